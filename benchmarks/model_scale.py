"""Rounds at the model sizes users train, against the physical limits measured in the same run.

For each model size (the bundled byte-level GPT at 25M, 85M, 125M, 350M or 1B parameters),
codec and mode, one real `diloco server` (with --state-dir: every round durable; with
`--durability interval` only every checkpoint-every-th round, 10 by default, so a run shows
what the durable write costs) and K real
worker processes that train through the public `DiLoCoWorker` API (AdamW; by default batch 1,
context 16, so the training itself is short and the round is what is measured; a GPU run
gives real batches with --batch-size, --context and --dtype bf16). Per round it reports:
  - each worker's compute and blocked time (the share of its time its sync hook took: a sync
    round, or a streaming fragment's send and merge) and their sum, the round's wall time; in
    sync mode the blocked time split into encode, upload, wait (until the result is ready),
    download and apply (`DiLoCoWorker.last_round_phases`), in streaming mode into the
    fragments' sends, their merges' waits for the syncs in flight, and the rest of the merges;
  - the server's parts (its /metrics `diloco_round_part_seconds`): scan and fold per body,
    the wait for the last round's checkpoint (written in the background), the step log (the
    step's input made durable), outer step, delta coding, the whole commit (the result is out
    after it), and the background checkpoint itself;
  - bytes up and down per worker, and the peak RSS of the server and of each worker (the
    server's also beyond its RSS before any model, torch and the HTTP stack; a worker's beyond
    its training state: measured after its first optimizer step, before it joined);
and, measured in the same run on the same machine, the two physical limits of a round: the
time a plain loopback socket needs to move the round's bytes (K clients each send their upload
and receive their download through one process: the median of 5 rounds after one that
faults the buffers in; the lower median of two such series) and one memory pass over the
fp32 model (a copy at the server's thread budget), both once the run's dirty pages are
written back (os.sync). The headline ratio is
a worker's median blocked time over (loopback + memory pass); in sync mode, "last in" is the
same for the worker that began each round's sync last, which excludes the others' wait for
its training (on this 2-core machine the workers' training times differ by up to a second a
round, the server's work taking turns with one of them). Writes
benchmarks/results/model_scale.md and .json.

    python benchmarks/model_scale.py                                   # 25M and 85M
    python benchmarks/model_scale.py --sizes 85M --codecs int8 --rounds 3 --out-dir /tmp/ms
    python benchmarks/model_scale.py --device cuda --sizes 125M --codecs int8 --dtype bf16 \
        --batch-size 16 --context 256 --sync-every 100 --modes sync,streaming --max-seconds 120
"""

from __future__ import annotations

import itertools
import json
import multiprocessing as mp
import os
import platform
import re
import resource
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import typer
import urllib3

from diloco.commands.threads import machine_cores, split_cores
from diloco.console import check_output_path, err, fail, out, summary_table, write_json
from diloco.server.ops.launch import start_server, start_shards, stop_process
from wire import _memory_kb, raw_tcp  # benchmarks/ is sys.path[0]

RESULTS = Path(__file__).parent / "results"
CONTEXT = mp.get_context("spawn")
# width, depth of the bundled GPT (12 w^2 parameters a block, plus 256 w of embeddings)
# ("2M" is for the benchmark's own test: a round of it takes a fraction of a second)
SIZES = {
    "2M": (256, 2),
    "25M": (512, 8),
    "85M": (768, 12),
    "125M": (768, 18),
    "350M": (1024, 28),
    "1B": (2048, 20),
}
CODECS = {
    "fp32": [],
    "int8": ["--upload-codec", "int8", "--download-codec", "int8"],
}
PHASES = ("encode", "upload", "wait", "download", "apply", "other")
STREAMING_PHASES = ("send", "wait", "mix")
SERVER_PARTS = (
    "scan",
    "fold",
    "checkpoint_wait",
    "step_log",
    "step_log_wait",
    "outer_step",
    "delta",
    "commit",
    "checkpoint",
)


# ------------------------------------------------------------------ one worker process


def _empty_window(streaming: bool) -> dict[str, float]:
    """One window's sums (H steps): compute and blocked; streaming also splits blocked into
    send (a fragment's send on the training thread: coding its body, or with error feedback
    on an fp32 CPU anchor only a copy of its values, e' and the coding on its sync's thread
    and shown in wait if unfinished), wait (the merges waiting for their syncs) and mix
    (the rest of the merges), from the streamer's own counters: a step that both merges and
    sends (delay 0) has each part counted where it belongs."""
    extra = {"send": 0.0, "wait": 0.0, "mix": 0.0} if streaming else {}
    return {"compute": 0.0, "blocked": 0.0, **extra}


