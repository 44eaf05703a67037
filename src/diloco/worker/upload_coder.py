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
import os
import threading
from collections.abc import Callable, Collection, Mapping, Sequence

import torch

from diloco.algorithm import TensorKind
from diloco.algorithm.compression.codecs import Codec
from diloco.algorithm.outer import pseudo_gradient, pseudo_gradient_into
from diloco.wire import TensorSpec, encode_tensors, fingerprint
from diloco.wire.compressed.body import encode_compressed
from diloco.wire.format.layout import FrameLayout

log = logging.getLogger("diloco.worker")

# An experiment awaiting a GPU's measurement (benchmarks/results/gpu_check/README.md): "1"
# codes a GPU worker's compressed upload into a body-sized buffer on the GPU and copies it to
# the host once, instead of copying each piece's codes and scales as it is coded.
STAGE_ON_DEVICE = "DILOCO_STAGE_ON_DEVICE"


class DeferredBody:
    """An upload body to code once, possibly on another thread (`UploadCoder.coding_from`),
    or to abandon if it will never be sent (its residuals then stand as they were)."""

    def __init__(self, code: Callable[[], bytearray], abandon: Callable[[], None]) -> None:
        self._code = code
        self._abandon = abandon
        self._lock = threading.Lock()
        self._claimed = False

    @classmethod
    def ready(cls, body: bytearray) -> DeferredBody:
        """A body coded already."""
        return cls(lambda: body, lambda: None)

    def _claim(self) -> bool:
        with self._lock:
            claimed, self._claimed = self._claimed, True
        return not claimed

    def __call__(self) -> bytearray:
        """The body; a second call (or one after `abandon`) is an error."""
        if not self._claim():
            raise RuntimeError("a deferred upload body is coded once")
        return self._code()

    def abandon(self) -> None:
        """It will not be coded or sent (its send failed before its thread ran); nothing if
        it was claimed already."""
        if self._claim():
            self._abandon()


