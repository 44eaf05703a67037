"""The fp32 master weights, kept in the byte layout of the result that workers download.

- With fp32 downloads the masters' buffer *is* the encoded result: nothing is encoded, and
  every worker's response is a read-only view of the bytes the outer step wrote.
- The outer step updates that buffer in place. When a response still reads it (a straggler
  downloading the last result while the next round commits), the masters are first copied
  into a new buffer and the old one is left to the readers until they let go.
- A round's running sums live in fp32 buffers allocated once and written over every round;
  in streaming mode one pool the size of the largest fragment serves every fragment's round
  in turn (`fragment_sums`), so the sums take 1/P of the model, not all of it.
So memory is the masters' buffer, the sums and the momentum (3x the fp32 model), plus a
reused encoded result of 0.5x when the download dtype is bf16; no model-sized buffer is
allocated (and page-faulted in) again per round.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from diloco.wire.format.layout import FrameBuffer, FrameLayout


class MasterFrames:
    """Masters as views of one `FrameBuffer`, the round's sum buffers, the result to serve.

    `encoded` is each tensor's dtype in the downloaded result; floating masters are fp32 and
    int/bool ones keep their dtype. When every name's encoded dtype is its master's, the
    masters' buffer is served as the result as it is.
    """

    def __init__(
        self, tensors: Mapping[str, torch.Tensor], encoded: Mapping[str, torch.dtype]
    ) -> None:
        shapes = {name: tuple(t.shape) for name, t in tensors.items()}
        master_dtypes = {
            name: torch.float32 if t.is_floating_point() else t.dtype for name, t in tensors.items()
        }
        self.layout = FrameLayout.plan({n: (shapes[n], master_dtypes[n]) for n in tensors})
        self.result_layout = FrameLayout.plan({n: (shapes[n], encoded[n]) for n in tensors})
        self.aliased = all(encoded[n] == master_dtypes[n] for n in tensors)
        self.current = FrameBuffer(self.layout)
        self.current.fill(tensors)
        self._sums: dict[str, torch.Tensor] | None = None
        self._pool: torch.Tensor | None = None  # (fragment_sums)
        self._senders: dict[str, torch.Tensor] | None = None
        self._encoded: FrameBuffer | None = None

    @property
    def masters(self) -> dict[str, torch.Tensor]:
        return self.current.views

    def sums(self) -> dict[str, torch.Tensor]:
        """fp32 buffers for a round's running sums (floating names), the same every round."""
        if self._sums is None:
            self._sums = {
                name: torch.empty(view.shape, dtype=torch.float32)
                for name, view in self.masters.items()
                if view.dtype == torch.float32
            }
        return self._sums

    def fragment_sums(self, names: Sequence[str], fresh: bool = False) -> dict[str, torch.Tensor]:
        """fp32 buffers for the running sums of one streaming fragment's round (its floating
        `names`): views of one pool the size of the largest fragment asked for, shared by
        every fragment. Their rounds fold one after another: a worker sends fragment f + 1
        only after it has merged fragment f's result, so f's step has used its sums up before
        f + 1's open. `fresh`: another fragment's round still has sums open (a straggler, a
        join, a barrier timeout), so these get memory of their own, dropped with the round."""
        shapes = {
            name: self.masters[name].shape
            for name in names
            if self.masters[name].dtype == torch.float32
        }
        if fresh:
            return {name: torch.empty(shape, dtype=torch.float32) for name, shape in shapes.items()}
        total = sum(math.prod(shape) for shape in shapes.values())
        if self._pool is None or self._pool.numel() < total:
            self._pool = None  # (no round holds it: its memory goes before the larger one comes)
            self._pool = torch.empty(total, dtype=torch.float32)
        views, start = {}, 0
        for name, shape in shapes.items():
            size = math.prod(shape)
            views[name] = self._pool[start : start + size].view(shape)
            start += size
        return views

    def senders(self) -> dict[str, torch.Tensor]:
        """fp32 buffers for a round's counts of senders (sparse_mean), as `sums`."""
        if self._senders is None:
            self._senders = {
                name: torch.empty(view.shape, dtype=torch.float32)
                for name, view in self.masters.items()
                if view.dtype == torch.float32
            }
        return self._senders

    def writable(self) -> dict[str, torch.Tensor]:
        """The masters, to be updated in place; first copied to a new buffer if a response
        still reads the current one."""
        if self.current.lent:
            fresh = FrameBuffer(self.layout)
            fresh.fill(self.current.views)
            self.current = fresh
        return self.current.views

    def result(self) -> FrameBuffer:
        """The body workers download: the masters' own buffer, or an encoding of them.

        An encoding is written into the previous one's buffer unless a response still reads it.
        """
        if self.aliased:
            return self.current
        if self._encoded is None or self._encoded.lent:
            self._encoded = FrameBuffer(self.result_layout)
        self._encoded.fill(self.current.views)
        return self._encoded
