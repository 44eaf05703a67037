"""The coordinator driven by method calls (no HTTP): rounds, barriers, membership, rejections.

Time is a fake clock, so eviction and barrier timeouts need no sleeping; `wait_result` is always
called with `wait=0`, which answers at once. Every rejection is checked to leave the state exactly
as it was (masters, optimizer momentum, round, the round's submissions and running sum, members).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import pytest
import torch

from diloco.algorithm import RunningMean, pseudo_gradient
from diloco.server.coordinator import Coordinator, RoundResult, Waiting
from diloco.server.errors import Rejection
from diloco.server.rounds.round import Round
from diloco.server.settings import ServerSettings
from diloco.wire import TensorSpec, decode_tensors, fingerprint, is_worker_id

W_SPEC = [TensorSpec("w", (), torch.float32, "trainable")]
SGD_FEDAVG = {"outer_optimizer": "sgd", "outer_lr": 1.0}
NESTEROV = {"outer_optimizer": "nesterov", "outer_lr": 0.7, "outer_momentum": 0.9}


class FakeClock:
    """A monotonic clock that moves only when a test says so."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def scalar(value: float) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float32)


def make(
    *,
    base: float | None = 10.0,
    workers: tuple[str, ...] = ("a", "b"),
    specs: list[TensorSpec] | None = None,
    initial: dict[str, torch.Tensor] | None = None,
    **settings: Any,
) -> tuple[Coordinator, FakeClock]:
    """A coordinator with scalar weight `w` = base (None: no weights) and `workers` registered."""
    clock = FakeClock()
    if initial is None and base is not None:
        initial = {"w": scalar(base)}
    coordinator = Coordinator(ServerSettings(**settings), initial, clock=clock)
    for worker_id in workers:
        coordinator.register(worker_id, specs or W_SPEC, protocol_version=1)
    return coordinator, clock


def grad(value: float) -> dict[str, torch.Tensor]:
    return {"w": scalar(value)}


# ----------------------------------------------------------------------- state snapshots


def snapshot(c: Coordinator) -> dict[str, Any]:
    """Everything a rejection must leave alone, copied."""
    current = c.round
    running = None if current is None else current.running
    return {
        "masters": None if c.masters is None else {n: t.clone() for n, t in c.masters.items()},
        "optimizer": c.model.optimizer.state_dict(),
        "round": c.round_number,
        "round_object": current,
        "submitted": None if current is None else dict(current.submitted),
        "members": None if current is None else set(current.members),
        "first_submission_at": None if current is None else current.first_submission_at,
        "round_tokens": None if current is None else current.tokens,
        "running_count": None if running is None else running.count,
        "running_sums": None
        if running is None
        else {n: t.clone() for n, t in running.sums.items()},
        "running_totals": None if running is None else dict(running.totals),
        "result": c.model.published,
        "specs": None if c.model.specs is None else dict(c.model.specs),
        "workers": {
            w.worker_id: (w.live, w.session, w.last_seen, w.rounds_contributed, w.step)
            for w in c.membership.workers.values()
        },
        "bytes_in": c.traffic.bytes_in,
        "bytes_out": c.traffic.bytes_out,
        "rounds_committed": c.rounds_committed,
    }


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and torch.equal(a, b)
        )
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a is b if isinstance(a, Round | RoundResult) else a == b


def assert_unchanged(before: dict[str, Any], after: dict[str, Any]) -> None:
    for key in before:
        assert same(before[key], after[key]), f"{key} changed: {before[key]!r} -> {after[key]!r}"


def rejected(c: Coordinator, call: Callable[[], object], status: int, kind: str) -> Rejection:
    """Run `call`, expect Rejection(status, kind) and no change of state; return it."""
    before = snapshot(c)
    with pytest.raises(Rejection) as info:
        call()
    assert (info.value.status, info.value.kind) == (status, kind), info.value.to_body()
    assert info.value.to_body() == {
        "error": info.value.error,
        "kind": kind,
        "detail": info.value.detail,
    }
    assert_unchanged(before, snapshot(c))
    return info.value


def result_of(c: Coordinator, round_number: int, worker_id: str | None = None) -> RoundResult:
    answer = c.wait_result(round_number, worker_id, 0)
    assert isinstance(answer, RoundResult), answer
    return answer


def result_w(c: Coordinator, round_number: int, worker_id: str | None = None) -> float:
    return decode_tensors(result_of(c, round_number, worker_id).body)["w"].item()


# ----------------------------------------------------------------------- 1. reference vectors


@pytest.mark.parametrize("via_upload", [False, True], ids=["init", "first-worker-upload"])
def test_fedavg_two_workers_uniform_gives_15(via_upload: bool) -> None:
    if via_upload:
        c, _ = make(base=None, workers=("a",), **SGD_FEDAVG)
        assert c.upload_initial("a", grad(10.0)) == 0
        c.register("b", W_SPEC, protocol_version=1)
    else:
        c, _ = make(**SGD_FEDAVG)
    # L - G = +2 and +8: pseudo-gradients G - L = -2 and -8.
    g_a = pseudo_gradient({"w": scalar(10.0)}, {"w": scalar(12.0)})
    assert g_a["w"].item() == -2.0
    assert c.submit("a", 0, g_a, tokens=1)["status"] == "accepted"
    assert c.round_number == 0
    answer = c.submit("b", 0, grad(-8.0), tokens=3)
    assert (answer["status"], answer["round"], answer["current_round"]) == ("accepted", 0, 1)
    assert c.round_number == 1
    assert c.masters is not None and c.masters["w"].item() == 15.0
    assert result_w(c, 0, "a") == 15.0
    assert result_of(c, 0).round == 1
    assert c.model.optimizer.state_dict() == {}


