"""Rounds through a slow link, measured rather than projected: each worker behind its own link.

One real `diloco server` on 127.0.0.1 and K `diloco worker` processes of the bundled GPT, each
talking to the server through its own `LinkProxy` (benchmarks/shaped_link.py: a host's link of
`--mbps` each way and `--rtt-ms` round trip, shared by that worker's connections). For every
codec pair and mode the workers train the same steps from the same seed, so their eval losses
compare; per run:

- blocked per round: a worker's time in its sync hook in a round (`round_figures` of `diloco
  worker --json`; the median over its rounds but the first, which waits for the late
  joiners), mean over the workers; its ratio to fp32's in the same mode;
- last in (sync mode): per round, the blocked time of the worker that waited least for the
  result (the last to send: its wait is the server's commit, not the barrier), the mean over
  the rounds but the first, with its split (encode, upload, wait, download, apply); its ratio
  to fp32's. It is what a round's sync costs when the workers train at the same speed, as on
  machines of their own: here K workers train on the host's few shared cores and finish
  their windows seconds apart, and the mean above counts those seconds as blocked;
- wall per round: compute per round (the loop's time not blocked, over the rounds) + blocked;
- projection: what the paper arithmetic says a sync costs on this link: the round's bytes
  (up and down, the worker's own counters per round) over the rate, plus two round trips per
  exchange (the submission, the result);

Worker 0 starts first and the others once the server holds its initial weights: a worker
that registers before then uploads the whole model as well (the server keeps one), which on
a slow link costs each of them a model's transfer before training.
- hidden (streaming): the share of the same codec's sync-mode blocked time that streaming
  hides behind compute; and last in against last in (a streaming cycle's last in: the worker
  whose merges waited least for their syncs in that cycle, its sends and mixes counted);
- final eval loss and the run's wall time (time to that loss).

Writes benchmarks/results/slow_link.md and .json.

    python benchmarks/slow_link.py                   # K = 4, 25M, 100 Mbit/s, 50 ms (~30 min)
    python benchmarks/slow_link.py --size 2M --workers 2 --steps 8 --sync-every 4 --out-dir /tmp/s
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import subprocess
import tempfile
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path
from urllib.parse import urlsplit

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
from diloco.models.gpt import GPTConfig
from diloco.server.ops.launch import diloco_command, start_server, stop_process
from shaped_link import LinkProxy, LinkShape  # benchmarks/ is sys.path[0]

RESULTS = Path(__file__).parent / "results"
# the bundled GPT: width, depth (as benchmarks/model_scale.py sizes it)
SIZES = {"2M": (256, 2), "25M": (512, 8)}
CODECS = {
    "fp32": ("fp32", "fp32"),
    "int8": ("int8", "int8"),
    "int2": ("int2", "int2"),
    "topk:0.03+int2": ("topk:0.03+int2", "int2"),
    # top-k both ways: each step's delta to P goes out as top-k too (error feedback via P)
    "topk:0.03+int2/topk:0.03+int2": ("topk:0.03+int2", "topk:0.03+int2"),
}


def mode_args(mode: str, sync_every: int, fragments: int, delay: int, workers: int) -> list[str]:
    common = ["--sync-every", str(sync_every), "--min-workers", str(workers)]
    if mode == "sync":
        return common
    return [*common, "--mode", "streaming", "--fragments", str(fragments), "--delay", str(delay)]


def run_once(job: dict, scratch: Path) -> dict:
    """One server, K workers each behind its own shaped link; the workers' --json reports."""
    scratch.mkdir(parents=True, exist_ok=True)
    up, down = CODECS[job["codec"]]
    server_args = [
        *mode_args(job["mode"], job["sync_every"], job["fragments"], job["delay"], job["workers"]),
        *("--upload-codec", up, "--download-codec", down, "--threads", "1"),
    ]
    process, url = start_server(
        scratch / "port", *server_args, output=(scratch / "server.log").open("wb")
    )
    target = urlsplit(url)
    shape = LinkShape(job["mbps"], job["rtt_ms"])
    width, depth = SIZES[job["size"]]
    try:
        with ExitStack() as links:
            proxies = [
                links.enter_context(LinkProxy((target.hostname, target.port), shape))
                for _ in range(job["workers"])
            ]
            workers = []
            started = time.monotonic()
            for i, proxy in enumerate(proxies):
                if i == 1:
                    # the others join once w0's initial weights are in: every worker that
                    # registers before then uploads the whole model too (only one is kept)
                    wait_for_weights(url, workers[0])
                args = [
                    *("worker", "--server", proxy.url, "--worker-id", f"w{i}"),
                    *("--steps", str(job["steps"]), "--data-dispatch", "static"),
                    *("--shard", str(i), "--num-shards", str(job["workers"])),
                    *("--corpus", str(job["corpus"]), "--no-progress", "--threads", "1"),
                    *("--width", str(width), "--depth", str(depth), "--heads", "4"),
                    *("--seq-len", "64", "--batch-size", str(job["batch_size"])),
                    *("--eval-batches", "4", "--json", str(scratch / f"w{i}.json")),
                ]
                workers.append(
                    subprocess.Popen(
                        diloco_command(*args),
                        stdout=subprocess.DEVNULL,
                        stderr=(scratch / f"w{i}.log").open("wb"),
                    )
                )
            wait_for_all(workers, scratch)
            seconds = time.monotonic() - started
            carried = [(p.up.carried, p.down.carried) for p in proxies]
    finally:
        stop_process(process)
    reports = [json.loads((scratch / f"w{i}.json").read_text()) for i in range(job["workers"])]
    return {"reports": reports, "seconds": seconds, "carried": carried}


