"""Utilization and peak bandwidth: how long a worker waits on synchronization, per mode and link.

Real processes on 127.0.0.1: one `diloco server` and `diloco worker` processes (static
shards) per run, H = 100. One worker by default, so that the figure is the cost of the
communication itself; with `--workers 2` a barrier also waits for the slower peer (on this
2-core machine the workers and the server then compete for the cores).

Modes: sync, streaming with P = 4 and tau = 1 or 5 (alpha 0.5), and async (Delayed Nesterov,
N = the worker count). Links: loopback as is, and the workers' uploads capped at 1 Gbit/s and
100 Mbit/s (`diloco worker --max-upload-mbps`, a client-side pace; downloads are not capped).

For each run: the share of the training loop's wall time the workers spent blocked on the
server (mean over them), the time per inner step, and the largest single upload, from which
the peak bandwidth a worker needs follows: the largest transfer must fit in the compute it can
hide behind (tau steps in streaming; sync and async hide none, so one inner step is the
budget: a sync then costs at most one step), in bytes per second.

Writes benchmarks/results/utilization.md and .json.

    python benchmarks/utilization.py                        # full: 12 runs, ~8 min on 2 cores
    python benchmarks/utilization.py --steps 48 --sync-every 24 --links loopback --out-dir /tmp/u
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import typer

from diloco.console import (
    check_output_path,
    err,
    fail,
    out,
    progress_bar,
    summary_table,
    write_json,
)
from diloco.data import generated_corpus
from diloco.server.ops.launch import diloco_command, start_server, stop_process

RESULTS = Path(__file__).parent / "results"


@dataclass(frozen=True)
class Mode:
    label: str
    server_args: tuple[str, ...]
    overlap_steps: int  # inner steps a transfer can hide behind (the peak-bandwidth budget)


def modes(sync_every: int, fragments: int, workers: int) -> list[Mode]:
    h, k = str(sync_every), str(workers)
    streaming = ("--mode", "streaming", "--sync-every", h, "--fragments", str(fragments))
    return [
        Mode("sync", ("--sync-every", h, "--min-workers", k), 1),
        Mode(
            f"streaming P={fragments} tau=1",
            (*streaming, "--delay", "1", "--alpha", "0.5", "--min-workers", k),
            1,
        ),
        Mode(
            f"streaming P={fragments} tau=5",
            (*streaming, "--delay", "5", "--alpha", "0.5", "--min-workers", k),
            5,
        ),
        Mode("async", ("--mode", "async", "--sync-every", h, "--dn-period", k), 1),
    ]


LINKS = {"loopback": None, "1 Gbit/s": 1000.0, "100 Mbit/s": 100.0}


def run_once(
    mode: Mode,
    mbps: float | None,
    steps: int,
    count: int,
    model: list[str],
    corpus: Path,
    scratch: Path,
) -> dict:
    """One server, `count` workers; returns the workers' --json reports."""
    scratch.mkdir(parents=True, exist_ok=True)
    process, url = start_server(
        scratch / "port", *mode.server_args, output=(scratch / "server.log").open("wb")
    )
    try:
        workers = []
        for i in range(count):
            args = [
                "worker",
                "--server",
                url,
                "--worker-id",
                f"w{i}",
                "--steps",
                str(steps),
                "--data-dispatch",
                "static",
                "--shard",
                str(i),
                "--num-shards",
                str(count),
                "--corpus",
                str(corpus),
                "--no-progress",
                "--eval-batches",
                "1",
                "--json",
                str(scratch / f"w{i}.json"),
                *model,
                *(["--max-upload-mbps", str(mbps)] if mbps else []),
            ]
            workers.append(
                subprocess.Popen(
                    diloco_command(*args),
                    stdout=subprocess.DEVNULL,
                    stderr=(scratch / f"w{i}.log").open("wb"),
                    env={**os.environ, "OMP_NUM_THREADS": "1"},  # one core per worker
                )
            )
        for i, worker in enumerate(workers):
            if worker.wait(timeout=1800) != 0:
                raise RuntimeError(f"worker {i} failed: {(scratch / f'w{i}.log').read_text()}")
    finally:
        stop_process(process)
    return {"workers": [json.loads((scratch / f"w{i}.json").read_text()) for i in range(count)]}


def summarize(mode: Mode, link: str, run: dict, steps: int) -> dict:
    reports = run["workers"]
    blocked = statistics.mean(r["blocked_fraction"] for r in reports)
    steady = [r["steady_blocked_fraction"] for r in reports]
    step_seconds = statistics.mean(
        (r["train_seconds"] - r["blocked_seconds"]) / steps for r in reports
    )
    largest = max(r["largest_upload_bytes"] for r in reports)
    budget = mode.overlap_steps * step_seconds
    return {
        "mode": mode.label,
        "link": link,
        "blocked_fraction": blocked,
        "steady_blocked_fraction": statistics.mean(steady) if None not in steady else None,
        "blocked_seconds": [r["blocked_seconds"] for r in reports],
        "train_seconds": [r["train_seconds"] for r in reports],
        "step_seconds": step_seconds,
        "largest_upload_bytes": largest,
        "overlap_steps": mode.overlap_steps,
        "peak_bandwidth_bytes_per_second": largest / budget if budget > 0 else None,
        "syncs": [r["rounds"] for r in reports],
        "final_eval_loss": [r["final_eval_loss"] for r in reports],
    }


