"""Convergence benchmark: data-parallel against DiLoCo (K = 4, H in {10, 50, 200}), equal tokens,
best against best.

A single worker with the same steps shows what the K - 1 extra workers buy. Every run trains
from the same initial weights on the same per-worker shards (fixed seeds) for the same number
of inner steps per worker, so the runs differ only in how often they talk. Each mode is tuned
before it is compared: data-parallel, one worker and DiLoCo at each H each run over a grid of
inner learning rates (`--ddp-lr`, `--single-lr`, `--diloco-lr`; a larger batch of K workers'
gradients takes a larger lr), DiLoCo also over outer learning rates (the best one depends on H
and K: "Scaling Laws for DiLoCo", Charles et al. 2025, arXiv 2503.09799), and the table and
the reading compare each mode's best run with data-parallel's best run. A best run on the edge
of its grid is flagged: a wider grid might find a better one. DiLoCo gets enough outer steps
for Nesterov momentum to matter (100 rounds at H = 50). Writes <out>/convergence.md, .json, .png.

    python benchmarks/convergence.py                  # full run (Shakespeare, 2 cores)
    python benchmarks/convergence.py --steps 20 --corpus generated --out-dir /tmp/x  # smoke
"""

from __future__ import annotations

import platform
import shlex
import sys
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
        "0.7,1.0", help="Comma-separated outer learning rates, each run at every H."
    ),
    width: int = typer.Option(64, help="Model width."),
    depth: int = typer.Option(2, help="Transformer blocks."),
    seq_len: int = typer.Option(64, help="Bytes per sequence (= model context)."),
    batch_size: int = typer.Option(8, help="Sequences per step per worker."),
    eval_every: int = typer.Option(250, help="Inner steps between evaluations."),
    jobs: int = typer.Option(2, help="Runs trained side by side (one process each)."),
    lr: str = typer.Option(
        "0.003", help="Inner AdamW peak learning rates, comma-separated: every mode's grid."
    ),
    ddp_lr: str = typer.Option(
        "0.006,0.012,0.024", help="Data-parallel's inner lr grid ('': --lr's)."
    ),
    single_lr: str = typer.Option(
        "0.0015,0.003,0.006", help="One worker's inner lr grid ('': --lr's)."
    ),
    diloco_lr: str = typer.Option(
        "0.0015,0.003,0.006", help="DiLoCo's inner lr grid ('': --lr's)."
    ),
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
    every = number_list(lr, "--lr", float)
    grids = {
        mode: every if not given.strip() else number_list(given, option, float)
        for mode, given, option in (
            ("ddp", ddp_lr, "--ddp-lr"),
            ("single", single_lr, "--single-lr"),
            ("diloco", diloco_lr, "--diloco-lr"),
        )
    }
    try:
        data = load_named_corpus(corpus)
        model = GPTConfig(context=seq_len, width=width, depth=depth, heads=4)
        base = dict(
            workers=workers,
            steps=steps,
            batch_size=batch_size,
            seq_len=seq_len,
            model=model,
            corpus=corpus,
            seed=seed,
            eval_every=eval_every,
        )
        configs = [SimConfig(mode="ddp", lr=inner, **base) for inner in grids["ddp"]]
        configs += [SimConfig(mode="single", lr=inner, **base) for inner in grids["single"]]
        configs += [
            SimConfig(mode="diloco", sync_every=h, outer_lr=outer, lr=inner, **base)
            for h in h_values
            for outer in lr_values
            for inner in grids["diloco"]
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
        "inner_lr": grids,
        "outer": f"nesterov momentum 0.9, lr in {{{', '.join(map(str, lr_values))}}}",
        "eval_every": eval_every,
        "jobs": jobs,
        "torch": torch.__version__,
        "machine": f"{platform.machine()}, {jobs} runs at a time with "
        f"{threads_per_job(jobs) if jobs > 1 else torch.get_num_threads()} torch thread(s) each",
        "total_seconds": round(total_seconds, 1),
        "command": _command(sys.argv[1:]),
    }
    write_results({"setup": setup, "runs": runs}, out_dir)


def _command(args: list[str]) -> str:
    """The command that made these results, less where it wrote them (--out-dir)."""
    kept = []
    for arg in args:
        if kept and kept[-1] == "--out-dir":
            kept.pop()
        elif not arg.startswith("--out-dir="):
            kept.append(arg)
    return shlex.join(["python", "benchmarks/convergence.py", *kept])


def _group(run: dict) -> str:
    """Which tuned mode a run belongs to: ddp, single, or DiLoCo at its H."""
    return f"diloco H={run['sync_every']}" if run["mode"] == "diloco" else run["mode"]


def _best(runs: list[dict]) -> dict[str, dict]:
    """Each mode's run with the lowest final eval loss over its grids (inner lr; DiLoCo's also
    outer lr), in the order the modes first appear."""
    best: dict[str, dict] = {}
    for run in runs:
        group = _group(run)
        if group not in best or run["final_eval_loss"] < best[group]["final_eval_loss"]:
            best[group] = run
    return best


def _inner_lr(run: dict) -> float:
    return run["config"]["lr"]


