"""Shared by the compressed-upload server tests: a small model with a trainable matrix, a
trainable vector and two buffers, pseudo-gradients whose decoded values are worked out by hand,
and raw-HTTP helpers against a real `diloco server` process."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file
from test_server_http import Api

from diloco.algorithm.compression.codecs import Codec
from diloco.wire import decode_tensors, encode_tensors
from diloco.wire.compressed.body import encode_compressed
from diloco.wire.format.frames import decode_frame
from frames import frame_of

# w and b are trainable (sent compressed); f is a float buffer and n an int32 buffer (sent
# exact, as plain entries).
SHAPES = {"w": (2, 64), "b": (5,), "f": (3,), "n": (2,)}
KINDS = {"w": "trainable", "b": "trainable", "f": "float_buffer", "n": "int_buffer"}
BUFFERS = ("f", "n")
BASE = 10.0  # every float master starts here; n starts at [7, 100]
N_START = [7, 100]

INT8 = ("int8", "--codec-block", "8")
INT8_CODEC = Codec("int8", block=8)
# chunk 64: k = round(0.03 * 64) = round(1.92) = 2 kept values per chunk, 6-bit indices
TOPK = ("topk:0.03+int2", "--codec-block", "8", "--topk-chunk", "64")
TOPK_CODEC = Codec("int2", 0.03, block=8, chunk=64)
CODECS = {"int8": (INT8, INT8_CODEC), "topk": (TOPK, TOPK_CODEC)}


def init_file(tmp_path: Path) -> Path:
    path = tmp_path / "init.safetensors"
    masters = {name: torch.full(SHAPES[name], BASE) for name in ("w", "b", "f")}
    masters["n"] = torch.tensor(N_START, dtype=torch.int32)
    save_file(masters, str(path))
    return path


def specs() -> list[dict]:
    dtypes = {"w": "float32", "b": "float32", "f": "float32", "n": "int32"}
    return [
        {"name": name, "shape": list(shape), "dtype": dtypes[name], "kind": KINDS[name]}
        for name, shape in SHAPES.items()
    ]


def start(server_process, tmp_path: Path, codec_args: tuple[str, ...], *args: str):
    """A server of the model above with `--upload-codec` and its options; SGD lr 1 (the step
    is masters - mean) unless `args` say otherwise."""
    server = server_process(
        "--init", str(init_file(tmp_path)), "--sync-every", "1",
        "--upload-codec", *codec_args, *args,
    )  # fmt: skip
    return server, Api(server.url)


def register(api: Api, worker_id: str) -> None:
    api.ok("POST", "/v1/workers", json_body={
        "protocol_version": 1, "worker_id": worker_id, "tensors": specs()
    })  # fmt: skip


def dense(shape: tuple[int, ...], values: dict[int, float]) -> torch.Tensor:
    """A tensor of zeros with `values` at the given flat positions."""
    flat = torch.zeros(torch.Size(shape).numel())
    for position, value in values.items():
        flat[position] = value
    return flat.view(shape)


def body(
    w: torch.Tensor,
    b: torch.Tensor,
    codec: Codec,
    f: torch.Tensor | None = None,
    n: torch.Tensor | None = None,
) -> bytearray:
    """A compressed submission: w and b coded, the buffers f and n plain (n as int64, as
    workers send int buffers' pseudo-gradients)."""
    tensors = {"w": w, "b": b}
    tensors["f"] = torch.zeros(3) if f is None else f
    tensors["n"] = torch.zeros(2, dtype=torch.int64) if n is None else n
    return encode_compressed(tensors, codec, exact=BUFFERS)


def entries(data: bytes | bytearray) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A body's entries as copies (to be changed and written again with `rebuild`)."""
    tensors, metadata = decode_frame(bytearray(data))
    return {name: t.clone() for name, t in tensors.items()}, metadata


def rebuild(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None) -> bytes:
    """A body of exactly these entries and metadata."""
    return bytes(frame_of(tensors, metadata))


def plain(values: dict[str, torch.Tensor]) -> bytes:
    return bytes(encode_tensors(values))


def weights(api: Api) -> tuple[int, dict[str, torch.Tensor]]:
    response = api.call("GET", "/v1/weights")
    assert response.status == 200, response.data[:300]
    return int(response.headers["X-Diloco-Round"]), decode_tensors(response.data)


def submit(api: Api, worker_id: str, data: bytes | bytearray, round_number: int = 0, query=""):
    return api.submit(worker_id, bytes(data), round_number=round_number, query=query)
