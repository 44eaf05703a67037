"""The first hour of a new user (issue 27): a wrong --server, a missing token, another model.

Each mistake ends in one line that says what to change, exit code 2 for a wrong URL and 1 for a
refusal, never a traceback. Servers are real `diloco server` processes on 127.0.0.1; the CLI
runs in this process (typer's runner) unless the test is about a real process.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from processes import run_cli_in_process, self_signed_certificate
from tiny import LLAMA, TINY_CLI, TINY_MODEL

TOKEN = "first-hour-token-0123"


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def last_line(result, code: int) -> str:
    """The one error line a user reads (retry warnings may come before it)."""
    assert result.returncode == code, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines and all(line.startswith("WARNING") for line in lines[:-1]), result.stderr
    return lines[-1]


def worker(url: str, corpus: Path, *extra: str):
    return run_cli_in_process(
        "worker", "--server", url, "--corpus", str(corpus), "--steps", "2", "--no-progress",
        *TINY_CLI, *extra,
    )  # fmt: skip


# -- item 4: a wrong address ends, with why --------------------------------------------------


def test_a_worker_that_never_reaches_a_server_gives_up_naming_the_url(
    corpus_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DILOCO_TOKEN", "")
    url = f"http://127.0.0.1:{closed_port()}"
    result = worker(url, corpus_file, "--give-up-after", "2")
    assert last_line(result, 2) == (
        f"error: no diloco server answered at {url} (connection refused) for 2 s: is it "
        "running? check --server"
    )


def test_a_worker_resuming_from_its_checkpoint_waits_out_a_server_that_is_down(
    tmp_path: Path,
) -> None:
    """It reached the server before (its checkpoint says so): the server is restarting, not
    a wrong address, so it retries for all of --give-up-after, not the first contact's 60 s."""
    from diloco.commands.work import FIRST_CONTACT_SECONDS, retry_policy

    saved = tmp_path / "w0-state"
    fresh = retry_policy(900.0, 30.0, saved)
    assert fresh.first_contact == FIRST_CONTACT_SECONDS == 60.0 and fresh.deadline == 900.0
    assert retry_policy(20.0, 30.0, None).first_contact == 20.0  # the shorter limit
    assert retry_policy(0.0, 30.0, None).first_contact is None  # 0: for ever
    (saved / "gen-000000000003").mkdir(parents=True)
    resumed = retry_policy(900.0, 30.0, saved)
    assert resumed.first_contact is None and resumed.deadline == 900.0
    (saved / "gen-000000000003").rmdir()
    (saved / "gen-000000000004.tmp-0123abcd").mkdir()  # a write that never finished
    assert retry_policy(900.0, 30.0, saved).first_contact == 60.0


