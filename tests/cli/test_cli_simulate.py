"""`diloco simulate` as a user runs it: a real process, JSON on disk, one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from diloco.models import GPTConfig
from diloco.sim import SimConfig, simulate
from processes import run_cli_in_process, sampled
from tiny import TINY_BATCH, TINY_CLI, TINY_MODEL, TINY_WARMUP

TINY = TINY_CLI


def run_cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "diloco.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.mark.slow  # in `make test-slow`; tests/sim count the bytes of each mode in process
def test_ddp_against_diloco_h50_moves_at_least_40x_fewer_bytes(
    tmp_path: Path, corpus_file: Path
) -> None:
    documents = {}
    for mode in ("ddp", "diloco"):
        path = tmp_path / f"{mode}.json"
        result = run_cli(
            "simulate",
            "--mode",
            mode,
            "--workers",
            "4",
            "--sync-every",
            "50",
            "--steps",
            "50",
            "--corpus",
            str(corpus_file),
            "--seed",
            "1",
            "--json",
            str(path),
            *TINY,
        )
        assert result.returncode == 0, result.stderr
        assert "final" in result.stdout or "eval loss" in result.stdout
        documents[mode] = json.loads(path.read_text())
    ddp, diloco = documents["ddp"], documents["diloco"]
    assert ddp["steps"] == diloco["steps"] == 50
    assert diloco["outer_steps"] == 1
    ratio = ddp["bytes_sent_per_worker"] / diloco["bytes_sent_per_worker"]
    assert ratio >= 40
    assert ratio == pytest.approx(2 * 3 / 4 * 50)  # ring all-reduce every step vs one round
    assert len(diloco["eval_curve"]) == 2 and diloco["eval_curve"][-1][0] == 50


def test_int8_uploads_are_counted_and_reported(tmp_path: Path, corpus_file: Path) -> None:
    path = tmp_path / "int8.json"
    result = run_cli_in_process(
        "simulate",
        *("--mode", "diloco", "--workers", "2", "--sync-every", "2", "--steps", "4"),
        *("--upload-codec", "INT8", "--codec-block", "64", "--error-feedback-beta", "0.5"),
        *("--corpus", str(corpus_file), "--json", str(path)),
        *TINY,
    )
    assert result.returncode == 0, result.stderr
    assert "int8, EF 0.5" in result.stdout
    document = json.loads(path.read_text())
    assert document["upload_codec"] == "int8" and document["error_feedback_beta"] == 0.5
    assert document["config"]["codec_block"] == 64
    # 42,880 one-byte codes and 678 fp32 scales (tests/sim/test_sim_compression.py counts them
    # tensor by tensor) per round, 2 rounds; fp32 weights down.
    assert document["bytes_sent_per_worker"] == 2 * (42_880 + 4 * 678)
    assert document["bytes_received_per_worker"] == 2 * 4 * 42_880


def test_simulate_warns_of_measured_costs_and_records_what_the_codec_chose(
    tmp_path: Path, corpus_file: Path
) -> None:
    """Issue 30, item 1: top-k picks outer sgd 1.0 and sparse_mean when none is given, and a
    run warns of its measured cost over 5 % (once over a sweep, stderr, one line each); a beta
    given to fp32 uploads is noted. The --json carries the resolved settings and which the
    codec chose."""
    path = tmp_path / "sweep.json"
    result = run_cli_in_process(
        "simulate",
        *("--workers", "2", "--sync-every", "2", "--steps", "2", "--error-feedback-beta", "0.5"),
        *("--sweep", "upload-codec=fp32,topk:0.03+int2", "--sweep", "seed=0,1"),
        *("--corpus", str(corpus_file), "--json", str(path)),
        *TINY,
    )
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if line.startswith("WARNING:")]
    # the beta given to fp32, then top-k at its defaults (sgd, sparse_mean, chunks of 128):
    # measured +5.2 % and +5.4 % at 137k parameters, over 5 %; once each over the sweep
    assert len(warnings) == 2, result.stderr
    assert warnings[0].startswith(
        "WARNING: error-feedback beta 0.5 has no effect with upload codec fp32"
    )
    assert warnings[1].startswith(
        "WARNING: upload codec topk:0.03+int2 at its companion settings (outer sgd lr 1, "
        "sparse_mean, chunks of 128) ended +5.2 % at 137k parameters"
    )
    configs = {
        run["config"]["upload_codec"]: run["config"] for run in json.loads(path.read_text())["runs"]
    }
    outer = ("outer_optimizer", "outer_lr", "outer_momentum", "aggregation")
    every = ["outer_optimizer", "outer_lr", "outer_momentum"]
    topk = configs["topk:0.03+int2"]
    assert [topk[k] for k in outer] == ["sgd", 1.0, 0.0, "sparse_mean"]
    assert topk["outer_defaults_from_codec"] == [*every, "aggregation"]
    assert [configs["fp32"][k] for k in outer] == ["nesterov", 0.7, 0.9, "mean"]
    assert configs["fp32"]["outer_defaults_from_codec"] == every
    # the plain mean, given, keeps its measured cost's warning
    mean = run_cli_in_process(
        "simulate",
        *("--workers", "2", "--sync-every", "2", "--steps", "2"),
        *("--upload-codec", "topk:0.03+int2", "--aggregation", "mean"),
        *("--corpus", str(corpus_file)),
        *TINY,
    )
    assert mean.returncode == 0, mean.stderr
    (warning,) = [line for line in mean.stderr.splitlines() if line.startswith("WARNING:")]
    assert warning.startswith(
        "WARNING: upload codec topk:0.03+int2 at its companion settings (outer sgd, no "
        "momentum) still ended +11.3 % to +12.2 % above the best fp32 DiLoCo run at H = 50 "
        "(+6.8 % at H = 10)"
    )
    assert "benchmarks/results/compression-topk/README.md" in warning


@pytest.mark.slow  # the int8 upload case above is the default suite's sample
def test_int8_delta_downloads_are_counted_and_labelled(tmp_path: Path, corpus_file: Path) -> None:
    path = tmp_path / "down.json"
    result = run_cli(
        "simulate",
        *("--mode", "diloco", "--workers", "2", "--sync-every", "2", "--steps", "4"),
        *("--upload-codec", "int8", "--download-codec", "int8", "--codec-block", "64"),
        *("--corpus", str(corpus_file), "--json", str(path)),
        *TINY,
    )
    assert result.returncode == 0, result.stderr
    assert "down int8" in result.stdout
    document = json.loads(path.read_text())
    assert document["config"]["download_codec"] == "int8"
    # Each round's download is the int8 delta: the same 42,880 codes and 678 scales as an upload.
    assert document["bytes_received_per_worker"] == 2 * (42_880 + 4 * 678)


@pytest.mark.slow  # the default suite keeps the simulate CLI's other runs
def test_plot_is_written(tmp_path: Path, corpus_file: Path) -> None:
    png = tmp_path / "curve.png"
    result = run_cli(
        "simulate",
        "--mode",
        "diloco",
        "--workers",
        "2",
        "--sync-every",
        "2",
        "--steps",
        "4",
        "--corpus",
        str(corpus_file),
        "--plot",
        str(png),
        *TINY,
    )
    assert result.returncode == 0, result.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_simulate_names_a_shared_dtype_in_its_title_and_its_json(
    tmp_path: Path, corpus_file: Path
) -> None:
    base = ["--workers", "2", "--steps", "4", "--sync-every", "2", "--corpus", str(corpus_file)]
    path = tmp_path / "run.json"
    result = run_cli_in_process("simulate", *base, *TINY, "--dtype", "bf16", "--json", str(path))
    assert result.returncode == 0, result.stderr
    assert "diloco simulate (bf16 autocast)" in result.stdout
    config = json.loads(path.read_text())["config"]
    assert (config["device"], config["dtype"]) == ("cpu", "bf16")
    swept = tmp_path / "sweep.json"
    result = run_cli_in_process(
        "simulate", *base, *TINY, "--sweep", "dtype=fp32,bf16", "--json", str(swept)
    )
    assert result.returncode == 0, result.stderr
    title = next(line for line in result.stdout.splitlines() if "sweep of 2 runs" in line)
    assert "autocast" not in title  # the dtype differs between the runs: it has a column
    runs = json.loads(swept.read_text())["runs"]
    assert [r["config"]["dtype"] for r in runs] == ["fp32", "bf16"]
    assert runs[0]["final_eval_loss"] != runs[1]["final_eval_loss"]


BAD_INPUTS = [
    (["--mode", "bogus"], "unknown mode"),
    (["--workers", "0"], "workers must be a positive integer"),
    (["--steps", "0"], "steps must be a positive integer"),
    (["--sync-every", "0"], "sync_every must be a positive integer"),
    (["--aggregation", "trimmed_mean:0.7"], "the trimmed fraction F must be in [0, 0.5), got 0.7"),
    (["--hostile", "evil"], "hostile must be one of none, scale100, sign_flip, noise"),
    (["--corpus", "{tmp}/missing.txt"], "does not exist"),
    (["--corpus", "{tmp}/empty.txt"], "empty"),
    (["--corpus", "{tmp}/tiny.txt"], "fewer than one training sequence"),
    (["--json", "{tmp}/no/such/dir.json"], "--json directory does not exist"),
    (["--plot", "{tmp}/no/such/dir.png"], "--plot directory does not exist"),
    (["--plot", "{tmp}/runs.xyz"], "matplotlib cannot write 'xyz'"),  # (was after training)
    (["--json", "{tmp}/tiny.txt/out.json"], "--json is inside a file, not a directory"),
    (["--mode", "streaming", "--fragments", "3", "--sync-every", "10"], "fragments"),
    (["--mode", "streaming", "--fragments", "2", "--sync-every", "10", "--delay", "5"], "tau"),
    (["--outer-lr", "-1"], "lr must be > 0"),
    (["--outer-momentum", "1"], "momentum"),
    (["--mode", "async", "--speeds", "1,x"], "--speeds"),
    (["--mode", "async", "--workers", "2", "--speeds", "1"], "one value per worker"),
    (["--mode", "streaming", "--fragments", "2", "--sync-every", "10", "--alpha", "1.5"], "alpha"),
    (["--mode", "async", "--grace", "-1"], "grace must be a number >= 0"),
    (["--mode", "async", "--staleness-weighting", "log"], "staleness_weighting must be one of"),
    (["--upload-codec", "int3"], "unknown codec 'int3'; allowed: fp32, bf16, int8"),
    (["--upload-codec", "topk:1.5+int2"], "top-k fraction must be in (0, 1], got 1.5"),
    (["--upload-codec", "topk:1.5"], "would keep k = round(1.5 x 128) = 192 values"),
    (["--upload-codec", "topk:0.0001"], "keeps k = round(0.0001 x 128) = 0 values of each chunk"),
    (["--upload-codec", "topk:0.03", "--outer-momentum", "0.5"], "outer_momentum 0.5 needs"),
    (["--codec-block", "100"], "block size must be a positive power of two in [8, 65536]"),
    (["--topk-chunk", "1"], "chunk size must be a positive power of two in [2, 65536], got 1"),
    (["--error-feedback-beta", "1"], "error_feedback_beta must be in [0, 1)"),
    (["--mode", "ddp", "--upload-codec", "int8"], "upload_codec int8 applies to modes diloco"),
    (["--download-codec", "int5"], "unknown codec 'int5'; allowed: fp32, bf16, int8"),
    (["--mode", "single", "--download-codec", "int8"], "mode single has no global weights"),
    (["--model-config", "{tmp}/missing.json"], "--model-config {tmp}/missing.json: cannot read it"),
    (["--sweep", "bogus=1,2"], "--sweep 'bogus' is not a setting; sweepable: mode, workers"),
    (["--sweep", "outer-lr=0.5,x"], "--sweep outer-lr: 'x' is not a number"),
    (["--sweep", "outer-lr=0.5,-1", "--json", "{tmp}/no.json"], "lr must be > 0"),
    (["--sweep", "mode=diloco,bogus"], "unknown mode 'bogus'"),
    (["--sweep", "outer-lr=0.5,1", "--jobs", "0"], "--jobs must be a positive integer, got 0"),
    (["--device", "tpu"], "--device must be cpu, cuda, cuda:N or auto, got 'tpu'"),
    (["--dtype", "fp16"], "--dtype must be fp32 or bf16, got 'fp16'"),
    (["--sweep", "dtype=fp32,half"], "--dtype must be fp32 or bf16, got 'half'"),
]
if not torch.cuda.is_available():  # where torch sees no GPU, one is not pretended
    BAD_INPUTS.append((["--device", "cuda"], "--device cuda: torch sees no CUDA device"))


@pytest.mark.parametrize(
    ("args", "needle"),
    [pytest.param(*case, id=" ".join(case[0])[:40]) for case in BAD_INPUTS],
)
def test_bad_input_gives_one_line_and_exit_2_in_process(
    args: list[str], needle: str, tmp_path: Path, corpus_file: Path
) -> None:
    """Every case through typer's runner in this process (real processes: below)."""
    check_bad_input(args, needle, tmp_path, corpus_file, run_cli_in_process)


