"""DiLoCo inside a Lightning `Trainer`: one callback turns the fit into a worker.

    trainer = L.Trainer(max_steps=..., callbacks=[DiLoCoCallback(URL, "w0"), ModelCheckpoint(...)])
    trainer.fit(module)                 # after a crash: trainer.fit(module, ckpt_path="last")

The callback attaches in `on_train_start`, once Lightning has built and (on a resume) restored
the optimizer, and hooks that torch optimizer, so H counts optimizer steps whatever
`accumulate_grad_batches` is. Each checkpoint Lightning writes carries, in this callback's
state, where the worker's state of that very step was saved (`state_dir`/step-N: anchor,
steps into the round, error-feedback residual, identity, as safetensors and JSON; Lightning's
own file holds only that path and the run's settings); `fit(ckpt_path=...)` restores it. The
end of the fit syncs a last partial round, so the module ends on the global weights (a
`ModelCheckpoint` saved in the fit's last batch comes before that sync and holds local ones:
save with `trainer.save_checkpoint(...)` after `fit` for the global model).
"""

from __future__ import annotations

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
)
from diloco.worker import DiLoCoWorker
from diloco.worker.data.tokens import samples_in

try:
    from lightning.pytorch.callbacks import Callback
except ImportError as exc:  # pragma: no cover - the message is the point
    raise ImportError(
        "diloco.integrations.lightning needs Lightning: pip install 'diloco[lightning]'"
    ) from exc

__all__ = ["DiLoCoCallback", "DiLoCoCallbackError"]
log = logging.getLogger("diloco.integrations.lightning")


def _run_settings(trainer: Any) -> dict:
    """What a resume must keep. A GradientAccumulationScheduler changes
    `accumulate_grad_batches` at epoch starts (after `on_train_start`, where a resume is
    checked): its schedule is the setting then, not the value of the moment, which refused
    every resume saved past its first change."""
    for callback in getattr(trainer, "callbacks", ()):
        scheduling = getattr(callback, "scheduling", None)
        if type(callback).__name__ == "GradientAccumulationScheduler" and isinstance(
            scheduling, dict
        ):
            schedule = {str(epoch): int(n) for epoch, n in sorted(scheduling.items())}
            return {"accumulate_grad_batches": schedule}
    return {"accumulate_grad_batches": int(trainer.accumulate_grad_batches)}


