"""The server's CPU work of one int8 round, at several thread budgets: do more cores pay?

The GPU check on an H200 (results/gpu_check/h200-2026-11-29/) found the server's fold, outer
step and delta coding the largest part of a 125M round's sequential compute (0.43 s of
0.80 s), with the server at 4 torch threads on a 16-core host, and a 350M delta 5.9x slower
than a 125M one for 2.8x the values. On 2 cores a second torch thread made every coded part
slower (results/model_scale-server-threads/). This times the three parts alone, in one process, for
the bundled GPT's tensors at one size, so that a machine with more cores says which budget
the server should run with, and whether the 350M delta is slow outside the server too:

  - scan + fold: one worker's int8 body taken in as a round's later upload, its values scanned
    from its spool file, then added into sums that hold a body already (worker_coding.py's
    `_server_fold`, the server's intake; the server reports the two parts apart);
  - outer step: `apply_running_mean` (Nesterov, torch's fused kernel) on the sums of two
    bodies whose folds bounded every value, as the commit of a K = 2 round runs it;
  - delta: masters - P coded int8 and P moved by it (`PublishedCopy.advance`, the server's).

Each part at each torch thread count of `--threads`; then, for each count of `--pool`, the delta
with its tensors spread over that many Python threads, torch at one thread each (a candidate,
not what the server does). Every variant's delta body and P must equal one thread's, byte for
byte, coded by the eager code. With DILOCO_FUSED_INT8=1 (the compiled kernels of
algorithm/compression/fused_int8.py, an experiment) the delta codes through them; a kernel runs
only at the thread count it was compiled at, so give one `--threads` count a process. One memory
pass (a copy of the fp32 model) on one thread is the yardstick every row's passes are counted
in; each row also times the pass at its own count. Medians of `--repeats`.

    python benchmarks/server_threads.py --size 125M --threads 1,4,8 --pool 4,8
"""

from __future__ import annotations

import os
import platform
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
import typer

from diloco.algorithm import RunningMean, TensorKind
from diloco.algorithm.compression import fused_int8
from diloco.algorithm.compression.codecs import parse_codec
from diloco.algorithm.contributions import Contribution
from diloco.algorithm.outer import apply_running_mean
from diloco.algorithm.outer_optimizer import OuterOptimizer
from diloco.console import check_output_path, fail, out, summary_table, write_json
from diloco.models.gpt import GPTConfig
from diloco.server.model.published_copy import PublishedCopy
from diloco.wire.compressed.body import compressed_frame, encode_compressed, write_entry
from model_scale import SIZES  # benchmarks/ is sys.path[0]
from worker_coding import _server_fold

RESULTS = Path(__file__).parent / "results"
CODEC = parse_codec("int8")


