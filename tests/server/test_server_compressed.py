"""Compressed submissions (issue 12) against a real `diloco server` process over raw HTTP, with
bodies spooled (--memory-bodies 0) and in memory (1): the committed weights equal values worked
out by hand below, and every malformed body is a 422 naming the tensor (and part) that leaves
the round where it was; a header-level fault is answered from the header alone.

Outer SGD with lr 1 throughout, so the new masters are BASE - the mean decoded pseudo-gradient
(top-k: each element's mean over the workers that sent it, its default sparse_mean, and the plain
mean when given).
"""

from __future__ import annotations

import pytest
import torch
from compressed_bodies import (
    BASE,
    CODECS,
    SHAPES,
    TOPK_CODEC,
    body,
    dense,
    entries,
    plain,
    rebuild,
    register,
    start,
    submit,
    weights,
)
from test_server_http import raw_request

from diloco.algorithm.compression.codecs import Codec
from diloco.wire.compressed.bitpack import pack, unpack
from diloco.wire.format.frames import read_frame_header

SGD = ("--outer-optimizer", "sgd", "--outer-lr", "1")

# ---- int8, block 8: s = absmax / 127 per block of 8, code round(x / s) (half to even).
# A's block 0 has absmax 63.5, so s = 0.5: 0.7 / 0.5 = 1.4 -> 1 (0.5), 0.75 / 0.5 = 1.5 -> 2
# (1.0); its block 15 is -127 * 0.125 and 0.125 (s = 0.125, exact). B's block 0 has s = 0.25,
# its block 1 s = 254 / 127 = 2: 3 / 2 = 1.5 -> 2 (4.0). A's b has s = 0.25 (exact); B's b is
# all zero (s = 0, decoded 0).
INT8_A = {
    "w": {0: 63.5, 1: -63.5, 3: 0.5, 4: 1.0, 5: -1.5, 6: 0.7, 7: 0.75, 120: -15.875, 121: 0.125},
    "b": {0: 31.75, 1: -0.25, 2: 0.5, 4: 10.0},
}
INT8_B = {"w": {0: 31.75, 7: 0.25, 9: 254.0, 10: 3.0}, "b": {}}
# BASE - (A + B) / 2 with the decoded values (0.7 -> 0.5, 0.75 -> 1.0, 3 -> 4):
INT8_W = {0: -37.625, 1: 41.75, 3: 9.75, 4: 9.5, 5: 10.75, 6: 9.75, 7: 9.375, 9: -117.0,
          10: 8.0, 120: 17.9375, 121: 9.9375}  # fmt: skip
INT8_B_NEW = [-5.875, 10.125, 9.75, 10.0, 5.0]

# ---- topk:0.03+int2, chunk 64 (k = 2 per chunk), block 8: int2 s = absmax / 1.5 over the
# kept values, level floor(x / s + 2) clamped to 0..3, decoded (level - 1.5) * s.
# A's w keeps 3 and -1.2 of chunk 0 (not 0.5), -3 and 1.5 of chunk 1 (not 0.25): s = 2,
# x / s + 2 = 3.5, 1.4, 0.5, 2.75 -> levels 3, 1, 0, 2 -> 3, -1, -3, 1.
# B's w keeps -1.5, 1.5 of chunk 0, -0.2 and 0.75 of chunk 1 (not 0.1): s = 1, levels 0, 3,
# 1, 2 -> -1.5, 1.5, -0.5, 0.5. b is one tail chunk of 5 keeping 2: A's 3 and -1.5 (s = 2:
# 3, -1), B's 1.5 and -0.75 (s = 1: 1.5, -0.5).
TOPK_A = {
    "w": {5: 3.0, 7: 0.5, 40: -1.2, 70: -3.0, 100: 1.5, 101: 0.25},
    "b": {0: 0.5, 1: 3.0, 2: -0.1, 4: -1.5},
}
TOPK_B = {"w": {5: -1.5, 6: 1.5, 64: -0.2, 65: 0.1, 127: 0.75}, "b": {3: 1.5, 4: -0.75}}
# Under --aggregation mean each decoded value is halved (two workers):
TOPK_W = {5: 9.25, 6: 9.25, 40: 10.5, 64: 10.25, 70: 11.5, 100: 9.5, 127: 9.75}
TOPK_B_NEW = [10.0, 8.5, 10.0, 9.25, 10.75]
# Under sparse_mean, a top-k codec's default, each over the workers that sent it: only w[5]
# and b[4] come from both ((3 - 1.5) / 2 = 0.75, (-1 - 0.5) / 2 = -0.75), every other kept
# value from one worker, whole (w[6]: 10 - 1.5 = 8.5, w[40]: 10 + 1 = 11, ...). The buffers f
# and n keep the plain mean.
TOPK_SPARSE_W = {5: 9.25, 6: 8.5, 40: 11.0, 64: 10.5, 70: 13.0, 100: 9.0, 127: 9.5}
TOPK_SPARSE_B_NEW = [10.0, 7.0, 10.0, 8.5, 10.75]