def test_plain_http_to_a_tls_server_says_to_use_https_and_the_server_logs_it(
    server_process, corpus_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DILOCO_TOKEN", "")
    cert, key = self_signed_certificate(tmp_path)
    server = server_process("--tls-cert", str(cert), "--tls-key", str(key))
    url = server.url  # http://127.0.0.1:PORT, the mistake: the server speaks https
    assert url.startswith("http://")
    https = url.replace("http://", "https://")
    result = worker(url, corpus_file)  # no --give-up-after: it ends at once, not in 60 s
    assert last_line(result, 2) == (
        f"error: the server at {url} speaks TLS and dropped a plain-HTTP request: use --server "
        f"{https}"
    )
    status = run_cli_in_process("status", url)
    assert last_line(status, 2) == (
        f"error: cannot read the status of {url}: the server at {url} speaks TLS and dropped a "
        f"plain-HTTP request: use {https}"
    )
    logged = [line for line in server.log.read_text().splitlines() if "plain-HTTP" in line]
    assert len(logged) == 2, logged  # one line for each dropped request
    assert logged[0].endswith(
        "WARNING diloco.server: a plain-HTTP request came to this TLS port and was dropped: its "
        "client must use an https:// URL"
    )


# -- item 5c: a URL without its scheme --------------------------------------------------------


@pytest.mark.parametrize(
    ("command", "line"),
    [
        (
            ["worker", "--server", "127.0.0.1:8471"],
            "error: --server must start with http:// or https://, got '127.0.0.1:8471'; e.g. "
            "--server http://127.0.0.1:8471",
        ),
        (
            ["status", "127.0.0.1:8471"],
            "error: URL must start with http:// or https://, got '127.0.0.1:8471'; e.g. "
            "http://127.0.0.1:8471",
        ),
        (
            ["admin", "pause", "localhost:8471"],
            "error: URL must start with http:// or https://, got 'localhost:8471'; e.g. "
            "http://localhost:8471",
        ),
        (
            ["status", "http://user:pw@127.0.0.1:8471"],
            "error: URL must not carry credentials; pass --token-file instead: "
            "'http://user:pw@127.0.0.1:8471'",
        ),
    ],
    ids=["worker", "status", "admin", "credentials"],
)
def test_a_server_url_without_its_scheme_names_the_option_and_the_fix(
    command: list[str], line: str
) -> None:
    assert last_line(run_cli_in_process(*command), 2) == line  # nothing is contacted


# -- item 5b: no token, or a wrong one --------------------------------------------------------


def test_a_missing_or_wrong_token_says_how_to_give_one(
    server_process, corpus_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DILOCO_TOKEN", "")
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    url = server_process("--token-file", str(token_file)).url
    needs = "the server needs a token: pass --token-file FILE or set the DILOCO_TOKEN environment"
    unauthorized = "401 unauthorized: missing or wrong bearer token"
    assert last_line(worker(url, corpus_file), 1) == (
        f"error: could not join {url}: {unauthorized} ({url}/v1/info); {needs} variable"
    )
    assert last_line(run_cli_in_process("status", url), 1) == (
        f"error: cannot read the status of {url}: {unauthorized} ({url}/v1/status); {needs} "
        "variable"
    )
    assert last_line(run_cli_in_process("admin", "pause", url), 1) == (
        f"error: {url}: {unauthorized} ({url}/v1/admin/pause); the server needs an admin token: "
        "pass --token-file FILE or set the DILOCO_TOKEN environment variable"
    )
    monkeypatch.setenv("DILOCO_TOKEN", "not-the-token")
    assert last_line(run_cli_in_process("status", url), 1) == (
        f"error: cannot read the status of {url}: {unauthorized} ({url}/v1/status); the server "
        "refused the token given: check --token-file (or DILOCO_TOKEN) against the server's"
    )


# -- item 5a: another model than the run's ----------------------------------------------------


def test_a_worker_with_another_model_hears_which_side_has_what(
    server_process, corpus_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("transformers")
    from diloco.models.causal_lm import CausalLMConfig

    monkeypatch.setenv("DILOCO_TOKEN", "")
    gpt = TINY_MODEL.build()  # the run starts with the bundled GPT's weights
    init = tmp_path / "gpt.safetensors"
    save_file({name: t.contiguous() for name, t in gpt.state_dict().items()}, str(init))
    url = server_process("--init", str(init)).url
    config = tmp_path / "llama.json"
    config.write_text(json.dumps(LLAMA))
    llama = CausalLMConfig.from_file(config).build()

    def size(model: torch.nn.Module) -> str:
        parameters = sum(p.numel() for p in model.parameters())
        return f"{parameters:,} parameters in {len(model.state_dict())} tensors"

    first = min(gpt.state_dict())  # the first name, sorted, and the llama has none of them
    shape = list(gpt.state_dict()[first].shape)
    result = worker(url, corpus_file, "--model-config", str(config))
    assert last_line(result, 1) == (
        f"error: could not join {url}: 422 fingerprint_mismatch: this server's run was started "
        f"with another model ({size(gpt)}) than this worker's ({size(llama)}); first "
        f"difference: tensor '{first}' is missing; the run's model has it with shape {shape} "
        f"and dtype float32 ({url}/v1/workers); start this worker with the run's model (the "
        "same --model-config, or --width, --depth and --heads), or start the server on a new "
        "--state-dir for a new run"
    )
