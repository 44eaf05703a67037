"""The opt-in fused int8 kernels (algorithm/compression/fused_int8.py, DILOCO_FUSED_INT8=1): the
bytes a worker's encode, a server's delta and a receiver's decode write are the eager code's,
checked on a hand-worked block and against the eager path (itself checked against hand-worked
values in test_algo_codecs.py) on several pieces of random values; a kernel that cannot compile
or that differs on its probe is not used, and nothing changes without the variable."""

from __future__ import annotations

import logging
import shutil
import threading

import pytest
import torch

from diloco.algorithm.compression import fused_int8
from diloco.algorithm.compression.codecs import Encoded, decode_into, parse_codec, piece_elements
from diloco.wire.compressed.body import write_parts
from diloco.wire.compressed.header import part_specs
from processes import run_cli_in_process

INT8 = parse_codec("int8")
pytestmark = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),  # torch.compile's own
    pytest.mark.skipif(
        not any(shutil.which(cxx) for cxx in ("c++", "g++", "clang++")),
        reason="inductor compiles C++: no compiler here (the kernels then stay off)",
    ),
]


@pytest.fixture
def fused(monkeypatch):
    """DILOCO_FUSED_INT8=1 (the kernels compiled by one test are kept for the next)."""
    monkeypatch.setenv(fused_int8.ENABLE, "1")
    return fused_int8


@pytest.fixture
def fresh(monkeypatch):
    """No kernel compiled or probed yet in this process."""
    for table in ("_kernels", "_compiles", "_threads", "_calls"):
        monkeypatch.setattr(fused_int8, table, {})
    monkeypatch.setattr(fused_int8, "_probed", set())


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t


def parts(numel: int, codec=INT8) -> dict[str, torch.Tensor]:
    return {k: torch.zeros(shape, dtype=dt) for k, (shape, dt) in part_specs(numel, codec).items()}


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
    block = 128
    codec = parse_codec("int8", block=block)
    gen = torch.Generator().manual_seed(numel)
    masters = torch.randn(numel, generator=gen) * 0.02
    p0 = masters + torch.randn(numel, generator=gen) * 1e-3
    p0[:block] = masters[:block]  # a zero block
    p0[block : 2 * block] = -0.0  # -0 + a zero level's +0 is +0
    masters[block : 2 * block] = 0.0
    local = masters - torch.randn(numel, generator=gen) * 1e-3

    def run() -> tuple[torch.Tensor, dict, dict, torch.Tensor]:
        p, delta, upload = p0.clone(), parts(numel, codec), parts(numel, codec)
        write_parts(masters, codec, delta, fold_into=p, less=p)  # a server's delta to P
        write_parts(masters, codec, upload, less=local)  # a worker's anchor - local
        anchor = p0.clone()
        decode_into(Encoded(numel, delta["codes"], delta["scales"]), codec, anchor)
        return p, delta, upload, anchor

    ran = []
    real = fused_int8._run

    def counted(name, *args):
        used = real(name, *args)
        ran.append((name, used))
        return used

    monkeypatch.setattr(fused_int8, "_run", counted)
    before = fused_int8.calls()
    got = run()
    assert {name for name, used in ran if used} == set(fused_int8.NAMES)  # each kernel ran
    assert all(used for _, used in ran)
    after = fused_int8.calls()
    assert all(after[name] > before[name] for name in fused_int8.NAMES)
    monkeypatch.setenv(fused_int8.ENABLE, "0")
    ran.clear()
    want = run()
    assert not ran
    assert torch.equal(bits(got[0]), bits(want[0]))
    for mine, theirs in zip(got[1:3], want[1:3], strict=True):
        assert all(torch.equal(bits(mine[k]), bits(theirs[k])) for k in mine)
    assert torch.equal(bits(got[3]), bits(want[3]))
    assert torch.equal(bits(got[3]), bits(got[0]))  # a receiver's anchor moved as P did
    assert not torch.signbit(got[0][block : 2 * block]).any()


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


def test_without_the_variable_nothing_is_compiled(fresh, monkeypatch) -> None:
    monkeypatch.delenv(fused_int8.ENABLE, raising=False)
    out = parts(128)
    assert not fused_int8.code(torch.randn(128), torch.randn(128), out["codes"], out["scales"], 128)
    assert not fused_int8.add_decoded(out["codes"], out["scales"], torch.zeros(128), 128)
    assert fused_int8._kernels == {}


def test_a_kernel_that_differs_on_its_probe_is_not_used(fused, fresh, monkeypatch, caplog) -> None:
    monkeypatch.setattr(fused_int8, "_probe", lambda name, kernel: False)
    out = parts(256)
    with caplog.at_level(logging.WARNING, logger="diloco.algorithm.compression.fused_int8"):
        assert not fused.code(torch.randn(256), torch.randn(256), out["codes"], out["scales"], 128)
        assert not fused.code(torch.randn(256), torch.randn(256), out["codes"], out["scales"], 128)
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "code_less differs from the eager code" in warned[0]
    assert torch.equal(out["codes"], torch.zeros(256, dtype=torch.uint8))


def test_a_kernel_that_cannot_compile_leaves_eager_coding(
    fused, fresh, monkeypatch, caplog
) -> None:

    def no_compiler(*args, **kwargs):
        raise RuntimeError("no C++ compiler found")

    monkeypatch.setattr(torch, "compile", no_compiler)
    numel = 512
    masters, p = torch.randn(numel), torch.randn(numel)
    got, p_got = parts(numel), p.clone()
    with caplog.at_level(logging.WARNING, logger="diloco.algorithm.compression.fused_int8"):
        write_parts(masters, INT8, got, fold_into=p_got, less=p_got)
    assert "cannot run here (no C++ compiler found)" in caplog.text
    monkeypatch.setenv(fused_int8.ENABLE, "0")
    want, p_want = parts(numel), p.clone()
    write_parts(masters, INT8, want, fold_into=p_want, less=p_want)
    assert all(torch.equal(got[k], want[k]) for k in got)
    assert torch.equal(p_got, p_want)


