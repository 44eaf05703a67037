"""The worker's upload bodies: codecs and error feedback, with every expected value by hand."""

from __future__ import annotations

import logging

import pytest
import torch

from diloco.algorithm.compression.codecs import parse_codec
from diloco.wire import TensorSpec, decode_tensors
from diloco.wire.compressed.body import decode_compressed
from diloco.worker.state.checkpoint import load_worker_checkpoint, save_worker_checkpoint
from diloco.worker.upload_coder import UploadCoder

SPECS = [
    TensorSpec("w", (4,), torch.float32, "trainable"),
    TensorSpec("norm.running_mean", (2,), torch.float32, "float_buffer"),
    TensorSpec("steps", (), torch.int64, "int_buffer"),
]
EXPECTED = {"w": ((4,), torch.float32), "norm.running_mean": ((2,), torch.float32)}
EXPECTED["steps"] = ((), torch.int64)


def gradient(w: list[float]) -> dict[str, torch.Tensor]:
    return {
        "w": torch.tensor(w, dtype=torch.float32),
        "norm.running_mean": torch.tensor([0.1, -0.2]),
        "steps": torch.tensor(3, dtype=torch.int64),
    }


def sent(body: bytearray, coder: UploadCoder) -> dict[str, torch.Tensor]:
    exact = {"norm.running_mean", "steps"}
    return decode_compressed(body, EXPECTED, coder.codec, exact=exact)


def test_top_k_error_feedback_sends_what_accumulated_and_keeps_the_rest():
    # Chunk 4, F = 0.25: one value per chunk, fp32 values; beta 0.5.
    coder = UploadCoder(parse_codec("topk:0.25", chunk=4), 0.5, SPECS)
    # Round 1: e = [1, 3, -2, 0.5]; the largest is 3 at index 1; e keeps the rest.
    first = sent(coder.body(gradient([1, 3, -2, 0.5])), coder)
    assert first["w"].tolist() == [0, 3, 0, 0]
    assert coder.residual["w"].tolist() == [1, 0, -2, 0.5]
    # Round 2: e = 0.5 [1, 0, -2, 0.5] + [1, 1, 1, 1] = [1.5, 1, 0, 1.25]: 1.5 goes.
    second = sent(coder.body(gradient([1, 1, 1, 1])), coder)
    assert second["w"].tolist() == [1.5, 0, 0, 0]
    assert coder.residual["w"].tolist() == [0, 1, 0, 1.25]
    # Round 3, nothing new: e = [0, 0.5, 0, 0.625]: 0.625 goes, 0.5 stays.
    third = sent(coder.body(gradient([0, 0, 0, 0])), coder)
    assert third["w"].tolist() == [0, 0, 0, 0.625]
    assert coder.residual["w"].tolist() == [0, 0.5, 0, 0]
    # Buffers go exact every round and keep no residual.
    for body in (first, second, third):
        assert torch.equal(body["norm.running_mean"], torch.tensor([0.1, -0.2]))
        assert body["steps"].item() == 3 and body["steps"].dtype == torch.int64
    assert set(coder.residual) == {"w"}


def test_a_body_the_server_never_folded_in_leaves_the_residual_as_it_was():
    """Answered `committed` (the round closed without it), a rebase, a failed streaming
    sync: the server got nothing of the body, so the residual returns to what it was before
    it; a folded body's residual stands."""
    coder = UploadCoder(parse_codec("topk:0.25", chunk=4), 0.5, SPECS)
    coder.body(gradient([1, 3, -2, 0.5]))
    coder.settle(folded=False)  # the very first body: nothing was kept before it
    assert coder.residual == {}
    coder.body(gradient([1, 3, -2, 0.5]))
    coder.settle(folded=True)
    assert coder.residual["w"].tolist() == [1, 0, -2, 0.5]
    # Not folded: e goes back to [1, 0, -2, 0.5], not 0.5 e + g - sent = [1.5, 1, 0, 1.25]
    # minus the 1.5 that went.
    coder.body(gradient([1, 1, 1, 1]))
    assert coder.residual["w"].tolist() == [0, 1, 0, 1.25]
    coder.settle(folded=False)
    assert coder.residual["w"].tolist() == [1, 0, -2, 0.5]
    # The fragment goes again later with a pseudo-gradient that holds the first one too:
    # e = 0.5 [1, 0, -2, 0.5] + [2, 2, 2, 2] = [2.5, 2, 1, 2.25]: 2.5 goes.
    again = sent(coder.body(gradient([2, 2, 2, 2])), coder)
    coder.settle(folded=True)
    assert again["w"].tolist() == [2.5, 0, 0, 0]
    assert coder.residual["w"].tolist() == [0, 2, 1, 2.25]


