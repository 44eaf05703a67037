"""Peak memory per rank of one DiLoCo worker: FSDP2 on 2 ranks, DDP on 2 ranks, one process.

Each run is `examples/fsdp_worker.py` (the bundled GPT, the same seed and global batches)
against its own `diloco server` process, with gloo on the CPU. The figure is each rank's peak
resident set (ru_maxrss) at the end of training, which includes the interpreter and torch
(measured alone: the `baseline` row, a rank that imports everything and trains nothing).
Writes benchmarks/results/fsdp_memory.md and .json.

    python benchmarks/fsdp_memory.py
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import typer

from diloco.console import check_output_path, fail, markdown_table, out, summary_table, write_json
from diloco.server.ops.launch import start_server, stop_process

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "fsdp_worker.py"
RESULTS = Path(__file__).parent / "results"
WRAPS = ("none", "ddp", "fsdp")


def run_wrap(wrap: str, args: list[str], sync_every: int, work: Path) -> dict:
    """One worker of `wrap` against a fresh server; rank 0's figures."""
    port_file, report = work / f"port-{wrap}", work / f"{wrap}.json"
    server, url = start_server(port_file, "--sync-every", str(sync_every))
    try:
        launcher = [sys.executable]
        if wrap != "none":
            launcher += ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
        command = [*launcher, str(EXAMPLE), "--server", url, "--wrap", wrap, "--json",
                   str(report), *args]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        result = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
        if result.returncode != 0:
            raise fail(f"the {wrap} worker failed: {result.stderr[-2000:]}")
    finally:
        stop_process(server)
    return json.loads(report.read_text())


def baseline_mb() -> float:
    """A process that imports torch, diloco and the example and then stops: the floor."""
    code = (
        "import resource, sys, torch, torch.distributed.fsdp; sys.path.insert(0, sys.argv[1]); "
        "import fsdp_worker; print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)"
    )
    result = subprocess.run([sys.executable, "-c", code, str(EXAMPLE.parent)],
                            capture_output=True, text=True, check=True)  # fmt: skip
    return float(result.stdout.strip())


def main(
    width: int = typer.Option(1024, help="Model width (the GPT of examples/fsdp_worker.py)."),
    depth: int = typer.Option(4, help="Transformer blocks."),
    steps: int = typer.Option(4, help="Optimizer steps per worker."),
    sync_every: int = typer.Option(2, help="H: steps per round."),
    out_dir: Path = typer.Option(RESULTS, help="Where fsdp_memory.md and .json go."),
    json_path: Path | None = typer.Option(None, "--json", help="Also write the results here."),
) -> None:
    check_output_path(out_dir / "fsdp_memory.json", "--out-dir")
    check_output_path(json_path, "--json")
    for option, value in (("--width", width), ("--depth", depth), ("--steps", steps),
                          ("--sync-every", sync_every)):  # fmt: skip
        if value < 1:
            raise fail(f"{option} must be at least 1, got {value}")
    if width % 8:
        raise fail(f"--width must be a multiple of 8 (the model's heads), got {width}")
    args = ["--steps", str(steps), "--batch-size", "2", "--seq-len", "64", "--width",
            str(width), "--depth", str(depth), "--heads", "8"]  # fmt: skip
    runs = {}
    with tempfile.TemporaryDirectory() as work:
        for wrap in WRAPS:
            out.print(f"training {wrap} ...")
            runs[wrap] = run_wrap(wrap, args, sync_every, Path(work))
    floor = baseline_mb()
    parameters = runs["none"]["parameters"]
    model_mb = parameters * 4 / 1e6
    rows = [["baseline (imports only)", "-", f"{floor:.0f}", "-", "-"]]
    for wrap in WRAPS:
        peaks = runs[wrap]["peak_rss_mb"]
        rows.append([wrap, len(peaks), " / ".join(f"{p:.0f}" for p in peaks),
                     " / ".join(f"{(p - floor) / model_mb:.2f}" for p in peaks),
                     f"{runs[wrap]['final_eval_loss']:.4f}"])  # fmt: skip
    title = (f"Peak RSS per rank, {parameters / 1e6:.1f}M parameters ({model_mb:.0f} MB fp32), "
             f"{steps} steps at H = {sync_every}")  # fmt: skip
    columns = ["worker", "ranks", "peak MB (rank 0 / 1)", "above baseline, x fp32 model",
               "final eval loss"]  # fmt: skip
    out.print(summary_table(title, columns, rows))
    document = {
        "parameters": parameters,
        "model_fp32_mb": model_mb,
        "baseline_mb": floor,
        "steps": steps,
        "sync_every": sync_every,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "runs": {w: {k: v for k, v in r.items() if k != "state"} for w, r in runs.items()},
    }
    write_json(out_dir / "fsdp_memory.json", document)
    command = f"Command: `python benchmarks/fsdp_memory.py` ({document['machine']})"
    lines = [f"# {title}", "", command, "", *markdown_table(columns, rows)]
    (out_dir / "fsdp_memory.md").write_text("\n".join(lines) + "\n")
    if json_path is not None:
        write_json(json_path, document)


if __name__ == "__main__":
    typer.run(main)