def main(
    steps: int = typer.Option(300, help="Inner steps per worker per run."),
    sync_every: int = typer.Option(100, help="H."),
    fragments: int = typer.Option(4, help="P for the streaming runs."),
    workers: int = typer.Option(1, help="Worker processes per run (1 or 2 on 2 cores)."),
    links: str = typer.Option(",".join(LINKS), help="Comma-separated: loopback,1 Gbit/s,..."),
    width: int = typer.Option(256, help="Model width."),
    depth: int = typer.Option(8, help="Transformer blocks (>= P)."),
    batch_size: int = typer.Option(
        2, help="Sequences of 64 bytes per inner step (fewer: less compute to hide a sync in)."
    ),
    out_dir: Path = typer.Option(RESULTS, help="Where utilization.md and .json go."),
) -> None:
    check_output_path(out_dir / "utilization.json", "--out-dir")
    chosen = [name.strip() for name in links.split(",") if name.strip()]
    unknown = [name for name in chosen if name not in LINKS]
    if unknown or not chosen:
        raise fail(f"--links must name some of {', '.join(LINKS)}, got {links!r}")
    small = {"--steps": steps, "--sync-every": sync_every, "--fragments": fragments}
    small.update({"--width": width, "--depth": depth})
    too_small = [f"{option} {value}" for option, value in small.items() if value < 1]
    if too_small:
        raise fail(f"{', '.join(too_small)}: each must be >= 1")
    if depth < fragments or sync_every % fragments or sync_every // fragments <= 5:
        raise fail("need --depth >= --fragments and H / P > 5 (tau = 5 must fit in a window)")
    if workers < 1 or batch_size < 1:
        raise fail(f"--workers and --batch-size must be >= 1, got {workers} and {batch_size}")
    model = [
        *("--width", str(width), "--depth", str(depth), "--heads", "4"),
        *("--seq-len", "64", "--batch-size", str(batch_size)),
    ]
    runs = [(mode, link) for link in chosen for mode in modes(sync_every, fragments, workers)]
    rows, results = [], []
    with tempfile.TemporaryDirectory(prefix="diloco-utilization-") as scratch:
        corpus = Path(scratch) / "corpus.txt"
        corpus.write_bytes(generated_corpus(num_bytes=2_000_000, seed=1))
        with progress_bar("utilization runs", len(runs)) as advance:
            for index, (mode, link) in enumerate(runs):
                scratch_dir = Path(scratch) / str(index)
                run = run_once(mode, LINKS[link], steps, workers, model, corpus, scratch_dir)
                result = summarize(mode, link, run, steps)
                results.append(result)
                peak = result["peak_bandwidth_bytes_per_second"]
                rows.append(
                    [
                        mode.label,
                        link,
                        f"{100 * result['steady_blocked_fraction']:.2f} %"
                        if result["steady_blocked_fraction"] is not None
                        else "-",
                        f"{100 * result['blocked_fraction']:.2f} %",
                        f"{1000 * result['step_seconds']:.1f}",
                        f"{result['largest_upload_bytes'] / 1e6:.2f}",
                        f"{peak * 8 / 1e9:.2f}" if peak else "-",
                    ]
                )
                advance(1)
    columns = [
        "mode",
        "upload link",
        "blocked, steady state",
        "blocked, whole run",
        "ms / inner step",
        "largest upload MB",
        "peak need Gbit/s",
    ]
    title = (
        f"utilization: {workers} worker(s), H = {sync_every}, {steps} steps, GPT {width}x{depth}, "
        f"batch {batch_size}"
    )
    out.print(summary_table(title, columns, rows))
    document = {
        "steps": steps,
        "sync_every": sync_every,
        "fragments": fragments,
        "workers": workers,
        "model": {"width": width, "depth": depth, "seq_len": 64, "batch_size": batch_size},
        "results": results,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "torch": torch.__version__,
    }
    write_json(out_dir / "utilization.json", document)
    (out_dir / "utilization.md").write_text(markdown(document, columns, rows))
    err.print(f"wrote {out_dir}/utilization.md and utilization.json")


def markdown(document: dict, columns: list[str], rows: list[list[str]]) -> str:
    return "\n".join(
        [
            "# Utilization: time blocked on synchronization, per mode and upload link",
            "",
            f"Command: `python benchmarks/utilization.py --steps {document['steps']} "
            f"--sync-every {document['sync_every']} --fragments {document['fragments']} "
            f"--workers {document['workers']} --width {document['model']['width']} "
            f"--depth {document['model']['depth']} --batch-size {document['model']['batch_size']}` "
            f"({document['machine']}, torch "
            f"{document['torch']}; one server and {document['workers']} `diloco worker` "
            "process(es) on 127.0.0.1, one core per worker).",
            "",
            "- blocked, steady state: the share of wall time the workers' training threads gave "
            "their syncs (coding, waiting on the server, taking results in) between the end "
            "of their first sync window and the end of training (this "
            "leaves out the start-up skew between processes and the final flush), mean over the "
            "workers; whole run: the same over the whole training loop, final sync included;",
            "- upload link: `--max-upload-mbps` on each worker (downloads are not capped);",
            "- peak need: the largest single upload divided by the compute it can hide behind "
            "(tau inner steps in streaming; one inner step for sync and async, which overlap "
            "nothing), i.e. the bandwidth a worker needs so that a sync costs no more than that.",
            "- the regime: what a sync costs is its transfer time against H inner steps of "
            "compute. A CPU computes slowly for its model size, so the default model and batch "
            "are chosen to make one inner step shorter than a full upload at 1 Gbit/s, as one "
            "step of a large model on a GPU is against its sync; with a bigger batch every mode "
            "hides its syncs (see --batch-size).",
            "",
            "| " + " | ".join(columns) + " |",
            "|" + "---|" * len(columns),
            *["| " + " | ".join(row) + " |" for row in rows],
            "",
        ]
    )


if __name__ == "__main__":
    typer.run(main)