HAND = {
    "int8": (INT8_A, INT8_B, INT8_W, INT8_B_NEW),
    "topk": (TOPK_A, TOPK_B, TOPK_SPARSE_W, TOPK_SPARSE_B_NEW),
    "topk-mean": (TOPK_A, TOPK_B, TOPK_W, TOPK_B_NEW),
}
AGGREGATION = {"topk-mean": ("--aggregation", "mean")}


def gradient_body(values: dict, codec: Codec, f=None, n=None) -> bytearray:
    return body(dense(SHAPES["w"], values["w"]), dense(SHAPES["b"], values["b"]), codec, f, n)


def malformed_bodies(name: str, codec: Codec, valid: bytearray) -> dict[str, tuple]:
    """case -> (body, kind, tensor, part or None, refused from its header alone)."""
    parts, meta = entries(valid)

    def changed(updates: dict[str, torch.Tensor | None]) -> bytes:
        tensors = dict(parts)
        for key, value in updates.items():
            if value is None:
                del tensors[key]
            else:
                tensors[key] = value
        return rebuild(tensors, meta)

    w_scales, b_scales = parts["w#scales"], parts["b#scales"]
    cases = {
        "nan scale": (changed({"w#scales": _set(w_scales, 0, float("nan"))}), "w", "scales", False),
        "negative scale": (changed({"b#scales": _set(b_scales, 0, -1.0)}), "b", "scales", False),
        "wrong block count": (changed({"w#scales": w_scales[:-1]}), "w", "scales", True),
        "truncated codes": (changed({"w#codes": parts["w#codes"][:-1]}), "w", "codes", True),
        "missing part": (changed({"w#scales": None}), "w", "scales", True),
        "trainable sent plain": (
            changed(
                {
                    "w#codes": None,
                    "w#scales": None,
                    "w#indices": None,
                    "w": torch.zeros(SHAPES["w"]),
                }
            )
            if codec.is_sparse
            else changed({"w#codes": None, "w#scales": None, "w": torch.zeros(SHAPES["w"])}),
            "w",
            None,
            True,
        ),
    }
    result = {
        case: (data, "malformed_compressed", tensor, part, early)
        for case, (data, tensor, part, early) in cases.items()
    }
    result["buffer in bf16"] = (
        changed({"n": torch.zeros(2, dtype=torch.bfloat16)}),
        "wrong_dtype",
        "n",
        None,
        True,
    )
    result["buffer of the wrong shape"] = (
        changed({"f": torch.zeros(4)}),
        "wrong_shape",
        "f",
        None,
        True,
    )
    if name == "int8":
        codes = parts["w#codes"].clone()
        codes[3] = 255  # levels are 0..254
        result["level 255"] = (
            changed({"w#codes": codes}),
            "malformed_compressed",
            "w",
            "codes",
            False,
        )
    else:
        # b's two indices (one tail chunk of 5) are 1 and 4 at 6 bits: 7 is past the tail.
        b_indices = pack(torch.tensor([1, 7]), 6)
        result["index out of range"] = (
            changed({"b#indices": b_indices}),
            "malformed_compressed",
            "b",
            "indices",
            False,
        )
        # w's are 5, 40 | 6, 36: a repeat in chunk 0.
        w_indices = pack(torch.tensor([5, 5, 6, 36]), 6)
        result["duplicate index"] = (
            changed({"w#indices": w_indices}),
            "malformed_compressed",
            "w",
            "indices",
            False,
        )
        padded = parts["b#indices"].clone()
        padded[-1] |= 0x80  # 2 indices x 6 bits = 12: bits 4-7 of byte 1 are padding
        result["padding bits"] = (
            changed({"b#indices": padded}),
            "malformed_compressed",
            "b",
            "indices",
            False,
        )
    return result


