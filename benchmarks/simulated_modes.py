"""Simulated modes benchmark: async DiLoCo with heterogeneous workers, and Streaming DiLoCo.

Part 1 (Async Local-SGD, Liu et al. 2024): K = 4 workers at speeds 1, 1, 0.5, 0.25. Sync
DiLoCo against async DiLoCo with Delayed Nesterov (N = K, c = 0), with and without DyLU, async
with DyLU and the server's grace window (simultaneous arrivals share one Nesterov step), and
sync DiLoCo cut to the async runs' simulated wall time. Part 2 (Streaming DiLoCo, Douillard et
al. 2025): streaming with P fragments (delay tau, mix alpha) against sync DiLoCo at the same H
and data-parallel, at equal inner steps. Every run trains from the same initial weights on the
same per-worker shards (fixed seeds) through the in-process simulator (no network).
Writes <out>/simulated_modes.md and .json.

    python benchmarks/simulated_modes.py                  # full run (Shakespeare, ~10 min, 2 cores)
    python benchmarks/simulated_modes.py --steps 16 --sync-every 8 --corpus generated \\
        --width 16 --batch-size 4 --seq-len 16 --out-dir /tmp/x          # smoke, seconds
"""

from __future__ import annotations

import math
import platform
import time
from pathlib import Path

import torch
import typer

from diloco.algorithm import dylu_local_steps
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
from diloco.sim import SimConfig, simulate, total_inner_steps
from diloco.sim.runner import validate_algorithm_settings

RESULTS = Path(__file__).parent / "results"
NAME = "simulated_modes"

# Async Local-SGD (Liu et al. 2024), as cited in /work/shared/DESIGN.md: perplexity.
PAPER_ASYNC = {"dn_dylu": 41.13, "sync": 41.35}