def wait_for_all(workers: list[subprocess.Popen], scratch: Path, timeout: float = 3600) -> None:
    """Until every worker has exited; the first that fails stops the others (a barrier would
    keep them waiting for it) and is reported with its log."""
    deadline = time.monotonic() + timeout
    try:
        while any(w.poll() is None for w in workers):
            failed = [i for i, w in enumerate(workers) if w.poll() not in (None, 0)]
            if failed or time.monotonic() > deadline:
                i = failed[0] if failed else 0
                log = (scratch / f"w{i}.log").read_text()[-3000:]
                raise RuntimeError(f"worker {i} failed or timed out: {log}")
            time.sleep(0.5)
        failed = [i for i, w in enumerate(workers) if w.returncode != 0]
        if failed:
            log = (scratch / f"w{failed[0]}.log").read_text()[-3000:]
            raise RuntimeError(f"worker {failed[0]} failed: {log}")
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
                worker.wait(timeout=30)


def wait_for_weights(url: str, first: subprocess.Popen, timeout: float = 600.0) -> None:
    """Until the server holds global weights (worker `first` uploads them)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if first.poll() is not None:
            raise RuntimeError(f"worker 0 exited ({first.returncode}) before uploading weights")
        with (
            contextlib.suppress(OSError, ValueError),
            urllib.request.urlopen(f"{url}/v1/info", timeout=5) as reply,
        ):
            if json.loads(reply.read())["model_fingerprint"] is not None:
                return
        time.sleep(0.2)
    raise RuntimeError(f"no global weights after {timeout:g} s")


def cycles(report: dict) -> list[dict]:
    """A worker's round figures; in streaming mode (a round is a cycle of every fragment)
    without the last line when there are others (close(): every fragment synced at once)."""
    figures = report["round_figures"]
    if report.get("mode") == "streaming" and len(figures) > 2:
        figures = figures[:-1]
    return figures


def per_round(report: dict, key: str, phase: str | None = None) -> float:
    """The median over a worker's rounds (`cycles`) of one figure (`phase`: of that part of
    its "phases" split), its first round left out when there are others (it waits for the
    late joiners)."""
    figures = cycles(report)
    chosen = figures[1:] or figures
    if phase is not None:
        return statistics.median(f[key].get(phase, 0.0) for f in chosen)
    return statistics.median(f[key] for f in chosen)


STREAMING_PHASES = ("send", "wait", "mix")


def streaming_split(reports: list[dict]) -> dict[str, float] | None:
    """A streaming round's blocked time by part (send: the sends on the training thread;
    wait: the merges waiting for their syncs; mix: the rest of the merges), each the mean
    over the workers of its median over their cycles; None for a sync run."""
    if any(r["mode"] != "streaming" for r in reports):
        return None
    return {
        p: statistics.mean(per_round(r, "phases", p) for r in reports) for p in STREAMING_PHASES
    }


def last_in(reports: list[dict]) -> tuple[float, dict[str, float]] | None:
    """The round's sync on its critical path: per round every worker ended (matched by the
    step it ended at; the first left out), the figures of the worker whose wait for the
    result was shortest (in streaming mode, per cycle, whose merges waited least for their
    syncs), its blocked seconds and their split, averaged over the rounds. None without
    every round's split."""
    by_step = [{f["step"]: f for f in cycles(r)} for r in reports]
    shared = sorted(set.intersection(*(set(steps) for steps in by_step)))  # the same rounds
    chosen = []
    for step in shared[1:] or shared:
        figures = [steps[step] for steps in by_step]
        if not all(f.get("phases") for f in figures):
            return None
        chosen.append(min(figures, key=lambda f: f["phases"]["wait"]))
    if not chosen:
        return None
    phases = STREAMING_PHASES if "send" in chosen[0]["phases"] else LAST_IN_PHASES
    split = {p: statistics.mean(f["phases"][p] for f in chosen) for p in phases}
    return statistics.mean(f["blocked_seconds"] for f in chosen), split


