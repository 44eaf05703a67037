"""`diloco demo`: a real server and K worker processes on 127.0.0.1, compared with baselines.

The server and workers are the same `diloco server` / `diloco worker` commands a user runs;
the demo only starts them, follows the rounds through /v1/status, and then trains a single
worker for the same steps (in-process, no network) to show what the K - 1 extra workers buy.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import typer
from rich.table import Table

from diloco.commands.options import CORPUS_HELP, DTYPE_HELP, require_positive
from diloco.commands.threads import split_cores
from diloco.console import (
    check_output_path,
    err,
    fail,
    megabytes,
    out,
    progress_bar,
    summary_table,
    write_json,
)
from diloco.data import CorpusError, load_named_corpus
from diloco.models import GPTConfig
from diloco.server.ops.launch import diloco_command, start_server, stop_process
from diloco.server.settings import ServerSettings
from diloco.sim import SimConfig, total_inner_steps
from diloco.sim.jobs import run_configs
from diloco.training import autocast_dtype_of, training_device
from diloco.worker import DiLoCoClient, RetryPolicy, ServerError, ServerUnavailable

FP32_BYTES = 4


@dataclass(frozen=True)
class Where:
    """Where the demo's workers and baselines train: a resolved device, and fp32 or bf16."""

    device: str
    dtype: str

    def label(self) -> str:
        """For the table's title: nothing on the CPU in fp32, else e.g. "on cuda, bf16 " (its
        trailing space before the title's next words)."""
        parts = [] if self.device == "cpu" else [f"on {self.device}"]
        parts += ["bf16"] if self.dtype == "bf16" else []
        return f"{', '.join(parts)} " if parts else ""


DEMO_MODES = ("sync", "streaming", "async")
# The demo's model and batch: small enough that 2 workers, one worker alone and data-parallel
# all train in about 2 minutes on 2 cores, and that DiLoCo gets enough outer steps to show its
# gain (README, "Quick start", shows the table these defaults give).
DEMO_MODEL = {"width": 64, "depth": 2, "heads": 4, "seq_len": 64, "batch_size": 8}
DEMO_STEPS = 1000
DEMO_H = 20  # every mode (streaming: a multiple of the demo model's 2 fragments)


