"""Robust aggregation against one bad worker of four: final eval loss per attack and rule.

One of K = 4 simulated DiLoCo workers sends, every round, its pseudo-gradient scaled by 100,
its sign flipped, or Gaussian noise of the same norm (sim/hostile.py). Each attack is run under
every aggregation rule (algorithm/robust.py: mean, clipped_mean, trimmed_mean:0.25, median),
and so is the honest run, so the table shows both what a rule saves under attack and what it
costs when nobody attacks. The last row is the three honest workers alone (K = 3): the best
a rule can reach once it drops the bad worker, whose data is lost with it. Same seed, data
and steps everywhere.
Writes <out>/robust_aggregation.md and .json.

    python benchmarks/robust_aggregation.py        # 17 runs, ~8 min on 2 cores
"""

from __future__ import annotations

import platform
import time
from pathlib import Path

import torch
import typer

from diloco.console import (
    check_output_path,
    fail,
    markdown_table,
    out,
    progress_bar,
    summary_table,
    write_json,
)
from diloco.data import CorpusError, load_named_corpus
from diloco.models import GPTConfig
from diloco.sim import SimConfig, prepare, total_inner_steps
from diloco.sim.jobs import run_configs

RESULTS = Path(__file__).parent / "results"
RULES = ("mean", "clipped_mean", "trimmed_mean:0.25", "median")
ATTACKS = ("none", "scale100", "sign_flip", "noise")
THREE_HONEST = "none, K=3 (the honest three alone)"


def main(
    steps: int = typer.Option(1000, help="Inner steps per worker."),
    sync_every: int = typer.Option(20, help="H: inner steps per round."),
    width: int = typer.Option(64, help="Model width."),
    depth: int = typer.Option(2, help="Transformer blocks."),
    batch_size: int = typer.Option(8, help="Sequences per step per worker."),
    corpus: str = typer.Option("shakespeare", help="shakespeare, generated[:SEED] or a path."),
    jobs: int = typer.Option(2, help="Runs trained side by side (one process each)."),
    out_dir: Path = typer.Option(RESULTS, help="Where robust_aggregation.md and .json go."),
) -> None:
    check_output_path(out_dir / "robust_aggregation.json", "--out-dir")
    if jobs < 1:
        raise fail(f"--jobs must be a positive integer, got {jobs}")
    try:
        data = load_named_corpus(corpus)
        base = dict(workers=4, steps=steps, sync_every=sync_every, batch_size=batch_size,
                    seq_len=64, model=GPTConfig(context=64, width=width, depth=depth, heads=4),
                    corpus=corpus, eval_every=steps)  # fmt: skip
        cases = [(attack, rule) for attack in ATTACKS for rule in RULES]
        configs = [SimConfig(aggregation=rule, hostile=attack, **base) for attack, rule in cases]
        # What the three honest workers reach alone: the best any rule can do once it has
        # dropped the bad worker (its data is lost with it).
        cases.append((THREE_HONEST, "mean"))
        configs.append(SimConfig(**{**base, "workers": 3}))
        for config in configs:
            prepare(config, data)
    except (ValueError, CorpusError) as exc:
        raise fail(str(exc)) from None
    started = time.perf_counter()
    total = sum(total_inner_steps(c) for c in configs)
    with progress_bar(f"{len(configs)} runs, {jobs} at a time", total) as advance:
        runs = run_configs(configs, jobs, advance, data)
    honest = runs[cases.index(("none", "mean"))]["final_eval_loss"]
    rows = []
    for (attack, rule), run in zip(cases, runs, strict=True):
        loss = run["final_eval_loss"]
        rows.append([attack, rule, f"{loss:.4f}", f"{100 * (loss / honest - 1):+.2f} %",
                     run["refused_contributions"]])  # fmt: skip
    columns = ["bad worker", "aggregation", "final eval loss", "vs honest mean",
               "refused contributions"]  # fmt: skip
    title = (f"K=4, one bad worker, H={sync_every}, {steps} inner steps per worker, "
             f"{runs[0]['parameters']:,} parameters, {corpus}")  # fmt: skip
    out.print(summary_table(title, columns, rows))
    setup = {k: v for k, v in base.items() if k != "model"}
    setup.update(model=base["model"].to_dict(), torch=torch.__version__,
                 machine=f"{platform.machine()}, jobs {jobs}",
                 total_seconds=round(time.perf_counter() - started, 1))  # fmt: skip
    labelled = [{"attack": a, "aggregation": r, **run}
                for (a, r), run in zip(cases, runs, strict=True)]  # fmt: skip
    document = {"setup": setup, "runs": labelled}
    write_json(out_dir / "robust_aggregation.json", document)
    command = (f"Command: `python benchmarks/robust_aggregation.py` "
               f"({document['setup']['total_seconds']:.0f} s)")  # fmt: skip
    lines = [f"# {title}", "", command, "", *markdown_table(columns, rows)]
    (out_dir / "robust_aggregation.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    typer.run(main)
