"""`diloco worker`: train the bundled GPT as one DiLoCo worker of a running server."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import typer

from diloco.commands.options import (
    CORPUS_HELP,
    TokenFileOption,
    TokenOption,
    read_token,
    require_positive,
)
from diloco.console import (
    check_output_path,
    err,
    fail,
    megabytes,
    out,
    progress_bar,
    summary_table,
    write_json,
)
from diloco.data import BatchSampler, CorpusError, load_named_corpus, split_train_val, worker_shard
from diloco.evaluation import Evaluator
from diloco.models import GPT, GPTConfig
from diloco.training import Replica
from diloco.worker import (
    AuthError,
    DiLoCoWorker,
    RetryPolicy,
    ServerError,
    ServerUnavailable,
)
from diloco.worker.distributed import LeaderFailed
from diloco.worker.settings import ServerSettingsError


def _sampler_seed(seed: int, shard: int) -> int:
    """The simulator's seeding, so that a real run and `diloco simulate` see the same batches."""
    return seed * 1000 + shard + 1


def worker_command(
    server: str = typer.Option(..., help="Server URL, e.g. http://127.0.0.1:8470"),
    worker_id: str = typer.Option(None, help="Stable id (re-used after a restart)."),
    steps: int = typer.Option(500, help="Inner optimizer steps to train."),
    seed: int = typer.Option(0, help="Seed of the initial weights and of this shard's batches."),
    shard: int = typer.Option(0, help="Which shard of the training data this worker trains."),
    num_shards: int = typer.Option(1, help="How many shards the training data is cut into."),
    corpus: str = typer.Option("shakespeare", help=CORPUS_HELP),
    lr: float = typer.Option(3e-3, help="Inner AdamW peak learning rate."),
    warmup: int = typer.Option(50, help="Inner learning-rate warm-up steps."),
    batch_size: int = typer.Option(16, help="Sequences per inner step."),
    seq_len: int = typer.Option(64, help="Bytes per sequence."),
    width: int = typer.Option(64, help="Model width (must match the other workers)."),
    depth: int = typer.Option(4, help="Transformer blocks."),
    heads: int = typer.Option(4, help="Attention heads."),
    eval_batches: int = typer.Option(8, help="Validation batches for the final eval loss."),
    token: str = TokenOption,
    token_file: Path = TokenFileOption,
    json_path: Path = typer.Option(None, "--json", help="Write the worker's figures here."),
    progress: bool = typer.Option(True, help="Show a progress bar."),
    give_up_after: float = typer.Option(
        900.0, help="Seconds one request keeps retrying an unreachable server (0: forever)."
    ),
) -> None:
    """Join a server, train, sync every H steps (the server's H), report loss and traffic."""
    check_output_path(json_path, "--json")
    require_positive(steps=steps, num_shards=num_shards, batch_size=batch_size, seq_len=seq_len)
    if not 0 <= shard < num_shards:
        raise fail(f"shard must be in [0, {num_shards}), got {shard}")
    secret = read_token(token, token_file)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        config = GPTConfig(context=seq_len, width=width, depth=depth, heads=heads)
        split = split_train_val(load_named_corpus(corpus))
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
    initial = GPT(config).state_dict()
    replica = Replica(config, initial, sampler, lr, warmup, steps, weight_decay=0.1)
    if give_up_after < 0:
        raise fail(f"--give-up-after must be >= 0 seconds, got {give_up_after}")
    retry = RetryPolicy(deadline=give_up_after or None)
    try:
        worker = DiLoCoWorker(
            replica.model, replica.optimizer, server, worker_id, secret, retry=retry
        )
    except ValueError as exc:
        raise fail(str(exc)) from None
    except (AuthError, ServerError, ServerUnavailable, ServerSettingsError, LeaderFailed) as exc:
        raise fail(f"could not join {server}: {exc}", code=1) from None
    tokens_per_step = batch_size * seq_len
    try:
        with progress_bar(f"worker {worker.worker_id}", steps, enabled=progress) as advance:
            for _ in range(steps):
                loss = replica.train_step()
                worker.report(loss=loss, tokens=tokens_per_step)
                advance(1)
        worker.close()
    except (ServerError, ServerUnavailable, LeaderFailed) as exc:
        worker.close(final_sync=False)
        raise fail(f"worker {worker.worker_id} stopped: {exc}", code=1) from None
    final_loss = evaluator.loss(replica.model.state_dict())
    stats = worker.stats()
    result = {
        **stats,
        "server": server,
        "steps": steps,
        "shard": shard,
        "num_shards": num_shards,
        "seed": seed,
        "final_eval_loss": final_loss,
        "tokens": steps * tokens_per_step,
    }
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
