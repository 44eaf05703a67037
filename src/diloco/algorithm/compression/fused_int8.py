"""The int8 codec's CPU hot loops as compiled, fused kernels (torch.compile, inductor): opt in
with DILOCO_FUSED_INT8=1.

Eager torch codes a 2 MiB piece in about a dozen passes over it (a difference, abs, amax,
two divisions, round, clamp, casts, the decoded levels, the fold); one fused loop reads the
operands once and writes the codes, the scales and the fold in the same sweep (a server's
85M delta on one thread: 0.098 s against 0.154 s, benchmarks/server_threads.py).

Same bytes: the kernels' Python functions compute the codec's documented formulas
(algorithm/compression/codecs.py) in the same order and fp32 rounding (a division by the scale,
127 a tensor so that it is not turned into a reciprocal, round half to even, the decode a
separate multiply then an add), and the tests compare their bytes with codecs.py's own path.
Each compiled kernel is then probed against its own function run eagerly, bit for bit (the sign
of zero too), on 512 rows of random values and rows of zero and underflowing scales, exact ties,
near ties at scales that are not powers of two and -0 targets; one that cannot be compiled here
(no C++ compiler), that dynamo did not compile (TORCHDYNAMO_DISABLE) or that differs is not
used: the eager code runs, with one warning. Only the probed graph ever runs: inputs that would
make dynamo compile another are refused before anything is written (the kernel is then off for
good). Finite inputs only: a NaN or Inf makes its block's
scale non-finite (every receiver refuses it) and its codes unspecified, as eager.

`prepare()` compiles and probes all three (a server and a DiLoCoWorker call it at start
when their run codes int8: `prepare_for`; 3-5 s each here with inductor's disk cache warm,
about 17 s cold); otherwise each compiles at its first use, under a lock, so a server's
threads never compile at once. A kernel runs only at the torch thread count it was compiled
at (at another, that call is eager). Only spans of whole blocks of 128 (the codec's default,
the block the probe checks), at least two, of int8 on CPU with weights of +1 go through
here; everything else (other blocks, int4, int2, top-k, a tensor's last span when its last
block is short, error feedback's -1, accelerators) stays eager. `calls()` counts the pieces
each kernel coded; each logs its first.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable

import torch

ENABLE = "DILOCO_FUSED_INT8"
NAMES = ("code_less", "delta", "add_decoded")
_QMAX = 127.0
_log = logging.getLogger(__name__)
_lock = threading.Lock()
_kernels: dict[str, Callable[..., None] | None] = {}  # name -> the kernel, None: not usable
_probed: set[str] = set()  # kernels whose one graph was probed: no other may be compiled
_compiles: dict[str, int] = {}  # graphs inductor compiled for each kernel (the probe needs 1)
_threads: dict[str, int] = {}  # the torch thread count each kernel was compiled at
_calls: dict[str, int] = {}  # pieces each kernel coded in this process
BLOCK = 128  # the block size the kernels are probed at, and run for (the codec's default)


def requested() -> bool:
    """Whether this process asked for the fused kernels (DILOCO_FUSED_INT8=1)."""
    return os.environ.get(ENABLE) == "1"


def check_setting() -> None:
    """ValueError unless DILOCO_FUSED_INT8 is unset, empty, 0 or 1 (a command checks it at
    start: `yes` or `true` must not quietly mean off)."""
    value = os.environ.get(ENABLE, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"{ENABLE} must be 1 (on) or 0 (off), got {value!r}")


def _levels(
    d: torch.Tensor, scales: torch.Tensor, qmax: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each (rows, block) row's scale (absmax / 127) and levels clamp(round(d / s)), a zero
    scale giving zero levels (d / inf), as codecs._code_values computes them. 127 comes in
    as a tensor, `qmax`: inductor would multiply by the reciprocal of a number (as CUDA does;
    on CPU torch 2.13 no longer does), off by an ulp in about 5 % of scales."""
    s = d.abs().amax(dim=1) / qmax
    scales.copy_(s)
    safe = torch.where(s == 0, math.inf, s).unsqueeze(1)
    return s, (d / safe).round().clamp(-_QMAX, _QMAX)


