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
Then the model on paper (`traffic_model`, `memory_model`) is checked against the measured
points and carried to internet scale. Writes scale.json and scale.md to --out-dir (default
benchmarks/results) and prints a table.

    python benchmarks/scale.py                              # 64 workers, 100 rounds, S = 1, 2, 4
    python benchmarks/scale.py --workers 8 --rounds 5 --shards 1,2 --out-dir /tmp
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
from diloco.server.ops.launch import start_server, start_shards, stop_process
from diloco.wire import encode_tensors
from diloco.worker import DiLoCoClient, RetryPolicy
from diloco.worker.net.sharded_servers import ShardedClient

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
    urls: list[str], first: int, count: int, rounds: int, init: Path, out_file: Path, mode: str
):
    """`count` worker threads (ids first..first+count-1); per-round times to `out_file`. In
    async mode a "round" is one arrival: sent for the version of the worker's last result."""
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
        return clients[0] if len(clients) == 1 else ShardedClient(clients, mode=mode)

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
            version = 0  # the round (sync), or the version of our last result (async)
            for r in range(rounds):
                started = time.perf_counter()
                c.submit(version, worker_id, body, tokens=1)
                while (got := c.wait_result(version, worker_id, wait=60)) is None:
                    pass
                version = got.round if mode == "async" else r + 1
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