def demo_command(
    workers: int = typer.Option(2, help="Worker processes K."),
    steps: int = typer.Option(DEMO_STEPS, help="Inner steps per worker."),
    mode: str = typer.Option(
        "sync",
        help="sync, streaming (a fragment per block: 2, tau 1, alpha 0.5) or async (DyLU, 2 s "
        "grace window).",
    ),
    sync_every: int = typer.Option(
        None,
        help=f"H: inner steps per round (default {DEMO_H}; streaming: a multiple of 2).",
    ),
    corpus: str = typer.Option("shakespeare", help=CORPUS_HELP),
    seed: int = typer.Option(0, help="Seed of weights and batches."),
    device: str = typer.Option(
        "cpu",
        help="Where the workers and the baselines train: cpu, cuda, cuda:N, or auto (cuda if "
        "present). The demo's model is small: a few CPU cores train it as fast.",
    ),
    dtype: str = typer.Option("fp32", help=DTYPE_HELP),
    json_path: Path = typer.Option(None, "--json", help="Write the demo's figures here."),
) -> None:
    """Train with a real server and K workers on 127.0.0.1; compare with one worker and DDP."""
    check_output_path(json_path, "--json")
    if mode not in DEMO_MODES:
        raise fail(f"--mode must be one of {', '.join(DEMO_MODES)}, got {mode!r}")
    if sync_every is None:
        sync_every = DEMO_H
    require_positive(workers=workers, steps=steps, sync_every=sync_every)
    try:
        where = Where(str(training_device(device)), dtype)  # before anything starts
        autocast_dtype_of(dtype)
    except ValueError as exc:
        raise fail(str(exc)) from None
    try:
        mode_args = _mode_args(mode, workers, sync_every)
    except ValueError as exc:
        raise fail(str(exc)) from None
    try:
        data = load_named_corpus(corpus)  # fetch once here, so workers find it cached
    except CorpusError as exc:
        raise fail(str(exc)) from None
    with tempfile.TemporaryDirectory(prefix="diloco-demo-") as scratch:
        corpus_path = Path(scratch) / "corpus.txt"
        corpus_path.write_bytes(data)
        port_file = Path(scratch) / "port"
        server_log = (Path(scratch) / "server.log").open("wb")
        try:
            server, url = start_server(
                port_file,
                *mode_args,
                "--heartbeat-interval",
                "2",
                "--heartbeat-timeout",
                "20",
                "--threads",
                "1",  # its passes are small beside the workers' training
                output=server_log,
            )
        except RuntimeError as exc:
            raise fail(f"demo failed: {exc}", code=1) from None
        processes: list[subprocess.Popen] = []
        try:
            err.print(f"server on {url}; starting {workers} workers")
            for w in range(workers):
                log = (Path(scratch) / f"w{w}.log").open("wb")
                processes.append(
                    subprocess.Popen(
                        diloco_command(
                            "worker",
                            "--server",
                            url,
                            "--worker-id",
                            f"w{w}",
                            "--steps",
                            str(steps),
                            "--seed",
                            str(seed),
                            "--corpus",
                            str(corpus_path),
                            "--no-progress",
                            *_model_args(),
                            "--threads",
                            str(split_cores(workers)),
                            "--device",
                            where.device,
                            "--dtype",
                            where.dtype,
                            "--json",
                            str(Path(scratch) / f"w{w}.json"),
                        ),
                        stdout=subprocess.DEVNULL,
                        stderr=log,
                    )
                )
            _follow(url, processes, steps * workers)
            failed = [w for w, p in enumerate(processes) if p.returncode != 0]
            if failed:
                last = (Path(scratch) / f"w{failed[0]}.log").read_text().strip().splitlines()
                raise fail(
                    f"worker w{failed[0]} failed: {last[-1] if last else 'no output'}", code=1
                )
            reports = [
                json.loads((Path(scratch) / f"w{w}.json").read_text()) for w in range(workers)
            ]
        except typer.Exit:  # a worker's own one-line failure, already printed
            raise
        except (RuntimeError, ServerError, ServerUnavailable) as exc:
            raise fail(f"demo failed: {exc}", code=1) from None
        finally:
            for process in processes:
                stop_process(process)
            stop_process(server)
    _report(reports, data, workers, steps, sync_every, corpus, seed, json_path, mode, where)


def _model_args() -> list[str]:
    """The demo's model and batch as `diloco worker` options."""
    return [a for k, v in DEMO_MODEL.items() for a in (f"--{k.replace('_', '-')}", str(v))]


def _mode_args(mode: str, workers: int, sync_every: int) -> list[str]:
    """The server's options for the demo's mode (checked here, so a bad H fails at once)."""
    h = ["--sync-every", str(sync_every)]
    if mode == "sync":
        return [*h, "--min-workers", str(workers)]
    if mode == "async":
        # The recommended async setting (README): DyLU, and a grace window that makes the
        # arrivals of one wave a single plain-Nesterov step.
        return ["--mode", "async", *h, "--dylu", "--grace-seconds", "2", "--dn-period", "1"]
    settings = ServerSettings(
        mode="streaming", sync_every=sync_every, fragments=DEMO_MODEL["depth"], delay=1
    )
    return [
        "--mode",
        "streaming",
        *h,
        "--fragments",
        str(settings.fragments),
        "--delay",
        str(settings.delay),
        "--alpha",
        "0.5",
        "--min-workers",
        str(workers),
    ]


def _follow(url: str, processes: list[subprocess.Popen], total_steps: int) -> None:
    """A progress bar over every worker's steps, read from the server's /v1/status."""
    with (
        DiLoCoClient(url, retry=RetryPolicy(attempts=3), read_timeout=10) as client,
        progress_bar("demo (all workers)", total_steps) as advance,
    ):
        done = 0
        while any(p.poll() is None for p in processes):
            steps = sum(w["step"] for w in client.status()["workers"])
            advance(max(0, steps - done))
            done = max(done, steps)
            time.sleep(0.5)
        advance(max(0, total_steps - done))