def test_token_weighting_gives_16_5() -> None:
    c, _ = make(weighting="tokens", **SGD_FEDAVG)
    c.submit("a", 0, grad(-2.0), tokens=1)
    c.submit("b", 0, grad(-8.0), tokens=3)
    assert c.masters is not None and c.masters["w"].item() == 16.5
    assert result_w(c, 0, "b") == 16.5


def test_outer_lr_half_gives_12_5() -> None:
    c, _ = make(outer_optimizer="sgd", outer_lr=0.5)
    c.submit("a", 0, grad(-2.0))
    c.submit("b", 0, grad(-8.0))
    assert c.masters is not None and c.masters["w"].item() == 12.5
    assert result_w(c, 0) == 12.5


def test_nesterov_two_rounds_give_0_601_then_0_0319() -> None:
    c, _ = make(base=1.0, **NESTEROV)
    # L = 0.8 and 0.6 from G = 1.
    c.submit("a", 0, pseudo_gradient({"w": scalar(1.0)}, {"w": scalar(0.8)}))
    c.submit("b", 0, pseudo_gradient({"w": scalar(1.0)}, {"w": scalar(0.6)}))
    assert c.round_number == 1
    assert c.masters is not None
    assert c.masters["w"].item() == pytest.approx(0.601, abs=1e-6)
    assert result_w(c, 0, "a") == pytest.approx(0.601, abs=1e-6)
    assert c.model.optimizer.state_dict()["w"].item() == pytest.approx(0.3, abs=1e-6)

    c.submit("a", 1, grad(0.2))
    c.submit("b", 1, grad(0.4))
    assert c.round_number == 2
    assert c.masters["w"].item() == pytest.approx(0.0319, abs=1e-6)
    decoded = decode_tensors(result_of(c, 1, "b").body)
    assert decoded["w"].dtype == torch.float32
    assert decoded["w"].item() == pytest.approx(0.0319, abs=1e-6)
    assert decoded["w"].item() == c.masters["w"].item()
    assert c.model.optimizer.state_dict()["w"].item() == pytest.approx(0.57, abs=1e-6)


def test_bf16_download_dtype_encodes_result_in_bf16_from_fp32_masters() -> None:
    c, _ = make(base=1.0, download_dtype=torch.bfloat16, **NESTEROV)
    c.submit("a", 0, grad(0.2))
    c.submit("b", 0, grad(0.4))
    decoded = decode_tensors(result_of(c, 0).body)["w"]
    assert decoded.dtype == torch.bfloat16
    assert c.masters is not None and c.masters["w"].dtype == torch.float32
    assert decoded.item() == scalar(0.601).to(torch.bfloat16).item()


# ----------------------------------------------------------------------- 2. registration


def test_first_worker_without_init_uploads_and_first_upload_wins() -> None:
    c, _ = make(base=None, workers=(), **SGD_FEDAVG)
    assert c.info()["model_fingerprint"] is None
    rejected(c, c.weights, 404, "no_weights")
    first = c.register("a", W_SPEC, protocol_version=1)
    assert first["needs_initial_weights"] is True
    assert first["worker_id"] == "a" and first["round"] == 0
    assert first["settings"] == c.settings.to_wire()
    second = c.register("b", W_SPEC, protocol_version=1)
    assert second["needs_initial_weights"] is True  # nobody has uploaded yet
    assert c.info()["model_fingerprint"] is None

    assert c.upload_initial("b", {"w": scalar(7.0)}) == 0  # b is quicker: b's weights win
    late = rejected(c, lambda: c.upload_initial("a", {"w": scalar(3.0)}), 409, "weights_exist")
    assert late.detail == {"current_round": 0, "initial_from": "b"}  # whose weights won
    assert c.masters is not None and c.masters["w"].item() == 7.0
    assert decode_tensors(c.weights().body)["w"].item() == 7.0
    assert c.register("c", W_SPEC, protocol_version=1)["needs_initial_weights"] is False
    assert c.info()["model_fingerprint"] == fingerprint(W_SPEC)
    # Both uploaders are members of round 0 (c too: nobody has submitted yet).
    assert c.status()["waiting_for"] == ["a", "b", "c"]


def test_workers_that_wait_are_told_one_uploader_and_the_task_moves_when_it_leaves() -> None:
    """Registrants that wait for another's weights: the first is told to upload them, the
    others whom they wait for; a worker that does not wait (the old way) still offers its
    own. Once the uploader leaves, the next waiting worker to register again is told to."""
    c, _ = make(base=None, workers=(), **SGD_FEDAVG)

    def register(worker_id: str, waits: bool = True) -> dict:
        return c.register(
            worker_id, W_SPEC, protocol_version=1, session=f"session-{worker_id}",
            waits_for_initial=waits,
        )  # fmt: skip

    first, second = register("a"), register("b")
    assert (first["needs_initial_weights"], first["initial_upload_by"]) == (True, "a")
    assert (second["needs_initial_weights"], second["initial_upload_by"]) == (False, "a")
    assert register("a")["needs_initial_weights"] is True  # asked again: still a's task
    assert register("b")["needs_initial_weights"] is False
    assert register("old", waits=False)["needs_initial_weights"] is True  # offers its own
    c.deregister("a")  # the uploader left before uploading
    again = register("b")
    assert (again["needs_initial_weights"], again["initial_upload_by"]) == (True, "b")
    assert register("c")["needs_initial_weights"] is False
    assert c.upload_initial("b", {"w": scalar(7.0)}) == 0
    done = register("c")
    assert (done["needs_initial_weights"], done["initial_upload_by"]) == (False, None)


