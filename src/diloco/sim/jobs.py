"""Several simulated runs, one after another in this process or side by side in child processes.

A tiny model does not get faster with a second torch thread, but two runs on two cores finish
in about the time of one: `--jobs 2` on a 2-core machine halves a sweep. Each child process is
`python -m diloco.sim.jobs CONFIG RESULT THREADS`: it reads its settings as JSON, trains, writes
its results as JSON, and prints `progress N` lines that the parent adds to one progress bar.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from diloco.sim.config import SimConfig
from diloco.sim.runner import prepare, run

Progress = Callable[[int], None]
PROGRESS_EVERY = 50  # inner steps between a child's progress lines


def threads_per_job(jobs: int) -> int:
    """Split this machine's cores between the jobs (at least one thread each)."""
    return max(1, (os.cpu_count() or 1) // jobs)


def run_configs(
    configs: Sequence[SimConfig],
    jobs: int = 1,
    progress: Progress | None = None,
    corpus: bytes | None = None,
) -> list[dict]:
    """Every run's `SimResult.to_json()`, in the order of `configs`.

    Settings must have been checked (`prepare`) by the caller. With jobs > 1 each run's corpus
    comes from its own `config.corpus` spec (cached on disk after the parent's first load).
    A child that fails raises RuntimeError with its last line of output.
    """
    advance = progress or (lambda _n: None)
    if jobs <= 1 or len(configs) <= 1:
        return [run(prepare(c, corpus), advance).to_json() for c in configs]
    results: list[dict | None] = [None] * len(configs)
    failures: list[str] = []
    lock = threading.Lock()
    pending = list(enumerate(configs))

    def worker(scratch: Path) -> None:
        while True:
            with lock:
                if not pending or failures:
                    return
                index, config = pending.pop(0)
            try:
                results[index] = _run_child(config, scratch / f"run{index}", jobs, advance, lock)
            except RuntimeError as exc:
                with lock:
                    failures.append(f"run {index + 1}: {exc}")

    with tempfile.TemporaryDirectory(prefix="diloco-sweep-") as scratch:
        threads = [
            threading.Thread(target=worker, args=(Path(scratch),), daemon=True)
            for _ in range(min(jobs, len(configs)))
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    if failures:
        raise RuntimeError(failures[0])
    return [r for r in results if r is not None]


def _run_child(
    config: SimConfig, stem: Path, jobs: int, advance: Progress, lock: threading.Lock
) -> dict:
    config_path, result_path = stem.with_suffix(".config.json"), stem.with_suffix(".result.json")
    config_path.write_text(json.dumps(config.to_dict()))
    command = [sys.executable, "-m", "diloco.sim.jobs", str(config_path), str(result_path)]
    log_path = stem.with_suffix(".log")
    with (
        log_path.open("w") as log,  # a file, not a pipe: a chatty child never blocks on it
        subprocess.Popen(
            [*command, str(threads_per_job(jobs))], stdout=subprocess.PIPE, stderr=log, text=True
        ) as child,
    ):
        assert child.stdout is not None
        for line in child.stdout:
            kind, _, count = line.partition(" ")
            if kind == "progress" and count.strip().isdigit():
                with lock:
                    advance(int(count))
    errors = log_path.read_text().strip().splitlines()
    if child.returncode != 0 or not result_path.exists():
        raise RuntimeError(errors[-1] if errors else f"exit code {child.returncode}")
    return json.loads(result_path.read_text())


def _child_main(config_path: str, result_path: str, threads: str) -> int:
    import torch

    torch.set_num_threads(int(threads))
    config = SimConfig.from_dict(json.loads(Path(config_path).read_text()))
    done = 0

    def report(n: int) -> None:
        nonlocal done
        done += n
        if done >= PROGRESS_EVERY:
            print(f"progress {done}", flush=True)
            done = 0

    try:
        result = run(prepare(config), report)
    except ValueError as exc:  # settings are checked by the parent; a corpus may still fail
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"progress {done}", flush=True)
    Path(result_path).write_text(json.dumps(result.to_json()))
    return 0


if __name__ == "__main__":
    sys.exit(_child_main(*sys.argv[1:4]))
