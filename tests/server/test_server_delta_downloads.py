"""--download-codec: results are coded deltas against the published weights P, which the
server moves exactly as a worker moves its anchor, keeps durable, and serves whole to a worker
whose anchor is anywhere else. Every expected value is worked out by hand."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from diloco.algorithm.compression.codecs import parse_codec
from diloco.server.coordinator import Coordinator
from diloco.server.errors import Rejection
from diloco.server.model.published_copy import PublishedCopy
from diloco.server.model.results import RoundResult
from diloco.server.settings import ServerSettings
from diloco.server.state.journal import RoundJournal
from diloco.server.state.store import StateStore
from diloco.wire import decode_tensors, specs_of
from diloco.wire.compressed.body import apply_delta

# Plain averaging (outer SGD, lr 1): masters <- masters - mean(g). int8 with blocks of 8.
SETTINGS = ServerSettings(
    sync_every=2, outer_optimizer="sgd", outer_lr=1.0, download_codec="int8", codec_block=8
)
START = {"w": torch.zeros(3)}
# Streaming, two fragments of one tensor each (a, b), the same codec and outer step
STREAMING = ServerSettings(
    mode="streaming",
    sync_every=4,
    fragments=2,
    delay=1,
    outer_optimizer="sgd",
    outer_lr=1.0,
    download_codec="int8",
    codec_block=8,
)
SPECS = specs_of(START, {"w": "trainable"})


def coordinator(state: Path, **journal) -> Coordinator:
    return Coordinator(SETTINGS, journal=RoundJournal(StateStore(state), SETTINGS, **journal))


def result(c: Coordinator, round_number: int, have: int | None) -> RoundResult:
    outcome = c.wait_result(round_number, "a", 0.0, have=have)
    assert isinstance(outcome, RoundResult)
    return outcome


def test_a_result_is_the_coded_delta_and_p_moves_by_exactly_it(tmp_path: Path) -> None:
    c = coordinator(tmp_path / "state")
    c.register("a", SPECS, 1)
    c.upload_initial("a", START)
    # masters = 0 - g = [127, 2.5, -0.75]; P was 0, so the delta is the same. Its block's
    # absmax is 127: scale 1, levels round half to even: 127, 2, -1.
    c.submit("a", 0, {"w": torch.tensor([-127.0, -2.5, 0.75])})
    assert c.masters["w"].tolist() == [127.0, 2.5, -0.75]
    published = c.model.published_tensors
    assert published is not None and published["w"].tolist() == [127.0, 2.0, -1.0]

    delta = result(c, 0, have=0)  # our anchor is round 0: the delta
    assert delta.delta_from == 0 and delta.round == 1
    anchor = {"w": torch.zeros(3)}
    apply_delta(bytes(delta.body), anchor, parse_codec("int8", block=8))
    assert anchor["w"].tolist() == [127.0, 2.0, -1.0]

    for have in (None, 5):  # no anchor stated, or another one: P whole, in fp32
        whole = result(c, 0, have=have)
        assert whole.delta_from is None
        assert decode_tensors(bytes(whole.body))["w"].tolist() == [127.0, 2.0, -1.0]
    # GET /v1/weights is P too, not the masters: every worker starts from what others hold.
    assert decode_tensors(bytes(c.weights().body))["w"].tolist() == [127.0, 2.0, -1.0]

    # Round 1 moves nothing (g = 0): what int8 left out goes now. masters - P =
    # [0, 0.5, 0.25]: absmax 0.5, so 0.5 goes as level 127 and 0.25 as 63.5 -> 64 (even).
    c.submit("a", 1, {"w": torch.zeros(3)})
    second = result(c, 1, have=1)
    assert second.delta_from == 1
    apply_delta(bytes(second.body), anchor, parse_codec("int8", block=8))
    scale = torch.tensor(0.5) / 127
    expected = torch.tensor([127.0, 2.0, -1.0]) + torch.tensor([0.0, 127.0, 64.0]) * scale
    assert torch.equal(anchor["w"], expected)
    assert torch.equal(c.model.published_tensors["w"], expected)


def test_a_delta_nobody_reads_is_written_over_and_one_being_read_keeps_its_bytes(
    tmp_path: Path,
) -> None:
    """Each step's delta goes into the last step's body when no response reads it any more
    (no new 0.26x-the-model body per round); a slow download's body stays as it was."""
    c = coordinator(tmp_path / "state")
    c.register("a", SPECS, 1)
    c.upload_initial("a", START)
    codec = parse_codec("int8", block=8)
    anchor = {"w": torch.zeros(3)}

    def step(round_number: int, g: list[float]) -> bytearray:
        c.submit("a", round_number, {"w": torch.tensor(g)})
        assert c.model.delta is not None
        return c.model.delta[2].data

    first = step(0, [-127.0, -2.5, 0.75])  # as above: P = [127, 2, -1]
    apply_delta(bytes(result(c, 0, have=0).body), anchor, codec)
    second = step(1, [0.0, 0.0, 0.0])  # nobody holds round 0's delta: written over
    assert second is first
    held = result(c, 1, have=1)  # a download of round 1's delta, still going on
    snapshot = bytes(held.body)
    apply_delta(snapshot, anchor, codec)  # by hand, as above: [127, 2.5, -1 + 64 * 0.5 / 127]
    expected = torch.tensor([127.0, 2.0, -1.0]) + torch.tensor([0.0, 127.0, 64.0]) * (
        torch.tensor(0.5) / 127
    )
    assert torch.equal(anchor["w"], expected)

    third = step(2, [0.0, 0.0, 0.0])  # round 1's body is being read: a new one
    assert third is not second
    assert bytes(held.body) == snapshot
    apply_delta(bytes(result(c, 2, have=2).body), anchor, codec)
    assert torch.equal(anchor["w"], c.model.published_tensors["w"])
    del held
    assert step(3, [0.0, 0.0, 0.0]) is third  # read no more: written over again
    apply_delta(bytes(result(c, 3, have=3).body), anchor, codec)
    assert torch.equal(anchor["w"], c.model.published_tensors["w"])


