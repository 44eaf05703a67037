"""A worker's credential as a user meets it: `diloco worker` processes enroll with the token
from the environment, keep the credential they were issued in their --checkpoint-dir, go on
with it alone when resumed, and enroll again on a server that never issued it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from diloco.worker import DiLoCoClient, RetryPolicy
from processes import start_worker, wait_all

ENROLL = "enroll-token-0123456789"
TOKEN_ENV = {"DILOCO_TOKEN": ENROLL}


@pytest.mark.slow  # in `make test-slow`; the default suite keeps a sample
def test_a_resumed_worker_keeps_its_credential_and_enrolls_again_where_it_is_unknown(
    server_process, corpus_file: Path, tmp_path: Path
) -> None:
    token = TOKEN_ENV
    first = server_process("--sync-every", "2", "--state-dir", str(tmp_path / "state"), env=token)
    checkpoints = tmp_path / "w0-state"
    resumable = ("--checkpoint-dir", str(checkpoints))

    def run(url: str, steps: int, env: dict[str, str], name: str) -> dict:
        out = tmp_path / name
        out.mkdir()
        worker = start_worker(url, "w0", 0, 1, steps, corpus_file, out, extra=resumable, env=env)
        wait_all([worker])
        assert worker.returncode == 0, (out / "w0.log").read_text()
        return json.loads((out / "w0.json").read_text())

    def saved_credential() -> str:
        newest = max(checkpoints.glob("gen-*"), key=lambda p: int(p.name.split("-")[1]))
        (manifest,) = newest.glob("*.json")
        return json.loads(manifest.read_text())["metadata"]["worker"]["extra"]["credential"]

    run(first.url, 2, token, "enrolled")
    credential = saved_credential()
    # No token at all this time: the checkpoint's credential is the worker's identity.
    assert run(first.url, 4, {"DILOCO_TOKEN": ""}, "resumed")["resumed_at_step"] == 2
    assert saved_credential() == credential

    # A new server that never issued it answers 401; the worker enrolls again with the token.
    fresh = server_process("--sync-every", "2", env=token)
    assert run(fresh.url, 6, token, "fresh")["resumed_at_step"] == 4
    assert saved_credential() != credential
    with DiLoCoClient(fresh.url, ENROLL, retry=RetryPolicy(attempts=2)) as client:
        (worker,) = client.status()["workers"]
    assert (worker["worker_id"], worker["rounds_contributed"]) == ("w0", 1)