def measure(
    shards: int,
    workers: int,
    rounds: int,
    procs: int,
    init: Path,
    work: Path,
    mode: str = "sync",
    grace: float = 0.0,
) -> dict:
    steps = (
        ("--mode", "async", "--grace-seconds", str(grace))
        if mode == "async"
        else ("--min-workers", str(workers))
    )
    args = ("--sync-every", "1", *steps, "--heartbeat-timeout", "300",
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
        role = json.dumps([urls, firsts[p], per_proc[p], rounds, str(init), out_file, mode])
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


# ----------------------------------------------------------------- the model on paper

GB = 1e9


def traffic_model(workers: int, model_bytes: float, shards: int) -> float:
    """Bytes one shard receives per round (and sends: full weights back): every worker sends
    each shard its 1/S of the model, so N M / S, headers and JSON aside."""
    return workers * model_bytes / shards


def round_comm_seconds(
    workers: int, model_bytes: float, shards: int, shard_gbps: float, worker_gbps: float
) -> float:
    """The communication part of a round: the busier of a shard's link (N M / S each way)
    and a worker's link (M each way, in parallel over the shards), full duplex."""
    shard_link = traffic_model(workers, model_bytes, shards) / (shard_gbps * GB / 8)
    worker_link = model_bytes / (worker_gbps * GB / 8)
    return max(shard_link, worker_link)


def memory_model(params: float, shards: int) -> float:
    """Bytes of RAM one shard needs for its part: fp32 masters, outer momentum and running
    sum, and the encoded result (fp32): 16 P / S; uploads spool to disk (--memory-bodies 0)."""
    return 16 * params / shards


def markdown(workers: int, rounds: int, measured: list[dict]) -> str:
    model_bytes = measured[0]["model_bytes"]
    lines = [
        "# Sharded servers: load and scale (issue 15)",
        "",
        f"Measured by `python benchmarks/scale.py` on this machine (2 cores, loopback): "
        f"{workers} protocol workers (threads in {measured[0]['procs']} processes, the real "
        f"clients) x {rounds} "
        f"rounds of a {model_bytes / 1e6:.2f} MB fp32 model, sync mode, --min-workers "
        f"{workers}, every round durable (--state-dir). Every shard and every worker run on "
        "the same 2 cores, so the round time here measures CPU, not links.",
        "",
        "| S | s/round (mean) | worker median s | max s | MB in per shard | model N M / S MB "
        "| MB out per shard | RSS MiB @10 rounds | RSS MiB end | errors |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in measured:
        predicted = traffic_model(workers, model_bytes, r["shards"]) * rounds / 1e6
        lines.append(
            f"| {r['shards']} | {r['seconds_per_round']:.3f} | "
            f"{r['worker_round_median_seconds']:.3f} | {r['worker_round_max_seconds']:.3f} | "
            f"{' / '.join(f'{b / 1e6:.0f}' for b in r['bytes_in_per_shard'])} | "
            f"{predicted:.0f} | "
            f"{' / '.join(f'{b / 1e6:.0f}' for b in r['bytes_out_per_shard'])} | "
            f"{' / '.join(f'{k / 1024:.0f}' for k in r['rss_kib_after_10_rounds'] or [])} | "
            f"{' / '.join(f'{k / 1024:.0f}' for k in r['rss_kib_end'])} | {len(r['errors'])} |"
        )
    lines += [
        "",
        "## The model on paper",
        "",
        "- Traffic: a shard receives N M / S bytes per round (each worker's slice) and sends as "
        "much (the new weights); a worker sends and receives M, over S connections at once.",
        "- Round time: H t_step + max(N M / (S B_shard), M / B_worker) + the outer step "
        "(O(M / S) memory traffic per shard) + the decision (one confirm per worker, S - 1 "
        "small calls from shard 0, and one long-poll answer per follower).",
        "- Memory per shard: 16 P / S bytes (fp32 masters, momentum, running sum, encoded "
        "result); the K uploads of a round spool to disk, not RAM.",
        "",
        "## Internet scale, from the model",
        "",
        "N = 64 workers, fp32 uploads and downloads, full-duplex links: 10 Gbit/s per shard, "
        "1 Gbit/s per worker. Communication seconds per round (compute not counted):",
        "",
        "| params | S | RAM per shard GB | per-shard bytes per round GB | shard link s | "
        "worker link s | round comm s |",
        "|---|---|---|---|---|---|---|",
    ]
    for params in (1e9, 7e9, 70e9):
        for shards in (1, 4, 16):
            m = 4 * params
            shard_s = traffic_model(64, m, shards) / (10 * GB / 8)
            worker_s = m / (1 * GB / 8)
            lines.append(
                f"| {params / 1e9:.0f}B | {shards} | {memory_model(params, shards) / GB:.1f} | "
                f"{traffic_model(64, m, shards) / GB:.0f} | {shard_s:.0f} | {worker_s:.0f} | "
                f"{round_comm_seconds(64, m, shards, 10, 1):.0f} |"
            )
    lines += [
        "",
        "The shard link dominates while S < N B_worker / B_shard (64 x 1 / 10 = 6.4 here): "
        "from S = 7 shards on, the workers' own links are the bottleneck, and more shards buy "
        "no time (they still divide each shard's RAM). bf16 halves every byte figure; "
        "int8 uploads (docs/protocol.md, not yet with shards) divide the upload by about 4.",
        "",
    ]
    return "\n".join(lines)


def main(
    workers: int = typer.Option(64, help="Protocol workers (threads)."),
    rounds: int = typer.Option(100, help="Rounds per shard count."),
    shards: str = typer.Option("1,2,4", help="Shard counts to measure, comma-separated."),
    procs: int = typer.Option(4, help="Worker processes the threads are spread over."),
    tensors: int = typer.Option(16, help="Tensors of the model."),
    elements: int = typer.Option(16384, help="Values per tensor (about)."),
    out_dir: Path = typer.Option(RESULTS, help="Where scale.json and scale.md go."),
    logs: Path = typer.Option(None, help="Keep the servers' logs and state here."),
    mode: str = typer.Option(
        "sync", help="sync, or async (scale-async.json/.md: each worker's rounds are arrivals)"
    ),
    grace_seconds: float = typer.Option(0.0, help="async: the servers' --grace-seconds."),
    role_worker: str = typer.Option(None, hidden=True),
) -> None:
    if role_worker is not None:
        urls, first, count, n, init, out_file, role_mode = json.loads(role_worker)
        worker_process(urls, first, count, n, Path(init), Path(out_file), role_mode)
        return
    if mode not in ("sync", "async"):
        raise fail(f"--mode must be sync or async, got {mode!r}")
    name = "scale" if mode == "sync" else "scale-async"
    check_output_path(out_dir / f"{name}.json", "--out-dir")
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
            result = measure(count, workers, rounds, procs, init, work, mode, grace_seconds)
            result["model_bytes"] = model_bytes
            result["procs"] = procs
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
    write_json(
        out_dir / f"{name}.json",
        {"workers": workers, "rounds": rounds, "mode": mode, "grace_seconds": grace_seconds,
         "results": measured},
    )  # fmt: skip
    if mode == "sync":
        (out_dir / "scale.md").write_text(markdown(workers, rounds, measured))
    else:
        (out_dir / "scale-async.md").write_text(
            async_markdown(workers, rounds, grace_seconds, measured)
        )
    if any(r["errors"] or not complete(r, mode, rounds) for r in measured):
        raise fail("some rounds failed: see errors in the JSON")


def complete(result: dict, mode: str, rounds: int) -> bool:
    """Sync: every shard at the last round. Async: every shard at one version (the number of
    steps depends on how arrivals shared grace windows)."""
    committed = result["rounds_committed"]
    if mode == "sync":
        return committed == [rounds] * result["shards"]
    return len(set(committed)) == 1 and committed[0] > 0


def async_markdown(workers: int, rounds: int, grace: float, measured: list[dict]) -> str:
    model_bytes = measured[0]["model_bytes"]
    lines = [
        "# Sharded servers in async mode: load (issue 15)",
        "",
        f"Measured by `python benchmarks/scale.py --mode async --grace-seconds {grace:g} "
        f"--workers {workers} --rounds {rounds}` on this machine (2 cores, loopback): "
        f"{workers} protocol workers (threads in {measured[0]['procs']} processes, the real "
        f"clients), each sending {rounds} arrivals of a {model_bytes / 1e6:.2f} MB fp32 "
        "model, each arrival for the version of its last result; every step durable. "
        "Shards and workers share the 2 cores: the times measure CPU, not links.",
        "",
        "| S | steps (versions) | s per arrival (mean) | worker median s | max s | "
        "MB in per shard | MB out per shard | RSS MiB @10 | RSS MiB end | RSS MiB peak | "
        "errors |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in measured:
        lines.append(
            f"| {r['shards']} | {r['rounds_committed'][0]} | {r['seconds_per_round']:.3f} | "
            f"{r['worker_round_median_seconds']:.3f} | {r['worker_round_max_seconds']:.3f} | "
            f"{' / '.join(f'{b / 1e6:.0f}' for b in r['bytes_in_per_shard'])} | "
            f"{' / '.join(f'{b / 1e6:.0f}' for b in r['bytes_out_per_shard'])} | "
            f"{' / '.join(f'{k / 1024:.0f}' for k in r['rss_kib_after_10_rounds'] or [])} | "
            f"{' / '.join(f'{k / 1024:.0f}' for k in r['rss_kib_end'])} | "
            f"{' / '.join(f'{k / 1024:.0f}' for k in r['rss_kib_peak'])} | "
            f"{len(r['errors'])} |"
        )
    lines += [
        "",
        "Every arrival costs its worker S uploads, one confirmation on shard 0 (which asks "
        "the S - 1 others), and S downloads of one version; a follower keeps the 3 versions "
        "before its current one (M / S each) for those downloads. Bytes in per shard are N x "
        "arrivals x M / S as in sync mode; bytes out depend on how many versions the "
        "workers took.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    typer.run(main)
