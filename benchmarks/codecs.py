"""Codec throughput on one CPU core, and each codec's error and size per block size.

For a flat fp32 tensor of --elements values drawn from N(0, 1) (64M = 256 MB by default), with
one torch thread, the median of --repeats runs of:
  - encode: the tensor to a compressed safetensors body (wire.compressed.encode_compressed:
    the codec math and the bit packing, written into the body's buffer);
  - decode: the body back to an fp32 tensor (decode_compressed: parse the header, check every
    part's values, unpack, dequantize);
  - fold: the body's tensor checked and added into an fp32 running sum span by span
    (fold_entry, the server's path), beside one in-place add_ over the same memory;
GB/s count the fp32 input (4 bytes per element). Then, for int8, int4, int2 and the top-k
codecs at block 64, 128 and 256 (chunk 128): the relative RMS error ||D(C(x)) - x|| / ||x||
and the bytes per element on the wire. Writes benchmarks/results/codecs.md and .json.

    python benchmarks/codecs.py
    python benchmarks/codecs.py --elements 1000000 --repeats 1 --out-dir /tmp/c
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from pathlib import Path

import torch
import typer

from diloco.algorithm.compression.codecs import Layout, decode, encode, parse_codec
from diloco.console import (
    check_output_path,
    err,
    fail,
    out,
    progress_bar,
    summary_table,
    write_json,
)
from diloco.wire.compressed.body import (
    check_compressed_header,
    decode_compressed,
    encode_compressed,
    fold_entry,
)
from diloco.wire.format.frames import decode_frame

RESULTS = Path(__file__).parent / "results"
CODECS = ("fp32", "bf16", "int8", "int4", "int2", "topk:0.03+int2", "topk:0.01+int2")
BLOCK_CODECS = ("int8", "int4", "int2", "topk:0.03+int2", "topk:0.01+int2")
BLOCKS = (64, 128, 256)
TARGET_GBPS = 1.0


def timed(function, repeats: int) -> float:
    """The median of `repeats` runs, in seconds."""
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        function()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def throughput(x: torch.Tensor, spec: str, repeats: int) -> dict:
    codec = parse_codec(spec)
    expected = {"x": (tuple(x.shape), torch.float32)}
    body = encode_compressed({"x": x}, codec)
    encode_s = timed(lambda: encode_compressed({"x": x}, codec), repeats)
    decode_s = timed(lambda: decode_compressed(body, expected, codec), repeats)
    tensors, metadata = decode_frame(body)
    entry = check_compressed_header(tensors, metadata, expected, codec).compressed["x"]
    raw = {part: tensor.view(torch.uint8) for part, tensor in entry.parts.items()}
    total = torch.zeros_like(x)
    fold_s = timed(
        lambda: fold_entry(entry, lambda part, b, e: raw[part][b:e], total, 0.5), repeats
    )
    gb = x.numel() * 4 / 1e9
    return {
        "codec": spec,
        "encode_seconds": encode_s,
        "decode_seconds": decode_s,
        "fold_seconds": fold_s,
        "encode_gbps": gb / encode_s,
        "decode_gbps": gb / decode_s,
        "fold_gbps": gb / fold_s,
        "body_bytes": len(body),
        "bytes_per_element": Layout(x.numel(), codec).nbytes / x.numel(),
    }


def error_and_size(x: torch.Tensor, spec: str, block: int) -> dict:
    codec = parse_codec(spec, block=block)
    decoded = decode(encode(x, codec), codec)
    error = float(torch.linalg.vector_norm(decoded.sub_(x)) / torch.linalg.vector_norm(x))
    return {
        "codec": spec,
        "block": block,
        "relative_rms_error": error,
        "bytes_per_element": Layout(x.numel(), codec).nbytes / x.numel(),
    }


def main(
    elements: int = typer.Option(64 * 1024 * 1024, help="Elements of the fp32 test tensor."),
    repeats: int = typer.Option(3, help="Runs per measurement (the median is reported)."),
    out_dir: Path = typer.Option(RESULTS, help="Where codecs.md and codecs.json go."),
) -> None:
    check_output_path(out_dir / "codecs.json", "--out-dir")
    if elements < 1 or repeats < 1:
        raise fail("--elements must be >= 1 and --repeats >= 1")
    torch.set_num_threads(1)
    x = torch.randn(elements, generator=torch.Generator().manual_seed(0))
    memory_pass_s = timed(lambda: x.add_(0.0), max(repeats, 3))
    speeds, grid = [], []
    with progress_bar("codecs", len(CODECS) + len(BLOCK_CODECS) * len(BLOCKS)) as advance:
        for spec in CODECS:
            speeds.append(throughput(x, spec, repeats))
            advance()
        for spec in BLOCK_CODECS:
            for block in BLOCKS:
                grid.append(error_and_size(x, spec, block))
                advance()
    for speed in speeds:
        speed["relative_rms_error"] = error_and_size(x, speed["codec"], 128)["relative_rms_error"]
    columns = ["codec", "encode GB/s", "decode GB/s", "fold GB/s", "bytes/element", "rel RMS error"]
    rows = [
        [
            s["codec"],
            f"{s['encode_gbps']:.2f}",
            f"{s['decode_gbps']:.2f}",
            f"{s['fold_gbps']:.2f}",
            f"{s['bytes_per_element']:.4f}",
            f"{s['relative_rms_error']:.4f}",
        ]
        for s in speeds
    ]
    title = f"codecs: {elements:,} fp32 elements ({elements * 4 / 1e6:,.0f} MB), one thread"
    out.print(summary_table(title, columns, rows))
    block_columns = ["codec", *[f"block {b}: error, bytes/elem" for b in BLOCKS]]
    block_rows = [
        [
            spec,
            *[
                f"{g['relative_rms_error']:.4f}, {g['bytes_per_element']:.4f}"
                for g in grid
                if g["codec"] == spec
            ],
        ]
        for spec in BLOCK_CODECS
    ]
    out.print(summary_table("error and size per block size (chunk 128)", block_columns, block_rows))
    missed = [
        f"{s['codec']} {what}"
        for s in speeds
        for what in ("encode", "decode", "fold")
        if s[f"{what}_gbps"] < TARGET_GBPS
    ]
    document = {
        "elements": elements,
        "repeats": repeats,
        "threads": torch.get_num_threads(),
        "target_gbps": TARGET_GBPS,
        "memory_pass_gbps": elements * 4 / 1e9 / memory_pass_s,
        "throughput": speeds,
        "block_sizes": grid,
        "missed_target": missed,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "torch": torch.__version__,
    }
    write_json(out_dir / "codecs.json", document)
    (out_dir / "codecs.md").write_text(
        _markdown(document, columns, rows, block_columns, block_rows)
    )
    err.print(f"wrote {out_dir}/codecs.md and codecs.json")


def _markdown(
    document: dict,
    columns: list[str],
    rows: list[list[str]],
    block_columns: list[str],
    block_rows: list[list[str]],
) -> str:
    elements = document["elements"]
    missed = document["missed_target"]
    verdict = (
        f"Every codec encodes, decodes and folds at >= {TARGET_GBPS:g} GB/s on one core."
        if not missed
        else f"Under {TARGET_GBPS:g} GB/s on one core: {', '.join(missed)}."
    )

    def table(head: list[str], body: list[list[str]]) -> list[str]:
        return [
            "| " + " | ".join(head) + " |",
            "|" + "---|" * len(head),
            *["| " + " | ".join(row) + " |" for row in body],
        ]

    by = {(g["codec"], g["block"]): g for g in document["block_sizes"]}
    trade = "; ".join(
        f"{spec}: block 64 {_change(by, spec, 64)}, block 256 {_change(by, spec, 256)}"
        for spec in ("int8", "int4", "int2")
    )
    return "\n".join(
        [
            "# Codecs: throughput on one core, error and size",
            "",
            f"Command: `python benchmarks/codecs.py` ({elements:,} fp32 elements from N(0, 1), "
            f"{elements * 4 / 1e6:,.0f} MB; median of {document['repeats']}; one torch thread; "
            f"{document['machine']}; torch {document['torch']}).",
            "",
            "- encode: the tensor to a compressed safetensors body (codec math, bit packing);",
            "- decode: the body to an fp32 tensor (header and every value checked, unpacked, "
            "dequantized, into a newly allocated fp32 tensor);",
            "- fold: the body's tensor checked and added into an fp32 running sum, span by span "
            "(the server's path);",
            "- GB/s count the fp32 input, 4 bytes per element; one in-place `add_` over the same "
            f"memory runs at {document['memory_pass_gbps']:.1f} GB/s;",
            "- bytes/element: codes, scales and indices on the wire (block 128, chunk 128); "
            "rel RMS error: ||D(C(x)) - x|| / ||x||.",
            "",
            *table(columns, rows),
            "",
            verdict,
            "",
            "## Block size (values per scale), chunk 128",
            "",
            *table(block_columns, block_rows),
            "",
            f"Against block 128 (error, bytes): {trade}.",
            "",
        ]
    )


def _change(by: dict, spec: str, block: int) -> str:
    """'-9% error, +3% bytes': `block` against block 128 for `spec`."""
    here, base = by[(spec, block)], by[(spec, 128)]
    error = here["relative_rms_error"] / base["relative_rms_error"] - 1
    size = here["bytes_per_element"] / base["bytes_per_element"] - 1
    return f"{error:+.0%} error, {size:+.1%} bytes"


if __name__ == "__main__":
    typer.run(main)
