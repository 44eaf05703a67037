"""Streaming DiLoCo as a user runs it: `diloco server --mode streaming` and worker processes."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from test_e2e_sync import simulated_run

from processes import global_weights, start_worker, wait_all

STREAMING = ("--mode", "streaming", "--sync-every", "4", "--fragments", "2")


def simulated_streaming(
    corpus: bytes, workers: int, steps: int, delay: int, alpha: float, **codecs: str
):
    return simulated_run(
        corpus, workers, steps, mode="streaming", fragments=2, delay=delay, alpha=alpha, **codecs
    )


def test_streaming_through_the_real_server_matches_the_simulator(
    server_process, corpus_file: Path, small_corpus: bytes, tmp_path: Path
) -> None:
    """Two worker processes, P = 2, tau = 1, alpha = 0.5: every fragment round over HTTP
    (sent from a background thread while training goes on) equals the simulator's."""
    server = server_process(*STREAMING, "--delay", "1", "--alpha", "0.5", "--min-workers", "2")
    workers = [start_worker(server.url, f"w{i}", i, 2, 11, corpus_file, tmp_path) for i in range(2)]
    wait_all(workers)
    for i, worker in enumerate(workers):
        assert worker.returncode == 0, (tmp_path / f"w{i}.log").read_text()
    real, version = global_weights(server.url)
    simulated = simulated_streaming(small_corpus, workers=2, steps=11, delay=1, alpha=0.5)
    # Windows of S = 2: fragment 0 is sent at steps 1, 5, 9 (merged at 2, 6, 10), fragment 1
    # at 3, 7, 11 (merged at 4, 8, and at the end); with alpha > 0 every merge leaves some
    # local residue, so the final flush syncs both once more: 4 + 4 outer steps.
    assert simulated.outer_steps == 8 and version == 8
    for name, tensor in simulated.final_state.items():
        torch.testing.assert_close(real[name], tensor, rtol=1e-5, atol=1e-6, msg=name)
    reports = [json.loads((tmp_path / f"w{i}.json").read_text()) for i in range(2)]
    for report in reports:
        assert report["mode"] == "streaming"
        assert report["rounds"] == 8 and report["fragment_rounds"] == [4, 4]
        assert report["fragment_failures"] == 0
    # Both workers end on the global model.
    assert reports[0]["final_eval_loss"] == reports[1]["final_eval_loss"]
