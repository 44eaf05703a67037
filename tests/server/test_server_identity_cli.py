"""Tokens, tokens files and TLS files on the command line: each bad one is exit code 2 and
one `error:` line before anything listens; `--token` works but warns that `ps` shows it."""

from __future__ import annotations

from pathlib import Path

import pytest

from processes import run_all, run_each_in_process

ENROLL = "enroll-token-0123456789"


@pytest.mark.parametrize(
    "part",
    [
        pytest.param("in-process", id="in-process"),  # every case, through typer's runner
        pytest.param("one-process", id="one-process"),  # a real process
        pytest.param("processes", id="processes", marks=pytest.mark.slow),  # every case
    ],
)
def test_bad_tokens_and_tls_files_exit_2_with_one_error_line(tmp_path: Path, part: str) -> None:
    def write(name: str, content: str | bytes) -> str:
        path = tmp_path / name
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)
        return str(path)

    pem = write("not-a-cert.pem", "-----BEGIN CERTIFICATE-----\nnonsense\n")
    missing = str(tmp_path / "missing")
    server = ["server", "--host", "127.0.0.1", "--port", "0"]
    cases = {
        "missing tokens file": (["--tokens-file", missing], "--tokens-file", "cannot be read"),
        "tokens file is a directory": (["--tokens-file", str(tmp_path)], "cannot be read", ""),
        "tokens file not text": (["--tokens-file", write("bin", b"\xff\xfe\x00")], "cannot", ""),
        "one field": (
            ["--tokens-file", write("one", f"# ok\n{ENROLL}\n")],
            "line 2: expected 'TOKEN SCOPE', got 1 field(s)",
            "",
        ),
        "unknown scope": (
            ["--tokens-file", write("scope", f"{ENROLL} root\n")],
            "line 1: unknown scope 'root' (expected admin, enroll, shard or worker:ID)",
            "",
        ),
        "bad worker id": (
            ["--tokens-file", write("id", f"{ENROLL} worker:-w\n")],
            "line 1: worker id '-w' is not a valid id",
            "",
        ),
        "short token": (
            ["--tokens-file", write("short", "tok admin\n")],
            "line 1: a token must be at least 16",
            "",
        ),
        "repeated token": (
            ["--tokens-file", write("twice", f"{ENROLL} enroll\n{ENROLL} admin\n")],
            "line 2: the same token as line 1",
            "",
        ),
        "no tokens": (["--tokens-file", write("empty", "# nothing\n")], "holds no tokens", ""),
        "two shard secrets": (
            ["--tokens-file", write("shards", f"{ENROLL} shard\n{ENROLL[::-1]} shard\n")],
            "lines 1 and 2: one 'shard' secret",
            "",
        ),
        "missing token file": (["--token-file", missing], "--token-file", "cannot be read"),
        "cert without key": (["--tls-cert", pem], "--tls-cert and --tls-key go together", ""),
        "key without cert": (["--tls-key", pem], "--tls-cert and --tls-key go together", ""),
        "missing cert": (["--tls-cert", missing, "--tls-key", pem], "--tls-cert file does not", ""),
        "not a certificate": (["--tls-cert", pem, "--tls-key", pem], "do not load as a PEM", ""),
    }
    worker = ["worker", "--server", "https://127.0.0.1:9", "--steps", "1", "--no-progress"]
    status = ["status", "https://127.0.0.1:9"]
    commands = {label: [*server, *args] for label, (args, *_) in cases.items()}
    commands["worker ca file missing"] = [*worker, "--ca-file", missing]
    commands["worker ca file not PEM"] = [*worker, "--ca-file", pem]
    commands["status ca file missing"] = [*status, "--ca-file", missing]
    needles = {label: needle for label, (_, *needle) in cases.items()}
    needles["worker ca file missing"] = ["--ca-file", "does not exist"]
    needles["worker ca file not PEM"] = ["--ca-file", "is not a readable PEM certificate"]
    needles["status ca file missing"] = ["--ca-file", "does not exist"]
    if part == "one-process":
        commands = dict(list(commands.items())[:1])
    in_process = part == "in-process"
    outcomes = (run_each_in_process if in_process else run_all)(commands)
    for label, (code, stdout, stderr) in outcomes.items():
        lines = [line for line in stderr.splitlines() if line.strip()]
        assert code == 2, (label, code, stderr)
        assert "Traceback" not in stderr and "Traceback" not in stdout, (label, stderr)
        assert len(lines) == 1 and lines[0].startswith("error: "), (label, stderr)
        for needle in needles[label]:
            assert needle in lines[0], (label, lines[0])
        assert ENROLL not in lines[0]  # a secret is never echoed


@pytest.mark.slow  # the token-file path stays in the default suite
def test_token_on_the_command_line_works_but_warns(server_process, tmp_path: Path) -> None:
    server = server_process("--token", ENROLL)
    warning = "--token shows in `ps`"
    assert warning in server.log.read_text()
    out = tmp_path / "status.json"
    given = {
        "--token": ["--token", ENROLL],
        "--token-file": ["--token-file", str(tmp_path / "token")],
        "environment": [],
    }
    (tmp_path / "token").write_text(ENROLL + "\n")
    commands = {
        how: ["status", server.url, *args, "--json", str(out.with_suffix(f".{i}"))]
        for i, (how, args) in enumerate(given.items())
    }
    outcomes = run_all(commands, {"environment": {"DILOCO_TOKEN": ENROLL}})
    for how, (code, _stdout, stderr) in outcomes.items():
        assert code == 0, (how, stderr)
        assert out.with_suffix(f".{list(given).index(how)}").exists()
        assert (warning in stderr) == (how == "--token"), (how, stderr)
        assert ENROLL not in stderr
    # Without any of the three: 401, one line.
    code, _stdout, stderr = run_all({"none": ["status", server.url]})["none"]
    assert code == 1 and "unauthorized" in stderr.splitlines()[-1], stderr