def _on_edge(run: dict, runs: list[dict], key: str) -> str | None:
    """ "smallest" or "largest" when `run` is its group's best at the edge of a grid of more
    than one value of `key` ("lr" or "outer_lr"): a wider grid might find a better run."""
    grid = sorted({r["config"][key] for r in runs if _group(r) == _group(run)})
    if len(grid) < 2:
        return None
    value = run["config"][key]
    return "smallest" if value == grid[0] else "largest" if value == grid[-1] else None


def write_results(document: dict, out_dir: Path) -> None:
    """Print the table and write convergence.json, .md and .png from one results document."""
    runs, setup = document["runs"], document["setup"]
    best = _best(runs)
    ddp = best["ddp"]
    rows = []
    for run in runs:
        sent = run["bytes_sent_per_worker"]
        diloco = run["mode"] == "diloco"
        rows.append(
            [
                f"{run['mode']} (K={run['workers']})",
                run["sync_every"] if diloco else "-",
                _inner_lr(run),
                run["config"]["outer_lr"] if diloco else "-",
                f"{run['final_eval_loss']:.4f}" + (" (best)" if run is best[_group(run)] else ""),
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
        "inner lr",
        "outer lr",
        "final eval loss",
        "loss / best ddp",
        "MB sent per worker",
        "less traffic than ddp",
        "outer steps",
        "seconds",
    ]
    out.print(summary_table("convergence", columns, rows))
    write_json(out_dir / "convergence.json", document)
    plot_runs(
        [
            {**r, "overrides": {"lr": _inner_lr(r), "outer_lr": r["config"]["outer_lr"]}}
            if r["mode"] == "diloco"
            else {**r, "overrides": {"lr": _inner_lr(r)}}
            for r in best.values()
        ],
        out_dir / "convergence.png",
        title=f"K={setup['workers']}, {setup['steps_per_worker']} inner steps per worker, "
        f"{setup['corpus']} (each mode at its best learning rates)",
    )
    (out_dir / "convergence.md").write_text(_markdown(setup, columns, rows, _reading(runs)))
    err.print(f"wrote {out_dir}/convergence.md, .json, .png")


def _reading(runs: list[dict]) -> list[str]:
    """One line per tuned mode, best against best: where each DiLoCo H lands between one
    worker alone and data-parallel, and any best run found on the edge of its grid."""
    best = _best(runs)
    ddp, single = best["ddp"], best["single"]
    lines = [
        f"- data-parallel's best: inner lr {_inner_lr(ddp)}, eval loss "
        f"{ddp['final_eval_loss']:.4f}; one worker's best: inner lr {_inner_lr(single)}, "
        f"{single['final_eval_loss']:.4f}."
    ]
    for group, run in best.items():
        if run["mode"] != "diloco":
            continue
        gain = single["final_eval_loss"] - run["final_eval_loss"]
        gap = run["final_eval_loss"] / ddp["final_eval_loss"] - 1
        verdict = "better" if gain > 0 else "worse"
        lines.append(
            f"- {group} (best inner lr {_inner_lr(run)}, outer lr {run['config']['outer_lr']}): "
            f"{abs(gain):.3f} nats {verdict} than one worker alone at its best, "
            f"{100 * gap:+.2f} % from data-parallel's best eval loss, with "
            f"{ddp['bytes_sent_per_worker'] / run['bytes_sent_per_worker']:,.0f}x less traffic "
            f"({run['outer_steps']} outer steps)."
        )
    for group, run in best.items():
        for key, name in (("lr", "inner lr"), ("outer_lr", "outer lr")):
            edge = _on_edge(run, runs, key) if key == "lr" or run["mode"] == "diloco" else None
            if edge is not None:
                lines.append(
                    f"- {group}'s best {name} ({run['config'][key]}) is the {edge} of its grid: "
                    "a wider grid might find a better run."
                )
    return lines


def _grids(inner: object) -> str:
    """The inner lr grids of a results file (a number in files written before the sweep)."""
    if isinstance(inner, dict):
        return "; ".join(f"{mode} {{{', '.join(map(str, grid))}}}" for mode, grid in inner.items())
    return f"{{{inner}}} for every mode"


def _markdown(setup: dict, columns: list[str], rows: list[list[object]], reading: list[str]) -> str:
    lines = [
        "# Convergence: data-parallel vs DiLoCo at equal tokens",
        "",
        f"Command: `{setup.get('command', 'python benchmarks/convergence.py')}` (settings below).",
        "",
        f"- model: byte-level GPT, width {setup['model']['width']}, depth "
        f"{setup['model']['depth']}, context {setup['seq_len']}, "
        f"{setup['parameters']:,} parameters",
        f"- data: corpus `{setup['corpus']}`, {setup['workers']} workers, each "
        f"{setup['steps_per_worker']} inner AdamW steps of {setup['batch_size']} x "
        f"{setup['seq_len']} bytes ({setup['tokens_per_worker']:,} tokens per worker); "
        "ddp takes the mean gradient of all workers' batches every step",
        f"- outer optimizer: {setup['outer']}; seed {setup['seed']}; inner AdamW lr grids "
        f"{_grids(setup['inner_lr'])}, each with warm-up and cosine decay; every mode is "
        "compared at its best run (marked in the table) against data-parallel's best",
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
