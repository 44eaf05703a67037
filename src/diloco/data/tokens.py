"""Byte-level tokens (vocabulary 256): encoding, train/validation split, worker shards, batches.

Bytes are kept as torch.uint8 to use one byte per token in memory; batches are returned as
int64, which is what embedding layers and cross-entropy expect.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.utils.data
from torch import Tensor

from diloco.data.errors import CorpusError
from diloco.data.named import load_named_corpus

__all__ = [
    "VOCAB_SIZE",
    "BatchSampler",
    "CorpusSplit",
    "TokenWindows",
    "encode",
    "eval_batches",
    "load_named_corpus",
    "split_train_val",
    "worker_shard",
]

VOCAB_SIZE = 256


def encode(data: bytes) -> Tensor:
    """The bytes of ``data`` as a 1-D torch.uint8 tensor that owns its memory."""
    if not data:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


@dataclass(frozen=True)
class CorpusSplit:
    """Train and validation tokens (1-D uint8) cut from one corpus."""

    train: Tensor
    val: Tensor


def split_train_val(data: bytes, val_fraction: float = 0.1, chunk_bytes: int = 4096) -> CorpusSplit:
    """Split ``data`` into interleaved chunks so validation samples the whole corpus.

    The corpus is cut into consecutive ``chunk_bytes`` chunks; the last chunk of every group of
    k = round(1 / val_fraction) goes to validation, the rest to training. A corpus shorter than
    k chunks uses k smaller chunks instead, so it still gets a validation part. Deterministic:
    the same bytes always split the same way.
    """
    if not 0 < val_fraction <= 0.5:
        raise ValueError(f"val_fraction must be in (0, 0.5], got {val_fraction}")
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    tokens = encode(data)
    period = round(1 / val_fraction)
    chunk = min(chunk_bytes, max(1, len(tokens) // period))
    full_chunks = len(tokens) // chunk
    rows = tokens[: full_chunks * chunk].view(full_chunks, chunk)
    is_val = torch.arange(full_chunks) % period == period - 1
    train, val = [rows[~is_val].flatten()], [rows[is_val].flatten()]
    tail = tokens[full_chunks * chunk :]
    (val if full_chunks % period == period - 1 else train).append(tail)
    return CorpusSplit(train=torch.cat(train), val=torch.cat(val))


def worker_shard(train: Tensor, worker: int, num_workers: int) -> Tensor:
    """The ``worker``-th of ``num_workers`` contiguous, disjoint, near-equal slices of ``train``.

    Shards differ in length by at most one token and together cover ``train`` exactly.
    """
    if num_workers < 1:
        raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    if not 0 <= worker < num_workers:
        raise ValueError(f"worker must be in [0, {num_workers}), got {worker}")
    start = worker * len(train) // num_workers
    stop = (worker + 1) * len(train) // num_workers
    return train[start:stop]


def _check_length(tokens: Tensor, seq_len: int, what: str, purpose: str) -> None:
    """Raise CorpusError if ``tokens`` cannot hold one window of seq_len + 1 tokens."""
    if len(tokens) < seq_len + 1:
        raise CorpusError(
            f"{what} has {len(tokens)} tokens, fewer than one {purpose} sequence of "
            f"seq_len + 1 = {seq_len + 1}; use a larger corpus or a smaller --seq-len"
        )


def _check_shape(batch_size: int, seq_len: int) -> None:
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")


def _windows(tokens: Tensor, starts: Tensor, seq_len: int) -> tuple[Tensor, Tensor]:
    """Inputs and next-token targets (int64, [len(starts), seq_len]) at the given starts."""
    rows = tokens[starts.unsqueeze(1) + torch.arange(seq_len + 1)].long()
    return rows[:, :-1], rows[:, 1:]


class BatchSampler:
    """Random training windows from one token stream, reproducible from ``seed``.

    Each sampler owns its torch.Generator, so workers with different seeds draw independent
    streams and a given seed always yields the same sequence of batches.
    """

    def __init__(self, tokens: Tensor, batch_size: int, seq_len: int, seed: int) -> None:
        _check_shape(batch_size, seq_len)
        _check_length(tokens, seq_len, "corpus", "training")
        self.tokens = tokens
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.generator = torch.Generator().manual_seed(seed)

    def next_batch(self) -> tuple[Tensor, Tensor]:
        """(x, y), both int64 [batch_size, seq_len], with y[:, i] == x[:, i + 1] shifted."""
        return _windows(self.tokens, self._starts(), self.seq_len)

    def skip(self, batches: int) -> None:
        """Advance as if `batches` batches were drawn (a worker resuming mid-run)."""
        for _ in range(batches):
            self._starts()

    def _starts(self) -> Tensor:
        high = len(self.tokens) - self.seq_len
        return torch.randint(0, high, (self.batch_size,), generator=self.generator)


class TokenWindows(torch.utils.data.Dataset):
    """A map-style dataset of consecutive, non-overlapping training windows of one token stream.

    Sample i is (x, y) for the seq_len + 1 tokens starting at i * seq_len: what a server-side
    permutation of sample indices (work units) addresses.
    """

    def __init__(self, tokens: Tensor, seq_len: int) -> None:
        _check_shape(1, seq_len)
        _check_length(tokens, seq_len, "corpus", "training")
        self.tokens = tokens
        self.seq_len = seq_len

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"window {index} is out of range [0, {len(self)})")
        x, y = _windows(self.tokens, torch.tensor([index * self.seq_len]), self.seq_len)
        return x[0], y[0]


def eval_batches(
    tokens: Tensor, batch_size: int, seq_len: int, max_batches: int
) -> list[tuple[Tensor, Tensor]]:
    """A fixed evaluation set: evenly spaced, non-overlapping windows over ``tokens``.

    Up to ``max_batches`` full batches; if the tokens cannot fill one batch, a single smaller
    batch of every window that fits. Deterministic, so evaluation losses are comparable.
    """
    _check_shape(batch_size, seq_len)
    if max_batches < 1:
        raise ValueError(f"max_batches must be >= 1, got {max_batches}")
    _check_length(tokens, seq_len, "validation split", "evaluation")
    window = seq_len + 1
    fitting = len(tokens) // window
    if fitting < batch_size:
        count = fitting
    else:
        count = min(max_batches, fitting // batch_size) * batch_size
    last_start = len(tokens) - window
    if count == 1:
        starts = torch.zeros(1, dtype=torch.long)
    else:
        starts = torch.arange(count) * last_start // (count - 1)
    return [
        _windows(tokens, starts[first : first + batch_size], seq_len)
        for first in range(0, count, batch_size)
    ]
