"""Streaming DiLoCo (Douillard et al. 2025): fragments, their sync schedule, and the merge.

The model is split into P fragments that sync on staggered schedules, so peak bandwidth drops
by P; with a delay tau the transfer of a fragment overlaps tau inner steps, and the arriving
global values are mixed with the local ones that kept training meanwhile.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise

import torch

from diloco.algorithm._checks import require_fraction, require_int_at_least
from diloco.algorithm.tensors import TensorDict


def _check_tensor_sizes(tensor_sizes: Sequence[tuple[str, int]]) -> None:
    seen: set[str] = set()
    for name, numel in tensor_sizes:
        if name in seen:
            raise ValueError(f"tensor {name!r} is listed twice")
        if numel < 0:
            raise ValueError(f"tensor {name!r} has a negative size {numel}")
        seen.add(name)


def _block_of(name: str, block_prefixes: Sequence[str]) -> int | None:
    """Index of the longest prefix `name` starts with ("blocks.1" must not claim "blocks.10.")."""
    best: int | None = None
    for index, prefix in enumerate(block_prefixes):
        if name.startswith(prefix) and (best is None or len(prefix) > len(block_prefixes[best])):
            best = index
    return best


def _plan_strided(
    tensor_sizes: Sequence[tuple[str, int]], num_fragments: int, block_prefixes: Sequence[str]
) -> list[list[int]]:
    if not 1 <= num_fragments <= len(block_prefixes):
        raise ValueError(
            f"fragments must be in [1, {len(block_prefixes)}] (the number of blocks), "
            f"got {num_fragments}"
        )
    members: list[list[int]] = [[] for _ in range(num_fragments)]
    loads = [0] * num_fragments
    outside: list[int] = []
    blocks_seen: set[int] = set()
    for position, (name, numel) in enumerate(tensor_sizes):
        block = _block_of(name, block_prefixes)
        if block is None:
            outside.append(position)
            continue
        blocks_seen.add(block)
        members[block % num_fragments].append(position)
        loads[block % num_fragments] += numel
    empty_blocks = [p for i, p in enumerate(block_prefixes) if i not in blocks_seen]
    if empty_blocks:
        raise ValueError(f"block prefixes match no tensor: {empty_blocks}")
    for position in outside:
        lightest = min(range(num_fragments), key=lambda f: (loads[f], f))
        members[lightest].append(position)
        loads[lightest] += tensor_sizes[position][1]
    return [sorted(positions) for positions in members]


def _plan_contiguous(
    tensor_sizes: Sequence[tuple[str, int]], num_fragments: int
) -> list[list[int]]:
    count = len(tensor_sizes)
    if not 1 <= num_fragments <= count:
        raise ValueError(
            f"fragments must be in [1, {count}] (the number of tensors), got {num_fragments}"
        )
    cumulative = [0]
    for _, numel in tensor_sizes:
        cumulative.append(cumulative[-1] + numel)
    total = cumulative[-1]
    cuts = [0]
    for k in range(1, num_fragments):
        target = k * total / num_fragments
        # Leave at least one tensor for each fragment still to come.
        candidates = range(cuts[-1] + 1, count - (num_fragments - k) + 1)
        cuts.append(min(candidates, key=lambda j: (abs(cumulative[j] - target), j)))
    cuts.append(count)
    return [list(range(start, end)) for start, end in pairwise(cuts)]


# Where models keep their repeated blocks: ours, GPT-2 (`transformer.h`), Llama (`model.layers`).
BLOCK_CONTAINERS = ("blocks", "transformer.h", "model.layers", "layers")


def block_prefixes_from_names(names: Sequence[str]) -> list[str]:
    """The repeated blocks' prefixes ("blocks.0.", ...) read off state-dict names alone.

    For a server that knows a model only by its tensor names: the first container of
    BLOCK_CONTAINERS whose indices 0..n-1 all hold tensors gives n prefixes, so the plan equals
    the one built from the module (`diloco.models.block_prefixes`). [] when no container fits.
    """
    for container in BLOCK_CONTAINERS:
        head = container + "."
        indices: set[int] = set()
        for name in names:
            if name.startswith(head):
                index, dot, _ = name[len(head) :].partition(".")
                if dot and index.isdigit() and (index == "0" or not index.startswith("0")):
                    indices.add(int(index))
        if indices and indices == set(range(len(indices))):
            return [f"{head}{i}." for i in range(len(indices))]
    return []


def plan_fragments(
    tensor_sizes: Sequence[tuple[str, int]],
    num_fragments: int,
    block_prefixes: Sequence[str] | None = None,
) -> list[list[str]]:
    """Split tensor names (given as (name, numel) in model order) into `num_fragments` lists.

    With `block_prefixes` (the repeated blocks, in order) block i goes to fragment i % P, strided
    as in the paper, and tensors outside every block go, in model order, to the fragment with the
    fewest parameters so far (ties: lowest index). Without, the model is cut into P contiguous
    runs, each cut placed where the running parameter count is closest to k * total / P. Every
    name lands in exactly one fragment; each fragment keeps model order.
    """
    require_int_at_least("fragments", num_fragments, 1)
    _check_tensor_sizes(tensor_sizes)
    if block_prefixes:
        plan = _plan_strided(tensor_sizes, num_fragments, block_prefixes)
    else:
        plan = _plan_contiguous(tensor_sizes, num_fragments)
    return [[tensor_sizes[position][0] for position in positions] for positions in plan]


@dataclass(frozen=True)
class StreamingSchedule:
    """When each fragment is sent and merged, counted in inner optimizer steps t >= 1.

    Within every cycle of H = `sync_every` steps, fragment f owns the window of S = H / P steps
    ending at (f + 1) * S: it is sent tau = `delay` steps before the window ends and merged at
    its end. With P = 3 and H = 600 the merges fall at 200, 400, 600, then 800, ...
    """

    sync_every: int
    num_fragments: int
    delay: int = 0

    def __post_init__(self) -> None:
        require_int_at_least("sync_every H", self.sync_every, 1)
        require_int_at_least("fragments P", self.num_fragments, 1)
        if self.num_fragments > self.sync_every:
            raise ValueError(
                f"fragments P must be <= sync_every H, got P = {self.num_fragments}, "
                f"H = {self.sync_every}"
            )
        if self.sync_every % self.num_fragments != 0:
            raise ValueError(
                f"sync_every H must be divisible by fragments P, got H = {self.sync_every}, "
                f"P = {self.num_fragments}"
            )
        delay_ok = isinstance(self.delay, int) and not isinstance(self.delay, bool)
        if not delay_ok or not 0 <= self.delay < self.window:
            raise ValueError(
                f"delay tau must be in [0, S) with S = H / P = {self.window}, got {self.delay!r}"
            )

    @property
    def window(self) -> int:
        """S = H / P, the steps between two consecutive fragment merges."""
        return self.sync_every // self.num_fragments

    def _check_step(self, t: int) -> None:
        require_int_at_least("step t", t, 1)

    def _check_fragment(self, fragment: int) -> None:
        if not isinstance(fragment, int) or not 0 <= fragment < self.num_fragments:
            raise ValueError(f"fragment must be in [0, {self.num_fragments - 1}], got {fragment!r}")

    def send_offset(self, fragment: int) -> int:
        """Step within a cycle, in [0, H), at which `fragment` is sent."""
        self._check_fragment(fragment)
        return (fragment * self.window + self.window - self.delay) % self.sync_every

    def merge_offset(self, fragment: int) -> int:
        """Step within a cycle, in [0, H), at which `fragment` is merged."""
        self._check_fragment(fragment)
        return ((fragment + 1) * self.window) % self.sync_every

    def fragments_sent_at(self, t: int) -> list[int]:
        """Fragments to send once t inner steps are done."""
        self._check_step(t)
        phase = t % self.sync_every
        return [f for f in range(self.num_fragments) if self.send_offset(f) == phase]

    def fragments_merged_at(self, t: int) -> list[int]:
        """Fragments whose global values are merged once t inner steps are done."""
        self._check_step(t)
        phase = t % self.sync_every
        return [f for f in range(self.num_fragments) if self.merge_offset(f) == phase]

    def merge_step_for_send(self, fragment: int, t_send: int) -> int:
        """The step at which the send of `fragment` at step `t_send` is merged (t_send + tau)."""
        if fragment not in self.fragments_sent_at(t_send):
            raise ValueError(f"fragment {fragment} is not sent at step {t_send}")
        return t_send + self.delay


def alpha_merge(
    global_state: Mapping[str, torch.Tensor], local: Mapping[str, torch.Tensor], alpha: float
) -> TensorDict:
    """theta = (1 - alpha) * G' + alpha * L for every name of `global_state`.

    Computed in float32 on the local tensor's device, returned in the local tensor's dtype.
    Buffers follow the apply policy: an int buffer's mix is rounded half to even (computed in
    float64, exact for any int32 and for int64 up to 2**53), a bool buffer is True when its
    mix is >= 0.5. `local` may hold more names (the whole model while G' is one fragment);
    extra names are ignored. alpha 0 takes the global values, alpha 1 keeps the local ones.
    A floating tensor at alpha 0 is G' itself in the local dtype (no arithmetic: the signs
    of its zeros stand, a non-finite local value does not leak in as 0 * L, and no temporary
    is made when the dtype and device already match).
    """
    alpha = require_fraction("alpha", alpha, include_one=True)
    merged: TensorDict = {}
    for name, global_tensor in global_state.items():
        local_tensor = local.get(name)
        if local_tensor is None:
            raise ValueError(f"tensor {name!r} is in the global state but not local")
        if tuple(global_tensor.shape) != tuple(local_tensor.shape):
            raise ValueError(
                f"tensor {name!r} has shape {tuple(global_tensor.shape)} globally "
                f"and {tuple(local_tensor.shape)} locally"
            )
        exact = not local_tensor.is_floating_point()
        if alpha == 0.0 and not exact:
            merged[name] = global_tensor.detach().to(
                device=local_tensor.device, dtype=local_tensor.dtype
            )
            continue
        work = torch.float64 if exact else torch.float32
        mixed = global_tensor.detach().to(device=local_tensor.device, dtype=work)
        mixed = mixed.mul(1 - alpha).add_(local_tensor.detach().to(work), alpha=alpha)
        if local_tensor.dtype == torch.bool:
            merged[name] = mixed >= 0.5
        elif exact:
            merged[name] = mixed.round_().to(local_tensor.dtype)
        else:
            merged[name] = mixed.to(local_tensor.dtype)
    return merged
