"""Load on sharded servers: K protocol workers x R rounds on 1, 2 and 4 shards (issue 15).

Each worker is a thread speaking the real protocol through the real clients (DiLoCoClient, or
ShardedClient over every shard): register, then every round submit a pseudo-gradient of the
model (seeded noise; no training, so the servers, not the workers' compute, are measured)
and wait for the round's result. Threads are spread over --procs worker processes. Servers
are real `diloco server` processes (`--shard I` for S > 1) on 127.0.0.1 with --init, sync
mode, --min-workers K, a --state-dir each (every round durable). Measured per S:
  - round time: one worker's submit-to-result time per round (with a barrier every worker
    waits for the last one: the round time), its mean, median and max; and the wall time of
    the whole run (worker start-up included);
  - per-shard bytes in and out (each server's /v1/status counters);
  - each server's RSS (VmRSS), sampled every 0.2 s: after the first 10 rounds and at the
    end, and its peak (flat = no growth with rounds).
Writes --json (default benchmarks/results/scale.json) and prints a table.

    python benchmarks/scale.py                              # 64 workers, 100 rounds, S = 1, 2, 4
    python benchmarks/scale.py --workers 8 --rounds 5 --shards 1,2 --json /tmp/s.json
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import typer
from safetensors.torch import save_file

from diloco.console import check_output_path, err, fail, out, summary_table, write_json
from diloco.server.launch import start_server, start_shards, stop_process
from diloco.wire import encode_tensors
from diloco.worker import DiLoCoClient, RetryPolicy
from diloco.worker.sharded_client import ShardedClient

RESULTS = Path(__file__).parent / "results"


def model(tensors: int, elements: int) -> dict[str, torch.Tensor]:
    """`tensors` fp32 tensors of `elements` values each, sizes staggered so shards differ."""
    generator = torch.Generator().manual_seed(0)
    return {
        f"layer{i:02d}.weight": torch.randn(elements + 64 * i, generator=generator)
        for i in range(tensors)
    }


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def worker_process(
    urls: list[str], first: int, count: int, rounds: int, init: Path, out_file: Path
):
    """`count` worker threads (ids first..first+count-1); per-round times to `out_file`."""
    from safetensors.torch import load_file

    weights = load_file(str(init))
    specs = [
        {"name": n, "shape": list(t.shape), "dtype": "float32", "kind": "trainable"}
        for n, t in weights.items()
    ]
    times: dict[str, list[float]] = {}
    errors: list[str] = []

    def client() -> DiLoCoClient | ShardedClient:
        retry = RetryPolicy(attempts=30)
        clients = [DiLoCoClient(url, retry=retry, read_timeout=600) for url in urls]
        return clients[0] if len(clients) == 1 else ShardedClient(clients)

    def run(index: int) -> None:
        worker_id = f"w{index:03d}"
        try:
            c = client()
            c.register(worker_id, specs)
            generator = torch.Generator().manual_seed(index)
            body = encode_tensors(
                {n: 1e-3 * torch.randn(t.shape, generator=generator) for n, t in weights.items()}
            )
            mine = times.setdefault(worker_id, [])
            for r in range(rounds):
                started = time.perf_counter()
                c.submit(r, worker_id, body, tokens=1)
                while c.wait_result(r, worker_id, wait=60) is None:
                    pass
                mine.append(time.perf_counter() - started)
            c.close()
        except Exception as exc:  # reported, and the benchmark fails
            errors.append(f"{worker_id}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=run, args=(first + i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    out_file.write_text(json.dumps({"times": times, "errors": errors}))


def measure(shards: int, workers: int, rounds: int, procs: int, init: Path, work: Path) -> dict:
    args = ("--sync-every", "1", "--min-workers", str(workers), "--heartbeat-timeout", "300",
            "--heartbeat-interval", "60", "--init", str(init))  # fmt: skip
    logs = [(work / f"s{shards}-shard{i}.log").open("ab") for i in range(shards)]
    if shards == 1:
        started = [
            start_server(
                work / "s1.port", *args, "--state-dir", str(work / "s1-state"), output=logs[0]
            )
        ]
    else:
        started = start_shards(
            work,
            shards,
            *args,
            per_shard=lambda i: ("--state-dir", str(work / f"s{shards}-state{i}")),
            output=lambda i: logs[i],
        )
    urls = [url for _, url in started]
    pids = [process.pid for process, _ in started]
    samples: list[list[int]] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.2):
            samples.append([rss_kib(pid) for pid in pids])

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    per_proc = [workers // procs + (1 if p < workers % procs else 0) for p in range(procs)]
    firsts = [sum(per_proc[:p]) for p in range(procs)]
    began = time.perf_counter()

    def spawn(p: int) -> subprocess.Popen:
        out_file = str(work / f"out-{shards}-{p}.json")
        role = json.dumps([urls, firsts[p], per_proc[p], rounds, str(init), out_file])
        return subprocess.Popen([sys.executable, __file__, "--role-worker", role])

    children = [spawn(p) for p in range(procs)]
    at_round_10 = None
    status = DiLoCoClient(urls[0], retry=RetryPolicy(attempts=5))
    try:
        while any(child.poll() is None for child in children):
            if at_round_10 is None and status.status()["round"] >= min(10, rounds):
                at_round_10 = [rss_kib(pid) for pid in pids]
            time.sleep(0.2)
        wall = time.perf_counter() - began
        stats = []
        for url in urls:
            with DiLoCoClient(url, retry=RetryPolicy(attempts=5)) as c:
                stats.append(c.status())
        end_rss = [rss_kib(pid) for pid in pids]
    finally:
        status.close()
        stop.set()
        for process, _ in started:
            stop_process(process)
    results = [json.loads((work / f"out-{shards}-{p}.json").read_text()) for p in range(procs)]
    errors = [e for r in results for e in r["errors"]]
    rounds_done = [s["round"] for s in stats]
    first_worker = results[0]["times"].get("w000", [])
    ordered = sorted(first_worker)
    peaks = [max(s[i] for s in samples) if samples else 0 for i in range(len(pids))]
    return {
        "shards": shards,
        "workers": workers,
        "rounds": rounds,
        "rounds_committed": rounds_done,
        "errors": errors,
        "wall_seconds": wall,
        # one worker's submit-to-result time, averaged: with a barrier, the round time
        "seconds_per_round": sum(first_worker) / len(first_worker) if first_worker else None,
        "worker_round_median_seconds": ordered[len(ordered) // 2] if ordered else None,
        "worker_round_max_seconds": ordered[-1] if ordered else None,
        "bytes_in_per_shard": [s["bytes_in"] for s in stats],
        "bytes_out_per_shard": [s["bytes_out"] for s in stats],
        "rss_kib_after_10_rounds": at_round_10,
        "rss_kib_end": end_rss,
        "rss_kib_peak": peaks,
    }


def main(
    workers: int = typer.Option(64, help="Protocol workers (threads)."),
    rounds: int = typer.Option(100, help="Rounds per shard count."),
    shards: str = typer.Option("1,2,4", help="Shard counts to measure, comma-separated."),
    procs: int = typer.Option(4, help="Worker processes the threads are spread over."),
    tensors: int = typer.Option(16, help="Tensors of the model."),
    elements: int = typer.Option(16384, help="Values per tensor (about)."),
    json_path: Path = typer.Option(RESULTS / "scale.json", "--json", help="Results file."),
    logs: Path = typer.Option(None, help="Keep the servers' logs and state here."),
    role_worker: str = typer.Option(None, hidden=True),
) -> None:
    if role_worker is not None:
        urls, first, count, n, init, out_file = json.loads(role_worker)
        worker_process(urls, first, count, n, Path(init), Path(out_file))
        return
    check_output_path(json_path, "--json")
    try:
        counts = [int(s) for s in shards.split(",")]
    except ValueError:
        raise fail(f"--shards must be integers separated by commas, got {shards!r}") from None
    if not all(1 <= s <= tensors for s in counts):
        raise fail(f"every --shards count must be in [1, --tensors {tensors}], got {shards}")
    if workers < 1 or rounds < 1 or not 1 <= procs <= workers:
        raise fail("--workers and --rounds must be >= 1, --procs in [1, --workers]")
    rows, measured = [], []
    with tempfile.TemporaryDirectory(prefix="diloco-scale-") as temporary:
        work = Path(temporary) if logs is None else logs
        work.mkdir(parents=True, exist_ok=True)
        init = work / "init.safetensors"
        weights = model(tensors, elements)
        save_file(weights, str(init))
        model_bytes = sum(t.numel() * 4 for t in weights.values())
        for count in counts:
            err.print(f"S = {count}: {workers} workers x {rounds} rounds ...")
            result = measure(count, workers, rounds, procs, init, work)
            result["model_bytes"] = model_bytes
            measured.append(result)
            if result["errors"]:
                err.print(f"errors: {result['errors'][:5]}")
            rows.append([
                count,
                f"{result['seconds_per_round']:.3f}",
                f"{result['worker_round_median_seconds']:.3f}",
                " / ".join(f"{b / 1e6:.0f}" for b in result["bytes_in_per_shard"]),
                " / ".join(f"{b / 1e6:.0f}" for b in result["bytes_out_per_shard"]),
                " / ".join(f"{k / 1024:.0f}" for k in result["rss_kib_after_10_rounds"] or []),
                " / ".join(f"{k / 1024:.0f}" for k in result["rss_kib_end"]),
                len(result["errors"]),
            ])  # fmt: skip
    columns = ["S", "s/round", "worker median s", "MB in/shard", "MB out/shard",
               "RSS MiB @10", "RSS MiB end", "errors"]  # fmt: skip
    title = f"{workers} workers x {rounds} rounds, model {model_bytes / 1e6:.1f} MB"
    out.print(summary_table(title, columns, rows))
    write_json(json_path, {"workers": workers, "rounds": rounds, "results": measured})
    if any(r["errors"] or r["rounds_committed"] != [rounds] * r["shards"] for r in measured):
        raise fail("some rounds failed: see errors in the JSON")


if __name__ == "__main__":
    typer.run(main)
