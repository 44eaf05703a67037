"""A torch.distributed group acting as one DiLoCo worker: rank 0 talks, the others follow.

Rank 0 broadcasts a status word before every payload, so an error on rank 0 (a server that
refused, a network that never came back) reaches every rank as an exception instead of leaving
them blocked in a collective. JSON travels as UTF-8 bytes in a uint8 tensor: no pickle.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from diloco.wire.format.specs import TensorSpec, first_difference

T = TypeVar("T")
_OK, _FAILED = 0, 1


class LeaderFailed(RuntimeError):
    """Raised on follower ranks when rank 0 failed; carries rank 0's message."""


def group_size() -> int:
    """World size when torch.distributed is initialized, else 1."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 1


def rank() -> int:
    return dist.get_rank() if group_size() > 1 else 0


def comm_device() -> torch.device:
    """Where tensors must be for the group's collectives (NCCL: the current GPU)."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def sum_over_group(value: int) -> int:
    """`value` summed over every rank of the group (each rank calls it); itself without one."""
    if group_size() == 1:
        return value
    total = torch.tensor([value], dtype=torch.int64, device=comm_device())
    dist.all_reduce(total)
    return int(total.item())


def _broadcast_bytes(payload: bytes | None) -> bytes:
    device = comm_device()
    size = torch.tensor(
        [len(payload) if payload is not None else 0], dtype=torch.int64, device=device
    )
    dist.broadcast(size, src=0)
    buffer = (
        torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
        if payload
        else torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    )
    if int(size.item()):
        dist.broadcast(buffer, src=0)
    return bytes(buffer.cpu().numpy().tobytes()) if int(size.item()) else b""


def lead(action: Callable[[], T], share: Callable[[T | None], Any]) -> Any:
    """Run `action` on rank 0 and `share` its result on every rank, propagating failure.

    Without a group this is just `share(action())`. With one, rank 0 runs `action`; a status
    word and, on failure, rank 0's message are broadcast; every rank then calls `share` with
    rank 0's result (None on followers), which must broadcast whatever the followers need.
    """
    if group_size() == 1:
        return share(action())
    result: T | None = None
    message = b""
    if rank() == 0:
        try:
            result = action()
        except BaseException as exc:
            message = f"{type(exc).__name__}: {exc}".encode()
            _broadcast_status(_FAILED, message)
            raise
        _broadcast_status(_OK, b"")
    else:
        status, message = _receive_status()
        if status != _OK:
            raise LeaderFailed(f"rank 0 of the DiLoCo worker failed: {message.decode()}")
    return share(result)


def _broadcast_status(status: int, message: bytes) -> None:
    word = torch.tensor([status], dtype=torch.int64, device=comm_device())
    dist.broadcast(word, src=0)
    if status != _OK:
        _broadcast_bytes(message)


def _receive_status() -> tuple[int, bytes]:
    word = torch.tensor([0], dtype=torch.int64, device=comm_device())
    dist.broadcast(word, src=0)
    status = int(word.item())
    return status, (_broadcast_bytes(None) if status != _OK else b"")


def broadcast_json(value: Any) -> Any:
    """Rank 0's JSON-serialisable value on every rank."""
    if group_size() == 1:
        return value
    payload = json.dumps(value).encode() if rank() == 0 else None
    return json.loads(_broadcast_bytes(payload).decode())


def broadcast_tensors_(tensors: dict[str, torch.Tensor]) -> None:
    """Overwrite every rank's tensors in place with rank 0's (names in the same order)."""
    if group_size() == 1:
        return
    for name in sorted(tensors):
        dist.broadcast(tensors[name], src=0)


