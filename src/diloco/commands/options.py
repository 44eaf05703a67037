"""Options shared by several commands, so each is spelled and documented once."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import typer

from diloco.console import fail, warn
from diloco.worker import (
    AuthError,
    DiLoCoClient,
    RetryPolicy,
    ServerError,
    ServerUnavailable,
    ServerUnreachable,
)
from diloco.worker.net import tls
from diloco.worker.net.auth import TOKEN_ENV
from diloco.worker.net.transport import split_base_url

Client = TypeVar("Client", bound=DiLoCoClient)

CORPUS_HELP = "'shakespeare' (default, fetched once into a cache), 'generated[:SEED]', or a path"
# --dtype of the commands that train (training.py::autocast_dtype_of)
DTYPE_HELP = "fp32, or bf16: forward passes under autocast (weights stay fp32)."
# The outer settings follow the upload codec when not given (algorithm/recipes.py).
OUTER_OPTIMIZER_HELP = (
    "sgd, momentum or nesterov. Default: follows --upload-codec: sgd for a top-k codec "
    "(SparseLoCo: its error feedback stands in for momentum), else nesterov (mode async: "
    "Delayed Nesterov whatever the codec)."
)
OUTER_LR_HELP = "Outer learning rate. Default: follows --upload-codec: 1.0 for top-k, else 0.7."
OUTER_MOMENTUM_HELP = "Outer momentum (default 0.9 for momentum and nesterov, 0 for sgd)."
ERROR_FEEDBACK_HELP = (
    "Each worker keeps what compression left out: e = beta e + g, send C(e), e -= D(C(e)); "
    "in [0, 1), 0: off. Default: 0 for bf16 and int8, else 0.95 (no effect with fp32)."
)

# --help panels (typer's rich_help_panel) that several commands share.
AUTH_PANEL = "Auth and TLS"
DATA_PANEL = "Data"
MODEL_PANEL = "Model and inner optimizer"
CODEC_PANEL = "Codecs"
STREAMING_PANEL = "Streaming mode"
ASYNC_PANEL = "Async mode"
DURABILITY_PANEL = "Durability"
NETWORK_PANEL = "Network"
OUTPUTS_PANEL = "Outputs"

TokenOption = typer.Option(
    None,
    help="The enrollment token. Shows in `ps` to every user of the machine: prefer "
    f"--token-file or the {TOKEN_ENV} environment variable.",
    rich_help_panel=AUTH_PANEL,
)
TokenFileOption = typer.Option(
    None,
    help=f"File whose first line is the enrollment token (else ${TOKEN_ENV}, if set).",
    rich_help_panel=AUTH_PANEL,
)
CaFileOption = typer.Option(
    None,
    help="PEM file of the certificate (or its CA) that an https:// server presents, when "
    "the system does not trust it (a self-signed certificate).",
    rich_help_panel=AUTH_PANEL,
)


def read_token(token: str | None, token_file: Path | None) -> str | None:
    """--token-file (its first line), else --token (with a warning), else $DILOCO_TOKEN."""
    if token and token_file:
        raise fail("give --token or --token-file, not both")
    if token:
        warn(
            "--token shows in `ps` and in shell history to other users of this machine; "
            f"use --token-file or the {TOKEN_ENV} environment variable"
        )
        return token
    if token_file is None:
        return os.environ.get(TOKEN_ENV, "").strip() or None
    try:
        text = token_file.read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        reason = getattr(exc, "strerror", None) or "not UTF-8 text"
        raise fail(f"--token-file {token_file} cannot be read ({reason})") from None
    if not text:
        raise fail(f"--token-file {token_file} is empty")
    return text.splitlines()[0].strip()


def check_ca_file(ca_file: Path | None) -> None:
    """--ca-file must load as PEM certificates: one error line now, not a failed handshake."""
    if ca_file is None:
        return
    try:
        tls.check_ca_file(ca_file)
    except ValueError as exc:
        raise fail(str(exc).replace("ca_file", "--ca-file", 1)) from None


def check_server_url(url: str, name: str) -> None:
    """A server URL as a user gave it (`name`: "--server", "URL"): one error line naming it,
    with the URL they likely meant when the scheme is missing ("127.0.0.1:8470")."""
    try:
        split_base_url(url)
    except ValueError as exc:
        message = str(exc).replace("base_url", name, 1).replace("token=", "--token-file", 1)
        if isinstance(url, str) and "://" not in url and url.strip():
            message += f"; e.g. {name + ' ' if name.startswith('-') else ''}http://{url.strip()}"
        raise fail(message) from None


def refusal(exc: BaseException, sent_token: bool, token: str = "token") -> str:
    """`exc` as a user reads it, with what to do about a 401 (`sent_token`: whether a token
    was given; `token` names the one needed, "admin token")."""
    if not isinstance(exc, AuthError):
        return str(exc)
    if sent_token:
        return (
            f"{exc}; the server refused the {token} given: check --token-file (or {TOKEN_ENV}) "
            f"against the server's"
        )
    article = "an" if token[:1] in "aeiou" else "a"
    return (
        f"{exc}; the server needs {article} {token}: pass --token-file FILE or set the "
        f"{TOKEN_ENV} environment variable"
    )


def require_positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise fail(f"{name} must be a positive integer, got {value}")


@contextmanager
def server_client(
    kind: type[Client],
    url: str,
    token: str | None,
    token_file: Path | None,
    ca_file: Path | None,
    *,
    attempts: int,
    read_timeout: float,
    failure: str,
    token_name: str = "token",
) -> Iterator[Client]:
    """A client of `kind` for a command that calls a server (`diloco status`, `diloco admin`):
    a bad token file, CA file or URL exits 2; a call that the server refuses or that cannot
    reach it exits 1 with `failure` (formatted with `url`) and the reason, no traceback (2
    when no server ever answered at `url`: a wrong URL). `token_name` names the token a 401
    asks for."""
    check_server_url(url, "URL")
    secret = read_token(token, token_file)
    check_ca_file(ca_file)
    try:
        client = kind(
            url, secret, retry=RetryPolicy(attempts=attempts), read_timeout=read_timeout,
            ca_file=ca_file,
        )  # fmt: skip
    except ValueError as exc:
        raise fail(str(exc)) from None
    with client:
        try:
            yield client
        except ServerUnreachable as exc:
            raise fail(f"{failure.format(url=url)}: {exc}") from None
        except (ServerError, ServerUnavailable) as exc:
            message = refusal(exc, secret is not None, token_name)
            raise fail(f"{failure.format(url=url)}: {message}", code=1) from None