def test_initial_upload_is_validated_and_bf16_upload_becomes_fp32_masters() -> None:
    specs = [TensorSpec("w", (2,), torch.float32, "trainable")]
    c, _ = make(base=None, workers=("a",), specs=specs)
    bad = rejected(
        c,
        lambda: c.upload_initial("a", {"w": torch.tensor([1.0, float("nan")])}),
        422,
        "non_finite",
    )
    assert bad.detail["tensor"] == "w"
    rejected(c, lambda: c.upload_initial("a", {"w": torch.zeros(3)}), 422, "wrong_shape")
    rejected(c, lambda: c.upload_initial("a", {}), 422, "missing_tensor")
    rejected(c, lambda: c.upload_initial("ghost", {"w": torch.zeros(2)}), 404, "unknown_worker")
    assert c.masters is None
    c.upload_initial("a", {"w": torch.tensor([1.5, -2.0], dtype=torch.bfloat16)})
    assert c.masters is not None and c.masters["w"].dtype == torch.float32
    assert c.masters["w"].tolist() == [1.5, -2.0]
    assert c.traffic.bytes_in == 4  # two bf16 elements


def test_with_init_weights_nobody_needs_to_upload() -> None:
    c, _ = make(workers=())
    answer = c.register("a", W_SPEC, protocol_version=1)
    assert answer["needs_initial_weights"] is False
    assert answer["model_fingerprint"] == fingerprint(W_SPEC)
    rejected(c, lambda: c.upload_initial("a", grad(1.0)), 409, "weights_exist")


def test_fingerprint_mismatch_names_the_tensor_and_comes_before_the_id_check() -> None:
    c, _ = make(workers=("a",))
    wrong_shape = [TensorSpec("w", (3,), torch.float32, "trainable")]
    error = rejected(
        c, lambda: c.register("new", wrong_shape, protocol_version=1), 422, "fingerprint_mismatch"
    )
    assert "'w'" in error.error and "[3]" in error.error
    assert error.detail == {"expected": fingerprint(W_SPEC), "got": fingerprint(wrong_shape)}
    # "a" is held by a live worker, but the model check comes first.
    error = rejected(
        c, lambda: c.register("a", wrong_shape, protocol_version=1), 422, "fingerprint_mismatch"
    )
    assert "'w'" in error.error
    extra = [*W_SPEC, TensorSpec("extra.bias", (4,), torch.float32, "trainable")]
    error = rejected(
        c, lambda: c.register("new", extra, protocol_version=1), 422, "fingerprint_mismatch"
    )
    assert "'extra.bias'" in error.error
    error = rejected(
        c, lambda: c.register("new", [], protocol_version=1), 422, "fingerprint_mismatch"
    )
    assert "'w'" in error.error and "missing" in error.error
    int_model = [TensorSpec("steps", (), torch.int64, "int_buffer")]
    c2, _ = make(initial={"steps": torch.tensor(3)}, workers=())
    error = rejected(
        c2,
        lambda: c2.register(
            "x", [TensorSpec("steps", (), torch.int32, "int_buffer")], protocol_version=1
        ),
        422,
        "fingerprint_mismatch",
    )
    assert "'steps'" in error.error and "int32" in error.error
    assert c2.register("x", int_model, protocol_version=1)["worker_id"] == "x"


def test_worker_id_taken_and_same_session_is_idempotent() -> None:
    c, clock = make(workers=())
    c.register("a", W_SPEC, protocol_version=1, session="s1")
    taken = rejected(c, lambda: c.register("a", W_SPEC, protocol_version=1), 409, "worker_id_taken")
    assert taken.detail == {"worker_id": "a"} and "'a'" in taken.error
    rejected(
        c, lambda: c.register("a", W_SPEC, protocol_version=1, session="s2"), 409, "worker_id_taken"
    )
    clock.advance(5)
    again = c.register("a", W_SPEC, protocol_version=1, session="s1")
    assert again["worker_id"] == "a" and again["round"] == 0
    assert c.membership.live_ids() == {"a"}
    assert c.membership.workers["a"].last_seen == clock.now
    # Sessionless duplicates never match each other.
    c.register("b", W_SPEC, protocol_version=1)
    rejected(c, lambda: c.register("b", W_SPEC, protocol_version=1), 409, "worker_id_taken")


def test_evicted_or_deregistered_worker_may_register_again() -> None:
    c, clock = make(workers=("a", "b"), heartbeat_timeout=30.0)
    c.submit("a", 0, grad(-2.0))
    c.deregister("b")  # round 0 commits with a alone
    assert c.round_number == 1
    again = c.register("b", W_SPEC, protocol_version=1)
    assert again["worker_id"] == "b" and again["round"] == 1
    assert c.status()["waiting_for"] == ["a", "b"]  # round 1 has no submission: b joins

    clock.advance(31)
    c.heartbeat("b", 1, 1.0, None, 0)
    assert c.evict_stale() == ["a"]
    assert c.membership.workers["a"].live is False
    assert c.register("a", W_SPEC, protocol_version=1)["worker_id"] == "a"
    assert c.membership.workers["a"].rounds_contributed == 1  # the counters are kept


def test_null_id_gets_a_generated_id_and_bad_ids_are_refused() -> None:
    c, _ = make(workers=())
    one = c.register(None, W_SPEC, protocol_version=1)["worker_id"]
    two = c.register(None, W_SPEC, protocol_version=1)["worker_id"]
    assert one != two and is_worker_id(one) and is_worker_id(two)
    assert c.membership.live_ids() == {one, two}
    for bad in ("", "-starts-with-dash", "has space", "slash/id", "x" * 65, "ü"):
        error = rejected(c, lambda bad=bad: c.register(bad, W_SPEC, 1), 422, "invalid_request")
        assert error.detail["field"] == "worker_id"
    assert c.register("A.b_c-9", W_SPEC, protocol_version=1)["worker_id"] == "A.b_c-9"
    assert c.register("x" * 64, W_SPEC, protocol_version=1)["worker_id"] == "x" * 64


def test_protocol_version_is_checked_first() -> None:
    c, _ = make(workers=("a",))
    wrong = [TensorSpec("w", (9,), torch.float32, "trainable")]
    for version in (2, 0):
        error = rejected(c, lambda v=version: c.register("a", wrong, v), 400, "protocol_version")
        assert error.detail == {"expected": 1, "got": version}