def check_same_model(specs: Sequence[TensorSpec], sharded: bool) -> None:
    """Every rank of the group must hold the model rank 0 holds, sharded the same way (FSDP
    or not), else every rank raises.

    Checked once before any other collective: ranks that disagree would otherwise send
    tensors of other sizes and block each other forever. The rank that differs names the
    first differing tensor; the others name the rank.
    """
    if group_size() == 1:
        return
    # Exact dtypes (the wire's fingerprint counts every float as one): ranks in other
    # dtypes would send each other tensors of other byte sizes.
    exact = json.dumps(sorted([s.name, list(s.shape), str(s.dtype)] for s in specs)).encode()
    word = bytearray(hashlib.sha256(exact).digest()) + bytes([int(sharded)])
    mine = torch.frombuffer(word, dtype=torch.uint8).to(comm_device())
    everyone = [torch.empty_like(mine) for _ in range(group_size())]
    dist.all_gather(everyone, mine)
    differing = [r for r, other in enumerate(everyone) if not torch.equal(other, everyone[0])]
    if not differing:
        return
    ranks = ", ".join(map(str, differing))
    if all(torch.equal(other[:-1], everyone[0][:-1]) for other in everyone):
        raise ValueError(
            f"rank(s) {ranks} of the worker's group shard the model differently from rank 0 "
            f"(rank 0 {'does' if everyone[0][-1] else 'does not'} use FSDP); every rank must "
            "wrap the model the same way"
        )
    reference = broadcast_json([spec.to_json() for spec in specs] if rank() == 0 else None)
    if rank() in differing:
        expected = [TensorSpec.from_json(entry) for entry in reference]
        difference = first_difference(expected, list(specs)) or _first_dtype(expected, specs)
        raise ValueError(
            f"rank {rank()} of the worker's group holds another model than rank 0: "
            f"{difference}; every rank must build the same model"
        )
    raise ValueError(
        f"rank(s) {ranks} of the worker's group hold another model than rank 0 (see their "
        "error for the first difference); every rank must build the same model"
    )


def check_same_choice(name: str, chosen: bool) -> None:
    """Every rank of the group must make the same yes/no choice (an option that decides
    which collectives follow), else every rank raises naming the ranks that differ."""
    if group_size() == 1:
        return
    mine = torch.tensor([int(chosen)], dtype=torch.int64, device=comm_device())
    everyone = [torch.empty_like(mine) for _ in range(group_size())]
    dist.all_gather(everyone, mine)
    choices = [bool(flag.item()) for flag in everyone]
    if len(set(choices)) > 1:
        given = [r for r, flag in enumerate(choices) if flag]
        raise ValueError(
            f"{name} was given on rank(s) {', '.join(map(str, given))} only; every rank of "
            "the worker's group must be given it, or none"
        )


class ReplicasDiffer(RuntimeError):
    """The ranks of one (unsharded) worker trained apart: their weights differ."""


def check_replicas_agree(tensors: Mapping[str, torch.Tensor], step: int) -> None:
    """Every rank of an unsharded group must hold the same trained tensors (DDP averages the
    gradients, so the replicas stay bitwise equal); else every rank raises, naming the first
    tensor that differs. Called before each sync, on every rank.

    Ranks that train apart (a model DDP never wrapped; under torchrun, a transformers Trainer
    whose evaluate() ran before train() is one) would send rank 0's work alone and silently
    drop the others'. Each tensor is fingerprinted by the sum of its bits read as integers:
    exact, and the same whatever order a device sums in.
    """
    if group_size() == 1:
        return
    names = sorted(tensors)
    device = comm_device()
    mine = torch.zeros(len(names), dtype=torch.int64, device=device)
    for position, name in enumerate(names):
        mine[position] = _bits_sum(tensors[name]).to(device)
    leader = mine.clone()
    dist.broadcast(leader, src=0)
    differs = (mine != leader).to(torch.int64)
    dist.all_reduce(differs, op=dist.ReduceOp.MAX)  # every rank learns of any rank's
    if bool(differs.any()):
        first = names[int(differs.nonzero()[0])]
        raise ReplicasDiffer(
            f"the ranks of this DiLoCo worker hold different weights after local step {step} "
            f"(first: {first!r}): the group must train one replica, with gradients averaged "
            "across ranks (wrap the model in DistributedDataParallel; under torchrun, call a "
            "transformers Trainer's evaluate() only after train(), or it never wraps the model)"
        )


_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits_sum(tensor: torch.Tensor) -> torch.Tensor:
    """The sum (int64, wrapping) of a float tensor's bit patterns read as integers."""
    flat = tensor.detach().contiguous().reshape(-1)
    return flat.view(_BITS[flat.element_size()]).sum(dtype=torch.int64)


def _first_dtype(expected: Sequence[TensorSpec], got: Sequence[TensorSpec]) -> str:
    """The first tensor whose exact dtype differs (first_difference lets floats match)."""
    want = {spec.name: spec.dtype for spec in expected}
    for spec in sorted(got, key=lambda spec: spec.name):
        if want.get(spec.name) != spec.dtype:
            return f"tensor {spec.name!r} is {spec.dtype}, rank 0 has {want.get(spec.name)}"
    return "the models differ"
