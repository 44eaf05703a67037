"""A transformers `Trainer` as one DiLoCo worker: a tiny GPT-2 (random init) on a corpus's bytes.

Start a server, then one of these per worker (each on its own machine, or all on one):

    diloco server --sync-every 50 --min-workers 2
    python examples/transformers_trainer.py --server http://127.0.0.1:8470 --worker-id w0 \
        --output-dir run-w0 --steps 500
    # after a crash: the same command with --resume continues from the last checkpoint

No model is downloaded: it is built from examples/model_configs/gpt2-tiny.json (any causal
LM config with vocab_size >= 256 works, --model-config) and trained on bytes: of Shakespeare's
plays by default (fetched once into a cache, as `diloco worker` does), or --corpus FILE.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

from diloco.data import TokenWindows, load_named_corpus, split_train_val
from diloco.integrations.transformers import (
    DiLoCoCallback,
    DiLoCoCallbackError,
    worker_data_seed,
)
from diloco.models.causal_lm import CausalLMConfig, ModelConfigError
from diloco.worker import ServerError, ServerUnavailable

HERE = Path(__file__).resolve().parent
EVAL_REPORT_SECONDS = 15.0  # an evaluation says how far it is this often


class ByteWindows(torch.utils.data.Dataset):
    """The corpus's windows as the Trainer wants them: input ids, labels shifted by the model."""

    def __init__(self, tokens: torch.Tensor, seq_len: int) -> None:
        self.windows = TokenWindows(tokens, seq_len)

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        x, _ = self.windows[index]
        return {"input_ids": x, "labels": x}


