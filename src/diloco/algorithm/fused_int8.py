"""The int8 codec's CPU hot loops as compiled, fused kernels (torch.compile, inductor): opt in
with DILOCO_FUSED_INT8=1.

Eager torch codes a 2 MiB piece in about a dozen passes over it (a difference, abs, amax,
two divisions, round, clamp, casts, the decoded levels, the fold); one fused loop reads the
operands once and writes the codes, the scales and the fold in the same sweep (a server's
85M delta on one thread: 0.098 s against 0.154 s, benchmarks/server_threads.py). The
kernels compute the codec's documented formulas (algorithm/codecs.py) in the same order and
fp32 rounding (a division by the scale, round half to even, the decode a separate multiply
then an add), so their bytes are the eager code's (the tests compare them); each compiled
kernel is probed against its own function run eagerly on a small piece at its first use
(zero and underflowing blocks, half-way levels, -0 targets), and one that cannot be
compiled here (no C++ compiler) or differs by one bit is not used: the eager code runs,
with one warning. Finite inputs only: a NaN or Inf makes its
block's scale non-finite (every receiver refuses it) and its codes unspecified, as eager.

The first use of each kernel in a process compiles it (seconds; inductor caches the result
on disk for later processes), under a lock, so a server's threads never compile at once.
Only whole blocks of int8 on CPU with weights of +1 go through here: everything else
(int4, int2, top-k, a short last block, error feedback's -1, accelerators) stays eager.
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
_QMAX = 127.0
_log = logging.getLogger(__name__)
_lock = threading.Lock()
_kernels: dict[str, Callable[..., None] | None] = {}  # name -> the kernel, None: not usable


def requested() -> bool:
    """Whether this process asked for the fused kernels (DILOCO_FUSED_INT8=1)."""
    return os.environ.get(ENABLE) == "1"


def _levels(d: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each (rows, block) row's scale (absmax / 127) and levels clamp(round(d / s)), a zero
    scale giving zero levels (d / inf), as codecs._code_values computes them."""
    s = d.abs().amax(dim=1) / _QMAX
    scales.copy_(s)
    safe = torch.where(s == 0, math.inf, s).unsqueeze(1)
    return s, (d / safe).round().clamp(-_QMAX, _QMAX)


def _decoded(codes: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """What a receiver decodes from uint8 codes: (code - 127) * s, a separate multiply."""
    return (codes.to(torch.float32) - _QMAX) * s.unsqueeze(1)


def _code_less(
    x: torch.Tensor, less: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor
) -> None:
    """codes, scales <- int8(x - less): a worker's anchor - local."""
    _, levels = _levels(x - less, scales)
    codes.copy_((levels + _QMAX).to(torch.uint8))


def _delta(x: torch.Tensor, p: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> None:
    """codes, scales <- int8(x - p), p += what they decode to: a server's delta to its
    published copy P (one tensor both subtracted and moved: aliased inputs of two views are
    not compiled)."""
    s, levels = _levels(x - p, scales)
    coded = (levels + _QMAX).to(torch.uint8)
    codes.copy_(coded)
    p.add_(_decoded(coded, s))


def _add_decoded(codes: torch.Tensor, scales: torch.Tensor, target: torch.Tensor) -> None:
    """target += what codes, scales decode to: a fold into sums, an apply to an anchor."""
    target.add_(_decoded(codes, scales))


_EAGER = {"code_less": _code_less, "delta": _delta, "add_decoded": _add_decoded}


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
    if not _eligible(block, x, less, codes, scales):
        return False
    rows = x.numel() // block
    name = "code_less" if fold_into is None else "delta"
    return _run(name, x.view(rows, block), less.view(rows, block), codes.view(rows, block), scales)


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
    """Run kernel `name`; False when it is not usable here (it then never runs again)."""
    kernel = _kernel(name)
    if kernel is None:
        return False
    try:
        kernel(*args)
    except Exception as exc:  # a recompile for inputs the probe did not show, failing
        _kernels[name] = None
        _log.warning("the fused int8 kernel %s failed (%s); coding eagerly from now on", name, exc)
        return False
    return True


def _eligible(
    block: int,
    x: torch.Tensor,
    less: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
) -> bool:
    if not requested() or x.device.type != "cpu" or not x.numel() or x.numel() % block:
        return False
    floats = (x, less, scales)
    if any(t.dtype != torch.float32 or t.device.type != "cpu" for t in floats):
        return False
    if x.numel() < 2 * block:  # one row: a shape the compiled graph specializes, unprobed
        return False
    every = (*floats, codes)
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
    try:
        kernel = torch.compile(_EAGER[name], dynamic=True, fullgraph=True)
        same = _probe(name, kernel)
    except Exception as exc:  # no compiler, an inductor without this backend, ...
        _log.warning(
            "%s=1 but the fused int8 kernel %s cannot run here (%s); coding eagerly",
            ENABLE,
            name,
            exc,
        )
        return None
    if not same:
        _log.warning(
            "%s=1 but the fused int8 kernel %s differs from the eager code on its "
            "probe; coding eagerly",
            ENABLE,
            name,
        )
        return None
    _log.info("fused int8 kernel %s compiled and probed in %.1f s", name, time.monotonic() - began)
    return kernel


def _probe(name: str, kernel: Callable[..., None]) -> bool:
    """Whether compiled `kernel` writes the bytes its own Python function writes eagerly, on a
    piece that holds the edge cases (that function's bytes are the codec's: the tests compare
    them with codecs.py's)."""
    gen = torch.Generator().manual_seed(8)
    rows, block = 8, 128
    p = torch.randn(rows, block, generator=gen) * 0.01  # less (and a server's target): P
    x = p + torch.randn(rows, block, generator=gen) * 0.01
    x[1] = p[1]  # a zero block: scale 0, codes 127
    p[2:5] = 0.0
    x[2] = 1e-44  # absmax / 127 underflows to 0
    x[3] = torch.arange(block) - 63.5  # levels at exact halves of a step
    p[4] = -0.0  # -0 + a zero level's +0 is +0
    x[4, 0] = 1e-30
    codes = torch.zeros(rows, block, dtype=torch.uint8)
    scales = torch.zeros(rows)
    _EAGER["code_less"](x, p, codes, scales)  # (a receiver's operands: real codes and scales)
    decoding = name == "add_decoded"
    args = [codes, scales, p] if decoding else [x, p, codes.zero_(), scales.zero_()]
    want = [t.clone() for t in args]
    _EAGER[name](*want)
    kernel(*args)
    return all(torch.equal(got, expected) for got, expected in zip(args, want, strict=True))
