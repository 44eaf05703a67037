"""The anchor: the global weights the local model last started from, and their round.

A pseudo-gradient is anchor - local, so the anchor must be exactly the weights the server
sent. Rank 0 keeps it in fp32 (the other ranks of a torch.distributed group never compute a
pseudo-gradient and keep none); new global weights become the model everywhere and the anchor
on rank 0, then rank 0's values are broadcast. The anchor lives on the CPU, or beside a model
on an accelerator (`anchor_device`): there the pseudo-gradient, its error feedback and coding
and a coded delta's apply run at the accelerator's speed, and only coded bytes cross to the
host (the codecs code the same bytes on every device: benchmarks/codec_devices.py).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

import torch
from torch import nn

from diloco.algorithm import pseudo_gradient, to_fp32_masters
from diloco.algorithm.compression.codecs import Codec
from diloco.wire.compressed.body import apply_delta
from diloco.worker.parallel import distributed


def updated_anchor(
    anchor: dict[str, torch.Tensor],
    tensors: Mapping[str, torch.Tensor],
    device: torch.device | str = "cpu",
) -> dict[str, torch.Tensor]:
    """`tensors` as copies on `device` (fp32 for floating ones), written over `anchor` where
    it fits.

    Copying into the anchor's own memory spares a model-sized allocation, and its page faults,
    every round; a new anchor is built when the names, shapes, dtypes or device differ.
    """
    device = torch.device(device)
    fresh = {
        name: (torch.float32 if t.is_floating_point() else t.dtype, t.shape)
        for name, t in tensors.items()
    }
    if fresh.keys() == anchor.keys() and all(
        (a.dtype, a.shape) == fresh[name] and a.device == device for name, a in anchor.items()
    ):
        for name, target in anchor.items():
            target.copy_(tensors[name].detach())
        return anchor
    return to_fp32_masters(tensors, device)


class Anchor:
    """The model's anchor (`tensors`, on rank 0, on `device`) and `round`, the round they
    start.

    `round` is the sync round in sync mode and the version in async mode; in streaming mode
    each fragment has its own round (kept by the streamer) and `round` is the version the
    last full weights started.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        leader: bool,
        download_dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        self.model = model
        self.leader = leader
        self.device = torch.device(device)  # where the fp32 anchor lives
        self.download_dtype = download_dtype  # what a follower's broadcast buffers hold
        self.tensors: dict[str, torch.Tensor] = {}
        self.round = 0
        # A sync round's coded delta moves the whole anchor in place (`values_after`): no
        # copy of it is kept. One that fails part way leaves it torn until whole weights are
        # adopted again.
        self.torn = False

    def move_to(self, device: torch.device | str) -> None:
        """Keep the anchor on `device` from now on (a GPU that ran out of memory: the CPU)."""
        self.device = torch.device(device)
        self.tensors = {name: t.to(self.device) for name, t in self.tensors.items()}

    def pseudo_gradient(self, names: list[str] | None = None) -> dict[str, torch.Tensor]:
        """anchor - local (fp32) for `names`, or for every tensor; rank 0 only."""
        assert not self.torn, "a torn anchor is replaced by whole weights before it is used"
        local = self.model.state_dict()
        if names is None:
            return pseudo_gradient(self.tensors, local)
        return pseudo_gradient({n: self.tensors[n] for n in names}, {n: local[n] for n in names})

    def values_after(
        self,
        delta: bytearray,
        names: Sequence[str],
        codec: Codec,
        coded: Collection[str],
        *,
        in_place: bool = False,
    ) -> dict[str, torch.Tensor]:
        """The new global values of `names` when the server sent a coded delta against our
        anchor: anchor + D(body) for coded tensors, the sent value for the others, computed
        with the server's own function so that they equal its published copy bit for bit.

        `in_place` (a sync round, on the training thread, for the whole anchor): the anchor
        moves in place, each span checked as it is applied (no model-sized copy, no pass of
        its own to check the body first); `adopt` then takes these very tensors. A failure
        part way leaves the anchor `torn`: the caller adopts the server's whole weights
        instead (AnchorTorn). Otherwise (a streaming sync, on its own thread while training
        goes on, even with one fragment that holds every tensor) copies move, so a refused
        delta, or one whose merge gave up on it, leaves the anchor as it was; the merge
        copies them into the anchor's own tensors (`adopt_fragment`)."""
        exact = {n for n in names if n not in coded}
        if not in_place:
            targets = {name: self.tensors[name].clone() for name in names}
            apply_delta(delta, targets, codec, exact=exact, scratch=True)
            return targets
        self.torn = True  # until the last span is in
        apply_delta(delta, self.tensors, codec, exact=exact, scratch=True)
        self.torn = False
        return self.tensors

    def adopt(self, tensors: Mapping[str, torch.Tensor], round_number: int) -> None:
        """New global weights become the model and (this is rank 0) the fp32 anchor."""
        state = self.model.state_dict()
        with torch.no_grad():
            for name, target in state.items():
                target.copy_(tensors[name])
        if tensors is not self.tensors:  # (the anchor itself: a delta moved it in place)
            self.tensors = updated_anchor(self.tensors, tensors, self.device)
        self.torn = False
        self.round = round_number

    def share(self) -> None:
        """Every rank takes rank 0's model and round (nothing to do without a group)."""
        distributed.broadcast_tensors_(self.model.state_dict())
        self.round = distributed.broadcast_json(self.round)

    def adopt_everywhere(self, tensors: Mapping[str, torch.Tensor], round_number: int) -> None:
        """Every rank takes the full global weights that rank 0 has (a streaming rebase)."""
        if self.leader:
            self.adopt(tensors, round_number)
        self.share()

    def adopt_fragment(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """A fragment's new anchor (rank 0 keeps the anchor; elsewhere this does nothing),
        copied into the anchor's own tensors. Taking a coded delta's values (`values_after`'s
        copies) as the anchor instead, and letting the old tensors go, cost a CPU worker
        memory and time: at 85M int8 streaming its peak beyond training grew from 1.9x the
        fp32 model to 2.3-2.8x, and a round's blocked time from 3.1-4.2x the round's limit
        (its bytes over loopback plus a pass over the model, measured in the same run) to
        4.7-5.0x, its syncs slowed by the new allocations
        (benchmarks/results/model_scale-fragment-adopt/)."""
        if not self.leader:
            return
        part = {name: self.tensors[name] for name in tensors if name in self.tensors}
        self.tensors.update(updated_anchor(part, tensors, self.device))  # in place where it fits

    def broadcast_fragment(
        self, tensors: Mapping[str, torch.Tensor], names: list[str]
    ) -> dict[str, torch.Tensor]:
        """Rank 0's G'_f on every rank, on the model's device (followers get fresh buffers)."""
        state = self.model.state_dict()
        if self.leader:
            out = {n: tensors[n].to(device=state[n].device) for n in names}
        else:
            out = {}
            for n in names:
                dtype = self.download_dtype if state[n].is_floating_point() else None
                out[n] = torch.empty_like(state[n], dtype=dtype)
        distributed.broadcast_tensors_(out)
        return out


def parse_anchor_device(requested: object) -> torch.device | None:
    """A DiLoCoWorker's `anchor_device`: None for "auto", else the device it names (checked
    before anything reaches the server)."""
    if requested == "auto":
        return None
    wrong = (
        f"anchor_device must be 'auto', 'cpu' or a device name such as 'cuda:0', got {requested!r}"
    )
    if not isinstance(requested, (str, torch.device)):
        raise ValueError(wrong)
    try:
        device = torch.device(requested)
    except (RuntimeError, ValueError):
        raise ValueError(wrong) from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"anchor_device {str(requested)!r}: this machine has no CUDA device")
    return device