def main(
    steps: int = typer.Option(
        1000, help="Inner steps per worker (async: of the fastest worker). Small for a smoke run."
    ),
    sync_every: int = typer.Option(100, help="H, inner steps per round (divisible by every P)."),
    speeds: str = typer.Option("1,1,0.5,0.25", help="Part 1: worker speeds; K = their count."),
    grace: float = typer.Option(
        1.0, help="Part 1: the grace window of the DyLU + grace run, in simulated time units."
    ),
    fragments: str = typer.Option("2,4", help="Part 2: comma-separated P values (<= depth)."),
    delay: int = typer.Option(1, help="Part 2: tau, inner steps a fragment's sync overlaps."),
    alpha: float = typer.Option(0.5, help="Part 2: merge theta = (1 - alpha) G' + alpha L."),
    width: int = typer.Option(64, help="Model width."),
    depth: int = typer.Option(4, help="Transformer blocks (the fragments stride over them)."),
    seq_len: int = typer.Option(64, help="Bytes per sequence (= model context)."),
    batch_size: int = typer.Option(16, help="Sequences per step per worker."),
    lr: float = typer.Option(3e-3, help="Inner AdamW peak learning rate."),
    corpus: str = typer.Option("shakespeare", help="shakespeare, generated[:SEED] or a path."),
    seed: int = typer.Option(0, help="Seed shared by every run."),
    out_dir: Path = typer.Option(RESULTS, help=f"Where {NAME}.md/.json go."),
    from_json: Path = typer.Option(
        None, help=f"Re-render the tables from an earlier {NAME}.json; no training."
    ),
) -> None:
    check_output_path(out_dir / f"{NAME}.json", "--out-dir")
    if from_json is not None:
        document = read_results_json(from_json, ("setup", "runs"))
        write_results(document, out_dir)
        return
    speed_values = tuple(number_list(speeds, "--speeds", float))
    p_values = number_list(fragments, "--fragments")
    if any(not v > 0 or not math.isfinite(v) for v in speed_values):
        raise fail(f"--speeds must all be finite and > 0, got {speeds!r}")
    fastest, slowest = max(speed_values), min(speed_values)
    equal_wall_steps = round(steps * slowest / fastest)
    if equal_wall_steps < 1:
        raise fail(
            f"--steps {steps} leaves sync DiLoCo at equal wall time no step "
            f"(steps * min speed / max speed < 1)"
        )
    too_many = [p for p in p_values if p > depth]
    if too_many:
        raise fail(f"--fragments {too_many} exceed --depth {depth} (fragments stride over blocks)")
    workers = len(speed_values)
    try:
        data = load_named_corpus(corpus)
        model = GPTConfig(context=seq_len, width=width, depth=depth, heads=4)
        base = dict(
            workers=workers,
            steps=steps,
            sync_every=sync_every,
            batch_size=batch_size,
            seq_len=seq_len,
            lr=lr,
            model=model,
            corpus=corpus,
            seed=seed,
        )
        asynchronous = dict(mode="async", speeds=speed_values, async_delay=workers, async_c=0.0)
        plan = [
            ("sync DiLoCo", ["async", "streaming"], SimConfig(mode="diloco", **base)),
            ("async DN", ["async"], SimConfig(**asynchronous, **base)),
            ("async DN + DyLU", ["async"], SimConfig(**asynchronous, dylu=True, **base)),
            (
                "async DyLU + grace",
                ["async"],
                SimConfig(**{**asynchronous, "async_delay": 1}, dylu=True, grace=grace, **base),
            ),
            (
                "sync DiLoCo, equal wall time",
                ["async"],
                SimConfig(mode="diloco", **{**base, "steps": equal_wall_steps}),
            ),
            ("ddp", ["streaming"], SimConfig(mode="ddp", **base)),
        ]
        plan += [
            (
                f"streaming P={p}",
                ["streaming"],
                SimConfig(mode="streaming", fragments=p, delay=delay, alpha=alpha, **base),
            )
            for p in p_values
        ]
        for _, _, config in plan:
            validate_algorithm_settings(config)
    except (ValueError, CorpusError) as exc:
        raise fail(str(exc)) from None

    started = time.perf_counter()
    runs = []
    for label, parts, config in plan:
        with progress_bar(label, total_inner_steps(config)) as advance:
            result = simulate(config, corpus=data, progress=advance)
        run = {"label": label, "parts": parts, **result.to_json()}
        run.update(_wall_time(run, slowest))
        runs.append(run)
    total_seconds = time.perf_counter() - started

    setup = {
        "workers": workers,
        "steps_per_worker": steps,
        "sync_every": sync_every,
        "speeds": list(speed_values),
        "grace": grace,
        "equal_wall_steps": equal_wall_steps,
        "fragments": p_values,
        "delay": delay,
        "alpha": alpha,
        "batch_size": batch_size,
        "seq_len": seq_len,
        "model": model.to_dict(),
        "parameters": runs[0]["parameters"],
        "corpus": corpus,
        "seed": seed,
        "inner_lr": lr,
        "outer": "nesterov lr 0.7 momentum 0.9 (sync, streaming); "
        f"delayed nesterov lr 0.7 momentum 0.9 N={workers} c=0 (async), N=1 (plain "
        "Nesterov per step) with the grace window",
        "torch": torch.__version__,
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads",
        "total_seconds": round(total_seconds, 1),
    }
    write_results({"setup": setup, "runs": runs}, out_dir)


def _wall_time(run: dict, slowest: float) -> dict:
    """Simulated wall time in time units (a speed-1 worker does one step per unit).

    Async: the last arrival (every worker stops once the fastest has done its steps). Sync
    modes: every round waits for the slowest worker, so steps / min(speed).
    """
    if run["mode"] == "async":
        return {
            "simulated_wall_time": max(a[2] for a in run["arrivals"]),
            "wall_time_rule": "last async arrival",
        }
    return {
        "simulated_wall_time": run["steps"] / slowest,
        "wall_time_rule": "steps / min(speed): every round waits for the slowest worker",
    }


def _local_steps(run: dict) -> list[int]:
    """H per worker: DyLU's H_w = max(1, floor(v_w / max(v) * H)), else H for everyone."""
    h = run["sync_every"]
    if not run["config"]["dylu"]:
        return [h] * run["workers"]
    return dylu_local_steps(run["config"]["speeds"], h)


def _async_rows(runs: list[dict]) -> tuple[list[str], list[list[object]]]:
    sync = runs[0]
    columns = [
        "run",
        "H per worker",
        "inner steps per worker",
        "inner steps, all",
        "outer steps",
        "simulated wall time",
        "final eval loss",
        "loss / sync DiLoCo",
        "seconds",
    ]
    rows = []
    for run in runs:
        rows.append(
            [
                run["label"],
                ", ".join(str(h) for h in _local_steps(run)),
                ", ".join(str(s) for s in run["local_steps_per_worker"]),
                sum(run["local_steps_per_worker"]),
                run["outer_steps"],
                f"{run['simulated_wall_time']:,.0f}",
                f"{run['final_eval_loss']:.4f}",
                f"{run['final_eval_loss'] / sync['final_eval_loss']:.3f}",
                f"{run['wall_seconds']:.0f}",
            ]
        )
    return columns, rows


