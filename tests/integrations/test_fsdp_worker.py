"""examples/fsdp_worker.py: a 2-rank FSDP2 worker, a 2-rank DDP worker and a one-process
worker of the same model, seed and global batches end on the same global weights.

Each run is its own `diloco server` process with that one worker; the weights agree to
float rounding (the ranks sum their halves' gradients in another order than one process).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if not hasattr(pytest.importorskip("torch.distributed.fsdp"), "fully_shard"):
    pytest.skip("FSDP2 (fully_shard) needs torch >= 2.6", allow_module_level=True)

from example_runs import EXAMPLES

from processes import global_weights

SMALL = ("--steps", "6", "--batch-size", "4", "--seq-len", "33", "--width", "21", "--heads", "3")


def run_example(url: str, wrap: str, out: Path) -> dict:
    """The example with `wrap` (fsdp and ddp: 2 ranks under torchrun); rank 0's figures."""
    launcher = [sys.executable]
    if wrap != "none":
        launcher += ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    report = out / f"{wrap}.json"
    result = subprocess.run(
        [*launcher, str(EXAMPLES / "fsdp_worker.py"), "--server", url, "--wrap", wrap,
         "--worker-id", wrap, "--json", str(report), "--state", *SMALL],
        capture_output=True, text=True, timeout=240, check=False,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(report.read_text())


# Both modes in `make test-slow` (about 20 s each): the default suite's FSDP samples are in
# tests/worker/test_worker_fsdp.py (a group against plain SGD written out by hand).
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_fsdp_ddp_and_one_process_end_on_the_same_global_weights(
    server_process, tmp_path: Path, mode: str
) -> None:
    """H = 3, 6 steps: 2 rounds (async: 2 versions) with the default outer Nesterov."""
    figures, weights = {}, {}
    for wrap in ("none", "fsdp", "ddp"):
        server = server_process("--mode", mode, "--sync-every", "3")
        figures[wrap] = run_example(server.url, wrap, tmp_path)
        weights[wrap], round_number = global_weights(server.url)
        assert round_number == 2 and figures[wrap]["worker"]["rounds"] == 2
        assert figures[wrap]["ranks"] == (1 if wrap == "none" else 2)
        # after the last round every rank's model is the global one (rank 0 gathered it)
        for name, value in figures[wrap]["state"].items():
            torch.testing.assert_close(torch.tensor(value), weights[wrap][name], msg=name)
    one = figures["none"]
    assert one["final_eval_loss"] < one["initial_eval_loss"] - 0.3  # the weights did move
    for wrap in ("fsdp", "ddp"):
        assert weights[wrap].keys() == weights["none"].keys()
        for name, value in weights["none"].items():
            torch.testing.assert_close(weights[wrap][name], value, rtol=1e-5, atol=1e-5,
                                       msg=f"{wrap} {name}")  # fmt: skip
        assert figures[wrap]["final_eval_loss"] == pytest.approx(one["final_eval_loss"], abs=1e-4)
