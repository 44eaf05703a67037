"""TLS on the worker side: a CA file checked before any request, a refused certificate told
apart from other handshake failures (it needs --ca-file, not patience), and a TLS server told
apart from a plain-HTTP one (an http:// URL that needs https://)."""

from __future__ import annotations

import os
import socket
import ssl
from collections.abc import Iterator


def exception_chain(exc: BaseException) -> Iterator[BaseException]:
    """`exc`, then what it wraps: its cause, context and exception arguments, each once (urllib3
    keeps the socket's error in one or another of them)."""
    seen: set[int] = set()
    pending: list[object] = [exc]
    while pending:
        error = pending.pop(0)
        if not isinstance(error, BaseException) or id(error) in seen:
            continue
        seen.add(id(error))
        yield error
        pending.extend([error.__cause__, error.__context__, *error.args])


def certificate_problem(exc: BaseException) -> str | None:
    """The verification message when `exc` is a refused server certificate, else None."""
    for error in exception_chain(exc):
        if isinstance(error, ssl.SSLCertVerificationError):
            return str(error.verify_message or error.reason or error)
    return None


def check_ca_file(ca_file: str | os.PathLike[str]) -> None:
    """ValueError unless `ca_file` loads as PEM certificates (checked before any request)."""
    try:
        ssl.create_default_context(cafile=os.fspath(ca_file))
    except FileNotFoundError:
        raise ValueError(f"ca_file {ca_file} does not exist") from None
    except (ssl.SSLError, OSError) as exc:
        reason = getattr(exc, "reason", None) or getattr(exc, "strerror", None) or exc
        raise ValueError(
            f"ca_file {ca_file} is not a readable PEM certificate ({reason})"
        ) from None


def speaks_tls(host: str, port: int, timeout: float) -> bool:
    """Whether a TLS handshake with host:port completes. The certificate is not checked: this
    only tells a TLS server (an http:// request it drops needs https://) from another."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        with (
            socket.create_connection((host, port), timeout=timeout) as raw,
            context.wrap_socket(raw),
        ):
            return True
    except (OSError, ValueError):  # ssl.SSLError is an OSError
        return False
