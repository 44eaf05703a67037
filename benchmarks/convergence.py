"""Convergence benchmark: data-parallel against DiLoCo (K = 4, H in {10, 50, 200}), equal tokens.

A single worker with the same steps shows what the K - 1 extra workers buy. Every run trains
from the same initial weights on the same per-worker shards (fixed seeds) for the same number
of inner steps per worker, so the runs differ only in how often they talk.
Writes <out>/convergence.md, .json and .png.

    python benchmarks/convergence.py                  # full run (Shakespeare, < 15 min, 2 cores)
    python benchmarks/convergence.py --steps 20 --corpus generated --out-dir /tmp/x  # smoke
"""

from __future__ import annotations

import platform
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
    progress_bar,
    read_results_json,
    summary_table,
    write_json,
)
from diloco.data import CorpusError, load_named_corpus
from diloco.models import GPTConfig
from diloco.plotting import plot_runs
from diloco.sim import SimConfig, simulate, total_inner_steps

RESULTS = Path(__file__).parent / "results"


def main(
    steps: int = typer.Option(1200, help="Inner steps per worker (equal tokens in every run)."),
    workers: int = typer.Option(4, help="K workers."),
    sync_every: str = typer.Option("10,50,200", help="Comma-separated H values for DiLoCo."),
    width: int = typer.Option(64, help="Model width."),
    depth: int = typer.Option(4, help="Transformer blocks."),
    seq_len: int = typer.Option(64, help="Bytes per sequence (= model context)."),
    batch_size: int = typer.Option(16, help="Sequences per step per worker."),
    lr: float = typer.Option(3e-3, help="Inner AdamW peak learning rate."),
    corpus: str = typer.Option("shakespeare", help="shakespeare, generated[:SEED] or a path."),
    seed: int = typer.Option(0, help="Seed shared by every run."),
    out_dir: Path = typer.Option(RESULTS, help="Where convergence.md/.json/.png go."),
    from_json: Path = typer.Option(
        None, help="Re-render the table and plot from an earlier convergence.json; no training."
    ),
) -> None:
    check_output_path(out_dir / "convergence.json", "--out-dir")
    if from_json is not None:
        document = read_results_json(from_json, ("setup", "runs"))
        write_results(document, out_dir)
        return
    h_values = number_list(sync_every, "--sync-every")
    try:
        data = load_named_corpus(corpus)
        model = GPTConfig(context=seq_len, width=width, depth=depth, heads=4)
        base = dict(
            workers=workers,
            steps=steps,
            batch_size=batch_size,
            seq_len=seq_len,
            lr=lr,
            model=model,
            corpus=corpus,
            seed=seed,
        )
        configs = [SimConfig(mode="ddp", **base), SimConfig(mode="single", **base)]
        configs += [SimConfig(mode="diloco", sync_every=h, **base) for h in h_values]
    except (ValueError, CorpusError) as exc:
        raise fail(str(exc)) from None

    started = time.perf_counter()
    runs = []
    for config in configs:
        label = config.mode if config.mode != "diloco" else f"diloco H={config.sync_every}"
        with progress_bar(label, total_inner_steps(config)) as advance:
            runs.append(simulate(config, corpus=data, progress=advance).to_json())
    total_seconds = time.perf_counter() - started

    setup = {
        "workers": workers,
        "steps_per_worker": steps,
        "batch_size": batch_size,
        "seq_len": seq_len,
        "model": model.to_dict(),
        "parameters": runs[0]["parameters"],
        "tokens_per_worker": runs[0]["tokens_per_worker"],
        "corpus": corpus,
        "seed": seed,
        "inner_lr": lr,
        "outer": "nesterov lr 0.7 momentum 0.9",
        "torch": torch.__version__,
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads",
        "total_seconds": round(total_seconds, 1),
    }
    write_results({"setup": setup, "runs": runs}, out_dir)