def _decoded(codes: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """What a receiver decodes from uint8 codes: (code - 127) * s, a separate multiply."""
    return (codes.to(torch.float32) - _QMAX) * s.unsqueeze(1)


def _code_less(
    x: torch.Tensor,
    less: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    qmax: torch.Tensor,
) -> None:
    """codes, scales <- int8(x - less): a worker's anchor - local."""
    _, levels = _levels(x - less, scales, qmax)
    codes.copy_((levels + _QMAX).to(torch.uint8))


def _delta(
    x: torch.Tensor, p: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, qmax: torch.Tensor
) -> None:
    """codes, scales <- int8(x - p), p += what they decode to: a server's delta to its
    published copy P (one tensor both subtracted and moved: aliased inputs of two views are
    not compiled)."""
    s, levels = _levels(x - p, scales, qmax)
    coded = (levels + _QMAX).to(torch.uint8)
    codes.copy_(coded)
    p.add_(_decoded(coded, s))


def _add_decoded(codes: torch.Tensor, scales: torch.Tensor, target: torch.Tensor) -> None:
    """target += what codes, scales decode to: a fold into sums, an apply to an anchor."""
    target.add_(_decoded(codes, scales))


_EAGER = {"code_less": _code_less, "delta": _delta, "add_decoded": _add_decoded}
_QMAX_TENSOR = torch.tensor(_QMAX, dtype=torch.float32)


def prepare() -> dict[str, str]:
    """Compile and probe every kernel now (a process's start), not in its first round."""
    for name in NAMES:
        _kernel(name)
    return status()


def prepare_for(*codecs: object) -> None:
    """`prepare()` when the kernels are asked for and one of `codecs` (algorithm.codecs.Codec)
    is dense int8, the one they code: a run without it pays no compile."""
    if requested() and any(
        getattr(c, "values", None) == "int8" and not getattr(c, "is_sparse", True) for c in codecs
    ):
        prepare()


def status() -> dict[str, str]:
    """Each kernel's state in this process: used (compiled and probed), refused (eager
    instead) or not compiled."""
    return {
        name: "not compiled"
        if name not in _kernels
        else ("used" if _kernels[name] is not None else "refused")
        for name in NAMES
    }


def calls() -> dict[str, int]:
    """Pieces each kernel has coded in this process (what shows it ran on real bodies)."""
    return {name: _calls.get(name, 0) for name in NAMES}


def code(
    x: torch.Tensor,
    less: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    block: int,
    fold_into: torch.Tensor | None = None,
) -> bool:
    """Code x - less (flat fp32, whole blocks of `block`) into the uint8 `codes` and fp32
    `scales` slots, adding the decoded values to `fold_into` (weight +1) when given, which must
    then be `less` itself (a server's P); False (nothing written) when the fused kernel is not
    to be used here: the caller codes eagerly."""
    if fold_into is not None and not _same(fold_into, less):
        return False
    if fold_into is None and x.data_ptr() == less.data_ptr():
        return False  # (aliased inputs: another graph)
    if not _eligible(block, x, less, codes, scales):
        return False
    rows = x.numel() // block
    name = "code_less" if fold_into is None else "delta"
    views = (x.view(rows, block), less.view(rows, block), codes.view(rows, block))
    return _run(name, *views, scales, _QMAX_TENSOR)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.numel() == b.numel() and a.dtype == b.dtype


def add_decoded(
    codes: torch.Tensor, scales: torch.Tensor, target: torch.Tensor, block: int
) -> bool:
    """target += the int8 codes' decoded values (flat, whole blocks of `block`); False (nothing
    added) when the fused kernel is not to be used here."""
    if not _eligible(block, target, target, codes, scales):
        return False
    rows = target.numel() // block
    return _run("add_decoded", codes.view(rows, block), scales, target.view(rows, block))


def _run(name: str, *args: torch.Tensor) -> bool:
    """Run kernel `name`; False when it is not usable here: not at the thread count it was
    compiled at (dynamo would compile another graph for this one: eager this time), or (it
    then never runs again) its compile failed, or it would compile a second graph, which
    the probe never saw (refused by `_backend` before it runs, so nothing was written)."""
    kernel = _kernel(name)
    if kernel is None or torch.get_num_threads() != _threads[name]:
        return False
    try:
        with torch.no_grad():
            kernel(*args)
    except Exception as exc:
        from torch._dynamo.exc import FailOnRecompileLimitHit, TorchDynamoException

        if not isinstance(exc, (TorchDynamoException, FailOnRecompileLimitHit)):
            raise  # the kernel ran and failed: what it wrote may be half done
        _kernels[name] = None
        _log.warning("the fused int8 kernel %s failed (%s); coding eagerly from now on", name, exc)
        return False
    _calls[name] = _calls.get(name, 0) + 1
    if _calls[name] == 1:
        _log.info("fused int8 kernel %s coded its first piece", name)
    return True


def _eligible(
    block: int,
    x: torch.Tensor,
    less: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
) -> bool:
    if not requested() or block != BLOCK or not x.numel() or x.numel() % block:
        return False
    if torch.is_inference_mode_enabled():  # inference tensors: guards the probe never met
        return False
    floats = (x, less, scales)
    if any(t.device.type != "cpu" for t in (*floats, codes)):
        return False
    if any(t.dtype != torch.float32 for t in floats):
        return False
    if x.numel() < 2 * block:  # one row: a shape the compiled graph specializes, unprobed
        return False
    if (
        less.numel() != x.numel()
        or codes.numel() != x.numel()
        or scales.numel() * block != x.numel()
    ):
        return False
    every = (*floats, codes)
    if any(t.requires_grad or t.is_inference() for t in every):
        return False
    return codes.dtype == torch.uint8 and all(t.is_contiguous() for t in every)


def _kernel(name: str) -> Callable[..., None] | None:
    """The compiled kernel `name`, compiled and probed at its first use (under the lock)."""
    if name in _kernels:
        return _kernels[name]
    with _lock:
        if name not in _kernels:
            _kernels[name] = _compiled(name)
    return _kernels[name]


def _compiled(name: str) -> Callable[..., None] | None:
    began = time.monotonic()
    _threads[name] = torch.get_num_threads()
    try:
        kernel = torch.compile(_EAGER[name], dynamic=True, fullgraph=True, backend=_backend(name))
        with torch.no_grad():
            same = _probe(name, kernel)
    except Exception as exc:  # no compiler, an inductor without this backend, ...
        _log.warning(
            "%s=1 but the fused int8 kernel %s cannot run here (%s); coding eagerly",
            ENABLE,
            name,
            exc,
        )
        return None
    if same and _compiles.get(name) != 1:  # dynamo off (TORCHDYNAMO_DISABLE): eager vs eager
        _log.warning(
            "%s=1 but the fused int8 kernel %s was not compiled (%s graphs); coding eagerly",
            ENABLE,
            name,
            _compiles.get(name, 0),
        )
        return None
    if not same:
        _log.warning(
            "%s=1 but the fused int8 kernel %s differs from the eager code on its probe; "
            "coding eagerly",
            ENABLE,
            name,
        )
        return None
    _probed.add(name)
    _log.info("fused int8 kernel %s compiled and probed in %.1f s", name, time.monotonic() - began)
    return kernel


def _backend(name: str) -> Callable[..., Callable[..., object]]:
    """Inductor, for the probe's one graph of kernel `name` only: a second graph (inputs the
    probe never showed it) would run unprobed, so its compile is refused, before it runs."""

    def compile_once(graph: torch.fx.GraphModule, inputs: list) -> Callable[..., object]:
        if name in _probed:
            raise RuntimeError(f"kernel {name} would compile a graph its probe did not check")
        from torch._inductor.compile_fx import compile_fx

        _compiles[name] = _compiles.get(name, 0) + 1

        return compile_fx(graph, inputs)

    return compile_once


def _bits(t: torch.Tensor) -> torch.Tensor:
    """fp32 as its bit patterns (-0 is not +0), anything else as it is."""
    return t.view(torch.int32) if t.dtype == torch.float32 else t


def _probe(name: str, kernel: Callable[..., None]) -> bool:
    """Whether compiled `kernel` writes, bit for bit, what its own Python function writes
    eagerly (whose bytes are the codec's: the tests compare them with codecs.py's), on 512
    rows of random values and rows that hold the edge cases."""
    gen = torch.Generator().manual_seed(8)
    rows, block = 512, BLOCK
    p = torch.randn(rows, block, generator=gen) * 0.01  # less (and a server's target): P
    x = p + torch.randn(rows, block, generator=gen) * 0.01
    x[1] = p[1]  # a zero block: scale 0, codes 127
    p[2:8] = 0.0
    x[2] = 1e-44  # absmax / 127 underflows to 0
    x[3] = torch.arange(block) - 63.5  # ties: s = 127 / 127 = 1, every other value k + 0.5
    x[3, 0] = 127.0
    p[4] = -0.0  # -0 + a zero level's +0 is +0
    x[4] = torch.randn(block, generator=gen) * 1e-3
    x[4, :8] = 0.0
    for row, absmax in ((5, 0.37), (6, 3.1e-5), (7, 911.0)):  # near ties at scales that are
        s = torch.tensor(absmax) / torch.tensor(_QMAX)  # not powers of two: (k + 0.5) * s
        x[row] = (torch.arange(block) - 63.5) * s  # in fp32, a division off by an ulp
        x[row, 0] = absmax  # rounds the other way
    codes = torch.zeros(rows, block, dtype=torch.uint8)
    scales = torch.zeros(rows)
    qmax = _QMAX_TENSOR
    _EAGER["code_less"](x, p, codes, scales, qmax)  # a receiver's operands: real codes
    if name == "add_decoded":
        args = [codes, scales, p]
    else:
        args = [x, p, codes.zero_(), scales.zero_(), qmax]
    want = [t.clone() for t in args]
    _EAGER[name](*want)
    kernel(*args)
    return all(torch.equal(_bits(a), _bits(b)) for a, b in zip(args, want, strict=True))
