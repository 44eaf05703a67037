"""Run under torchrun by test_worker_distributed.py: a DDP process group as one DiLoCo worker."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from diloco.worker import DiLoCoWorker


def main(url: str, token: str, steps: int, wrap: str) -> None:
    """`wrap` "ddp", or "none": each rank trains its own copy (what no group may do)."""
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    ddp = torch.nn.parallel.DistributedDataParallel(model) if wrap == "ddp" else model
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    worker = DiLoCoWorker(ddp, optimizer, url, worker_id="group", token=token or None)
    generator = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        x = torch.randn(8, 4, generator=generator)
        ddp(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    worker.close()
    state = {name: t.tolist() for name, t in model.state_dict().items()}
    report = {"rank": rank, "rounds": worker.stats()["rounds"], "state": state}
    print(json.dumps(report), flush=True)
    dist.barrier()  # both ranks leave together; gloo may abort a rank that is torn down early
    dist.destroy_process_group()
    # torch 2.13 (CPU): a process that ran DDP over gloo aborts now and then at interpreter exit,
    # after all of the above ("terminate called without an active exception"), with or without
    # diloco: a bare DDP script did so in 2-4 of 10 runs on a loaded 2-core machine, and in 0 of
    # 10 without DDP or when it leaves through os._exit. The run's outcome is printed already.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] if len(sys.argv) > 4 else "ddp")
