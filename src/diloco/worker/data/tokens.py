"""Counting the tokens a worker trains when its loop does not report them.

Under `--weighting tokens` the server weighs each pseudo-gradient by the tokens behind it; a
loop that never calls `DiLoCoWorker.report(tokens=...)` would send 0 and be refused. So the
worker counts what its model's training forwards consume: an integer input (token ids) counts
its elements, a float input its batch size (samples). An explicit report replaces the count.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

PREFERRED_INPUTS = ("input_ids", "idx", "tokens", "input", "x")


def batch_tokens(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> int:
    """Tokens in one forward's input: the elements of the first integer tensor (token ids),
    else the batch size of the first tensor; 0 when no input is a tensor."""
    tensors = [kwargs[k] for k in PREFERRED_INPUTS if isinstance(kwargs.get(k), torch.Tensor)]
    tensors += [a for a in args if isinstance(a, torch.Tensor)]
    tensors += [v for v in kwargs.values() if isinstance(v, torch.Tensor)]
    for tensor in tensors:
        if not tensor.is_floating_point() and tensor.dtype != torch.bool:
            return tensor.numel()
    for tensor in tensors:
        return int(tensor.shape[0]) if tensor.dim() else 1
    return 0


def samples_in(batch: Any) -> int:
    """Samples in a batch as a framework passes it: the first dimension of its first tensor
    (in a tuple, list or dict, depth first); 0 when it holds none."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    if isinstance(batch, Mapping):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for item in batch:
            found = samples_in(item)
            if found:
                return found
    return 0


def batch_samples(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> int:
    """Samples in one forward's input (the preferred inputs first), as `samples_in`."""
    preferred = [kwargs[k] for k in PREFERRED_INPUTS if k in kwargs]
    return samples_in([*preferred, *args, *kwargs.values()])


class TokenCounter:
    """A forward pre-hook on the model that calls `add(measure(input))` for every training
    forward (tokens by default; `batch_samples` counts samples)."""

    def __init__(
        self,
        model: nn.Module,
        add: Callable[[int], None],
        measure: Callable[[tuple, dict], int] = batch_tokens,
    ) -> None:
        self._model = model
        self._add = add
        self._measure = measure
        self._handle = model.register_forward_pre_hook(self._count, with_kwargs=True)

    def _count(self, _module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self._model.training and torch.is_grad_enabled():
            self._add(self._measure(args, kwargs))

    def remove(self) -> None:
        self._handle.remove()


class TokenTally:
    """Tokens trained this round and in all, as the loop reports them or, under token
    weighting until the loop reports any, as the model's training forwards count them."""

    def __init__(self) -> None:
        self.in_round = 0
        self.total = 0
        self._counted_in_round = 0  # of in_round, what the counter (not the loop) added
        self._counter: TokenCounter | None = None

    def count_forwards(self, model: nn.Module) -> None:
        """Count `model`'s training forwards until the loop reports tokens itself."""
        self._counter = TokenCounter(model, self._count)

    def report(self, tokens: int) -> None:
        """Tokens the loop reports; the first report replaces the counter's figure."""
        if tokens and self._counter is not None:
            self._counter.remove()
            self._counter = None
            self.in_round -= self._counted_in_round
            self.total -= self._counted_in_round
            self._counted_in_round = 0
        self.in_round += tokens
        self.total += tokens

    def _count(self, tokens: int) -> None:
        self._counted_in_round += tokens
        self.in_round += tokens
        self.total += tokens

    def in_round_over(self, total: Callable[[int], int]) -> int:
        """This round's tokens for a group of processes training one replica (`total` sums
        over its ranks, each calling this): what the loop reported, plus what every rank's
        forwards counted (each rank counts its own batches; the loop reports for the worker)."""
        counted = self._counted_in_round
        return self.in_round - counted + total(counted)

    def round_done(self) -> None:
        self.in_round = 0
        self._counted_in_round = 0

    def round_state(self) -> dict[str, int]:
        """This round's figures, for a checkpoint taken inside the round."""
        return {"in_round": self.in_round, "counted_in_round": self._counted_in_round}

    def resume_round(self, state: Mapping[str, Any]) -> None:
        """A round resumed from a checkpoint inside it goes on with the tokens trained in it."""
        self.in_round = int(state.get("in_round", 0))
        self._counted_in_round = int(state.get("counted_in_round", 0))

    def stop_counting(self) -> None:
        if self._counter is not None:
            self._counter.remove()
