"""--download-codec: results are coded deltas against the published weights P, which the
server moves exactly as a worker moves its anchor, keeps durable, and serves whole to a worker
whose anchor is anywhere else. Every expected value is worked out by hand."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from diloco.algorithm.codecs import parse_codec
from diloco.server.coordinator import Coordinator
from diloco.server.journal import RoundJournal
from diloco.server.results import RoundResult
from diloco.server.settings import ServerSettings
from diloco.server.store import StateStore
from diloco.wire import decode_tensors, specs_of
from diloco.wire.compressed import apply_delta

# Plain averaging (outer SGD, lr 1): masters <- masters - mean(g). int8 with blocks of 8.
SETTINGS = ServerSettings(
    sync_every=2, outer_optimizer="sgd", outer_lr=1.0, download_codec="int8", codec_block=8
)
START = {"w": torch.zeros(3)}
SPECS = specs_of(START, {"w": "trainable"})


def coordinator(state: Path) -> Coordinator:
    return Coordinator(SETTINGS, journal=RoundJournal(StateStore(state), SETTINGS))


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


def test_p_is_durable_and_a_restarted_server_serves_it_whole(tmp_path: Path) -> None:
    first = coordinator(tmp_path / "state")
    first.register("a", SPECS, 1)
    first.upload_initial("a", START)
    first.submit("a", 0, {"w": torch.tensor([-127.0, -2.5, 0.75])})
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
