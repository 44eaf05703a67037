"""Compressed uploads as a user runs them: `diloco server --upload-codec` and worker processes.

The real system (workers code their pseudo-gradients with error feedback, the server decodes
them piece by piece from its spool) must end where `diloco simulate` with the same codec does,
and the workers must have moved the bytes the codec promises.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from test_e2e_async import async_config, replay_arrivals
from test_e2e_sync import simulated_run

from diloco.checkpoints import CheckpointStore
from diloco.sim import simulate
from processes import global_weights, start_worker, wait_all

STREAMING = ("--mode", "streaming", "--fragments", "2", "--delay", "1", "--alpha", "0.5")


# The plain mean's four with -m slow (each is ~10-25 s of two worker processes); the default
# suite's sample of the fidelity is the int8 delta-download test below, also compared with the
# simulator.
# The default suite runs SparseLoCo's mean over senders (--aggregation sparse_mean), whose
# server side (senders counted as each body folds) has no other real-process test.
CASES = [
    pytest.param("topk:0.03+int2", "sync", "mean", marks=pytest.mark.slow),
    pytest.param("int8", "sync", "mean", marks=pytest.mark.slow),
    pytest.param("int8", "streaming", "mean", marks=pytest.mark.slow),
    pytest.param("topk:0.03+int2", "streaming", "mean", marks=pytest.mark.slow),
    pytest.param("topk:0.03+int2", "sync", "sparse_mean"),
    pytest.param("topk:0.03+int2", "streaming", "sparse_mean", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("codec", "mode", "aggregation"), CASES)
def test_compressed_uploads_through_the_real_server_match_the_simulator(
    server_process,
    corpus_file: Path,
    small_corpus: bytes,
    tmp_path: Path,
    codec: str,
    mode: str,
    aggregation: str,
) -> None:
    options = ("--upload-codec", codec, "--codec-block", "64", "--topk-chunk", "64")
    mode_options = STREAMING if mode == "streaming" else ()
    server = server_process(
        *options, *mode_options, "--aggregation", aggregation, "--sync-every", "4",
        "--min-workers", "2",
    )  # fmt: skip
    workers = [start_worker(server.url, f"w{i}", i, 2, 10, corpus_file, tmp_path) for i in range(2)]
    wait_all(workers)
    for i, worker in enumerate(workers):
        assert worker.returncode == 0, (tmp_path / f"w{i}.log").read_text()
    real, _ = global_weights(server.url)

    sim_mode = {"sync": {}, "streaming": dict(mode="streaming", fragments=2, delay=1, alpha=0.5)}
    simulated = simulated_run(
        small_corpus,
        workers=2,
        steps=10,
        upload_codec=codec,
        codec_block=64,
        topk_chunk=64,
        aggregation=aggregation,
        **sim_mode[mode],
    )
    for name, tensor in simulated.final_state.items():
        torch.testing.assert_close(real[name], tensor, rtol=1e-5, atol=1e-6, msg=name)
    reports = [json.loads((tmp_path / f"w{i}.json").read_text()) for i in range(2)]
    assert reports[0]["final_eval_loss"] == pytest.approx(simulated.final_eval_loss, rel=1e-5)
    for report in reports:
        assert report["rounds"] >= 3


@pytest.mark.parametrize(
    ("codec", "mode_options"),
    [
        ("int8", ()),
        pytest.param("topk:0.03+int2", STREAMING, marks=pytest.mark.slow),
    ],
    ids=["int8-sync", "topk-int2-streaming"],
)
def test_delta_downloads_keep_every_anchor_bit_identical_to_the_published_weights(
    server_process,
    corpus_file: Path,
    small_corpus: bytes,
    tmp_path: Path,
    codec: str,
    mode_options: tuple,
) -> None:
    """--download-codec: each result is a coded delta against the weights every worker holds;
    at the end each worker's anchor (in its checkpoint) equals the server's published weights
    bit for bit, those equal what `diloco simulate --download-codec` ends on, and the
    downloads were a fraction of full fp32 weights."""
    options = ("--upload-codec", codec, "--download-codec", codec, "--sync-every", "4")
    server = server_process(*options, *mode_options, "--min-workers", "2")
    workers = [
        start_worker(
            server.url,
            f"w{i}",
            i,
            2,
            12,
            corpus_file,
            tmp_path,
            extra=("--checkpoint-dir", str(tmp_path / f"ckpt{i}")),
        )
        for i in range(2)
    ]
    wait_all(workers)
    for i, worker in enumerate(workers):
        assert worker.returncode == 0, (tmp_path / f"w{i}.log").read_text()
    published, _ = global_weights(server.url)
    full = sum(t.numel() * t.element_size() for t in published.values())
    for i in range(2):
        saved = CheckpointStore(tmp_path / f"ckpt{i}").load_latest()
        assert saved is not None
        anchor = saved.tensors["anchor"]
        assert anchor.keys() == published.keys()
        for name, tensor in published.items():
            assert torch.equal(anchor[name], tensor), name
        report = json.loads((tmp_path / f"w{i}.json").read_text())
        rounds = report["rounds"]
        assert rounds >= 3
        # One full download to join; every round after that a delta.
        assert report["bytes_received"] < full + rounds * full / 3
    sim_mode = dict(mode="streaming", fragments=2, delay=1, alpha=0.5) if mode_options else {}
    simulated = simulated_run(
        small_corpus, workers=2, steps=12, upload_codec=codec, download_codec=codec, **sim_mode
    )
    for name, tensor in simulated.final_state.items():
        torch.testing.assert_close(published[name], tensor, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.slow
@pytest.mark.skipif(
    not any(shutil.which(cxx) for cxx in ("c++", "g++", "clang++")),
    reason="the fused kernels compile C++: no compiler here",
)
def test_the_fused_int8_kernels_end_bit_for_bit_where_the_eager_code_does(
    server_process, corpus_file: Path, tmp_path: Path
) -> None:
    """DILOCO_FUSED_INT8=1 (algorithm/compression/fused_int8.py) in a real server and two real
    workers, int8 both ways: each process compiled and probed the kernels it runs, and the
    published weights and both workers' anchors are bit for bit those of the same run coded
    eagerly."""
    options = ("--upload-codec", "int8", "--download-codec", "int8", "--sync-every", "4")
    published = {}
    for fused in ("0", "1"):
        out = tmp_path / f"fused{fused}"
        out.mkdir()
        env = {"DILOCO_FUSED_INT8": fused}
        server = server_process(*options, "--min-workers", "2", "--log-level", "info", env=env)
        workers = [
            start_worker(
                server.url, f"w{i}", i, 2, 12, corpus_file, out,
                extra=("--checkpoint-dir", str(out / f"ckpt{i}")), env=env,
            )
            for i in range(2)
        ]  # fmt: skip
        wait_all(workers)
        for i, worker in enumerate(workers):
            assert worker.returncode == 0, (out / f"w{i}.log").read_text()
        published[fused], _ = global_weights(server.url)
        for i in range(2):
            saved = CheckpointStore(out / f"ckpt{i}").load_latest()
            assert saved is not None
            for name, tensor in published[fused].items():
                assert torch.equal(saved.tensors["anchor"][name].view(torch.int32),
                                   tensor.view(torch.int32)), name  # fmt: skip
        logs = {"server": server.log.read_text()}
        logs |= {f"w{i}": (out / f"w{i}.log").read_text() for i in range(2)}
        ran = {"server": ("delta",), "w0": ("code_less", "add_decoded")}
        ran["w1"] = ran["w0"]  # (a worker's encode and apply; the server's delta)
        for process, kernels in ran.items():
            for kernel in kernels:
                first = f"fused int8 kernel {kernel} coded its first piece"
                assert (first in logs[process]) == (fused == "1"), (process, kernel)
            assert "coding eagerly" not in logs[process]
    assert published["1"].keys() == published["0"].keys()
    for name, tensor in published["1"].items():
        assert torch.equal(tensor.view(torch.int32), published["0"][name].view(torch.int32)), name


@pytest.mark.slow
def test_async_compressed_arrivals_match_the_simulator_and_deltas_reach_the_last_arrival(
    server_process, small_corpus: bytes
) -> None:
    """Async mode, the simulator's arrivals replayed by two in-process DiLoCoWorkers: int8
    uploads with error feedback end where the simulator does; with int8 delta downloads too,
    the worker that arrived last holds the server's published weights bit for bit."""
    config = async_config(upload_codec="int8", codec_block=64, error_feedback_beta=0.95)
    simulated = simulate(config, corpus=small_corpus)
    arrivals = [(w, n) for w, n, _ in simulated.arrivals]
    for download in ("fp32", "int8"):
        server = server_process(
            "--mode",
            "async",
            "--sync-every",
            "4",
            "--dn-period",
            "2",
            "--upload-codec",
            "int8",
            "--codec-block",
            "64",
            "--download-codec",
            download,
            "--error-feedback-beta",
            "0.95",
        )
        workers = replay_arrivals(server.url, config, simulated, small_corpus)
        last = workers[arrivals[-1][0]]
        anchor = {n: t.clone() for n, t in last.anchor.items()}
        for worker in workers:
            worker.close(final_sync=False)
        real, version = global_weights(server.url)
        assert version == len(arrivals)
        if download == "fp32":
            for name, tensor in simulated.final_state.items():
                torch.testing.assert_close(real[name], tensor, rtol=1e-5, atol=1e-6, msg=name)
        else:  # the published weights, which the last arrival's delta brought to its anchor
            for name, tensor in real.items():
                assert torch.equal(anchor[name], tensor), name
            coded = simulate(replace(config, download_codec="int8"), corpus=small_corpus)
            assert [(w, n) for w, n, _ in coded.arrivals] == arrivals
            for name, tensor in coded.final_state.items():
                torch.testing.assert_close(real[name], tensor, rtol=1e-5, atol=1e-6, msg=name)