def _set(tensor: torch.Tensor, index: int, value: float) -> torch.Tensor:
    copy = tensor.clone()
    copy[index] = value
    return copy


def test_the_hand_made_bodies_hold_what_the_comments_say() -> None:
    """The indices the malformed cases edit, read back from the valid topk body."""
    parts, _ = entries(gradient_body(TOPK_A, TOPK_CODEC))
    assert unpack(parts["w#indices"], 6, 4).tolist() == [5, 40, 6, 36]
    assert unpack(parts["b#indices"], 6, 2).tolist() == [1, 4]


@pytest.mark.parametrize("memory_bodies", ["0", "1"])
@pytest.mark.parametrize("name", ["int8", "topk", "topk-mean"])
def test_malformed_bodies_are_refused_then_two_workers_commit_the_hand_computed_weights(
    server_process, tmp_path, name, memory_bodies
) -> None:
    codec_args, codec = CODECS[name.removesuffix("-mean")]
    a_values, b_values, w_expected, b_expected = HAND[name]
    server, api = start(server_process, tmp_path, codec_args, *SGD, "--memory-bodies",
                        memory_bodies, *AGGREGATION.get(name, ()))  # fmt: skip
    register(api, "a")
    register(api, "b")
    valid_a = gradient_body(
        a_values, codec, f=torch.tensor([0.5, 0.0, -1.0]), n=torch.tensor([1, -2])
    )
    before = api.snapshot()
    for case, (data, kind, tensor, part, early) in malformed_bodies(
        name.removesuffix("-mean"), codec, valid_a
    ).items():
        error = api.rejects(submit(api, "a", data), 422, kind, f"'{tensor}'")
        assert error["detail"]["tensor"] == tensor, (case, error)
        if part is not None:
            assert error["detail"]["part"] == part, (case, error)
        assert api.snapshot() == before, case
        if early:  # the header alone is enough: the rest of the body is never sent
            header_end = read_frame_header(data, len(data))[0]
            status, _, answer, _ = raw_request(
                server.url, "POST", "/v1/rounds/0/submissions?worker_id=a",
                {"Content-Length": str(len(data))}, data[:header_end],
            )  # fmt: skip
            assert status == 422, (case, answer)
    other = Codec("int4", block=8) if name == "int8" else Codec("int2", 0.5, block=8, chunk=64)
    coded_otherwise = gradient_body(a_values, other)
    error = api.rejects(submit(api, "a", coded_otherwise), 422, "codec_mismatch", str(codec))
    assert error["detail"]["expected"]["diloco.codec"] == str(codec)
    error = api.rejects(
        submit(api, "a", plain({n: torch.zeros(SHAPES[n]) for n in SHAPES})),
        422, "codec_mismatch", str(codec), "no codec",
    )  # fmt: skip
    assert error["detail"]["got"] == {}
    assert api.snapshot() == before

    assert submit(api, "a", valid_a).status == 200
    valid_b = gradient_body(
        b_values, codec, f=torch.tensor([0.5, 1.0, 1.0]), n=torch.tensor([3, 0], dtype=torch.int32)
    )
    assert submit(api, "b", valid_b).status == 200
    round_number, new = weights(api)
    assert round_number == 1
    w = torch.full((128,), BASE)
    for position, value in w_expected.items():
        w[position] = value
    assert torch.equal(new["w"], w.view(SHAPES["w"]))
    assert torch.equal(new["b"], torch.tensor(b_expected))
    # f: 10 - mean([0.5, 0, -1], [0.5, 1, 1]); n: round([7, 100] - mean([1, -2], [3, 0]))
    assert torch.equal(new["f"], torch.tensor([9.5, 9.5, 10.0]))
    assert new["n"].dtype == torch.int32 and new["n"].tolist() == [5, 101]
    assert "Traceback" not in server.log.read_text()


def test_a_compressed_body_to_a_plain_server_is_a_codec_mismatch(server_process, tmp_path):
    _, api = start(server_process, tmp_path, ("fp32",), *SGD)
    register(api, "a")
    before = api.snapshot()
    error = api.rejects(
        submit(api, "a", gradient_body(INT8_A, CODECS["int8"][1])),
        422, "codec_mismatch", "'int8'", "plain tensors", "fp32",
    )  # fmt: skip
    assert error["detail"]["got"]["diloco.codec"] == "int8"
    assert api.snapshot() == before
