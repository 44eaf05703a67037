"""Which of our source files one round runs through, from its first submission to the result.

A real server (the CLI's uvicorn server, in a thread of this process) with a state directory,
and K protocol workers (DiLoCoClient, in the main thread) that register, offer the initial
weights and then play rounds of each kind: a sync round, a streaming fragment round (two
fragments) and an async arrival. While a round runs, a profile hook on the server's threads
records every function of `diloco` that is called; the files it names are what a reader must
open to follow the round (issue 26 aims at 8 at most for a sync round, server side).
The client's own files are not counted: it runs on the main thread, which is not profiled.
Writes benchmarks/results/round_path.md and .json.

    python benchmarks/round_path.py [--out-dir DIR]
"""

from __future__ import annotations

import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import typer

import diloco
from diloco.console import check_output_path, out, summary_table, write_json
from diloco.server.coordinator import Coordinator
from diloco.server.http.runner import build_server
from diloco.server.settings import ServerSettings
from diloco.server.state.journal import RoundJournal
from diloco.server.state.store import StateStore
from diloco.wire import encode_tensors, specs_of
from diloco.worker.net.client import DiLoCoClient

RESULTS = Path(__file__).parent / "results"
PACKAGE = Path(diloco.__file__).resolve().parent
MODEL = {"embed": torch.zeros(64, 16), "block.weight": torch.zeros(16, 16), "head": torch.zeros(16)}
MODES = {
    "sync round": {"mode": "sync"},
    "streaming fragment round": {"mode": "streaming", "fragments": 2, "sync_every": 2},
    "async arrival": {"mode": "async"},
}


class FileRecorder:
    """The package's source files whose functions a server thread calls while it is on."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.functions: dict[str, set[str]] = defaultdict(set)
        self.on = False
        self.main = threading.get_ident()

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call" or not self.on or threading.get_ident() == self.main:
            return
        name = frame.f_code.co_filename
        if name.startswith(str(PACKAGE)):
            self.calls[str(Path(name).relative_to(PACKAGE))] += 1
            self.functions[str(Path(name).relative_to(PACKAGE))].add(frame.f_code.co_qualname)


def play(mode: str, settings: dict[str, Any], workers: int, state: Path) -> dict[str, Any]:
    """One run: join, then one round of `mode` with the files its server side ran through."""
    server_settings = ServerSettings(**settings)
    journal = RoundJournal(StateStore(state), server_settings)
    coordinator = Coordinator(server_settings, None, journal=journal)
    server = build_server(coordinator, "127.0.0.1", 0, None, log_level="warning")
    recorder = FileRecorder()
    threading.setprofile(recorder)
    thread = threading.Thread(target=server.run, name="round-path-server", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while server.bound_port is None:
            if time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        client = DiLoCoClient(f"http://127.0.0.1:{server.bound_port}", read_timeout=30)
        specs = [s.to_json() for s in specs_of(MODEL, dict.fromkeys(MODEL, "trainable"))]
        ids = [client.register(f"w{i}", specs)["worker_id"] for i in range(workers)]
        client.upload_initial(ids[0], encode_tensors(MODEL))
        gradient = encode_tensors({n: torch.full_like(t, 0.01) for n, t in MODEL.items()})
        fragment = 1 if settings.get("fragments", 1) > 1 else 0
        if fragment:  # a fragment's body holds its own tensors only
            plan = client.info()["fragment_plan"]
            names = plan[fragment]
            gradient = encode_tensors({n: torch.full_like(MODEL[n], 0.01) for n in names})
        recorder.on = True
        started = time.perf_counter()
        # an async arrival is one worker's submission, applied as one outer step
        for worker in ids[:1] if mode == "async" else ids:
            client.submit(0, worker, gradient, fragment=fragment, tokens=1)
        answer = client.wait_result(0, ids[0], fragment=fragment) if mode != "async" else None
        seconds = time.perf_counter() - started
        recorder.on = False
        client.close()
    finally:
        threading.setprofile(None)  # type: ignore[arg-type]
        server.should_exit = True
        thread.join(timeout=15)
    assert mode == "async" or answer is not None
    assert coordinator.version == 1, f"{mode}: the round did not step ({coordinator.version})"
    files = sorted(recorder.calls)
    return {
        "files": files,
        "functions": {f: sorted(recorder.functions[f]) for f in files},
        "by_folder": dict(Counter(str(Path(f).parent) for f in files)),
        "server_files": [f for f in files if f.startswith("server/")],
        "seconds": seconds,
    }


def main(
    workers: int = typer.Option(2, help="protocol workers (K)"),
    out_dir: Path = typer.Option(RESULTS, help="Where round_path.md and .json go."),
) -> None:
    check_output_path(out_dir / "round_path.json", "--out-dir")
    json_path = out_dir / "round_path.json"
    results: dict[str, Any] = {}
    for kind, settings in MODES.items():
        with tempfile.TemporaryDirectory() as state:
            results[kind] = play(settings["mode"], settings, workers, Path(state))
    rows = [
        [
            kind,
            str(len(r["server_files"])),
            str(len(r["files"])),
            ", ".join(f"{k} {v}" for k, v in sorted(r["by_folder"].items())),
        ]
        for kind, r in results.items()
    ]
    out.print(
        summary_table(
            "Files one round runs through", ["round", "server/", "all", "by folder"], rows
        )
    )
    write_json(json_path, {"workers": workers, "rounds": results})
    lines = [
        "# Files one round runs through (server side)",
        "",
        "`python benchmarks/round_path.py`: a real server with a state directory, "
        f"{workers} protocol workers, one round of each kind; every `diloco` file whose "
        "functions a server thread calls between the first submission and the result.",
        "",
        "| round | server/ files | all files |",
        "|---|---|---|",
        *[
            f"| {kind} | {len(r['server_files'])} | {len(r['files'])} |"
            for kind, r in results.items()
        ],
        "",
    ]
    for kind, r in results.items():
        lines += [f"## {kind}", "", *[f"- `{f}`" for f in r["files"]], ""]
    json_path.with_suffix(".md").write_text("\n".join(lines))


if __name__ == "__main__":
    sys.setrecursionlimit(10_000)
    typer.run(main)
