"""The published weights P that every worker holds, and the coded deltas that move them.

With `--download-codec` other than fp32, a step's result is not the masters but a coded
delta: the server sends Q(masters - P) and sets P <- P + D(Q(masters - P)). Every worker
applies the same body to its anchor with the same function (`wire.compressed.apply_delta`),
so anchors and P stay bit-identical everywhere, and what Q left out stays in masters - P and
goes out with the next step (error feedback of the download). A worker whose anchor is not
the P before the step (it joined late, missed a step, restarted) gets P in full.

Only trainable float tensors are coded; buffers go as their new value, plain, as in uploads.
P lives in one `FrameBuffer` in the byte layout of a full download, so a full download is a
view of it; it is durable with the masters (the checkpoint's "published" group).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping

import torch

from diloco.algorithm.compression.codecs import Codec
from diloco.wire.compressed.body import compressed_frame, write_entry
from diloco.wire.format.layout import FrameBuffer, FrameLayout


class PublishedCopy:
    """P, in the layout of a full download (`dtypes`: each tensor's dtype on the wire)."""

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor],
        dtypes: Mapping[str, torch.dtype],
        codec: Codec,
        coded: Collection[str],
    ) -> None:
        self.layout = FrameLayout.plan({n: (tuple(t.shape), dtypes[n]) for n, t in tensors.items()})
        self.current = FrameBuffer(self.layout)
        self.current.fill(tensors)
        self.codec = codec
        self.coded = frozenset(coded)

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        """P as views of its buffer (read them; `advance` is the only writer)."""
        return self.current.views

    def _writable(self) -> dict[str, torch.Tensor]:
        """P to update in place; first copied away from a response still reading it."""
        if self.current.lent:
            fresh = FrameBuffer(self.layout)
            fresh.fill(self.current.views)
            self.current = fresh
        return self.current.views

    def advance(
        self,
        masters: Mapping[str, torch.Tensor],
        names: Iterable[str],
        reuse: bytearray | None = None,
    ) -> bytearray:
        """Code masters - P for `names` (one step's tensors), move P by exactly what the body
        says, and return the body. Each difference is taken a piece at a time, just before
        the piece is coded (`write_entry(less=P)`): no tensor-sized scratch (at 85M parameters
        the embedding's 155 MB) and no pass to write one out and read it back.

        P moves as each piece is coded (`write_entry(fold_into=P)`): the same `decode_into`
        of the same pieces that a worker's `apply_delta` runs on this body, so P and every
        anchor stay bit-identical, without reading back and re-checking our own body.

        `reuse`: the last delta of the same tensors, which nobody reads any more, written over
        instead of a new body (see `compressed_frame`)."""
        published = self._writable()
        names = list(names)
        exact = {n for n in names if n not in self.coded}
        shapes = {n: (tuple(published[n].shape), published[n].dtype) for n in names}
        body, views = compressed_frame(shapes, self.codec, exact, reuse=reuse)
        for name in names:
            target = published[name]
            if name in exact:
                value = masters[name].to(target.dtype)
                write_entry(views, name, value, self.codec, exact)
                target.copy_(value)
            else:  # masters - P, a piece at a time, coded and added to P
                write_entry(
                    views, name, masters[name], self.codec, exact, fold_into=target, less=target
                )
        return body