def test_threads_compile_each_kernel_once(fused, fresh, monkeypatch) -> None:
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


def test_prepare_compiles_and_probes_every_kernel(fused, fresh) -> None:
    assert fused.status() == dict.fromkeys(fused.NAMES, "not compiled")
    assert fused.prepare() == dict.fromkeys(fused.NAMES, "used")


def test_a_second_graph_is_refused_before_it_writes_anything(fused, fresh, caplog) -> None:
    """Inputs that would make dynamo compile another graph (here fp64 operands, which the
    eligibility checks keep out of the public calls) run nothing unprobed: the compile is
    refused, nothing is written, and the kernel is off from then on."""
    fused.prepare()
    codes = torch.full((256,), 130, dtype=torch.uint8)
    scales = torch.ones(2, dtype=torch.float64)
    target = torch.zeros(2, 128, dtype=torch.float64)
    with caplog.at_level(logging.WARNING, logger="diloco.algorithm.compression.fused_int8"):
        assert not fused._run("add_decoded", codes.view(2, 128), scales, target)
    assert "a graph its probe did not check" in caplog.text
    assert torch.equal(target, torch.zeros(2, 128, dtype=torch.float64))
    assert fused.status()["add_decoded"] == "refused"


@pytest.mark.parametrize("value", ["yes", "true", "2"])
def test_a_bad_setting_is_refused_at_start_by_the_server_and_the_worker(monkeypatch, value):
    monkeypatch.setenv(fused_int8.ENABLE, value)
    want = f"DILOCO_FUSED_INT8 must be 1 (on) or 0 (off), got '{value}'"
    for command in (["server", "--port", "0"], ["worker", "--server", "http://127.0.0.1:9"]):
        done = run_cli_in_process(*command)
        assert done.returncode == 2, (command, done.stdout, done.stderr)
        assert want in done.stdout + done.stderr
        assert "Traceback" not in done.stdout + done.stderr


def test_only_a_run_that_codes_dense_int8_compiles_at_start(fused, fresh) -> None:
    fused.prepare_for(parse_codec("fp32"), parse_codec("topk:0.03+int8"), parse_codec("int2"))
    assert fused.status() == dict.fromkeys(fused.NAMES, "not compiled")
    fused.prepare_for(parse_codec("fp32"), INT8)
    assert fused.status() == dict.fromkeys(fused.NAMES, "used")


def test_without_the_variable_a_run_of_int8_compiles_nothing(fresh, monkeypatch) -> None:
    monkeypatch.setenv(fused_int8.ENABLE, "0")
    fused_int8.check_setting()
    fused_int8.prepare_for(INT8)
    assert fused_int8.status() == dict.fromkeys(fused_int8.NAMES, "not compiled")


def test_other_blocks_and_other_thread_counts_stay_eager(fused, monkeypatch) -> None:
    """The probe checks blocks of 128 at the compile's thread count: a body in blocks of 32,
    or a call at another thread count, is coded eagerly, and the kernels stay in use."""
    fused.prepare()
    ran = []
    real = fused_int8._run
    monkeypatch.setattr(fused_int8, "_run", lambda *a: ran.append(a[0]) or real(*a))
    codec = parse_codec("int8", block=32)
    masters, p = torch.randn(4096), torch.randn(4096)
    write_parts(masters, codec, parts(4096, codec), fold_into=p, less=p)
    assert ran == []
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        out = parts(4096)
        assert not fused.code(masters, p, out["codes"], out["scales"], 128, fold_into=p)
    finally:
        torch.set_num_threads(threads)
    assert fused.status() == dict.fromkeys(fused.NAMES, "used")
    assert fused.code(masters, p, out["codes"], out["scales"], 128, fold_into=p)


def test_inputs_the_probe_never_saw_stay_eager(fused) -> None:
    fused.prepare()
    x, p = torch.randn(512), torch.randn(512)
    out = parts(512)
    grad = torch.randn(512, requires_grad=True)
    assert not fused.code(grad, p, out["codes"], out["scales"], 128)  # needs grad
    assert not fused.code(x, x, out["codes"], out["scales"], 128)  # x is less: aliased
    assert not fused.code(x, p[:384], out["codes"][:384], out["scales"][:3], 128)  # sizes
    assert not fused.add_decoded(out["codes"], out["scales"][:3], p, 128)  # scales short
    with torch.inference_mode():
        assert not fused.code(x, p, out["codes"], out["scales"], 128)
    assert torch.equal(out["codes"], torch.zeros(512, dtype=torch.uint8))
    assert fused.status() == dict.fromkeys(fused.NAMES, "used")  # none was switched off


def test_a_kernel_dynamo_did_not_compile_is_not_used(fused, fresh, monkeypatch, caplog) -> None:
    """With dynamo off (TORCHDYNAMO_DISABLE=1) torch.compile runs the function as it is, and
    the probe would compare eager with eager: such a kernel is refused."""
    monkeypatch.setattr(torch, "compile", lambda function, **options: function)
    with caplog.at_level(logging.WARNING, logger="diloco.algorithm.compression.fused_int8"):
        assert fused.prepare() == dict.fromkeys(fused.NAMES, "refused")
    assert "was not compiled (0 graphs)" in caplog.text
