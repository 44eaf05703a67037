"""The opt-in fused int8 kernels (algorithm/fused_int8.py, DILOCO_FUSED_INT8=1): the bytes a
worker's encode, a server's delta and a receiver's decode write are the eager code's, checked
on a hand-worked block and against the eager path (itself checked against hand-worked values in
test_algo_codecs.py) on several pieces of random values; a kernel that cannot compile or that
differs on its probe is not used, and nothing changes without the variable."""

from __future__ import annotations

import logging
import threading

import pytest
import torch

from diloco.algorithm import fused_int8
from diloco.algorithm.codecs import Encoded, decode_into, parse_codec, piece_elements
from diloco.wire.compressed.body import write_parts
from diloco.wire.compressed.header import part_specs

INT8 = parse_codec("int8")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.compile's own


@pytest.fixture
def fused(monkeypatch):
    """DILOCO_FUSED_INT8=1 with this test's own kernel table (compiled kernels are kept across
    tests: inductor compiles each once a process)."""
    monkeypatch.setenv(fused_int8.ENABLE, "1")
    return fused_int8


def parts(numel: int) -> dict[str, torch.Tensor]:
    return {k: torch.zeros(shape, dtype=dt) for k, (shape, dt) in part_specs(numel, INT8).items()}


def test_a_hand_worked_block_through_the_fused_delta(fused) -> None:
    # d = x - p = (-64 .. 63) / 4 in each of two blocks: absmax 16, s = 16 / 127; a level is
    # round(d * 127 / 16)
    d = (torch.arange(128, dtype=torch.float32) - 64) / 4
    p = torch.full((256,), 2.0)
    x = p + torch.cat([d, d])
    assert torch.equal(x - p, torch.cat([d, d]))
    out = parts(256)
    assert fused.code(x, p, out["codes"], out["scales"], 128, fold_into=p)
    s = torch.tensor(16.0) / 127
    assert out["scales"].tolist() == [s.item(), s.item()]
    for codes in out["codes"].view(2, 128):
        assert codes[0] == 0  # -16: level -127, code 0
        assert codes[64] == 127  # 0: level 0
        assert codes[127] == 127 + 125  # 15.75 * 127 / 16 = 125.02: level 125
        assert codes[65] == 127 + 2  # 0.25 * 127 / 16 = 1.98: level 2
    # P moved by what the codes decode to: 2 + (code - 127) * s, in fp32
    assert p[0].item() == p[128].item() == (torch.tensor(2.0) + torch.tensor(-127.0) * s).item()
    assert p[64].item() == 2.0


def test_a_hand_worked_zero_block_gives_zero_scale_and_middle_codes(fused) -> None:
    p = torch.full((256,), -0.0)
    x = torch.zeros(256)
    x[128:] = torch.linspace(-1, 1, 128)
    out = parts(256)
    assert fused.code(x, p, out["codes"], out["scales"], 128, fold_into=p)
    assert out["scales"][0].item() == 0.0
    assert torch.equal(out["codes"][:128], torch.full((128,), 127, dtype=torch.uint8))
    # a zero level decodes to +0, and -0 + +0 is +0: P's zeros lose their sign, as eager
    assert not torch.signbit(p[:128]).any()


@pytest.mark.parametrize("numel", [3 * piece_elements(torch.device("cpu")) + 300, 128 * 5])
def test_the_fused_delta_encode_and_decode_write_the_eager_bytes(fused, monkeypatch, numel) -> None:
    gen = torch.Generator().manual_seed(numel)
    masters = torch.randn(numel, generator=gen) * 0.02
    p0 = masters + torch.randn(numel, generator=gen) * 1e-3
    p0[:128] = masters[:128]  # a zero block
    local = masters - torch.randn(numel, generator=gen) * 1e-3

    def run() -> tuple[torch.Tensor, dict, dict, torch.Tensor]:
        p, delta, upload = p0.clone(), parts(numel), parts(numel)
        write_parts(masters, INT8, delta, fold_into=p, less=p)  # a server's delta to P
        write_parts(masters, INT8, upload, less=local)  # a worker's anchor - local
        anchor = p0.clone()
        decode_into(Encoded(numel, delta["codes"], delta["scales"]), INT8, anchor)
        return p, delta, upload, anchor

    calls = []
    real = fused.code

    def counted(*args, **kwargs):
        calls.append(real(*args, **kwargs))
        return calls[-1]

    monkeypatch.setattr(fused_int8, "code", counted)
    got = run()
    assert any(calls)  # the fused kernels ran
    monkeypatch.setenv(fused_int8.ENABLE, "0")
    want = run()
    assert torch.equal(got[0], want[0])
    for mine, theirs in zip(got[1:3], want[1:3], strict=True):
        assert all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert torch.equal(got[3], want[3])
    assert torch.equal(got[3], got[0])  # a receiver's anchor moved as the server's P did


