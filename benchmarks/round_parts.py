"""Where a synchronous round's time goes: each part of the server's path, timed on its own.

For the same 25M-parameter fp32 state (100 MB) as benchmarks/wire.py, median of a few runs:
  - uvicorn receive / send: a bare ASGI app on uvicorn (uvloop, httptools, the server's malloc
    settings) reading a 100 MB POST, and answering a 100 MB GET that a urllib3 client reads into
    a reused buffer (another process) - the floor of any upload and download through uvicorn;
  - spool write: the received chunks (256 KB, as uvicorn delivers them) into a kept spool file;
  - checked fold: the round's first body checked and folded in one read of its file;
  - scan + fold: a later body, scanned (outside the lock), then added into the sums;
  - outer step: apply_running_mean (Nesterov), and one in-place pass over the same memory.
Writes benchmarks/results/round_parts.md and .json.

    python benchmarks/round_parts.py
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import platform
import socket
import statistics
import threading
import time
from pathlib import Path

import torch
import typer
import urllib3
import uvicorn

from diloco.algorithm import RunningMean
from diloco.console import check_output_path, fail, out, summary_table, write_json
from diloco.server.http.runner import return_large_frees_to_the_os
from diloco.wire import SpoolFiles, encode_tensors, spool_body
from wire import make_state, outer_step_against_memory_pass  # benchmarks/ is sys.path[0]

RESULTS = Path(__file__).parent / "results"
# Clients are new processes: a forked one would inherit the server's malloc settings, under
# which urllib3's 4 MB read buffers are page-faulted in on every read (about 2x slower).
CONTEXT = mp.get_context("spawn")
CHUNK = 256_000  # what uvloop hands uvicorn per socket read


def median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1000


def timed(function, repeats: int) -> list[float]:
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        function()
        samples.append(time.perf_counter() - started)
    return samples


# ------------------------------------------------------------------ uvicorn alone


def _uploader(port: int, size: int, repeats: int) -> None:
    body = os.urandom(size)
    pool = urllib3.PoolManager()
    for _ in range(repeats):
        pool.request("POST", f"http://127.0.0.1:{port}/", body=body)


def _downloader(port: int, size: int, repeats: int, times) -> None:
    pool = urllib3.PoolManager()
    inbox = bytearray(size)
    view = memoryview(inbox)
    for i in range(repeats):
        started = time.perf_counter()
        response = pool.request("GET", f"http://127.0.0.1:{port}/", preload_content=False)
        done = 0
        while done < size:
            done += response.readinto(view[done : done + 4 * 1024 * 1024])
        response.release_conn()
        times[i] = time.perf_counter() - started


def uvicorn_alone(body: bytes, repeats: int) -> dict:
    """Server-side receive time of each upload, client-side time of each download."""
    received: list[float] = []
    payload = memoryview(body)

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["method"] == "POST":
            started = time.perf_counter()
            while (await receive()).get("more_body"):
                pass
            received.append(time.perf_counter() - started)
            answer = b"ok"
        else:
            answer = payload
        length = str(len(answer)).encode()
        headers = [(b"content-length", length)]  # as Starlette's Response sets it
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": answer})

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        uploader = CONTEXT.Process(target=_uploader, args=(port, len(body), repeats))
        uploader.start()
        uploader.join()
        times = CONTEXT.Array("d", repeats)
        downloader = CONTEXT.Process(target=_downloader, args=(port, len(body), repeats, times))
        downloader.start()
        downloader.join()
    finally:
        server.should_exit = True
        thread.join(timeout=10)
    return {"receive_ms": median_ms(received), "send_ms": median_ms(list(times))}


# ------------------------------------------------------------------ the server's own parts


def server_parts(state: dict[str, torch.Tensor], repeats: int) -> dict:
    body = bytes(encode_tensors({n: t * 1e-3 for n, t in state.items()}))
    files = SpoolFiles()

    async def chunks():
        view = memoryview(body)
        for start in range(0, len(body), CHUNK):
            yield view[start : start + CHUNK]

    def spool():
        return asyncio.run(spool_body(chunks(), len(body), 1 << 40, files=files))

    spool().close()  # the kept file now exists, as after the server's first round
    write = timed(lambda: spool().close(), repeats)
    spooled = spool()
    shapes = {n: tuple(t.shape) for n, t in spooled.meta.items()}
    sums = {n: torch.empty_like(t) for n, t in state.items()}

    def checked_fold():
        reader = spooled.checked_pieces()
        RunningMean(storage=sums).add_pieces(shapes, reader, 1, max_abs=lambda: reader.bound)

    running = RunningMean(storage=sums)
    running.add_pieces(shapes, spooled.pieces(), 1)

    first = timed(checked_fold, repeats)
    scan = timed(spooled.check_values, repeats)
    fold = timed(lambda: running.add_pieces(shapes, spooled.pieces(), 1), repeats)
    spooled.close()

    outer = outer_step_against_memory_pass(state, repeats)  # wire.py's measurement
    return {
        "spool_write_ms": median_ms(write),
        "checked_fold_ms": median_ms(first),
        "scan_ms": median_ms(scan),
        "fold_ms": median_ms(fold),
        "outer_step_ms": outer["outer_step_seconds"] * 1000,
        "memory_pass_ms": outer["memory_pass_seconds"] * 1000,
    }


def main(
    parameters: int = typer.Option(25_000_000, help="Model size in fp32 parameters."),
    repeats: int = typer.Option(7, help="Runs per part (the median is reported)."),
    out_dir: Path = typer.Option(RESULTS, help="Where round_parts.md and .json go."),
) -> None:
    check_output_path(out_dir / "round_parts.json", "--out-dir")
    if parameters < 10 or repeats < 1:
        raise fail("--parameters must be >= 10 and --repeats >= 1")
    return_large_frees_to_the_os()  # as `diloco server` does
    torch.set_num_threads(1)
    state = make_state(parameters)
    body = bytes(encode_tensors(state))
    parts = {**uvicorn_alone(body, repeats), **server_parts(state, repeats)}
    labels = {
        "receive_ms": "uvicorn: receive one body (bare ASGI app)",
        "send_ms": "uvicorn: send one body, read by urllib3 into a reused buffer",
        "spool_write_ms": "spool write (kept file, 256 KB chunks)",
        "checked_fold_ms": "first body of a round: check and fold in one read",
        "scan_ms": "later body: scan (outside the lock)",
        "fold_ms": "later body: fold (add into the sums)",
        "outer_step_ms": "outer step (apply_running_mean, Nesterov, fused)",
        "memory_pass_ms": "one in-place pass over the model (add_)",
    }
    rows = [[labels[key], f"{value:.1f}"] for key, value in parts.items()]
    title = f"round parts: {parameters:,} fp32 parameters ({len(body) / 1e6:.0f} MB)"
    out.print(summary_table(title, ["part", "ms"], rows))
    document = {
        "parameters": parameters,
        "body_mb": len(body) / 1e6,
        "repeats": repeats,
        "parts_ms": parts,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "torch": torch.__version__,
    }
    write_json(out_dir / "round_parts.json", document)
    lines = [
        "# Round parts: each step of a synchronous round, timed on its own",
        "",
        f"Command: `python benchmarks/round_parts.py` ({parameters:,} fp32 parameters, "
        f"{len(body) / 1e6:.0f} MB; median of {repeats}; {document['machine']}, torch "
        f"{document['torch']}; one torch thread; everything on 127.0.0.1).",
        "",
        "| part | ms |",
        "|---|---|",
        *[f"| {label} | {ms} |" for label, ms in rows],
        "",
    ]
    (out_dir / "round_parts.md").write_text("\n".join(lines))


if __name__ == "__main__":
    typer.run(main)