def test_bf16_worker_matches_fp32_model() -> None:
    c, _ = make(workers=("a",), **SGD_FEDAVG)
    bf16 = [TensorSpec("w", (), torch.bfloat16, "trainable")]
    assert fingerprint(bf16) == fingerprint(W_SPEC)
    answer = c.register("b", bf16, protocol_version=1)
    assert answer["model_fingerprint"] == fingerprint(W_SPEC)
    c.submit("a", 0, grad(-2.0))
    c.submit("b", 0, grad(-8.0))  # pseudo-gradients come in the upload dtype (fp32)
    assert c.masters is not None and c.masters["w"].item() == 15.0


# ----------------------------------------------------------------------- 3. barrier


def test_barrier_waits_for_every_member_live_at_round_start() -> None:
    c, _ = make(workers=("a", "b", "c"), **SGD_FEDAVG)
    assert c.submit("a", 0, grad(-3.0))["waiting_for"] == ["b", "c"]
    assert c.wait_result(0, "a", 0) == Waiting(0, ["b", "c"])
    assert c.submit("c", 0, grad(-9.0)) == {
        "status": "accepted",
        "round": 0,
        "fragment": 0,
        "current_round": 0,
        "waiting_for": ["b"],
    }
    assert c.round_number == 0 and c.status()["waiting_for"] == ["b"]
    c.submit("b", 0, grad(-6.0))
    assert c.round_number == 1
    assert result_w(c, 0, "b") == 16.0
    assert c.status()["waiting_for"] == ["a", "b", "c"]


def test_worker_registering_before_first_submission_joins_the_barrier() -> None:
    c, _ = make(workers=("a",), **SGD_FEDAVG)
    c.register("late", W_SPEC, protocol_version=1)
    assert c.round is not None and c.round.members == {"a", "late"}
    assert c.submit("a", 0, grad(-2.0))["waiting_for"] == ["late"]
    assert c.round_number == 0
    c.submit("late", 0, grad(-8.0))
    assert c.round_number == 1 and result_w(c, 0) == 15.0


def test_worker_registering_after_first_submission_does_not_block() -> None:
    c, _ = make(workers=("a", "b"), **SGD_FEDAVG)
    c.submit("a", 0, grad(-3.0))
    c.register("late", W_SPEC, protocol_version=1)
    assert c.round is not None and c.round.members == {"a", "b"}
    assert c.status()["waiting_for"] == ["b"]
    c.submit("b", 0, grad(-6.0))  # round 0 commits without "late"
    assert c.round_number == 1 and result_w(c, 0) == 14.5
    assert c.round.members == {"a", "b", "late"}  # it is a member from the next round


def test_late_worker_submission_before_commit_is_counted_as_extra() -> None:
    c, _ = make(workers=("a", "b"), **SGD_FEDAVG)
    c.submit("a", 0, grad(-3.0))
    c.register("late", W_SPEC, protocol_version=1)
    assert c.submit("late", 0, grad(-9.0)) == {
        "status": "accepted",
        "round": 0,
        "fragment": 0,
        "current_round": 0,
        "waiting_for": ["b"],
    }
    assert c.round_number == 0  # the extra never completes the barrier itself
    c.submit("b", 0, grad(-6.0))
    assert result_w(c, 0, "late") == 16.0  # mean of -3, -9, -6


def test_eviction_releases_survivors_and_commits_their_contributions() -> None:
    c, clock = make(workers=("a", "b", "silent"), heartbeat_timeout=30.0, **SGD_FEDAVG)
    clock.advance(20)
    c.submit("a", 0, grad(-2.0))
    c.heartbeat("b", 10, 1.0, 3.0, 100)
    clock.advance(5)
    c.submit("b", 0, grad(-8.0))
    assert c.wait_result(0, "a", 0) == Waiting(0, ["silent"])
    assert c.evict_stale() == []  # silent for 25 s: not yet past 30
    clock.advance(6)  # silent for 31 s, a for 11 s, b for 6 s
    assert c.evict_stale() == ["silent"]
    assert c.round_number == 1
    assert result_w(c, 0, "a") == 15.0
    assert result_w(c, 0, "b") == 15.0
    assert c.round is not None and c.round.members == {"a", "b"}
    assert [w["live"] for w in c.status()["workers"]] == [True, True, False]


def test_eviction_of_a_worker_that_already_submitted_keeps_its_contribution() -> None:
    c, clock = make(workers=("a", "b"), heartbeat_timeout=30.0, **SGD_FEDAVG)
    c.submit("a", 0, grad(-2.0))
    clock.advance(31)
    c.heartbeat("b", 1, 1.0, None, 0)
    assert c.evict_stale() == ["a"]
    assert c.round_number == 0
    c.submit("b", 0, grad(-8.0))
    assert result_w(c, 0, "b") == 15.0


def test_deregistration_releases_survivors() -> None:
    c, _ = make(workers=("a", "b", "leaver"), **SGD_FEDAVG)
    c.submit("a", 0, grad(-2.0))
    c.submit("b", 0, grad(-8.0))
    assert c.round_number == 0
    c.deregister("leaver")
    assert c.round_number == 1
    assert result_w(c, 0, "a") == 15.0
    rejected(c, lambda: c.deregister("leaver"), 404, "unknown_worker")


def test_min_workers_holds_a_round_until_enough_contributions() -> None:
    c, _ = make(workers=("a",), min_workers=2, **SGD_FEDAVG)
    assert c.submit("a", 0, grad(-2.0))["waiting_for"] == []
    assert c.round_number == 0
    # Nobody to wait for, yet one more worker must join: the answer and the status say so.
    assert c.wait_result(0, "a", 0) == Waiting(0, [], more_submissions_needed=1)
    assert c.status()["more_submissions_needed"] == 1
    c.register("b", W_SPEC, protocol_version=1)  # late: not a member, but its submission counts
    assert c.round_number == 0
    c.submit("b", 0, grad(-8.0))
    assert c.round_number == 1 and result_w(c, 0, "b") == 15.0


