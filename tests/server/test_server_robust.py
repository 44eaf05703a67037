"""Robust aggregation on the server (`--aggregation clipped_mean`), checked against values
worked by hand from the rule (algorithm/robust.py's docstring): a pseudo-gradient whose L2
norm is over 10x the median of recent norms (this round's and the last 32 accepted) is
refused; one over 2x it is scaled down to 2x. Outer SGD at lr 1, so each step moves the
weights by minus the mean of what it used.

The pseudo-gradients are multiples of (0.6, 0.8), whose norm is 1: g = k (0.6, 0.8) has
norm k, so every median and scale below is plain arithmetic on the k's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from crashes import killed

from diloco.server.coordinator import Coordinator
from diloco.server.settings import ServerSettings
from diloco.server.state.journal import RoundJournal
from diloco.server.state.store import StateStore
from diloco.wire import TensorSpec

SPECS = [
    TensorSpec("w", (2,), torch.float32, "trainable"),
    TensorSpec("count", (), torch.int64, "int_buffer"),
]
UNIT = torch.tensor([0.6, 0.8])


def make(
    state: Path | None = None, workers: tuple[str, ...] = ("a", "b", "c"), **settings
) -> Coordinator:
    settings = {"outer_optimizer": "sgd", "outer_lr": 1.0, "aggregation": "clipped_mean",
                **settings}  # fmt: skip
    if settings.get("mode") == "async":
        settings.update(outer_optimizer="nesterov", outer_momentum=0.0)
    journal = RoundJournal(StateStore(state), ServerSettings(**settings))
    restored = state is not None and any((state / "checkpoints").glob("gen-*"))
    initial = {"w": torch.tensor([10.0, 10.0]), "count": torch.tensor(0)}
    c = Coordinator(journal.settings, None if restored else initial, journal=journal)
    for worker in workers:
        if not c.membership.is_live(worker):
            c.register(worker, SPECS, 1)
    return c


def send(c: Coordinator, worker: str, round_number: int, k: float) -> dict:
    return c.submit(worker, round_number, {"w": k * UNIT, "count": torch.tensor(0)})


def w(c: Coordinator) -> list[float]:
    return c.masters["w"].tolist()


def test_a_sync_round_refuses_an_outlier_and_clips_a_large_norm(tmp_path: Path) -> None:
    c = make(tmp_path)
    for worker, k in (("a", 1.0), ("b", 1.2), ("c", 50.0)):
        send(c, worker, 0, k)
    # Median of (1, 1.2, 50) is 1.2: 50 > 12 is refused; the mean of 1 and 1.2 is 1.1.
    assert w(c) == pytest.approx([10 - 1.1 * 0.6, 10 - 1.1 * 0.8], abs=1e-6)
    for worker, k in (("a", 1.0), ("b", 3.0), ("c", 2.0)):
        send(c, worker, 1, k)
    # History (1, 1.2) and this round's (1, 3, 2): median 1.2, bound 2.4; b's 3 scaled by 0.8.
    # Mean of 1, 2.4 and 2 is 1.8.
    assert w(c) == pytest.approx([9.34 - 1.8 * 0.6, 9.12 - 1.8 * 0.8], abs=1e-5)
    (refused,) = c.journal.state.audit_log("contribution_refused")
    assert (refused["worker_id"], refused["round"]) == ("c", 0)
    assert refused["detail"]["reason"] == (
        "pseudo-gradient norm 50 is more than 10x the median norm 1.2"
    )
    rendered = c.metrics.render().decode()
    assert 'diloco_screened_contributions_total{outcome="refused"} 1.0' in rendered
    assert 'diloco_screened_contributions_total{outcome="clipped"} 1.0' in rendered
    (clipped,) = c.journal.state.audit_log("contribution_clipped")
    assert (clipped["worker_id"], clipped["round"]) == ("b", 1)
    assert clipped["detail"]["scale"] == pytest.approx(0.8)
    assert clipped["detail"]["norm"] == pytest.approx(3.0)
    killed(c)


def test_the_norm_history_survives_a_restart(tmp_path: Path) -> None:
    first = make(tmp_path)
    for worker, k in (("a", 1.0), ("b", 1.2), ("c", 50.0)):
        send(first, worker, 0, k)
    killed(first)  # as kill -9 leaves it
    again = make(tmp_path)
    for worker, k in (("a", 1.0), ("b", 3.0), ("c", 2.0)):
        send(again, worker, 1, k)
    # The same 7.1 as without the restart; with the history forgotten the median would be 2,
    # nothing clipped, and w[0] = 9.34 - 2 x 0.6 = 8.14.
    assert w(again) == pytest.approx([9.34 - 1.8 * 0.6, 9.12 - 1.8 * 0.8], abs=1e-5)
    killed(again)


def test_a_round_whose_every_pseudo_gradient_is_refused_changes_nothing() -> None:
    c = make(outer_optimizer="momentum", outer_momentum=0.5)
    for round_number in range(4):  # history: twelve norms of 1
        for worker in ("a", "b", "c"):
            send(c, worker, round_number, 1.0)
    before, momentum = w(c), c.model.optimizer.state_dict()
    for worker in ("a", "b", "c"):
        send(c, worker, 4, 1e6)  # median 1 (twelve 1s, three 1e6): all over 10, all refused
    assert c.round_number == 5
    assert w(c) == before
    after = c.model.optimizer.state_dict()
    assert after.keys() == momentum.keys() and all(
        torch.equal(after[k], momentum[k]) for k in after
    )
    assert [e["worker_id"] for e in c.journal.state.audit_log("contribution_refused")] == [
        "a",
        "b",
        "c",
    ]


def test_async_arrivals_are_screened_one_by_one() -> None:
    c = make(mode="async")
    send(c, "a", 0, 1.0)  # alone: median 1, kept
    send(c, "b", 0, 1.2)  # median of (1, 1.2) = 1.1, bound 2.2: kept
    send(c, "c", 0, 50.0)  # median of (1, 1.2, 50) = 1.2: refused, a step that changes nothing
    assert c.version == 3
    assert w(c) == pytest.approx([10 - 2.2 * 0.6, 10 - 2.2 * 0.8], abs=1e-5)
    send(c, "a", 1, 3.0)  # median of (1, 1.2, 3) = 1.2, bound 2.4: scaled to 2.4
    assert w(c) == pytest.approx([10 - 4.6 * 0.6, 10 - 4.6 * 0.8], abs=1e-5)
    assert [e["worker_id"] for e in c.journal.state.audit_log("contribution_refused")] == ["c"]
    assert [e["worker_id"] for e in c.journal.state.audit_log("contribution_clipped")] == ["a"]


def test_the_plain_mean_screens_nothing() -> None:
    c = make(aggregation="mean")
    for worker, k in (("a", 1.0), ("b", 1.2), ("c", 50.0)):
        send(c, worker, 0, k)
    mean = (1.0 + 1.2 + 50.0) / 3
    assert w(c) == pytest.approx([10 - mean * 0.6, 10 - mean * 0.8], abs=1e-5)
    assert c.journal.state.audit_log("contribution_refused") == []


ELEMENTWISE = {  # (values per element); norms 5.48, 2.24, 9.54, 4.58, 3.74: none refused
    "a": [1.0, 5.0, -2.0],
    "b": [2.0, 1.0, 0.0],
    "c": [9.0, 3.0, 1.0],
    "d": [4.0, -1.0, 2.0],
    "e": [3.0, 2.0, 1.0],
}
WIDE = [TensorSpec("w", (3,), torch.float32, "trainable")]


@pytest.mark.parametrize(
    ("aggregation", "expected"),
    [
        # Per element, sorted: [1, 2, 3, 4, 9], [-1, 1, 2, 3, 5], [-2, 0, 1, 1, 2].
        ("median", [10 - 3, 10 - 2, 10 - 1]),
        # trimmed_mean:0.2 of 5 drops one from each end: (2+3+4)/3, (1+2+3)/3, (0+1+1)/3.
        ("trimmed_mean:0.2", [10 - 3, 10 - 2, 10 - 2 / 3]),
    ],
)
def test_elementwise_rules_combine_what_screening_keeps(aggregation: str, expected) -> None:
    settings = ServerSettings(outer_optimizer="sgd", outer_lr=1.0, aggregation=aggregation)
    c = Coordinator(settings, {"w": torch.full((3,), 10.0)})
    workers = {**ELEMENTWISE, "f": [1000.0, 1000.0, 1000.0]}  # norm 1732: over 10x 5.03
    for worker in workers:
        c.register(worker, WIDE, 1)
    for worker, values in workers.items():
        c.submit(worker, 0, {"w": torch.tensor(values)})
    assert c.masters["w"].tolist() == pytest.approx(expected, abs=1e-6)
    assert [e["worker_id"] for e in c.journal.state.audit_log("contribution_refused")] == ["f"]


def test_sparse_mean_averages_each_element_over_its_senders_and_replays_from_the_log(
    tmp_path: Path,
) -> None:
    """--aggregation sparse_mean, outer SGD lr 1, by hand: a sends w = (0.4, 0), b (0, -0.6):
    each element has one sender, so the step is (0.4, -0.6) (the plain mean would halve it);
    then a (1, 2), b (3, 0): (2, 2). The float buffer bn is not trained: it takes the plain
    mean of what both sent, (0.5 + 0) / 2 = 0.25, then (1 + 0) / 2 = 0.5, as the simulator
    does. The step log holds the means (totals 1 for w): a restart that replays both steps
    from it, with no checkpoint since round 0, ends on the same bits."""
    settings = ServerSettings(
        outer_optimizer="sgd", outer_lr=1.0, aggregation="sparse_mean", min_workers=2
    )
    specs = [SPECS[0], TensorSpec("bn", (1,), torch.float32, "float_buffer")]
    journal = RoundJournal(StateStore(tmp_path), settings, checkpoint_every=3)
    c = Coordinator(settings, {"w": torch.tensor([10.0, 10.0]), "bn": torch.tensor([1.0])},
                    journal=journal)  # fmt: skip
    for worker in ("a", "b"):
        c.register(worker, specs, 1)
    rounds = ((([0.4, 0.0], 0.5), ([0.0, -0.6], 0.0)), (([1.0, 2.0], 1.0), ([3.0, 0.0], 0.0)))
    for number, sent in enumerate(rounds):
        for worker, (values, bn) in zip(("a", "b"), sent, strict=True):
            c.submit(worker, number, {"w": torch.tensor(values), "bn": torch.tensor([bn])})
    assert c.round_number == 2
    assert w(c) == pytest.approx([10.0 - 0.4 - 2.0, 10.0 + 0.6 - 2.0], abs=1e-6)
    assert c.masters["bn"].tolist() == pytest.approx([1.0 - 0.25 - 0.5])
    weights = c.masters["w"].clone()
    c.journal.settle()
    assert c.journal.state.steps.generations() == [0, 1]  # no checkpoint since round 0
    c.journal.state.close()
    again = Coordinator(
        settings, journal=RoundJournal(StateStore(tmp_path), settings, checkpoint_every=3)
    )
    assert again.round_number == 2 and torch.equal(again.masters["w"], weights)


@pytest.mark.parametrize(
    ("settings", "needle"),
    [
        ({"aggregation": "median", "mode": "async"}, "mode async applies each arrival alone"),
        ({"aggregation": "trimmed_mean:0.1", "upload_codec": "int8"}, "compressed uploads"),
        ({"aggregation": "clipped_mean", "weighting": "tokens"}, "weighs every pseudo-gradient"),
        ({"aggregation": "trimmed_mean:0.5"}, "must be in [0, 0.5)"),
        ({"aggregation": "mode"}, "aggregation must be one of mean, clipped_mean"),
        ({"aggregation": "sparse_mean", "mode": "async"}, "needs mode sync or streaming"),
        ({"aggregation": "sparse_mean", "weighting": "tokens"}, "and weighting uniform"),
        ({"aggregation": "clipped_mean", "clip_multiple": -1.0}, "clip multiple must be > 0"),
        ({"aggregation": "clipped_mean", "outlier_ratio": 1.0}, "outlier ratio must be > 1"),
    ],
)
def test_bad_aggregation_settings_are_refused(settings: dict, needle: str) -> None:
    with pytest.raises(ValueError) as caught:
        ServerSettings(**settings)
    assert needle in str(caught.value)


def test_banning_a_worker_drops_its_held_pseudo_gradient() -> None:
    c = make()
    send(c, "a", 0, 1.0)
    send(c, "c", 0, 4.0)  # held until b is in
    answer = c.admin.evict("c", "admin", ban=True, reason="hostile")
    assert answer["pending_dropped"] is True and c.round_number == 0
    send(c, "b", 0, 1.2)
    assert w(c) == pytest.approx([10 - 1.1 * 0.6, 10 - 1.1 * 0.8], abs=1e-6)  # a and b only
    (refused,) = c.journal.state.audit_log("contribution_refused")
    assert (refused["worker_id"], refused["detail"]["reason"]) == ("c", "worker banned by an admin")


def test_a_read_that_fails_while_a_round_decides_leaves_it_holding_everything(
    monkeypatch,
) -> None:
    c = make(workers=("a", "b", "c", "d"))
    send(c, "d", 0, 1.0)
    c.admin.evict("d", "admin", ban=True)  # its held update dropped: recorded, kept so
    send(c, "a", 0, 1.0)
    send(c, "b", 0, 1.2)
    import diloco.server.rounds.robust as screening

    real_fold = screening.fold
    calls = []

    def failing(*args, **kwargs):
        calls.append(args[1].worker_id)
        if len(calls) == 2:
            raise OSError("spool file ended early")
        return real_fold(*args, **kwargs)

    monkeypatch.setattr(screening, "fold", failing)
    with pytest.raises(OSError):
        send(c, "c", 0, 2.0)
    current = c.round
    assert c.round_number == 0 and current.running is None and len(current.held) == 3
    assert current.norms == current.clipped == {}
    assert current.refused == {"d": "worker banned by an admin"}
    monkeypatch.setattr(screening, "fold", real_fold)
    c.evict_stale()  # the server's next tick (each second) decides the round again
    assert w(c) == pytest.approx([10 - 1.4 * 0.6, 10 - 1.4 * 0.8], abs=1e-6)  # mean 1, 1.2, 2


def test_a_read_that_fails_inside_a_held_body_s_fold_does_not_stop_the_server(
    monkeypatch,
) -> None:
    """The same failure raised inside the fold of the second held body (its sums opened by
    the screened fold, so the fold itself took it for a body torn into others' sums): it
    stopped the server (503 until restarted), though the round had gone back to holding
    everything with no sums. The error is the read's, the server serves on, and the next
    tick decides the round."""
    from diloco.server.rounds.round import Round

    c = make()
    send(c, "a", 0, 1.0)
    send(c, "b", 0, 1.2)
    real_add = Round.add
    calls = []

    def failing(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise OSError("spool file ended early")
        return real_add(self, *args, **kwargs)

    monkeypatch.setattr(Round, "add", failing)
    with pytest.raises(OSError, match="spool file ended early"):
        send(c, "c", 0, 2.0)
    assert c.model.broken is None
    assert c.round_number == 0 and c.round.running is None and len(c.round.held) == 3
    monkeypatch.setattr(Round, "add", real_add)
    c.evict_stale()  # the server's next tick decides the round again
    assert w(c) == pytest.approx([10 - 1.4 * 0.6, 10 - 1.4 * 0.8], abs=1e-6)  # mean 1, 1.2, 2


def test_a_sign_flipped_pseudo_gradient_of_honest_norm_is_refused() -> None:
    c = make(workers=("a", "b", "c", "d"))
    for worker, k in (("a", 1.0), ("b", 1.2), ("c", 0.9), ("d", -1.1)):
        send(c, worker, 0, k)
    # Norms 1, 1.2, 0.9, 1.1: none refused or clipped (median 1.05). Per element the median
    # of the k's is (0.9 + 1) / 2 > 0, so d's cosine with it is -1: refused. Mean of the rest:
    # (1 + 1.2 + 0.9) / 3.
    mean = (1.0 + 1.2 + 0.9) / 3
    assert w(c) == pytest.approx([10 - mean * 0.6, 10 - mean * 0.8], abs=1e-6)
    (refused,) = c.journal.state.audit_log("contribution_refused")
    assert refused["worker_id"] == "d" and "cosine -1.000" in refused["detail"]["reason"]


def test_a_model_with_a_scalar_parameter_is_screened_like_any_other() -> None:
    """A 0-dim trained tensor (a learned temperature) in a screened round: the round decides
    instead of failing. By hand: each worker sends k (0.6, 0.8) for w and k for t, so the
    norms are k sqrt(2): 1.41, 1.70, 1.27, 1.56, none clipped (median 1.48); the median of
    the k's is 0.95 > 0 for every element, so d (k = -1.1) has cosine -1 and is refused;
    the rest's mean k is (1 + 1.2 + 0.9) / 3."""
    specs = [
        TensorSpec("w", (2,), torch.float32, "trainable"),
        TensorSpec("t", (), torch.float32, "trainable"),
    ]
    settings = ServerSettings(outer_optimizer="sgd", outer_lr=1.0, aggregation="clipped_mean")
    c = Coordinator(settings, {"w": torch.tensor([10.0, 10.0]), "t": torch.tensor(2.0)})
    for worker in ("a", "b", "c", "d"):
        c.register(worker, specs, 1)
    for worker, k in (("a", 1.0), ("b", 1.2), ("c", 0.9), ("d", -1.1)):
        c.submit(worker, 0, {"w": k * UNIT, "t": torch.tensor(k)})
    mean = (1.0 + 1.2 + 0.9) / 3
    assert c.round_number == 1
    assert w(c) == pytest.approx([10 - mean * 0.6, 10 - mean * 0.8], abs=1e-6)
    assert c.masters["t"].item() == pytest.approx(2 - mean, abs=1e-6)