LAST_IN_PHASES = ("encode", "upload", "wait", "download", "apply")


def summarize(job: dict, run: dict) -> dict:
    reports = run["reports"]
    shape = LinkShape(job["mbps"], job["rtt_ms"])
    up = statistics.mean(per_round(r, "mb_up") * 1e6 for r in reports)
    down = statistics.mean(per_round(r, "mb_down") * 1e6 for r in reports)
    blocked = statistics.mean(per_round(r, "blocked_seconds") for r in reports)
    windows = max(1.0, job["steps"] / job["sync_every"])  # rounds of H steps (cycles)
    compute = statistics.mean(r["train_seconds"] - r["blocked_seconds"] for r in reports) / windows
    exchanges = 2 if job["mode"] == "sync" else 2 * job["fragments"]  # per round of H steps
    last = last_in(reports)
    return {
        **{k: job[k] for k in ("codec", "mode")},
        "rounds": [r["rounds"] for r in reports],
        "blocked_per_round": blocked,
        "wall_per_round": compute + blocked,
        "last_in_per_round": None if last is None else last[0],
        "last_in_phases": None if last is None else last[1],
        "streaming_phases": streaming_split(reports),
        "up_bytes_per_round": up,
        "down_bytes_per_round": down,
        "projected_per_round": shape.transfer_seconds(up + down, exchanges),
        "final_eval_loss": statistics.mean(r["final_eval_loss"] for r in reports),
        "run_seconds": run["seconds"],
        "link_bytes": run["carried"],
        "round_figures": [r["round_figures"] for r in reports],
    }


