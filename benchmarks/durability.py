"""Durability benchmark: the price of a durable round, restart time, checkpoint throughput.

1. A one-worker round (`Coordinator.submit` through the commit) for a 25M-parameter fp32
   model, in memory, with `--durability round` (a checkpoint of weights and momentum before
   every result) and with `--durability interval --checkpoint-every 10`; mean over 10 rounds.
2. Restart: a `diloco server --state-dir` process on a directory holding a 25M and a 100M
   model (weights + momentum), timed from launch to listening and to the first
   `GET /v1/weights` answered; and the in-process restore alone (verify + load).
3. Checkpoint write throughput (`CheckpointStore.write` of weights + momentum) against a plain
   write + fsync of the same bytes into two files.

Writes benchmarks/results/durability.md and .json.

    python benchmarks/durability.py
    python benchmarks/durability.py --parameters 1000000 --restart-sizes 1000000 --out-dir /tmp/d
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import typer

from diloco.console import (
    check_output_path,
    err,
    fail,
    number_list,
    out,
    summary_table,
    write_json,
)
from diloco.server.coordinator import Coordinator
from diloco.server.ops.launch import start_server, stop_process
from diloco.server.settings import ServerSettings
from diloco.server.state.journal import RoundJournal
from diloco.server.state.store import StateStore
from diloco.wire import encode_tensors, specs_of
from diloco.worker import DiLoCoClient, RetryPolicy

RESULTS = Path(__file__).parent / "results"
TENSORS = 10
SETTINGS = ServerSettings(sync_every=1)


def model(parameters: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        f"layer{i}.weight": torch.randn(parameters // TENSORS, generator=generator)
        for i in range(TENSORS)
    }


def coordinator_on(state: dict, state_dir: Path | None, **durability) -> Coordinator:
    journal = RoundJournal(StateStore(state_dir), SETTINGS, **durability)
    coordinator = Coordinator(SETTINGS, state, journal=journal)
    coordinator.register("a", specs_of(state, dict.fromkeys(state, "trainable")), 1)
    return coordinator


def round_seconds(state: dict, rounds: int, state_dir: Path | None, **durability) -> float:
    """Mean seconds of one round (submit through commit) after a first untimed one."""
    coordinator = coordinator_on(state, state_dir, **durability)
    gradients = [{n: t * 1e-3 for n, t in state.items()} for _ in range(2)]
    coordinator.submit("a", 0, gradients[0])  # creates the momentum: not timed
    started = time.perf_counter()
    for number in range(1, rounds + 1):
        coordinator.submit("a", number, {n: t.clone() for n, t in gradients[1].items()})
    elapsed = time.perf_counter() - started
    coordinator.shutdown()
    return elapsed / rounds


def restart_seconds(parameters: int, scratch: Path) -> dict[str, float]:
    """Launch-to-listening and launch-to-first-weights of a server resuming a state dir."""
    state_dir = scratch / f"restart-{parameters}"
    state = model(parameters)
    coordinator = coordinator_on(state, state_dir)
    coordinator.submit("a", 0, {n: t * 1e-3 for n, t in state.items()})  # momentum exists
    coordinator.shutdown()
    del coordinator, state
    started = time.perf_counter()
    journal = RoundJournal(StateStore(state_dir), SETTINGS)
    Coordinator(SETTINGS, journal=journal).shutdown()
    in_process = time.perf_counter() - started

    port_file = scratch / f"port-{parameters}"
    started = time.perf_counter()
    process, url = start_server(port_file, "--state-dir", str(state_dir), "--sync-every", "1")
    listening = time.perf_counter() - started
    try:
        with DiLoCoClient(url, retry=RetryPolicy(attempts=1), read_timeout=120) as client:
            body, round_number = client.get_weights()
        first_weights = time.perf_counter() - started
        assert round_number == 1 and len(body) > parameters * 4
    finally:
        stop_process(process)
    return {"in_process": in_process, "listening": listening, "first_weights": first_weights}


def write_throughput(state: dict, scratch: Path) -> tuple[float, float, int]:
    """Seconds for a checkpoint generation of weights + momentum, and for a plain write."""
    momentum = {n: t * 0.5 for n, t in state.items()}
    store = StateStore(scratch / "throughput").checkpoints
    assert store is not None
    checkpoint = []
    for generation in range(3):
        started = time.perf_counter()
        store.write(generation, {"weights": state, "outer_state": momentum}, {"round": 0})
        checkpoint.append(time.perf_counter() - started)
    blobs = [encode_tensors(state), encode_tensors(momentum)]
    plain = []
    for attempt in range(3):
        started = time.perf_counter()
        for index, blob in enumerate(blobs):
            path = scratch / f"plain-{attempt}-{index}.bin"
            with open(path, "wb") as handle:
                handle.write(blob)
                handle.flush()
                os.fsync(handle.fileno())
        plain.append(time.perf_counter() - started)
    return statistics.median(checkpoint), statistics.median(plain), sum(len(b) for b in blobs)


def main(
    parameters: int = typer.Option(25_000_000, help="Model size of the round timings."),
    rounds: int = typer.Option(10, help="Timed rounds per durability mode."),
    checkpoint_every: int = typer.Option(10, help="N of --durability interval."),
    restart_sizes: str = typer.Option(
        "25000000,100000000", help="Comma-separated model sizes for the restart timing."
    ),
    directory: Path = typer.Option(None, help="Where state dirs go (default: a temp dir)."),
    out_dir: Path = typer.Option(RESULTS, help="Where durability.md and .json go."),
) -> None:
    check_output_path(out_dir / "durability.json", "--out-dir")
    sizes = number_list(restart_sizes, "--restart-sizes")
    if parameters < TENSORS or rounds < 1 or checkpoint_every < 1:
        raise fail("--parameters must be >= 10, --rounds and --checkpoint-every >= 1")
    if any(size < TENSORS for size in sizes):
        raise fail("every --restart-sizes entry must be >= 10")
    state = model(parameters)
    model_mb = parameters // TENSORS * TENSORS * 4 / 1e6
    with tempfile.TemporaryDirectory(prefix="diloco-durability-", dir=directory) as scratch:
        root = Path(scratch)
        err.print("timing rounds: in memory, durability round, durability interval")
        memory = round_seconds(state, rounds, None)
        durable = round_seconds(state, rounds, root / "round")
        interval = round_seconds(
            state,
            rounds,
            root / "interval",
            durability="interval",
            checkpoint_every=checkpoint_every,
        )
        err.print("timing checkpoint writes")
        checkpoint, plain, nbytes = write_throughput(state, root)
        restarts = {}
        for size in sizes:
            err.print(f"timing a restart with {size:,} parameters")
            restarts[size] = restart_seconds(size, root)
    round_rows = [
        ["in memory (no --state-dir)", f"{memory:.3f}", "1.0x"],
        ["--durability round", f"{durable:.3f}", f"{durable / memory:.1f}x"],
        [
            f"--durability interval --checkpoint-every {checkpoint_every}",
            f"{interval:.3f}",
            f"{interval / memory:.1f}x",
        ],
    ]
    round_columns = ["mode", "seconds per round (mean)", "vs in memory"]
    out.print(
        summary_table(f"a round with {parameters:,} fp32 parameters", round_columns, round_rows)
    )
    restart_rows = [
        [
            f"{size:,} ({size * 4 * 2 / 1e6:,.0f} MB on disk)",
            f"{r['in_process']:.2f}",
            f"{r['listening']:.2f}",
            f"{r['first_weights']:.2f}",
        ]
        for size, r in restarts.items()
    ]
    restart_columns = [
        "parameters",
        "restore in process s",
        "launch to listening s",
        "launch to first weights s",
    ]
    out.print(summary_table("restart on an existing --state-dir", restart_columns, restart_rows))
    write_rows = [
        [
            "checkpoint generation (weights + momentum)",
            f"{checkpoint:.3f}",
            f"{nbytes / 1e6 / checkpoint:,.0f}",
        ],
        [
            "plain write + fsync, same bytes, 2 files",
            f"{plain:.3f}",
            f"{nbytes / 1e6 / plain:,.0f}",
        ],
    ]
    write_columns = ["write", "seconds (median of 3)", "MB/s"]
    out.print(summary_table(f"writing {nbytes / 1e6:,.0f} MB", write_columns, write_rows))
    document = {
        "parameters": parameters,
        "model_mb": model_mb,
        "rounds": rounds,
        "checkpoint_every": checkpoint_every,
        "round_seconds": {"memory": memory, "round": durable, "interval": interval},
        "durability_price_round": durable / memory,
        "durability_price_interval": interval / memory,
        "restart_seconds": {str(size): r for size, r in restarts.items()},
        "checkpoint_write_seconds": checkpoint,
        "plain_write_seconds": plain,
        "bytes_written": nbytes,
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
    }
    write_json(out_dir / "durability.json", document)

    def table(columns: list[str], rows: list[list[str]]) -> list[str]:
        return [
            "| " + " | ".join(columns) + " |",
            "|" + "---|" * len(columns),
            *["| " + " | ".join(row) + " |" for row in rows],
        ]

    lines = [
        "# Durability: the price of a durable round, restart time, checkpoint throughput",
        "",
        f"Command: `python benchmarks/durability.py` ({os.cpu_count()} CPUs; a checkpoint holds "
        "weights and momentum, so twice the model).",
        "",
        f"## A round with {parameters:,} fp32 parameters ({model_mb:.0f} MB), one worker",
        "",
        "Rounds back to back, with no training between them: each step waits for the last "
        "one's checkpoint (written in the background after its step log), so this is the "
        "disk's price of a round, not what a worker that trains between rounds waits for "
        "(that is benchmarks/model_scale.py's).",
        "",
        *table(round_columns, round_rows),
        "",
        "## Restart on an existing state dir",
        "",
        "Launch to listening includes starting Python and importing torch; the restore verifies "
        "every file's checksum (XXH3-128) before decoding it.",
        "",
        *table(restart_columns, restart_rows),
        "",
        "## Checkpoint write throughput",
        "",
        *table(write_columns, write_rows),
        "",
    ]
    (out_dir / "durability.md").write_text("\n".join(lines))
    err.print(f"wrote {out_dir}/durability.md and durability.json")


if __name__ == "__main__":
    typer.run(main)
