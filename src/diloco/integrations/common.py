"""What every framework callback shares: its error, the optimizer it hooks, the options it owns."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from diloco.worker import distributed

# DiLoCoWorker options a callback sets itself (the framework's checkpoints hold the state)
OWNED_OPTIONS = ("checkpoint_dir", "scheduler", "save_every_round")


class DiLoCoCallbackError(ValueError):
    """The trainer cannot run as a DiLoCo worker as set up; the message names the cause."""


def torch_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside a framework's wrappers (accelerate's AcceleratedOptimizer and
    Lightning's LightningOptimizer keep it in `.optimizer`): its step hook fires once per real
    optimizer step, whatever the gradient accumulation."""
    inner = optimizer
    while isinstance(getattr(inner, "optimizer", None), torch.optim.Optimizer):
        inner = inner.optimizer
    if not isinstance(inner, torch.optim.Optimizer) or not hasattr(
        inner, "register_step_post_hook"
    ):
        raise DiLoCoCallbackError(
            f"cannot hook the trainer's optimizer ({type(optimizer).__name__}): DiLoCo needs a "
            "torch.optim.Optimizer (its step hook counts H); DeepSpeed's own optimizers are not"
        )
    return inner


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
