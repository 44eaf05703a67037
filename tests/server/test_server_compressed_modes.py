"""Compressed submissions in streaming and async mode over raw HTTP against a real `diloco
server`, with expected weights worked out by hand; and the server's peak memory while it folds
a spooled compressed upload of a 25M-parameter model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from compressed_bodies import (
    BASE,
    CODECS,
    SHAPES,
    dense,
    register,
    start,
    submit,
    weights,
)
from safetensors.torch import save_file
from test_server_http import Api

from diloco.algorithm.compression.codecs import Codec
from diloco.wire.compressed.body import encode_compressed

INT8_ARGS, INT8_CODEC = CODECS["int8"]
TOPK_ARGS, TOPK_CODEC = CODECS["topk"]


def test_streaming_a_compressed_fragment_commits_and_a_part_of_another_fragment_is_refused(
    server_process, tmp_path
) -> None:
    """Two fragments, contiguous by size: w alone, then b, f, n. Fragment 0's int8 body holds
    w's parts only; w's block 0 is [63.5, -63.5, 0, 0.5, 1, -1.5, 0.7, 0.75] with s = 0.5,
    decoded [63.5, -63.5, 0, 0.5, 1, -1.5, 0.5, 1] (1.4 -> 1, 1.5 -> 2). SGD lr 1."""
    _, api = start(
        server_process, tmp_path, INT8_ARGS, "--mode", "streaming", "--fragments", "2",
        "--outer-optimizer", "sgd", "--outer-lr", "1", "--sync-every", "2",
    )  # fmt: skip
    register(api, "a")
    info = api.ok("GET", "/v1/info")
    assert info["fragment_plan"] == [["w"], ["b", "f", "n"]]
    values = {0: 63.5, 1: -63.5, 3: 0.5, 4: 1.0, 5: -1.5, 6: 0.7, 7: 0.75}
    w = dense(SHAPES["w"], values)
    before = api.snapshot()
    both = encode_compressed({"w": w, "b": torch.ones(5)}, INT8_CODEC)
    error = api.rejects(submit(api, "a", both, query="&fragment=0"), 422, "wrong_fragment", "'b'")
    assert error["detail"] == {"tensor": "b", "fragment": 0, "belongs_to": 1}
    assert api.snapshot() == before
    answer = submit(api, "a", encode_compressed({"w": w}, INT8_CODEC), query="&fragment=0")
    assert answer.status == 200, answer.data[:300]
    assert api.ok("GET", "/v1/info")["fragment_rounds"] == [1, 0]
    _, new = weights(api)
    decoded = {0: 63.5, 1: -63.5, 3: 0.5, 4: 1.0, 5: -1.5, 6: 0.5, 7: 1.0}
    expected = torch.full((128,), BASE)
    for position, value in decoded.items():
        expected[position] = BASE - value
    assert torch.equal(new["w"], expected.view(SHAPES["w"]))
    assert torch.equal(new["b"], torch.full((5,), BASE))  # fragment 1 has not synced


def test_async_a_compressed_arrival_is_applied_with_delayed_nesterov(
    server_process, tmp_path
) -> None:
    """Async, the default outer optimizer: Delayed Nesterov with N = 1, lr 0.7, momentum 0.9;
    from zero momentum m = g and theta -= 0.7 (0.9 m + g) = 1.33 g for the trainable tensors.
    Buffers take the mean local value: f = 10 - g_f, n = round([7, 100] - g_n).
    topk:0.03+int2, chunk 64 (k = 2): chunk 0 keeps 3 (5) and -1.2 (40), chunk 1 -3 (70) and
    1.5 (100); s = 2 decodes them to 3, -1, -3, 1. b keeps 3 (1) and -1.5 (4): 3, -1."""
    _, api = start(server_process, tmp_path, TOPK_ARGS, "--mode", "async")
    register(api, "a")
    w = dense(SHAPES["w"], {5: 3.0, 7: 0.5, 40: -1.2, 70: -3.0, 100: 1.5, 101: 0.25})
    b = torch.tensor([0.5, 3.0, -0.1, 0.0, -1.5])
    gradient = {"w": w, "b": b, "f": torch.tensor([1.0, 0.0, -0.5]), "n": torch.tensor([2, -3])}
    body = encode_compressed(gradient, TOPK_CODEC, exact={"f", "n"})
    answer = submit(api, "a", body)
    assert answer.status == 200, answer.data[:300]
    round_number, new = weights(api)
    assert round_number == 1
    decoded_w = dense(SHAPES["w"], {5: 3.0, 40: -1.0, 70: -3.0, 100: 1.0})
    assert torch.allclose(new["w"], BASE - 1.33 * decoded_w, rtol=0, atol=1e-5)
    assert torch.allclose(new["b"], BASE - 1.33 * torch.tensor([0, 3.0, 0, 0, -1]), atol=1e-5)
    assert torch.equal(new["f"], torch.tensor([9.0, 10.0, 10.5]))
    assert new["n"].tolist() == [5, 103]


def _memory_kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def test_a_spooled_compressed_upload_of_25m_parameters_adds_little_to_the_server_peak(
    server_process, tmp_path
) -> None:
    """Folding a spooled int8 upload reads, checks and decodes it a span at a time: the peak
    RSS rises by a few MiB, not by the 100 MB fp32 model a whole decode would take (measured
    here: about 2 MB; a body in memory adds its own 26 MB). Round 0 allocates the round's sums
    (the model's size, once); the peak is reset after it (clear_refs 5) and round 1 measured."""
    shape = (5000, 5000)
    model_mb = 5000 * 5000 * 4 / 2**20
    init = tmp_path / "big.safetensors"
    save_file({"big": torch.zeros(shape)}, str(init))
    server = server_process(
        "--init", str(init), "--sync-every", "1", "--outer-optimizer", "sgd", "--outer-lr",
        "1", "--upload-codec", "int8", "--memory-bodies", "0",
    )  # fmt: skip
    api = Api(server.url)
    spec = {"name": "big", "shape": list(shape), "dtype": "float32", "kind": "trainable"}
    api.ok("POST", "/v1/workers", json_body={
        "protocol_version": 1, "worker_id": "a", "tensors": [spec],
    })  # fmt: skip
    gradient = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 1e-3
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small ops on a loaded machine: a thread pool only waits
    try:
        body = bytes(encode_compressed({"big": gradient}, Codec("int8")))
    finally:
        torch.set_num_threads(threads)
    assert submit(api, "a", body, round_number=0).status == 200
    pid = server.process.pid
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM := VmRSS
    except OSError as exc:
        pytest.skip(f"cannot reset the peak RSS here: {exc}")
    before_kb = _memory_kb(pid, "VmRSS")
    answer = submit(api, "a", body, round_number=1)
    assert answer.status == 200, answer.data[:300]
    rise_mb = (_memory_kb(pid, "VmHWM") - before_kb) / 1024
    assert rise_mb < 0.1 * model_mb, json.dumps({"rise_mb": rise_mb, "model_mb": model_mb})
    assert api.ok("GET", "/v1/status")["round"] == 2