def _streaming_rows(runs: list[dict]) -> tuple[list[str], list[list[object]]]:
    ddp = next(r for r in runs if r["mode"] == "ddp")
    sync = next(r for r in runs if r["mode"] == "diloco")
    columns = [
        "run",
        "P",
        "final eval loss",
        "loss / ddp",
        "MB sent per worker",
        "less traffic than ddp",
        "peak sync MB",
        "peak / sync DiLoCo",
        "syncs",
        "seconds",
    ]
    rows = []
    for run in runs:
        fragments = run["config"]["fragments"] if run["mode"] == "streaming" else "-"
        rows.append(
            [
                run["label"],
                fragments,
                f"{run['final_eval_loss']:.4f}",
                f"{run['final_eval_loss'] / ddp['final_eval_loss']:.3f}",
                f"{run['bytes_sent_per_worker'] / 1e6:,.2f}",
                f"{ddp['bytes_sent_per_worker'] / run['bytes_sent_per_worker']:,.1f}x",
                f"{run['peak_sync_bytes'] / 1e6:.3f}",
                f"{run['peak_sync_bytes'] / sync['peak_sync_bytes']:.3f}",
                run["outer_steps"] if run["mode"] != "ddp" else f"{run['steps']} all-reduces",
                f"{run['wall_seconds']:.0f}",
            ]
        )
    return columns, rows


def write_results(document: dict, out_dir: Path) -> None:
    """Print both tables and write simulated_modes.json and .md from one results document."""
    setup, runs = document["setup"], document["runs"]
    async_runs = [r for r in runs if "async" in r["parts"]]
    streaming_runs = [r for r in runs if "streaming" in r["parts"]]
    streaming_runs.sort(key=lambda r: ["ddp", "diloco", "streaming"].index(r["mode"]))
    async_columns, async_rows = _async_rows(async_runs)
    streaming_columns, streaming_rows = _streaming_rows(streaming_runs)
    out.print(summary_table("1. heterogeneous workers", async_columns, async_rows))
    out.print(summary_table("2. streaming", streaming_columns, streaming_rows))
    write_json(out_dir / f"{NAME}.json", document)
    text = _markdown(
        setup,
        (async_columns, async_rows, _async_reading(async_runs, setup)),
        (streaming_columns, streaming_rows, _streaming_reading(streaming_runs, setup)),
    )
    (out_dir / f"{NAME}.md").write_text(text)
    err.print(f"wrote {out_dir}/{NAME}.md, .json")


def _verdict(delta: float) -> str:
    return f"{abs(delta):.3f} nats {'higher (worse)' if delta > 0 else 'lower (better)'}"


