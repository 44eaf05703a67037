"""Each process's thread budget: how many threads torch's CPU kernels may use.

torch starts as many threads as the machine has cores in every process. A server and K workers
on one machine then run (K + 1) x cores threads on cores cores, and OpenMP's threads spin while
they wait for the next parallel region, taking the cores the others need: measured on 2 cores
with a server and two workers of an 85.6M-parameter GPT (batch 1, context 16), an AdamW step
took about 1.0 s with each process at torch's default and about 0.4 s with one thread each. So
every process states its budget: `--threads` on `diloco server` and `diloco worker` (the
server's default is small; OMP_NUM_THREADS, when set, is respected), and the commands that
start several processes on one machine (the demo, the benchmarks) split its cores.
"""

from __future__ import annotations

import contextlib
import os

import torch

# The server's own work is memory-bound passes (fold, outer step, codecs, checksums): a few
# threads reach the memory bandwidth, more only add their overhead to every small op.
SERVER_DEFAULT_THREADS = 4


def machine_cores() -> int:
    """The cores this process may run on (its affinity mask; os.cpu_count() as a fallback)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def check_threads(threads: int | None, option: str = "--threads") -> None:
    """ValueError naming `option` unless `threads` is None or a positive integer."""
    if threads is None:
        return
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"{option} must be a positive integer, got {threads!r}")


def apply_thread_budget(threads: int | None) -> int:
    """Give torch's CPU kernels `threads` threads (None: leave torch's default) and return the
    number in effect. Inter-op threads are capped at the same number."""
    check_threads(threads)
    if threads is not None:
        torch.set_num_threads(threads)
        # fixed once any inter-op work has run; the intra-op count is what matters here
        with contextlib.suppress(RuntimeError):
            torch.set_num_interop_threads(threads)
    return torch.get_num_threads()


def server_threads(threads: int | None) -> int | None:
    """The server's budget: `threads`; else None (torch's default) where OMP_NUM_THREADS says
    what the operator wants; else SERVER_DEFAULT_THREADS capped at the cores."""
    if threads is not None:
        return threads
    if os.environ.get("OMP_NUM_THREADS"):
        return None
    return min(SERVER_DEFAULT_THREADS, machine_cores())


def split_cores(processes: int, cores: int | None = None) -> int:
    """Threads for each of `processes` processes sharing this machine (at least 1)."""
    return max(1, (cores or machine_cores()) // max(1, processes))
