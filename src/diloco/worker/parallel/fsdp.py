"""FSDP2 inside a worker: every rank keeps the anchor of its own shard, rank 0 relays bodies.

`fully_shard` leaves each parameter a DTensor split by rows (Shard(0)) over a 1-D mesh of the
group. The pseudo-gradient is computed where each shard lives (anchor shard - local shard), so
no rank holds the full fp32 anchor or the full model: the shards travel to rank 0 one at a
time, straight into their rows of the upload body (a safetensors body is row-major, so one
rank's rows are one contiguous byte range of the tensor's slot), and the new global weights
go back the same way. Rank 0 holds the bodies in transit (model-sized, in the wire's dtype),
as a single-process worker does; nothing else of the full model.

State-dict entries that are not DTensors (buffers, parameters left out of `fully_shard`) are
replicated, as under DDP: rank 0's values are uploaded and the new ones are broadcast.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from diloco.algorithm import pseudo_gradient
from diloco.wire.format.layout import FrameLayout
from diloco.worker.anchor import updated_anchor
from diloco.worker.parallel import distributed
from diloco.worker.settings import ServerSettingsError, WorkerSettings


def _dtensor_module() -> Any:
    """torch.distributed.tensor if something imported it, else None: a model holds DTensors
    only after that import (fully_shard does it), and importing it here would cost every
    worker and CLI start about a second."""
    return sys.modules.get("torch.distributed.tensor")


@dataclass(frozen=True)
class ShardRows:
    """One sharded tensor: its global shape and the rows (start, count) each rank holds."""

    shape: tuple[int, ...]
    starts: tuple[int, ...]
    counts: tuple[int, ...]


def _is_dtensor(tensor: object) -> bool:
    module = _dtensor_module()
    return module is not None and isinstance(tensor, module.DTensor)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if _is_dtensor(tensor) else tensor  # type: ignore[attr-defined]


def refuse_fsdp1(model: nn.Module) -> None:
    """ValueError for a model wrapped anywhere by FSDP1's FullyShardedDataParallel (the
    Trainer's or Lightning's FSDP v1): its state_dict() is a collective that returns copies,
    so rank 0 reading it alone hangs the group, and weights copied into it never reach the
    model. FSDP2 (`fully_shard`) is what a sharded worker takes."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # a torch without torch.distributed
        return
    if any(isinstance(module, FullyShardedDataParallel) for module in model.modules()):
        raise ValueError(
            "the model is wrapped in FullyShardedDataParallel (FSDP1), which DiLoCoWorker "
            "does not support: its state_dict() gathers copies on every rank; shard it with "
            "FSDP2 (torch.distributed.fsdp.fully_shard) instead, or train without FSDP"
        )


def is_sharded(model: nn.Module) -> bool:
    """Whether any state-dict entry of `model` is a DTensor (FSDP2 or another DTensor plan)."""
    return any(_is_dtensor(t) for t in model.state_dict().values())


def _check_placement(name: str, tensor: torch.Tensor) -> None:
    """Only fully_shard's own layout is taken: rows split over a 1-D mesh of the whole group."""
    placements = tuple(tensor.placements)  # type: ignore[attr-defined]
    mesh = tensor.device_mesh  # type: ignore[attr-defined]
    rows_over_group = (
        len(placements) == 1
        and isinstance(placements[0], _dtensor_module().Shard)
        and placements[0].dim == 0
        and mesh.ndim == 1
        and mesh.size() == distributed.group_size()
    )
    if not rows_over_group:
        raise ValueError(
            f"tensor {name!r} is a DTensor placed {placements} on a mesh of shape "
            f"{tuple(mesh.shape)}; a DiLoCo worker takes fully_shard's layout: rows split "
            f"(Shard(0)) over a 1-D mesh of all {distributed.group_size()} ranks of the group"
        )