def _async_reading(runs: list[dict], setup: dict) -> list[str]:
    by_label = {r["label"]: r for r in runs}
    sync, equal = by_label["sync DiLoCo"], by_label["sync DiLoCo, equal wall time"]
    dn, dylu = by_label["async DN"], by_label["async DN + DyLU"]
    grace = by_label["async DyLU + grace"]
    speedup = sync["simulated_wall_time"] / dylu["simulated_wall_time"]
    ppl = {k: math.exp(r["final_eval_loss"]) for k, r in by_label.items()}
    paper = PAPER_ASYNC
    lines = [
        f"- Async DN + DyLU ends {_verdict(dylu['final_eval_loss'] - sync['final_eval_loss'])} "
        f"than sync DiLoCo (per-byte perplexity {ppl['async DN + DyLU']:.3f} vs "
        f"{ppl['sync DiLoCo']:.3f}, ratio {ppl['async DN + DyLU'] / ppl['sync DiLoCo']:.3f}) "
        f"in {speedup:.1f}x less simulated wall time "
        f"({dylu['simulated_wall_time']:,.0f} vs {sync['simulated_wall_time']:,.0f} units) and "
        f"with {sum(dylu['local_steps_per_worker']):,} instead of "
        f"{sum(sync['local_steps_per_worker']):,} inner steps in all. The paper reports "
        f"{paper['dn_dylu']} vs {paper['sync']} perplexity (ratio "
        f"{paper['dn_dylu'] / paper['sync']:.3f}) for a 20M model.",
        f"- DyLU against plain async DN: "
        f"{_verdict(dylu['final_eval_loss'] - dn['final_eval_loss'])} "
        f"({dylu['outer_steps']} vs {dn['outer_steps']} arrivals).",
        f"- Async DyLU + grace window (the arrivals DyLU makes simultaneous share one outer "
        f"step, as on the server with --grace-seconds): "
        f"{_verdict(grace['final_eval_loss'] - sync['final_eval_loss'])} than sync DiLoCo "
        f"(perplexity ratio {ppl['async DyLU + grace'] / ppl['sync DiLoCo']:.3f}) in "
        f"{sync['simulated_wall_time'] / grace['simulated_wall_time']:.1f}x less simulated "
        f"wall time, and {_verdict(grace['final_eval_loss'] - dylu['final_eval_loss'])} than "
        f"async DN + DyLU without the window ({grace['outer_steps']} outer steps).",
        f"- At equal wall time ({equal['simulated_wall_time']:,.0f} units, "
        f"{equal['steps']} steps per worker) sync DiLoCo ends "
        f"{_verdict(equal['final_eval_loss'] - dylu['final_eval_loss'])} than async DN + DyLU "
        f"and {_verdict(equal['final_eval_loss'] - grace['final_eval_loss'])} than async DyLU "
        "+ grace.",
        *_spikes([dn, dylu, grace, sync]),
        "- Against the paper, in spirit only: our model is tiny, trained on a CPU for few "
        "steps, and the async rows see fewer tokens than sync DiLoCo (slow workers stop "
        "early); the paper's point that async never waits for the slowest worker is the "
        "wall-time column.",
    ]
    return lines


def _spikes(runs: list[dict]) -> list[str]:
    """A line per run whose eval curve climbs back up by more than 0.1 nats mid-run."""
    lines = []
    for run in runs:
        curve = run["eval_curve"]
        worst = max(
            ((later, curve[i][1]) for i in range(1, len(curve)) for later in curve[i + 1 :]),
            key=lambda pair: pair[0][1] - pair[1],
            default=None,
        )
        if worst is None or worst[0][1] - worst[1] <= 0.1:
            continue
        (step, loss), before = worst
        lines.append(
            f"- {run['label']}: the eval loss is not monotone; it climbs back to {loss:.2f} "
            f"at step {step} (of the fastest worker) after having been {before:.2f} "
            f"(eval curve: {', '.join(f'{s}: {v:.2f}' for s, v in curve[1:])})."
        )
    return lines


def _streaming_reading(runs: list[dict], setup: dict) -> list[str]:
    ddp = next(r for r in runs if r["mode"] == "ddp")
    sync = next(r for r in runs if r["mode"] == "diloco")
    lines = [
        f"- Sync DiLoCo H={sync['sync_every']}: "
        f"{_verdict(sync['final_eval_loss'] - ddp['final_eval_loss'])} than ddp with "
        f"{ddp['bytes_sent_per_worker'] / sync['bytes_sent_per_worker']:,.0f}x less traffic."
    ]
    for run in runs:
        if run["mode"] != "streaming":
            continue
        p = run["config"]["fragments"]
        lines.append(
            f"- Streaming P={p}: {_verdict(run['final_eval_loss'] - ddp['final_eval_loss'])} "
            f"than ddp and {_verdict(run['final_eval_loss'] - sync['final_eval_loss'])} than "
            f"sync DiLoCo; peak transfer {sync['peak_sync_bytes'] / run['peak_sync_bytes']:.2f}x "
            f"smaller than sync DiLoCo's (ideal {p}x), "
            f"{ddp['bytes_sent_per_worker'] / run['bytes_sent_per_worker']:,.0f}x less traffic "
            "than ddp."
        )
    lines.append(
        "- Against the paper, in spirit only: Streaming DiLoCo reports the same loss as "
        "data-parallel with 400x fewer bits and lower peak bandwidth at a far larger scale; its "
        "bit count also reflects low-precision (4-bit) outer gradients, while this simulator "
        "counts fp32, so our traffic factor comes from H alone."
    )
    return lines


def _table(columns: list[str], rows: list[list[object]]) -> list[str]:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]


