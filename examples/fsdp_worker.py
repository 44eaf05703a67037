"""One DiLoCo worker made of several GPUs (or CPU processes), with FSDP2 sharding the model.

    diloco server --sync-every 50
    torchrun --nproc-per-node 2 examples/fsdp_worker.py --server http://127.0.0.1:8470 \
        --steps 500   # on Shakespeare's plays (fetched once), or --corpus FILE
    # the same run with another wrap, to compare: --wrap ddp, or --wrap none without torchrun

Every rank trains its slice of each global batch; `fully_shard` splits every block and the
root over the group, and DiLoCoWorker sees DTensors: each rank computes the pseudo-gradient of
its own rows, and rank 0 relays them to the server and the new weights back, tensor by tensor.
The same global batches and seed give the same global weights under fsdp, ddp and none
(tests/integrations/test_fsdp_worker.py checks that). NCCL when CUDA is there, else gloo.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from diloco.data import BatchSampler, eval_batches, load_named_corpus, split_train_val
from diloco.models import GPTConfig
from diloco.training import make_inner_optimizer
from diloco.worker import DiLoCoWorker, ServerError, ServerUnavailable
from diloco.worker.parallel.distributed import LeaderFailed


def wrap(model: torch.nn.Module, how: str, device: torch.device) -> torch.nn.Module:
    """The model as the group trains it: FSDP2 shards, a DDP replica, or itself."""
    if how == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        return fully_shard(model)
    if how == "ddp":
        ids = [device.index] if device.type == "cuda" else None
        return torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)
    return model


def peak_rss_mb(distributed: bool) -> list[float]:
    """Every rank's peak resident memory so far, in MB (Linux reports ru_maxrss in KiB)."""
    mine = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if not distributed:
        return [mine]
    device = (
        torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    )
    value = torch.tensor([mine], dtype=torch.float64, device=device)
    everyone = [torch.empty_like(value) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, value)
    return [float(v) for v in everyone]


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model on the CPU (an FSDP model gathers its shards: every rank must call)."""
    state = {}
    for name, tensor in model.state_dict().items():
        full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
        state[name.removeprefix("module.")] = full.detach().cpu()
    return state


@torch.no_grad()
def eval_loss(spec: GPTConfig, model: torch.nn.Module, batches, device) -> float:
    model.eval()
    total = sum(float(spec.loss(model, x.to(device), y.to(device))) for x, y in batches)
    model.train()
    return total / len(batches)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", required=True)
    parser.add_argument("--worker-id", default=None)
    parser.add_argument("--wrap", choices=["fsdp", "ddp", "none"], default="fsdp")
    parser.add_argument("--corpus", default="shakespeare", help="a text file, or shakespeare")
    parser.add_argument("--steps", type=int, default=500, help="optimizer steps")
    parser.add_argument("--batch-size", type=int, default=8, help="global: split over ranks")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0, help="the same on every worker")
    parser.add_argument("--json", default=None, help="rank 0 writes the figures here")
    parser.add_argument("--state", action="store_true", help="and the final weights in --json")
    options = parser.parse_args()
    distributed = options.wrap != "none"
    if distributed:
        cuda = torch.cuda.is_available()
        dist.init_process_group("nccl" if cuda else "gloo")
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    rank = dist.get_rank() if distributed else 0
    ranks = dist.get_world_size() if distributed else 1
    device = torch.device("cuda", torch.cuda.current_device()) if distributed and cuda else None
    device = device or torch.device("cpu")
    try:
        if options.batch_size % ranks:
            raise ValueError(f"--batch-size {options.batch_size} must split over {ranks} ranks")
        split = split_train_val(load_named_corpus(options.corpus))
        val = eval_batches(split.val, options.batch_size, options.seq_len, 4)
        torch.manual_seed(options.seed)  # every rank and worker: the same initial weights
        spec = GPTConfig(context=options.seq_len, width=options.width, depth=options.depth,
                         heads=options.heads)  # fmt: skip
        model = wrap(spec.build().to(device), options.wrap, device)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    optimizer = make_inner_optimizer(model, options.lr, weight_decay=0.1)
    try:
        worker = DiLoCoWorker(model, optimizer, options.server, options.worker_id)
    except (ValueError, ServerError, ServerUnavailable, LeaderFailed) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    sampler = BatchSampler(split.train, options.batch_size, options.seq_len, options.seed)
    share = options.batch_size // ranks
    mine = slice(rank * share, (rank + 1) * share)
    initial = eval_loss(spec, model, val, device)
    started = time.monotonic()
    try:
        for _ in range(options.steps):
            x, y = sampler.next_batch()
            loss = spec.loss(model, x[mine].to(device), y[mine].to(device))
            loss.backward()
            optimizer.step()  # every H-th step syncs with the server
            optimizer.zero_grad()
            worker.report(float(loss.detach()))
        worker.close()
    except (ServerError, ServerUnavailable, LeaderFailed) as exc:
        print(f"error: the server failed us: {exc}", file=sys.stderr)
        return 1
    seconds = time.monotonic() - started
    peaks = peak_rss_mb(distributed)  # before the full state below is gathered for the report
    final = eval_loss(spec, model, val, device)
    state = full_state(model) if options.state else None  # every rank gathers, rank 0 keeps
    if rank == 0:
        stats = worker.stats()
        print(f"eval loss {initial:.4f} -> {final:.4f}, {stats['rounds']} rounds on {ranks} "
              f"rank(s) ({options.wrap})")  # fmt: skip
        if options.json:
            figures = {"wrap": options.wrap, "ranks": ranks, "initial_eval_loss": initial,
                       "final_eval_loss": final, "train_seconds": seconds,
                       "peak_rss_mb": peaks, "worker": stats,
                       "parameters": sum(t.numel() for t in model.state_dict().values()),
                       "state": state and {n: t.tolist() for n, t in state.items()}}  # fmt: skip
            Path(options.json).write_text(json.dumps(figures))
    if distributed:
        dist.barrier()
        dist.destroy_process_group()
        # gloo can abort a process at interpreter exit after DDP (tests/worker/ddp_worker_script.py)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
