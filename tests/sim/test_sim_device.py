"""Where simulated replicas train (`SimConfig.device` and `dtype`, `diloco simulate --device
--dtype`): the worker's own parsing of both, and bf16 autocast changing the training's numbers
in every mode while the global weights stay fp32 on the CPU."""

from __future__ import annotations

import pytest
import torch

from diloco.sim import SimConfig, simulate
from tiny import TINY_MODEL


def tiny(**overrides) -> SimConfig:
    base = dict(workers=2, sync_every=4, steps=8, batch_size=4, seq_len=32, model=TINY_MODEL,
                warmup=2, eval_batches=2, seed=3)  # fmt: skip
    return SimConfig(**{**base, **overrides})


def test_the_cpu_in_fp32_by_default_and_auto_is_kept_as_what_it_resolved_to() -> None:
    assert (tiny().device, tiny().dtype) == ("cpu", "fp32")
    assert tiny(device="auto").device == ("cuda" if torch.cuda.is_available() else "cpu")
    assert tiny(device=torch.device("cpu")).device == "cpu"  # a torch.device, by its name
    # a sweep's child process gets its run through to_dict / from_dict
    again = SimConfig.from_dict(tiny(dtype="bf16", device="auto").to_dict())
    assert (again.device, again.dtype) == (tiny(device="auto").device, "bf16")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(device="tpu"), "--device must be cpu, cuda, cuda:N or auto, got 'tpu'"),
        (dict(dtype="fp16"), "--dtype must be fp32 or bf16, got 'fp16'"),
        (dict(device=0), "device and dtype are names, got 0, 'fp32'"),
    ],
)
def test_a_bad_device_or_dtype_is_refused_naming_it(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError) as raised:
        tiny(**overrides)
    assert str(raised.value) == message


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_a_gpu_is_refused_before_anything_trains() -> None:
    with pytest.raises(ValueError, match=r"^--device cuda: torch sees no CUDA device"):
        tiny(device="cuda")


@pytest.mark.parametrize("mode", ["single", "ddp", "diloco", "streaming", "async"])
def test_bf16_autocast_changes_every_mode_repeatably_and_keeps_fp32_weights(
    mode: str, small_corpus: bytes
) -> None:
    extra = dict(fragments=2) if mode == "streaming" else {}
    fp32 = simulate(tiny(mode=mode, **extra), corpus=small_corpus)
    bf16 = simulate(tiny(mode=mode, dtype="bf16", **extra), corpus=small_corpus)
    again = simulate(tiny(mode=mode, dtype="bf16", **extra), corpus=small_corpus)
    assert bf16.eval_curve == again.eval_curve  # deterministic
    # the replicas' forward passes ran in bf16: the losses moved, a little
    assert bf16.final_eval_loss != fp32.final_eval_loss
    assert bf16.final_eval_loss == pytest.approx(fp32.final_eval_loss, abs=0.1)
    for tensor in bf16.final_state.values():
        assert tensor.device.type == "cpu"
        assert tensor.dtype == torch.float32 or not tensor.is_floating_point()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode", ["single", "ddp", "diloco", "streaming", "async"])
def test_on_a_gpu_every_mode_trains_there_and_ends_with_fp32_weights_on_the_cpu(
    mode: str, small_corpus: bytes
) -> None:
    extra = dict(fragments=2) if mode == "streaming" else {}
    cpu = simulate(tiny(mode=mode, **extra), corpus=small_corpus)
    gpu = simulate(tiny(mode=mode, device="cuda", dtype="bf16", **extra), corpus=small_corpus)
    assert gpu.config.device == "cuda"
    assert gpu.final_eval_loss == pytest.approx(cpu.final_eval_loss, abs=0.1)
    for tensor in gpu.final_state.values():
        assert tensor.device.type == "cpu"
        assert tensor.dtype == torch.float32 or not tensor.is_floating_point()
