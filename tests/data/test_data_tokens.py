"""Byte tokens: split, worker shards, training sampler and evaluation batches."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from diloco.data import (
    VOCAB_SIZE,
    BatchSampler,
    CorpusError,
    encode,
    eval_batches,
    generated_corpus,
    split_train_val,
    worker_shard,
)


def test_encode_keeps_bytes_as_uint8() -> None:
    tokens = encode(b"\x00ab\xff")
    assert tokens.dtype == torch.uint8
    assert tokens.tolist() == [0, 97, 98, 255]
    assert encode(b"").numel() == 0
    assert VOCAB_SIZE == 256


def test_split_interleaves_chunks() -> None:
    data = bytes(range(20))
    split = split_train_val(data, val_fraction=0.5, chunk_bytes=4)
    assert split.train.tolist() == [0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19]
    assert split.val.tolist() == [4, 5, 6, 7, 12, 13, 14, 15]


def test_split_partial_tail_chunk_follows_its_position() -> None:
    split = split_train_val(bytes(range(14)), val_fraction=0.5, chunk_bytes=4)
    assert split.val.tolist() == [4, 5, 6, 7, 12, 13]


def test_split_is_deterministic_and_representative() -> None:
    data = generated_corpus(100 * 4096)
    first = split_train_val(data)
    second = split_train_val(data)
    assert torch.equal(first.train, second.train)
    assert torch.equal(first.val, second.val)
    assert len(first.val) == 10 * 4096
    assert len(first.train) == 90 * 4096
    # Every 10th chunk is validation, so it spans the corpus from start to end.
    val = bytes(first.val.tolist())
    assert val[:4096] == data[9 * 4096 : 10 * 4096]
    assert val[-4096:] == data[-4096:]


def test_small_corpus_still_gets_validation() -> None:
    split = split_train_val(b"x" * 1000, val_fraction=0.1)
    assert len(split.val) == 100
    assert len(split.train) == 900


@pytest.mark.parametrize("fraction", [0.0, -0.1, 0.51, 1.0, float("nan")])
def test_split_rejects_bad_val_fraction(fraction: float) -> None:
    with pytest.raises(ValueError, match="val_fraction"):
        split_train_val(b"abc" * 100, val_fraction=fraction)


def test_split_rejects_bad_chunk_size() -> None:
    with pytest.raises(ValueError, match="chunk_bytes"):
        split_train_val(b"abc", chunk_bytes=0)


def test_worker_shards_are_disjoint_and_cover_train() -> None:
    train = encode(generated_corpus(10_001))
    shards = [worker_shard(train, worker, 4) for worker in range(4)]
    assert torch.equal(torch.cat(shards), train)
    assert max(len(s) for s in shards) - min(len(s) for s in shards) <= 1
    assert torch.equal(worker_shard(train, 2, 4), shards[2])


@given(length=st.integers(0, 500), workers=st.integers(1, 12))
def test_worker_shards_partition_any_length(length: int, workers: int) -> None:
    train = torch.arange(length)
    shards = [worker_shard(train, worker, workers) for worker in range(workers)]
    assert torch.equal(torch.cat(shards), train)
    assert max(map(len, shards)) - min(map(len, shards)) <= 1


@pytest.mark.parametrize(
    ("worker", "workers", "field"), [(0, 0, "num_workers"), (3, 3, "worker"), (-1, 2, "worker")]
)
def test_worker_shard_validates_indices(worker: int, workers: int, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        worker_shard(torch.arange(10), worker, workers)


def test_sampler_batches_have_shape_dtype_and_shift() -> None:
    tokens = encode(generated_corpus(5_000))
    x, y = BatchSampler(tokens, batch_size=8, seq_len=32, seed=0).next_batch()
    assert x.shape == y.shape == (8, 32)
    assert x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    data = bytes(tokens.tolist())
    for row_x, row_y in zip(x, y, strict=True):
        window = bytes(row_x.tolist()) + bytes(row_y[-1:].tolist())
        assert window in data


def test_sampler_is_reproducible_per_seed_and_independent_across_seeds() -> None:
    tokens = encode(generated_corpus(20_000))

    def stream(seed: int) -> list[torch.Tensor]:
        sampler = BatchSampler(tokens, batch_size=4, seq_len=16, seed=seed)
        return [sampler.next_batch()[0] for _ in range(3)]

    first, again, other = stream(1), stream(1), stream(2)
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert not any(torch.equal(a, b) for a, b in zip(first, other, strict=True))


def test_sampler_does_not_touch_global_rng_or_other_samplers() -> None:
    tokens = encode(generated_corpus(20_000))
    alone = BatchSampler(tokens, 4, 16, seed=5)
    expected = [alone.next_batch()[0] for _ in range(3)]
    mine, noisy = BatchSampler(tokens, 4, 16, seed=5), BatchSampler(tokens, 4, 16, seed=6)
    torch.manual_seed(0)
    reference = torch.rand(3)
    torch.manual_seed(0)
    got = []
    for _ in range(3):
        noisy.next_batch()
        got.append(mine.next_batch()[0])
    assert torch.equal(torch.rand(3), reference)
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))


def test_sampler_accepts_exactly_one_sequence() -> None:
    tokens = encode(b"abcde")
    x, y = BatchSampler(tokens, batch_size=2, seq_len=4, seed=0).next_batch()
    assert x.tolist() == [list(b"abcd")] * 2
    assert y.tolist() == [list(b"bcde")] * 2


def test_sampler_rejects_too_small_corpus() -> None:
    expected = (
        "corpus has 4 tokens, fewer than one training sequence of seq_len + 1 = 5; "
        "use a larger corpus or a smaller --seq-len"
    )
    with pytest.raises(CorpusError) as info:
        BatchSampler(encode(b"abcd"), batch_size=1, seq_len=4, seed=0)
    assert str(info.value) == expected


@pytest.mark.parametrize(
    ("batch_size", "seq_len", "field"), [(0, 4, "batch_size"), (1, 0, "seq_len")]
)
def test_sampler_rejects_bad_shape(batch_size: int, seq_len: int, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        BatchSampler(encode(b"abcdefgh"), batch_size=batch_size, seq_len=seq_len, seed=0)


def test_eval_batches_are_fixed_and_evenly_spaced() -> None:
    tokens = torch.arange(10_000)
    batches = eval_batches(tokens, batch_size=4, seq_len=15, max_batches=3)
    assert len(batches) == 3
    again = eval_batches(tokens, batch_size=4, seq_len=15, max_batches=3)
    for (x, y), (x2, y2) in zip(batches, again, strict=True):
        assert x.shape == y.shape == (4, 15)
        assert x.dtype == y.dtype == torch.int64
        assert torch.equal(x, x2) and torch.equal(y, y2)
        assert torch.equal(x[:, 1:], y[:, :-1])
    starts = torch.cat([x[:, 0] for x, _ in batches]).tolist()
    assert starts == [i * (10_000 - 16) // 11 for i in range(12)]


def test_eval_batch_windows_do_not_overlap() -> None:
    tokens = torch.arange(1_000)
    batches = eval_batches(tokens, batch_size=3, seq_len=9, max_batches=100)
    starts = sorted(int(s) for x, _ in batches for s in x[:, 0])
    assert all(b - a >= 10 for a, b in itertools.pairwise(starts))
    assert starts[0] == 0
    assert int(batches[-1][1].max()) == 999
    assert len(batches) == 1_000 // 10 // 3
    assert all(x.shape == (3, 9) for x, _ in batches)


def test_eval_batches_shrink_for_short_tokens() -> None:
    batches = eval_batches(torch.arange(25), batch_size=8, seq_len=9, max_batches=5)
    assert len(batches) == 1
    x = batches[0][0]
    assert x.shape == (2, 9)
    assert x[:, 0].tolist() == [0, 15]
    single = eval_batches(torch.arange(10), batch_size=8, seq_len=9, max_batches=5)
    assert single[0][0].shape == (1, 9)


def test_eval_batches_reject_too_short_tokens() -> None:
    with pytest.raises(CorpusError, match=r"validation split has 9 tokens.*seq_len \+ 1 = 10"):
        eval_batches(torch.arange(9), batch_size=2, seq_len=9, max_batches=1)
    with pytest.raises(ValueError, match="max_batches"):
        eval_batches(torch.arange(100), batch_size=2, seq_len=9, max_batches=0)