def write_results(document: dict, out_dir: Path) -> None:
    """Print the table and write convergence.json, .md and .png from one results document."""
    runs, setup = document["runs"], document["setup"]
    ddp = runs[0]
    rows = []
    for run in runs:
        sent = run["bytes_sent_per_worker"]
        rows.append(
            [
                f"{run['mode']} (K={run['workers']})",
                run["sync_every"] if run["mode"] == "diloco" else "-",
                f"{run['final_eval_loss']:.4f}",
                f"{run['final_eval_loss'] / ddp['final_eval_loss']:.3f}",
                f"{sent / 1e6:,.2f}",
                f"{ddp['bytes_sent_per_worker'] / sent:,.1f}x" if sent else "no traffic",
                run["outer_steps"],
                f"{run['wall_seconds']:.0f}",
            ]
        )
    columns = [
        "mode",
        "H",
        "final eval loss",
        "loss / ddp",
        "MB sent per worker",
        "less traffic than ddp",
        "outer steps",
        "seconds",
    ]
    out.print(summary_table("convergence", columns, rows))
    write_json(out_dir / "convergence.json", document)
    plot_runs(
        runs,
        out_dir / "convergence.png",
        title=f"K={setup['workers']}, {setup['steps_per_worker']} inner steps per worker, "
        f"{setup['corpus']}",
    )
    (out_dir / "convergence.md").write_text(_markdown(setup, columns, rows, _reading(runs)))
    err.print(f"wrote {out_dir}/convergence.md, .json, .png")


def _reading(runs: list[dict]) -> list[str]:
    """One line per DiLoCo run placing it between the single worker and data-parallel."""
    ddp = next(r for r in runs if r["mode"] == "ddp")
    single = next(r for r in runs if r["mode"] == "single")
    lines = []
    for run in runs:
        if run["mode"] != "diloco":
            continue
        gain = single["final_eval_loss"] - run["final_eval_loss"]
        gap = run["final_eval_loss"] - ddp["final_eval_loss"]
        verdict = "better" if gain > 0 else "worse"
        lines.append(
            f"- H={run['sync_every']}: {abs(gain):.3f} nats {verdict} than one worker alone, "
            f"{gap:+.3f} nats from data-parallel, with "
            f"{ddp['bytes_sent_per_worker'] / run['bytes_sent_per_worker']:,.0f}x less traffic "
            f"({run['outer_steps']} outer steps)."
        )
    return lines


def _markdown(setup: dict, columns: list[str], rows: list[list[object]], reading: list[str]) -> str:
    lines = [
        "# Convergence: data-parallel vs DiLoCo at equal tokens",
        "",
        "Command: `python benchmarks/convergence.py` (defaults below), run through `make bench`.",
        "",
        f"- model: byte-level GPT, width {setup['model']['width']}, depth "
        f"{setup['model']['depth']}, context {setup['seq_len']}, "
        f"{setup['parameters']:,} parameters",
        f"- data: corpus `{setup['corpus']}`, {setup['workers']} workers, each "
        f"{setup['steps_per_worker']} inner AdamW steps of {setup['batch_size']} x "
        f"{setup['seq_len']} bytes ({setup['tokens_per_worker']:,} tokens per worker); "
        "ddp takes the mean gradient of all workers' batches every step",
        f"- outer optimizer: {setup['outer']}; seed {setup['seed']}; inner lr "
        f"{setup['inner_lr']} with warm-up and cosine decay",
        "- bytes: DiLoCo sends fp32 pseudo-gradients up and receives fp32 weights once per "
        "round; ddp counts a ring all-reduce of fp32 gradients every step "
        "(2 (K - 1) / K of the model per worker and direction)",
        f"- machine: {setup['machine']}, torch {setup['torch']}; whole benchmark "
        f"{setup['total_seconds']} s",
        "",
        "| " + " | ".join(columns) + " |",
        "|" + "---|" * len(columns),
    ]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    lines += ["", "Reading (generated from the numbers above):", "", *reading]
    lines += ["", "![eval loss against steps and bytes](convergence.png)", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    typer.run(main)
