"""What every framework callback shares: its error, the optimizer it hooks, the options it owns."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from diloco.worker.data.leased_sampler import LeasedSampler
from diloco.worker.parallel import distributed

log = logging.getLogger("diloco.integrations")

# DiLoCoWorker options a callback sets itself (the framework's checkpoints hold the state)
OWNED_OPTIONS = ("checkpoint_dir", "scheduler", "save_every_round")


class DiLoCoCallbackError(ValueError):
    """The trainer cannot run as a DiLoCo worker as set up; the message names the cause."""


def worker_data_seed(seed: int, worker_id: str) -> int:
    """A data-order seed of the worker's own: `seed` mixed with its id (SHA-256, < 2**32), so
    workers started with one seed (which must build the same initial weights) shuffle their
    data apart, and a worker resumed under its id shuffles as it did before."""
    digest = hashlib.sha256(f"{seed}\0{worker_id}".encode()).digest()
    return int.from_bytes(digest[:4], "big")


def torch_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside a framework's wrappers (accelerate's AcceleratedOptimizer and
    Lightning's LightningOptimizer keep it in `.optimizer`): its step hook fires once per real
    optimizer step, whatever the gradient accumulation."""
    chain, wrapped = [optimizer], optimizer
    while (wrapped := getattr(wrapped, "optimizer", None)) is not None and len(chain) < 16:
        chain.append(wrapped)
    if any(_deepspeed(part) for part in chain):
        # (accelerate's DeepSpeedOptimizerWrapper is a torch Optimizer that never ran its
        # __init__, over ZeRO's, which copies its own fp32 partitions back into the model
        # after the step a hook would sync in: the global weights would be overwritten)
        raise DiLoCoCallbackError(
            f"cannot hook the trainer's optimizer ({type(optimizer).__name__}): DeepSpeed "
            "(ZeRO) optimizers are not supported; train without DeepSpeed, or shard with FSDP2"
        )
    inner = optimizer
    while isinstance(getattr(inner, "optimizer", None), torch.optim.Optimizer):
        inner = inner.optimizer
    if not isinstance(inner, torch.optim.Optimizer) or not hasattr(
        inner,
        "_optimizer_step_post_hooks",  # (an Optimizer whose __init__ ran)
    ):
        raise DiLoCoCallbackError(
            f"cannot hook the trainer's optimizer ({type(optimizer).__name__}): DiLoCo needs a "
            "torch.optim.Optimizer (its step hook counts H); DeepSpeed's own optimizers are not"
        )
    return inner


def _deepspeed(part: object) -> bool:
    """An optimizer object of DeepSpeed's, or a framework's wrapper named for it."""
    kind = type(part)
    return kind.__module__.split(".")[0] == "deepspeed" or "DeepSpeed" in kind.__name__


def refuse_owned_options(worker_options: dict[str, Any], framework: str) -> None:
    """A callback's DiLoCoWorker options may not include the ones it sets itself."""
    for owned in OWNED_OPTIONS:
        if owned in worker_options:
            raise DiLoCoCallbackError(
                f"{owned} is the callback's to set ({framework}'s checkpoints hold the worker "
                "state)"
            )


def check_resumed(worker: Any, resume: Any) -> None:
    """A worker asked to resume from `resume` that ignored it (the state did not fit) leaves
    the run at once, and the callback says so, instead of training from the server's weights
    under a Trainer that restored other ones."""
    if resume is None or worker.resumed is not None:
        return
    worker.close(final_sync=False)
    raise DiLoCoCallbackError(
        f"the worker state in {resume} does not fit this model and optimizer (the log says "
        "why); resume from a checkpoint of this run, or start afresh"
    )


def changed_settings(saved: dict, now: dict) -> list[str]:
    """'name before -> now' for each run setting a resume must keep but does not."""
    return [f"{k} {saved.get(k)} -> {v}" for k, v in now.items() if saved.get(k) != v]


def resume_on_every_rank(find: Callable[[], Path | None]) -> Path | None:
    """The saved worker state to resume, as rank 0 finds and checks it (only rank 0 saves it,
    so only it may see the folder); every rank of a torch.distributed group gets its path, or
    raises when rank 0 refused it."""

    def share(found: Path | None) -> Path | None:
        path = distributed.broadcast_json(None if found is None else str(found))
        return None if path is None else Path(path)

    try:
        return distributed.lead(find, share)
    except distributed.LeaderFailed as exc:  # the other ranks fail as rank 0 did
        raise DiLoCoCallbackError(str(exc)) from None


class LeasedTrainSampler(torch.utils.data.Sampler[int]):
    """A framework's sampler for server-leased data. Frameworks build their train dataloader
    before the callback has a worker and iterate it only after, so the worker's
    `LeasedSampler` is bound (`bind`) when training starts.

    One iteration runs epoch after epoch of the server's (it shares each epoch's units among
    the workers; the framework stops at max_steps). Each new iteration first hands out again
    what the last one fetched and never trained: a dataloader's read-ahead dies with its
    iterator at the framework's epoch end. Samples count as trained through `trained(n)`, as
    the framework consumes them.
    """

    def __init__(self, length: int, dataset_id: str, **options: Any) -> None:
        """`options` go to LeasedSampler (unit_size, shuffle_seed, lease_count)."""
        self.length = length
        self.dataset_id = dataset_id
        self.options = options
        self.leased: LeasedSampler | None = None
        self._warned_empty = False

    def __len__(self) -> int:
        return self.length

    def bind(self, worker: Any, processes: int = 1) -> LeasedSampler:
        """The worker's sampler, counting trained samples. Refused on a streaming server or
        for a worker of several `processes`; on any failure the worker leaves the run."""
        try:
            if processes > 1:
                raise DiLoCoCallbackError(
                    "leased data is for one process per worker: under torch.distributed only "
                    "rank 0 talks to the server"
                )
            if worker.settings.mode == "streaming":
                raise DiLoCoCallbackError(
                    "leased data through a framework callback is for sync and async servers: "
                    "a streaming server takes whole units only"
                )
            self.leased = LeasedSampler.for_worker(
                worker, self.dataset_id, self.length, count_trained=True, **self.options
            )
        except BaseException:  # refused, or the server failed us: leave the run
            worker.close(final_sync=False)
            raise
        return self.leased

    def trained(self, samples: int) -> None:
        if self.leased is None:
            return
        if samples == 0 and not self._warned_empty:
            self._warned_empty = True
            log.warning(
                "a training batch held no tensor to count samples by: leased samples count "
                "as trained only by the first dimension of a batch's first tensor"
            )
        self.leased.trained(samples)

    def __iter__(self) -> Iterator[int]:
        leased = self.leased
        if leased is None:
            raise DiLoCoCallbackError(
                "the leased sampler has no worker yet: iterate the train dataloader only "
                "inside the framework's training, with the DiLoCoCallback among its callbacks"
            )
        leased.give_back_untrained()
        empty_epochs = 0
        while empty_epochs < 2:  # one empty iteration is an epoch boundary; two, no data
            handed_out = False
            for index in leased:
                handed_out = True
                yield index
            empty_epochs = 0 if handed_out else empty_epochs + 1
        raise RuntimeError(f"dataset {self.dataset_id!r} gave no work units in a new epoch")
