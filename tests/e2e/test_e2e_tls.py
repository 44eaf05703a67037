"""TLS as a user runs it: `diloco server` over HTTPS with a self-signed certificate made in
the test, `diloco worker` processes that trust it through --ca-file (and enroll with a token
from a file or the environment), and a worker that was not told to trust it: one clear line."""

from __future__ import annotations

import json
import os
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

from diloco.worker import DiLoCoClient, RetryPolicy
from processes import run_cli_in_process, self_signed_certificate

ENROLL = "enroll-token-0123456789"
TOKEN_ENV = {"DILOCO_TOKEN": ENROLL}


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "diloco.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, **(env or {})},
    )


def one_error_line(result: subprocess.CompletedProcess, *needles: str) -> str:
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def test_https_with_a_trusted_and_an_untrusted_certificate(
    server_process, corpus_file: Path, tmp_path: Path, monkeypatch
) -> None:
    """A whole run over HTTPS (two `diloco worker` processes trusting the certificate through
    --ca-file, leased data, a token from a file) is tests/e2e/test_e2e_readme_recipe.py, the
    README's recipe; here the same server refuses what does not speak TLS properly."""
    cert, key = self_signed_certificate(tmp_path)
    token_file = tmp_path / "token"
    token_file.write_text(ENROLL + "\n")
    server = server_process(
        "--tls-cert", str(cert), "--tls-key", str(key), "--token-file", str(token_file),
        "--sync-every", "2",
    )  # fmt: skip
    url = server.url.replace("http://", "https://")
    with DiLoCoClient(url, ENROLL, ca_file=cert, retry=RetryPolicy(attempts=2)) as client:
        assert client.status()["round"] == 0  # a client that trusts the certificate is served

    # The server's own protocol (the JSON 400 for bytes that are not HTTP) under TLS.
    port = urlsplit(url).port
    context = ssl.create_default_context(cafile=str(cert))
    with (
        socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
        context.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
    ):
        tls.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        answer = b""
        while chunk := tls.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400"), answer
    assert json.loads(body)["kind"] == "malformed_http"

    # Without --ca-file the certificate is not trusted: one line naming the URL and the fix,
    # at once (retrying cannot help).
    started = time.monotonic()
    refused = run_cli(
        "worker", "--server", url, "--steps", "1", "--no-progress", "--corpus", str(corpus_file),
        "--token-file", str(token_file),
    )  # fmt: skip
    line = one_error_line(refused, f"could not join {url}", "not trusted", "--ca-file")
    assert f"TLS certificate of {url}" in line
    assert time.monotonic() - started < 60
    monkeypatch.setenv("DILOCO_TOKEN", ENROLL)  # `diloco status` in this process
    one_error_line(run_cli_in_process("status", url), "not trusted", "--ca-file")


def test_a_tls_server_with_an_idle_keep_alive_client_stops_at_once(
    server_process, tmp_path: Path
) -> None:
    """An open dashboard tab holds an idle TLS keep-alive connection: SIGTERM must close it
    and exit 0, not wait out the graceful-shutdown timeout for a TLS close the client never
    sends (uvicorn then logs 'timeout graceful shutdown exceeded')."""
    cert, key = self_signed_certificate(tmp_path)
    server = server_process("--tls-cert", str(cert), "--tls-key", str(key))
    port = urlsplit(server.url).port
    context = ssl.create_default_context(cafile=str(cert))
    raw = socket.create_connection(("127.0.0.1", port), timeout=10)
    with context.wrap_socket(raw, server_hostname="localhost") as tls:
        tls.sendall(b"GET /v1/info HTTP/1.1\r\nHost: localhost\r\n\r\n")
        answer = b""
        while b"\r\n\r\n" not in answer:
            answer += tls.recv(65536)
        assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
        server.process.terminate()  # the connection stays open, idle
        assert server.process.wait(timeout=30) == 0
    log = server.log.read_text()
    assert "graceful shutdown exceeded" not in log, log[-2000:]
