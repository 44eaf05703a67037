"""Models used by the demo, the tests and the benchmarks, and the spec a replica trains."""

from typing import Protocol

import torch
from torch import nn

from diloco.models.gpt import GPT, GPTConfig, block_prefixes


class ModelSpec(Protocol):
    """What a replica and an evaluator need of a model: build it, and its loss on bytes.

    GPTConfig (the bundled GPT) and models.causal_lm.CausalLMConfig (any transformers causal
    LM from a config file) are the two kinds.
    """

    @property
    def context(self) -> int | None: ...

    def build(self) -> nn.Module: ...

    def loss(
        self, model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor
    ) -> torch.Tensor: ...


__all__ = ["GPT", "GPTConfig", "ModelSpec", "block_prefixes"]