class ShardLayout:
    """Which rows of every sharded tensor each rank holds (gathered once, at the start)."""

    def __init__(self, model: nn.Module) -> None:
        state = model.state_dict()
        self.sharded = sorted(n for n, t in state.items() if _is_dtensor(t))
        self.replicated = sorted(
            n for n, t in state.items() if isinstance(t, torch.Tensor) and n not in self.sharded
        )
        for name in self.sharded:
            _check_placement(name, state[name])
        mine = [_local(state[n]).shape[0] if state[n].dim() else 0 for n in self.sharded]
        counts = _all_gather_ints(mine)
        self.rows: dict[str, ShardRows] = {}
        for index, name in enumerate(self.sharded):
            shape = tuple(state[name].shape)
            per_rank = tuple(rank_counts[index] for rank_counts in counts)
            empty = state[name].numel() == 0  # FSDP2 keeps no rows of it: a 0-byte slot
            if not shape or (sum(per_rank) != shape[0] and not empty):
                raise ValueError(
                    f"tensor {name!r} of shape {list(shape)}: its ranks hold {list(per_rank)} "
                    "rows, which do not add up to the whole tensor"
                )
            starts = tuple(sum(per_rank[:r]) for r in range(len(per_rank)))
            self.rows[name] = ShardRows(shape, starts, per_rank)


def _all_gather_ints(values: list[int]) -> list[list[int]]:
    """Every rank's `values` (one list per rank, all of one length), via one all_gather."""
    device = distributed.comm_device()
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(distributed.group_size())]
    dist.all_gather(everyone, mine)
    return [t.cpu().tolist() for t in everyone]


def check_sharded_settings(settings: WorkerSettings) -> None:
    """What a sharded worker cannot do yet is refused on every rank (the settings are shared)."""
    if settings.mode == "streaming":
        raise ServerSettingsError(
            "the server runs streaming mode; an FSDP-sharded worker syncs in sync or async "
            "mode (use DDP, or one process, for streaming)"
        )
    upload, download = settings.upload_codec, settings.download_codec
    coded = [f"upload codec {upload}"] if upload.is_quantized or upload.is_sparse else []
    if not download.is_identity:
        coded.append(f"download codec {download}")
    if coded:
        raise ServerSettingsError(
            f"the server sets {' and '.join(coded)}; an FSDP-sharded worker sends fp32 or "
            "bf16 tensors and takes plain weights (a quantized or sparse codec's blocks and a "
            "coded download's delta span whole tensors)"
        )


