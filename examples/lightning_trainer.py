"""A Lightning `Trainer` as one DiLoCo worker: the bundled byte-level GPT on a text file.

    diloco server --sync-every 50 --min-workers 2
    python examples/lightning_trainer.py --server http://127.0.0.1:8470 --worker-id w0 \
        --output-dir run-w0 --steps 500   # on Shakespeare's plays (fetched once), or --corpus FILE
    # after a crash: the same command with --resume continues from the last checkpoint

Batches are drawn by step from a seeded sampler (the dataloader is built after Lightning has
restored the step), so a resumed fit trains exactly the batches an unbroken one would.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from diloco.data import (
    BatchSampler,
    TokenWindows,
    eval_batches,
    load_named_corpus,
    split_train_val,
)
from diloco.integrations.common import worker_data_seed
from diloco.integrations.lightning import DiLoCoCallback, DiLoCoCallbackError
from diloco.models import GPTConfig
from diloco.training import inner_lr, make_inner_optimizer
from diloco.worker import ServerError, ServerUnavailable


class StepBatches(torch.utils.data.IterableDataset):
    """The sampler's batches from `start` on (one per forward pass)."""

    def __init__(self, tokens: torch.Tensor, batch_size: int, seq_len: int, seed: int,
                 start: int, count: int) -> None:  # fmt: skip
        self.args = (tokens, batch_size, seq_len, seed)
        self.start, self.count = start, count

    def __iter__(self):
        sampler = BatchSampler(*self.args)
        sampler.skip(self.start)
        for _ in range(self.count - self.start):
            yield sampler.next_batch()


class ByteGPT(L.LightningModule):
    def __init__(self, options: argparse.Namespace, train: torch.Tensor, leased=None) -> None:
        super().__init__()
        self.options, self.train_tokens, self.leased = options, train, leased
        torch.manual_seed(options.seed)  # every worker builds the same initial weights
        self.spec = GPTConfig(context=options.seq_len, width=64, depth=2, heads=4)
        self.model = self.spec.build()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return self.spec.loss(self.model, x, y)

    def configure_optimizers(self):
        o = self.options
        optimizer = make_inner_optimizer(self.model, o.lr, weight_decay=0.1)
        warmup = min(50, o.steps // 10)
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: inner_lr(step, 1.0, warmup, o.steps)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def train_dataloader(self):
        o = self.options
        if self.leased is not None:  # the server's work units of the windows, in its order
            windows = TokenWindows(self.train_tokens, o.seq_len)
            return torch.utils.data.DataLoader(windows, batch_size=o.batch_size,
                                               sampler=self.leased)  # fmt: skip
        passes = o.steps * o.grad_accum
        start = self.trainer.global_step * o.grad_accum  # restored by now on a resume
        # each worker's own data order (the same --seed builds the same initial weights), and
        # the ranks of a DDP group train different batches
        own = worker_data_seed(o.seed, o.worker_id) if o.worker_id else o.seed
        seed = own + self.global_rank
        data = StepBatches(self.train_tokens, o.batch_size, o.seq_len, seed, start, passes)
        return torch.utils.data.DataLoader(data, batch_size=None)


@torch.no_grad()
def eval_loss(module: ByteGPT, batches) -> float:
    module.model.eval()
    return sum(float(module.spec.loss(module.model, x, y)) for x, y in batches) / len(batches)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", required=True)
    parser.add_argument("--worker-id", default=None)
    parser.add_argument("--corpus", default="shakespeare", help="a text file, or shakespeare")
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--steps", type=int, default=500, help="optimizer steps (max_steps)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--save-steps", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0, help="the same on every worker")
    parser.add_argument("--resume", action="store_true", help="from the last checkpoint")
    parser.add_argument(
        "--data-dispatch",
        choices=("local", "server"),
        default="local",
        help="server: train the work units the server leases (each sample "
        "once across the workers); local: batches drawn by step, seeded",
    )
    parser.add_argument("--unit-size", type=int, default=256, help="samples per work unit")
    parser.add_argument(
        "--devices",
        type=int,
        default=1,
        help="processes of this worker (DDP under torchrun when above 1)",
    )
    parser.add_argument("--json", default=None, help="write the figures here")
    options = parser.parse_args()
    if options.data_dispatch == "server" and options.devices > 1:
        parser.error("--data-dispatch server is for one process per worker (--devices 1)")
    try:
        split = split_train_val(load_named_corpus(options.corpus))
        val = eval_batches(split.val, options.batch_size, options.seq_len, 8)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    callback = DiLoCoCallback(options.server, options.worker_id)
    leased = None
    if options.data_dispatch == "server":
        # every worker names the same bytes and window length with the same id
        digest = hashlib.sha256(split.train.numpy().tobytes()).hexdigest()[:16]
        windows = len(TokenWindows(split.train, options.seq_len))
        leased = callback.leased_sampler(f"bytes-{digest}-w{options.seq_len}", windows,
                                         unit_size=options.unit_size)  # fmt: skip
    module = ByteGPT(options, split.train, leased)
    initial = eval_loss(module, val)
    module.model.train()
    checkpoints = ModelCheckpoint(dirpath=Path(options.output_dir) / "checkpoints",
                                  every_n_train_steps=options.save_steps, save_top_k=-1,
                                  save_last=True)  # fmt: skip
    trainer = L.Trainer(
        max_steps=options.steps,
        accumulate_grad_batches=options.grad_accum,
        gradient_clip_val=1.0,
        callbacks=[callback, checkpoints],
        default_root_dir=options.output_dir,
        accelerator="auto",
        devices=options.devices,
        strategy="ddp" if options.devices > 1 else "auto",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    try:
        trainer.fit(module, ckpt_path="last" if options.resume else None)
    except DiLoCoCallbackError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (ServerError, ServerUnavailable) as exc:
        print(f"error: the server failed us: {exc}", file=sys.stderr)
        return 1
    final = eval_loss(module, val)
    figures = {
        "initial_eval_loss": initial,
        "final_eval_loss": final,
        "global_step": trainer.global_step,
        "resumed_from": callback.resumed_from,
        "worker": callback.worker_stats,
    }
    if trainer.is_global_zero:  # under torchrun the group is one worker: one report
        print(f"eval loss {initial:.4f} -> {final:.4f}, {figures['worker']['rounds']} rounds")
        if options.json:
            Path(options.json).write_text(json.dumps(figures, indent=2))
    if torch.distributed.is_initialized():
        # PyTorch 2.13 on CPU: a process that ran DDP over gloo can abort at interpreter exit
        # after all its work is done ("terminate called without an active exception").
        torch.distributed.destroy_process_group()
        sys.stdout.flush()
        os._exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
