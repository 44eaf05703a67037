"""Rounds at the model sizes users train, against the physical limits measured in the same run.

For each model size (the bundled byte-level GPT at 25M, 85M, 350M or 1B parameters), codec and
mode, one real `diloco server` (with --state-dir: every round durable) and K real worker
processes that train through the public `DiLoCoWorker` API (AdamW, batch 1, context 16, so the
training itself is short and the round is what is measured). Per round it reports:
  - each worker's blocked time, split into encode (pseudo-gradient and upload body), upload,
    wait (until the result is ready), download and apply (`DiLoCoWorker.last_round_phases`);
  - the server's parts (its /metrics `diloco_round_part_seconds`): scan and fold per body,
    outer step, delta coding, the durable checkpoint write, the whole commit;
  - bytes up and down per worker, and the peak RSS of the server and of each worker (a worker's
    beyond its training state: measured after its first optimizer step, before it joined);
and, measured in the same run on the same machine, the two physical limits of a round: the
time a plain loopback socket needs to move the round's bytes (K clients each send their upload
and receive their download through one process) and one memory pass over the fp32 model (a
copy at the server's thread budget). The headline ratio is a worker's median blocked time
over (loopback + memory pass). Writes benchmarks/results/model_scale.md and .json.

    python benchmarks/model_scale.py                                   # 25M and 85M
    python benchmarks/model_scale.py --sizes 85M --codecs int8 --rounds 3 --out-dir /tmp/ms
    python benchmarks/model_scale.py --device cuda --sizes 85M,350M --sync-every 100
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import platform
import re
import resource
import statistics
import tempfile
import time
from pathlib import Path

import torch
import typer
import urllib3

from diloco.commands.threads import machine_cores, split_cores
from diloco.console import check_output_path, err, fail, out, summary_table, write_json
from diloco.server.ops.launch import start_server, stop_process
from wire import _memory_kb, raw_tcp  # benchmarks/ is sys.path[0]

RESULTS = Path(__file__).parent / "results"
CONTEXT = mp.get_context("spawn")
# width, depth of the bundled GPT (12 w^2 parameters a block, plus 256 w of embeddings)
# ("2M" is for the benchmark's own test: a round of it takes a fraction of a second)
SIZES = {"2M": (256, 2), "25M": (512, 8), "85M": (768, 12), "350M": (1024, 28), "1B": (2048, 20)}
CODECS = {
    "fp32": [],
    "int8": ["--upload-codec", "int8", "--download-codec", "int8"],
}
PHASES = ("encode", "upload", "wait", "download", "apply", "other")
SERVER_PARTS = ("scan", "fold", "outer_step", "delta", "checkpoint", "commit")


# ------------------------------------------------------------------ one worker process


def _rss_kb() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _worker(
    url: str, index: int, size: str, rounds: int, device: str, threads: int, path: str
) -> None:
    """Train `rounds` rounds of H steps (the server's H) and write what each round cost."""
    torch.set_num_threads(threads)
    from diloco.models.gpt import GPTConfig
    from diloco.worker import DiLoCoWorker

    width, depth = SIZES[size]
    config = GPTConfig(context=16, width=width, depth=depth, heads=max(1, width // 64))
    torch.manual_seed(0)
    model = config.build().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(index)

    def step() -> float:
        tokens = torch.randint(0, 256, (1, 17), generator=generator).to(device)
        started = time.perf_counter()
        config.loss(model, tokens[:, :-1], tokens[:, 1:]).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        return time.perf_counter() - started

    step()  # the training state (gradients, AdamW's moments) exists from here on
    training_state_kb = _rss_kb()
    worker = DiLoCoWorker(model, optimizer, url, worker_id=f"w{index}", result_wait=120)
    per_round: list[dict] = []
    compute = 0.0
    assert worker.client is not None
    sent, received = worker.client.stats.bytes_sent, worker.client.stats.bytes_received
    while worker.rounds < rounds:
        before = worker.rounds
        seconds = step()
        if worker.rounds == before:
            compute += seconds
            continue
        phases = dict(worker.last_round_phases or {})
        stats = worker.client.stats
        per_round.append(
            {
                **phases,
                "compute": compute,
                "up": stats.bytes_sent - sent,  # heartbeats' few bytes included
                "down": stats.bytes_received - received,
            }
        )
        sent, received, compute = stats.bytes_sent, stats.bytes_received, 0.0
    stats = worker.stats()
    worker.close(final_sync=False)
    Path(path).write_text(
        json.dumps(
            {
                "rounds": per_round,
                "bytes_sent": stats["bytes_sent"],
                "bytes_received": stats["bytes_received"],
                "training_state_mb": training_state_kb / 1024,
                "peak_rss_mb": _rss_kb() / 1024,
            }
        )
    )


# ------------------------------------------------------------------ the physical limits


def memory_pass_seconds(parameters: int, threads: int, repeats: int = 3) -> float:
    """One copy over the fp32 model (read it, write it), at `threads` threads: the median."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        source = torch.ones(parameters)
        target = torch.empty(parameters)
        target.copy_(source)  # fault both in first
        samples = []
        for _ in range(repeats):
            started = time.perf_counter()
            target.copy_(source)
            samples.append(time.perf_counter() - started)
        return statistics.median(samples)
    finally:
        torch.set_num_threads(before)


def loopback_seconds(up: int, down: int, workers: int) -> float:
    """K clients each push `up` and pull `down` bytes through one process (the median round):
    the symmetric raw_tcp moves the larger of the two each way, a bound from above."""
    return raw_tcp(max(up, down, 1), workers, 3)["median_round_seconds"]


# ------------------------------------------------------------------ one configuration


def _server_parts(url: str) -> dict[str, dict[str, float]]:
    """Sum and count of each `diloco_round_part_seconds` part from the server's /metrics."""
    text = urllib3.PoolManager().request("GET", url + "/metrics", timeout=30).data.decode()
    parts: dict[str, dict[str, float]] = {}
    pattern = r'diloco_round_part_seconds_(sum|count)\{part="(\w+)"\} ([0-9.e+-]+)'
    for kind, part, value in re.findall(pattern, text):
        parts.setdefault(part, {})[kind] = float(value)
    return parts


def run_one(
    size: str,
    codec: str,
    mode: str,
    workers: int,
    rounds: int,
    sync_every: int,
    device: str,
    scratch: Path,
) -> dict:
    width, depth = SIZES[size]
    from diloco.models.gpt import GPTConfig

    with torch.device("meta"):  # counted, not allocated (1B would be 4 GB here)
        model = GPTConfig(context=16, width=width, depth=depth).build()
    parameters = sum(p.numel() for p in model.parameters())
    server_threads = 1 if device == "cpu" else min(4, machine_cores())
    worker_threads = split_cores(workers + 1) if device == "cpu" else 1
    mode_args = ["--mode", mode] + (
        ["--fragments", "4", "--delay", "1"] if mode == "streaming" else []
    )
    directory = Path(tempfile.mkdtemp(dir=scratch))
    log = (directory / "server.log").open("wb")
    server, url = start_server(
        directory / "port",
        "--state-dir",
        str(directory / "state"),
        "--sync-every",
        str(sync_every),
        "--threads",
        str(server_threads),
        "--heartbeat-timeout",
        "600",
        *CODECS[codec],
        *mode_args,
        output=log,
    )
    try:
        paths = [directory / f"w{i}.json" for i in range(workers)]
        group = [
            CONTEXT.Process(
                target=_worker,
                args=(url, i, size, rounds, device, worker_threads, str(paths[i])),
            )
            for i in range(workers)
        ]
        for process in group:
            process.start()
        for process in group:
            process.join(timeout=3600)
            if process.exitcode != 0:
                raise RuntimeError(f"a worker failed (exit {process.exitcode}); see {directory}")
        parts = _server_parts(url)
        server_peak_mb = _memory_kb(server.pid, "VmHWM") / 1024
    finally:
        stop_process(server)
    reports = [json.loads(path.read_text()) for path in paths]
    # the first round carries the start (joins, the first download): the steady ones count
    steady = [r for report in reports for r in report["rounds"][1:]] or [
        r for report in reports for r in report["rounds"]
    ]
    up = int(statistics.median(r["up"] for r in steady))
    down = int(statistics.median(r["down"] for r in steady))
    loopback = loopback_seconds(up, down, workers)
    memory = memory_pass_seconds(parameters, server_threads)
    blocked = statistics.median(r["blocked"] for r in steady)
    return {
        "size": size,
        "parameters": parameters,
        "codec": codec,
        "mode": mode,
        "workers": workers,
        "rounds": rounds,
        "sync_every": sync_every,
        "device": device,
        "server_threads": server_threads,
        "worker_threads": worker_threads,
        "blocked_seconds": blocked,
        "phases": {p: statistics.median(r.get(p, 0.0) for r in steady) for p in PHASES},
        "compute_seconds": statistics.median(r["compute"] for r in steady),
        "server_parts": {
            part: parts.get(part, {}).get("sum", 0.0)
            / max(1.0, parts.get(part, {}).get("count", 0))
            for part in SERVER_PARTS
        },
        "bytes_up_per_round": up,
        "bytes_down_per_round": down,
        "loopback_seconds": loopback,
        "memory_pass_seconds": memory,
        "ratio_to_limit": blocked / (loopback + memory),
        "server_peak_mb": server_peak_mb,
        "model_mb": parameters * 4 / 2**20,
        "worker_peak_mb": max(r["peak_rss_mb"] for r in reports),
        "worker_beyond_training_mb": max(
            r["peak_rss_mb"] - r["training_state_mb"] for r in reports
        ),
    }


# ------------------------------------------------------------------ the command


def main(
    sizes: str = typer.Option("25M,85M", help=f"Model sizes, from {', '.join(SIZES)}."),
    codecs: str = typer.Option("fp32,int8", help="Codecs both ways: fp32, int8."),
    modes: str = typer.Option("sync", help="sync, streaming (4 fragments, delay 1)."),
    workers: int = typer.Option(2, help="Worker processes."),
    rounds: int = typer.Option(4, help="Rounds per configuration (the first is not counted)."),
    sync_every: int = typer.Option(4, help="H: inner steps per round."),
    device: str = typer.Option("cpu", help="cpu or cuda (the workers' device)."),
    out_dir: Path = typer.Option(RESULTS, help="Where model_scale.md and .json go."),
) -> None:
    """Measure rounds at real model sizes against loopback and a memory pass."""
    check_output_path(out_dir / "model_scale.json", "--out-dir")
    chosen = [s.strip() for s in sizes.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in SIZES]
    if unknown or not chosen:
        raise fail(f"--sizes must be from {', '.join(SIZES)}, got {sizes!r}")
    codec_list = [c.strip() for c in codecs.split(",") if c.strip()]
    if not codec_list or any(c not in CODECS for c in codec_list):
        raise fail(f"--codecs must be from {', '.join(CODECS)}, got {codecs!r}")
    mode_list = [m.strip() for m in modes.split(",") if m.strip()]
    if not mode_list or any(m not in ("sync", "streaming") for m in mode_list):
        raise fail(f"--modes must be from sync, streaming, got {modes!r}")
    if workers < 1 or rounds < 2 or sync_every < 1:
        raise fail("--workers and --sync-every must be >= 1 and --rounds >= 2")
    if "streaming" in mode_list and sync_every % 4:
        raise fail(f"--modes streaming needs --sync-every divisible by 4, got {sync_every}")
    if device not in ("cpu", "cuda"):
        raise fail(f"--device must be cpu or cuda, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise fail("--device cuda: torch sees no CUDA device on this machine")
    check_output_path(out_dir / "model_scale.json", "--out-dir")
    results = []
    with tempfile.TemporaryDirectory(prefix="diloco-model-scale-") as scratch:
        for size in chosen:
            for codec in codec_list:
                for mode in mode_list:
                    err.print(f"{size} {codec} {mode}: {workers} workers x {rounds} rounds ...")
                    started = time.perf_counter()
                    row = run_one(
                        size, codec, mode, workers, rounds, sync_every, device, Path(scratch)
                    )
                    err.print(
                        f"  blocked {row['blocked_seconds']:.2f} s a round, "
                        f"{row['ratio_to_limit']:.1f}x the limit "
                        f"({time.perf_counter() - started:.0f} s)"
                    )
                    results.append(row)
    document = {
        "machine": {
            "platform": platform.platform(),
            "cores": machine_cores(),
            "torch": torch.__version__,
        },
        "results": results,
    }
    write_json(out_dir / "model_scale.json", document)
    (out_dir / "model_scale.md").write_text(_markdown(document))
    headers, rows = _table(results)
    out.print(
        summary_table("Rounds at real model sizes (medians of the steady rounds)", headers, rows)
    )


def _table(results: list[dict]) -> tuple[list[str], list[list[object]]]:
    headers = [
        "model",
        "codec",
        "mode",
        "blocked s",
        "limit s (loopback + pass)",
        "ratio",
        "encode/upload/wait/download/apply s",
        "server fold/step/delta/checkpoint/commit s",
        "MB up/down",
        "server peak (x model)",
        "worker beyond training MB",
    ]
    rows = []
    for r in results:
        p, s = r["phases"], r["server_parts"]
        rows.append(
            [
                f"{r['size']} ({r['parameters'] / 1e6:.1f}M)",
                r["codec"],
                r["mode"],
                f"{r['blocked_seconds']:.2f}",
                f"{r['loopback_seconds']:.2f} + {r['memory_pass_seconds']:.3f}",
                f"{r['ratio_to_limit']:.1f}x",
                "/".join(f"{p[k]:.2f}" for k in ("encode", "upload", "wait", "download", "apply")),
                "/".join(
                    f"{s[k]:.2f}" for k in ("fold", "outer_step", "delta", "checkpoint", "commit")
                ),
                f"{r['bytes_up_per_round'] / 1e6:.0f}/{r['bytes_down_per_round'] / 1e6:.0f}",
                f"{r['server_peak_mb']:.0f} MB ({r['server_peak_mb'] / r['model_mb']:.1f}x)",
                f"{r['worker_beyond_training_mb']:.0f}",
            ]
        )
    return headers, rows


def _markdown(document: dict) -> str:
    headers, rows = _table(document["results"])
    machine = document["machine"]
    lines = [
        "# Rounds at real model sizes",
        "",
        "`python benchmarks/model_scale.py` (settings per row in model_scale.json): a real "
        "`diloco server --state-dir` and K real `DiLoCoWorker` processes of the bundled GPT; "
        "the limit is measured in the same run: a plain loopback socket moving the round's "
        "bytes, plus one memory pass over the fp32 model. The ratio is a worker's median "
        "blocked time per round over that limit. "
        f"Machine: {machine['cores']} cores, {machine['platform']}, torch {machine['torch']}.",
        "",
        "| " + " | ".join(headers) + " |",
        "|" + "---|" * len(headers),
    ]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    typer.run(main)
