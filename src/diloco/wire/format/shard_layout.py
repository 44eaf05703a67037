"""Which tensors each server shard owns: the one layout every shard and worker computes.

Sharded servers (issue 15) split the model by whole tensors, balanced by the bytes of their
fp32 masters (`algorithm/shards.py::assign_shards`). The layout depends only on the tensor
specs in their order and the shard count, so a worker and every shard compute the same one
from the same model, and a body is split or joined by name alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from diloco.algorithm.shards import assign_shards
from diloco.wire.format.specs import TensorSpec


def master_bytes(spec: TensorSpec) -> int:
    """Bytes of the tensor's master on a server: fp32 for floats, its own dtype otherwise."""
    numel = 1
    for size in spec.shape:
        numel *= int(size)
    itemsize = 4 if spec.dtype.is_floating_point else torch.empty((), dtype=spec.dtype).itemsize
    return numel * itemsize


def shard_layout(specs: Sequence[TensorSpec], shards: int) -> list[list[str]]:
    """The names of the tensors each of `shards` shards owns, in spec order within a shard.

    Units are taken in name order, so the layout depends on the set of tensors only: a
    worker's state_dict order and an --init file's order give the same one."""
    by_name = sorted(specs, key=lambda spec: spec.name)
    owned = assign_shards([master_bytes(spec) for spec in by_name], shards)
    order = {spec.name: index for index, spec in enumerate(specs)}
    return [
        sorted((by_name[index].name for index in indices), key=order.__getitem__)
        for indices in owned
    ]


def split_by_layout(
    tensors: Mapping[str, torch.Tensor], layout: Sequence[Sequence[str]]
) -> list[dict[str, torch.Tensor]]:
    """`tensors` cut into each shard's part (views, no copies); a name outside the layout, or
    one the layout names and `tensors` lacks, is a ValueError naming it."""
    known = {name for names in layout for name in names}
    stray = sorted(set(tensors) - known)
    if stray:
        raise ValueError(f"tensor {stray[0]!r} is owned by no shard of the layout")
    missing = sorted(known - set(tensors))
    if missing:
        raise ValueError(f"tensor {missing[0]!r} of the layout is missing")
    return [{name: tensors[name] for name in names} for names in layout]


def fragment_shards(
    plan: Sequence[Sequence[str]], specs: Sequence[TensorSpec], shards: int
) -> list[int]:
    """Streaming mode: the shard that owns each fragment of `plan` whole, balanced by the
    fp32 bytes of the fragments (in plan order), so that a fragment's round lives on one
    shard and commits there alone."""
    size = {spec.name: master_bytes(spec) for spec in specs}
    owned = assign_shards([sum(size[name] for name in names) for names in plan], shards)
    owner = [0] * len(plan)
    for shard, fragments in enumerate(owned):
        for fragment in fragments:
            owner[fragment] = shard
    return owner


def shard_fragment_plan(
    plan: Sequence[Sequence[str]], specs: Sequence[TensorSpec], shards: int, shard: int
) -> list[list[str]]:
    """Shard `shard`'s view of the whole model's fragment plan: its own fragments' names, and
    an empty list for every fragment another shard owns (fragment numbers stay the run's)."""
    owner = fragment_shards(plan, specs, shards)
    return [list(names) if owner[f] == shard else [] for f, names in enumerate(plan)]
