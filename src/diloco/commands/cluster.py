"""`diloco cluster`: S shard servers on this machine, started and stopped as one."""

from __future__ import annotations

import signal
import threading
from pathlib import Path

import typer
from rich.table import Table

from diloco.console import err, fail
from diloco.server.ops.launch import start_shards, stop_process


def cluster_command(
    ctx: typer.Context,
    shards: int = typer.Option(2, help="How many shard servers (each owns part of the model)."),
    state_dir: Path = typer.Option(
        ..., help="Each shard's state goes to DIR/shard-I; restarting on it resumes the run."
    ),
    log_dir: Path = typer.Option(
        None, help="Each shard's log goes to DIR/shard-I.log (default: the state dir, if any)."
    ),
) -> None:
    """Start SHARDS `diloco server --shard I` processes on 127.0.0.1; every other option
    (after the ones above) goes to each shard, e.g. `diloco cluster --shards 4 --sync-every
    50 --init model.safetensors`. Workers need one shard's URL. Ctrl-C stops them all.

    On several machines, run `diloco server --shard I --shard-url URL0 --shard-url URL1 ...`
    on each instead (docs/architecture.md, "Sharded servers")."""
    if not 2 <= shards <= 64:
        raise fail(f"--shards must be in [2, 64], got {shards}")
    for option in ("--shard", "--shard-url", "--port", "--port-file", "--host", "--state-dir"):
        if any(arg == option or arg.startswith(f"{option}=") for arg in ctx.args):
            raise fail(f"{option} is set by `diloco cluster` for each shard; leave it out")
    logs = log_dir or state_dir
    for directory, option in ((state_dir, "--state-dir"), (logs, "--log-dir")):
        if directory is not None:
            try:
                directory.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise fail(f"{option} {directory} cannot be created ({exc.strerror})") from None
    work = logs or Path.cwd()

    def per_shard(shard: int) -> tuple[str, ...]:
        return ("--state-dir", str(state_dir / f"shard-{shard}"))

    def output(shard: int):
        return (logs / f"shard-{shard}.log").open("ab") if logs is not None else None

    for stale in work.glob("shard-*.port"):
        stale.unlink()
    try:
        started = start_shards(work, shards, *ctx.args, per_shard=per_shard, output=output)
    except RuntimeError as exc:
        where = f" (logs in {logs})" if logs is not None else ""
        raise fail(f"a shard did not start: {exc}{where}") from None
    table = Table(title=f"diloco cluster: {shards} shards")
    table.add_column("shard")
    table.add_column("URL")
    table.add_column("pid")
    for shard, (process, url) in enumerate(started):
        table.add_row(str(shard), url, str(process.pid))
    err.print(table)
    err.print(f"workers: diloco worker --server {started[0][1]} ...   (Ctrl-C stops the cluster)")
    stop = threading.Event()
    previous = {
        sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        while not stop.wait(0.5):
            ended = [i for i, (process, _) in enumerate(started) if process.poll() is not None]
            if ended:
                err.print(
                    f"shard {ended[0]} exited (code {started[ended[0]][0].returncode}); stopping"
                )
                break
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for process, _ in reversed(started):
            stop_process(process)
        for shard in range(shards):
            (work / f"shard-{shard}.port").unlink(missing_ok=True)
    codes = [process.returncode for process, _ in started]
    err.print(f"cluster stopped; shard exit codes {codes}")
    if stop.is_set() is False:
        raise typer.Exit(1)
