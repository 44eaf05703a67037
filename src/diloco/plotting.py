"""Loss curves against inner steps and against bytes communicated (matplotlib is optional)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


def require_matplotlib(path: Path | None = None) -> None:
    """Fail early, before a long run, when plotting was asked for but cannot be done: no
    matplotlib, or a file name whose suffix it cannot write (`path`)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ValueError("--plot needs matplotlib: pip install 'diloco[plot]'") from exc
    if path is None:
        return
    from matplotlib.figure import Figure

    formats = Figure().canvas.get_supported_filetypes()
    suffix = path.suffix.lstrip(".").lower()
    if suffix not in formats:
        raise ValueError(
            f"--plot {path}: matplotlib cannot write {suffix or 'a file without a suffix'!r}; "
            f"name it .{' .'.join(sorted(formats))}"
        )


def _label(run: dict) -> str:
    """Mode, H and K; a sweep's runs add their swept settings (`overrides`)."""
    swept = "".join(f", {k.replace('_', '-')}={v}" for k, v in run.get("overrides", {}).items())
    if run["mode"] in ("ddp", "single"):
        return f"{run['mode']} (K={run['workers']}{swept})"
    return f"{run['mode']} H={run['sync_every']} (K={run['workers']}{swept})"


def plot_runs(runs: Sequence[dict], path: str | Path, title: str = "") -> None:
    """Two panels: eval loss vs inner steps per worker, and vs bytes sent per worker (log)."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, (by_step, by_bytes) = plt.subplots(1, 2, figsize=(11, 4.2))
    for run in runs:
        steps = [point[0] for point in run["eval_curve"]]
        losses = [point[1] for point in run["eval_curve"]]
        by_step.plot(steps, losses, label=_label(run))
        # Bytes accrue at a steady rate per inner step (per round for DiLoCo), so scale by step.
        total = run["bytes_sent_per_worker"]
        sent = [max(total * s / run["steps"], 1.0) for s in steps]
        by_bytes.plot(sent[1:], losses[1:], label=_label(run), marker=".")
    by_step.set_xlabel("inner steps per worker")
    by_step.set_ylabel("eval loss (nats/byte)")
    by_bytes.set_xlabel("bytes sent per worker (log)")
    by_bytes.set_xscale("log")
    by_bytes.set_ylabel("eval loss (nats/byte)")
    for axis in (by_step, by_bytes):
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
