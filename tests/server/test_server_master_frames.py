"""Masters in the result's byte layout, loans that block reuse, and the lock-free value scan.

First `MasterFrames` alone, then through the coordinator: with fp32 downloads the result is the
masters' own buffer; a result some response still reads is never written again (the masters
move to a new buffer instead); with nobody reading, every round uses the same buffers.
"""

from __future__ import annotations

import asyncio
import threading

import torch

from diloco.server.coordinator import Coordinator, RoundResult
from diloco.server.errors import Rejection
from diloco.server.model.master_frames import MasterFrames
from diloco.server.settings import ServerSettings
from diloco.wire import (
    SpooledTensors,
    SpoolFiles,
    TensorSpec,
    decode_tensors,
    encode_tensors,
    spool_body,
)

TENSORS = {
    "w": torch.arange(6, dtype=torch.float32).reshape(2, 3),
    "half": torch.tensor([0.5, -1.5], dtype=torch.bfloat16),
    "steps": torch.tensor([3, 4], dtype=torch.int64),
}
FP32 = {"w": torch.float32, "half": torch.float32, "steps": torch.int64}


def test_fp32_results_are_the_masters_buffer_with_the_bytes_of_encode_tensors() -> None:
    frames = MasterFrames(TENSORS, FP32)
    assert frames.aliased
    assert frames.masters["half"].dtype == torch.float32  # floating masters are fp32
    assert frames.result() is frames.current
    masters = {n: t.clone() for n, t in frames.masters.items()}
    assert bytes(frames.result().lend()) == bytes(encode_tensors(masters))


def test_a_bf16_result_is_encoded_and_its_buffer_reused_unless_lent() -> None:
    encoded = {"w": torch.bfloat16, "half": torch.bfloat16, "steps": torch.int64}
    frames = MasterFrames(TENSORS, encoded)
    assert not frames.aliased
    first = frames.result()
    assert first is not frames.current
    decoded = decode_tensors(first.lend())
    assert decoded["w"].dtype == torch.bfloat16
    assert torch.equal(decoded["w"], TENSORS["w"].to(torch.bfloat16))
    assert frames.result() is first  # nobody reads it: written again in place
    loan = first.lend()
    second = frames.result()
    assert second is not first  # a response still reads the first: it stays as it was
    assert bytes(loan) == bytes(second.lend())
    del loan


def test_masters_are_updated_in_place_unless_a_response_still_reads_them() -> None:
    frames = MasterFrames(TENSORS, FP32)
    original = frames.current
    assert frames.writable() is original.views  # nobody reads it: written in place
    loan = original.lend()
    before = bytes(loan)
    masters = frames.writable()
    assert frames.current is not original and masters is frames.current.views
    assert bytes(frames.current.lend()) == before  # the same weights, in a new buffer
    masters["w"].fill_(-1.0)
    assert bytes(loan) == before  # the reader's bytes stay as they were
    del loan


def test_the_sums_are_the_same_fp32_buffers_every_round() -> None:
    frames = MasterFrames(TENSORS, FP32)
    sums = frames.sums()
    assert set(sums) == {"w", "half"}  # floating names only; int buffers sum elsewhere
    assert all(t.dtype == torch.float32 and t.is_contiguous() for t in sums.values())
    assert frames.sums() is sums


# --------------------------------------------------------------------- through the coordinator

SPECS = [TensorSpec("w", (4,), torch.float32, "trainable")]


def coordinator(**settings) -> Coordinator:
    c = Coordinator(
        ServerSettings(outer_optimizer="sgd", outer_lr=1.0, **settings), {"w": torch.zeros(4)}
    )
    for worker in ("a", "b"):
        c.register(worker, SPECS, protocol_version=1)
    return c


def play_round(c: Coordinator, value: float) -> None:
    number = c.round_number
    c.submit("a", number, {"w": torch.full((4,), value)})
    c.submit("b", number, {"w": torch.full((4,), value)})
    assert c.round_number == number + 1


def test_rounds_reuse_the_same_buffers_when_nobody_reads_the_old_result() -> None:
    c = coordinator()
    addresses = set()
    for r in range(5):
        play_round(c, -1.0)
        assert c.masters is not None
        addresses.add(c.masters["w"].data_ptr())
        assert decode_tensors(c.weights().body)["w"].tolist() == [r + 1.0] * 4
    assert len(addresses) == 1


def test_a_result_still_being_read_keeps_its_bytes_while_rounds_go_on() -> None:
    c = coordinator()
    play_round(c, -1.0)
    held = c.wait_result(0, "a", 0)  # a slow download of round 0's result
    assert isinstance(held, RoundResult)
    snapshot = bytes(held.body)
    for _ in range(4):
        play_round(c, -1.0)
    assert bytes(held.body) == snapshot
    assert decode_tensors(held.body)["w"].tolist() == [1.0] * 4
    assert c.masters is not None and c.masters["w"].tolist() == [5.0] * 4


# --------------------------------------------------------------------- the value scan


