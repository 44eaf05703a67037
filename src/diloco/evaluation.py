"""Held-out loss of a global model, on a fixed set of validation batches shared by every mode."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from diloco.data import eval_batches
from diloco.models import ModelSpec


class Evaluator:
    """Loads a state into one scratch model and averages the loss over fixed batches."""

    def __init__(
        self,
        model_config: ModelSpec,
        val_tokens: torch.Tensor,
        batch_size: int,
        seq_len: int,
        max_batches: int,
    ) -> None:
        self.spec = model_config
        self.model = model_config.build()
        self.batches = eval_batches(val_tokens, batch_size, seq_len, max_batches)

    @torch.no_grad()
    def loss(self, state: Mapping[str, torch.Tensor]) -> float:
        self.model.load_state_dict(state)
        self.model.eval()
        total = 0.0
        for x, y in self.batches:
            total += float(self.spec.loss(self.model, x, y))
        return total / len(self.batches)
