"""A worker's own part of a sync round, timed alone: encode and apply beside their limits.

model_scale.py times whole rounds through a server; this times the two phases a worker runs
by itself, with nothing else on the machine, for the bundled GPT on one device:
  - encode: `UploadCoder.body_from` (anchor - local, error feedback, the coded body on the
    host), what a worker with its anchor beside the model runs before it uploads;
  - send now: the part of a streaming fragment's send that stays on the training thread,
    `UploadCoder.coding_from` (anchor - local into e' = beta e + g), timed for the whole
    model; the rest of the coding runs on the fragment's thread beside the next steps
    (with a CPU anchor and error feedback; otherwise all of it is the send's). CPU runs
    only: a GPU anchor's send codes all of it on the training thread;
  - apply: `Anchor.values_after` of a coded delta the server made (`PublishedCopy.advance`),
    then `Anchor.adopt` (the new weights into the model), what it runs after the download;
  - and the server's side on its CPU: the intake of that body as a round's later one
    (`server_fold`: the scan of its values from its spool file, then its fold into sums that
    hold a body already, as `round.fold` adds it: top-k as kept values, its senders counted as
    `--aggregation sparse_mean`, a top-k server's default, counts them), and the delta
    (`PublishedCopy.advance`: code masters - P and move P by exactly what was sent), both in
    the last upload's path to a round's result.
Beside them, measured in the same run: the body's bytes copied between host and device
(from pageable memory, as the body lives, and from pinned memory) and one memory pass over
the fp32 model on the device. `--profile` prints the functions where each phase spent its
time (cProfile; a blocking copy or sync shows as the call that waited).

    python benchmarks/worker_coding.py --device cuda --size 125M --codec int8
    python benchmarks/worker_coding.py --device cpu --size 2M --out-dir /tmp   # no GPU
"""

from __future__ import annotations

import cProfile
import io
import pstats
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import typer

from diloco.algorithm import RunningMean, classify_tensors
from diloco.algorithm.compression.codecs import Codec, parse_codec
from diloco.console import check_output_path, fail, out, summary_table, write_json
from diloco.server.model.published_copy import PublishedCopy
from diloco.server.rounds.admission import scan_values
from diloco.wire import specs_of
from diloco.wire.compressed.header import check_compressed_header
from diloco.wire.compressed.pieces import CompressedPieces
from diloco.wire.format.frames import read_frame_header
from diloco.wire.format.spool import SpooledTensors, SpoolFiles
from diloco.worker.anchor import Anchor
from diloco.worker.upload_coder import UploadCoder

SIZES = {"2M": (256, 2), "25M": (512, 8), "85M": (768, 12), "125M": (768, 18), "350M": (1024, 28)}


def _timed(work: Callable[[], object], device: torch.device, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        work()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - started)
    return times


def _server_fold(
    body: bytearray, state: dict[str, torch.Tensor], coding: Codec, exact: set[str]
) -> tuple[Callable[[], RunningMean], Callable[[RunningMean], None]]:
    """The function that takes `body` in as a server takes a round's later upload: from a
    spool file, its values scanned (admission.scan_values), then folded into sums that hold
    one body already, in preallocated storage (round.fold's add_pieces)."""
    spool = tempfile.TemporaryFile()  # noqa: SIM115 (closed with the spooled body)
    spool.write(body)
    spool.flush()
    data_start, entries, metadata = read_frame_header(bytes(body[: 1 << 20]), len(body))
    spooled = SpooledTensors(spool, len(body), data_start, entries, SpoolFiles(keep=0), metadata)
    expected = {n: (tuple(t.shape), torch.float32) for n, t in state.items() if n not in exact}
    expected |= {n: (tuple(state[n].shape), state[n].dtype) for n in exact}
    header = check_compressed_header(entries, metadata, expected, coding, exact=exact)
    opened = CompressedPieces.spooled(header, spooled)
    shapes = {name: tuple(t.shape) for name, t in opened.meta.items()}
    storage = {n: torch.empty(shape) for n, shape in shapes.items()}
    counts = {n: torch.empty(shape) for n, shape in shapes.items()}

    def running() -> RunningMean:
        held = RunningMean(storage=storage, count_senders=coding.is_sparse, senders_storage=counts)
        held.add_pieces(shapes, opened.pieces(held.takes_sparse(1)), tokens=1)  # the first
        return held

    def fold(held: RunningMean) -> None:
        bound = scan_values(opened).bound
        held.add_pieces(shapes, opened.pieces(held.takes_sparse(1)), tokens=1, max_abs=bound)

    return running, fold


