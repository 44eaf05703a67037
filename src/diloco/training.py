"""The bundled training recipe: the small GPT with AdamW, warm-up + cosine, clipping.

The simulator runs K of these `Replica`s in one process and `diloco worker` runs one per
process, so a real run and a simulated run train each replica identically.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from diloco.data import BatchSampler
from diloco.models import ModelSpec


def inner_lr(step: int, base_lr: float, warmup: int, total: int) -> float:
    """Linear warm-up then cosine decay to 10% of the base rate (as in the DiLoCo paper)."""
    if warmup and step < warmup:
        return base_lr * (step + 1) / warmup
    span = max(1, total - warmup)
    progress = min(1.0, (step - warmup) / span)
    return base_lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def training_device(name: str) -> torch.device:
    """--device: cpu, cuda, cuda:N, or auto (the first GPU when torch sees one); ValueError
    naming the option for a device this machine does not have."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError, TypeError):
        raise ValueError(f"--device must be cpu, cuda, cuda:N or auto, got {name!r}") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device must be cpu, cuda, cuda:N or auto, got {name!r}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"--device {name}: torch sees no CUDA device on this machine (a CPU build of "
                "torch, or no GPU); use --device cpu"
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(
                f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)"
            )
    return device


def autocast_dtype_of(name: str) -> torch.dtype | None:
    """--dtype: fp32 (no autocast) or bf16 (autocast); ValueError for anything else."""
    if name == "fp32":
        return None
    if name == "bf16":
        return torch.bfloat16
    raise ValueError(f"--dtype must be fp32 or bf16, got {name!r}")


def make_inner_optimizer(model: torch.nn.Module, lr: float, weight_decay: float):
    return torch.optim.AdamW(
        model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay
    )


class Replica:
    """A worker's private training state; the simulator never shares tensors between replicas."""

    def __init__(
        self,
        model_config: ModelSpec,
        initial_state: Mapping[str, torch.Tensor],
        sampler: BatchSampler,
        lr: float,
        warmup: int,
        total_steps: int,
        weight_decay: float,
        device: torch.device | str = "cpu",
        autocast_dtype: torch.dtype | None = None,
    ) -> None:
        """`device`: where the model trains (batches follow it); `autocast_dtype` (bf16):
        forward passes under torch.autocast, the weights and the optimizer staying fp32."""
        self.spec = model_config
        self.device = torch.device(device)
        self.autocast_dtype = autocast_dtype
        self.model = model_config.build()
        self.model.load_state_dict(initial_state)
        self.model.to(self.device)
        self.optimizer = make_inner_optimizer(self.model, lr, weight_decay)
        self.sampler = sampler
        self.base_lr, self.warmup, self.total_steps = lr, warmup, total_steps
        self.steps_done = 0
        self.last_loss = float("nan")

    def train_step(self) -> float:
        """One inner optimizer step on the replica's own next batch."""
        x, y = self.sampler.next_batch()
        loss = self.loss_and_backward(x, y)
        self.apply_gradients()
        return loss

    def loss_and_backward(self, x: torch.Tensor, y: torch.Tensor, scale: float = 1.0) -> float:
        self.model.train()
        if x.device != self.device:
            x = x.to(self.device, non_blocking=True)
            y = y.to(self.device, non_blocking=True)
        with torch.autocast(
            self.device.type,
            dtype=self.autocast_dtype or torch.bfloat16,
            enabled=self.autocast_dtype is not None,
        ):
            loss = self.spec.loss(self.model, x, y)
        (loss * scale).backward()
        return loss.item()

    def apply_gradients(self) -> None:
        lr = inner_lr(self.steps_done, self.base_lr, self.warmup, self.total_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps_done += 1

    def state(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()

    def load(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Overwrite some or all tensors in place (new global weights or a merged fragment)."""
        own = self.model.state_dict()
        with torch.no_grad():
            for name, value in tensors.items():
                own[name].copy_(value)