def test_what_the_kernels_do_not_cover_stays_eager(fused) -> None:
    x, p = torch.randn(256), torch.randn(256)
    out = parts(256)
    assert not fused.code(x, p.bfloat16(), out["codes"], out["scales"], 128)  # bf16 local
    assert not fused.code(x[:200], p[:200], out["codes"][:200], out["scales"][:2], 128)  # short
    assert not fused.code(x, p, out["codes"], out["scales"], 128, fold_into=p.clone())  # not P
    wide = torch.randn(256, 2)[:, 0]
    assert not fused.code(wide, p, out["codes"], out["scales"], 128)  # not contiguous
    one_row = parts(128)  # a shape the compiled graph would specialize for, unprobed
    assert not fused.code(x[:128], p[:128], one_row["codes"], one_row["scales"], 128)
    assert torch.equal(out["codes"], torch.zeros(256, dtype=torch.uint8))


def test_without_the_variable_nothing_is_compiled(monkeypatch) -> None:
    monkeypatch.delenv(fused_int8.ENABLE, raising=False)
    monkeypatch.setattr(fused_int8, "_kernels", {})
    out = parts(128)
    assert not fused_int8.code(torch.randn(128), torch.randn(128), out["codes"], out["scales"], 128)
    assert not fused_int8.add_decoded(out["codes"], out["scales"], torch.zeros(128), 128)
    assert fused_int8._kernels == {}


def test_a_kernel_that_differs_on_its_probe_is_not_used(fused, monkeypatch, caplog) -> None:
    monkeypatch.setattr(fused_int8, "_kernels", {})
    monkeypatch.setattr(fused_int8, "_probe", lambda name, kernel: False)
    out = parts(256)
    with caplog.at_level(logging.WARNING, logger="diloco.algorithm.fused_int8"):
        assert not fused.code(torch.randn(256), torch.randn(256), out["codes"], out["scales"], 128)
        assert not fused.code(torch.randn(256), torch.randn(256), out["codes"], out["scales"], 128)
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "code_less differs from the eager code" in warned[0]
    assert torch.equal(out["codes"], torch.zeros(256, dtype=torch.uint8))


def test_a_kernel_that_cannot_compile_leaves_eager_coding(fused, monkeypatch, caplog) -> None:
    monkeypatch.setattr(fused_int8, "_kernels", {})

    def no_compiler(*args, **kwargs):
        raise RuntimeError("no C++ compiler found")

    monkeypatch.setattr(torch, "compile", no_compiler)
    numel = 512
    masters, p = torch.randn(numel), torch.randn(numel)
    got, p_got = parts(numel), p.clone()
    with caplog.at_level(logging.WARNING, logger="diloco.algorithm.fused_int8"):
        write_parts(masters, INT8, got, fold_into=p_got, less=p_got)
    assert "cannot run here (no C++ compiler found)" in caplog.text
    monkeypatch.setenv(fused_int8.ENABLE, "0")
    want, p_want = parts(numel), p.clone()
    write_parts(masters, INT8, want, fold_into=p_want, less=p_want)
    assert all(torch.equal(got[k], want[k]) for k in got)
    assert torch.equal(p_got, p_want)


def test_threads_compile_each_kernel_once(fused, monkeypatch) -> None:
    monkeypatch.setattr(fused_int8, "_kernels", {})
    compiled = []
    real = fused_int8._compiled

    def counting(name):
        compiled.append(name)
        return real(name)

    monkeypatch.setattr(fused_int8, "_compiled", counting)
    results = []

    def code() -> None:
        out = parts(256)
        results.append(fused.code(torch.randn(256), torch.randn(256), *out.values(), 128))

    threads = [threading.Thread(target=code) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert compiled == ["code_less"]
    assert results == [True] * 4