def test_each_streaming_fragment_writes_its_next_delta_over_its_own_last_one(
    tmp_path: Path,
) -> None:
    """Streaming, two fragments (a, b): each fragment's step writes its delta into that
    fragment's last body when no response reads it (one body per fragment, not a third at
    each commit), never into the other fragment's, which stays as it was; a body being read
    keeps its bytes and the step takes a new one; the old round's result is no longer served."""
    settings = STREAMING
    start = {"a": torch.zeros(3), "b": torch.zeros(3)}
    c = Coordinator(settings, journal=RoundJournal(StateStore(tmp_path / "state"), settings))
    c.register("w", specs_of(start, {"a": "trainable", "b": "trainable"}), 1)
    c.upload_initial("w", start)
    codec = parse_codec("int8", block=8)
    anchor = {"a": torch.zeros(3)}

    def step(round_number: int, fragment: int, g: list[float]) -> bytearray:
        name = "ab"[fragment]
        c.submit("w", round_number, {name: torch.tensor(g)}, fragment=fragment)
        assert c.model.delta is not None and c.model.delta[1] == frozenset(name)
        return c.model.delta[2].data

    def delta_of_a(round_number: int) -> RoundResult:
        got = c.wait_result(round_number, "w", 0.0, fragment=0, have=round_number)
        assert isinstance(got, RoundResult) and got.delta_from == round_number
        return got

    a0 = step(0, 0, [-1.0, 0.0, -0.5])  # sgd, lr 1: a = [1, 0, 0.5]
    b0 = step(0, 1, [0.0, -2.0, 0.0])
    b_bytes = bytes(b0)
    assert b0 is not a0
    apply_delta(bytes(delta_of_a(0).body), anchor, codec)
    # P's a by hand, as in the test above: levels 127, 0, 64 (63.5 to even) times 1 / 127
    assert torch.equal(anchor["a"], torch.tensor([127.0, 0.0, 64.0]) * (torch.tensor(1.0) / 127))
    a1 = step(1, 0, [0.0, 0.0, -0.25])  # nobody reads a's round-0 delta: written over
    assert a1 is a0 and bytes(b0) == b_bytes
    with pytest.raises(Rejection) as expired:
        c.wait_result(0, "w", 0.0, fragment=0, have=0)
    assert expired.value.status == 410
    held = delta_of_a(1)  # a download of a's round-1 delta, still going on
    snapshot = bytes(held.body)
    step(1, 1, [0.0, 0.0, 0.0])
    a2 = step(2, 0, [0.0, 0.0, 0.0])  # a's round-1 body is being read: a new one
    assert a2 is not a1 and bytes(held.body) == snapshot
    apply_delta(snapshot, anchor, codec)
    apply_delta(bytes(delta_of_a(2).body), anchor, codec)
    assert torch.equal(anchor["a"], c.model.published_tensors["a"])
    del held
    step(2, 1, [0.0, 0.0, 0.0])
    assert step(3, 0, [0.0, 0.0, 0.0]) is a2  # read no more: written over again
    apply_delta(bytes(delta_of_a(3).body), anchor, codec)
    assert torch.equal(anchor["a"], c.model.published_tensors["a"])