class UploadCoder:
    """Turns pseudo-gradients into upload bodies for one codec; owns the residuals."""

    def __init__(
        self,
        codec: Codec,
        beta: float,
        specs: Sequence[TensorSpec],
        plan: Sequence[Sequence[str]] | None = None,
        device: torch.device | str = "cpu",
        stage_on_device: bool | None = None,
    ) -> None:
        self.codec = codec
        self.device = torch.device(device)  # the residuals', beside the anchor
        # code a compressed body where the residuals live, then copy it once (see
        # STAGE_ON_DEVICE; None: as that variable says, and only off the CPU; True: always)
        self.stage_on_device = stage_on_device
        self._stage: torch.Tensor | None = None
        self.beta = float(beta)
        self.coded_names = {s.name for s in specs if s.kind == TensorKind.TRAINABLE.value}
        self._residual: dict[str, torch.Tensor] = {}  # settled: what the server has missed
        self._plain_buffer: tuple[FrameLayout, bytearray] | None = None  # (plain_body)
        self._coded_buffer: bytearray | None = None  # (body_from with reuse)
        # The residuals the body under way leaves, in buffers of their own: they replace the
        # residuals once the server folds the body in, and are dropped if it never does (see
        # `settle`); None when nothing is pending. A replaced residual's memory is the next
        # body's buffer (`_spare`), so no round allocates or copies a model-sized residual.
        self._pending: dict[str, torch.Tensor] | None = None
        self._spare: dict[str, torch.Tensor] = {}
        # Set unless a body's coding handed to another thread (`coding_from`) is yet to end:
        # until then it writes the pending residuals, so whatever reads or replaces them waits.
        self._coding_done = threading.Event()
        self._coding_done.set()
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
    def residual(self) -> dict[str, torch.Tensor]:
        """Each coded tensor's residual, the body under way's counted as folded (what a
        checkpoint keeps: a restarted worker treats a body it sent as folded). Waits for a
        coding under way on another thread, which writes the pending ones."""
        self._coding_done.wait()
        return {**self._residual, **(self._pending or {})}

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
            for name in coded:  # e <- e - D(C(e)): what the server did not get
                source[name].sub_(sent[name].reshape(source[name].shape))
        return sent

    def plain_body(
        self,
        anchor: Mapping[str, torch.Tensor],
        local: Mapping[str, torch.Tensor],
        reuse: bool = True,
        spare: bytearray | None = None,
    ) -> bytearray:
        """The identity codec's body with anchor - local computed straight into it: no
        model-sized (or fragment-sized) fp32 gradient is allocated, page-faulted and copied.
        `reuse`: in the last such body's buffer when the layout is the same, and kept for the
        next; the last body's request must be over (sync mode: the next round syncs after
        it). Streaming fragments' uploads overlap, so each takes a buffer of its own.
        `spare`: a buffer nobody reads any more (the weights the worker joined with, loaded
        already), written over when no kept buffer fits and it has the body's size."""
        layout = FrameLayout.plan(
            {
                name: (
                    tuple(tensor.shape),
                    torch.float32 if tensor.is_floating_point() else torch.int64,
                )
                for name, tensor in anchor.items()
            }
        )
        kept = self._plain_buffer if reuse else None
        if kept is not None and kept[0] == layout:
            buffer = kept[1]
        elif spare is not None and len(spare) == layout.size:
            buffer = spare
        else:
            buffer = bytearray(layout.size)
        if reuse:
            self._plain_buffer = (layout, buffer)
        body = torch.frombuffer(buffer, dtype=torch.uint8)
        layout.write_header(body)
        pseudo_gradient_into(anchor, local, layout.views(body))
        return buffer

    def body_from(
        self,
        anchor: Mapping[str, torch.Tensor],
        local: Mapping[str, torch.Tensor],
        reuse: bool = False,
    ) -> bytearray:
        """`body(pseudo_gradient(anchor, local))`, byte for byte. A codec that keeps a residual
        gets there without the model-sized pseudo-gradient (allocated, page-faulted and read
        again every round): each coded tensor's anchor - local goes through one scratch
        buffer into its e' = beta e + g; the others' differences are small.

        `reuse`: written over the last body made with `reuse` when it has this body's size;
        the caller promises that body's request is over (sync mode: a round's exchange starts
        after the last one's ended; streaming mode's uploads overlap and take new bodies)."""
        if self.codec.is_identity:
            return self.plain_body(anchor, local, reuse=reuse)
        if not (self.codec.is_quantized or self.codec.is_sparse):
            return self.body(pseudo_gradient(anchor, local), reuse=reuse)
        coded = self._coded(anchor)
        if not self.keeps_residual:
            return self._coded_difference(anchor, local, coded, reuse)
        source, exact, pending = self._accumulated_from(anchor, local, coded)
        return self._compressed(source, exact, pending, reuse)

    def coding_from(
        self, anchor: Mapping[str, torch.Tensor], local: Mapping[str, torch.Tensor]
    ) -> DeferredBody:
        """`body_from(anchor, local)` in two parts, for a streaming fragment's send: what reads
        `local` runs now, on the caller's thread (an fp32 CPU anchor's coded tensors: `local`
        copied into the pending residuals' buffers, one pass; the rest: e' = beta e + g, and
        the exact tensors' differences); the DeferredBody returned takes e' from those copies
        and codes the body, so it may run on another thread while training moves `local` on
        (Streaming DiLoCo overlaps a fragment's communication with the next inner steps; a
        top-k body's coding is most of a send's time on a CPU). It reads `anchor` then: the
        caller leaves the anchor's tensors as they are until it has coded (a streaming
        fragment's anchor changes only at its merge, after its sync). Until it has coded (or
        been abandoned), whatever reads or replaces the pending residuals (`residual`,
        `state`, `settle`, the next body, `move_to`) waits for it. The body is byte for byte
        `body_from`'s.

        Only a quantized or sparse codec that keeps a residual defers its coding. The others
        read `local` while they code (int8 without error feedback takes anchor - local a piece
        at a time) or code a dense body whole (fp32, bf16): all of it runs now."""
        if not self.keeps_residual or not (self.codec.is_quantized or self.codec.is_sparse):
            return DeferredBody.ready(self.body_from(anchor, local))
        coded = self._coded(anchor)
        # An fp32 anchor's tensors are only copied now (local, in fp32, into its pending
        # residual's buffer: one pass); g and e' are taken from that copy on the coding's
        # thread, element for element as `_accumulated_from` takes them from `local`.
        later = [n for n in coded if anchor[n].dtype == torch.float32 and anchor[n].is_cpu]
        snapshots = self._snapshots(later, local)
        source, exact, pending = self._accumulated_from(
            {n: anchor[n] for n in anchor if n not in snapshots},
            {n: local[n] for n in anchor if n not in snapshots},
            [n for n in coded if n not in snapshots],
            keep=snapshots,
        )
        source = {n: pending[n] if n in pending else source[n] for n in anchor}  # body order
        self._coding_done.clear()

        def code() -> bytearray:
            try:
                try:
                    self._accumulate_snapshots(anchor, snapshots)
                except BaseException:  # copies of local are no residual: the old ones stand
                    self._settled(folded=False)
                    raise
                return self._compressed(source, exact, pending, reuse=False)
            finally:
                self._coding_done.set()

        def abandon() -> None:  # never coded nor sent: the old residuals stand
            self._coding_done.set()
            self.settle(folded=False)

        return DeferredBody(code, abandon)

    def _accumulated_from(
        self,
        anchor: Mapping[str, torch.Tensor],
        local: Mapping[str, torch.Tensor],
        coded: Sequence[str],
        keep: Mapping[str, torch.Tensor] | None = None,
    ) -> tuple[dict[str, torch.Tensor], set[str], dict[str, torch.Tensor]]:
        """What a residual-keeping body codes, in buffers that no longer read `local`: each
        coded tensor's anchor - local goes through one scratch buffer into its pending
        e' = beta e + g; the others' differences (small) are exact. Returns (the body's
        tensors, the exact names, the pending residuals). `keep`: more pending residuals'
        buffers, filled by the caller (`coding_from`'s snapshots)."""
        others = [n for n in anchor if n not in set(coded)]
        exact = pseudo_gradient({n: anchor[n] for n in others}, {n: local[n] for n in others})
        largest = max((anchor[n].numel() for n in coded), default=0)
        scratch = torch.empty(largest, dtype=torch.float32, device=self.device)

        def difference(name: str) -> torch.Tensor:  # in the scratch, used before the next
            into = scratch[: anchor[name].numel()].view(anchor[name].shape)
            pseudo_gradient_into({name: anchor[name]}, {name: local[name]}, {name: into})
            return into

        pending = self._accumulated(coded, difference, keep)
        source = {n: pending[n] if n in pending else exact[n] for n in anchor}
        return source, set(exact), pending

    def _snapshots(
        self, names: Sequence[str], local: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """`local` of `names` copied, in fp32 on the residuals' device, into the buffers their
        pending residuals will be (spares where they fit): the only pass over the model a
        deferred coding takes on the training thread. Settles a body left unanswered first,
        as `_accumulated` does, so the spares are free."""
        self._settle_unanswered()
        return {n: self._buffer(n, local[n].shape).copy_(local[n].detach()) for n in names}

    def _accumulate_snapshots(
        self, anchor: Mapping[str, torch.Tensor], snapshots: Mapping[str, torch.Tensor]
    ) -> None:
        """Each snapshot of local becomes e' = beta e + (anchor - local) in place: g through
        one scratch, then `_accumulate`'s operations in its order (its bytes exactly)."""
        largest = max((t.numel() for t in snapshots.values()), default=0)
        scratch = torch.empty(largest, dtype=torch.float32, device=self.device)
        for name, target in snapshots.items():
            g = scratch[: target.numel()].view(target.shape)
            torch.sub(anchor[name].detach(), target, out=g)
            self._accumulate(name, g, into=target)

    def _coded_difference(
        self,
        anchor: Mapping[str, torch.Tensor],
        local: Mapping[str, torch.Tensor],
        coded: Sequence[str],
        reuse: bool,
    ) -> bytearray:
        """No residual kept: each coded tensor's anchor - local is taken a piece at a time
        as the piece is coded (`write_parts(less=...)`, a bf16 or other-device local piece
        converted to fp32 on the anchor's device first), the same fp32 subtraction as
        `pseudo_gradient`'s, so neither a model-sized pseudo-gradient nor a tensor-sized
        scratch is made. An anchor that is not fp32 goes through `pseudo_gradient`."""
        fast = {
            name
            for name in coded
            if anchor[name].dtype == torch.float32 and local[name].is_floating_point()
        }
        others = [n for n in anchor if n not in fast]
        rest = pseudo_gradient({n: anchor[n] for n in others}, {n: local[n] for n in others})
        exact = set(anchor) - set(coded)
        source = {n: anchor[n].detach() if n in fast else rest[n] for n in anchor}
        less = {n: local[n].detach() for n in fast}
        return self._compressed(source, exact, None, reuse, less=less)

    def _compressed(
        self,
        source: Mapping[str, torch.Tensor],
        exact: Collection[str],
        residual: Mapping[str, torch.Tensor] | None,
        reuse: bool,
        less: Mapping[str, torch.Tensor] | None = None,
    ) -> bytearray:
        """The compressed body of `source`, each coded piece's decoded values taken off
        `residual` as it is written; with `reuse`, over the last body made so, and kept."""
        body = encode_compressed(
            source,
            self.codec,
            exact=exact,
            fold_into=residual,
            weight=-1.0,
            less=less,
            reuse=self._coded_buffer if reuse else None,
            staging=self._staging if self._stages() else None,
        )
        if reuse:
            self._coded_buffer = body
        return body

    def _stages(self) -> bool:
        if self.stage_on_device is not None:
            return self.stage_on_device
        return self.device.type != "cpu" and os.environ.get(STAGE_ON_DEVICE) == "1"

    def _staging(self, size: int) -> torch.Tensor:
        """`size` bytes beside the residuals, in a buffer kept for the next bodies and grown
        to the largest (streaming fragments' bodies differ in size). Never cleared: every
        byte of a body's data section is written by one of its entries."""
        kept = self._stage
        if kept is None or kept.numel() < size or kept.device != self.device:
            kept = self._stage = torch.empty(size, dtype=torch.uint8, device=self.device)
        return kept[:size]

    def body(self, gradient: Mapping[str, torch.Tensor], reuse: bool = False) -> bytearray:
        """The body that uploads `gradient` (anchor - local); updates the residuals.
        `reuse`: a compressed body is written over the last one, as in `body_from`."""
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
        return self._compressed(source, exact, residual, reuse)

    def _with_residuals(
        self, gradient: Mapping[str, torch.Tensor]
    ) -> tuple[list[str], dict[str, torch.Tensor]]:
        """The coded names, and what is coded for each: e' = beta e + g in a buffer of its own
        where a residual is kept (pending until `settle`), else the gradient itself."""
        coded = self._coded(gradient)
        source = dict(gradient)
        if self.keeps_residual:
            source.update(self._accumulated(coded, gradient.__getitem__))
        elif self._pending is not None:  # (none is kept without a residual)
            self.settle(folded=True)
        return coded, source

    def _coded(self, tensors: Mapping[str, torch.Tensor]) -> list[str]:
        """The names of `tensors` that the codec codes: trainable floating tensors."""
        return [n for n, t in tensors.items() if n in self.coded_names and t.is_floating_point()]

    def _accumulated(
        self,
        coded: Sequence[str],
        gradient_of: Callable[[str], torch.Tensor],
        keep: Mapping[str, torch.Tensor] | None = None,
    ) -> dict[str, torch.Tensor]:
        """e' = beta e + g for each coded name, pending until `settle` (with `keep`'s, whose
        buffers the caller fills); a last body that got no answer counts as folded first."""
        self._settle_unanswered()
        pending = {name: self._accumulate(name, gradient_of(name)) for name in coded}
        self._pending = {**pending, **(keep or {})}
        return self._pending

    def settle(self, folded: bool) -> None:
        """The server's answer to the last body: folded in ("accepted", "duplicate"), its
        residuals replace the old ones; not folded (the round committed without it, a rebase
        dropped it, a streaming sync failed and its fragment goes again later), the old ones
        stand, so that no part of a pseudo-gradient is lost or sent twice."""
        self._coding_done.wait()  # (a body coded on another thread writes the pending ones)
        self._settled(folded)

    def _settled(self, folded: bool) -> None:
        """`settle`'s bookkeeping, without waiting for a coding under way (the coding's own
        thread, giving up on its copies, must not wait for itself)."""
        pending, self._pending = self._pending, None
        for name, new in (pending or {}).items():
            if folded:
                old = self._residual.get(name)
                self._residual[name] = new
                if old is not None:
                    self._spare[name] = old
            else:
                self._spare[name] = new

    def _settle_unanswered(self) -> None:
        """Before a new body: a last body that got no answer counts as folded (after a
        coding under way ends), so its old residuals' buffers are spare."""
        self._coding_done.wait()
        self._settled(folded=True)

    def _buffer(self, name: str, shape: torch.Size) -> torch.Tensor:
        """An fp32 buffer of `shape` for `name`'s pending residual: its spare where it fits."""
        target = self._spare.pop(name, None)
        if target is None or target.shape != shape:
            target = torch.empty(shape, dtype=torch.float32, device=self.device)
        return target

    def _accumulate(
        self, name: str, gradient: torch.Tensor, into: torch.Tensor | None = None
    ) -> torch.Tensor:
        """e' = beta e + g (as beta * e, then + g: the simulator's two roundings), written
        into a spare fp32 buffer (or `into`); e itself stays as it is until `settle`."""
        g = gradient.detach().to(device=self.device, dtype=torch.float32)
        target = self._buffer(name, g.shape) if into is None else into
        residual = self._residual.get(name)
        if residual is None or residual.shape != g.shape:
            target.zero_().add_(g)  # beta * 0 + g, with the signs of zeros it gives
        else:
            torch.mul(residual, self.beta, out=target).add_(g)
        return target

    def move_to(self, device: torch.device | str) -> None:
        """Keep the residuals (and a body under way's) on `device` from now on."""
        self._coding_done.wait()
        self.device = torch.device(device)
        self._residual = {name: t.to(self.device) for name, t in self._residual.items()}
        if self._pending is not None:
            self._pending = {name: t.to(self.device) for name, t in self._pending.items()}
        self._spare = {}
        self._stage = None

    # ----------------------------------------------------------------- checkpoints

    def state(self) -> tuple[dict[str, torch.Tensor], str | None]:
        """The residuals and the key they belong to (nothing when none is kept); a body under
        way counts as folded, as a restarted worker treats it."""
        residual = self.residual  # (after a coding under way on another thread)
        if not self.keeps_residual or not residual:
            return {}, None
        return residual, self.key

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
        self._residual = {
            name: tensor.to(device=self.device, dtype=torch.float32, copy=True)
            for name, tensor in residual.items()
            if name in self.coded_names
        }
        self._pending, self._spare = None, {}