def main(
    size: str = typer.Option("25M", help=f"Bundled GPT size: {', '.join(SIZES)}."),
    workers: int = typer.Option(4, help="K worker processes, each behind its own link."),
    steps: int = typer.Option(
        120,
        help="Inner steps per worker per run (6 rounds at H = 20: the figures leave the first "
        "out, and one or two more rounds would leave them to whatever else ran then).",
    ),
    sync_every: int = typer.Option(20, help="H."),
    fragments: int = typer.Option(4, help="P for the streaming runs."),
    delay: int = typer.Option(4, help="tau for the streaming runs (inner steps a sync hides in)."),
    batch_size: int = typer.Option(2, help="Sequences of 64 bytes per inner step."),
    mbps: float = typer.Option(100.0, help="Each link's rate, each direction (Mbit/s)."),
    rtt_ms: float = typer.Option(50.0, help="Each link's round-trip time (ms)."),
    codecs: str = typer.Option(",".join(CODECS), help=f"From: {', '.join(CODECS)}."),
    modes: str = typer.Option("sync,streaming", help="sync and/or streaming."),
    out_dir: Path = typer.Option(RESULTS, help="Where slow_link.md and .json go."),
) -> None:
    check_output_path(out_dir / "slow_link.json", "--out-dir")
    chosen = [c.strip() for c in codecs.split(",") if c.strip()]
    chosen_modes = [m.strip() for m in modes.split(",") if m.strip()]
    if size not in SIZES:
        raise fail(f"--size must be one of {', '.join(SIZES)}, got {size!r}")
    if not chosen or any(c not in CODECS for c in chosen):
        raise fail(f"--codecs must name some of {', '.join(CODECS)}, got {codecs!r}")
    if not chosen_modes or any(m not in ("sync", "streaming") for m in chosen_modes):
        raise fail(f"--modes must be sync and/or streaming, got {modes!r}")
    if min(workers, steps, sync_every, fragments, batch_size) < 1 or delay < 0:
        raise fail("--workers, --steps, --sync-every, --fragments, --batch-size must be >= 1")
    if "streaming" in chosen_modes and (
        sync_every % fragments or delay >= sync_every // fragments or fragments > SIZES[size][1]
    ):
        raise fail("streaming needs P | H, tau < H / P and P <= the model's depth")
    try:
        LinkShape(mbps, rtt_ms)
    except ValueError as exc:
        raise fail(str(exc)) from None
    width, depth = SIZES[size]
    state = GPTConfig(context=64, width=width, depth=depth, heads=4).build().state_dict()
    params = sum(t.numel() for t in state.values() if t.is_floating_point())
    del state
    jobs = [
        {
            **{"size": size, "workers": workers, "steps": steps, "sync_every": sync_every},
            **{"fragments": fragments, "delay": delay, "batch_size": batch_size},
            **{"mbps": mbps, "rtt_ms": rtt_ms, "codec": codec, "mode": mode},
        }
        for mode in chosen_modes
        for codec in chosen
    ]
    results = []
    with tempfile.TemporaryDirectory(prefix="diloco-slow-link-") as scratch:
        corpus = Path(scratch) / "corpus.txt"
        corpus.write_bytes(generated_corpus(num_bytes=2_000_000, seed=1))
        with progress_bar("slow-link runs", len(jobs)) as advance:
            for index, job in enumerate(jobs):
                run = run_once({**job, "corpus": corpus}, Path(scratch) / str(index))
                results.append(summarize(job, run))
                advance(1)
    compare(results)
    document = {
        "setup": {**jobs[0], "codecs": chosen, "modes": chosen_modes, "parameters": params},
        "results": results,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()}",
        "torch": torch.__version__,
    }
    columns, rows = table(results)
    out.print(summary_table(f"Through {mbps:g} Mbit/s, {rtt_ms:g} ms", columns, rows))
    write_json(out_dir / "slow_link.json", document)
    (out_dir / "slow_link.md").write_text(markdown(document, columns, rows))
    err.print(f"wrote {out_dir}/slow_link.md and slow_link.json")


def compare(results: list[dict]) -> None:
    """Each result's figures against fp32's in its mode and against its own codec's sync
    run (the share streaming hides), written into it; runs absent from `results` give None.
    Also for a table merged from several runs' documents (a rerun's rows in place of older
    ones): ValueError for a mode and codec given twice, which would compare the wrong rows."""
    by = {(r["mode"], r["codec"]): r for r in results}
    if len(by) != len(results):
        raise ValueError("each mode and codec must come once in a table's results")
    for r in results:
        fp32 = by.get((r["mode"], "fp32"))
        r["blocked_vs_fp32"] = r["blocked_per_round"] / fp32["blocked_per_round"] if fp32 else None
        r["wall_vs_fp32"] = r["wall_per_round"] / fp32["wall_per_round"] if fp32 else None
        r["last_in_vs_fp32"] = (
            r["last_in_per_round"] / fp32["last_in_per_round"]
            if fp32 and r["last_in_per_round"] is not None and fp32["last_in_per_round"]
            else None
        )
        synced = by.get(("sync", r["codec"]))
        r["hidden"] = (
            1 - r["blocked_per_round"] / synced["blocked_per_round"]
            if r["mode"] == "streaming" and synced
            else None
        )
        r["hidden_last_in"] = (  # the same, last in against last in
            1 - r["last_in_per_round"] / synced["last_in_per_round"]
            if r["mode"] == "streaming"
            and synced
            and r["last_in_per_round"] is not None
            and synced["last_in_per_round"]
            else None
        )