def test_a_long_poll_that_outlives_a_failed_commit_is_refused_not_answered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker long-polls round 1 while its commit fails coding the delta (P half moved, the
    last delta's body possibly half written over): when its wait ends it gets 503, not a
    result or "waiting" from a model that may no longer match the disk."""
    import threading

    c = coordinator(tmp_path / "state")
    c.register("a", SPECS, 1)
    c.register("b", SPECS, 1)
    c.upload_initial("a", START)
    c.submit("a", 0, {"w": torch.tensor([-127.0, -2.5, 0.75])})
    c.submit("b", 0, {"w": torch.tensor([-127.0, -2.5, 0.75])})
    outcome: list[object] = []

    def long_poll() -> None:
        try:
            outcome.append(c.wait_result(1, "a", 1.0, have=1))
        except Rejection as refused:
            outcome.append(refused)

    def out_of_memory(*args, **kwargs):
        raise MemoryError("no room for the delta body")

    c.submit("a", 1, {"w": torch.zeros(3)})
    poller = threading.Thread(target=long_poll)
    poller.start()
    monkeypatch.setattr(PublishedCopy, "advance", out_of_memory)
    with pytest.raises(Rejection) as refused:
        c.submit("b", 1, {"w": torch.zeros(3)})
    assert refused.value.status == 503
    poller.join(timeout=10)
    (answer,) = outcome
    assert isinstance(answer, Rejection) and answer.status == 503
    assert "coding the download delta of round 2 failed" in str(answer)


def test_p_is_durable_and_a_restarted_server_serves_it_whole(tmp_path: Path) -> None:
    first = coordinator(tmp_path / "state")
    first.register("a", SPECS, 1)
    first.upload_initial("a", START)
    first.submit("a", 0, {"w": torch.tensor([-127.0, -2.5, 0.75])})
    first.journal.settle()  # round 1's checkpoint is on disk (the step log's replay: below)
    shutil.copytree(tmp_path / "state", tmp_path / "copy")  # as kill -9 leaves it

    second = coordinator(tmp_path / "copy")
    assert second.round_number == 1
    assert second.masters["w"].tolist() == [127.0, 2.5, -0.75]
    assert second.model.published_tensors["w"].tolist() == [127.0, 2.0, -1.0]
    # The delta of round 0 died with the process: a worker at round 0 gets P whole.
    assert second.membership.is_live("a")
    assert decode_tensors(bytes(second.weights().body))["w"].tolist() == [127.0, 2.0, -1.0]
    # Both servers then take the same next round to the same P, byte for byte.
    for c in (first, second):
        c.submit("a", 1, {"w": torch.zeros(3)})
    assert result(first, 1, have=1).body == result(second, 1, have=1).body
    assert torch.equal(first.model.published_tensors["w"], second.model.published_tensors["w"])


def test_after_a_rollback_a_round_number_alone_earns_no_delta(tmp_path: Path) -> None:
    """--durability interval: a restart rolls back to the last checkpoint and the same round
    numbers happen again with other weights. A worker that still holds the first timeline's
    round 3 must not get a delta meant for the second timeline's round 3: until this process
    has itself sent it a result, its anchor could be either, so it gets P whole."""
    interval = dict(durability="interval", checkpoint_every=2)
    first = coordinator(tmp_path / "state", **interval)
    first.register("a", SPECS, 1)
    first.upload_initial("a", START)
    for r, g in enumerate(([-8.0, 0.0, 0.0], [0.0, -8.0, 0.0], [0.0, 0.0, -8.0])):
        first.submit("a", r, {"w": torch.tensor(g)})
    assert first.round_number == 3  # round 2 is past the last checkpoint (taken at 2)
    first.journal.settle()
    shutil.copytree(tmp_path / "state", tmp_path / "copy")  # as kill -9 leaves it

    second = coordinator(tmp_path / "copy", **interval)
    assert second.round_number == 2  # rolled back
    second.submit("a", 2, {"w": torch.tensor([0.0, 0.0, 4.0])})  # another round 2
    second.submit("a", 3, {"w": torch.zeros(3)})
    # P was [8, 8, 8] in the first timeline at round 3 and is [8, 8, -4] in this one.
    assert first.model.published_tensors["w"].tolist() == [8.0, 8.0, 8.0]
    assert second.model.published_tensors["w"].tolist() == [8.0, 8.0, -4.0]
    whole = result(second, 3, have=3)
    assert whole.delta_from is None
    assert decode_tensors(bytes(whole.body))["w"].tolist() == [8.0, 8.0, -4.0]
    # Sent round 4 by this process, the worker's next result is a delta again.
    second.submit("a", 4, {"w": torch.zeros(3)})
    assert result(second, 4, have=4).delta_from == 4

    # With durability "round" nothing is ever rolled back: the round names the weights.
    third = coordinator(tmp_path / "round")
    third.register("a", SPECS, 1)
    third.upload_initial("a", START)
    third.submit("a", 0, {"w": torch.tensor([-8.0, 0.0, 0.0])})
    third.journal.settle()
    shutil.copytree(tmp_path / "round", tmp_path / "round-copy")
    fourth = coordinator(tmp_path / "round-copy")
    fourth.submit("a", 1, {"w": torch.zeros(3)})
    assert result(fourth, 1, have=1).delta_from == 1


def test_after_a_restart_a_fragment_never_gets_another_fragment_s_delta(tmp_path: Path) -> None:
    """Streaming, two fragments (a, then b). After a restart fragment a commits first; a
    worker still waiting for fragment b's result of the round before the restart gets b's
    current weights whole, not the delta of a's step (which names other tensors)."""
    settings = STREAMING
    start = {"a": torch.zeros(3), "b": torch.zeros(3)}
    specs = specs_of(start, {"a": "trainable", "b": "trainable"})

    def streaming(state: Path) -> Coordinator:
        return Coordinator(settings, journal=RoundJournal(StateStore(state), settings))

    first = streaming(tmp_path / "state")
    first.register("w", specs, 1)
    first.upload_initial("w", start)
    assert first.model.plan == [["a"], ["b"]]
    first.submit("w", 0, {"a": torch.tensor([-1.0, 0.0, 0.0])}, fragment=0)
    first.submit("w", 0, {"b": torch.tensor([0.0, -2.0, 0.0])}, fragment=1)
    first.journal.settle()
    shutil.copytree(tmp_path / "state", tmp_path / "copy")

    second = streaming(tmp_path / "copy")
    second.submit("w", 1, {"a": torch.tensor([0.0, 0.0, -4.0])}, fragment=0)
    late = second.wait_result(0, "w", 0.0, fragment=1, have=0)
    assert isinstance(late, RoundResult) and late.delta_from is None
    assert decode_tensors(bytes(late.body))["b"].tolist() == [0.0, 2.0, 0.0]


def test_a_fragment_s_full_weights_are_encoded_only_for_a_worker_that_needs_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Streaming, two fragments: a worker at the fragment's last round takes the delta and no
    full copy of the fragment is made (half the model per fragment's result); a worker whose
    anchor is elsewhere gets the fragment whole, encoded then, with the values of the step."""
    settings = STREAMING
    start = {"a": torch.zeros(3), "b": torch.zeros(3)}
    c = Coordinator(settings, journal=RoundJournal(StateStore(tmp_path / "state"), settings))
    c.register("w", specs_of(start, {"a": "trainable", "b": "trainable"}), 1)
    c.upload_initial("w", start)
    encoded: list[list[str]] = []
    encode = c.model.encode
    monkeypatch.setattr(
        c.model, "encode", lambda names: encoded.append(list(names)) or encode(names)
    )
    # sgd, lr 1: a moves to [1, 0, 0.5]; P by its int8 coding (absmax 1: levels 127, 0, 63.5
    # -> 64, half to even, times 1/127)
    c.submit("w", 0, {"a": torch.tensor([-1.0, 0.0, -0.5])}, fragment=0)
    delta = c.wait_result(0, "w", 0.0, fragment=0, have=0)
    assert isinstance(delta, RoundResult) and delta.delta_from == 0
    assert encoded == []  # the delta was enough
    anchor = {"a": torch.zeros(3)}
    apply_delta(bytes(delta.body), anchor, parse_codec("int8", block=8))
    expected = torch.tensor([127.0, 0.0, 64.0]) * (torch.tensor(1.0) / 127)
    assert torch.equal(anchor["a"], expected)
    whole = c.wait_result(0, "w", 0.0, fragment=0, have=None)
    assert isinstance(whole, RoundResult) and whole.delta_from is None
    assert encoded == [["a"]]
    assert torch.equal(decode_tensors(bytes(whole.body))["a"], expected)
    again = c.wait_result(0, "w", 0.0, fragment=0, have=None)
    assert encoded == [["a"]] and bytes(again.body) == bytes(whole.body)  # encoded once


def test_a_failure_while_coding_the_delta_stops_serving_until_a_restart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """P may be half moved when coding fails (memory, say): serving it, or a delta from it,
    could hand workers weights a restart would not have. The server answers 503 instead; the
    step's input was logged before anything moved, so a restart applies it again from the
    checkpoint, where P and the masters agree, and P moves as the masters do."""
    c = coordinator(tmp_path / "state")
    c.register("a", SPECS, 1)
    c.upload_initial("a", START)

    def out_of_memory(*args, **kwargs):
        raise MemoryError("no room for the delta body")

    monkeypatch.setattr(PublishedCopy, "advance", out_of_memory)
    with pytest.raises(Rejection) as refused:
        c.submit("a", 0, {"w": torch.tensor([-127.0, -2.5, 0.75])})
    assert refused.value.status == 503
    assert "coding the download delta of round 1 failed: no room" in str(refused.value)
    with pytest.raises(Rejection) as weights:
        c.weights()
    assert weights.value.status == 503
    monkeypatch.undo()
    shutil.copytree(tmp_path / "state", tmp_path / "copy")  # as kill -9 leaves it
    again = coordinator(tmp_path / "copy")
    assert again.round_number == 1  # replayed from the step log
    # by hand (sgd, lr 1): the masters move by +[127, 2.5, -0.75]; P by their int8 coding
    # (one block, absmax 127: scale 1, so 2.5 rounds to 2 (half to even) and -0.75 to -1)
    assert again.masters["w"].tolist() == [127.0, 2.5, -0.75]
    assert again.model.published_tensors["w"].tolist() == [127.0, 2.0, -1.0]
