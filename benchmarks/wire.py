"""Wire benchmark: a DiLoCo round through the real server against raw TCP and gloo all_reduce.

For a 25M-parameter fp32 state (100 MB) and K = 1, 2, 4 concurrent workers it measures, in one
run on 127.0.0.1:
  (a) one round through `diloco server`: every worker pushes its pseudo-gradient and pulls the
      new global weights (the worker's encode is done before the clock starts);
  (b) a raw loopback TCP transfer of the same bytes: each of K clients sends 100 MB to one
      server process and receives 100 MB back;
  (c) torch.distributed gloo all_reduce of the same tensor between K processes;
  (d) per codec pair (--codecs UPLOAD/DOWNLOAD), a round as a real worker sees it: every
      round a new pseudo-gradient becomes its upload body (`UploadCoder`, error feedback
      included), and the answer is applied to the worker's fp32 anchor (`apply_delta` for a
      coded delta, a copy out of full weights otherwise), all inside the clock; with the bytes
      each worker sent and received per round (the client's counters), where the time went
      (encode, submit, wait, apply; the server's commit from its /metrics) and the server's
      peak memory;
plus the server's peak resident memory per K (VmHWM) against the model's fp32 size, and the
outer step (the coordinator's apply_running_mean with Nesterov, and apply_mean beside it)
against one in-place pass over the same memory. Writes benchmarks/results/wire.md and .json.

    python benchmarks/wire.py                      # full (about 5-10 minutes on 2 cores)
    python benchmarks/wire.py --parameters 1000000 --workers 1,2 --rounds 2 --out-dir /tmp/w
    python benchmarks/wire.py --codecs fp32/fp32,int8/int8,topk:0.03+int2/int8
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import platform
import socket
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
import typer
from safetensors.torch import save_file

from diloco.algorithm import (
    Contribution,
    OuterOptimizer,
    RunningMean,
    apply_mean,
    apply_running_mean,
)
from diloco.algorithm.tensors import finite_bound
from diloco.console import (
    check_output_path,
    err,
    fail,
    number_list,
    out,
    summary_table,
    write_json,
)
from diloco.server.ops.launch import start_server, stop_process
from diloco.wire import encode_tensors, specs_of
from diloco.worker import DiLoCoClient, RetryPolicy
from wire_codecs import (  # benchmarks/ is sys.path[0]
    CODEC_COLUMNS,
    DEFAULT_CODECS,
    PHASES,
    codec_pairs,
    codec_row,
    codec_worker,
    project_onto_links,
    projection_table,
    server_metric,
    target_line,
)

RESULTS = Path(__file__).parent / "results"
TENSORS = 10
CONTEXT = mp.get_context("fork")  # children inherit the tensors; nothing is pickled


def make_state(parameters: int, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    per = parameters // TENSORS
    return {f"layer{i}.weight": torch.randn(per, generator=generator) for i in range(TENSORS)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def timed_group(target, make_args, workers: int, rounds: int, others=()) -> dict:
    """Run `workers` processes of `target`; each writes its round times into a shared array.

    A round's time is the slowest process's (everyone must be done); the median is reported.
    `others` are extra processes (a server) joined after the group.
    """
    times = CONTEXT.Array("d", rounds * 8)
    group = [CONTEXT.Process(target=target, args=(*make_args(i), times)) for i in range(workers)]
    for process in group:
        process.start()
    for process in [*group, *others]:
        process.join(timeout=900)
        if process.exitcode != 0:
            raise RuntimeError(f"a benchmark process failed (exit {process.exitcode})")
    per_round = [max(times[r * 8 + i] for i in range(workers)) for r in range(rounds)]
    return {"round_seconds": per_round, "median_round_seconds": statistics.median(per_round)}


# ------------------------------------------------------------------ (a) the real server


def _server(
    init: Path | None, workers: int, scratch: Path, memory_bodies: int = 0, *codec_args: str
) -> tuple[subprocess.Popen, str]:
    port_file = Path(tempfile.mkdtemp(dir=scratch)) / "port"
    return start_server(
        port_file,
        *(["--init", str(init)] if init is not None else []),
        *codec_args,
        "--min-workers",
        str(workers),
        "--memory-bodies",
        str(memory_bodies),
        "--sync-every",
        "1",
        "--heartbeat-interval",
        "60",
        "--heartbeat-timeout",
        "600",
    )


def _memory_kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _round_worker(url, index, state, rounds, barrier, times) -> None:
    torch.set_num_threads(1)
    specs = [s.to_json() for s in specs_of(state, dict.fromkeys(state, "trainable"))]
    gradient = {n: t * 1e-3 for n, t in state.items()}
    body = encode_tensors(gradient)
    with DiLoCoClient(url, retry=RetryPolicy(attempts=3), read_timeout=600) as client:
        worker_id = client.register(f"bench{index}", specs)["worker_id"]
        weights, _ = client.get_weights()
        for r in range(rounds):
            barrier.wait()
            started = time.perf_counter()
            client.submit(r, worker_id, body)
            # As DiLoCoWorker does: the new weights land in the last round's buffer.
            while (got := client.wait_result(r, worker_id, wait=60, into=weights)) is None:
                pass
            weights = got.body
            times[r * 8 + index] = time.perf_counter() - started


def runtime_baseline_mb(scratch: Path) -> float:
    """RSS of a server with no model: the interpreter, torch and the web stack."""
    process, _ = _server(None, 1, scratch)
    try:
        time.sleep(1.0)
        return _memory_kb(process.pid, "VmRSS") / 1024
    finally:
        stop_process(process)


def server_rounds(
    init: Path, state, workers: int, rounds: int, scratch: Path, memory_bodies: int
) -> dict:
    process, url = _server(init, workers, scratch, memory_bodies)
    try:
        idle_kb = _memory_kb(process.pid, "VmRSS")
        barrier = CONTEXT.Barrier(workers)
        timing = timed_group(
            _round_worker, lambda i: (url, i, state, rounds, barrier), workers, rounds
        )
        peak_kb = _memory_kb(process.pid, "VmHWM")
    finally:
        stop_process(process)
    return {
        **timing,
        "server_idle_rss_mb": idle_kb / 1024,
        "server_peak_rss_mb": peak_kb / 1024,
    }


# ------------------------------------------------------------------ (d) codecs, worker work in


def codec_rounds(
    init: Path,
    state,
    workers: int,
    rounds: int,
    scratch: Path,
    memory_bodies: int,
    pair: tuple[str, str],
    codec_args: list[str],
) -> dict:
    upload, download = pair
    args = ["--upload-codec", upload, "--download-codec", download, *codec_args]
    process, url = _server(init, workers, scratch, memory_bodies, *args)
    names = [*PHASES, "up_bytes", "down_bytes", "up_body", "down_body", "delta"]
    shared = {name: CONTEXT.Array("d", rounds * 8) for name in names}
    shared["anchor_equal"] = CONTEXT.Array("d", 8)
    try:
        barrier = CONTEXT.Barrier(workers)
        timing = timed_group(
            codec_worker, lambda i: (url, i, state, rounds, barrier, shared), workers, rounds
        )
        peak_kb = _memory_kb(process.pid, "VmHWM")
        commit_s = server_metric(url, "diloco_outer_step_seconds_sum")
        commits = server_metric(url, "diloco_outer_step_seconds_count")
    finally:
        stop_process(process)

    def each(name: str) -> list[float]:
        return [shared[name][r * 8 + i] for r in range(rounds) for i in range(workers)]

    return {
        "upload_codec": upload,
        "download_codec": download,
        "workers": workers,
        **timing,
        "phase_median_seconds": {phase: statistics.median(each(phase)) for phase in PHASES},
        "server_commit_mean_seconds": commit_s / commits if commits else None,
        "up_bytes_per_worker_round": statistics.median(each("up_bytes")),
        "down_bytes_per_worker_round": statistics.median(each("down_bytes")),
        "up_body_bytes": statistics.median(each("up_body")),
        "down_body_bytes": statistics.median(each("down_body")),
        "delta_downloads": int(sum(each("delta"))),
        "downloads": rounds * workers,
        "anchors_equal_published": all(shared["anchor_equal"][i] == 1.0 for i in range(workers)),
        "server_peak_rss_mb": peak_kb / 1024,
    }


# ------------------------------------------------------------------ (b) raw TCP


def _receive_exactly(connection: socket.socket, buffer: bytearray) -> None:
    view, got = memoryview(buffer), 0
    while got < len(buffer):
        n = connection.recv_into(view[got:])
        if n == 0:
            raise ConnectionError(f"peer closed after {got} of {len(buffer)} bytes")
        got += n


def _tcp_echo_server(listener: socket.socket, workers: int, size: int, rounds: int) -> None:
    buffer = bytearray(size)
    for _ in range(rounds):
        connections = [listener.accept()[0] for _ in range(workers)]
        for connection in connections:  # receive every push, then answer every pull
            _receive_exactly(connection, buffer)
        for connection in connections:
            connection.sendall(buffer)
            connection.close()


def _tcp_client(port, index, size, rounds, barrier, times) -> None:
    payload = os.urandom(size)
    inbox = bytearray(size)
    for r in range(rounds):
        barrier.wait()
        started = time.perf_counter()
        with socket.create_connection(("127.0.0.1", port), timeout=120) as connection:
            connection.sendall(payload)
            _receive_exactly(connection, inbox)
        times[r * 8 + index] = time.perf_counter() - started


def raw_tcp(size: int, workers: int, rounds: int) -> dict:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    server = CONTEXT.Process(target=_tcp_echo_server, args=(listener, workers, size, rounds))
    server.start()
    barrier = CONTEXT.Barrier(workers)
    try:
        return timed_group(
            _tcp_client, lambda i: (port, i, size, rounds, barrier), workers, rounds, [server]
        )
    finally:
        listener.close()


# ------------------------------------------------------------------ (c) gloo all_reduce


def _gloo_rank(port, rank, workers, numel, rounds, times) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=workers
    )
    tensor = torch.ones(numel)
    dist.all_reduce(tensor)  # warm-up: connections and buffers
    for r in range(rounds):
        dist.barrier()
        started = time.perf_counter()
        dist.all_reduce(tensor)
        times[r * 8 + rank] = time.perf_counter() - started
    dist.barrier()
    dist.destroy_process_group()


def gloo_all_reduce(numel: int, workers: int, rounds: int) -> dict:
    port = free_port()
    return timed_group(_gloo_rank, lambda r: (port, r, workers, numel, rounds), workers, rounds)


# ------------------------------------------------------------------ the outer step


def outer_step_against_memory_pass(state: dict[str, torch.Tensor], repeats: int = 5) -> dict:
    """The commit's math as the coordinator runs it, against one in-place pass over memory.

    The coordinator's outer step is `apply_running_mean` on the round's sums: the division by
    the total weight happens inside PyTorch's fused SGD kernel, and the NaN/Inf scan is skipped
    because the fold bounded every value (`finite_bound`). `apply_mean` on a given mean (which
    scans it) is reported beside it. Timed on one thread: with two, a busy second core (the
    shared machine's other load) stretched every operation to 80-120 ms.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # both sides on one core: the shared machine's load stays out
    try:
        return _outer_step_timings(state, repeats)
    finally:
        torch.set_num_threads(threads)


def _outer_step_timings(state: dict[str, torch.Tensor], repeats: int) -> dict:
    masters = {n: t.clone() for n, t in state.items()}
    gradient = {n: t * 1e-3 for n, t in state.items()}
    bound = max(finite_bound(t) or math.inf for t in gradient.values())
    sums = {n: torch.empty_like(t) for n, t in state.items()}  # the server's reused sum buffers
    kinds = dict.fromkeys(masters, "trainable")
    optimizer = OuterOptimizer("nesterov", lr=0.7, momentum=0.9)
    apply_mean(masters, gradient, optimizer, kinds)  # the first step creates the momentum
    steps, scanned, passes = [], [], []
    for _ in range(repeats):
        running = RunningMean(storage=sums)
        running.add(Contribution(gradient), max_abs=bound)  # the fold, not timed
        started = time.perf_counter()
        apply_running_mean(masters, running, optimizer, kinds)
        steps.append(time.perf_counter() - started)
        started = time.perf_counter()
        apply_mean(masters, gradient, optimizer, kinds)
        scanned.append(time.perf_counter() - started)
        started = time.perf_counter()
        for name, tensor in masters.items():
            tensor.add_(gradient[name])  # one in-place pass: read two arrays, write one
        passes.append(time.perf_counter() - started)
    return {
        "outer_step_seconds": statistics.median(steps),
        "apply_mean_seconds": statistics.median(scanned),
        "memory_pass_seconds": statistics.median(passes),
    }


# ------------------------------------------------------------------ driver


def main(
    parameters: int = typer.Option(25_000_000, help="Model size in fp32 parameters."),
    workers: str = typer.Option("1,2,4", help="Comma-separated worker counts."),
    rounds: int = typer.Option(3, help="Timed rounds per measurement (median reported)."),
    out_dir: Path = typer.Option(RESULTS, help="Where wire.md and wire.json go."),
    memory_bodies: int = typer.Option(
        0, help="The server's --memory-bodies (0, its default: every upload is spooled)."
    ),
    codecs: str = typer.Option(
        DEFAULT_CODECS,
        help="Comma-separated UPLOAD/DOWNLOAD codec pairs measured with the worker's own work "
        "(download fp32: full weights; any other: coded deltas). Empty: none.",
    ),
    codec_block: int = typer.Option(128, help="The server's --codec-block."),
    topk_chunk: int = typer.Option(128, help="The server's --topk-chunk."),
    error_feedback_beta: float = typer.Option(0.95, help="The server's --error-feedback-beta."),
    links: str = typer.Option(
        "1000,100",
        help="Link speeds in Mbit/s for the projection of each round onto slower links "
        "(empty: none).",
    ),
) -> None:
    check_output_path(out_dir / "wire.json", "--out-dir")
    counts = number_list(workers, "--workers")
    if any(k < 1 or k > 8 for k in counts) or parameters < TENSORS or rounds < 1:
        raise fail("--workers must be in [1, 8], --parameters >= 10 and --rounds >= 1")
    pairs = codec_pairs(codecs) if codecs.strip() else []
    link_speeds = number_list(links, "--links", float) if links.strip() else []
    if any(not math.isfinite(v) or v <= 0 for v in link_speeds):
        raise fail("--links takes positive speeds in Mbit/s")
    codec_args = [
        *("--codec-block", str(codec_block), "--topk-chunk", str(topk_chunk)),
        *("--error-feedback-beta", str(error_feedback_beta)),
    ]
    state = make_state(parameters)
    model_mb = sum(t.numel() * 4 for t in state.values()) / 1e6
    size = sum(t.numel() * 4 for t in state.values())
    rows, results, codec_rows, codec_results = [], [], [], []
    with tempfile.TemporaryDirectory(prefix="diloco-wire-") as scratch:
        init = Path(scratch) / "init.safetensors"
        save_file(state, str(init))
        baseline_mb = runtime_baseline_mb(Path(scratch))

        def model_multiple(peak_mb: float) -> str:
            return f"{(peak_mb - baseline_mb) * 1.048576 / model_mb:.2f}x"

        for k in counts:
            err.print(f"K={k}: server round, raw TCP, gloo all_reduce")
            real = server_rounds(init, state, k, rounds, Path(scratch), memory_bodies)
            tcp = raw_tcp(size, k, rounds)
            gloo = gloo_all_reduce(size // 4, k, rounds) if k > 1 else None
            result = {"workers": k, "server": real, "raw_tcp": tcp, "gloo": gloo}
            results.append(result)
            gloo_s = gloo["median_round_seconds"] if gloo else None
            rows.append(
                [
                    k,
                    f"{real['median_round_seconds']:.3f}",
                    f"{tcp['median_round_seconds']:.3f}",
                    f"{gloo_s:.3f}" if gloo_s else "-",
                    f"{real['median_round_seconds'] / gloo_s:.2f}x" if gloo_s else "-",
                    f"{real['median_round_seconds'] / tcp['median_round_seconds']:.2f}x",
                    f"{real['server_peak_rss_mb']:.0f}",
                    model_multiple(real["server_peak_rss_mb"]),
                ]
            )
            for pair in pairs:
                err.print(f"K={k}: codecs {pair[0]} up, {pair[1]} down, worker work included")
                coded = codec_rounds(
                    init, state, k, rounds, Path(scratch), memory_bodies, pair, codec_args
                )
                coded["gloo_ratio"] = coded["median_round_seconds"] / gloo_s if gloo_s else None
                codec_results.append(coded)
                codec_rows.append(codec_row(coded, model_multiple))
    projections = project_onto_links(results, codec_results, size, link_speeds)
    outer = outer_step_against_memory_pass(state)
    columns = [
        "K",
        "server round s",
        "raw TCP s",
        "gloo all_reduce s",
        "round / gloo",
        "round / TCP",
        "server peak RSS MB",
        "(peak - runtime) / model",
    ]
    out.print(
        summary_table(f"wire: {parameters:,} fp32 parameters ({model_mb:.0f} MB)", columns, rows)
    )
    if codec_rows:
        out.print(summary_table("codecs, a real worker's round", CODEC_COLUMNS, codec_rows))
    ratio = outer["outer_step_seconds"] / outer["memory_pass_seconds"]
    out.print(
        f"outer step {outer['outer_step_seconds']:.4f} s, one memory pass "
        f"{outer['memory_pass_seconds']:.4f} s: {ratio:.2f}x (apply_mean on a given mean, "
        f"scanned: {outer['apply_mean_seconds'] / outer['memory_pass_seconds']:.2f}x)"
    )
    document = {
        "parameters": parameters,
        "model_mb": model_mb,
        "rounds": rounds,
        "results": results,
        "codecs": [f"{u}/{d}" for u, d in pairs],
        "codec_settings": {
            "codec_block": codec_block,
            "topk_chunk": topk_chunk,
            "error_feedback_beta": error_feedback_beta,
        },
        "codec_results": codec_results,
        "link_projections": projections,
        "runtime_baseline_rss_mb": baseline_mb,
        "memory_bodies": memory_bodies,
        "outer_step": outer,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "torch": torch.__version__,
    }
    if projections:
        out.print(summary_table("projected onto slower links", *projection_table(projections)))
    target = target_line(codec_results, document)
    if target:
        out.print(target)
    write_json(out_dir / "wire.json", document)
    (out_dir / "wire.md").write_text(_markdown(document, columns, rows, ratio, codec_rows, target))
    err.print(f"wrote {out_dir}/wire.md and wire.json")


def _markdown(
    document: dict,
    columns: list[str],
    rows: list[list[object]],
    ratio: float,
    codec_rows: list[list[object]],
    target: str,
) -> str:
    outer = document["outer_step"]
    codecs = ",".join(document["codecs"])
    command = (
        f"python benchmarks/wire.py --rounds {document['rounds']} "
        f"--memory-bodies {document['memory_bodies']}"
        + (f" --codecs {codecs}" if codecs != DEFAULT_CODECS else "")
    )
    settings = document["codec_settings"]
    lines = [
        "# Wire: a round through the server against raw TCP and gloo all_reduce",
        "",
        f"Command: `{command}` "
        f"({document['parameters']:,} fp32 parameters, "
        f"{document['model_mb']:.0f} MB; median of {document['rounds']} rounds; "
        f"{document['machine']}, torch {document['torch']}; everything on 127.0.0.1).",
        "",
        "- server round: every worker pushes a 100 MB pseudo-gradient and pulls the new "
        "weights through `diloco server` (barrier over all K, outer Nesterov step, the result "
        "served from the masters' own buffer), into the buffer its last weights came in (as "
        "`DiLoCoWorker` does); the body is encoded before the clock starts and the weights "
        "are not decoded (the transport alone);",
        "- raw TCP: each of K clients sends the same bytes to one process and gets them back;",
        "- gloo: `torch.distributed.all_reduce` of the same fp32 tensor between K processes;",
        "- peak RSS: the server process's VmHWM over the whole run; the last column subtracts "
        f"the RSS of a server with no model ({document['runtime_baseline_rss_mb']:.0f} MB: "
        "Python, torch, the web stack) and divides by the fp32 model size.",
        "",
        "| " + " | ".join(columns) + " |",
        "|" + "---|" * len(columns),
        *["| " + " | ".join(str(c) for c in row) + " |" for row in rows],
        "",
        f"Outer step as the coordinator runs it (`apply_running_mean`, Nesterov: the division "
        f"by the total weight inside PyTorch's fused SGD kernel, no NaN/Inf scan since the "
        f"fold bounded every value) {outer['outer_step_seconds'] * 1000:.1f} ms against one "
        f"in-place pass over the same memory {outer['memory_pass_seconds'] * 1000:.1f} ms "
        f"(both on one thread): "
        f"{ratio:.2f}x; `apply_mean` on a given mean, which scans it for NaN/Inf first: "
        f"{outer['apply_mean_seconds'] * 1000:.1f} ms, "
        f"{outer['apply_mean_seconds'] / outer['memory_pass_seconds']:.2f}x.",
        "",
    ]
    if codec_rows:
        lines += [
            "## Codecs: a round as a real worker sees it",
            "",
            f"Server `--upload-codec UP --download-codec DOWN --codec-block "
            f"{settings['codec_block']} --topk-chunk {settings['topk_chunk']} "
            f"--error-feedback-beta {settings['error_feedback_beta']:g}`; one torch thread per "
            "worker. Every round each worker gets a new pseudo-gradient (its own seeded noise, "
            "shifted; made before the clock), and inside the clock:",
            "",
            "- encode: `UploadCoder.body` (error feedback: e = beta e + g, code e, "
            "e -= D(C(e)); fp32: the plain body);",
            "- submit: the POST, answered once the server has spooled, scanned and folded it;",
            "- wait: the long poll until the round commits (barrier, outer step, for a coded "
            "download the delta's encode and P += D(delta)) and the answer's download, with "
            "have = the anchor's round so that a coded download is a delta;",
            "- apply: `apply_delta` into the worker's fp32 anchor, or a copy out of the full "
            "weights (fp32 down);",
            "- round s: the slowest worker's encode to apply, median over rounds; round / gloo "
            "against the gloo fp32 all_reduce of the same K above; phases are medians over "
            "every worker and round;",
            "- up / down MB: bytes each worker sent and received per round (the client's "
            "counters: bodies, JSON answers included); server commit: the mean of the "
            "server's `diloco_outer_step_seconds` (outer step, delta encode and P's update, "
            "the journal); deltas: downloads that came as a delta (every worker ended with "
            "an anchor equal to the server's published weights bit for bit: "
            + (
                "yes"
                if all(c["anchors_equal_published"] for c in document["codec_results"])
                else "NO"
            )
            + ").",
            "",
            "| " + " | ".join(CODEC_COLUMNS) + " |",
            "|" + "---|" * len(CODEC_COLUMNS),
            *["| " + " | ".join(str(c) for c in row) + " |" for row in codec_rows],
            "",
        ]
        if target:
            lines += [target, ""]
    projections = document["link_projections"]
    if projections:
        columns, rows = projection_table(projections)
        lines += [
            "## Projected onto slower links",
            "",
            "Loopback moves bytes at memory speed, so there coding costs more CPU time than "
            "it saves in transfer. On a real link of B bit/s per machine (full duplex) a "
            "round through the server also waits for its busiest link, the server's, which "
            "carries all K uploads and then all K downloads: the measured round + K (up + "
            "down) / B; a gloo ring all_reduce moves 2 (K - 1) / K of the model over every "
            "worker's link at once: the measured all_reduce + 2 (K - 1) / K S / B. A model, "
            "not a measurement (no latency, no TCP ramp-up, no overlap of compute and "
            "transfer); up and down bytes are the measured ones above.",
            "",
            "| " + " | ".join(columns) + " |",
            "|" + "---|" * len(columns),
            *["| " + " | ".join(str(c) for c in row) + " |" for row in rows],
            "",
        ]
    return "\n".join(lines)


if __name__ == "__main__":
    typer.run(main)