def test_without_error_feedback_nothing_is_kept():
    coder = UploadCoder(parse_codec("topk:0.25", chunk=4), 0.0, SPECS)
    assert not coder.keeps_residual
    assert sent(coder.body(gradient([1, 3, -2, 0.5])), coder)["w"].tolist() == [0, 3, 0, 0]
    # The -2 left out last round is forgotten: this round's top value is 1 at index 0.
    assert sent(coder.body(gradient([1, 0, 0, 0])), coder)["w"].tolist() == [1, 0, 0, 0]
    assert coder.residual == {}


def test_int8_sends_blockwise_levels_and_keeps_the_rounding():
    # Block 8 holds w's four values (zero-padded): absmax 127, so the scale is 1 and the
    # levels are the values rounded half to even: 2.5 -> 2, -1.25 -> -1, 0.75 -> 1.
    coder = UploadCoder(parse_codec("int8", block=8), 0.9, SPECS)
    first = sent(coder.body(gradient([127, 2.5, -1.25, 0.75])), coder)
    assert first["w"].tolist() == [127, 2, -1, 1]
    assert coder.residual["w"].tolist() == [0, 0.5, -0.25, -0.25]
    # e = 0.9 [0, 0.5, -0.25, -0.25] + [127, 0, 0, 0] = [127, 0.45, -0.225, -0.225]
    second = sent(coder.body(gradient([127, 0, 0, 0])), coder)
    assert second["w"].tolist() == [127, 0, 0, 0]
    expected = torch.tensor([0.0, 0.5, -0.25, -0.25]) * 0.9
    assert torch.equal(coder.residual["w"], expected)


def test_bf16_error_feedback_carries_what_bf16_cannot_hold():
    # bf16 has 8 significant bits: 1 + 2^-10 goes as 1, and 2^-10 stays behind.
    coder = UploadCoder(parse_codec("bf16"), 0.5, SPECS)
    body = decode_tensors(coder.body(gradient([1 + 2**-10, 0, 0, 0])))
    assert body["w"].dtype == torch.bfloat16 and body["w"][0].item() == 1.0
    assert coder.residual["w"][0].item() == 2**-10
    # e = 2^-11 + 1 + 2^-10 = 1 + 3 * 2^-11, still sent as 1.
    coder.body(gradient([1 + 2**-10, 0, 0, 0]))
    assert coder.residual["w"][0].item() == 3 * 2**-11
    assert body["steps"].dtype == torch.int64  # int buffers stay int64 in plain bodies


def test_fp32_is_the_plain_body_and_keeps_nothing():
    coder = UploadCoder(parse_codec("fp32"), 0.95, SPECS)
    body = decode_tensors(coder.body(gradient([1, 3, -2, 0.5])))
    assert body["w"].tolist() == [1, 3, -2, 0.5] and coder.residual == {}
    assert coder.state() == ({}, None)


def test_an_fp32_body_from_anchor_and_local_is_written_straight_and_new_unless_reused(
    monkeypatch,
):
    """fp32 `body_from` (a streaming fragment's upload) takes anchor - local straight into the
    body, with no pseudo-gradient tensor: the bytes of `body(anchor - local)`, a buffer of its
    own each time (fragments' uploads overlap), and the kept buffer only with `reuse`."""

    def no_tensor(*_args):
        raise AssertionError("a pseudo-gradient tensor was made")

    monkeypatch.setattr("diloco.worker.upload_coder.pseudo_gradient", no_tensor)
    coder = UploadCoder(parse_codec("fp32"), 0.95, SPECS)
    anchor = gradient([1, 3, -2, 0.5])
    local = {
        "w": torch.tensor([0.5, 3, -1, 0.75], dtype=torch.bfloat16),
        "norm.running_mean": torch.tensor([0.1, 0.3]),
        "steps": torch.tensor(5, dtype=torch.int64),
    }
    first, second = coder.body_from(anchor, local), coder.body_from(anchor, local)
    assert first == second and first is not second
    sent_now = decode_tensors(first)
    assert sent_now["w"].dtype == torch.float32
    assert sent_now["w"].tolist() == [0.5, 0.0, -1.0, -0.25]  # 1 - 0.5, 3 - 3, -2 + 1, ...
    assert sent_now["steps"].item() == 3 - 5
    assert first == coder.body(
        {n: anchor[n] - local[n].float() for n in ("w",)}
        | {
            "norm.running_mean": anchor["norm.running_mean"] - local["norm.running_mean"],
            "steps": torch.tensor(-2, dtype=torch.int64),
        }
    )
    kept = coder.body_from(anchor, local, reuse=True)
    assert coder.body_from(anchor, local, reuse=True) is kept
    assert coder.body_from(anchor, local) is not kept and coder.residual == {}