def test_min_workers_after_an_eviction_says_that_workers_must_join() -> None:
    """A survivor of an eviction under --min-workers 2 is held, and told why (not silence)."""
    c, clock = make(workers=("a", "b"), min_workers=2, heartbeat_timeout=30.0, **SGD_FEDAVG)
    c.submit("a", 0, grad(-2.0))
    assert c.wait_result(0, "a", 0) == Waiting(0, ["b"], more_submissions_needed=0)
    clock.advance(31)
    c.heartbeat("a", 1, 1.0, None, 0)
    assert c.evict_stale() == ["b"]
    assert c.round_number == 0  # held: one contribution, two required
    assert c.wait_result(0, "a", 0) == Waiting(0, [], more_submissions_needed=1)
    assert c.status()["waiting_for"] == [] and c.status()["more_submissions_needed"] == 1
    c.register("c", W_SPEC, protocol_version=1)  # after the first submission: not a member
    assert c.wait_result(0, "a", 0) == Waiting(0, [], more_submissions_needed=1)
    c.submit("c", 0, grad(-8.0))
    assert c.round_number == 1 and result_w(c, 0, "a") == 15.0


def test_round_with_every_worker_gone_and_no_submission_stays_open() -> None:
    c, _ = make(workers=("a",))
    before = c.masters["w"].clone() if c.masters else None
    c.deregister("a")
    assert c.round_number == 0 and c.masters is not None and torch.equal(c.masters["w"], before)
    c.register("a", W_SPEC, protocol_version=1)
    assert c.status()["waiting_for"] == ["a"]


def test_token_weighted_zero_token_submission_is_refused_and_changes_nothing() -> None:
    """It would weigh nothing (a run of such workers never moved, silently): 422."""
    c, _ = make(base=1.0, weighting="tokens", **NESTEROV)
    error = rejected(c, lambda: c.submit("a", 0, grad(0.2), tokens=0), 422, "tokens_required")
    assert error.detail == {"field": "tokens", "got": 0}
    c.submit("a", 0, grad(0.2), tokens=1)
    c.submit("b", 0, grad(0.4), tokens=3)  # weighted 1 : 3, mean 0.35
    assert c.masters is not None
    assert c.masters["w"].item() == pytest.approx(1.0 - 0.7 * (0.35 + 0.9 * 0.35), abs=1e-6)


# ----------------------------------------------------------------------- 4. idempotency


def test_duplicate_submission_is_counted_once() -> None:
    c, clock = make(**SGD_FEDAVG)
    c.submit("a", 0, grad(-2.0))
    before = snapshot(c)
    clock.advance(1)
    again = c.submit("a", 0, grad(-100.0))  # a retry, even with other bytes, counts once
    assert again == {
        "status": "duplicate",
        "round": 0,
        "fragment": 0,
        "current_round": 0,
        "waiting_for": ["b"],
    }
    after = snapshot(c)
    for key in ("masters", "submitted", "running_count", "running_sums", "round_tokens"):
        assert same(before[key], after[key]), key
    assert c.round is not None and c.round.running is not None and c.round.running.count == 1
    c.submit("b", 0, grad(-8.0))
    assert result_w(c, 0) == 15.0


def test_submission_for_a_committed_round_says_whether_the_round_used_it() -> None:
    """A retry of a pseudo-gradient the committed round folded is "duplicate" (its answer was
    lost: the worker keeps the error-feedback residual it coded that body with); one the
    round went on without is "committed". Neither changes anything."""
    c, _ = make(**SGD_FEDAVG)
    c.submit("a", 0, grad(-2.0))
    c.submit("b", 0, grad(-8.0))
    c.register("c", W_SPEC, protocol_version=1)
    before = snapshot(c)
    answer = c.submit("a", 0, grad(-2.0))  # a's body again: a retry after a lost answer
    assert answer == {
        "status": "duplicate",
        "round": 0,
        "fragment": 0,
        "current_round": 1,
        "waiting_for": [],  # about round 0, which waits for nobody any more
    }
    late = c.submit("c", 0, grad(-50.0))
    assert late == {**answer, "status": "committed"}
    assert_unchanged(
        {k: v for k, v in before.items() if k != "workers"},
        {k: v for k, v in snapshot(c).items() if k != "workers"},
    )
    assert result_w(c, 0, "a") == 15.0


def test_future_round_is_409_with_current_round() -> None:
    c, _ = make()
    error = rejected(c, lambda: c.submit("a", 1, grad(-2.0)), 409, "future_round")
    assert error.detail == {"current_round": 0, "fragment": 0}
    c.submit("a", 0, grad(-2.0))
    c.submit("b", 0, grad(-8.0))
    error = rejected(c, lambda: c.submit("a", 5, grad(-2.0)), 409, "future_round")
    assert error.detail == {"current_round": 1, "fragment": 0}
    error = rejected(c, lambda: c.wait_result(2, "a", 0), 409, "future_round")
    assert error.detail == {"current_round": 1, "fragment": 0}