class ShardedAnchor:
    """The anchor of an FSDP2 worker: each rank's shards, and rank 0's replicated tensors.

    It offers what the worker uses of `Anchor` in sync and async mode: `adopt` (rank 0 takes
    the server's weights), `share` (every rank takes its rows of them), and the bodies that
    go up, gathered from every rank with `gather_body`.
    """

    def __init__(self, model: nn.Module, *, leader: bool, download_dtype: torch.dtype) -> None:
        self.model = model
        self.leader = leader
        self.download_dtype = download_dtype
        self.layout = ShardLayout(model)
        self.tensors: dict[str, torch.Tensor] = {}  # own rows, and (rank 0) replicated ones
        self.round = 0
        self.torn = False  # (Anchor's flag; never set here: no delta moves these in place)
        self._incoming: Mapping[str, torch.Tensor] | None = None

    # ----------------------------------------------------------------- upload

    def local_values(self) -> dict[str, torch.Tensor]:
        """This rank's part of the model as it is now: own rows, and (rank 0) the rest."""
        state = self.model.state_dict()
        names = self.layout.sharded + (self.layout.replicated if self.leader else [])
        return {name: _local(state[name]).detach() for name in names}

    def pseudo_gradient(self) -> dict[str, torch.Tensor]:
        """anchor - local of this rank's part (fp32, int64 for integer tensors)."""
        return pseudo_gradient(self.tensors, self.local_values())

    def gather_body(self, pieces: Mapping[str, torch.Tensor]) -> bytearray | None:
        """Rank 0: the safetensors body of the whole model from every rank's `pieces` (its
        rows of each sharded tensor, in the dtype they travel in; rank 0 also gives the
        replicated ones), with each rank's rows received straight into their place. Other
        ranks send and get None.

        Rank 0 plans and allocates the body before any rows move, and says whether that
        worked (`distributed.lead`), so a failure there reaches every rank as an error."""
        body = distributed.lead(lambda: self._new_body(pieces), lambda prepared: prepared)
        rows = self.layout.rows
        if not self.leader:
            for name in self.layout.sharded:
                if rows[name].counts[distributed.rank()]:
                    dist.send(_on_comm_device(pieces[name]), dst=0)
            return None
        buffer, views = body
        for name in self.layout.sharded:
            split = rows[name]
            for rank, (start, count) in enumerate(zip(split.starts, split.counts, strict=True)):
                if not count:
                    continue
                target = views[name][start : start + count]
                if rank == 0:
                    target.copy_(pieces[name])
                else:
                    _receive_into(target, src=rank)
        return buffer

    def _new_body(
        self, pieces: Mapping[str, torch.Tensor]
    ) -> tuple[bytearray, dict[str, torch.Tensor]]:
        """Rank 0's body for `pieces`: its header written, the replicated tensors in place."""
        rows = self.layout.rows
        entries = {name: (rows[name].shape, pieces[name].dtype) for name in self.layout.sharded}
        for name in self.layout.replicated:
            entries[name] = (tuple(pieces[name].shape), pieces[name].dtype)
        frame = FrameLayout.plan(entries)
        buffer = bytearray(frame.size)
        body = torch.frombuffer(buffer, dtype=torch.uint8)
        frame.write_header(body)
        views = frame.views(body)
        for name in self.layout.replicated:
            views[name].copy_(pieces[name])
        return buffer, views

    # ----------------------------------------------------------------- download

    def adopt(self, tensors: Mapping[str, torch.Tensor], round_number: int) -> None:
        """Rank 0 takes the server's full weights; `share` hands every rank its rows."""
        self._incoming = tensors
        self.round = round_number

    def share(self) -> None:
        """Every rank's shards (and the replicated tensors) become rank 0's new weights: in
        the model, and as this rank's fp32 CPU anchor. Rank 0 first checks that it has every
        tensor in its shape and says so (`distributed.lead`), before any rows move."""
        incoming, self._incoming = self._incoming, None
        distributed.lead(lambda: self._check_incoming(incoming), lambda _: None)
        state = self.model.state_dict()
        for name in self.layout.sharded:
            split = self.layout.rows[name]
            local = _local(state[name])
            if self.leader:
                assert incoming is not None
                full = incoming[name]
                for rank in range(1, len(split.counts)):
                    if split.counts[rank]:
                        part = full[split.starts[rank] : split.starts[rank] + split.counts[rank]]
                        dist.send(_on_comm_device(part.to(self._wire_dtype(local))), dst=rank)
                mine = full[: split.counts[0]]
            else:
                mine = torch.empty(local.shape, dtype=self._wire_dtype(local))
                if split.counts[distributed.rank()]:
                    _receive_into(mine, src=0)
            with torch.no_grad():
                local.copy_(mine)
            self._keep(name, mine)
        if self.leader:
            assert incoming is not None
            with torch.no_grad():
                for name in self.layout.replicated:
                    state[name].copy_(incoming[name])
                    self._keep(name, incoming[name])
        distributed.broadcast_tensors_({n: state[n] for n in self.layout.replicated})
        self.round = distributed.broadcast_json(self.round)

    def _check_incoming(self, incoming: Mapping[str, torch.Tensor] | None) -> None:
        """Rank 0: the server's weights hold every tensor of the model, in its shape."""
        assert incoming is not None, "share() before adopt()"
        state = self.model.state_dict()
        for name in self.layout.sharded + self.layout.replicated:
            if name not in incoming or tuple(incoming[name].shape) != tuple(state[name].shape):
                got = tuple(incoming[name].shape) if name in incoming else "nothing"
                raise ValueError(
                    f"the server's weights give tensor {name!r} {got}, the model has "
                    f"{tuple(state[name].shape)}"
                )

    def _keep(self, name: str, values: torch.Tensor) -> None:
        """`values` as this tensor's fp32 CPU anchor, in its old memory where it fits."""
        old = {name: self.tensors[name]} if name in self.tensors else {}
        self.tensors.update(updated_anchor(old, {name: values}))

    def _wire_dtype(self, local: torch.Tensor) -> torch.dtype:
        """The dtype a shard travels in from rank 0: the server's download dtype for floats."""
        return self.download_dtype if local.is_floating_point() else local.dtype


def _on_comm_device(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to(distributed.comm_device()).contiguous()


def _receive_into(target: torch.Tensor, src: int) -> None:
    """Receive a tensor of `target`'s shape and dtype from `src` into `target` (CPU memory)."""
    device = distributed.comm_device()
    if device.type == "cpu" and target.is_contiguous():
        dist.recv(target, src=src)
        return
    staging = torch.empty(target.shape, dtype=target.dtype, device=device)
    dist.recv(staging, src=src)
    target.copy_(staging)