def test_a_saved_residual_comes_back_only_to_the_same_model_plan_and_codec(caplog):
    coder = UploadCoder(parse_codec("topk:0.25", chunk=4), 0.5, SPECS)
    coder.body(gradient([1, 3, -2, 0.5]))
    residual, key = coder.state()
    assert key is not None and residual["w"].tolist() == [1, 0, -2, 0.5]

    again = UploadCoder(parse_codec("topk:0.25", chunk=4), 0.5, SPECS)
    again.restore(residual, key)
    assert again.residual["w"].tolist() == [1, 0, -2, 0.5]
    assert again.residual["w"].data_ptr() != residual["w"].data_ptr()

    for other in (
        UploadCoder(parse_codec("topk:0.5", chunk=4), 0.5, SPECS),  # another codec
        UploadCoder(parse_codec("topk:0.25", chunk=4), 0.9, SPECS),  # another beta
        UploadCoder(parse_codec("topk:0.25", chunk=4), 0.5, SPECS, plan=[["w"], ["steps"]]),
        UploadCoder(parse_codec("topk:0.25", chunk=4), 0.5, SPECS[:1]),  # another model
    ):
        with caplog.at_level(logging.WARNING, logger="diloco.worker"):
            caplog.clear()
            other.restore(residual, key)
        assert other.residual == {}
        assert "dropping the saved error-feedback residual of 1 tensors" in caplog.text


def test_the_residual_is_part_of_the_worker_checkpoint(tmp_path):
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    residual = {"weight": torch.tensor([[0.25, -0.5], [0.0, 1.5]])}
    path = save_worker_checkpoint(
        tmp_path,
        worker_id="w0",
        model=model,
        optimizer=optimizer,
        anchor=model.state_dict(),
        anchor_round=3,
        local_step=12,
        extra={"residual_key": "abc"},
        residual=residual,
    )
    assert (path / "residual.safetensors").is_file()
    loaded = load_worker_checkpoint(tmp_path, model=model, optimizer=optimizer)
    assert loaded is not None and loaded.extra["residual_key"] == "abc"
    assert torch.equal(loaded.residual["weight"], residual["weight"])
    # Without a residual (fp32 uploads, or beta 0) the checkpoint has no such file.
    path = save_worker_checkpoint(
        tmp_path,
        worker_id="w0",
        model=model,
        optimizer=optimizer,
        anchor=model.state_dict(),
        anchor_round=4,
        local_step=16,
    )
    assert not (path / "residual.safetensors").exists()
    assert load_worker_checkpoint(tmp_path, model=model, optimizer=optimizer).residual == {}


def test_a_body_from_anchor_and_local_is_the_body_of_their_pseudo_gradient():
    """`body_from` skips the model-sized pseudo-gradient: over rounds that are folded, one
    that is not and one whose answer never came, it uploads the same bytes and keeps the
    same residual as `body(pseudo_gradient(anchor, local))`, for every lossy codec."""
    from diloco.algorithm.outer import pseudo_gradient

    generator = torch.Generator().manual_seed(3)
    anchor = {
        "w": torch.randn(64, generator=generator),
        "norm.running_mean": torch.tensor([0.5, 0.25]),
        "steps": torch.tensor(7, dtype=torch.int64),
    }
    answers = [True, False, None, True]  # folded, not folded, no answer (counts as folded)
    for text, beta in (("int8", 0.9), ("topk:0.5+int2", 0.5), ("int4", 0.0)):
        codec = parse_codec(text, chunk=8, block=8)
        ours, theirs = UploadCoder(codec, beta, SPECS), UploadCoder(codec, beta, SPECS)
        last = None
        for answer in answers:
            local = {
                "w": anchor["w"] - torch.randn(64, generator=generator),
                "norm.running_mean": torch.tensor([0.125, 0.75]),
                "steps": torch.tensor(9, dtype=torch.int64),
            }
            # reuse (sync mode): the last body's memory, written over with the same bytes as
            # a new body's
            body = ours.body_from(anchor, local, reuse=True)
            assert body == theirs.body(pseudo_gradient(anchor, local))
            assert last is None or body is last, text
            last = body
            if answer is not None:
                ours.settle(answer)
                theirs.settle(answer)
            assert ours.residual.keys() == theirs.residual.keys(), text
            assert all(torch.equal(ours.residual[n], theirs.residual[n]) for n in ours.residual)
        assert (beta > 0) == bool(ours.residual), text  # a residual, and only where kept