def gpt_state(size: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random fp32 tensors of the bundled GPT's shapes at `size` (built on the meta device:
    nothing of the model itself is allocated)."""
    width, depth = SIZES[size]
    config = GPTConfig(context=16, width=width, depth=depth, heads=max(1, width // 64))
    with torch.device("meta"):
        shapes = {n: tuple(t.shape) for n, t in config.build().state_dict().items()}
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}


def median_seconds(
    work: Callable[[], object], repeats: int, setup: Callable[[], object] = lambda: None
) -> float:
    """The median time of `work` over `repeats` runs, `setup` run before each, untimed."""
    samples = []
    for _ in range(repeats):
        setup()
        started = time.perf_counter()
        work()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def balanced_groups(sizes: dict[str, int], groups: int) -> list[list[str]]:
    """`sizes`' names in `groups` lists of about equal total size (largest first, each to the
    lightest list so far); empty lists dropped."""
    lists: list[list[str]] = [[] for _ in range(groups)]
    totals = [0] * groups
    for name in sorted(sizes, key=lambda n: -sizes[n]):
        lightest = totals.index(min(totals))
        lists[lightest].append(name)
        totals[lightest] += sizes[name]
    return [names for names in lists if names]


class Round:
    """One round's state on the server: masters, P, sums and one body to fold."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        self.masters = {n: t.clone() for n, t in state.items()}
        self.p0 = {n: t - 1e-3 * torch.sign(t) for n, t in state.items()}  # P, a step behind
        self.copy = PublishedCopy(self.p0, {n: torch.float32 for n in state}, CODEC, set(state))
        # a worker's pseudo-gradient, coded as it uploads it
        self.body = encode_compressed({n: t * 1e-3 for n, t in state.items()}, CODEC)
        first, self._fold = _server_fold(self.body, state, CODEC, set())
        self.held = first()  # the round's first body, in sums of their own
        self.sums = {n: torch.zeros_like(t) for n, t in state.items()}
        self.running = RunningMean(storage=self.sums)
        self.last: bytearray | None = None  # the last delta body, written over as the server does
        self.optimizer = OuterOptimizer("nesterov", lr=0.7, momentum=0.9)
        self.kinds = dict.fromkeys(state, TensorKind.TRAINABLE)
        self.gradient = {n: t * 1e-3 for n, t in state.items()}
        self.bound = max(float(t.abs().max()) for t in self.gradient.values())
        self.pass_source = torch.ones(sum(t.numel() for t in state.values()))
        self.pass_target = torch.empty_like(self.pass_source)

    def reset_p(self) -> None:
        self.copy.current.fill(self.p0)

    def fold(self) -> None:
        self._fold(self.held)

    def fold_for_step(self) -> None:
        """A K = 2 round's sums as its folds leave them, every value bounded (so the step skips
        its NaN scan and divides by 2 in its fused kernel, as a server's commit does): the
        step's setup, untimed."""
        self.running = RunningMean(storage=self.sums)
        for _ in range(2):
            self.running.add(Contribution(self.gradient), max_abs=self.bound)

    def outer_step(self) -> None:
        apply_running_mean(self.masters, self.running, self.optimizer, self.kinds)

    def delta(self) -> bytearray:
        """P moves by the body; `reset_p` first for the same body each time (untimed)."""
        self.last = self.copy.advance(self.masters, list(self.masters), self.last)
        return self.last

    def pooled_delta(self, threads: int) -> bytearray:
        """The same body and P as `delta`, its tensors coded by `threads` Python threads."""
        published = self.copy.tensors
        shapes = {n: (tuple(t.shape), t.dtype) for n, t in published.items()}
        body, views = compressed_frame(shapes, CODEC, reuse=self.last)
        self.last = body
        groups = balanced_groups({n: t.numel() for n, t in published.items()}, threads)
        errors: list[BaseException] = []

        def code(names: list[str]) -> None:
            try:
                for name in names:
                    target = published[name]
                    write_entry(
                        views, name, self.masters[name], CODEC, fold_into=target, less=target
                    )
            except BaseException as exc:  # reported on the caller's thread
                errors.append(exc)

        workers = [threading.Thread(target=code, args=(names,)) for names in groups]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        if errors:
            raise errors[0]
        return body

    def memory_pass(self) -> None:
        self.pass_target.copy_(self.pass_source)


def _counts(text: str, option: str, allow_empty: bool = False) -> list[int]:
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items and not allow_empty:
        raise fail(f"{option} must list integers >= 1, got {text!r}")
    if any(not item.isdigit() or int(item) < 1 for item in items):
        raise fail(f"{option} must list integers >= 1, got {text!r}")
    return [int(item) for item in items]


