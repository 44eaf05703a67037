"""Convergence benchmark: data-parallel against DiLoCo (K = 4, H in {10, 50, 200}), equal tokens.

A single worker with the same steps shows what the K - 1 extra workers buy. Every run trains
from the same initial weights on the same per-worker shards (fixed seeds) for the same number
of inner steps per worker, so the runs differ only in how often they talk. DiLoCo gets enough
outer steps for Nesterov momentum to matter (100 rounds at H = 50), and each H is run at several
outer learning rates: the best one depends on H and K ("Scaling Laws for DiLoCo", Charles et
al. 2025, arXiv 2503.09799, find it independent of model size but not of the replica count).
Writes <out>/convergence.md, .json and .png.

    python benchmarks/convergence.py                  # full run (Shakespeare, ~25 min, 2 cores)
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
from diloco.sim import SimConfig, prepare, total_inner_steps
from diloco.sim.jobs import run_configs, threads_per_job

RESULTS = Path(__file__).parent / "results"


def main(
    steps: int = typer.Option(5000, help="Inner steps per worker (equal tokens in every run)."),
    workers: int = typer.Option(4, help="K workers."),
    sync_every: str = typer.Option("10,50,200", help="Comma-separated H values for DiLoCo."),
    outer_lr: str = typer.Option(
        "0.7,1.0,1.3", help="Comma-separated outer learning rates, each run at every H."
    ),
    width: int = typer.Option(64, help="Model width."),
    depth: int = typer.Option(2, help="Transformer blocks."),
    seq_len: int = typer.Option(64, help="Bytes per sequence (= model context)."),
    batch_size: int = typer.Option(8, help="Sequences per step per worker."),
    eval_every: int = typer.Option(250, help="Inner steps between evaluations."),
    jobs: int = typer.Option(2, help="Runs trained side by side (one process each)."),
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
    lr_values = number_list(outer_lr, "--outer-lr", float)
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
            eval_every=eval_every,
        )
        configs = [SimConfig(mode="ddp", **base), SimConfig(mode="single", **base)]
        configs += [
            SimConfig(mode="diloco", sync_every=h, outer_lr=lr, **base)
            for h in h_values
            for lr in lr_values
        ]
        for config in configs:
            prepare(config, data)
    except (ValueError, CorpusError) as exc:
        raise fail(str(exc)) from None

    started = time.perf_counter()
    total = sum(total_inner_steps(c) for c in configs)
    with progress_bar(f"{len(configs)} runs, {jobs} at a time", total) as advance:
        runs = run_configs(configs, jobs, advance, data)
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
        "outer": f"nesterov momentum 0.9, lr in {{{', '.join(map(str, lr_values))}}}",
        "eval_every": eval_every,
        "jobs": jobs,
        "torch": torch.__version__,
        "machine": f"{platform.machine()}, {jobs} runs at a time with "
        f"{threads_per_job(jobs) if jobs > 1 else torch.get_num_threads()} torch thread(s) each",
        "total_seconds": round(total_seconds, 1),
    }
    write_results({"setup": setup, "runs": runs}, out_dir)


def _best_per_h(runs: list[dict]) -> dict[int, dict]:
    """For each H, its DiLoCo run with the lowest final eval loss (over the outer lr sweep)."""
    best: dict[int, dict] = {}
    for run in runs:
        h = run["sync_every"]
        if run["mode"] == "diloco" and (
            h not in best or run["final_eval_loss"] < best[h]["final_eval_loss"]
        ):
            best[h] = run
    return best


def write_results(document: dict, out_dir: Path) -> None:
    """Print the table and write convergence.json, .md and .png from one results document."""
    runs, setup = document["runs"], document["setup"]
    ddp = runs[0]
    best = _best_per_h(runs)
    rows = []
    for run in runs:
        sent = run["bytes_sent_per_worker"]
        diloco = run["mode"] == "diloco"
        rows.append(
            [
                f"{run['mode']} (K={run['workers']})",
                run["sync_every"] if diloco else "-",
                run["config"]["outer_lr"] if diloco else "-",
                f"{run['final_eval_loss']:.4f}" + (" (best)" if run is best.get(
                    run["sync_every"]) and diloco else ""),
                f"{run['final_eval_loss'] / ddp['final_eval_loss']:.3f}",
                f"{sent / 1e6:,.2f}",
                f"{ddp['bytes_sent_per_worker'] / sent:,.1f}x" if sent else "no traffic",
                run["outer_steps"],
                f"{run['wall_seconds']:.0f}",
            ]
        )  # fmt: skip
    columns = [
        "mode",
        "H",
        "outer lr",
        "final eval loss",
        "loss / ddp",
        "MB sent per worker",
        "less traffic than ddp",
        "outer steps",
        "seconds",
    ]
    out.print(summary_table("convergence", columns, rows))
    write_json(out_dir / "convergence.json", document)
    plotted = [r for r in runs if r["mode"] != "diloco"] + list(best.values())
    plot_runs(
        [{**r, "overrides": {"outer_lr": r["config"]["outer_lr"]}} if r["mode"] == "diloco"
         else r for r in plotted],
        out_dir / "convergence.png",
        title=f"K={setup['workers']}, {setup['steps_per_worker']} inner steps per worker, "
        f"{setup['corpus']} (DiLoCo: best outer lr per H)",
    )  # fmt: skip
    (out_dir / "convergence.md").write_text(_markdown(setup, columns, rows, _reading(runs)))
    err.print(f"wrote {out_dir}/convergence.md, .json, .png")


def _reading(runs: list[dict]) -> list[str]:
    """One line per H (its best outer lr) placing it between one worker and data-parallel."""
    ddp = next(r for r in runs if r["mode"] == "ddp")
    single = next(r for r in runs if r["mode"] == "single")
    lines = []
    for h, run in sorted(_best_per_h(runs).items()):
        gain = single["final_eval_loss"] - run["final_eval_loss"]
        gap = run["final_eval_loss"] / ddp["final_eval_loss"] - 1
        verdict = "better" if gain > 0 else "worse"
        lines.append(
            f"- H={h} (best outer lr {run['config']['outer_lr']}): {abs(gain):.3f} nats {verdict} "
            f"than one worker alone, {100 * gap:+.2f} % from data-parallel's eval loss, with "
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
