"""A top-k round folds each body as its kept values (RunningMean.add_pieces given SparsePiece)
where contributions are added unscaled, and as dense pieces where they are weighted: the same
hand-worked sums either way (tests/server/test_server_compressed.py checks them through a
real server; here the fold's path is watched in process)."""

from __future__ import annotations

import tempfile

import pytest
import torch

from diloco.algorithm import RunningMean
from diloco.algorithm.compression.codecs import Codec
from diloco.algorithm.tensors import SparsePiece
from diloco.server.coordinator import Coordinator
from diloco.server.settings import ServerSettings
from diloco.wire import TensorSpec
from diloco.wire.compressed.body import encode_compressed
from diloco.wire.format.frames import read_frame_header
from diloco.wire.format.spool import SpooledTensors, SpoolFiles

# chunk 4, k = round(0.5 * 4) = 2, fp32 values: a keeps 4 and -3 of chunk 0 (not 1, 0) and
# 2, 6 of chunk 1; b keeps 2 and 8 of chunk 0 and -4, 1 of chunk 1 (not 0.5, 0.25).
CODEC = Codec("fp32", 0.5, block=8, chunk=4)
A = [1.0, 4.0, -3.0, 0.0, 0.0, 2.0, 0.0, 6.0]
B = [2.0, 0.25, 8.0, 0.5, -4.0, 0.0, 1.0, 0.0]
SPARSE, DENSE = {SparsePiece}, {torch.Tensor}


def spooled(values: list[float]) -> SpooledTensors:
    data = encode_compressed({"w": torch.tensor(values)}, CODEC)
    file = tempfile.TemporaryFile()  # noqa: SIM115 (closed with the spooled body)
    file.write(data)
    file.flush()
    data_start, entries, metadata = read_frame_header(bytes(data), len(data))
    return SpooledTensors(file, len(data), data_start, entries, SpoolFiles(keep=0), metadata)


@pytest.mark.parametrize(
    ("weighting", "aggregation", "kinds", "step"),
    [
        # sparse_mean: each element over its senders: b's 2 alone, a's 4, (-3 + 8) / 2, ...
        ("uniform", "sparse_mean", [SPARSE, SPARSE], [2.0, 4.0, 2.5, 0.0, -4.0, 2.0, 1.0, 6.0]),
        # the plain mean: (a + b) / 2 of the kept values
        ("uniform", "mean", [SPARSE, SPARSE], [1.0, 2.0, 2.5, 0.0, -2.0, 1.0, 0.5, 3.0]),
        # by tokens, a 3 and b 1: (3 a + b) / 4; a, weighted 3, is folded from dense pieces,
        # b, weighted 1, from its kept values
        ("tokens", "mean", [DENSE, SPARSE], [0.5, 3.0, -0.25, 0.0, -1.0, 1.5, 0.25, 4.5]),
    ],
)
def test_a_top_k_round_folds_kept_values_where_unscaled(
    monkeypatch: pytest.MonkeyPatch, weighting: str, aggregation: str, kinds: list, step: list
) -> None:
    seen: list[set[type]] = []  # per body folded: the kinds of its pieces
    add_pieces = RunningMean.add_pieces

    def watched(self, shapes, pieces, tokens, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(set())

        def each():
            for name, first, piece in pieces:
                seen[-1].add(type(piece))
                yield name, first, piece

        return add_pieces(self, shapes, each(), tokens, **kwargs)

    monkeypatch.setattr(RunningMean, "add_pieces", watched)
    settings = ServerSettings(
        outer_optimizer="sgd", outer_lr=1.0, upload_codec="topk:0.5", codec_block=8,
        topk_chunk=4, weighting=weighting, aggregation=aggregation, min_workers=2,
    )  # fmt: skip
    c = Coordinator(settings, {"w": torch.full((8,), 10.0)})
    for worker in ("a", "b"):
        c.register(worker, [TensorSpec("w", (8,), torch.float32, "trainable")], 1)
    for worker, values, tokens in (("a", A, 3), ("b", B, 1)):
        body = spooled(values)
        c.submit(worker, 0, body, tokens=tokens, metadata=body.metadata)
    assert c.round_number == 1
    assert c.masters["w"].tolist() == pytest.approx([10.0 - s for s in step])
    assert seen == kinds
