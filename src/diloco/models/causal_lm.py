"""Any transformers causal LM, built from a config file with random weights (nothing downloaded).

`diloco worker --model-config config.json` trains it on the same byte tokens as the bundled
GPT, so a user can try DiLoCo on their own architecture without writing code. The file is a
transformers config (`model_type` plus that model's fields, as `config.json` of any hub model);
its `vocab_size` must cover the 256 byte values.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from diloco.models.gpt import VOCAB_SIZE

# Where transformers configs keep the longest sequence a model takes (None: no fixed limit)
POSITION_FIELDS = ("n_positions", "max_position_embeddings", "n_ctx", "max_sequence_length")
INSTALL_HINT = "pip install 'diloco[transformers]' (or: pip install transformers)"


class ModelConfigError(ValueError):
    """A model config that cannot be read or cannot build a model; the message names why."""


@dataclass(frozen=True)
class CausalLMConfig:
    """A transformers causal-LM config as read from a file, plus how to train it on bytes."""

    path: str
    fields: dict = field(compare=False, repr=False)
    model_type: str = ""

    @classmethod
    def from_file(cls, path: str | Path) -> CausalLMConfig:
        """Read and check the file, then build the model once, so a bad config fails at once."""
        try:
            fields = json.loads(Path(path).read_text())
        except OSError as exc:
            raise ModelConfigError(f"--model-config {path}: cannot read it ({exc})") from None
        except ValueError as exc:
            raise ModelConfigError(f"--model-config {path} is not JSON: {exc}") from None
        if not isinstance(fields, dict) or not isinstance(fields.get("model_type"), str):
            raise ModelConfigError(
                f"--model-config {path} must be a JSON object with a 'model_type' "
                '(a transformers config, e.g. {"model_type": "llama", ...})'
            )
        spec = cls(str(path), fields, fields["model_type"])
        _check_causal_lm(spec.model_type, path)
        vocab = spec.transformers_config().vocab_size
        if not isinstance(vocab, int) or vocab < VOCAB_SIZE:
            raise ModelConfigError(
                f"--model-config {path}: vocab_size must be >= {VOCAB_SIZE} to hold byte "
                f"tokens, got {vocab!r}"
            )
        spec.build()
        return spec

    @property
    def context(self) -> int | None:
        """The longest sequence the model takes, or None if its config sets no limit."""
        config = self.transformers_config()
        for name in POSITION_FIELDS:
            value = getattr(config, name, None)
            if isinstance(value, int):
                return value
        return None

    def transformers_config(self):
        transformers = _transformers()
        fields = {k: v for k, v in self.fields.items() if k != "model_type"}
        try:
            return transformers.AutoConfig.for_model(self.model_type, **fields)
        except Exception as exc:  # a user's config: any failure of theirs is a bad input
            raise ModelConfigError(f"--model-config {self.path}: {_reason(exc)}") from None

    def build(self) -> nn.Module:
        """A fresh model with random weights (seed torch first for the same weights everywhere)."""
        transformers = _transformers()
        config = self.transformers_config()
        try:
            return transformers.AutoModelForCausalLM.from_config(config)
        except Exception as exc:  # a user's config: any failure of theirs is a bad input
            raise ModelConfigError(
                f"--model-config {self.path}: the {self.model_type} model does not build: "
                f"{_reason(exc)}"
            ) from None

    @staticmethod
    def loss(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-byte cross entropy (targets are the inputs shifted by one, as for GPT)."""
        logits = model(input_ids=tokens).logits
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))


def _reason(exc: BaseException) -> str:
    """The first line of the innermost cause (validators wrap the readable error)."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _check_causal_lm(model_type: str, path: str | Path) -> None:
    """A model type transformers knows and can build as a causal LM, else a short list."""
    _transformers()
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        examples = [t for t in ("llama", "gpt2", "mistral", "qwen2", "gemma", "phi3")
                    if t in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES]  # fmt: skip
        raise ModelConfigError(
            f"--model-config {path}: model_type {model_type!r} is not a causal LM that this "
            f"transformers knows ({len(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)} are, e.g. "
            f"{', '.join(examples)})"
        )


def _transformers():
    try:
        import transformers
    except ImportError:
        raise ModelConfigError(f"--model-config needs transformers: {INSTALL_HINT}") from None
    # Its notices about token ids outside a 256-byte vocabulary are not ours to show
    logging.getLogger("transformers").setLevel(logging.ERROR)
    transformers.logging.set_verbosity_error()
    return transformers
