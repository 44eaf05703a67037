"""DiLoCo inside a transformers `Trainer`: one callback turns the Trainer's run into a worker.

    trainer = Trainer(model, args, train_dataset=..., callbacks=[DiLoCoCallback(URL, "w0")])
    trainer.train()                    # or train(resume_from_checkpoint=True)

The callback attaches once the Trainer has built its optimizer (`on_train_begin`) and hooks
the torch optimizer inside the Trainer's wrappers, so H counts optimizer steps whatever the
gradient accumulation. Every checkpoint the Trainer writes gets the worker's state beside it
(`checkpoint-N/diloco/`: anchor, steps into the round, error-feedback residual, identity, in
safetensors and JSON), taken at that very step; `resume_from_checkpoint` restores it with the
Trainer's own, so a resumed run continues the same DiLoCo run. The Trainer's end syncs a last
partial round, so the model in memory after `train()` is the global one; a checkpoint or an
eval the Trainer makes at its last step (save and eval strategies "steps" at max_steps) comes
before that sync and holds the local weights: call `trainer.save_model()` after `train()` for
the global ones. Under torchrun the process group is
one worker: rank 0 talks to the server and saves the worker state with the checkpoints; a
resumed group continues from it (the Trainer restores every rank's model, optimizer and RNG).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from diloco.faults import crash_point
from diloco.integrations.common import (
    DiLoCoCallbackError,
    LeasedTrainSampler,
    changed_settings,
    check_resumed,
    refuse_owned_options,
    resume_on_every_rank,
    torch_optimizer,
    worker_data_seed,
)
from diloco.worker import DiLoCoWorker
from diloco.worker.data.tokens import TokenCounter, batch_samples

try:
    from transformers import TrainerCallback
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
except ImportError as exc:  # pragma: no cover - the message is the point
    raise ImportError(
        "diloco.integrations.transformers needs transformers: pip install 'diloco[transformers]'"
    ) from exc

__all__ = [
    "DiLoCoCallback",
    "DiLoCoCallbackError",
    "same_data_warning",
    "torch_optimizer",
    "worker_data_seed",
]
log = logging.getLogger("diloco.integrations.transformers")
STATE_DIR = "diloco"  # inside each checkpoint-N folder
RUN_FILE = "trainer_run.json"  # the Trainer settings a resume must keep


def _run_settings(args: Any) -> dict:
    return {
        "gradient_accumulation_steps": int(args.gradient_accumulation_steps),
        "per_device_train_batch_size": int(args.per_device_train_batch_size),
    }


def same_data_warning(args: Any, worker_id: str | None) -> str | None:
    """The warning for a Trainer whose data order every worker shares: its sampler shuffles
    with `data_seed`, else `seed`, and a seed that is not the worker's own (data_seed other
    than seed) is most likely the same on every worker, which then trains the same batches.
    None when data_seed differs from seed (say, `worker_data_seed(seed, worker_id)`)."""
    seed, data_seed = getattr(args, "seed", None), getattr(args, "data_seed", None)
    if seed is None or (data_seed is not None and data_seed != seed):
        return None
    option = "seed" if data_seed is None else "data_seed"
    own = f"worker_data_seed({seed}, {worker_id!r})" if worker_id else "worker_data_seed(...)"
    return (
        f"worker {worker_id}: the Trainer shuffles its train data with TrainingArguments "
        f"{option}={seed}, which is not the worker's own: every worker started with it trains "
        f"the same batches in the same order. Give each worker its own, data_seed={own} "
        "(diloco.integrations.transformers), or train leased data (callback.lease_data); "
        "a train_dataset that is a shard of this worker's own needs neither"
    )


class DiLoCoCallback(TrainerCallback):
    """Makes a `transformers.Trainer` one DiLoCo worker of the server at `server_url`.

    `worker_options` go to `DiLoCoWorker` (retry, ca_file, max_upload_mbps, heartbeat, ...).
    After training, `worker_stats` holds the worker's figures (rounds, bytes, blocked time).
    """

    def __init__(
        self,
        server_url: str,
        worker_id: str | None = None,
        token: str | None = None,
        **worker_options: Any,
    ) -> None:
        refuse_owned_options(worker_options, "the Trainer")
        self.server_url = server_url
        self.worker_id = worker_id
        self.token = token
        self.worker_options = worker_options
        self.worker: DiLoCoWorker | None = None
        self.worker_stats: dict | None = None
        self.resumed_from: str | None = None
        self._leased: LeasedTrainSampler | None = None
        self._sample_counter: TokenCounter | None = None
        self._warned_sharded = False

    def lease_data(
        self,
        trainer: Any,
        dataset_id: str,
        *,
        unit_size: int = 256,
        shuffle_seed: int = 0,
        lease_count: int = 1,
    ) -> None:
        """Train `trainer` on the work units the server leases of its train_dataset (the
        same `dataset_id` on every worker), so that each sample is trained once across the run.

        The samples count as trained when the model's training forwards consume them, not when
        the dataloader fetches them ahead; the worker's state in each checkpoint keeps the
        position, and a resume continues from it, so the Trainer must not skip batches itself
        (`TrainingArguments(ignore_data_skip=True)`). One process per worker; set max_steps.
        """
        args = trainer.args
        if not args.ignore_data_skip:
            raise DiLoCoCallbackError(
                "leased data needs TrainingArguments(ignore_data_skip=True): on a resume the "
                "Trainer skips batches by drawing them from the sampler, which would hand out "
                "leased samples untrained (the worker's checkpoint resumes the data itself)"
            )
        if args.world_size > 1:
            raise DiLoCoCallbackError(
                "leased data is for a single-process Trainer: under torchrun only rank 0 talks "
                "to the server"
            )
        try:
            length = len(trainer.train_dataset)
        except TypeError:
            raise DiLoCoCallbackError(
                "leased data needs a train_dataset with a length (a map-style dataset)"
            ) from None
        leased = self._leased = LeasedTrainSampler(
            length, dataset_id, unit_size=unit_size, shuffle_seed=shuffle_seed,
            lease_count=lease_count,
        )  # fmt: skip
        trainer._get_train_sampler = lambda *_args, **_kwargs: leased  # the Trainer's hook

    # ----------------------------------------------------------------- Trainer events

    def on_train_begin(self, args, state, control, model=None, optimizer=None,
                       lr_scheduler=None, **kwargs):  # fmt: skip
        if self.worker is not None:
            # The last train() ended in an exception (no on_train_end): its worker holds the
            # anchor and round of a model this train() has since restored from a checkpoint,
            # so it leaves without a last sync, and this train() joins with a worker of its own.
            log.warning(
                "the last train() did not end; its worker leaves without a last sync, and "
                "this train() joins anew from the weights the Trainer restored"
            )
            stale, self.worker = self.worker, None
            if self._sample_counter is not None:
                self._sample_counter.remove()
                self._sample_counter = None
            stale.close(final_sync=False)
        if optimizer is None or model is None:
            raise DiLoCoCallbackError(
                "the Trainer has no optimizer yet: DiLoCoCallback attaches in on_train_begin, "
                "once Trainer.train() has built it (pass the callback to Trainer(callbacks=...))"
            )
        if getattr(args, "load_best_model_at_end", False):
            raise DiLoCoCallbackError(
                "load_best_model_at_end loads an old local checkpoint before the final sync, "
                "which would send it to the server as this worker's last update; turn it off "
                "(the model a DiLoCo run ends on is the global one)"
            )
        inner = torch_optimizer(optimizer)
        resume = resume_on_every_rank(lambda: self._checked_state(args, state))
        if resume is not None:
            self.resumed_from = str(resume)
        self.worker = DiLoCoWorker(
            model,
            inner,
            self.server_url,
            self.worker_id,
            self.token,
            checkpoint_dir=resume,
            scheduler=lr_scheduler,
            save_every_round=False,
            **self.worker_options,
        )
        worker, self.worker = self.worker, None
        check_resumed(worker, resume)
        self.worker = worker
        if self._leased is not None:
            self._bind_leased_data(worker, model)
        elif worker.is_leader:
            warning = same_data_warning(args, worker.worker_id)
            if warning is not None:
                log.warning(warning)

    def _bind_leased_data(self, worker: DiLoCoWorker, model: Any) -> None:
        assert self._leased is not None
        self.worker = None  # bind makes the worker leave if it fails
        sampler = self._leased.bind(worker)
        self.worker = worker
        # a sample is trained when a training forward of the model consumes it
        self._sample_counter = TokenCounter(model, sampler.trained, batch_samples)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.worker is not None and logs and isinstance(logs.get("loss"), (int, float)):
            self.worker.report(loss=float(logs["loss"]))

    def on_save(self, args, state, control, **kwargs):
        if self.worker is None:
            return
        if self.worker.sharded:  # FSDP2: each rank holds rows of the anchor; not saved
            if not self._warned_sharded and self.worker.is_leader:
                log.warning(
                    "the worker state of an FSDP-sharded group is not saved with checkpoints: "
                    "a resumed group rejoins from the server's weights"
                )
            self._warned_sharded = True
            return
        if not self.worker.is_leader:
            return  # a group's rank 0 saves its state
        folder = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        (folder / STATE_DIR).mkdir(parents=True, exist_ok=True)
        # The Trainer's step, not the hook's count: fp16 overflow skips steps the hook never sees
        run = {**_run_settings(args), "global_step": int(state.global_step)}
        (folder / STATE_DIR / RUN_FILE).write_text(json.dumps(run))
        self.worker.save_checkpoint(folder / STATE_DIR)
        crash_point("trainer_checkpoint_saved")

    def on_train_end(self, args, state, control, **kwargs):
        if self.worker is None:
            return
        worker, self.worker = self.worker, None
        worker.close()  # a last partial round: the Trainer ends on the global weights
        self.worker_stats = worker.stats()
        if self._sample_counter is not None:
            self._sample_counter.remove()
            self._sample_counter = None

    # ----------------------------------------------------------------- resuming

    def _checked_state(self, args: Any, state: Any) -> Path | None:
        saved = self._saved_state(args, state)
        if saved is not None:
            self._check_same_settings(saved, args, state)
        return saved

    @staticmethod
    def _saved_state(args: Any, state: Any) -> Path | None:
        """The worker state saved with the checkpoint the Trainer resumed from, if any: the
        Trainer names checkpoints after their step, and has restored that step by now."""
        if not state.global_step:
            return None
        folder = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        saved = folder / STATE_DIR
        if not saved.is_dir():
            log.warning(
                "no DiLoCo worker state in %s (the Trainer resumed at step %d; a checkpoint "
                "outside output_dir is not looked for): joining afresh from the server's weights",
                folder,
                state.global_step,
            )
            return None
        return saved

    @staticmethod
    def _check_same_settings(saved: Path, args: Any, state: Any) -> None:
        path = saved / RUN_FILE
        try:
            before = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise DiLoCoCallbackError(f"cannot read {path}: {exc}") from None
        if before.get("global_step") != state.global_step:
            raise DiLoCoCallbackError(
                f"the worker state in {saved} was saved at step {before.get('global_step')}, "
                f"the Trainer resumed at step {state.global_step}"
            )
        now = _run_settings(args)
        changed = changed_settings(before, now)
        if changed:
            raise DiLoCoCallbackError(
                f"the run in {saved.parent} was saved with other Trainer settings "
                f"({', '.join(changed)}): H counts optimizer steps, so a resume must keep them"
            )