@pytest.mark.parametrize(
    ("args", "needle"),
    sampled(BAD_INPUTS, [" ".join(args)[:40] for args, _ in BAD_INPUTS], every=100),
)  # one real process in the default suite, every case with -m slow
def test_bad_input_gives_one_line_and_exit_2(
    args: list[str], needle: str, tmp_path: Path, corpus_file: Path
) -> None:
    check_bad_input(args, needle, tmp_path, corpus_file, run_cli)


def check_bad_input(args, needle, tmp_path: Path, corpus_file: Path, run) -> None:
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "tiny.txt").write_bytes(b"too short")
    args = [a.format(tmp=tmp_path) for a in args]
    if "--corpus" not in args:
        args += ["--corpus", str(corpus_file)]
    if "--steps" not in args:
        args += ["--steps", "2"]
    result = run("simulate", *args, *TINY)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error:"), lines
    assert needle.format(tmp=tmp_path) in lines[0]
    assert not (tmp_path / "no").exists()
    assert not (tmp_path / "no.json").exists()


@pytest.mark.slow  # sibling: tests/sim/test_sim_sweep.py runs sweeps in-process
def test_a_sweep_runs_each_value_and_marks_the_lowest_loss(
    tmp_path: Path, corpus_file: Path
) -> None:
    common = ["--workers", "2", "--sync-every", "2", "--steps", "4", "--corpus", str(corpus_file)]
    path = tmp_path / "sweep.json"
    result = run_cli(
        "simulate", *common, "--sweep", "outer-lr=0.3,1.0", "--jobs", "2",
        "--json", str(path), *TINY,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    document = json.loads(path.read_text())
    assert document["sweep"] == {"outer_lr": [0.3, 1.0]}
    assert [run["overrides"] for run in document["runs"]] == [{"outer_lr": 0.3}, {"outer_lr": 1.0}]
    # Each run equals the same settings given without --sweep (in this process: 2 threads
    # against the children's 1, hence rel 1e-4)
    losses = []
    for run, lr in zip(document["runs"], (0.3, 1.0), strict=True):
        alone = simulate(
            SimConfig(mode="diloco", workers=2, sync_every=2, steps=4, outer_lr=lr,
                      corpus=str(corpus_file), model=TINY_MODEL, batch_size=TINY_BATCH,
                      seq_len=TINY_MODEL.context, warmup=TINY_WARMUP)
        )  # fmt: skip
        assert run["final_eval_loss"] == pytest.approx(alone.final_eval_loss, rel=1e-4)
        losses.append(alone.final_eval_loss)
    best = 0 if losses[0] < losses[1] else 1
    assert document["best"] == {"outer_lr": [0.3, 1.0][best]}
    best_line = next(line for line in result.stdout.splitlines() if "<- best" in line)
    assert best_line.split()[1] == ["0.3", "1.0"][best]
    assert "lowest eval loss" in result.stdout


def test_demo_runs_a_real_server_and_workers(tmp_path: Path, corpus_file: Path) -> None:
    path = tmp_path / "demo.json"
    result = run_cli(
        "demo",
        "--workers",
        "2",
        "--steps",
        "6",
        "--sync-every",
        "3",
        "--corpus",
        str(corpus_file),
        "--json",
        str(path),
    )
    assert result.returncode == 0, result.stderr
    assert "one worker alone" in result.stdout and "fewer bytes" in result.stdout
    document = json.loads(path.read_text())
    # The baselines train the workers' model and batch: the same runs as `diloco simulate`
    model = GPTConfig(context=64, width=64, depth=2, heads=4)
    for mode in ("single", "ddp"):
        alone = simulate(
            SimConfig(mode=mode, workers=2, steps=6, model=model, batch_size=8, seq_len=64,
                      corpus=str(corpus_file)),
        )  # fmt: skip
        assert document[f"{mode}_final_eval_loss"] == pytest.approx(alone.final_eval_loss, rel=1e-4)
    assert document["rounds"] == 2
    assert (document["device"], document["dtype"]) == ("cpu", "fp32")  # the defaults
    reports = document["worker_reports"]
    assert [r["worker_id"] for r in reports] == ["w0", "w1"]
    assert {(r["device"], r["dtype"]) for r in reports} == {("cpu", "fp32")}
    # Both workers end on the same global weights, so their eval losses agree exactly.
    assert reports[0]["final_eval_loss"] == reports[1]["final_eval_loss"]
    assert document["ddp_bytes_per_worker"] > document["bytes_sent_per_worker"] > 0


@pytest.mark.slow  # in `make test-slow`; the default suite runs the fp32 demo above
def test_demo_with_bf16_trains_workers_and_baselines_under_autocast(
    tmp_path: Path, corpus_file: Path
) -> None:
    path = tmp_path / "demo.json"
    result = run_cli(
        "demo", "--steps", "6", "--sync-every", "3", "--dtype", "bf16",
        "--corpus", str(corpus_file), "--json", str(path),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "GPT bf16 (MB" in " ".join(result.stdout.split())  # the title says so
    document = json.loads(path.read_text())
    assert (document["device"], document["dtype"]) == ("cpu", "bf16")
    assert {(r["device"], r["dtype"]) for r in document["worker_reports"]} == {("cpu", "bf16")}
    # The baselines are the simulator's bf16 runs, which differ from its fp32 ones
    model = GPTConfig(context=64, width=64, depth=2, heads=4)
    for mode in ("single", "ddp"):
        common = dict(mode=mode, workers=2, steps=6, model=model, batch_size=8, seq_len=64,
                      corpus=str(corpus_file))  # fmt: skip
        bf16 = simulate(SimConfig(**common, dtype="bf16")).final_eval_loss
        fp32 = simulate(SimConfig(**common)).final_eval_loss
        assert document[f"{mode}_final_eval_loss"] == pytest.approx(bf16, rel=1e-4)
        assert bf16 != fp32


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_demo_on_cuda_without_a_gpu_is_one_line_and_starts_nothing() -> None:
    result = run_cli_in_process("demo", "--device", "cuda")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip() == (
        "error: --device cuda: torch sees no CUDA device on this machine (a CPU build of "
        "torch, or no GPU); use --device cpu"
    )
    assert "server on" not in result.stderr  # refused before a server started


def test_demo_with_no_workers_is_one_line() -> None:
    result = run_cli_in_process("demo", "--workers", "0")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip() == "error: workers must be a positive integer, got 0"


def test_demo_bad_corpus_is_one_line(tmp_path: Path) -> None:
    result = run_cli_in_process("demo", "--corpus", str(tmp_path / "nothing"))
    assert result.returncode == 2
    assert result.stderr.strip().startswith("error:")
    assert "does not exist" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.slow  # in `make test-slow`; the default suite keeps a sample
def test_demo_in_streaming_mode_syncs_fragments(tmp_path: Path, corpus_file: Path) -> None:
    path = tmp_path / "demo.json"
    result = run_cli(
        "demo", "--mode", "streaming", "--steps", "8", "--sync-every", "8",
        "--corpus", str(corpus_file), "--json", str(path),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    document = json.loads(path.read_text())
    # P = 2 (the demo model's 2 blocks), S = 4, tau = 1: fragment 0 is sent at step 3 and
    # fragment 1 at step 7; the flush syncs both once more (alpha 0.5 leaves local residue in
    # every merge), so both workers end on the global model.
    assert document["mode"] == "streaming" and document["rounds"] == 4
    reports = document["worker_reports"]
    assert [r["fragment_rounds"] for r in reports] == [[2, 2], [2, 2]]
    assert reports[0]["final_eval_loss"] == reports[1]["final_eval_loss"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--mode", "bogus"], "error: --mode must be one of sync, streaming, async, got 'bogus'"),
        (["--device", "tpu"], "error: --device must be cpu, cuda, cuda:N or auto, got 'tpu'"),
        (["--dtype", "fp16"], "error: --dtype must be fp32 or bf16, got 'fp16'"),
        (
            ["--mode", "streaming", "--sync-every", "7"],
            "error: sync_every H must be divisible by fragments P, got H = 7, P = 2",
        ),
    ],
)
def test_demo_bad_mode_settings_are_one_line(args: list[str], message: str) -> None:
    result = run_cli_in_process("demo", *args)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip() == message