def _baselines(
    data: bytes, workers: int, steps: int, corpus: str, seed: int, where: Where
) -> tuple[dict, dict]:
    """One worker alone and data-parallel over the same workers, trained side by side in the
    simulator on the demo's model (the same recipe as `diloco worker`), where the workers
    trained."""
    model = GPTConfig(context=DEMO_MODEL["seq_len"], width=DEMO_MODEL["width"],
                      depth=DEMO_MODEL["depth"], heads=DEMO_MODEL["heads"])  # fmt: skip
    common = dict(workers=workers, steps=steps, corpus=corpus, seed=seed, model=model,
                  seq_len=DEMO_MODEL["seq_len"], batch_size=DEMO_MODEL["batch_size"],
                  device=where.device, dtype=where.dtype)  # fmt: skip
    configs = [SimConfig(mode="single", **common), SimConfig(mode="ddp", **common)]
    total = sum(total_inner_steps(c) for c in configs)
    jobs = 2 if total >= 1000 else 1  # a child process pays ~2 s of imports: only for real runs
    with progress_bar("baselines: one worker alone, data-parallel", total) as advance:
        single, ddp = run_configs(configs, jobs=jobs, progress=advance, corpus=data)
    return single, ddp


def demo_table(steps: int, parameters: int, rows: list[list], where: Where | None = None) -> Table:
    """The demo's table (README.md, "Quick start", shows one: a test holds its columns to
    these); 84 columns wide with the default demo's rows, where longer titles made it 117.
    The title names the device and autocast when they are not the CPU and fp32."""
    return summary_table(
        f"diloco demo: {steps} inner steps per worker, {parameters:,}-parameter GPT "
        f"{'' if where is None else where.label()}(MB: per worker)",
        ["run", "final eval loss", "syncs", "MB sent", "MB received"],
        rows,
    )


def _report(
    reports: list[dict],
    data: bytes,
    workers: int,
    steps: int,
    sync_every: int,
    corpus: str,
    seed: int,
    json_path: Path | None,
    mode: str,
    where: Where,
) -> None:
    single, ddp = _baselines(data, workers, steps, corpus, seed, where)
    model_bytes = single["parameters"] * FP32_BYTES
    ddp_bytes = 2 * (workers - 1) / workers * model_bytes * steps
    diloco_loss = reports[0]["final_eval_loss"]
    sent = sum(r["bytes_sent"] for r in reports) / workers
    received = sum(r["bytes_received"] for r in reports) / workers
    rows = [
        [
            f"DiLoCo ({mode}), {workers} workers, H={sync_every}",
            f"{diloco_loss:.4f}",
            reports[0]["rounds"],
            megabytes(sent),
            megabytes(received),
        ],
        ["one worker alone", f"{single['final_eval_loss']:.4f}", "-", "0", "0"],
        [
            f"data-parallel, {workers} workers",
            f"{ddp['final_eval_loss']:.4f}",
            steps,
            megabytes(ddp_bytes),
            megabytes(ddp_bytes),
        ],
    ]
    out.print(demo_table(steps, single["parameters"], rows, where))
    gain = single["final_eval_loss"] - diloco_loss
    out.print(
        f"DiLoCo's {workers} workers ended {abs(gain):.3f} nats "
        f"{'below' if gain > 0 else 'above'} one worker alone and "
        f"{diloco_loss - ddp['final_eval_loss']:+.3f} from data-parallel, and moved "
        f"{ddp_bytes / max(sent, 1):,.0f}x fewer bytes than data-parallel would have for the "
        "same steps."
    )
    if json_path is not None:
        write_json(
            json_path,
            {
                "mode": mode,
                "workers": workers,
                "steps": steps,
                "sync_every": sync_every,
                "device": where.device,
                "dtype": where.dtype,
                "diloco_final_eval_loss": diloco_loss,
                "single_final_eval_loss": single["final_eval_loss"],
                "ddp_final_eval_loss": ddp["final_eval_loss"],
                "rounds": reports[0]["rounds"],
                "bytes_sent_per_worker": sent,
                "bytes_received_per_worker": received,
                "ddp_bytes_per_worker": ddp_bytes,
                "worker_reports": reports,
            },
        )
