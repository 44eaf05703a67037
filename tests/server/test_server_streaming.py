"""Streaming mode in the coordinator (no HTTP): per-fragment rounds, barriers and momentum."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from crashes import killed
from test_server_coordinator import FakeClock, rejected, scalar

from diloco.server.coordinator import Coordinator
from diloco.server.model.global_model import fragment_plan
from diloco.server.settings import ServerSettings
from diloco.server.state.journal import RoundJournal
from diloco.server.state.store import StateStore
from diloco.wire import TensorSpec, decode_tensors

# Two repeated blocks and a head: fragment 0 = blocks.0 + head (the lighter one gets what is
# outside the blocks), fragment 1 = blocks.1.
SPECS = [
    TensorSpec("blocks.0.w", (), torch.float32, "trainable"),
    TensorSpec("blocks.1.w", (), torch.float32, "trainable"),
    TensorSpec("head.w", (), torch.float32, "trainable"),
]
INITIAL = {"blocks.0.w": 10.0, "blocks.1.w": 20.0, "head.w": 30.0}
F0, F1 = ["blocks.0.w", "head.w"], ["blocks.1.w"]
STREAMING = {"mode": "streaming", "sync_every": 4, "fragments": 2, "delay": 1, "alpha": 0.5}


def streaming(
    workers=("a", "b"), state_dir: Path | None = None, fresh: bool = True, **settings
) -> tuple[Coordinator, FakeClock]:
    clock = FakeClock()
    config = ServerSettings(**{**STREAMING, **settings})
    journal = RoundJournal(StateStore(state_dir), config) if state_dir is not None else None
    initial = {n: scalar(v) for n, v in INITIAL.items()} if fresh else None
    c = Coordinator(config, initial, clock=clock, journal=journal)
    for worker in workers:
        c.register(worker, SPECS, protocol_version=1)
    return c, clock


def grads(names: list[str], value: float) -> dict[str, torch.Tensor]:
    return {n: scalar(value) for n in names}


def weights(c: Coordinator) -> dict[str, float]:
    assert c.masters is not None
    return {n: t.item() for n, t in c.masters.items()}


def test_the_plan_strides_blocks_and_is_published() -> None:
    c, _ = streaming()
    assert c.plan == [F0, F1]
    info = c.info()
    assert info["mode"] == "streaming" and info["fragment_plan"] == [F0, F1]
    assert info["fragment_rounds"] == [0, 0] and info["round"] == 0
    # Without recognisable blocks the cut is contiguous by parameter count.
    flat = [TensorSpec(f"t{i}", (n,), torch.float32, "trainable") for i, n in enumerate([3, 1, 4])]
    assert fragment_plan(flat, 2) == [["t0", "t1"], ["t2"]]
    with pytest.raises(ValueError, match=r"fragments must be in \[1, 2\] \(the number of blocks\)"):
        fragment_plan(SPECS, 3)


def test_fragment_rounds_share_one_pool_of_sums_unless_two_are_open_at_once(monkeypatch) -> None:
    """Fragment rounds that fold one after another write their sums over one pool the size of
    the largest fragment (F0: two scalars), not over a model-sized set; a round that opens
    while another fragment's is still open gets memory of its own. The means are the same
    either way (by hand: outer SGD, lr 1, G - mean)."""
    c, _ = streaming(outer_optimizer="sgd", outer_lr=1.0)
    opened: list[tuple[bool, dict[str, int]]] = []
    real = c.model.fragment_sums_storage

    def spy(names, fresh=False):
        storage = real(names, fresh=fresh)
        opened.append((fresh, {n: t.data_ptr() for n, t in storage.items()}))
        return storage

    monkeypatch.setattr(c.model, "fragment_sums_storage", spy)
    c.submit("a", 0, grads(F0, 1.0), fragment=0)
    c.submit("b", 0, grads(F0, 3.0), fragment=0)  # mean 2: 10 - 2, 30 - 2
    c.submit("a", 0, grads(F1, -1.0), fragment=1)
    c.submit("b", 0, grads(F1, -3.0), fragment=1)  # mean -2: 20 + 2
    assert weights(c) == {"blocks.0.w": 8.0, "blocks.1.w": 22.0, "head.w": 28.0}
    frames = c.model.frames
    assert frames is not None and frames._pool is not None and frames._sums is None
    pool = frames._pool.data_ptr()
    assert frames._pool.numel() == 2  # the largest fragment's, not the model's 3
    assert [fresh for fresh, _ in opened] == [False, False]  # opened once a round
    assert opened[0][1]["blocks.0.w"] == opened[1][1]["blocks.1.w"] == pool
    # Fragment 0's round 1 is open (a has sent, b not yet) when fragment 1's opens.
    c.submit("a", 1, grads(F0, 0.5), fragment=0)
    c.submit("a", 1, grads(F1, 1.0), fragment=1)
    c.submit("b", 1, grads(F1, 3.0), fragment=1)  # mean 2: 22 - 2
    c.submit("b", 1, grads(F0, 1.5), fragment=0)  # mean 1: 8 - 1, 28 - 1
    assert [fresh for fresh, _ in opened[2:]] == [False, True]
    assert opened[3][1]["blocks.1.w"] != pool
    assert weights(c) == {"blocks.0.w": 7.0, "blocks.1.w": 20.0, "head.w": 27.0}


def test_screened_fragment_rounds_decide_into_the_shared_pool() -> None:
    """Robust aggregation holds a round's bodies until it decides; the decision folds them
    into the same fragment pool. By hand (algorithm/robust.py's rule): fragment 0's norms 1,
    1.2 and 50, median 1.2, so 50 (over 10x) is refused and the mean of the others is
    1.1 * (0.6, 0.8); outer SGD at lr 1 moves it by minus that."""
    specs = [TensorSpec(n, (2,), torch.float32, "trainable") for n in ("t0", "t1")]
    config = ServerSettings(
        **STREAMING, aggregation="clipped_mean", outer_optimizer="sgd", outer_lr=1.0
    )
    c = Coordinator(config, {"t0": torch.tensor([10.0, 10.0]), "t1": torch.tensor([20.0, 20.0])})
    for worker in ("a", "b", "c"):
        c.register(worker, specs, protocol_version=1)
    assert c.plan == [["t0"], ["t1"]]
    unit = torch.tensor([0.6, 0.8])
    for worker, k in (("a", 1.0), ("b", 1.2), ("c", 50.0)):
        c.submit(worker, 0, {"t0": k * unit}, fragment=0)
    for worker in ("a", "b", "c"):
        c.submit(worker, 0, {"t1": unit}, fragment=1)
    assert c.masters is not None
    assert c.masters["t0"].tolist() == pytest.approx([10 - 0.66, 10 - 0.88])
    assert c.masters["t1"].tolist() == pytest.approx([19.4, 19.2])
    frames = c.model.frames
    assert frames is not None and frames._sums is None
    assert frames._pool is not None and frames._pool.numel() == 2


def test_a_fragment_step_touches_only_its_tensors_and_its_momentum() -> None:
    c, _ = streaming(outer_optimizer="nesterov", outer_lr=0.7, outer_momentum=0.9)
    c.submit("a", 0, grads(F0, 0.2), fragment=0)
    assert c.submit("b", 0, grads(F0, 0.2), fragment=0)["current_round"] == 1
    # Nesterov lr 0.7, mu 0.9 on g = 0.2: G - 0.7 * (0.2 + 0.9 * 0.2) = G - 0.266.
    assert weights(c) == pytest.approx({"blocks.0.w": 9.734, "blocks.1.w": 20.0, "head.w": 29.734})
    assert set(c.model.optimizer.state_dict()) == set(F0)
    assert c.info()["fragment_rounds"] == [1, 0] and c.version == 1
    result = c.wait_result(0, "a", 0, fragment=0)
    assert result.round == 1 and result.fragment == 0
    assert set(decode_tensors(result.body)) == set(F0)  # only the fragment travels back
    c.submit("a", 0, grads(F1, -1.0), fragment=1)
    c.submit("b", 0, grads(F1, -3.0), fragment=1)
    assert weights(c)["blocks.1.w"] == pytest.approx(20.0 + 0.7 * (2.0 + 0.9 * 2.0))
    assert weights(c)["blocks.0.w"] == pytest.approx(9.734)  # fragment 0 untouched by it
    assert set(c.model.optimizer.state_dict()) == {*F0, *F1}
    assert c.info()["fragment_rounds"] == [1, 1] and c.version == 2
    rows = c.journal.state.committed_rounds()
    assert [(r["round"], r["fragment"], r["fragment_round"]) for r in rows] == [
        (0, 0, 0),
        (1, 1, 0),
    ]


def test_fragment_rounds_have_their_own_barriers_and_idempotency() -> None:
    c, _ = streaming()
    c.submit("a", 0, grads(F0, 1.0), fragment=0)
    assert c.submit("a", 0, grads(F0, 9.0), fragment=0)["status"] == "duplicate"
    # Fragment 1's round 0 waits for a and b independently of fragment 0's.
    c.submit("a", 0, grads(F1, 1.0), fragment=1)
    assert c.status()["waiting_for"] == ["b"] and c.version == 0
    c.submit("b", 0, grads(F1, 1.0), fragment=1)
    assert c.info()["fragment_rounds"] == [0, 1]
    assert c.submit("b", 0, grads(F1, 5.0), fragment=1)["status"] == "duplicate"  # used
    assert c.submit("b", 0, grads(F0, 5.0), fragment=0)["status"] == "accepted"
    c.register("c", SPECS, protocol_version=1)
    assert c.submit("c", 0, grads(F1, 5.0), fragment=1)["status"] == "committed"  # not used
    future = rejected(c, lambda: c.submit("a", 2, grads(F1, 1.0), fragment=1), 409, "future_round")
    assert future.detail == {"current_round": 1, "fragment": 1}
    assert "round 2 of fragment 1" in future.error


def test_bad_fragment_submissions_are_422_and_change_nothing() -> None:
    c, _ = streaming()
    out_of_range = rejected(
        c, lambda: c.submit("a", 0, grads(F0, 1.0), fragment=2), 422, "invalid_request"
    )
    assert out_of_range.error == "field 'fragment' must be in [0, 1] in streaming mode, got 2"
    other = rejected(
        c,
        lambda: c.submit("a", 0, {**grads(F0, 1.0), "blocks.1.w": scalar(1.0)}, fragment=0),
        422,
        "wrong_fragment",
    )
    assert other.detail == {"tensor": "blocks.1.w", "fragment": 0, "belongs_to": 1}
    missing = rejected(
        c, lambda: c.submit("a", 0, grads(["blocks.0.w"], 1.0), fragment=0), 422, "missing_tensor"
    )
    assert missing.detail == {"tensor": "head.w"}
    nan = rejected(
        c, lambda: c.submit("a", 0, grads(F1, float("nan")), fragment=1), 422, "non_finite"
    )
    assert nan.detail["tensor"] == "blocks.1.w"
    rejected(c, lambda: c.wait_result(0, "a", 0, fragment=5), 422, "invalid_request")


def test_a_late_worker_joins_each_fragment_at_its_next_round() -> None:
    c, _ = streaming()
    c.submit("a", 0, grads(F0, 1.0), fragment=0)  # fragment 0's round 0 has begun
    c.register("c", SPECS, protocol_version=1)
    rounds = c.engine.rounds
    assert rounds[0].members == {"a", "b"}  # c is not awaited where someone already waits
    assert rounds[1].members == {"a", "b", "c"}  # fragment 1's round 0 has no submission yet
    c.submit("b", 0, grads(F0, 1.0), fragment=0)
    assert c.info()["fragment_rounds"] == [1, 0]  # committed without c
    assert c.engine.rounds[0].members == {"a", "b", "c"}  # its next round waits for c too
    c.submit("a", 0, grads(F1, 1.0), fragment=1)
    c.submit("b", 0, grads(F1, 1.0), fragment=1)
    assert c.engine.rounds[1].waiting_for() == ["c"]
    c.submit("c", 0, grads(F1, 3.0), fragment=1)
    assert c.info()["fragment_rounds"] == [1, 1]


def test_a_restart_resumes_every_fragment_round(tmp_path: Path) -> None:
    c, _ = streaming(state_dir=tmp_path)
    c.submit("a", 0, grads(F0, 1.0), fragment=0)
    c.submit("b", 0, grads(F0, 3.0), fragment=0)
    c.submit("a", 0, grads(F1, 1.0), fragment=1)  # open, not durable: lost with the crash
    before = weights(c)
    killed(c)  # as if killed: no flush
    again, _ = streaming(workers=(), state_dir=tmp_path, fresh=False)
    assert weights(again) == before
    assert again.info()["fragment_rounds"] == [1, 0] and again.version == 1
    assert set(again.model.optimizer.state_dict()) == set(F0)
    # round 0 of fragment 0 used a's: its retry after the restart is "duplicate"
    assert again.submit("a", 0, grads(F0, 9.0), fragment=0)["status"] == "duplicate"
    # a's fragment 1 submission did not survive: it is told to send it again.
    rejected(again, lambda: again.wait_result(0, "a", 0, fragment=1), 409, "not_submitted")
    again.submit("a", 0, grads(F1, 1.0), fragment=1)
    again.submit("b", 0, grads(F1, 1.0), fragment=1)
    assert again.info()["fragment_rounds"] == [1, 1]
    weights_result = again.weights()
    assert weights_result.round == 2 and weights_result.fragment_rounds == (1, 1)


def test_a_model_with_fewer_blocks_than_fragments_is_refused_at_registration() -> None:
    clock = FakeClock()
    c = Coordinator(ServerSettings(**STREAMING), None, clock=clock)
    one_block = [TensorSpec("blocks.0.w", (), torch.float32, "trainable")]
    error = rejected(
        c, lambda: c.register("a", one_block, protocol_version=1), 422, "fragments_do_not_fit"
    )
    assert "fragments must be in [1, 1]" in error.error
    assert c.model.specs is None and not c.membership.workers


def test_each_fragment_s_header_limit_counts_its_own_tensors() -> None:
    """By hand: 64 KiB + 4 x (name bytes + 160) per tensor of the fragment; every tensor for
    the initial weights; none before the model is known, for a fragment outside the plan, or
    for one without tensors here (another shard's: its 409 wrong_shard comes from the body's
    own check, not a 413 from its header's length)."""
    bare = Coordinator(ServerSettings(**STREAMING), None, clock=FakeClock())
    assert bare.max_header_bytes(0) is None and bare.max_header_bytes(None) is None
    c, _ = streaming()
    assert c.max_header_bytes(0) == 65536 + 4 * (10 + 160) + 4 * (6 + 160)  # blocks.0.w, head.w
    assert c.max_header_bytes(1) == 65536 + 4 * (10 + 160)
    assert c.max_header_bytes(None) == 65536 + 4 * (10 + 160) * 2 + 4 * (6 + 160)
    assert c.max_header_bytes(2) is None and c.max_header_bytes(-1) is None
    c.model.fixed_plan = [F0, []]  # as a streaming shard holds another shard's fragment
    assert c.model.specs is not None
    c.model.set_specs(c.model.specs, kinds_known=True)
    assert c.max_header_bytes(1) is None and c.max_header_bytes(0) == 65536 + 4 * 170 + 4 * 166
