"""`diloco worker`: train the bundled GPT as one DiLoCo worker of a running server."""

from __future__ import annotations

import hashlib
import math
import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import typer

from diloco.algorithm.compression import fused_int8
from diloco.commands.options import (
    CORPUS_HELP,
    DATA_PANEL,
    DTYPE_HELP,
    DURABILITY_PANEL,
    MODEL_PANEL,
    NETWORK_PANEL,
    OUTPUTS_PANEL,
    CaFileOption,
    TokenFileOption,
    TokenOption,
    check_ca_file,
    check_server_url,
    read_token,
    refusal,
    require_positive,
)
from diloco.commands.threads import apply_thread_budget
from diloco.console import (
    check_output_path,
    err,
    fail,
    log_to_stderr,
    megabytes,
    out,
    progress_bar,
    summary_table,
    write_json,
)
from diloco.data import (
    BatchSampler,
    CorpusError,
    TokenWindows,
    load_named_corpus,
    split_train_val,
    worker_shard,
)
from diloco.evaluation import Evaluator
from diloco.models import GPTConfig, ModelSpec
from diloco.models.causal_lm import CausalLMConfig
from diloco.training import Replica, autocast_dtype_of, training_device
from diloco.worker import (
    AuthError,
    DiLoCoClient,
    DiLoCoWorker,
    RetryPolicy,
    ServerError,
    ServerUnavailable,
    ServerUnreachable,
)
from diloco.worker.anchor import parse_anchor_device
from diloco.worker.data.leased_sampler import LeasedBatches, LeasedSampler
from diloco.worker.net.transport import split_base_url
from diloco.worker.parallel.distributed import LeaderFailed
from diloco.worker.settings import ServerSettingsError
from diloco.worker.state.checkpoint import holds_checkpoint

# The longest a worker retries a server that has never answered it (a wrong --server, a server
# not started yet) before it exits 2; --give-up-after lowers it, 0 lifts it. A worker that has
# had an answer retries through a server restart for as long as --give-up-after.
FIRST_CONTACT_SECONDS = 60.0


def retry_policy(
    give_up_after: float, max_retry_delay: float, checkpoint_dir: Path | None
) -> RetryPolicy:
    """How `diloco worker` retries: for --give-up-after in all (0: for ever), but a server
    that never answered for at most FIRST_CONTACT_SECONDS (a wrong --server is likelier than
    a slow start), unless the worker resumes from a checkpoint: it has reached the server
    before, so the server is restarting, and it waits that out."""
    resuming = checkpoint_dir is not None and holds_checkpoint(checkpoint_dir)
    return RetryPolicy(
        deadline=give_up_after or None,
        base_delay=min(0.5, max_retry_delay),
        max_delay=max_retry_delay,
        first_contact=None if resuming else min(FIRST_CONTACT_SECONDS, give_up_after) or None,
    )


def _dataset_id(corpus: bytes, seq_len: int) -> str:
    """Workers on the same bytes and window length share one dataset; any other is another."""
    return f"corpus-{hashlib.sha256(corpus).hexdigest()[:16]}-w{seq_len}"


def check_checkpoint_dir(path: Path | None) -> None:
    """--checkpoint-dir must be a directory this process can write, or not exist yet (it is
    made at the first save): found out at start, not after a round of training."""
    if path is None:
        return
    if path.exists() and not path.is_dir():
        raise fail(f"--checkpoint-dir is not a directory: {path}")
    existing = path if path.exists() else next((p for p in path.parents if p.exists()), None)
    if existing is None or not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise fail(f"--checkpoint-dir cannot be written here: {path}")


def _sampler_seed(seed: int, shard: int) -> int:
    """The simulator's seeding, so that a real run and `diloco simulate` see the same batches."""
    return seed * 1000 + shard + 1


def _join_refusal(exc: BaseException, sent_token: bool) -> str:
    """Why the server refused this worker, and what to change on either side."""
    message = refusal(exc, sent_token)
    if isinstance(exc, ServerError) and exc.kind == "fingerprint_mismatch":
        message += (
            "; start this worker with the run's model (the same --model-config, or --width, "
            "--depth and --heads), or start the server on a new --state-dir for a new run"
        )
    return message


def _model_spec(path: Path | None, seq_len: int, width: int, depth: int, heads: int) -> ModelSpec:
    """The bundled GPT, or the transformers model of --model-config (ValueError naming why not)."""
    if path is None:
        return GPTConfig(context=seq_len, width=width, depth=depth, heads=heads)
    spec = CausalLMConfig.from_file(path)
    if spec.context is not None and seq_len > spec.context:
        raise ValueError(
            f"--seq-len {seq_len} is longer than the model takes ({spec.context} positions "
            f"in {path})"
        )
    return spec