def spooled(value: float) -> SpooledTensors:
    body = bytes(encode_tensors({"w": torch.full((4,), value)}))

    async def chunks():
        yield body

    return asyncio.run(spool_body(chunks(), len(body), 10**6, files=SpoolFiles()))


def test_values_are_scanned_without_the_lock_and_the_state_is_checked_again_after(
    monkeypatch,
) -> None:
    """Once a round has sums, a spooled body is scanned without the lock: meanwhile another
    thread's calls go through (a's own retry among them, which completes the round); a's first
    attempt, once scanned, finds its round committed and counts once."""
    c = coordinator()
    assert c.submit("b", 0, spooled(-3.0))["status"] == "accepted"  # checked while folded
    first = spooled(-1.0)
    during: dict[str, object] = {}
    real_scan = SpooledTensors.check_values

    def scan_while_others_act(self: SpooledTensors) -> float:
        if self is first:

            def others() -> None:
                during["status"] = c.status()["round"]
                during["retry"] = c.submit("a", 0, {"w": torch.full((4,), -1.0)})["status"]

            thread = threading.Thread(target=others)
            thread.start()
            thread.join(timeout=60)
            during["blocked"] = thread.is_alive()  # it would wait on the lock forever
        return real_scan(self)

    monkeypatch.setattr(SpooledTensors, "check_values", scan_while_others_act)
    answer = c.submit("a", 0, first)
    assert during == {"status": 0, "retry": "accepted", "blocked": False}
    # the round folded a's retry: the first send is a duplicate of what it used
    assert answer["status"] == "duplicate" and c.round_number == 1
    assert c.masters is not None and c.masters["w"].tolist() == [2.0] * 4  # mean of 1 and 3


def test_the_first_spooled_body_of_a_round_is_checked_while_it_is_folded(monkeypatch) -> None:
    """One read of its file: no separate scan, and a NaN half way leaves the round untouched."""
    size = 600_000  # 2.4 MB: two 2 MiB pieces, the first folded before the NaN is read
    big = [TensorSpec("w", (size,), torch.float32, "trainable")]
    c = Coordinator(ServerSettings(outer_optimizer="sgd", outer_lr=1.0), {"w": torch.zeros(size)})
    for worker in ("a", "b"):
        c.register(worker, big, protocol_version=1)
    scans = []
    real_scan = SpooledTensors.check_values
    monkeypatch.setattr(
        SpooledTensors, "check_values", lambda self: scans.append(self) or real_scan(self)
    )

    def spool_of(tensor: torch.Tensor) -> SpooledTensors:
        body = bytes(encode_tensors({"w": tensor}))

        async def chunks():
            yield body

        return asyncio.run(spool_body(chunks(), len(body), 10**8, files=SpoolFiles()))

    poisoned = torch.full((size,), -1.0)
    poisoned[size - 1] = float("nan")
    try:
        c.submit("a", 0, spool_of(poisoned))
        raise AssertionError("a NaN body was accepted")
    except Rejection as error:
        assert (error.status, error.kind) == (422, "non_finite")
    assert c.round is not None and c.round.running is None and c.round.submitted == {}
    assert c.submit("a", 0, spool_of(torch.full((size,), -1.0)))["status"] == "accepted"
    assert scans == []  # both were the first in their round: checked while folded
    assert c.submit("b", 0, spool_of(torch.full((size,), -3.0)))["status"] == "accepted"
    assert len(scans) == 1  # the second was scanned first, outside the lock
    assert c.masters is not None and torch.equal(c.masters["w"], torch.full((size,), 2.0))


def test_a_non_finite_body_found_by_the_scan_changes_nothing() -> None:
    c = coordinator()
    assert c.round is not None
    before = (c.round.submitted.copy(), c.membership.workers["a"].last_seen)
    poisoned = torch.full((4,), 1.0)
    poisoned[2] = float("inf")
    for body in ({"w": poisoned}, spooled(float("nan"))):
        try:
            c.submit("a", 0, body)
            raise AssertionError("a non-finite body was accepted")
        except Rejection as error:
            assert (error.status, error.kind) == (422, "non_finite")
    assert c.round is not None and c.round.running is None
    assert (c.round.submitted, c.membership.workers["a"].last_seen) == before


def test_spooled_and_in_memory_sums_are_both_known_finite_from_their_scans() -> None:
    c = Coordinator(
        ServerSettings(outer_optimizer="sgd", outer_lr=1.0, min_workers=3), {"w": torch.zeros(4)}
    )
    for worker in ("a", "b", "c"):
        c.register(worker, SPECS, protocol_version=1)
    c.submit("a", 0, spooled(-1.0))
    assert c.round is not None and c.round.running is not None
    assert c.round.running.certainly_finite  # the scan bounded its values
    c.submit("b", 0, {"w": torch.full((4,), -2.0)})  # an in-memory body is bounded too
    assert c.round.running.certainly_finite
    c.submit("c", 0, spooled(-3.0))
    assert c.masters is not None and c.masters["w"].tolist() == [2.0] * 4
