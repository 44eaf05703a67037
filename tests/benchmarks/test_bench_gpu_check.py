"""The GPU check's parts stay runnable without a GPU: the codec comparison against the CPU
itself, and the whole script on the CPU at a tiny size (what an offline H100 runs, smaller)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from processes import BENCHMARKS, load_benchmark, run_benchmark, run_benchmark_in_process


@pytest.mark.slow  # the default suite runs its checks in process (below)
def test_the_codec_comparison_reports_every_codec_and_check(tmp_path: Path) -> None:
    result = run_benchmark(
        "codec_devices.py", "--device", "cpu", "--codecs", "int4,topk:0.03+int2",
        "--out-dir", str(tmp_path),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    rows = json.loads((tmp_path / "codec_devices.json").read_text())["results"]
    assert [row["codec"] for row in rows] == ["int4", "topk:0.03+int2"]
    for row in rows:  # the CPU against itself: a comparison that could not agree is broken
        assert row["plain_body_identical"] and row["error_feedback_identical"]
        assert row["delta_apply_identical"] and row["differing_tensors"] == []
        assert row["worker_bodies_identical"] and row["worker_residual_identical"]
        assert row["worker_anchor_identical"] and row["worker_rounds_identical"]
        assert row["worker_staged_identical"]
    # int4 packs two values a byte: well under an eighth of fp32's 4 bytes a value
    assert 0 < rows[0]["body_bytes"] < 4 * (1 << 24) / 4
    assert "| int4 |" in (tmp_path / "codec_devices.md").read_text()


def test_the_codec_comparison_names_what_differs(monkeypatch: pytest.MonkeyPatch) -> None:
    """A device that coded otherwise is caught: every second body (the device's, in each
    pair the comparison makes) comes back with its last byte changed."""
    module = load_benchmark("codec_devices.py")
    calls = []
    encode = module.encode_compressed

    def otherwise_every_second_time(*args, **kwargs):
        body = encode(*args, **kwargs)
        calls.append(None)
        if len(calls) % 2 == 0:
            body[-1] ^= 1
        return body

    monkeypatch.setattr(module, "encode_compressed", otherwise_every_second_time)
    row = module.compare("int8", __import__("torch").device("cpu"), seed=0)
    assert not row["plain_body_identical"] and not row["error_feedback_identical"]
    assert row["differing_tensors"] == list(module.awkward_tensors(0))


@pytest.mark.parametrize("drifting", [1, 2])
def test_the_worker_rounds_comparison_catches_a_residual_kept_otherwise(
    monkeypatch: pytest.MonkeyPatch, drifting: int
) -> None:
    """One worker keeps twice the residual it should after each body: the second (the
    device's) or the third (the device's, its bodies staged). Its later bodies, its residual
    and the anchor its deltas leave are reported as differing; the other agrees."""
    module = load_benchmark("codec_devices.py")
    made = []

    class Drifting(module.UploadCoder):
        def settle(self, folded: bool) -> None:
            super().settle(folded)
            if made.index(self) == drifting:
                self._residual["matrix"].mul_(2)

    def coder(*args, **kwargs):
        made.append(Drifting(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(module, "UploadCoder", coder)
    row = module.worker_rounds("int8", __import__("torch").device("cpu"), seed=0)
    unstaged = (
        row["worker_bodies_identical"],
        row["worker_residual_identical"],
        row["worker_anchor_identical"],
    )
    assert unstaged == ((True,) * 3 if drifting == 2 else (False,) * 3)
    assert row["worker_staged_identical"] == (drifting == 1)
    assert len(made) == 3 and made[2].stage_on_device and not made[1].stage_on_device


def test_the_gpu_check_without_its_dependencies_or_wheels_says_how_to_get_them(
    tmp_path: Path,
) -> None:
    python = tmp_path / "python"  # a Python whose imports all fail
    python.write_text("#!/bin/sh\nexit 1\n")
    python.chmod(0o755)
    result = subprocess.run(
        [str(BENCHMARKS / "gpu_check.sh"), str(tmp_path / "results")],
        env={**os.environ, "PYTHON": str(python), "DILOCO_WHEELS": str(tmp_path / "none")},
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 2, result.stdout + result.stderr
    assert "benchmarks/gpu_wheels.sh" in result.stderr and "holds no wheels" in result.stderr


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--device", "cuda"], "torch sees no CUDA device"),
        (["--device", "tpu!"], "--device must be a torch device"),
        (["--device", "cpu", "--codecs", "int3"], "--codecs: unknown codec 'int3'"),
    ],
)
def test_the_codec_comparison_refuses_bad_options_in_one_line(
    tmp_path: Path, args: list[str], needle: str
) -> None:
    if args == ["--device", "cuda"] and __import__("torch").cuda.is_available():
        pytest.skip("this machine has a GPU")
    result = run_benchmark_in_process("codec_devices.py", *args, "--out-dir", str(tmp_path))
    assert result.returncode == 2, result.stderr
    assert needle in result.stderr and "Traceback" not in result.stderr


@pytest.mark.slow  # a server and two workers per run (three runs), about 90 s
def test_the_gpu_check_runs_whole_on_the_cpu_at_a_tiny_size(tmp_path: Path) -> None:
    """Sync, then streaming at delay 1 and at delay 2 (GPU_CHECK_DELAYS: its own folder),
    then the demo and a streaming simulate under bf16 autocast (step 3)."""
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "OMP_NUM_THREADS": "1",
        "GPU_CHECK_DEVICE": "cpu",
        "GPU_CHECK_SIZE": "2M",
        "GPU_CHECK_BATCH": "1",
        "GPU_CHECK_CONTEXT": "16",
        "GPU_CHECK_H": "8",  # 2 fragments of 4 steps: a delay of 2 fits
        "GPU_CHECK_SECONDS": "15",
        "GPU_CHECK_DELAYS": "1,2",
        "GPU_CHECK_SERVER_WORK": "1",
        "GPU_CHECK_SERVER_POOL": "2",
        "GPU_CHECK_FUSED_THREADS": "1",
        "GPU_CHECK_DEMO_STEPS": "40",
    }
    result = subprocess.run(
        [str(BENCHMARKS / "gpu_check.sh"), str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=400, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "gpu_check: passed" in result.stdout
    for folder, mode, delay in [("sync", "sync", 0), ("streaming", "streaming", 1),
                                ("streaming-delay2", "streaming", 2)]:  # fmt: skip
        row = json.loads((tmp_path / folder / "model_scale.json").read_text())["results"][0]
        assert row["mode"] == mode and row["device"] == "cpu" and row["rounds"] >= 2
        assert row["delay"] == delay and row["sync_every"] == 8
        assert 0 < row["blocked_fraction"] < 1 and row["compute_seconds"] > 0
    assert (tmp_path / "codec_devices.json").exists()
    rows = json.loads((tmp_path / "server_threads.json").read_text())["rows"]
    assert [(r["torch_threads"], r["python_threads"], r["identical"]) for r in rows] == [
        (1, 1, True), (1, 2, True)
    ]  # fmt: skip
    demo = json.loads((tmp_path / "demo.json").read_text())
    assert (demo["device"], demo["dtype"], demo["steps"], demo["rounds"]) == ("cpu", "bf16", 40, 2)
    simulated = json.loads((tmp_path / "simulate-streaming.json").read_text())
    assert simulated["config"]["mode"] == "streaming" and simulated["config"]["dtype"] == "bf16"
    assert simulated["config"]["steps"] == 40 and simulated["outer_steps"] > 0
    fused = json.loads((tmp_path / "fused-int8-t1" / "server_threads.json").read_text())
    assert [(r["torch_threads"], r["identical"]) for r in fused["rows"]] == [(1, True)]
    if any(shutil.which(cxx) for cxx in ("c++", "g++", "clang++")):  # else refused, eager
        assert fused["fused_int8"]["delta"] == "used"  # (the one the server's delta runs)
        assert fused["fused_int8_calls"]["delta"] > 0


def test_a_workers_coding_is_timed_beside_its_copy_limits(tmp_path: Path) -> None:
    """worker_coding.py on the CPU at 2M: both phases timed, the body's size that of int8
    (one byte a value plus a 4-byte scale per 128-value block, a header), and the profile of
    each phase printed."""
    result = run_benchmark_in_process(
        "worker_coding.py", "--device", "cpu", "--size", "2M", "--repeats", "2", "--profile",
        "--out-dir", str(tmp_path),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    document = json.loads((tmp_path / "worker_coding.json").read_text())
    assert document["size"] == "2M" and document["codec"] == "int8"
    values = document["parameters"]
    for body in (document["upload_bytes"], document["download_bytes"]):
        assert values < body < values * (1 + 4 / 128) + 64_000
    assert set(document["seconds"]) == {
        "encode", "send_now", "apply", "server_delta", "server_fold",
    }  # fmt: skip
    assert all(seconds > 0 for seconds in document["seconds"].values())
    assert set(document["limits_seconds"]) == {
        "to_device_pageable", "to_device_pinned", "to_host_pageable", "to_host_pinned",
        "memory_pass", "cpu_memory_pass",
    }  # fmt: skip
    for phase, floor in document["floors"].items():  # each figure beside its measured floor
        ratio = document["seconds"][phase] / document["limits_seconds"][floor]
        assert document["ratio_to_floor"][phase] == pytest.approx(ratio)
    assert "--- encode: where the time went" in result.stdout
    assert "--- apply: where the time went" in result.stdout


def test_a_top_k_body_s_intake_on_the_server_is_timed(tmp_path: Path) -> None:
    """With top-k, the server's fold of the body (as kept values, senders counted) is timed
    beside the rest; the bodies hold about 3 % of the values (4 bytes of value and index
    would be 8 %)."""
    result = run_benchmark_in_process(
        "worker_coding.py", "--device", "cpu", "--size", "2M", "--repeats", "2",
        "--codec", "topk:0.03+int2", "--out-dir", str(tmp_path),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    document = json.loads((tmp_path / "worker_coding.json").read_text())
    assert document["seconds"]["server_fold"] > 0 and document["floors"]["server_fold"]
    assert document["upload_bytes"] < document["parameters"] * 4 * 0.08


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--size", "7B"], "--size must be one of"),
        (["--codec", "fp32"], "--codec fp32 sends plain tensors"),
        (["--codec", "int9"], "--codec:"),
    ],
)
def test_a_workers_coding_refuses_bad_options_in_one_line(
    args: list[str], message: str, tmp_path: Path
) -> None:
    result = run_benchmark_in_process(
        "worker_coding.py", "--device", "cpu", *args, "--out-dir", str(tmp_path)
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert message in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "worker_coding.json").exists()