class Stopped(BaseException):
    """SIGTERM or SIGINT came: the worker stops where it is, leaves and reports. Not an
    Exception, so that nothing on its way takes it for a failure to retry or to report."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.name = signal.Signals(signum).name
        self.code = 128 + signum  # the exit status a shell shows for a process it ended


@contextmanager
def stop_signals() -> Iterator[None]:
    """Inside: SIGTERM and SIGINT raise Stopped in the main thread, once (a second one ends
    the process as the signal does); the handlers before come back on the way out. A SIGINT
    the process ignores (a shell's background job) stays ignored; outside the main thread (a
    test's runner) nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    watched = [signal.SIGTERM]
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        watched.append(signal.SIGINT)
    before = {signum: signal.getsignal(signum) for signum in watched}

    def stop(signum: int, _frame: object) -> None:
        for each in watched:
            signal.signal(each, signal.SIG_DFL)
        raise Stopped(signum)

    for signum in watched:
        signal.signal(signum, stop)
    try:
        yield
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)


def _leave_at_once(worker: DiLoCoWorker) -> None:
    """A stopped worker leaves the run without a last sync, trying the server once (one that
    does not answer evicts the worker after its heartbeat timeout)."""
    if isinstance(worker.client, DiLoCoClient):
        worker.client.retry = RetryPolicy(attempts=1)
    worker.close(final_sync=False)