def test_every_worker_gets_byte_identical_result_and_old_results_expire() -> None:
    c, _ = make(workers=("a", "b", "c"), **NESTEROV)
    for worker, value in (("a", 0.1), ("b", 0.2), ("c", 0.6)):
        c.submit(worker, 0, grad(value))
    bodies = [result_of(c, 0, w).body for w in ("a", "b", "c")]
    assert bodies[0] == bodies[1] == bodies[2]
    assert c.weights().body == bodies[0]  # /v1/weights serves the same encoding
    assert c.weights().round == 1

    for worker, value in (("a", 0.1), ("b", 0.2), ("c", 0.6)):
        c.submit(worker, 1, grad(value))
    assert c.round_number == 2
    expired = rejected(c, lambda: c.wait_result(0, "a", 0), 410, "result_expired")
    assert expired.detail == {"current_round": 2, "fragment": 0}
    latest = result_of(c, 1, "c")
    assert latest.round == 2
    assert latest.body != bodies[0]
    assert decode_tensors(latest.body)["w"].item() == c.masters["w"].item()  # type: ignore[index]


def test_fragment_other_than_zero_is_refused_in_sync_mode() -> None:
    c, clock = make()
    clock.advance(3)
    error = rejected(c, lambda: c.submit("a", 0, grad(-2.0), fragment=1), 422, "invalid_request")
    assert error.detail == {"field": "fragment", "got": 1, "allowed": [0, 0]}
    assert error.error == "field 'fragment' must be 0 (one fragment) in sync mode, got 1"


# ----------------------------------------------------------------------- 5. validation

TWO_SPECS = [
    TensorSpec("layer.weight", (2, 3), torch.float32, "trainable"),
    TensorSpec("layer.bias", (3,), torch.float32, "trainable"),
]


def good_pair() -> dict[str, torch.Tensor]:
    return {"layer.weight": torch.full((2, 3), -2.0), "layer.bias": torch.full((3,), -4.0)}


@pytest.mark.parametrize(
    ("change", "kind", "tensor"),
    [
        (
            lambda t: t.update({"layer.bias": torch.tensor([0.0, float("nan"), 0.0])}),
            "non_finite",
            "layer.bias",
        ),
        (
            lambda t: t.update({"layer.weight": torch.full((2, 3), float("inf"))}),
            "non_finite",
            "layer.weight",
        ),
        (
            lambda t: t.update({"layer.bias": torch.tensor([-float("inf"), 0, 0])}),
            "non_finite",
            "layer.bias",
        ),
        (lambda t: t.update({"layer.weight": torch.zeros(3, 2)}), "wrong_shape", "layer.weight"),
        (lambda t: t.update({"layer.bias": torch.zeros(())}), "wrong_shape", "layer.bias"),
        (lambda t: t.update({"layer.extra": torch.zeros(3)}), "unknown_tensor", "layer.extra"),
        (lambda t: t.pop("layer.bias"), "missing_tensor", "layer.bias"),
        (
            lambda t: t.update({"layer.bias": torch.zeros(3, dtype=torch.bfloat16)}),
            "wrong_dtype",
            "layer.bias",
        ),
        (
            lambda t: t.update({"layer.weight": torch.zeros(2, 3, dtype=torch.float64)}),
            "wrong_dtype",
            "layer.weight",
        ),
    ],
    ids=[
        "nan",
        "inf",
        "minus-inf",
        "shape",
        "shape-scalar",
        "unknown",
        "missing",
        "bf16-when-fp32",
        "fp64",
    ],
)
def test_invalid_submission_is_422_naming_the_tensor_and_changes_nothing(
    change: Callable[[dict[str, torch.Tensor]], object], kind: str, tensor: str
) -> None:
    initial = {"layer.weight": torch.ones(2, 3), "layer.bias": torch.zeros(3)}
    c, clock = make(initial=initial, specs=TWO_SPECS, **SGD_FEDAVG)
    c.submit("b", 0, good_pair())  # the round already has a running sum to protect
    clock.advance(2)
    body = good_pair()
    change(body)
    error = rejected(c, lambda: c.submit("a", 0, body), 422, kind)
    assert error.detail["tensor"] == tensor
    assert repr(tensor) in error.error
    # The rejected worker can still submit a good pseudo-gradient for the same round.
    c.submit("a", 0, {"layer.weight": torch.full((2, 3), -4.0), "layer.bias": torch.zeros(3)})
    assert c.round_number == 1
    assert c.masters is not None
    assert torch.equal(c.masters["layer.weight"], torch.full((2, 3), 4.0))
    assert torch.equal(c.masters["layer.bias"], torch.full((3,), 2.0))
    decoded = decode_tensors(result_of(c, 0, "a").body)
    assert torch.equal(decoded["layer.weight"], torch.full((2, 3), 4.0))
    assert torch.equal(decoded["layer.bias"], torch.full((3,), 2.0))


def test_bf16_upload_dtype_wants_bf16_pseudo_gradients() -> None:
    c, _ = make(upload_dtype=torch.bfloat16, **SGD_FEDAVG)
    error = rejected(c, lambda: c.submit("a", 0, grad(-2.0)), 422, "wrong_dtype")
    assert error.detail == {"tensor": "w", "expected": "bfloat16", "got": "float32"}
    c.submit("a", 0, {"w": torch.tensor(-2.0, dtype=torch.bfloat16)})
    c.submit("b", 0, {"w": torch.tensor(-8.0, dtype=torch.bfloat16)})
    assert c.masters is not None and c.masters["w"].dtype == torch.float32
    assert c.masters["w"].item() == 15.0
    assert c.traffic.bytes_in == 4


# ----------------------------------------------------------------------- 6. barrier timeout


def test_barrier_timeout_is_504_naming_the_missing_and_the_round_recovers() -> None:
    c, clock = make(workers=("a", "b", "c"), barrier_timeout=60.0, **SGD_FEDAVG)
    clock.advance(500)  # time before the first submission does not count
    assert c.wait_result(0, None, 0) == Waiting(0, ["a", "b", "c"])
    c.submit("a", 0, grad(-3.0))
    c.submit("b", 0, grad(-6.0))
    clock.advance(60)
    assert c.wait_result(0, "a", 0) == Waiting(0, ["c"])  # exactly at the timeout: not yet
    clock.advance(0.5)
    error = rejected(c, lambda: c.wait_result(0, "a", 0), 504, "barrier_timeout")
    assert error.detail == {"waiting_for": ["c"], "round": 0, "fragment": 0}
    assert "'c'" in error.error
    rejected(c, lambda: c.wait_result(0, None, 0), 504, "barrier_timeout")
    assert c.round_number == 0
    c.submit("c", 0, grad(-9.0))
    assert c.round_number == 1
    assert result_w(c, 0, "a") == 16.0
    # Round 1 starts with a fresh clock for its barrier.
    assert c.wait_result(1, None, 0) == Waiting(1, ["a", "b", "c"])