@torch.no_grad()
def eval_loss(
    model: torch.nn.Module,
    windows: ByteWindows,
    batch_size: int,
    what: str,
    max_batches: int | None = None,
    say: bool = True,
) -> float:
    """Mean loss per window over `windows` (its first `max_batches` batches), outside the
    Trainer: under torchrun a Trainer.evaluate() before train() marks the model as prepared,
    and train() then never wraps it in DDP (transformers 5.24, accelerate 1.15), so the ranks
    would train apart. With `say`, it tells stderr how many batches it reads, how far it is
    every EVAL_REPORT_SECONDS, and the loss."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    batches = math.ceil(len(windows) / batch_size)
    if max_batches is not None:
        batches = min(batches, max_batches)

    def report(line: str) -> None:
        if say:
            print(f"eval of {what}: {line}", file=sys.stderr, flush=True)

    report(f"{batches:,} batches of {batch_size} windows")
    started = time.monotonic()
    next_report = started + EVAL_REPORT_SECONDS
    total, count = 0.0, 0
    for batch in range(batches):
        start = batch * batch_size
        ids = torch.stack(
            [windows[i]["input_ids"] for i in range(start, min(start + batch_size, len(windows)))]
        )
        ids = ids.to(device)
        total += float(model(input_ids=ids, labels=ids).loss) * len(ids)
        count += len(ids)
        if time.monotonic() >= next_report:
            report(f"{batch + 1:,}/{batches:,} batches, {time.monotonic() - started:.0f} s")
            next_report = time.monotonic() + EVAL_REPORT_SECONDS
    model.train(was_training)
    report(f"loss {total / count:.4f} ({time.monotonic() - started:.0f} s)")
    return total / count


class EvalAtStart(TrainerCallback):
    """The eval loss of the weights training starts from: after the Trainer restored its
    checkpoint (--resume) and the worker joined (a worker joining a run under way starts from
    the server's weights), so that "eval loss A -> B" is this run's own. Put it after the
    DiLoCoCallback."""

    def __init__(self, measure) -> None:
        self.measure = measure
        self.loss: float | None = None
        self.step = 0

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if self.loss is None:
            self.step = state.global_step
            what = "the weights it starts from" if not self.step else (
                f"the weights it resumes from (step {self.step})"
            )  # fmt: skip
            self.loss = self.measure(model, what)


def parse_options(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", required=True)
    parser.add_argument("--worker-id", default=None)
    parser.add_argument("--corpus", default="shakespeare", help="a text file, or shakespeare")
    parser.add_argument("--model-config", default=str(HERE / "model_configs" / "gpt2-tiny.json"))
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--steps", type=int, default=500, help="optimizer steps (max_steps)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--save-steps", type=int, default=100)
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="the same on every worker: the initial weights (with --data-dispatch local, each "
        "worker shuffles its data with a seed of its own, from --seed and --worker-id)",
    )
    parser.add_argument("--resume", action="store_true", help="from the newest checkpoint")
    parser.add_argument(
        "--data-dispatch",
        choices=("local", "server"),
        default="local",
        help="server: train the work units the server leases (each sample "
        "once across the workers); local: this Trainer's own shuffled order, seeded by "
        "--seed and --worker-id",
    )
    parser.add_argument("--unit-size", type=int, default=256, help="samples per work unit")
    parser.add_argument(
        "--eval-batches",
        type=int,
        default=None,
        help="validation batches of the eval at the start and at the end (default: all)",
    )
    parser.add_argument("--json", default=None, help="write the figures here")
    return parser.parse_args(argv)


def training_arguments(options: argparse.Namespace) -> TrainingArguments:
    """The Trainer's settings. Its data order comes from data_seed: the worker's own (from
    --seed and --worker-id), so two workers train different batches; without --worker-id
    (the server names the worker) it is --seed, and the callback warns."""
    data_seed = options.seed
    if options.worker_id is not None:
        data_seed = worker_data_seed(options.seed, options.worker_id)
    return TrainingArguments(
        output_dir=options.output_dir,
        max_steps=options.steps,
        per_device_train_batch_size=options.batch_size,
        per_device_eval_batch_size=options.batch_size,
        gradient_accumulation_steps=options.grad_accum,
        learning_rate=options.lr,
        warmup_steps=min(50, options.steps // 10),
        lr_scheduler_type="cosine",
        weight_decay=0.1,
        max_grad_norm=1.0,
        save_steps=options.save_steps,
        logging_steps=max(1, min(10, options.steps // 5)),
        seed=options.seed,
        data_seed=data_seed,
        report_to=[],
        use_cpu=not torch.cuda.is_available(),
        disable_tqdm=True,
        ignore_data_skip=options.data_dispatch == "server",  # the worker resumes the data
    )


def main() -> int:
    options = parse_options()
    try:
        spec = CausalLMConfig.from_file(options.model_config)
        split = split_train_val(load_named_corpus(options.corpus))
        train, val = (ByteWindows(t, options.seq_len) for t in (split.train, split.val))
    except (ModelConfigError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    torch.manual_seed(options.seed)  # every worker builds the same initial weights
    model = spec.build()
    args = training_arguments(options)
    callback = DiLoCoCallback(options.server, options.worker_id)
    say = args.process_index == 0  # under torchrun the group is one worker: one report

    def measure(weights: torch.nn.Module, what: str) -> float:
        return eval_loss(weights, val, options.batch_size, what, options.eval_batches, say)

    at_start = EvalAtStart(measure)  # after the callback: once the worker has joined
    trainer = Trainer(model=model, args=args, train_dataset=train, eval_dataset=val,
                      callbacks=[callback, at_start])  # fmt: skip
    if options.data_dispatch == "server":
        # every worker names the same bytes and window length with the same id
        digest = hashlib.sha256(split.train.numpy().tobytes()).hexdigest()[:16]
        callback.lease_data(trainer, f"bytes-{digest}-w{options.seq_len}",
                            unit_size=options.unit_size)  # fmt: skip
    try:
        trainer.train(resume_from_checkpoint=True if options.resume else None)
    except DiLoCoCallbackError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (ServerError, ServerUnavailable) as exc:
        print(f"error: the server failed us: {exc}", file=sys.stderr)
        return 1
    final_loss = measure(model, "the final weights")
    initial_loss = at_start.loss
    figures = {
        "initial_eval_loss": initial_loss,  # of the weights this run started from
        "initial_step": at_start.step,  # > 0: where a resumed run resumed
        "final_eval_loss": final_loss,
        "global_step": trainer.state.global_step,
        "resumed_from": callback.resumed_from,
        "worker": callback.worker_stats,
    }
    if trainer.is_world_process_zero():  # under torchrun the group is one worker: one report
        since = f" from step {at_start.step}, where it resumed," if at_start.step else ""
        print(f"eval loss {initial_loss:.4f} -> {final_loss:.4f}{since} (ln 256 = "
              f"{math.log(256):.4f}), {figures['worker']['rounds']} rounds")  # fmt: skip
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