def _markdown(setup: dict, part1: tuple, part2: tuple) -> str:
    speeds = ", ".join(f"{v:g}" for v in setup["speeds"])
    steps, h = setup["steps_per_worker"], setup["sync_every"]
    slowest, fastest = min(setup["speeds"]), max(setup["speeds"])
    p_text = ", ".join(str(p) for p in setup["fragments"])
    flush = ", here all P fragments" if setup["alpha"] > 0 else ""
    lines = [
        "# Simulated modes: async DiLoCo with heterogeneous workers, and Streaming DiLoCo",
        "",
        "Command: `python benchmarks/simulated_modes.py` (defaults below; a smoke run: "
        "`--steps 16 --sync-every 8 --width 16 --seq-len 16 --batch-size 4 --corpus generated "
        "--out-dir /tmp/x`).",
        "",
        f"- model: byte-level GPT, width {setup['model']['width']}, depth "
        f"{setup['model']['depth']}, context {setup['seq_len']}, "
        f"{setup['parameters']:,} parameters",
        f"- data: corpus `{setup['corpus']}`, K = {setup['workers']} workers, "
        f"{setup['batch_size']} x {setup['seq_len']} bytes per inner AdamW step, "
        f"{steps} inner steps per worker (async: of the fastest worker), H = {h}; "
        f"inner lr {setup['inner_lr']} with warm-up and cosine decay; seed {setup['seed']}",
        f"- outer optimizer: {setup['outer']}",
        f"- machine: {setup['machine']}, torch {setup['torch']}; whole benchmark "
        f"{setup['total_seconds']} s; everything runs in the in-process simulator (no network)",
        "",
        "## 1. Heterogeneous workers: sync vs async DiLoCo",
        "",
        f"Worker speeds {speeds} (inner steps per simulated time unit). Async runs apply each "
        f"arrival at once with Delayed Nesterov (N = {setup['workers']}, c = 0); DyLU gives "
        "worker w H_w = floor(v_w / max(v) * H) local steps so that every round takes the same "
        "time. The simulator stops every async worker when the fastest has done its steps, so "
        "slow workers do fewer; async wall time is the last arrival's simulated time "
        f"(= steps / max speed = {steps / fastest:,.0f}). Speeds do not exist in the "
        "simulator's sync mode, so sync DiLoCo's wall time is computed here: every round waits "
        f"for the slowest worker, so it is steps / min speed = {steps / slowest:,.0f} units "
        "(its fast workers idle meanwhile). Without a grace window, arrivals at the same "
        "simulated time (with DyLU, all four every round) are applied one after another, and "
        "each worker restarts from the global model right after its own arrival, so three of "
        "every four pseudo-gradients are stale. The DyLU + grace row averages the arrivals "
        f"within {setup['grace']:g} time unit(s) of the first into one outer step (plain "
        "Nesterov, N = 1), as the server does with --grace-seconds; the window closes early "
        "once every worker still training has arrived. "
        "The last row is sync DiLoCo given only "
        f"steps * min speed / max speed = {setup['equal_wall_steps']} steps, the async runs' "
        "wall time.",
        "",
        *_table(part1[0], part1[1]),
        "",
        "Reading (generated from the numbers above):",
        "",
        *part1[2],
        "",
        "## 2. Streaming DiLoCo",
        "",
        f"Streaming with P = {p_text} fragments (blocks strided over fragments, tensors outside "
        f"the blocks to the lightest fragment), tau = {setup['delay']} (a fragment is sent "
        f"{setup['delay']} inner step(s) before its merge), alpha = {setup['alpha']} "
        "(theta = (1 - alpha) G' + alpha L), against sync DiLoCo at the same H (the same run "
        "as in part 1) and data-parallel, all at equal inner steps per worker. Bytes are fp32: "
        "DiLoCo and streaming count the pseudo-gradient or fragment sent per sync (and as much "
        "received); ddp counts a ring all-reduce of fp32 gradients every step, "
        "2 (K - 1) / K of the model per worker, which is also its peak. Peak sync MB is the "
        "largest single transfer. The streaming run ends with a final flush, as a real worker's "
        "close does: it syncs every fragment trained since its last merge and, with alpha > 0, "
        f"every fragment (its local residue){flush}; the flush is counted in bytes and syncs. "
        "'syncs' counts outer steps (fragment syncs for streaming).",
        "",
        *_table(part2[0], part2[1]),
        "",
        "Reading (generated from the numbers above):",
        "",
        *part2[2],
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    typer.run(main)