def test_coding_from_reads_local_now_and_codes_the_same_body_later():
    """A streaming fragment's send (`coding_from`): what reads `local` runs at once, so the
    model may train on before the returned function codes the body (on another thread); the
    body and the residual are `body_from`'s for the values at the call, whatever `local`
    holds by the time it codes. Without a residual all of it is coded at the call."""
    generator = torch.Generator().manual_seed(5)
    anchor = {
        "w": torch.randn(64, generator=generator),
        "norm.running_mean": torch.tensor([0.5, 0.25]),
        "steps": torch.tensor(7, dtype=torch.int64),
    }
    cases = [("topk:0.25+int2", 0.95), ("int8", 0.9), ("int8", 0.0)]
    for (text, beta), dtype in [
        *((case, torch.float32) for case in cases),
        (cases[0], torch.bfloat16),
    ]:
        codec = parse_codec(text, chunk=8, block=8)
        later, now = UploadCoder(codec, beta, SPECS), UploadCoder(codec, beta, SPECS)
        for answer in (True, False, True):
            local = {  # (a bf16 model's values: copied now in fp32, as anchor - local takes them)
                "w": (anchor["w"] - torch.randn(64, generator=generator)).to(dtype),
                "norm.running_mean": torch.tensor([0.125, 0.75]),
                "steps": torch.tensor(9, dtype=torch.int64),
            }
            expected = now.body_from(anchor, {n: t.clone() for n, t in local.items()})
            code = later.coding_from(anchor, local)
            for tensor in local.values():  # training goes on before the body is coded
                tensor.add_(3)
            assert code() == expected, text
            if beta > 0:  # coded once, on the fragment's thread
                with pytest.raises(RuntimeError, match="once"):
                    code()
            later.settle(answer)
            now.settle(answer)
            assert later.residual.keys() == now.residual.keys(), text
            assert all(torch.equal(later.residual[n], now.residual[n]) for n in now.residual)
        assert (beta > 0) == bool(later.residual), text


@pytest.mark.parametrize("reader", ["state", "settle", "next body", "move_to"])
def test_what_reads_the_residuals_waits_for_a_coding_under_way(reader: str) -> None:
    """The coding, on another thread, takes e - D(C(e)) off the pending residuals: a
    checkpoint (`state`), the answer (`settle`), the next body and `move_to` read or replace
    them only once it ends."""
    import threading

    codec = parse_codec("int8", block=8)
    coder = UploadCoder(codec, 0.5, SPECS)
    anchor = gradient([1.0, -2.0, 0.5, 4.0])
    local = gradient([0.0, 0.0, 0.0, 0.0])
    code = coder.coding_from(anchor, local)
    read: list[dict[str, torch.Tensor]] = []
    work = {
        "state": lambda: read.append(coder.state()[0]),
        "settle": lambda: coder.settle(True),
        "next body": lambda: coder.body_from(anchor, anchor),  # (counts the last as folded)
        "move_to": lambda: coder.move_to("cpu"),
    }[reader]
    worker = threading.Thread(target=work)
    worker.start()
    worker.join(timeout=0.3)
    assert worker.is_alive()  # waits: the body is not coded yet
    code()
    worker.join(timeout=10)
    assert not worker.is_alive()
    # e = g = [1, -2, 0.5, 4]: one block of 8 (4 values), scale 4 / 127; levels
    # round(127 g / 4) = [32, -64, 16, 127], decoded [32, -64, 16, 127] * 4 / 127
    scale = torch.tensor(4.0) / 127
    decoded = torch.tensor([32.0, -64.0, 16.0, 127.0]) * scale
    expected = torch.tensor([1.0, -2.0, 0.5, 4.0]) - decoded
    if reader == "next body":  # e <- 0.5 e + 0 for the next body, coded already
        expected = 0.5 * expected
        expected -= torch.round(127 * expected / expected.abs().max()) * (
            expected.abs().max() / 127
        )
    if read:
        torch.testing.assert_close(read[0]["w"], expected, rtol=0, atol=1e-6)
    coder.settle(True)
    torch.testing.assert_close(coder.residual["w"], expected, rtol=0, atol=1e-6)


