"""A torchrun process group is one worker: rank 0 talks, every rank ends on the same weights."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from diloco.server.settings import ServerSettings
from diloco.wire import decode_tensors
from diloco.worker import DiLoCoClient

SCRIPT = Path(__file__).with_name("ddp_worker_script.py")


def torchrun(url: str, token: str, steps: int) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(SCRIPT),
            url,
            token,
            str(steps),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )


# sync in the slow suite: tests/integrations/test_fsdp_worker.py runs a DDP group (and FSDP)
# against one process in the default one
@pytest.mark.parametrize("mode", [pytest.param("sync", marks=pytest.mark.slow), "streaming"])
def test_ddp_group_is_one_worker_and_ranks_agree(live_server, mode: str) -> None:
    """Streaming (P = 2 over weight and bias, alpha 0.5): rank 0 syncs each fragment, every
    rank merges the broadcast G' into its own local values; 6 steps are fragment syncs at
    1..6, and the final flush syncs both fragments (alpha > 0): 8 outer steps."""
    if mode == "sync":
        settings = ServerSettings(sync_every=2, outer_optimizer="sgd", outer_lr=1.0)
    else:
        settings = ServerSettings(
            mode="streaming", sync_every=2, fragments=2, alpha=0.5, outer_optimizer="sgd",
            outer_lr=1.0,
        )  # fmt: skip
    with live_server(settings, token="s3cret") as server:
        result = torchrun(server.url, "s3cret", steps=6)
        assert result.returncode == 0, result.stderr[-3000:]
        lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
        assert sorted(line["rank"] for line in lines) == [0, 1]
        expected = 3 if mode == "sync" else 8
        assert all(line["rounds"] == expected for line in lines)
        assert lines[0]["state"] == lines[1]["state"]
        status = server.coordinator.status()
        assert [w["worker_id"] for w in status["workers"]] == ["group"]
        assert status["round"] == expected
        with DiLoCoClient(server.url, "s3cret") as client:
            body, _ = client.get_weights()
        weights = decode_tensors(body)
        for name, values in lines[0]["state"].items():
            torch.testing.assert_close(weights[name], torch.tensor(values))


def test_an_error_on_rank_0_reaches_every_rank(live_server) -> None:
    with live_server(ServerSettings(sync_every=2), token="right") as server:
        result = torchrun(server.url, "wrong", steps=2)
    assert result.returncode != 0
    assert "AuthError" in result.stderr or "401" in result.stderr
    assert "rank 0 of the DiLoCo worker failed" in result.stderr  # the follower was told