def _blocked_split(worker: object) -> dict[str, float]:
    """A streaming worker's blocked seconds so far by part (send, wait, mix:
    `FragmentStreamer.blocked_split`); empty for a sync worker."""
    streamer = getattr(worker, "streamer", None)
    return {} if streamer is None else streamer.blocked_split()


def _add_split(window: dict[str, float], before: dict[str, float], after: dict[str, float]) -> None:
    """Add what each part of a streaming worker's blocked time grew by in one step."""
    for part, seconds in after.items():
        window[part] += seconds - before[part]


def _rss_kb() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _worker(url: str, index: int, job: dict, path: str) -> None:
    """Train `rounds` windows of H steps (H: the server's) and write what they cost.

    Each step's time is split in two by an optimizer hook registered before the worker's own:
    compute (forward, backward, the optimizer's update; on a GPU up to a synchronize) and
    blocked (what the worker's sync hook then took: a sync round, or a streaming fragment's
    send and merge). The report is rewritten after every window, so a run cut short by its
    deadline still tells what it measured."""
    torch.set_num_threads(job["threads"])
    from diloco.models.gpt import GPTConfig
    from diloco.worker import DiLoCoWorker

    device = torch.device(job["device"])
    width, depth = SIZES[job["size"]]
    context, batch, sync_every = job["context"], job["batch_size"], job["sync_every"]
    config = GPTConfig(context=context, width=width, depth=depth, heads=max(1, width // 64))
    torch.manual_seed(0)
    model = config.build().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(index)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=job["dtype"] == "bf16")
    marks: dict[str, float] = {}

    def computed(*_args: object) -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        marks["computed"] = time.perf_counter()

    def step() -> tuple[float, float]:
        tokens = torch.randint(0, 256, (batch, context + 1), generator=generator).to(device)
        started = time.perf_counter()
        optimizer.zero_grad(set_to_none=False)  # part of the compute (a pass over the grads)
        with autocast:
            loss = config.loss(model, tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        optimizer.step()  # its hooks: `computed`, then the worker's sync
        ended = time.perf_counter()
        return marks["computed"] - started, ended - marks["computed"]

    optimizer.register_step_post_hook(computed)  # before the worker's: it runs first
    step()  # the training state (gradients, AdamW's moments) exists from here on
    training_state_kb = _rss_kb()
    worker = DiLoCoWorker(
        model,
        optimizer,
        url,
        worker_id=f"w{index}",
        result_wait=120,
        anchor_device=job["anchor_device"],
    )
    assert worker.client is not None
    report: dict = {"rounds": [], "windows": 0, "training_state_mb": training_state_kb / 1024}
    steady = {"compute": 0.0, "blocked": 0.0, "up": 0, "down": 0}
    window = _empty_window(worker.streamer is not None)
    for number in range(1, job["rounds"] * sync_every + 1):
        rounds_before, split_before = worker.rounds, _blocked_split(worker)
        compute, blocked = step()
        window["compute"] += compute
        window["blocked"] += blocked
        if worker.rounds != rounds_before:  # a sync round ended in this step's hook
            report["rounds"].append({**(worker.last_round_phases or {}), **window})
        elif worker.streamer is not None:  # a fragment sent or merged in this step's hook
            _add_split(window, split_before, _blocked_split(worker))
        if number % sync_every:
            continue
        if worker.streamer is not None:  # a streaming window: every fragment sent and merged
            report["rounds"].append(dict(window))
        stats = worker.client.stats
        if number <= job["warmup_rounds"] * sync_every:  # the start, then the warm-up
            sent, received = stats.bytes_sent, stats.bytes_received
        else:
            steady["compute"] += window["compute"]
            steady["blocked"] += window["blocked"]
            steady["up"], steady["down"] = stats.bytes_sent - sent, stats.bytes_received - received
        window = _empty_window(worker.streamer is not None)
        report.update(windows=number // sync_every, steady=steady, peak_rss_mb=_rss_kb() / 1024)
        # whole or not at all: a deadline may stop this process while the report is written
        Path(f"{path}.tmp").write_text(json.dumps(report))
        os.replace(f"{path}.tmp", path)
    worker.close(final_sync=False)


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


# The parts of a sync round's critical path that compute, in the order the round runs them:
# the last worker's upload coding, the server's scan and fold of its body, the outer step,
# the download delta's coding, the worker's apply (worker phases, then server parts)
CRITICAL_COMPUTE = (
    ("phases", "encode"),
    ("server_parts", "scan"),
    ("server_parts", "fold"),
    ("server_parts", "outer_step"),
    ("server_parts", "delta"),
    ("phases", "apply"),
)


def critical_compute(row: dict) -> dict[str, float] | None:
    """What a sync round's critical path spends computing, as the run measured it: each
    part's median (worker) or mean (server, per body for scan and fold: the last body's is on
    the path), by name; None for streaming, whose syncs overlap training and have no round
    to split. With the loopback time of the round's bytes it is what a round of sequential
    stages costs before HTTP, the disk and the processes' hand-offs add theirs."""
    if row["mode"] != "sync" or not row.get("phases"):
        return None
    return {part: row[where][part] for where, part in CRITICAL_COMPUTE}


def loopback_seconds(
    up: int, down: int, workers: int, rounds: int = 5, series: int = 2
) -> tuple[float, list[list[float]]]:
    """K clients each push `up` and pull `down` bytes through one process: the median of
    `rounds` rounds after a first one that faults the buffers in (as the server's and the
    workers' buffers are by the steady rounds measured), the lower of `series` such medians
    (on 2026-11-29, 5 of about 30 limits measured as one series came out 1.7-2.3x the
    others, each for a run's first configuration, the machine otherwise idle); and every
    series' rounds. The
    symmetric raw_tcp moves the larger of the two each way, a bound from above."""
    measured = [
        raw_tcp(max(up, down, 1), workers, rounds + 1)["round_seconds"] for _ in range(series)
    ]
    return min(statistics.median(times[1:]) for times in measured), measured


# ------------------------------------------------------------------ one configuration


def _server_parts(url: str) -> dict[str, dict[str, float]]:
    """Sum and count of each `diloco_round_part_seconds` part from the server's /metrics."""
    text = urllib3.PoolManager().request("GET", url + "/metrics", timeout=30).data.decode()
    parts: dict[str, dict[str, float]] = {}
    pattern = r'diloco_round_part_seconds_(sum|count)\{part="(\w+)"\} ([0-9.e+-]+)'
    for kind, part, value in re.findall(pattern, text):
        parts.setdefault(part, {})[kind] = float(value)
    return parts


def _parts_after_round(
    url: str, round_number: int, workers: list, deadline: float
) -> dict[str, dict[str, float]]:
    """The server's parts once it has committed `round_number` rounds (the warm-up ones, not
    counted, as the workers do not count theirs), read while the workers run."""
    while time.monotonic() < deadline and any(w.is_alive() for w in workers):
        parts = _server_parts(url)  # a round's parts are all in once its commit part is
        if parts.get("commit", {}).get("count", 0) >= round_number:
            return parts
        time.sleep(0.1)
    return {}


def _parts_since(
    parts: dict[str, dict[str, float]], before: dict[str, dict[str, float]]
) -> dict[str, dict[str, float]]:
    """Each part's sum and count since `before` was read."""
    return {
        part: {kind: value - before.get(part, {}).get(kind, 0.0) for kind, value in got.items()}
        for part, got in parts.items()
    }


def _bytes_moved(url: str) -> tuple[float, float]:
    """A server's tensor bytes received and sent so far (its /metrics)."""
    text = urllib3.PoolManager().request("GET", url + "/metrics", timeout=30).data.decode()
    found = dict(re.findall(r"^diloco_bytes_(in|out)_total ([0-9.e+-]+)$", text, re.M))
    return float(found.get("in", 0.0)), float(found.get("out", 0.0))


def run_one(
    size: str,
    codec: str,
    mode: str,
    settings: dict,
    scratch: Path,
    anchor_device: str = "auto",
    checkpoint_every: int | None = None,
    shards: int = 1,
    durability: str = "round",
    server_threads: int | None = None,
) -> dict:
    """One server (or `shards` sharded servers) and `workers` worker processes; the row of
    the results table. `server_threads`: the server's torch threads (None: 1 beside CPU
    workers, which take the other cores; up to 4 beside GPU workers)."""
    width, depth = SIZES[size]
    from diloco.models.gpt import GPTConfig

    with torch.device("meta"):  # counted, not allocated (1B would be 4 GB here)
        model = GPTConfig(context=settings["context"], width=width, depth=depth).build()
    parameters = sum(p.numel() for p in model.parameters())
    workers, device, sync_every = settings["workers"], settings["device"], settings["sync_every"]
    chosen_threads = server_threads
    if server_threads is None:
        server_threads = 1 if device == "cpu" else min(4, machine_cores())
    fragments = min(settings["fragments"], depth)
    mode_args = ["--mode", mode] + (
        ["--fragments", str(fragments), "--delay", str(settings["delay"])]
        if mode == "streaming"
        else []
    )
    directory = Path(tempfile.mkdtemp(dir=scratch))
    server_args = (
        "--sync-every",
        str(sync_every),
        "--threads",
        str(server_threads),
        "--heartbeat-timeout",
        "600",
        *CODECS[codec],
        *mode_args,
        *([] if checkpoint_every is None else ["--checkpoint-every", str(checkpoint_every)]),
        *("--durability", durability),
    )
    if shards == 1:
        server, url = start_server(
            directory / "port",
            "--state-dir",
            str(directory / "state"),
            *server_args,
            output=(directory / "server.log").open("wb"),
        )
        servers, urls = [server], [url]
    else:
        launched = start_shards(
            directory,
            shards,
            *server_args,
            per_shard=lambda i: ("--state-dir", str(directory / f"state-{i}")),
            output=lambda i: (directory / f"shard-{i}.log").open("wb"),
        )
        servers, urls = [p for p, _ in launched], [u for _, u in launched]
        server, url = servers[0], urls[0]
    # each server up, its torch and HTTP stack loaded, no model yet: what it holds regardless
    idle_mb = [_memory_kb(s.pid, "VmRSS") / 1024 for s in servers]
    job = {
        "size": size,
        "device": device,
        "threads": split_cores(workers + 1),
        "anchor_device": anchor_device,
        **{
            k: settings[k]
            for k in ("rounds", "warmup_rounds", "sync_every", "context", "batch_size", "dtype")
        },
    }
    cut_short = False
    group: list = []
    try:
        paths = [directory / f"w{i}.json" for i in range(workers)]
        group = [
            CONTEXT.Process(target=_worker, args=(url, i, job, str(paths[i])))
            for i in range(workers)
        ]
        for process in group:
            process.start()
        deadline = time.monotonic() + settings["max_seconds"]
        # the server's parts once the warm-up rounds have committed: only later ones count
        warm = _parts_after_round(url, settings["warmup_rounds"], group, deadline)
        for process in group:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
            if process.exitcode is None:  # past the deadline: what was written counts
                cut_short = True
                process.kill()
                process.join(timeout=30)
            elif process.exitcode != 0:
                raise RuntimeError(f"a worker failed (exit {process.exitcode}); see {directory}")
        final = _server_parts(url)
        parts = _parts_since(final, warm)
        peaks_mb = [_memory_kb(s.pid, "VmHWM") / 1024 for s in servers]
        server_peak_mb = max(peaks_mb)
        beyond_idle_mb = max(peak - idle for peak, idle in zip(peaks_mb, idle_mb, strict=True))
        shard_bytes = [_bytes_moved(u) for u in urls] if shards > 1 else []
    finally:  # (also when stopped: SIGTERM exits through here, see main)
        for process in group:
            if process.is_alive():
                process.kill()
                process.join(timeout=30)
        for process in servers:
            stop_process(process)
    reports = [json.loads(path.read_text()) for path in paths if path.exists()]
    windows = min((r["windows"] for r in reports), default=0)
    warmup = settings["warmup_rounds"]
    if len(reports) < workers or windows <= warmup:
        raise RuntimeError(
            f"{size} {codec} {mode}: no more than the {warmup} warm-up window(s) in "
            f"{settings['max_seconds']:g} s (--max-seconds); see {directory}"
        )
    steady_rounds = windows - warmup
    # the first round carries the start (joins, the first download), and the first rounds
    # grow the page cache (see --warmup-rounds): the steady ones count
    rounds = [r for report in reports for r in report["rounds"][warmup:]]
    up = int(statistics.median(r["steady"]["up"] for r in reports) / steady_rounds)
    down = int(statistics.median(r["steady"]["down"] for r in reports) / steady_rounds)
    # the run's dirty pages (step logs, checkpoints, spooled uploads) written back first: the
    # limits are measured on a machine at rest, not beside the kernel's writeback
    os.sync()
    loopback, loopback_rounds = loopback_seconds(up, down, workers)
    memory = memory_pass_seconds(parameters, server_threads)
    blocked = statistics.median(r["steady"]["blocked"] for r in reports) / steady_rounds
    last_in = last_in_blocked(reports, warmup) if mode == "sync" else None
    compute = statistics.median(r["steady"]["compute"] for r in reports) / steady_rounds
    row = {
        "size": size,
        "parameters": parameters,
        "codec": codec,
        "mode": mode,
        "fragments": fragments if mode == "streaming" else 1,
        "delay": settings["delay"] if mode == "streaming" else 0,
        **{k: settings[k] for k in ("workers", "sync_every", "device", "context", "batch_size")},
        "dtype": settings["dtype"],
        "anchor_device": anchor_device,
        "checkpoint_every": checkpoint_every,  # None: the server's default
        "durability": durability,
        "shards": shards,
        # sharded: each shard's tensor bytes in and out over the run, per round (the first
        # round's include the initial weights); server_peak_mb is then the largest shard's
        "shard_mb_per_round": [
            [round(b / 1e6 / windows, 1) for b in moved] for moved in shard_bytes
        ],
        "rounds": windows,
        "warmup_rounds": warmup,
        "cut_short": cut_short,
        "server_threads": server_threads,
        "server_threads_chosen": chosen_threads,  # None: the benchmark's default
        "worker_threads": job["threads"],
        "blocked_seconds": blocked,
        "compute_seconds": compute,
        "blocked_fraction": blocked / (blocked + compute) if blocked + compute else 0.0,
        # a worker's wall time per round: what streaming's overlap must shorten (a sync
        # hidden behind training that slows the training steps hides nothing)
        "round_seconds": compute + blocked,
        # sync mode: where a round's blocked time went
        "phases": {p: statistics.median(r.get(p, 0.0) for r in rounds) for p in PHASES}
        if rounds and mode == "sync"
        else None,
        # streaming: a window's blocked time split into its sends, its merges' waits for the
        # syncs in flight, and the rest of its merges (mixing, adopting the anchor)
        "streaming_phases": {
            p: statistics.median(r.get(p, 0.0) for r in rounds) for p in STREAMING_PHASES
        }
        if rounds and mode == "streaming"
        else None,
        # each worker's steady rounds (blocked, compute and the phases, seconds): the
        # headline is a mean, the phases medians, so a round slowed by the background
        # checkpoint, or a worker that waits for a slower one, shows here
        "steady_rounds": [
            [{k: round(v, 3) for k, v in r.items()} for r in report["rounds"][warmup:]]
            for report in reports
        ],
        # the server's commits in all, and those its parts count (after the warm-up ones)
        "server_commits": int(final.get("commit", {}).get("count", 0)),
        "server_commits_counted": int(parts.get("commit", {}).get("count", 0)),
        "server_parts": {
            part: parts.get(part, {}).get("sum", 0.0)
            / max(1.0, parts.get(part, {}).get("count", 0))
            for part in SERVER_PARTS
        },
        "bytes_up_per_round": up,
        "bytes_down_per_round": down,
        "loopback_seconds": loopback,
        "loopback_round_seconds": [[round(t, 4) for t in times] for times in loopback_rounds],
        "memory_pass_seconds": memory,
        "ratio_to_limit": blocked / (loopback + memory),
        # per round, the blocked time of the worker that began its sync last (the round's own
        # time: the others' extra is waiting for that worker's training), averaged over the
        # steady rounds; sync mode only (a streaming fragment's sync has no round to match)
        "last_in_blocked_seconds": last_in,
        "last_in_ratio_to_limit": None if last_in is None else last_in / (loopback + memory),
        "server_peak_mb": server_peak_mb,  # MiB, as model_mb
        # the peak less the process's RSS before any model (torch and the HTTP stack, about
        # 250 MiB): what the round's buffers take, the figure issue 29's 4x/5x targets read
        "server_idle_mb": max(idle_mb),
        "server_beyond_idle_mb": beyond_idle_mb,
        "model_mb": parameters * 4 / 2**20,
        "worker_peak_mb": max(r["peak_rss_mb"] for r in reports),
        "worker_beyond_training_mb": max(
            r["peak_rss_mb"] - r["training_state_mb"] for r in reports
        ),
    }
    return with_critical_compute(row)


def with_critical_compute(row: dict) -> dict:
    """`row` with its critical path's compute (`critical_compute`), their sum and the
    blocked time, and last in, over loopback plus that sum (sync rows; None otherwise)."""
    parts = critical_compute(row)
    total = None if parts is None else sum(parts.values())
    floor = None if total is None else row["loopback_seconds"] + total
    last_in = row.get("last_in_blocked_seconds")
    return {
        **row,
        "critical_compute_seconds": parts,
        "critical_compute_total_seconds": total,
        "ratio_to_loopback_and_compute": None if floor is None else row["blocked_seconds"] / floor,
        "last_in_ratio_to_loopback_and_compute": None
        if floor is None or last_in is None
        else last_in / floor,
    }


# ------------------------------------------------------------------ the command


def _keyword_or_counts(text: str, keyword: str, option: str) -> list[int | None]:
    """A comma-separated list of `keyword` (None: the default) and integers >= 1; anything
    else is one line and exit 2 naming `option`."""
    values: list[int | None] = []
    for item in (part.strip() for part in text.split(",")):
        if item == keyword:
            values.append(None)
        elif item.isdigit() and int(item) >= 1:
            values.append(int(item))
        else:
            raise fail(f"{option} must be '{keyword}' or integers >= 1, got {item!r}")
    return values


def main(
    sizes: str = typer.Option("25M,85M", help=f"Model sizes, from {', '.join(SIZES)}."),
    codecs: str = typer.Option("fp32,int8", help="Codecs both ways: fp32, int8."),
    modes: str = typer.Option("sync", help="sync, streaming (--fragments, --delay)."),
    fragments: int = typer.Option(
        4, help="Streaming: fragments (at most the model's blocks); 1 overlaps a whole sync."
    ),
    delay: int = typer.Option(1, help="Streaming: inner steps a sync overlaps (tau)."),
    workers: int = typer.Option(2, help="Worker processes."),
    rounds: int = typer.Option(
        4, help="Rounds per configuration (the --warmup-rounds first are not counted)."
    ),
    warmup_rounds: int = typer.Option(
        1,
        help="Rounds not counted: the first carries the start; the next few grow the "
        "server's page cache (its state dir's files), which costs far more on a fresh VM "
        "than the same writes once the cache has grown (a long run's steady state).",
    ),
    sync_every: int = typer.Option(4, help="H: inner steps per round."),
    device: str = typer.Option("cpu", help="cpu or cuda (the workers' device)."),
    dtype: str = typer.Option("fp32", help="fp32, or bf16 (autocast for the training steps)."),
    context: int = typer.Option(16, help="Tokens per sequence of a training step."),
    batch_size: int = typer.Option(1, help="Sequences per training step."),
    max_seconds: float = typer.Option(
        3600, help="Per configuration: past it the workers stop and what they measured counts."
    ),
    anchor_devices: str = typer.Option(
        "auto",
        help="Where the workers keep their anchor: auto (beside a GPU model when it fits), "
        "cpu; comma-separated to compare both in one run.",
    ),
    checkpoint_every: str = typer.Option(
        "server",
        help="Rounds between the server's full checkpoints: 'server' (its default) or N; "
        "comma-separated to compare in one run.",
    ),
    durability: str = typer.Option(
        "round",
        help="The server's --durability: round (every round durable before its result: the "
        "step log on the commit's path) or interval (no durable write on it: what a round "
        "costs without one); comma-separated to compare in one run.",
    ),
    shards: str = typer.Option(
        "1",
        help="Sharded servers (diloco server --shard) instead of one: S, or several to compare "
        "(e.g. 1,2,4); sync mode with the server's default checkpoints.",
    ),
    server_threads: str = typer.Option(
        "auto",
        help="The server's torch threads: auto (1 beside CPU workers, up to 4 beside GPU "
        "workers) or N; comma-separated to compare in one run.",
    ),
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
    if workers < 1 or sync_every < 1 or warmup_rounds < 1 or rounds <= warmup_rounds:
        raise fail(
            "--workers, --sync-every and --warmup-rounds must be >= 1 and --rounds above "
            f"--warmup-rounds, got {workers}, {sync_every}, {warmup_rounds} and {rounds}"
        )
    if fragments < 1 or delay < 0:
        raise fail(f"--fragments must be >= 1 and --delay >= 0, got {fragments} and {delay}")
    for size in chosen if "streaming" in mode_list else ():
        parts = min(fragments, SIZES[size][1])  # at most one fragment per block
        if sync_every % parts or delay >= sync_every // parts:
            raise fail(
                f"--modes streaming needs --sync-every divisible by the fragments ({parts} for "
                f"{size}) and --delay below --sync-every / fragments, got {sync_every} and "
                f"{delay}"
            )
    if device not in ("cpu", "cuda"):
        raise fail(f"--device must be cpu or cuda, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise fail("--device cuda: torch sees no CUDA device on this machine")
    anchor_list = [a.strip() for a in anchor_devices.split(",") if a.strip()]
    if not anchor_list or any(a not in ("auto", "cpu") for a in anchor_list):
        raise fail(f"--anchor-devices must be from auto, cpu, got {anchor_devices!r}")
    every_list = _keyword_or_counts(checkpoint_every, "server", "--checkpoint-every")
    durability_list = [d.strip() for d in durability.split(",") if d.strip()]
    if not durability_list or any(d not in ("round", "interval") for d in durability_list):
        raise fail(f"--durability must be from round, interval, got {durability!r}")
    shard_list = [s.strip() for s in shards.split(",") if s.strip()]
    if not shard_list or any(not s.isdigit() or int(s) < 1 for s in shard_list):
        raise fail(f"--shards must be integers >= 1, got {shards!r}")
    shard_counts = [int(s) for s in shard_list]
    if any(s > 1 for s in shard_counts) and (
        mode_list != ["sync"]
        or any(e is not None for e in every_list)
        or durability_list != ["round"]
    ):
        raise fail("--shards above 1 runs sync mode with default checkpoints and durability")
    thread_list = _keyword_or_counts(server_threads, "auto", "--server-threads")
    if dtype not in ("fp32", "bf16"):
        raise fail(f"--dtype must be fp32 or bf16, got {dtype!r}")
    if context < 1 or batch_size < 1 or not max_seconds > 0:
        raise fail("--context, --batch-size and --max-seconds must be positive")
    # `kill` (SIGTERM) ends the run through its `finally`, which stops the servers and the
    # workers: they hold gigabytes at these sizes and outlived a killed run before
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    settings = {
        "workers": workers,
        "rounds": rounds,
        "warmup_rounds": warmup_rounds,
        "sync_every": sync_every,
        "device": device,
        "dtype": dtype,
        "context": context,
        "batch_size": batch_size,
        "max_seconds": max_seconds,
        "fragments": fragments,
        "delay": delay,
    }
    check_output_path(out_dir / "model_scale.json", "--out-dir")
    results = []
    with tempfile.TemporaryDirectory(prefix="diloco-model-scale-") as scratch:
        for size in chosen:
            for codec in codec_list:
                for mode, anchor, every, count, durable, threads in itertools.product(
                    mode_list, anchor_list, every_list, shard_counts, durability_list, thread_list
                ):
                    err.print(
                        f"{size} {codec} {mode} (anchor {anchor}, checkpoint every "
                        f"{every or 'server default'}, {count} server(s), durability "
                        f"{durable}, server threads {threads or 'auto'}): {workers} workers x "
                        f"{rounds} rounds ..."
                    )
                    started = time.perf_counter()
                    try:
                        row = run_one(
                            size,
                            codec,
                            mode,
                            settings,
                            Path(scratch),
                            anchor,
                            every,
                            count,
                            durable,
                            threads,
                        )
                    except RuntimeError as exc:
                        raise fail(str(exc), code=1) from None
                    err.print(
                        f"  blocked {row['blocked_seconds']:.2f} s a round "
                        f"({100 * row['blocked_fraction']:.1f} % of the worker's time), "
                        f"{row['ratio_to_limit']:.1f}x the limit; {row['rounds']} rounds"
                        f"{' (cut short by --max-seconds)' if row['cut_short'] else ''} "
                        f"in {time.perf_counter() - started:.0f} s"
                    )
                    results.append(row)
    document = {
        "machine": {
            "platform": platform.platform(),
            "cores": machine_cores(),
            "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name() if device == "cuda" else None,
        },
        "results": results,
    }
    write_json(out_dir / "model_scale.json", document)
    (out_dir / "model_scale.md").write_text(_markdown(document))
    headers, rows = _table(results)
    out.print(
        summary_table("Rounds at real model sizes (medians of the steady rounds)", headers, rows)
    )


def last_in_blocked(reports: list[dict], warmup: int) -> float | None:
    """Per steady round (the n-th of every worker's), the blocked seconds of the worker that
    waited least for the result, the last to send (slow_link.py's "last in" rule), averaged
    over the rounds every worker reported; None without such a round or its waits."""
    rounds = [report["rounds"][warmup:] for report in reports]
    matched = min((len(r) for r in rounds), default=0)
    chosen = []
    for i in range(matched):
        figures = [r[i] for r in rounds]
        if not all("wait" in f for f in figures):
            return None
        chosen.append(min(figures, key=lambda f: f["wait"])["blocked"])
    return statistics.mean(chosen) if chosen else None


def _table(results: list[dict]) -> tuple[list[str], list[list[object]]]:
    headers = [
        "model",
        "codec",
        "mode",
        "device",
        "compute s",
        "blocked s",
        "blocked %",
        "round s (compute + blocked)",
        "limit s (loopback + pass)",
        "ratio",
        "critical-path compute s (ratio to loopback + it)",
        "encode/upload/wait/download/apply s (streaming: send/wait/mix s)",
        "server fold/wait/log/log wait/step/delta/commit s (background checkpoint)",
        "MB up/down",
        "server peak MiB (x model; beyond the idle process)",
        "worker beyond training MB",
    ]
    rows = []
    # name the server's threads when a row chose them (then every row, auto ones too)
    compared_threads = any(r.get("server_threads_chosen") is not None for r in results)
    for r in results:
        s = r["server_parts"]
        rows.append(
            [
                f"{r['size']} ({r['parameters'] / 1e6:.1f}M)",
                r["codec"],
                r["mode"]
                + (
                    f" ({r['fragments']} fragments, delay {r.get('delay', 1)})"
                    if r["mode"] == "streaming"
                    else ""
                ),
                f"{r['device']} {r['dtype']}"
                + (
                    f", anchor {r['anchor_device']}"
                    if r.get("anchor_device", "auto") != "auto"
                    else ""
                )
                + (
                    f", checkpoint every {r['checkpoint_every']}"
                    if r.get("checkpoint_every")
                    else ""
                )
                + (
                    f", durability {r['durability']}"
                    if r.get("durability", "round") != "round"
                    else ""
                )
                + (
                    f", server {_threads(r['server_threads'])}"
                    + (" (auto)" if r.get("server_threads_chosen") is None else "")
                    if compared_threads
                    else ""
                )
                + (
                    f", {r['shards']} shards (MB in/out per round: "
                    + ", ".join(f"{i:g}/{o:g}" for i, o in r["shard_mb_per_round"])
                    + ")"
                    if r.get("shards", 1) > 1
                    else ""
                ),
                f"{r['compute_seconds']:.2f}",
                f"{r['blocked_seconds']:.2f}",
                f"{100 * r['blocked_fraction']:.1f}",
                f"{r['compute_seconds'] + r['blocked_seconds']:.2f}",
                f"{r['loopback_seconds']:.2f} + {r['memory_pass_seconds']:.3f}",
                f"{r['ratio_to_limit']:.1f}x"
                + (
                    f" (last in {r['last_in_ratio_to_limit']:.1f}x)"
                    if r.get("last_in_ratio_to_limit") is not None
                    else ""
                ),
                f"{r['critical_compute_total_seconds']:.2f} "
                f"({r['ratio_to_loopback_and_compute']:.1f}x"
                + (
                    f", last in {r['last_in_ratio_to_loopback_and_compute']:.1f}x)"
                    if r.get("last_in_ratio_to_loopback_and_compute") is not None
                    else ")"
                )
                if r.get("critical_compute_total_seconds") is not None
                else "-",
                _phases_cell(r),
                "/".join(f"{s[k]:.2f}" for k in SERVER_PARTS[1:-1]) + f" ({s['checkpoint']:.2f})",
                f"{r['bytes_up_per_round'] / 1e6:.0f}/{r['bytes_down_per_round'] / 1e6:.0f}",
                f"{r['server_peak_mb']:.0f} ({r['server_peak_mb'] / r['model_mb']:.1f}x; "
                f"{r['server_beyond_idle_mb'] / r['model_mb']:.1f}x)",
                f"{r['worker_beyond_training_mb']:.0f}",
            ]
        )
    return headers, rows


def _threads(count: int) -> str:
    return f"{count} thread" + ("" if count == 1 else "s")


def _phases_cell(row: dict) -> str:
    """Sync: encode/upload/wait/download/apply; streaming: send/wait/mix (older results that
    have neither: -)."""
    sync, streaming = row.get("phases"), row.get("streaming_phases")
    if sync:
        return "/".join(f"{sync[k]:.2f}" for k in ("encode", "upload", "wait", "download", "apply"))
    if streaming:
        return "/".join(f"{streaming[k]:.2f}" for k in STREAMING_PHASES)
    return "-"


def _markdown(document: dict) -> str:
    headers, rows = _table(document["results"])
    machine = document["machine"]
    lines = [
        "# Rounds at real model sizes",
        "",
        "`python benchmarks/model_scale.py` (settings per row in model_scale.json): a real "
        "`diloco server --state-dir` and K real `DiLoCoWorker` processes of the bundled GPT; "
        "the limit is measured in the same run, once its dirty pages are written back: a "
        "plain loopback socket moving the round's bytes (the median of 5 rounds after a "
        "first that faults its buffers in, the lower of two such medians), plus one memory "
        "pass over the fp32 model. The "
        "ratio is a worker's median blocked time per round over that limit (in sync mode, "
        "last in: the blocked time of the worker that began each round's sync last, which "
        "excludes waiting for its training); blocked % is the "
        "share of a worker's time its sync hook took (compute: the training steps of a "
        "round, on a GPU up to a synchronize; round: compute plus blocked, a worker's wall "
        "time per round, which a sync overlapped with training shortens only if it does not "
        "slow the training steps). A streaming row splits its blocked time into the "
        "fragments' sends (coding a body on the training thread), their merges' waits for "
        "the syncs in flight, and "
        "the rest of the merges (mix). Critical-path compute (sync rows): what the "
        "round's own measurements give for its chain of sequential computing stages (the "
        "last worker's encode, the server's scan and fold of a body, the outer step, the "
        "delta's coding, the worker's apply), and the blocked time over loopback plus it: "
        "what HTTP, the disk and the hand-offs between processes add. "
        f"Machine: {machine['cores']} cores, {machine['platform']}, torch {machine['torch']}"
        + (f", {machine['gpu']}" if machine.get("gpu") else "")
        + ".",
        "",
        "| " + " | ".join(headers) + " |",
        "|" + "---|" * len(headers),
    ]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    typer.run(main)
