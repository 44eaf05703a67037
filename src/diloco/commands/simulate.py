"""`diloco simulate`: K replicas in one process through the server's own algorithm code."""

from __future__ import annotations

from pathlib import Path

import typer

from diloco.algorithm.recipes import error_feedback_note
from diloco.commands.options import (
    ASYNC_PANEL,
    CODEC_PANEL,
    CORPUS_HELP,
    DATA_PANEL,
    DTYPE_HELP,
    ERROR_FEEDBACK_HELP,
    MODEL_PANEL,
    OUTER_LR_HELP,
    OUTER_MOMENTUM_HELP,
    OUTER_OPTIMIZER_HELP,
    OUTPUTS_PANEL,
    STREAMING_PANEL,
)
from diloco.console import (
    check_output_path,
    err,
    fail,
    megabytes,
    number_list,
    out,
    progress_bar,
    summary_table,
    warn,
    write_json,
)
from diloco.data import CorpusError, load_named_corpus
from diloco.models import GPTConfig
from diloco.sim import MODES, SimConfig, prepare, run, total_inner_steps
from diloco.sim.jobs import run_configs
from diloco.sim.sweep import best_index, parse_sweeps


def _parse_speeds(text: str | None) -> tuple[float, ...]:
    if not text:
        return ()
    return tuple(number_list(text, "--speeds", float))


def _run(config: SimConfig, corpus: bytes, label: str) -> dict:
    """Prepare (which raises on bad input), then train under a progress bar."""
    setup = prepare(config, corpus)
    with progress_bar(label, total_inner_steps(config)) as advance:
        return run(setup, progress=advance).to_json()


def _config(options: dict) -> SimConfig:
    """The run that the command's options describe (ValueError on a bad setting)."""
    o = dict(options)
    model = GPTConfig(context=o["seq_len"], width=o.pop("width"), depth=o.pop("depth"),
                      heads=o.pop("heads"))  # fmt: skip
    return SimConfig(**{**o, "model": model, "speeds": _parse_speeds(o["speeds"])})


def _warnings(configs: list[SimConfig], grid: list[dict], beta_given: bool) -> list[str]:
    """Each run's measured risks (SimConfig.outer_warnings) and an error-feedback beta given
    where it cannot act, each sentence once over a sweep."""
    lines: list[str] = []
    for config, overrides in zip(configs, grid, strict=True):
        lines.extend(config.outer_warnings())
        if beta_given or "error_feedback_beta" in overrides:
            note = error_feedback_note(config.upload, config.error_feedback_beta)
            if note is not None and config.mode not in ("single", "ddp"):
                lines.append(note)
    return list(dict.fromkeys(lines))


def _report_sweep(
    grid: list[dict], configs: list[SimConfig], documents: list[dict], json_path: Path | None
) -> list[dict]:
    """One row per run, swept settings first; the lowest eval loss is marked.

    Returns the runs' documents with their swept settings (`overrides`), as written to --json.
    """
    keys = list(grid[0])
    best = best_index([d["final_eval_loss"] for d in documents])
    rows = [
        [*(overrides[k] for k in keys), *_result_row(c, d), "<- best" if i == best else ""]
        for i, (overrides, c, d) in enumerate(zip(grid, configs, documents, strict=True))
    ]
    columns = [k.replace("_", "-") for k in keys] + ROW_COLUMNS + [""]
    title = f"diloco simulate: sweep of {len(rows)} runs{_where(configs)}"
    out.print(summary_table(title, columns, rows))
    described = ", ".join(f"{k.replace('_', '-')}={v}" for k, v in grid[best].items())
    out.print(f"lowest eval loss: {documents[best]['final_eval_loss']:.4f} with {described}")
    runs = [{"overrides": o, **d} for o, d in zip(grid, documents, strict=True)]
    if json_path is not None:
        swept = {k: list(dict.fromkeys(o[k] for o in grid)) for k in keys}
        write_json(json_path, {"sweep": swept, "best": grid[best], "runs": runs})
        err.print(f"wrote {json_path}")
    return runs


def _result_row(c: SimConfig, result: dict) -> list[object]:
    """One table row from a run's settings and its `--json` document."""
    return [
        c.mode,
        c.effective_workers,
        c.sync_every if c.mode not in ("single", "ddp") else "-",
        _upload_label(c),
        c.steps,
        f"{result['final_eval_loss']:.4f}",
        result["outer_steps"],
        megabytes(result["bytes_sent_per_worker"]),
        megabytes(result["bytes_received_per_worker"]),
        f"{result['wall_seconds']:.1f}",
    ]


def _upload_label(config: SimConfig) -> str:
    """The upload codec, and its error feedback when it keeps any."""
    if config.mode in ("single", "ddp"):
        return "-"
    codec = config.upload
    if codec.is_identity and config.download.is_identity:
        return str(codec)
    down = "" if config.download.is_identity else f", down {config.download}"
    if config.error_feedback_beta == 0:
        return f"{codec}, no EF{down}"
    return f"{codec}, EF {config.error_feedback_beta:g}{down}"