def main(
    size: str = typer.Option("85M", help=f"The bundled GPT's size, from {', '.join(SIZES)}."),
    threads: str = typer.Option("1,2", help="Torch thread counts, comma-separated."),
    pool: str = typer.Option("2", help="Python thread counts for the pooled delta ('' none)."),
    repeats: int = typer.Option(3, help="Runs per part (the median is reported)."),
    out_dir: Path = typer.Option(RESULTS, help="Where server_threads.md and .json go."),
) -> None:
    check_output_path(out_dir / "server_threads.json", "--out-dir")
    if size not in SIZES:
        raise fail(f"--size must be one of {', '.join(SIZES)}, got {size!r}")
    thread_counts = _counts(threads, "--threads")
    pool_counts = _counts(pool, "--pool", allow_empty=True)
    if repeats < 1:
        raise fail(f"--repeats must be >= 1, got {repeats}")
    try:
        fused_int8.check_setting()
    except ValueError as exc:
        raise fail(str(exc)) from None
    if fused_int8.requested() and (len(thread_counts) > 1 or pool_counts):
        raise fail(
            "with DILOCO_FUSED_INT8=1 give one --threads count and --pool '' (a kernel runs "
            "at the thread count it was compiled at: one process a count)"
        )
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    state = gpt_state(size)
    parameters = sum(t.numel() for t in state.values())
    work = Round(state)
    del state  # (Round holds its own copies)
    work.fold_for_step()
    work.outer_step()  # the momentum exists from the first step on, as after a server's first
    masters = {n: t.clone() for n, t in work.masters.items()}  # the outer steps move them
    work.reset_p()
    fused = fused_int8.requested()
    os.environ[fused_int8.ENABLE] = "0"  # the reference is the eager code's
    reference_body = bytes(work.delta())
    reference_p = {n: t.clone() for n, t in work.copy.tensors.items()}
    if fused:
        os.environ[fused_int8.ENABLE] = "1"

    def same(code: Callable[[], bytearray]) -> bool:
        for name, tensor in work.masters.items():
            tensor.copy_(masters[name])
        work.reset_p()
        work.last = None  # a fresh body: an entry left unwritten cannot pass for a written one
        body = code()
        tensors = work.copy.tensors
        return bytes(body) == reference_body and all(
            torch.equal(tensors[n], reference_p[n]) for n in reference_p
        )

    rows: list[dict] = []
    try:
        torch.set_num_threads(1)
        one_pass = median_seconds(work.memory_pass, repeats)  # every row's yardstick
        for count in thread_counts:
            torch.set_num_threads(count)
            work.fold()  # first touches
            row = {
                "variant": f"torch {count} thread{'s' if count > 1 else ''}",
                "torch_threads": count,
                "python_threads": 1,
                "fold_seconds": median_seconds(work.fold, repeats),
                "outer_step_seconds": median_seconds(work.outer_step, repeats, work.fold_for_step),
                "delta_seconds": median_seconds(work.delta, repeats, work.reset_p),
                "memory_pass_seconds": median_seconds(work.memory_pass, repeats),
            }
            row["identical"] = same(work.delta)
            rows.append(row)
        torch.set_num_threads(1)
        for count in pool_counts:
            row = {
                "variant": f"delta over {count} Python threads (torch 1 each)",
                "torch_threads": 1,
                "python_threads": count,
                "fold_seconds": None,
                "outer_step_seconds": None,
                "delta_seconds": median_seconds(
                    lambda c=count: work.pooled_delta(c), repeats, work.reset_p
                ),
                "memory_pass_seconds": one_pass,
            }
            row["identical"] = same(lambda c=count: work.pooled_delta(c))
            rows.append(row)
    finally:
        torch.set_num_threads(before)

    def cell(seconds: float | None) -> str:
        return "-" if seconds is None else f"{seconds:.3f} ({seconds / one_pass:.1f})"

    headers = [
        "variant",
        "scan + fold s (passes)",
        "outer step s (passes)",
        "delta s (passes)",
        "memory pass s, its threads",
        "same",
    ]
    table = [
        [
            row["variant"],
            cell(row["fold_seconds"]),
            cell(row["outer_step_seconds"]),
            cell(row["delta_seconds"]),
            f"{row['memory_pass_seconds']:.3f}",
            "yes" if row["identical"] else "NO",
        ]
        for row in rows
    ]
    machine = f"{platform.machine()}, {os.cpu_count()} cores"
    kernels = ""
    if fused:
        states = fused_int8.status()
        kernels = " (fused int8 kernels: " + ", ".join(f"{k} {v}" for k, v in states.items()) + ")"
    title = f"the server's int8 round work{kernels}, {size} GPT ({parameters:,} parameters)"
    out.print(summary_table(title, headers, table))
    document = {
        "size": size,
        "parameters": parameters,
        "repeats": repeats,
        "machine": machine,
        "torch": torch.__version__,
        "one_thread_pass_seconds": one_pass,
        "fused_int8": fused_int8.status() if fused else None,  # each kernel: used or refused
        "fused_int8_calls": fused_int8.calls() if fused else None,  # pieces each coded
        "rows": rows,
    }
    write_json(out_dir / "server_threads.json", document)
    command = (
        ("DILOCO_FUSED_INT8=1 " if fused else "")
        + f"python benchmarks/server_threads.py --size {size} --threads {threads} "
        f"--pool '{pool}' --repeats {repeats}"
    )
    lines = [
        "# The server's int8 round work at thread budgets",
        "",
        f"Command: `{command}` ({parameters:,} parameters; median of {repeats}; {machine}, "
        f"torch {torch.__version__}). Seconds, and in brackets the same in memory passes: "
        f"copies of the fp32 model on one thread ({one_pass:.3f} s), for every row alike; the "
        "pass at the row's own thread count beside them. same: the delta's body and P equal "
        "one thread's eager code, byte for byte.",
        "",
        "| " + " | ".join(headers) + " |",
        "|" + "---|" * len(headers),
        *["| " + " | ".join(row) + " |" for row in table],
        "",
    ]
    (out_dir / "server_threads.md").write_text("\n".join(lines))
    if not all(row["identical"] for row in rows):
        raise fail("a variant's delta differs from one thread's: see the table")


if __name__ == "__main__":
    typer.run(main)