def anchor_copies(upload: Codec, beta: float, download: Codec, *, streaming: bool) -> int:
    """How many model-sized fp32 tensors a worker's round keeps beside its anchor's device:
    the anchor; a bf16 upload's whole pseudo-gradient (fp32, the quantized and the sparse
    codecs take anchor - local into the body a tensor or a piece at a time); a kept residual
    and its spare; a streaming fragment's coded delta, which moves a copy (in sync mode the
    delta moves the anchor itself)."""
    bf16 = not (upload.is_identity or upload.is_quantized or upload.is_sparse)
    residual = not upload.is_identity and beta > 0
    fragment = streaming and not download.is_identity
    return 1 + bf16 + 2 * residual + fragment


def choose_anchor_device(
    model: nn.Module, requested: torch.device | None, *, fp32_copies: int
) -> torch.device:
    """Where the anchor (and the error-feedback residuals beside it) live: `requested`, or
    (None: "auto") the model's accelerator when `fp32_copies` model-sized fp32 tensors
    (`anchor_copies`) fit in half of its free memory,
    else the CPU. On the accelerator the arithmetic of a round (anchor - local, error feedback,
    coding, a delta's apply) runs where the weights are, and only coded bytes cross to the host.
    """
    if requested is not None:
        return requested
    state = [t for t in model.state_dict().values() if isinstance(t, torch.Tensor)]
    devices = {t.device for t in state}
    if len(devices) != 1 or (device := devices.pop()).type != "cuda":
        return torch.device("cpu")
    free, _total = torch.cuda.mem_get_info(device)
    needed = 4 * fp32_copies * sum(t.numel() for t in state)
    return device if needed <= free // 2 else torch.device("cpu")