def _where(configs: list[SimConfig]) -> str:
    """Where the runs' replicas trained, for a table's title: the device and the dtype that
    all of them share (a swept one has its column), nothing for the CPU and fp32."""
    devices = {c.device for c in configs}
    dtypes = {c.dtype for c in configs}
    parts = [devices.pop()] if len(devices) == 1 and "cpu" not in devices else []
    parts += ["bf16 autocast"] if dtypes == {"bf16"} else []
    return f" ({', '.join(parts)})" if parts else ""


ROW_COLUMNS = [
    "mode",
    "workers",
    "H",
    "upload",
    "steps",
    "eval loss",
    "outer steps",
    "MB sent/worker",
    "MB recv/worker",
    "seconds",
]


def _load_corpus_or_fail(spec: str | None) -> bytes:
    try:
        return load_named_corpus(spec)
    except CorpusError as exc:
        raise fail(str(exc)) from None


# --help panels of this command's own options (the shared ones are in options.py).
OUTER_PANEL = "Outer optimizer"
ROBUST_PANEL = "Robust aggregation"
SWEEP_PANEL = "Sweeps"


def simulate_command(
    mode: str = typer.Option("diloco", help=f"One of: {', '.join(MODES)}."),
    workers: int = typer.Option(4, help="Number of simulated workers K."),
    sync_every: int = typer.Option(50, help="H: inner optimizer steps between syncs."),
    steps: int = typer.Option(500, help="Inner optimizer steps per worker."),
    outer_optimizer: str = typer.Option(
        None, help=OUTER_OPTIMIZER_HELP, rich_help_panel=OUTER_PANEL
    ),
    outer_lr: float = typer.Option(None, help=OUTER_LR_HELP, rich_help_panel=OUTER_PANEL),
    outer_momentum: float = typer.Option(
        None, help=OUTER_MOMENTUM_HELP, rich_help_panel=OUTER_PANEL
    ),
    fragments: int = typer.Option(
        1, help="Streaming: number of fragments P.", rich_help_panel=STREAMING_PANEL
    ),
    delay: int = typer.Option(
        0, help="Streaming: overlap tau in inner steps (< H / P).", rich_help_panel=STREAMING_PANEL
    ),
    alpha: float = typer.Option(
        0.0, help="Streaming: merge weight of the local model.", rich_help_panel=STREAMING_PANEL
    ),
    speeds: str = typer.Option(
        "", help="Async: comma-separated relative worker speeds.", rich_help_panel=ASYNC_PANEL
    ),
    dylu: bool = typer.Option(
        False,
        "--dylu",
        help="Async: dynamic local updates (fewer steps if slow).",
        rich_help_panel=ASYNC_PANEL,
    ),
    async_delay: int = typer.Option(
        0, help="Async: Delayed Nesterov N (0 = workers).", rich_help_panel=ASYNC_PANEL
    ),
    grace: float = typer.Option(
        0.0,
        help="Async: arrivals within this much simulated time of the first pending one are "
        "averaged into one outer step (the server's --grace-seconds; time unit: one inner step "
        "of a speed-1 worker).",
        rich_help_panel=ASYNC_PANEL,
    ),
    staleness_weighting: str = typer.Option(
        "none",
        help="Async: none or inverse_sqrt (scale by (1 + staleness)^-1/2).",
        rich_help_panel=ASYNC_PANEL,
    ),
    upload_codec: str = typer.Option(
        "fp32",
        help="Pseudo-gradient codec, as the server's: fp32, bf16, int8, int4, int2, topk:F or "
        "topk:F+VALUES (e.g. topk:0.03+int2: the largest 3% per chunk, 2-bit values).",
        rich_help_panel=CODEC_PANEL,
    ),
    download_codec: str = typer.Option(
        "fp32",
        help="Weights download codec, as the server's: fp32 sends full weights; any other "
        "codec each step's coded change of the published weights, which workers then hold.",
        rich_help_panel=CODEC_PANEL,
    ),
    codec_block: int = typer.Option(
        128,
        help="Values per quantization scale of int8/int4/int2 (a power of two, 8-65536).",
        rich_help_panel=CODEC_PANEL,
    ),
    topk_chunk: int = typer.Option(
        128, help="Elements per top-k chunk (a power of two, 2-65536).", rich_help_panel=CODEC_PANEL
    ),
    error_feedback_beta: float = typer.Option(
        None, help=ERROR_FEEDBACK_HELP, rich_help_panel=CODEC_PANEL
    ),
    aggregation: str = typer.Option(
        None,
        help="How a round's pseudo-gradients combine: mean, clipped_mean, trimmed_mean:F "
        "(0 <= F < 0.5) or median; the robust ones refuse norms over 10x the median, and "
        "(3 kept or more) one pointing away from the round's element-wise median. "
        "sparse_mean: each element over the workers that sent it (SparseLoCo's, for top-k "
        "uploads; --mode diloco and streaming, as the server in sync and streaming mode). "
        "Default: follows --upload-codec: sparse_mean for top-k in modes diloco and "
        "streaming, else mean.",
        rich_help_panel=ROBUST_PANEL,
    ),
    hostile: str = typer.Option(
        "none",
        help="The last worker sends its update scale100, sign_flip, or noise (or none).",
        rich_help_panel=ROBUST_PANEL,
    ),
    lr: float = typer.Option(
        3e-3, help="Inner AdamW peak learning rate.", rich_help_panel=MODEL_PANEL
    ),
    warmup: int = typer.Option(
        50, help="Inner learning-rate warm-up steps.", rich_help_panel=MODEL_PANEL
    ),
    batch_size: int = typer.Option(
        16, help="Sequences per inner step per worker.", rich_help_panel=MODEL_PANEL
    ),
    seq_len: int = typer.Option(64, help="Bytes per sequence.", rich_help_panel=MODEL_PANEL),
    width: int = typer.Option(64, help="Model width.", rich_help_panel=MODEL_PANEL),
    depth: int = typer.Option(4, help="Transformer blocks.", rich_help_panel=MODEL_PANEL),
    heads: int = typer.Option(4, help="Attention heads.", rich_help_panel=MODEL_PANEL),
    model_config: str = typer.Option(
        None,
        help="Train any transformers causal LM from this config.json instead of the bundled "
        "GPT (as `diloco worker --model-config`); --width, --depth and --heads are then unused.",
        rich_help_panel=MODEL_PANEL,
    ),
    device: str = typer.Option(
        "cpu",
        help="Where the replicas train: cpu, cuda, cuda:N, or auto (cuda if present). The "
        "global weights, outer step and evals stay on the CPU.",
        rich_help_panel=MODEL_PANEL,
    ),
    dtype: str = typer.Option(
        "fp32",
        help=DTYPE_HELP,
        rich_help_panel=MODEL_PANEL,
    ),
    corpus: str = typer.Option("shakespeare", help=CORPUS_HELP, rich_help_panel=DATA_PANEL),
    seed: int = typer.Option(0, help="Seed for weights, shards and batches."),
    eval_every: int = typer.Option(0, help="Inner steps between evals (0 = every round)."),
    sweep: list[str] = typer.Option(
        None,
        help="KEY=V1,V2,...: run once per value of any other option but --jobs, --json and "
        "--plot (e.g. outer-lr=0.5,0.7,1.0); several --sweep options make their grid. The "
        "table marks the lowest eval loss.",
        rich_help_panel=SWEEP_PANEL,
    ),
    jobs: int = typer.Option(
        1,
        help="Runs of a sweep trained side by side, each in its own process (<= cores).",
        rich_help_panel=SWEEP_PANEL,
    ),
    json_path: Path = typer.Option(
        None, "--json", help="Write the results as JSON here.", rich_help_panel=OUTPUTS_PANEL
    ),
    plot: Path = typer.Option(
        None,
        help="Draw eval loss vs steps and vs bytes to this PNG.",
        rich_help_panel=OUTPUTS_PANEL,
    ),
) -> None:
    """Train K replicas in one process and report loss and bytes moved."""
    options = {
        key: value
        for key, value in locals().items()
        if key not in ("sweep", "jobs", "json_path", "plot")
    }
    beta_given = error_feedback_beta is not None  # else the codec's, which warns of nothing
    check_output_path(json_path, "--json")
    check_output_path(plot, "--plot")
    if jobs < 1:
        raise fail(f"--jobs must be a positive integer, got {jobs}")
    if jobs > 1 and not sweep:
        warn("--jobs applies to the runs of a --sweep; this one run trains in this process")
    try:
        if plot is not None:
            from diloco.plotting import require_matplotlib

            require_matplotlib(plot)
        grid = parse_sweeps(sweep or [], options)
        configs = [_config({**options, **overrides}) for overrides in grid]
        for line in _warnings(configs, grid, beta_given):
            warn(line)
        data = _load_corpus_or_fail(corpus)
        if not sweep:
            documents = [_run(configs[0], data, f"{mode} K={configs[0].effective_workers}")]
        else:
            for config in configs:  # every run's settings fail before the first one trains
                prepare(config, data)
            total = sum(total_inner_steps(c) for c in configs)
            with progress_bar(f"sweep: {len(configs)} runs", total) as advance:
                documents = run_configs(configs, jobs, advance, data)
    except typer.Exit:
        raise
    except ValueError as exc:  # CorpusError is a ValueError too
        raise fail(str(exc)) from None
    except RuntimeError as exc:  # a child process of --jobs failed
        raise fail(f"a sweep run failed: {exc}", code=1) from None
    if sweep:
        documents = _report_sweep(grid, configs, documents, json_path)
    else:
        row = _result_row(configs[0], documents[0])
        out.print(summary_table(f"diloco simulate{_where(configs)}", ROW_COLUMNS, [row]))
        if json_path is not None:
            write_json(json_path, documents[0])
            err.print(f"wrote {json_path}")
    if plot is not None:
        from diloco.plotting import plot_runs

        plot_runs(documents, plot)
        err.print(f"wrote {plot}")