def _profile(work: Callable[[], object], lines: int) -> str:
    profiler = cProfile.Profile()
    profiler.enable()
    work()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(lines)
    return text.getvalue()


def main(
    device: str = typer.Option(
        "auto", help="Where the model, anchor and residual live (auto: CUDA if there is one)."
    ),
    size: str = typer.Option("125M", help=f"GPT size: {', '.join(SIZES)}."),
    codec: str = typer.Option("int8", help="Upload and download codec."),
    repeats: int = typer.Option(5, min=2, help="Timed runs of each phase (median reported)."),
    profile: bool = typer.Option(False, help="Print where each phase spent its time."),
    out_dir: Path = typer.Option(Path(__file__).parent / "results", help="Where results go."),
) -> None:
    check_output_path(out_dir / "worker_coding.json", "--out-dir")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if size not in SIZES:
        raise fail(f"--size must be one of {', '.join(SIZES)}, got {size!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise fail(f"--device {device}: this machine has no CUDA device")
    try:
        coding = parse_codec(codec)
    except ValueError as exc:
        raise fail(f"--codec: {exc}") from None
    if coding.is_identity:
        raise fail("--codec fp32 sends plain tensors; name a codec that codes (int8, int4, ...)")
    where = torch.device(device)
    from diloco.models.gpt import GPTConfig

    width, depth = SIZES[size]
    torch.manual_seed(0)
    model = GPTConfig(context=256, width=width, depth=depth).build().to(where)
    state = model.state_dict()
    parameters = sum(p.numel() for p in model.parameters())
    specs = specs_of(state, classify_tensors(model))
    anchor = Anchor(model, leader=True, download_dtype=torch.float32, device=where)
    anchor.adopt({n: t.detach().clone() for n, t in state.items()}, 0)
    with torch.no_grad():  # local = anchor + a training window's worth of change
        for tensor in model.parameters():
            tensor.add_(torch.randn_like(tensor), alpha=1e-3)
    coder = UploadCoder(coding, 0.95, specs, device=where)

    def encode() -> bytearray:
        body = coder.body_from(anchor.tensors, model.state_dict(), reuse=True)
        coder.settle(folded=True)
        return body

    body = encode()
    host = {n: t.detach().to("cpu", torch.float32) for n, t in anchor.tensors.items()}
    dtypes = {n: t.dtype for n, t in host.items()}
    published = PublishedCopy(host, dtypes, coding, coder.coded_names)
    masters = {n: t + 1e-3 * torch.randn_like(t) for n, t in host.items()}
    delta = published.advance(masters, list(masters))
    names = list(anchor.tensors)
    before = {n: t.clone() for n, t in anchor.tensors.items()}

    def apply() -> None:  # the same delta onto the same anchor each time
        for name, tensor in anchor.tensors.items():
            tensor.copy_(before[name])
        values = anchor.values_after(delta, names, coding, coder.coded_names)
        anchor.adopt(values, 1)

    sends = []
    # what the training thread runs of a send (CPU only: no device to wait for); the rest of
    # the coding untimed
    for _ in range(repeats if where.type == "cpu" else 0):
        started = time.perf_counter()
        code = coder.coding_from(anchor.tensors, model.state_dict())
        sends.append(time.perf_counter() - started)
        code()
        coder.settle(folded=True)

    reset = _timed(lambda: [t.copy_(before[n]) for n, t in anchor.tensors.items()], where, repeats)
    cpu = torch.device("cpu")
    exact = set(names) - coder.coded_names
    on_server = {n: t.to(dtypes[n]) for n, t in host.items()}  # (shapes and dtypes)
    held, take_in = _server_fold(body, on_server, coding, exact)
    folds = []
    for _ in range(repeats):  # each into sums holding the first body, made untimed
        sums = held()
        folds.append(_timed(lambda sums=sums: take_in(sums), cpu, 1)[0])
    figures = {
        "encode": statistics.median(_timed(encode, where, repeats)),
        "apply": statistics.median(_timed(apply, where, repeats)) - statistics.median(reset),
        # the server's side of the delta, on its CPU: code masters - P and move P by it
        "server_delta": statistics.median(
            _timed(lambda: published.advance(masters, names), cpu, repeats)
        ),
        # the server's intake of the body as a round's later upload: its scan, then its fold
        "server_fold": statistics.median(folds),
    }
    if sends:  # (a GPU anchor's send codes on the training thread: encode is its time)
        figures["send_now"] = statistics.median(sends)
    upload, download = len(body), len(delta)
    pageable = torch.empty(max(upload, download), dtype=torch.uint8)
    pinned = pageable.pin_memory() if where.type == "cuda" else pageable
    on_device = torch.empty_like(pageable, device=where)
    limits = {
        "to_device_pageable": statistics.median(
            _timed(lambda: on_device[:download].copy_(pageable[:download]), where, repeats)
        ),
        "to_device_pinned": statistics.median(
            _timed(lambda: on_device[:download].copy_(pinned[:download]), where, repeats)
        ),
        "to_host_pageable": statistics.median(
            _timed(lambda: pageable[:upload].copy_(on_device[:upload]), where, repeats)
        ),
        "to_host_pinned": statistics.median(
            _timed(lambda: pinned[:upload].copy_(on_device[:upload]), where, repeats)
        ),
    }
    flat = torch.empty(parameters, dtype=torch.float32, device=where)
    limits["memory_pass"] = statistics.median(_timed(lambda: flat.add_(1.0), where, repeats))
    on_cpu = flat if where.type == "cpu" else torch.empty(parameters, dtype=torch.float32)
    limits["cpu_memory_pass"] = statistics.median(_timed(lambda: on_cpu.add_(1.0), cpu, repeats))
    # each phase's floor, measured here: its bytes over the bus (from pageable memory, where
    # a body lives), or for the server's delta one pass over the fp32 model on its CPU
    floors = {
        "encode": ("to_host_pageable", upload),
        "apply": ("to_device_pageable", download),
        "server_delta": ("cpu_memory_pass", download),
        "server_fold": ("cpu_memory_pass", upload),
    }
    if sends:
        floors["send_now"] = ("memory_pass", upload)
    ratios = {phase: figures[phase] / limits[floor] for phase, (floor, _) in floors.items()}
    name = torch.cuda.get_device_name(where) if where.type == "cuda" else "CPU"
    document = {
        "device": name,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "size": size,
        "parameters": parameters,
        "codec": codec,
        "upload_bytes": upload,
        "download_bytes": download,
        "seconds": figures,
        "limits_seconds": limits,
        "floors": {phase: floor for phase, (floor, _) in floors.items()},
        "ratio_to_floor": ratios,
    }
    rows = [
        [
            phase,
            f"{figures[phase]:.3f}",
            f"{nbytes / 1e6:.0f}",
            f"{limits[floor]:.3f} ({floor.replace('_', ' ')})",
            f"{ratios[phase]:.1f}x",
        ]
        for phase, (floor, nbytes) in floors.items()
    ]
    out.print(
        summary_table(
            f"A worker's coding, {size} ({parameters / 1e6:.1f}M) {codec} on {name}"
            f" (pinned copies: to host {limits['to_host_pinned']:.3f} s, to device"
            f" {limits['to_device_pinned']:.3f} s; memory pass {limits['memory_pass']:.3f} s)",
            ["phase", "seconds", "MB", "floor s", "x floor"],
            rows,
        )
    )
    if profile:
        for phase, work in (("encode", encode), ("apply", apply)):
            out.print(f"--- {phase}: where the time went (cProfile, by own time)")
            out.print(_profile(work, 18), markup=False, highlight=False)
    write_json(out_dir / "worker_coding.json", document)


if __name__ == "__main__":
    typer.run(main)
