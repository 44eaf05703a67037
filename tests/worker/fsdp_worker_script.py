"""Run under torchrun by test_worker_fsdp.py (or alone with `plain`): an FSDP2 group as one
DiLoCo worker, on a model whose last layer has one row (so rank 1 holds none of it) and an
int64 buffer that counts forward passes (a replicated tensor beside the shards).

Each rank writes OUT/rank-N.json: its rank, its error (or null), and after a run the whole model
(files, not stdout: the ranks' lines would interleave on one pipe).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from diloco.worker import DiLoCoWorker


class Tiny(nn.Module):
    def __init__(self, rank: int, hidden: int = 7) -> None:
        super().__init__()
        self.first = nn.Linear(5, hidden)
        self.last = nn.Linear(hidden, 1)  # one row: rank 1 of 2 holds nothing of it
        self.register_buffer("seen", torch.zeros((), dtype=torch.int64))
        self.count = 1 + 100 * rank  # ranks count differently: only rank 0's value may last

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen += self.count
        return self.last(torch.relu(self.first(x)))


def build(variant: str, rank: int) -> nn.Module:
    torch.manual_seed(0)
    model = Tiny(rank, hidden=8 if variant == "disagree" and rank == 1 else 7)
    if variant == "dtype" and rank == 1:
        model = model.double()
    if variant == "plain" or (variant == "half" and rank == 1):
        return model
    from torch.distributed.fsdp import fully_shard

    if variant == "hsdp":  # replicate over one dim, shard over the other: not fully_shard's rows
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("replicate", "shard"))
        return fully_shard(model, mesh=mesh)
    fully_shard(model.first)
    fully_shard(model.last)
    return fully_shard(model)


def full_state(model: nn.Module) -> dict[str, list]:
    state = {}
    for name, tensor in model.state_dict().items():
        full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
        state[name] = full.tolist()
    return state


def main(url: str, variant: str, steps: int, out: Path) -> None:
    grouped = variant != "plain"
    if grouped:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if grouped else 0
    ranks = dist.get_world_size() if grouped else 1
    model = build(variant, rank)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    report: dict = {"rank": rank, "error": None}
    checkpoints = out / "checkpoint" if variant == "checkpoint" else None
    try:
        worker = DiLoCoWorker(model, optimizer, url, worker_id="group", heartbeat=False,
                              checkpoint_dir=checkpoints)  # fmt: skip
        generator = torch.Generator().manual_seed(100)  # the same global batches everywhere
        share = 12 // ranks
        for _ in range(steps):
            x = torch.randn(12, 5, generator=generator)[rank * share : (rank + 1) * share]
            model(x.to(next(model.parameters()).dtype)).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        worker.close()
        report["rounds"] = worker.stats()["rounds"]
        report["state"] = full_state(model)
    except Exception as exc:  # every rank reports what it raised, for the test to compare
        report["error"] = f"{type(exc).__name__}: {exc}"
    (out / f"rank-{rank}.json").write_text(json.dumps(report))
    if grouped:
        os._exit(0)  # no barrier: after a failed start the ranks may not be in step


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), Path(sys.argv[4]))
