"""Durability benchmark (first part): the price of a durable round, as a ratio.

Times `Coordinator.submit` of a one-worker round for a 25M-parameter fp32 model (100 MB), in
memory against `--state-dir` (weights and momentum written as an fsync'ed, checksummed
checkpoint generation before the result exists), and the checkpoint write throughput against a
plain write + fsync of the same bytes. Writes benchmarks/results/durability.md and .json.

    python benchmarks/durability.py
    python benchmarks/durability.py --parameters 1000000 --rounds 2 --out-dir /tmp/d
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import typer

from diloco.checkpoints import CheckpointStore
from diloco.console import check_output_path, err, fail, out, summary_table, write_json
from diloco.server.coordinator import Coordinator
from diloco.server.journal import RoundJournal
from diloco.server.settings import ServerSettings
from diloco.wire import encode_tensors, specs_of

RESULTS = Path(__file__).parent / "results"
TENSORS = 10


def round_seconds(state: dict, rounds: int, state_dir: Path | None) -> list[float]:
    settings = ServerSettings(sync_every=1)
    journal = RoundJournal(CheckpointStore(state_dir), settings) if state_dir else None
    coordinator = Coordinator(settings, state, journal=journal)
    coordinator.register("a", specs_of(state, dict.fromkeys(state, "trainable")), 1)
    times = []
    for number in range(rounds + 1):  # the first round creates the momentum: not timed
        gradient = {name: tensor * 1e-3 for name, tensor in state.items()}
        started = time.perf_counter()
        coordinator.submit("a", number, gradient)
        if number:
            times.append(time.perf_counter() - started)
    return times


def plain_write_seconds(data: bytearray, directory: Path) -> float:
    path = directory / "plain.bin"
    started = time.perf_counter()
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    elapsed = time.perf_counter() - started
    path.unlink()
    return elapsed


def main(
    parameters: int = typer.Option(25_000_000, help="Model size in fp32 parameters."),
    rounds: int = typer.Option(4, help="Timed rounds per setting (median reported)."),
    directory: Path = typer.Option(None, help="Where checkpoints go (default: a temp dir)."),
    out_dir: Path = typer.Option(RESULTS, help="Where durability.md and .json go."),
) -> None:
    check_output_path(out_dir / "durability.json", "--out-dir")
    if parameters < TENSORS or rounds < 1:
        raise fail("--parameters must be >= 10 and --rounds >= 1")
    generator = torch.Generator().manual_seed(0)
    state = {
        f"layer{i}.weight": torch.randn(parameters // TENSORS, generator=generator)
        for i in range(TENSORS)
    }
    model_mb = parameters // TENSORS * TENSORS * 4 / 1e6
    with tempfile.TemporaryDirectory(prefix="diloco-durability-", dir=directory) as scratch:
        memory = round_seconds(state, rounds, None)
        durable = round_seconds(state, rounds, Path(scratch) / "state")
        data = encode_tensors(state)
        plain = statistics.median(plain_write_seconds(data, Path(scratch)) for _ in range(3))
    m, d = statistics.median(memory), statistics.median(durable)
    checkpoint_mb = 2 * model_mb  # weights and momentum
    rows = [
        ["in memory", f"{m:.3f}", "1.0x", "-"],
        [
            "--state-dir (durable)",
            f"{d:.3f}",
            f"{d / m:.1f}x",
            f"{checkpoint_mb / max(d - m, 1e-9):.0f}",
        ],
        ["plain write + fsync of the weights", f"{plain:.3f}", "-", f"{model_mb / plain:.0f}"],
    ]
    columns = ["round", "seconds (median)", "vs in memory", "MB/s written"]
    out.print(summary_table(f"durability: {parameters:,} fp32 parameters", columns, rows))
    document = {
        "parameters": parameters,
        "model_mb": model_mb,
        "rounds": rounds,
        "memory_round_seconds": memory,
        "durable_round_seconds": durable,
        "plain_write_seconds": plain,
        "torch": torch.__version__,
    }
    write_json(out_dir / "durability.json", document)
    lines = [
        "# Durability: the price of a durable round",
        "",
        f"Command: `python benchmarks/durability.py` ({parameters:,} fp32 parameters, "
        f"{model_mb:.0f} MB; one worker; median of {rounds} rounds after the first; the "
        "checkpoint holds weights and momentum, so twice the model).",
        "",
        "| " + " | ".join(columns) + " |",
        "|" + "---|" * len(columns),
        *["| " + " | ".join(row) + " |" for row in rows],
        "",
        "The durable round's write rate is (checkpoint bytes) / (durable - in-memory round).",
        "",
    ]
    (out_dir / "durability.md").write_text("\n".join(lines))
    err.print(f"wrote {out_dir}/durability.md and durability.json")


if __name__ == "__main__":
    typer.run(main)