def worker_command(
    server: str = typer.Option(..., help="Server URL, e.g. http://127.0.0.1:8470"),
    worker_id: str = typer.Option(None, help="Stable id (re-used after a restart)."),
    steps: int = typer.Option(500, help="Inner optimizer steps to train."),
    seed: int = typer.Option(0, help="Seed of the initial weights and of this shard's batches."),
    data_dispatch: str = typer.Option(
        "server",
        help="server: train the work units the server leases (no sample skipped or repeated "
        "within an epoch, even across crashes); static: a fixed --shard of the data.",
        rich_help_panel=DATA_PANEL,
    ),
    unit_size: int = typer.Option(
        64, help="Samples per work unit (--data-dispatch server).", rich_help_panel=DATA_PANEL
    ),
    data_seed: int = typer.Option(
        0, help="Shuffle seed of the work units (same on all workers).", rich_help_panel=DATA_PANEL
    ),
    shard: int = typer.Option(
        0,
        help="Which shard this worker trains (--data-dispatch static).",
        rich_help_panel=DATA_PANEL,
    ),
    num_shards: int = typer.Option(
        1, help="Shards the data is cut into (--data-dispatch static).", rich_help_panel=DATA_PANEL
    ),
    corpus: str = typer.Option("shakespeare", help=CORPUS_HELP, rich_help_panel=DATA_PANEL),
    lr: float = typer.Option(
        3e-3, help="Inner AdamW peak learning rate.", rich_help_panel=MODEL_PANEL
    ),
    warmup: int = typer.Option(
        50, help="Inner learning-rate warm-up steps.", rich_help_panel=MODEL_PANEL
    ),
    batch_size: int = typer.Option(
        16, help="Sequences per inner step.", rich_help_panel=MODEL_PANEL
    ),
    seq_len: int = typer.Option(64, help="Bytes per sequence.", rich_help_panel=MODEL_PANEL),
    width: int = typer.Option(
        64, help="Model width (must match the other workers).", rich_help_panel=MODEL_PANEL
    ),
    depth: int = typer.Option(4, help="Transformer blocks.", rich_help_panel=MODEL_PANEL),
    heads: int = typer.Option(4, help="Attention heads.", rich_help_panel=MODEL_PANEL),
    model_config: Path = typer.Option(
        None,
        help="Train any transformers causal LM instead of the bundled GPT: a config.json "
        "(model_type and its fields; vocab_size >= 256 for byte tokens), random weights from "
        "--seed, nothing downloaded. --width, --depth and --heads are then not used.",
        rich_help_panel=MODEL_PANEL,
    ),
    eval_batches: int = typer.Option(
        8, help="Validation batches for the final eval loss.", rich_help_panel=MODEL_PANEL
    ),
    token: str = TokenOption,
    token_file: Path = TokenFileOption,
    ca_file: Path = CaFileOption,
    json_path: Path = typer.Option(
        None, "--json", help="Write the worker's figures here.", rich_help_panel=OUTPUTS_PANEL
    ),
    progress: bool = typer.Option(True, help="Show a progress bar.", rich_help_panel=OUTPUTS_PANEL),
    give_up_after: float = typer.Option(
        900.0,
        help="Seconds one request keeps retrying an unreachable server (0: forever).",
        rich_help_panel=NETWORK_PANEL,
    ),
    max_retry_delay: float = typer.Option(
        30.0, help="Longest wait between two retries (s).", rich_help_panel=NETWORK_PANEL
    ),
    max_upload_mbps: float = typer.Option(
        None,
        help="Cap this worker's upload bandwidth (megabits/s), for a shared link.",
        rich_help_panel=NETWORK_PANEL,
    ),
    fragment_timeout: float = typer.Option(
        None,
        help="Streaming: the longest a merge waits for its fragment's sync before keeping the "
        "old anchor and sending the fragment again next window (default: as long as retries go).",
        rich_help_panel=NETWORK_PANEL,
    ),
    checkpoint_dir: Path = typer.Option(
        None,
        help="Save this worker's state here after every round; starting again on it resumes "
        "under the same id (optimizer, schedule, RNG, data position).",
        rich_help_panel=DURABILITY_PANEL,
    ),
    threads: int = typer.Option(
        None,
        help="Threads for training on the CPU (default: torch's, every core). Give each "
        "process on a shared machine its share.",
    ),
    device: str = typer.Option(
        "auto", help="Where the model trains: cpu, cuda, cuda:N, or auto (cuda if present)."
    ),
    dtype: str = typer.Option("fp32", help=DTYPE_HELP),
    anchor_device: str = typer.Option(
        "auto",
        help="Where the fp32 anchor and error-feedback residual live: auto (beside a GPU "
        "model when they fit in half its free memory), cpu, or a device such as cuda:1.",
    ),
) -> None:
    """Join a server, train, sync every H steps (the server's H), report loss and traffic."""
    check_output_path(json_path, "--json")
    check_server_url(server, "--server")
    try:
        parse_anchor_device(anchor_device)
    except ValueError as exc:
        raise fail(str(exc).replace("anchor_device", "--anchor-device")) from None
    server_url = "".join(split_base_url(server))  # as the client and its errors write it
    require_positive(
        steps=steps,
        num_shards=num_shards,
        batch_size=batch_size,
        seq_len=seq_len,
        unit_size=unit_size,
    )
    if data_dispatch not in ("server", "static"):
        raise fail(f"--data-dispatch must be server or static, got {data_dispatch!r}")
    if data_dispatch == "server" and (shard, num_shards) != (0, 1):
        raise fail("--shard and --num-shards are for --data-dispatch static")
    if not 0 <= shard < num_shards:
        raise fail(f"shard must be in [0, {num_shards}), got {shard}")
    if not 0 <= data_seed < 2**63:
        raise fail(f"--data-seed must be in [0, 2**63), got {data_seed}")
    if not 0 <= seed < 2**63 // 1000 - 1000:  # (the shards' batch seeds: seed x 1000 + shard)
        raise fail(f"--seed must be in [0, {2**63 // 1000 - 1000}), got {seed}")
    if not (math.isfinite(lr) and lr > 0):
        raise fail(f"--lr must be a finite number > 0, got {lr}")
    if warmup < 0:
        raise fail(f"--warmup must be >= 0 steps, got {warmup}")
    if eval_batches < 1:
        raise fail(f"--eval-batches must be >= 1, got {eval_batches}")
    if not (math.isfinite(give_up_after) and give_up_after >= 0):
        raise fail(f"--give-up-after must be a finite number >= 0 seconds, got {give_up_after}")
    if not (math.isfinite(max_retry_delay) and max_retry_delay > 0):
        raise fail(f"--max-retry-delay must be a finite number > 0 seconds, got {max_retry_delay}")
    check_checkpoint_dir(checkpoint_dir)
    try:
        train_device = training_device(device)
        autocast_dtype = autocast_dtype_of(dtype)
        apply_thread_budget(threads)
        fused_int8.check_setting()
    except ValueError as exc:
        raise fail(str(exc)) from None
    secret = read_token(token, token_file)
    sent = secret is not None
    check_ca_file(ca_file)
    # joined, each round, waits, retries; the experiment's kernels, compiled as it joins
    log_to_stderr(info_from=["diloco.worker", "diloco.algorithm.compression.fused_int8"])
    try:
        config = _model_spec(model_config, seq_len, width, depth, heads)
        corpus_bytes = load_named_corpus(corpus)
        split = split_train_val(corpus_bytes)
        sampler = BatchSampler(
            worker_shard(split.train, shard, num_shards),
            batch_size,
            seq_len,
            seed=_sampler_seed(seed, shard),
        )
        evaluator = Evaluator(config, split.val, batch_size, seq_len, eval_batches)
    except (ValueError, CorpusError) as exc:
        raise fail(str(exc)) from None
    torch.manual_seed(seed)
    initial = config.build().state_dict()
    replica = Replica(
        config,
        initial,
        sampler,
        lr,
        warmup,
        steps,
        weight_decay=0.1,
        device=train_device,
        autocast_dtype=autocast_dtype,
    )
    retry = retry_policy(give_up_after, max_retry_delay, checkpoint_dir)
    try:
        with stop_signals():
            worker = DiLoCoWorker(
                replica.model,
                replica.optimizer,
                server,
                worker_id,
                secret,
                retry=retry,
                checkpoint_dir=checkpoint_dir,
                fragment_timeout=fragment_timeout,
                max_upload_mbps=max_upload_mbps,
                ca_file=ca_file,
                anchor_device=anchor_device,
            )
    except Stopped as stop:
        err.print(f"worker stopped by {stop.name} before it joined {server}", highlight=False)
        raise typer.Exit(code=stop.code) from None
    except ValueError as exc:
        raise fail(str(exc).replace("anchor_device", "--anchor-device")) from None
    except ServerUnreachable as exc:  # a wrong --server (or a shard of it that never answered)
        raise fail(exc.message("--server" if exc.server == server_url else None)) from None
    except (AuthError, ServerError, ServerUnavailable, ServerSettingsError, LeaderFailed) as exc:
        raise fail(f"could not join {server}: {_join_refusal(exc, sent)}", code=1) from None
    if data_dispatch == "server":
        windows = TokenWindows(split.train, seq_len)
        try:
            leased = LeasedSampler.for_worker(
                worker,
                _dataset_id(corpus_bytes, seq_len),
                len(windows),
                shuffle_seed=data_seed,
                unit_size=unit_size,
            )
        except (ServerError, ServerUnavailable) as exc:
            worker.close(final_sync=False)
            message = refusal(exc, sent)
            raise fail(f"could not register the dataset with {server}: {message}", code=1) from None
        replica.sampler = LeasedBatches(windows, leased, batch_size)
    done = worker.local_step  # > 0 when resuming from --checkpoint-dir
    if done:
        replica.steps_done = done  # the learning-rate schedule goes on where it was
        if data_dispatch == "static":
            sampler.skip(done)  # the same batches as a run that never stopped
    tokens_per_step = batch_size * seq_len
    started = time.monotonic()

    def figures(
        final_loss: float | None, train_seconds: float, stopped: Stopped | None = None
    ) -> dict:
        """What --json holds: the worker's figures, and whether a signal stopped it."""
        stats = worker.stats()
        return {
            **stats,
            "train_seconds": train_seconds,  # the training loop and the final sync, wall time
            "blocked_fraction": stats["blocked_seconds"] / train_seconds if train_seconds else 0.0,
            "server": server,
            "steps": steps,
            "data_dispatch": data_dispatch,
            "resumed_at_step": done,
            "shard": shard,
            "num_shards": num_shards,
            "seed": seed,
            "final_eval_loss": final_loss,  # None when stopped: no final sync, no eval
            "tokens": (steps if stopped is None else worker.local_step) * tokens_per_step,
            "device": str(train_device),
            "dtype": dtype,
            "interrupted": stopped is not None,
            "stopped_by": None if stopped is None else stopped.name,
        }

    try:
        with stop_signals():
            with progress_bar(f"worker {worker.worker_id}", steps, enabled=progress) as advance:
                advance(min(done, steps))
                for _ in range(max(0, steps - done)):
                    loss = replica.train_step()
                    worker.report(loss=loss, tokens=tokens_per_step)
                    advance(1)
            worker.close()
    except Stopped as stop:
        _leave_at_once(worker)
        result = figures(None, time.monotonic() - started, stop)
        resume = f"; the same command resumes from {checkpoint_dir}" if checkpoint_dir else ""
        err.print(
            f"worker {worker.worker_id} stopped by {stop.name} at step {worker.local_step} of "
            f"{steps}: {result['rounds']} rounds, {megabytes(result['bytes_sent'])} MB sent, "
            f"{megabytes(result['bytes_received'])} MB received, "
            f"{result['blocked_seconds']:.1f} s blocked; it left the run{resume}",
            highlight=False,
            soft_wrap=True,
        )
        if json_path is not None:
            write_json(json_path, result)
            err.print(f"wrote {json_path}")
        raise typer.Exit(code=stop.code) from None
    except (ServerError, ServerUnavailable, LeaderFailed) as exc:
        worker.close(final_sync=False)
        message = refusal(exc, sent)
        raise fail(f"worker {worker.worker_id} stopped: {message}", code=1) from None
    train_seconds = time.monotonic() - started
    final_loss = evaluator.loss(replica.model.state_dict())
    result = stats = figures(final_loss, train_seconds)
    out.print(
        summary_table(
            f"diloco worker {worker.worker_id}",
            ["steps", "rounds", "final eval loss", "MB sent", "MB received", "blocked s"],
            [
                [
                    steps,
                    stats["rounds"],
                    f"{final_loss:.4f}",
                    megabytes(stats["bytes_sent"]),
                    megabytes(stats["bytes_received"]),
                    f"{stats['blocked_seconds']:.1f}",
                ]
            ],
        )
    )
    if json_path is not None:
        write_json(json_path, result)
        err.print(f"wrote {json_path}")