# ----------------------------------------------------------------------- 7. unknown workers


def test_unknown_and_evicted_workers_get_404() -> None:
    c, clock = make(heartbeat_timeout=30.0)
    for who in ("ghost", "a"):
        if who == "a":
            clock.advance(31)
            c.heartbeat("b", 1, 1.0, None, 0)
            assert c.evict_stale() == ["a"]
        error = rejected(c, lambda w=who: c.submit(w, 0, grad(-2.0)), 404, "unknown_worker")
        assert error.detail == {"worker_id": who} and repr(who) in error.error
        rejected(c, lambda w=who: c.heartbeat(w, 1, 1.0, None, 0), 404, "unknown_worker")
        rejected(c, lambda w=who: c.wait_result(0, w, 0), 404, "unknown_worker")
        rejected(c, lambda w=who: c.deregister(w), 404, "unknown_worker")
        rejected(c, lambda w=who: c.upload_initial(w, grad(1.0)), 404, "unknown_worker")


# ----------------------------------------------------------------------- 8. status and info


def test_heartbeat_updates_status() -> None:
    c, clock = make(**SGD_FEDAVG)
    clock.advance(4)
    answer = c.heartbeat("a", 120, 3.5, 2.25, 4096)
    assert answer == {"round": 0, "recommended_sync_every": None, "command": None}
    clock.advance(2.5)
    workers = {w["worker_id"]: w for w in c.status()["workers"]}
    assert workers["a"] == {
        "worker_id": "a",
        "live": True,
        "step": 120,
        "steps_per_second": 3.5,
        "loss": 2.25,
        "tokens": 4096,
        "last_seen_seconds_ago": 2.5,
        "rounds_contributed": 0,
        "recommended_sync_every": None,
    }
    assert workers["b"]["last_seen_seconds_ago"] == 6.5
    assert workers["b"]["step"] == 0 and workers["b"]["loss"] is None
    c.heartbeat("a", 121, 3.0, None, 5000)
    c.submit("a", 0, grad(-2.0))
    c.submit("b", 0, grad(-8.0))
    workers = {w["worker_id"]: w for w in c.status()["workers"]}
    assert workers["a"]["step"] == 121 and workers["a"]["loss"] is None
    assert workers["a"]["tokens"] == 5000 and workers["a"]["steps_per_second"] == 3.0
    assert workers["a"]["rounds_contributed"] == 1 and workers["a"]["last_seen_seconds_ago"] == 0
    assert c.heartbeat("b", 5, 1.0, 1.0, 10)["round"] == 1


def test_status_and_info_report_round_fingerprint_and_bytes() -> None:
    specs = [TensorSpec("w", (4,), torch.float32, "trainable")]
    c, clock = make(base=None, workers=(), specs=specs, **SGD_FEDAVG)
    info = c.info()
    assert info == {
        "protocol_version": 1,
        "mode": "sync",
        "round": 0,
        "fragment_rounds": [0],
        "fragment_plan": None,
        "model_fingerprint": None,
        "settings": c.settings.to_wire(),
    }
    assert info["settings"]["outer_optimizer"] == {"kind": "sgd", "lr": 1.0, "momentum": 0.0}
    status = c.status()
    assert status["round"] == 0 and status["mode"] == "sync" and status["workers"] == []
    assert status["waiting_for"] == [] and status["bytes_in"] == 0 and status["bytes_out"] == 0
    assert status["rounds_per_hour"] == 0.0

    c.register("a", specs, protocol_version=1)
    c.upload_initial("a", {"w": torch.zeros(4)})
    assert c.info()["model_fingerprint"] == fingerprint(specs)
    assert c.status()["bytes_in"] == 16
    body = c.weights().body
    assert c.status()["bytes_out"] == len(body)
    c.register("b", specs, protocol_version=1)
    c.submit("a", 0, {"w": torch.full((4,), -1.0)})
    assert c.wait_result(0, "a", 0) == Waiting(0, ["b"])
    assert c.status()["bytes_out"] == len(body)  # waiting sends nothing
    assert c.status()["waiting_for"] == ["b"]
    clock.advance(1800)
    c.submit("b", 0, {"w": torch.full((4,), -3.0)})
    result = result_of(c, 0, "b")
    status = c.status()
    assert status["round"] == 1 and c.info()["round"] == 1
    assert status["bytes_in"] == 16 * 3
    assert status["bytes_out"] == len(body) + len(result.body)
    assert status["uptime_seconds"] == 1800.0
    assert status["rounds_per_hour"] == 2.0
    assert decode_tensors(result.body)["w"].tolist() == [2.0] * 4


# ----------------------------------------------------------------------- 9. memory


