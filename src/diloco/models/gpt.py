"""A small byte-level GPT: the model the demo, simulator, tests and benchmarks train.

Its transformer blocks live in `model.blocks` so that the streaming fragment plan can stride over
them (Streaming DiLoCo assigns block i to fragment i mod P).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from torch import nn
from torch.nn import functional as F

from diloco.algorithm.fragments import BLOCK_CONTAINERS

VOCAB_SIZE = 256  # bytes


@dataclass(frozen=True)
class GPTConfig:
    """Shape of the model; every field must be positive and width divisible by heads."""

    context: int = 128
    width: int = 128
    depth: int = 4
    heads: int = 4
    vocab_size: int = VOCAB_SIZE
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for field in ("context", "width", "depth", "heads", "vocab_size"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"model {field} must be a positive integer, got {value!r}")
        if self.width % self.heads:
            raise ValueError(
                f"model width ({self.width}) must be divisible by heads ({self.heads})"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model dropout must be in [0, 1), got {self.dropout}")

    def to_dict(self) -> dict:
        return asdict(self)

    def build(self) -> nn.Module:
        """A fresh GPT of this shape (seed torch first for the same weights everywhere)."""
        return GPT(self)

    @staticmethod
    def loss(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-byte cross entropy of a model this config built."""
        return model(tokens, targets)[1]


class SelfAttention(nn.Module):
    """Causal multi-head self-attention through PyTorch's fused kernel."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.heads = config.heads
        self.qkv = nn.Linear(config.width, 3 * config.width)
        self.proj = nn.Linear(config.width, config.width)
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        shape = (batch, time, self.heads, width // self.heads)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.proj(y.transpose(1, 2).reshape(batch, time, width))


class Block(nn.Module):
    """Pre-norm transformer block: the repeated unit that fragments are built from."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.norm_attn = nn.LayerNorm(config.width)
        self.attn = SelfAttention(config)
        self.norm_mlp = nn.LayerNorm(config.width)
        self.mlp = nn.Sequential(
            nn.Linear(config.width, 4 * config.width),
            nn.GELU(),
            nn.Linear(4 * config.width, config.width),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm_attn(x))
        return x + self.mlp(self.norm_mlp(x))


class GPT(nn.Module):
    """Decoder-only transformer over bytes; forward returns (logits, loss or None)."""

    def __init__(self, config: GPTConfig | None = None) -> None:
        super().__init__()
        self.config = config or GPTConfig()
        c = self.config
        self.token_embedding = nn.Embedding(c.vocab_size, c.width)
        self.position_embedding = nn.Embedding(c.context, c.width)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.depth))
        self.norm = nn.LayerNorm(c.width)
        self.head = nn.Linear(c.width, c.vocab_size, bias=False)
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
                # GPT-2's scaled init of residual projections keeps deep stacks stable.
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * c.depth))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(
        self, tokens: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        _, time = tokens.shape
        if time > self.config.context:
            raise ValueError(
                f"sequence length {time} exceeds the model context {self.config.context}"
            )
        positions = torch.arange(time, device=tokens.device)
        x = self.token_embedding(tokens) + self.position_embedding(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss


def block_prefixes(model: nn.Module) -> list[str]:
    """State-dict prefixes of a model's repeated blocks ("blocks.0.", ...), or [] if it has none.

    Looks for a `blocks` ModuleList (our GPT) and falls back to `transformer.h` / `model.layers`
    (GPT-2 and Llama layouts), so the fragment plan can stride over foreign models too.
    """
    for path in BLOCK_CONTAINERS:
        module: nn.Module | None = model
        for part in path.split("."):
            module = getattr(module, part, None)
            if module is None:
                break
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            return [f"{path}.{i}." for i in range(len(module))]
    return []