def test_an_abandoned_body_leaves_the_residuals_as_they_were() -> None:
    """A send that fails before its thread takes the body abandons it: nothing was coded or
    sent, so the residual stays what the last folded body left, and nothing waits."""
    codec = parse_codec("int8", block=8)
    coder = UploadCoder(codec, 0.5, SPECS)
    anchor, local = gradient([1.0, -2.0, 0.5, 4.0]), gradient([0.0, 0.0, 0.0, 0.0])
    coder.coding_from(anchor, local)()
    coder.settle(True)
    kept = coder.residual["w"].clone()
    body = coder.coding_from(anchor, gradient([3.0, 3.0, 3.0, 3.0]))
    body.abandon()
    assert torch.equal(coder.residual["w"], kept)  # (returns at once: nothing under way)
    body.abandon()  # twice: nothing more
    with pytest.raises(RuntimeError, match="once"):
        body()
    coded = coder.coding_from(anchor, local)
    coded()
    coded.abandon()  # once its thread took it, abandoning does nothing
    coder.settle(False)
    assert torch.equal(coder.residual["w"], kept)


def test_without_a_residual_the_body_codes_anchor_minus_local_piece_by_piece():
    """No residual kept: `body_from` codes anchor - local as each piece is coded. Its bytes
    are those of coding the whole pseudo-gradient, over several pieces and a short last
    block, and with a bf16 local model or a strided view (converted or flattened)."""
    from diloco.algorithm.compression.codecs import piece_elements
    from diloco.algorithm.outer import pseudo_gradient

    generator = torch.Generator().manual_seed(5)
    numel = 2 * piece_elements(torch.device("cpu")) + 37  # three pieces, a short last block
    specs = [TensorSpec("w", (numel,), torch.float32, "trainable"), *SPECS[1:]]
    anchor = {
        "w": torch.randn(numel, generator=generator),
        "norm.running_mean": torch.tensor([0.5, 0.25]),
        "steps": torch.tensor(7, dtype=torch.int64),
    }
    for text in ("int8", "topk:0.25+int2"):
        for dtype in (torch.float32, torch.bfloat16, "strided"):
            codec = parse_codec(text)
            coder = UploadCoder(codec, 0.0, specs)
            moved = anchor["w"] - torch.randn(numel, generator=generator)
            if dtype == "strided":  # a view that is not contiguous
                moved = torch.stack([moved, moved], dim=1)[:, 0]
                assert not moved.is_contiguous()
            local = {
                "w": moved if dtype == "strided" else moved.to(dtype),
                "norm.running_mean": torch.tensor([0.125, 0.75]),
                "steps": torch.tensor(9, dtype=torch.int64),
            }
            expected = UploadCoder(codec, 0.0, specs).body(pseudo_gradient(anchor, local))
            assert coder.body_from(anchor, local) == expected, (text, dtype)
            assert coder.residual == {}


def test_a_spare_buffer_takes_the_plain_body_only_when_its_size_fits():
    """`spare` (the weights the worker joined with) is written over when no kept buffer fits
    and it has the body's size; one of another size is left as it was."""
    coder = UploadCoder(parse_codec("fp32"), 0.95, SPECS)
    anchor, local = gradient([1, 3, -2, 0.5]), gradient([0.5, 1, -2, 1.5])
    size = len(coder.plain_body(anchor, local, reuse=False))
    short = bytearray(b"\x07" * (size - 1))
    body = coder.plain_body(anchor, local, spare=short)
    assert body is not short and short == bytearray(b"\x07" * (size - 1))
    coder = UploadCoder(parse_codec("fp32"), 0.95, SPECS)
    spare = bytearray(b"\x07" * size)
    body = coder.plain_body(anchor, local, spare=spare)
    assert body is spare
    assert decode_tensors(body)["w"].tolist() == [0.5, 2, 0, -1]  # 1-0.5, 3-1, -2+2, 0.5-1.5
    assert coder.plain_body(anchor, local, spare=bytearray(size)) is spare  # kept from then on