def test_round_holds_one_running_sum_not_one_copy_per_worker() -> None:
    workers = tuple(f"w{i}" for i in range(5))
    initial = {"layer.weight": torch.zeros(2, 3), "layer.bias": torch.zeros(3)}
    c, _ = make(initial=initial, specs=TWO_SPECS, workers=workers, min_workers=6, **SGD_FEDAVG)
    sent = []
    for i, worker in enumerate(workers):
        body = {"layer.weight": torch.full((2, 3), float(i)), "layer.bias": torch.full((3,), -1.0)}
        sent.append(body)
        c.submit(worker, 0, body)
    current = c.round
    assert current is not None and c.round_number == 0  # held by min_workers
    assert isinstance(current.running, RunningMean)
    assert current.running.count == 5 and current.contributions == 5
    assert set(current.running.sums) == {"layer.weight", "layer.bias"}
    assert torch.equal(current.running.sums["layer.weight"], torch.full((2, 3), 10.0))
    assert torch.equal(current.running.sums["layer.bias"], torch.full((3,), -5.0))
    # Nothing else in the round holds tensors: the submissions are bookkeeping only.
    for name, value in vars(current).items():
        if name != "running":
            assert not isinstance(value, torch.Tensor), name
            values = value.values() if isinstance(value, dict) else ()
            assert not any(isinstance(v, torch.Tensor | dict) for v in values), name
    assert set(current.submitted) == {(w, 0) for w in workers}
    # The sums live in buffers the server keeps for every round, not in a sent body, and the
    # senders' tensors are never written.
    sums_at = current.running.sums["layer.weight"].data_ptr()
    frames = c.model.frames
    assert frames is not None and frames.sums()["layer.weight"].data_ptr() == sums_at
    assert all(sums_at != body["layer.weight"].data_ptr() for body in sent)
    assert torch.equal(sent[0]["layer.weight"], torch.zeros(2, 3))
    masters_at = c.masters["layer.weight"].data_ptr()  # type: ignore[index]
    c.register("w5", TWO_SPECS, protocol_version=1)
    c.submit("w5", 0, {"layer.weight": torch.full((2, 3), 2.0), "layer.bias": torch.zeros(3)})
    assert c.round_number == 1
    assert current.running is None  # released at the commit
    assert c.masters is not None
    assert torch.equal(c.masters["layer.weight"], torch.full((2, 3), -2.0))
    assert torch.equal(c.masters["layer.bias"], torch.full((3,), 5.0 / 6.0))
    assert c.masters["layer.weight"].data_ptr() == masters_at  # updated in place


# ----------------------------------------------------------------------- 10. int / bool buffers


BUFFER_SPECS = [
    TensorSpec("w", (), torch.float32, "trainable"),
    TensorSpec("norm.running_mean", (2,), torch.float32, "float_buffer"),
    TensorSpec("norm.num_batches", (4,), torch.int64, "int_buffer"),
    TensorSpec("mask", (4,), torch.bool, "bool_buffer"),
]
ANCHOR = {
    "w": scalar(1.0),
    "norm.running_mean": torch.tensor([1.0, -1.0]),
    "norm.num_batches": torch.tensor([10, 10, 10, 10]),
    "mask": torch.tensor([True, False, True, False]),
}
LOCALS = [
    {
        "w": scalar(0.8),
        "norm.running_mean": torch.tensor([3.0, 0.0]),
        "norm.num_batches": torch.tensor([11, 12, 10, 13]),
        "mask": torch.tensor([True, True, False, False]),
    },
    {
        "w": scalar(0.6),
        "norm.running_mean": torch.tensor([5.0, 1.0]),
        "norm.num_batches": torch.tensor([12, 13, 11, 10]),
        "mask": torch.tensor([False, True, False, True]),
    },
]


@pytest.mark.parametrize("via_upload", [False, True], ids=["init", "first-worker-upload"])
def test_int_and_bool_buffers_follow_the_apply_policy(via_upload: bool) -> None:
    if via_upload:
        c, _ = make(base=None, workers=("a",), specs=BUFFER_SPECS, **NESTEROV)
        c.upload_initial("a", ANCHOR)
    else:
        c, _ = make(initial=ANCHOR, workers=("a",), specs=BUFFER_SPECS, **NESTEROV)
    c.register("b", BUFFER_SPECS, protocol_version=1)
    assert c.model.specs is not None and c.model.specs["norm.running_mean"].kind == "float_buffer"
    c.submit("a", 0, pseudo_gradient(ANCHOR, LOCALS[0]))
    # Int and bool pseudo-gradients may also come in their own dtype.
    second = pseudo_gradient(ANCHOR, LOCALS[1])
    second["norm.num_batches"] = second["norm.num_batches"].to(torch.int64)
    c.submit("b", 0, second)
    assert c.round_number == 1
    decoded = decode_tensors(result_of(c, 0, "a").body)
    assert decoded["w"].item() == pytest.approx(0.601, abs=1e-6)  # the outer optimizer
    # A float buffer (kind from registration) is the plain mean of the locals.
    assert decoded["norm.running_mean"].tolist() == [4.0, 0.5]
    # Means 11.5, 12.5, 10.5, 11.5: rounded half to even.
    assert decoded["norm.num_batches"].dtype == torch.int64
    assert decoded["norm.num_batches"].tolist() == [12, 12, 10, 12]
    # Means 0.5, 1, 0, 0.5: True at >= 0.5.
    assert decoded["mask"].dtype == torch.bool
    assert decoded["mask"].tolist() == [True, True, False, True]
    assert c.masters is not None
    assert c.masters["norm.num_batches"].dtype == torch.int64
    assert c.masters["mask"].dtype == torch.bool
    assert set(c.model.optimizer.state_dict()) == {"w"}  # only trainable tensors have momentum


def test_bool_buffer_below_half_is_false_with_three_workers() -> None:
    specs = [TensorSpec("mask", (3,), torch.bool, "bool_buffer")]
    anchor = {"mask": torch.tensor([False, False, True])}
    c, _ = make(initial=anchor, specs=specs, workers=("a", "b", "c"))
    locals_ = [[True, False, True], [False, True, False], [False, True, False]]
    for worker, local in zip(("a", "b", "c"), locals_, strict=True):
        c.submit(worker, 0, pseudo_gradient(anchor, {"mask": torch.tensor(local)}))
    assert decode_tensors(result_of(c, 0).body)["mask"].tolist() == [False, True, False]