class DiLoCoCallback(Callback):
    """Makes a Lightning fit one DiLoCo worker of the server at `server_url`.

    `state_dir` (default: <trainer.default_root_dir>/diloco-<worker id>) receives the worker state
    at each checkpoint; `worker_options` go to `DiLoCoWorker` (retry, ca_file, ...).
    After the fit, `worker_stats` holds the worker's figures (rounds, bytes, blocked time).
    """

    def __init__(
        self,
        server_url: str,
        worker_id: str | None = None,
        token: str | None = None,
        state_dir: str | Path | None = None,
        **worker_options: Any,
    ) -> None:
        refuse_owned_options(worker_options, "Lightning")
        self.server_url = server_url
        self.worker_id = worker_id
        self.token = token
        self.state_dir = None if state_dir is None else Path(state_dir)
        self.worker_options = worker_options
        self.worker: DiLoCoWorker | None = None
        self.worker_stats: dict | None = None
        self.resumed_from: str | None = None
        self._restored: dict | None = None
        self._saved_at: int | None = None
        self._trainer: Any = None
        self._warned_sharded = False
        self._leased: LeasedTrainSampler | None = None

    def leased_sampler(
        self,
        dataset_id: str,
        length: int,
        *,
        unit_size: int = 256,
        shuffle_seed: int = 0,
        lease_count: int = 1,
    ) -> LeasedTrainSampler:
        """A sampler for the module's train DataLoader (`sampler=`) over the work units the
        server leases of a map-style dataset of `length` samples (the same `dataset_id` on
        every worker), so that each sample is trained once across the run. A sample counts
        as trained when its batch starts training (not when Lightning fetches it ahead); the
        worker state in each checkpoint keeps the position, and `fit(ckpt_path=...)`
        continues from it. One process per worker; set max_steps."""
        self._leased = LeasedTrainSampler(
            length, dataset_id, unit_size=unit_size, shuffle_seed=shuffle_seed,
            lease_count=lease_count,
        )  # fmt: skip
        return self._leased

    # ----------------------------------------------------------------- Lightning events

    def on_train_start(self, trainer, pl_module) -> None:
        if self.worker is not None:
            return
        optimizers = list(trainer.optimizers)
        if len(optimizers) != 1:
            raise DiLoCoCallbackError(
                f"DiLoCo hooks one inner optimizer; configure_optimizers gave {len(optimizers)}"
            )
        inner = torch_optimizer(optimizers[0])
        schedulers = [config.scheduler for config in trainer.lr_scheduler_configs]
        resume = resume_on_every_rank(lambda: self._resume_dir(trainer))
        self.resumed_from = None if resume is None else str(resume)
        self.worker = DiLoCoWorker(
            pl_module,
            inner,
            self.server_url,
            self.worker_id,
            self.token,
            checkpoint_dir=resume,
            scheduler=schedulers[0] if len(schedulers) == 1 else None,
            save_every_round=False,
            **self.worker_options,
        )
        worker, self.worker = self.worker, None
        check_resumed(worker, resume)
        if self._leased is not None:
            self._leased.bind(worker, trainer.world_size)
        self.worker = worker

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        """A failed fit leaves the run: no partial round, no heartbeats holding a barrier."""
        if self.worker is not None:
            worker, self.worker = self.worker, None
            worker.close(final_sync=False)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._saved_at is not None:  # the checkpoint file of the last step is written now
            self._saved_at = None
            crash_point("lightning_checkpoint_saved")
        if self._leased is not None:
            self._leased.trained(samples_in(batch))  # its samples are trained from here on

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if self.worker is not None and loss is not None and hasattr(loss, "item"):
            self.worker.report(loss=float(loss.item()))

    def on_train_end(self, trainer, pl_module) -> None:
        if self.worker is None:
            return
        worker, self.worker = self.worker, None
        worker.close()  # a last partial round: the module ends on the global weights
        self.worker_stats = worker.stats()

    # ----------------------------------------------------------------- checkpoints

    def state_dict(self) -> dict:
        """Called as Lightning writes a checkpoint: the worker state of this step goes to
        state_dir/step-N, and the checkpoint keeps where, with the run's settings."""
        if self.worker is None or self._trainer is None:
            return {}
        if self.worker.sharded:  # FSDP2: each rank holds rows of the anchor; not saved
            if self.worker.is_leader and not self._warned_sharded:
                log.warning(
                    "the worker state of an FSDP-sharded group is not saved with checkpoints: "
                    "a resumed fit rejoins from the server's weights"
                )
            self._warned_sharded = True
            return {}
        step = self._trainer.global_step
        directory = (self._state_root(self._trainer) / f"step-{step}").resolve()
        self.worker.save_checkpoint(directory)  # a group's rank 0 saves, the others not
        self._saved_at = step
        return {"dir": str(directory), "step": step, **_run_settings(self._trainer)}

    def load_state_dict(self, state_dict: dict) -> None:
        self._restored = dict(state_dict) or None

    def setup(self, trainer, pl_module, stage: str) -> None:
        self._trainer = trainer

    def _state_root(self, trainer: Any) -> Path:
        """One folder per worker id, so workers started in one directory never share it."""
        worker_id = self.worker.worker_id if self.worker is not None else self.worker_id
        return self.state_dir or Path(trainer.default_root_dir) / f"diloco-{worker_id}"

    def _resume_dir(self, trainer: Any) -> Path | None:
        saved = self._restored
        if not saved:
            return None
        now = _run_settings(trainer)
        changed = changed_settings(saved, now)
        if changed:
            raise DiLoCoCallbackError(
                f"the checkpoint was saved with other Trainer settings ({', '.join(changed)}): "
                "H counts optimizer steps, so a resume must keep them"
            )
        if saved.get("step") != trainer.global_step:
            raise DiLoCoCallbackError(
                f"the worker state {saved.get('dir')} was saved at step {saved.get('step')}, "
                f"Lightning resumed at step {trainer.global_step}"
            )
        directory = Path(saved["dir"])
        if not directory.is_dir():
            raise DiLoCoCallbackError(
                f"the checkpoint's worker state {directory} is gone; start the worker afresh "
                "(without ckpt_path) or restore that folder"
            )
        return directory