def table(results: list[dict]) -> tuple[list[str], list[list[str]]]:
    columns = [
        "mode",
        "codec (up / down)",
        "blocked s / round",
        "x fp32",
        "last in s / round (x fp32)",
        "last in split s (sync: encode/upload/wait/download/apply; streaming: send/wait/mix)",
        "streaming send/wait/mix s (mean)",
        "projected s / round",
        "wall s / round",
        "x fp32 (wall)",
        "hidden by streaming",
        "MB up / down per round",
        "final eval loss",
        "run s",
    ]
    rows = []
    for r in results:
        up, down = CODECS[r["codec"]]
        rows.append(
            [
                r["mode"],
                f"{up} / {down}",
                f"{r['blocked_per_round']:.2f}",
                "-" if r["blocked_vs_fp32"] is None else f"{r['blocked_vs_fp32']:.2f}x",
                last_in_cell(r),
                "-"
                if r["last_in_phases"] is None
                else "/".join(f"{seconds:.2f}" for seconds in r["last_in_phases"].values()),
                "-"
                if not r.get("streaming_phases")
                else "/".join(f"{r['streaming_phases'][p]:.2f}" for p in STREAMING_PHASES),
                f"{r['projected_per_round']:.2f}",
                f"{r['wall_per_round']:.2f}",
                "-" if r["wall_vs_fp32"] is None else f"{r['wall_vs_fp32']:.2f}x",
                hidden_cell(r),
                f"{r['up_bytes_per_round'] / 1e6:.2f} / {r['down_bytes_per_round'] / 1e6:.2f}",
                f"{r['final_eval_loss']:.4f}",
                f"{r['run_seconds']:.0f}",
            ]
        )
    return columns, rows


def hidden_cell(r: dict) -> str:
    if r["hidden"] is None:
        return "-"
    last = r.get("hidden_last_in")
    return f"{100 * r['hidden']:.0f} %" + ("" if last is None else f" (last in {100 * last:.0f} %)")


def last_in_cell(r: dict) -> str:
    if r["last_in_per_round"] is None:
        return "-"
    ratio = "" if r["last_in_vs_fp32"] is None else f" ({r['last_in_vs_fp32']:.3f}x)"
    return f"{r['last_in_per_round']:.2f}{ratio}"


def markdown(document: dict, columns: list[str], rows: list[list[str]]) -> str:
    s = document["setup"]
    command = (
        f"python benchmarks/slow_link.py --size {s['size']} --workers {s['workers']} "
        f"--steps {s['steps']} --sync-every {s['sync_every']} --fragments {s['fragments']} "
        f"--delay {s['delay']} --batch-size {s['batch_size']} --mbps {s['mbps']:g} "
        f"--rtt-ms {s['rtt_ms']:g}"
    )
    return "\n".join(
        [
            "# Rounds through a slow link, measured",
            "",
            f"Command: `{command}` ({document['machine']}, torch {document['torch']}).",
            "",
            f"- {s['workers']} `diloco worker` processes of the bundled GPT "
            f"({s['parameters']:,} parameters), each behind its own {s['mbps']:g} Mbit/s, "
            f"{s['rtt_ms']:g} ms link (benchmarks/shaped_link.py), one `diloco server`; "
            f"H = {s['sync_every']}, {s['steps']} steps, streaming P = {s['fragments']}, "
            f"tau = {s['delay']}; one core each.",
            "- blocked: the workers' time in their sync hook per round (mean); last in: "
            "per round, the blocked time of the worker that waited least for the result (sync: "
            "the last to send; streaming: per cycle, the one whose merges waited least), the "
            "round's sync cost when workers train at the same speed, and its split; the mean "
            "also counts the seconds that workers sharing this host's cores wait for the "
            "slowest at the barrier; streaming send/wait/mix: a cycle's sends on the training "
            "thread, its merges' waits for their syncs and the rest of its merges, each the "
            "mean over the workers of its median; projected: the "
            "round's bytes over the link's rate plus two round trips per exchange, the paper "
            "arithmetic; hidden: the share of the same codec's sync-mode blocked time that "
            "streaming hides (mean against mean, and last in against last in).",
            "",
            "| " + " | ".join(columns) + " |",
            "|" + "---|" * len(columns),
            *["| " + " | ".join(row) + " |" for row in rows],
            "",
        ]
    )


if __name__ == "__main__":
    typer.run(main)
