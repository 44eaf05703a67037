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
from processes import process_group

SCRIPT = Path(__file__).with_name("ddp_worker_script.py")


def torchrun(
    url: str, token: str, steps: int, wrap: str = "ddp", real: bool = False
) -> subprocess.CompletedProcess:
    """The script as a 2-rank group: under torchrun itself (`real`: the group test below, as
    users launch it), or started as torchrun starts its ranks (tests/processes.py)."""
    args = [str(SCRIPT), url, token, str(steps), wrap]
    if not real:
        return process_group(args, ranks=2)
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    return subprocess.run(
        [sys.executable, *launcher, *args], capture_output=True, text=True, timeout=180,
        check=False,
    )  # fmt: skip


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
        result = torchrun(server.url, "s3cret", steps=6, real=True)
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


def test_ranks_that_train_apart_are_stopped_on_every_rank_at_the_first_sync(live_server) -> None:
    """Without DDP each rank steps on its own batches: after H = 2 steps the ranks hold other
    weights, and rather than send rank 0's work alone every rank raises, naming a tensor;
    nothing reaches the server."""
    with live_server(ServerSettings(sync_every=2), token="s3cret") as server:
        result = torchrun(server.url, "s3cret", steps=6, wrap="none")
        assert result.returncode != 0
        assert server.coordinator.status()["round"] == 0
    stopped = [line for line in result.stderr.splitlines() if "ReplicasDiffer:" in line]
    assert sorted(line[:7] for line in stopped) == ["[rank0]", "[rank1]"], result.stderr[-3000:]
    assert all("different weights after local step 2 (first: 'bias')" in s for s in stopped)


def test_a_ddp_group_under_token_weighting_reports_every_rank_s_tokens(live_server) -> None:
    """--weighting tokens and no report(tokens=...): each rank counts its own training
    forwards (the script's batches are 8 float rows: 8 each), and rank 0 sent only its own,
    half the group's. By hand: 2 ranks x 2 steps x 8 = 32 tokens for the round of H = 2."""
    settings = ServerSettings(sync_every=2, weighting="tokens", outer_optimizer="sgd", outer_lr=1.0)
    with live_server(settings, token="s3cret") as server:
        result = torchrun(server.url, "s3cret", steps=2)
        assert result.returncode == 0, result.stderr[-3000:]
        assert server.coordinator.round_number == 1
        assert server.coordinator.last_commit.tokens == 2 * 2 * 8