def test_a_body_coded_in_a_staging_buffer_is_byte_for_byte_the_same(monkeypatch):
    """`stage_on_device` codes the body into a body-sized buffer beside the residuals and
    copies it once (for GPU workers; forced here on the CPU): every lossy codec, with and
    without a residual, over rounds folded and not, uploads the same bytes and keeps the same
    residual as coding straight into the body, even with the buffer scribbled over between
    bodies. Off the experiment's variable, and on the CPU by default, nothing is staged."""
    from diloco.algorithm.compression.codecs import piece_elements

    generator = torch.Generator().manual_seed(11)
    numel = piece_elements(torch.device("cpu")) + 300  # two pieces, a short last block
    specs = [
        TensorSpec("w", (numel,), torch.float32, "trainable"),
        TensorSpec("empty", (0, 3), torch.float32, "trainable"),
        *SPECS[1:],
    ]
    anchor = {
        "w": torch.randn(numel, generator=generator),
        "empty": torch.zeros(0, 3),
        "norm.running_mean": torch.tensor([0.5, 0.25]),
        "steps": torch.tensor(7, dtype=torch.int64),
    }
    cases = (
        ("int8", 0.9),
        ("int8", 0.0),
        ("int4", 0.95),
        ("topk:0.03+int2", 0.95),
        ("topk:0.03", 0.95),  # fp32 values
    )
    for text, beta in cases:
        codec = parse_codec(text)
        staged = UploadCoder(codec, beta, specs, stage_on_device=True)
        plain = UploadCoder(codec, beta, specs)
        for answer, reuse in ((True, False), (False, True), (True, True)):
            local = {
                "w": anchor["w"] - torch.randn(numel, generator=generator),
                "empty": torch.zeros(0, 3),
                "norm.running_mean": torch.tensor([0.125, 0.75]),
                "steps": torch.tensor(9, dtype=torch.int64),
            }
            if staged._stage is not None:  # whatever the last body left there
                staged._stage.fill_(0xAB)
            got = staged.body_from(anchor, local, reuse=reuse)
            assert got == plain.body_from(anchor, local, reuse=reuse), (text, reuse)
            staged.settle(answer)
            plain.settle(answer)
            assert staged.residual.keys() == plain.residual.keys()
            assert all(torch.equal(staged.residual[n], plain.residual[n]) for n in plain.residual)
        assert staged._stage is not None and plain._stage is None, text
    monkeypatch.setenv("DILOCO_STAGE_ON_DEVICE", "1")
    default = UploadCoder(parse_codec("int8"), 0.0, specs)
    default.body_from(anchor, anchor)
    assert default._stage is None  # the variable stages a GPU's bodies, not the CPU's
    # (asked, not run: this machine may have no GPU) a coder whose residuals live on a GPU
    # stages with the variable, and not without it or when told not to
    default.device = torch.device("cuda")
    assert default._stages()
    assert not UploadCoder(parse_codec("int8"), 0.0, specs, stage_on_device=False)._stages()
    monkeypatch.delenv("DILOCO_STAGE_ON_DEVICE")
    assert not default._stages()


def test_a_deferred_coding_that_fails_before_its_residual_is_taken_leaves_the_old_one(
    monkeypatch,
) -> None:
    """A send's copies of the model are not a residual: if the coding's thread fails while
    turning them into e' = beta e + g, the residual the last folded body left stands (and a
    checkpoint then saves it), as when a body is never folded in."""
    codec = parse_codec("int8", block=8)
    coder = UploadCoder(codec, 0.5, SPECS)
    anchor = gradient([1.0, -2.0, 0.5, 4.0])
    coder.coding_from(anchor, gradient([0.0, 0.0, 0.0, 0.0]))()
    coder.settle(True)
    # e = g = [1, -2, 0.5, 4], scale 4 / 127, levels [32, -64, 16, 127]: e - D(C(e))
    scale = torch.tensor(4.0) / 127
    left = torch.tensor([1.0, -2.0, 0.5, 4.0]) - torch.tensor([32.0, -64.0, 16.0, 127.0]) * scale
    assert torch.equal(coder.residual["w"], left)

    def broken(*args, **kwargs):
        raise RuntimeError("the coding failed")

    code = coder.coding_from(anchor, gradient([9.0, 9.0, 9.0, 9.0]))
    monkeypatch.setattr(coder, "_accumulate", broken)
    with pytest.raises(RuntimeError, match="coding failed"):
        code()
    residual, _ = coder.state()  # does not wait: the coding is over
    assert torch.equal(residual["w"], left)
    coder.settle(False)  # (what the failed send's merge then says: nothing pending)
    assert torch.equal(coder.residual["w"], left)
