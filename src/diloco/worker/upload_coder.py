"""A pseudo-gradient's upload body: plain tensors, or compressed with error feedback.

The codec is the server's (/v1/info `upload_codec`). fp32 sends the tensors as they are. Every
other codec loses something, and error feedback keeps it: for each trainable tensor the worker
holds a residual e and sends, every round, the coding of e <- beta e + g, then keeps
e <- e - D(C(e)), what the server did not get (Seide et al. 2014; Karimireddy et al. 2019; the
decay beta as in SparseLoCo, Sarfi et al. 2025). D is applied to the body itself with the
server's own decoder (`decode_into` of each piece as it is coded), so the residual is exactly
what the server's fold will miss. beta = 0 turns it off (nothing is kept). Buffers and frozen
tensors always go exact.

The residual belongs to one model, fragment plan and codec: `key` names them, and a residual
saved under another key (a restart with another model, plan or server setting) is dropped
with a log line instead of being added to pseudo-gradients it does not belong to.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping, Sequence

import torch

from diloco.algorithm import TensorKind
from diloco.algorithm.codecs import Codec
from diloco.algorithm.outer import pseudo_gradient_into
from diloco.wire import TensorSpec, encode_tensors, fingerprint
from diloco.wire.compressed.body import encode_compressed
from diloco.wire.format.layout import FrameLayout

log = logging.getLogger("diloco.worker")


class UploadCoder:
    """Turns pseudo-gradients into upload bodies for one codec; owns the residuals."""

    def __init__(
        self,
        codec: Codec,
        beta: float,
        specs: Sequence[TensorSpec],
        plan: Sequence[Sequence[str]] | None = None,
    ) -> None:
        self.codec = codec
        self.beta = float(beta)
        self.coded_names = {s.name for s in specs if s.kind == TensorKind.TRAINABLE.value}
        self.residual: dict[str, torch.Tensor] = {}
        self._plain_buffer: tuple[FrameLayout, bytearray] | None = None  # (plain_body)
        # The residuals before the body under way: what they go back to if the server never
        # folds it in (see `settle`); None when nothing is pending.
        self._before: dict[str, torch.Tensor | None] | None = None
        identity = {
            "codec": str(codec),
            "block": codec.block,
            "chunk": codec.chunk,
            "beta": self.beta,
            "model": fingerprint(list(specs)),
            "plan": [list(names) for names in plan] if plan is not None else None,
        }
        text = json.dumps(identity, sort_keys=True).encode()
        self.key = hashlib.sha256(text).hexdigest()[:16]

    @property
    def keeps_residual(self) -> bool:
        """Whether anything is carried between rounds (a lossy codec and beta > 0)."""
        return self.beta > 0 and not self.codec.is_identity

    def dense(self, gradient: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The tensors a dense codec (fp32, bf16) sends for `gradient`, each in the dtype it
        travels in; updates the residuals. Element by element, so a rank of an FSDP group
        can code its own rows of each tensor (see worker/parallel/fsdp.py)."""
        codec = self.codec
        if codec.is_quantized or codec.is_sparse:
            raise ValueError(f"codec {codec} does not send dense tensors")
        if codec.is_identity:
            return {n: t.float() if t.is_floating_point() else t for n, t in gradient.items()}
        coded, source = self._with_residuals(gradient)
        sent = {n: t.bfloat16() if t.is_floating_point() else t for n, t in source.items()}
        if self.keeps_residual:
            self._subtract(coded, sent)
        return sent

    def plain_body(
        self, anchor: Mapping[str, torch.Tensor], local: Mapping[str, torch.Tensor]
    ) -> bytearray:
        """The identity codec's body with anchor - local computed straight into it, in the
        last body's buffer when the layout is the same: no model-sized gradient or body is
        allocated, page-faulted and copied each round. The last body's request must be over
        (sync mode: the next round syncs after it)."""
        layout = FrameLayout.plan(
            {
                name: (
                    tuple(tensor.shape),
                    torch.float32 if tensor.is_floating_point() else torch.int64,
                )
                for name, tensor in anchor.items()
            }
        )
        kept = self._plain_buffer
        buffer = kept[1] if kept is not None and kept[0] == layout else bytearray(layout.size)
        self._plain_buffer = (layout, buffer)
        body = torch.frombuffer(buffer, dtype=torch.uint8)
        layout.write_header(body)
        pseudo_gradient_into(anchor, local, layout.views(body))
        return buffer

    def body(self, gradient: Mapping[str, torch.Tensor]) -> bytearray:
        """The body that uploads `gradient` (anchor - local); updates the residuals."""
        codec = self.codec
        if codec.is_identity:
            return encode_tensors(gradient, float_dtype=torch.float32)
        if not (codec.is_quantized or codec.is_sparse):
            return encode_tensors(self.dense(gradient))  # dense bf16: a plain body
        coded, source = self._with_residuals(gradient)
        exact = set(gradient) - set(coded)
        # e <- e - D(C(e)) as each piece is coded: the decode_into the server's fold runs on
        # the same pieces of this body, so e is exactly what the server missed.
        residual = {n: source[n] for n in coded} if self.keeps_residual else None
        return encode_compressed(source, codec, exact=exact, fold_into=residual, weight=-1.0)

    def _with_residuals(
        self, gradient: Mapping[str, torch.Tensor]
    ) -> tuple[list[str], dict[str, torch.Tensor]]:
        """The coded names, and what is coded for each: e <- beta e + g where a residual is
        kept (remembered first, for `settle`), else the gradient itself."""
        coded = [n for n, t in gradient.items() if n in self.coded_names and t.is_floating_point()]
        source = dict(gradient)
        if self.keeps_residual:
            self._remember(coded)
            for name in coded:
                source[name] = self._accumulate(name, gradient[name])
        return coded, source

    def _remember(self, coded: Sequence[str]) -> None:
        """The residuals before this body, for `settle` to put back if it is never folded."""
        self._before = {
            n: None if self.residual.get(n) is None else self.residual[n].clone() for n in coded
        }

    def settle(self, folded: bool) -> None:
        """The server's answer to the last body: folded in ("accepted", "duplicate"), the
        residuals stand; not folded (the round committed without it, a rebase dropped it, a
        streaming sync failed and its fragment goes again later), they go back to what they
        were before it, so that no part of a pseudo-gradient is lost or sent twice."""
        before, self._before = self._before, None
        if folded or before is None:
            return
        for name, tensor in before.items():
            if tensor is None:
                self.residual.pop(name, None)
            else:
                self.residual[name] = tensor

    def _accumulate(self, name: str, gradient: torch.Tensor) -> torch.Tensor:
        """e <- beta e + g, in the residual's own fp32 memory (a new one if it has none)."""
        residual = self.residual.get(name)
        if residual is None or residual.shape != gradient.shape:
            residual = torch.zeros(gradient.shape, dtype=torch.float32)
        residual.mul_(self.beta).add_(gradient.detach().to(device="cpu", dtype=torch.float32))
        self.residual[name] = residual
        return residual

    def _subtract(self, names: Sequence[str], sent: Mapping[str, torch.Tensor]) -> None:
        for name in names:
            self.residual[name].sub_(sent[name].reshape(self.residual[name].shape))

    # ----------------------------------------------------------------- checkpoints

    def state(self) -> tuple[dict[str, torch.Tensor], str | None]:
        """The residuals and the key they belong to (nothing when none is kept)."""
        if not self.keeps_residual or not self.residual:
            return {}, None
        return dict(self.residual), self.key

    def restore(self, residual: Mapping[str, torch.Tensor], key: str | None) -> None:
        """Take saved residuals back if they belong to this model, plan and codec."""
        if not residual or not self.keeps_residual:
            return
        if key != self.key:
            log.warning(
                "dropping the saved error-feedback residual of %d tensors: it was kept for "
                "another model, fragment plan or codec (now %s, beta %g)",
                len(residual),
                self.codec,
                self.beta,
            )
            return
        self.residual = {
            name: tensor.to(torch.float32).clone()
            for name, tensor in residual.items()
            if name in self.coded_names
        }
