"""The bundled recipe on a chosen device and dtype: `diloco worker --device/--dtype` resolve to
what this machine has or one error naming the option; bf16 autocast trains fp32 weights."""

from __future__ import annotations

import pytest
import torch

from diloco.data import BatchSampler, encode
from diloco.models.gpt import GPTConfig
from diloco.training import Replica, autocast_dtype_of, training_device


def test_auto_is_the_gpu_when_torch_sees_one_and_cpu_names_itself() -> None:
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert training_device("auto").type == expected
    assert training_device("cpu") == torch.device("cpu")


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("tpu", "--device must be cpu, cuda, cuda:N or auto, got 'tpu'"),
        ("meta", "--device must be cpu, cuda, cuda:N or auto, got 'meta'"),
        ("gpu0", "--device must be cpu, cuda, cuda:N or auto, got 'gpu0'"),
    ],
)
def test_a_device_that_is_not_one_is_refused_naming_the_option(name, message) -> None:
    with pytest.raises(ValueError) as raised:
        training_device(name)
    assert str(raised.value) == message


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_a_gpu_says_so_and_what_to_use() -> None:
    message = r"^--device cuda:1: torch sees no CUDA device .*; use --device cpu$"
    with pytest.raises(ValueError, match=message):
        training_device("cuda:1")


def test_dtypes_are_fp32_or_bf16_autocast() -> None:
    assert autocast_dtype_of("fp32") is None
    assert autocast_dtype_of("bf16") is torch.bfloat16
    with pytest.raises(ValueError, match=r"^--dtype must be fp32 or bf16, got 'fp16'$"):
        autocast_dtype_of("fp16")


def test_bf16_autocast_trains_and_keeps_the_weights_and_optimizer_in_fp32() -> None:
    config = GPTConfig(context=16, width=32, depth=1, heads=2)
    torch.manual_seed(0)
    initial = config.build().state_dict()
    tokens = encode(b"the quick brown fox jumps over the lazy dog. " * 20)

    def replica(dtype):
        sampler = BatchSampler(tokens, batch_size=4, seq_len=16, seed=1)
        return Replica(config, initial, sampler, 1e-2, 0, 20, 0.0, autocast_dtype=dtype)

    plain, mixed = replica(None), replica(torch.bfloat16)
    first = mixed.train_step()
    for _ in range(19):
        last = mixed.train_step()
        plain.train_step()
    assert last < first  # it learns
    assert all(p.dtype == torch.float32 for p in mixed.model.parameters())
    state = mixed.optimizer.state[next(iter(mixed.model.parameters()))]
    assert state["exp_avg"].dtype == torch.float32
    # bf16 forwards round differently: the replicas part, by less than the 20 steps of lr 1e-2
    # that each could have moved a weight (an AdamW step moves it by about lr at most)
    gap = max(
        (a - b).abs().max().item()
        for a, b in zip(plain.model.parameters(), mixed.model.parameters(), strict=True)
    )
    assert 0 < gap < 2 * 20 * 1e-2
