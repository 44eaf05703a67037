"""One server's step log holds each round's bodies, durable as they came, not its sums: a
restart folds them again, in the order they were folded, to the same weights bit for bit."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from crashes import killed

from diloco.server.coordinator import Coordinator
from diloco.server.errors import Rejection
from diloco.server.settings import ServerSettings
from diloco.server.state.journal import RoundJournal
from diloco.server.state.store import StateStore
from diloco.wire import encode_tensors, specs_of
from diloco.wire.format.spool import open_spooled

# bf16 uploads: two bodies hold fewer bytes than the fp32 sums, so the log holds the bodies
SETTINGS = ServerSettings(sync_every=2, min_workers=2, upload_dtype=torch.bfloat16)
START = {"w": torch.tensor([1.0, 2.0, 3.0])}  # (an int buffer's delta would make a bf16 body
SPECS = specs_of(START, {"w": "trainable"})  # larger than the sums at this size)


def coordinator(state: Path, settings: ServerSettings = SETTINGS, **kwargs) -> Coordinator:
    journal = RoundJournal(StateStore(state), settings, **kwargs)
    try:
        return Coordinator(settings, journal=journal)
    except BaseException:
        journal.state.close()
        raise


class Bodies:
    """Upload bodies as the HTTP intake spools them: files on disk, opened piece by piece;
    `sent` keeps each body's bytes, to check the log against by hand."""

    def __init__(self, directory: Path, dtype: torch.dtype = torch.bfloat16) -> None:
        self.directory = directory
        self.dtype = dtype
        directory.mkdir(exist_ok=True)
        self.sent: list[bytes] = []

    def submit(self, c: Coordinator, worker: str, number: int, w: list[float]) -> dict:
        data = encode_tensors({"w": torch.tensor(w, dtype=self.dtype)})
        self.sent.append(bytes(data))
        path = self.directory / f"{len(self.sent)}.body"
        path.write_bytes(data)
        spooled = open_spooled(path)
        try:
            return c.submit(worker, number, spooled)
        finally:
            spooled.close()


def started(state: Path, **kwargs) -> Coordinator:
    c = coordinator(state, **kwargs)
    c.register("a", SPECS, 1)
    c.upload_initial("a", START)
    c.register("b", SPECS, 1)
    return c


# each round's two bodies: b first in round 1, so the log keeps the order they came in
CHAIN = [  # (values bf16 holds exactly)
    (("a", [0.25, 0.5, -0.125]), ("b", [0.5, 0.0, 0.375])),
    (("b", [0.125, -0.375, 0.25]), ("a", [-0.375, 0.125, 0.0625])),
    (("a", [0.375, 0.375, 0.375]), ("b", [0.5, -0.5, 0.125])),
]


def nesterov_by_hand(start: list[float], rounds) -> tuple[list[float], list[float]]:
    """Weights and momentum after `rounds` (the mean of each round's two bodies), written
    out: buffer = 0.9 * buffer + g, then w -= 0.7 * (g + 0.9 * buffer)."""
    w, buffer = list(start), [0.0] * len(start)
    for (_, x), (_, y) in rounds:
        for i in range(len(w)):
            g = (x[i] + y[i]) / 2
            buffer[i] = 0.9 * buffer[i] + g
            w[i] -= 0.7 * (g + 0.9 * buffer[i])
    return w, buffer


def weighs_as_by_hand(c: Coordinator, rounds) -> bool:
    w, _ = nesterov_by_hand([1.0, 2.0, 3.0], rounds)
    return torch.allclose(c.masters["w"], torch.tensor(w), rtol=1e-6)


def run_chain(c: Coordinator, bodies: Bodies, rounds=CHAIN) -> None:
    for number, pair in enumerate(rounds):
        for worker, values in pair:
            bodies.submit(c, worker, number, values)
    c.journal.settle()


def test_a_round_logs_its_bodies_as_they_came_and_not_its_sums(tmp_path: Path) -> None:
    state = tmp_path / "state"
    c = started(state, checkpoint_every=10)
    bodies = Bodies(tmp_path / "sent")
    run_chain(c, bodies, CHAIN[:2])
    assert c.round_number == 2
    steps = state / "steps"
    assert sorted(p.name for p in steps.glob("gen-*")) == ["gen-000000000000", "gen-000000000001"]
    step_1 = steps / "gen-000000000001"
    assert sorted(p.name for p in step_1.iterdir()) == [
        "input-0000.body",
        "input-0001.body",
        "manifest.json",
    ]  # no sums-*.safetensors
    manifest = json.loads((step_1 / "manifest.json").read_text())
    # round 1's bodies in the order they came: b's (the third sent), then a's
    for name, sent in (("input-0000.body", bodies.sent[2]), ("input-0001.body", bodies.sent[3])):
        assert (step_1 / name).read_bytes() == sent
        assert manifest["files"][name] == {
            "bytes": len(sent),
            "sha256": hashlib.sha256(sent).hexdigest(),
        }
    inputs = manifest["metadata"]["inputs"]
    assert [(i["file"], i["worker"], i["round"]) for i in inputs] == [
        ("input-0000.body", "b", 1),
        ("input-0001.body", "a", 1),
    ]
    assert manifest["metadata"]["count"] == 2
    assert list((state / "inputs").iterdir()) == []  # every copy moved into its step
    assert weighs_as_by_hand(c, CHAIN[:2])
    killed(c)


def test_steps_logged_as_bodies_are_folded_again_to_the_same_weights_bit_for_bit(
    tmp_path: Path,
) -> None:
    state, copy = tmp_path / "state", tmp_path / "copy"
    first = started(state, checkpoint_every=10)
    bodies = Bodies(tmp_path / "sent")
    run_chain(first, bodies)
    assert first.journal.state.steps.generations() == [0, 1, 2]
    shutil.copytree(state, copy)  # as kill -9 leaves it
    second = coordinator(copy, checkpoint_every=10)
    assert second.round_number == 3
    assert torch.equal(second.masters["w"], first.masters["w"])
    momentum = second.model.optimizer.state_dict()["w"]
    assert torch.equal(momentum, first.model.optimizer.state_dict()["w"])
    w, buffer = nesterov_by_hand([1.0, 2.0, 3.0], CHAIN)
    assert torch.allclose(second.masters["w"], torch.tensor(w), rtol=1e-6)
    assert torch.allclose(momentum, torch.tensor(buffer), rtol=1e-6)
    (restarted,) = second.journal.state.audit_log("restarted")
    assert restarted["detail"]["replayed_steps"] == [0, 1, 2]
    assert second.journal.state.steps.generations() == []  # checkpointed by the restart
    assert [r["round"] for r in second.journal.state.committed_rounds()] == [0, 1, 2]
    # and both go on alike
    for c in (first, second):
        bodies.submit(c, "a", 3, [0.125, 0.125, 0.125])
        bodies.submit(c, "b", 3, [0.375, 0.25, 0.125])
    assert first.weights().body == second.weights().body
    killed(first)
    killed(second)


def test_a_body_that_does_not_verify_sets_its_step_aside_with_the_steps_after_it(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    first = started(state, checkpoint_every=10)
    run_chain(first, Bodies(tmp_path / "sent"))
    killed(first)
    broken = state / "steps" / "gen-000000000001" / "input-0001.body"
    data = bytearray(broken.read_bytes())
    data[-1] ^= 0xFF
    broken.write_bytes(bytes(data))
    second = coordinator(state, checkpoint_every=10)
    assert second.round_number == 1 and second.sent_rounds.rollback_possible
    aside = sorted(p.name[:16] for p in (state / "steps-set-aside").iterdir())
    assert aside == ["gen-000000000001", "gen-000000000002"]
    assert weighs_as_by_hand(second, CHAIN[:1])
    killed(second)


def test_a_body_of_a_round_that_never_committed_is_gone_at_restart(tmp_path: Path) -> None:
    """The round was open: its workers send again, so its body is not needed."""
    state = tmp_path / "state"
    first = started(state)
    bodies = Bodies(tmp_path / "sent")
    answer = bodies.submit(first, "a", 0, [0.25, 0.5, -0.125])
    assert answer["status"] == "accepted" and answer["waiting_for"] == ["b"]
    (kept,) = (state / "inputs").iterdir()
    assert kept.read_bytes() == bodies.sent[0]
    killed(first)
    second = coordinator(state)
    assert list((state / "inputs").iterdir()) == []
    assert second.round_number == 0
    assert bodies.submit(second, "a", 0, [0.25, 0.5, -0.125])["status"] == "accepted"
    assert bodies.submit(second, "b", 0, [0.5, 0.0, 0.375])["status"] == "accepted"
    assert weighs_as_by_hand(second, CHAIN[:1])
    killed(second)


def test_a_refused_or_duplicate_body_leaves_no_copy(tmp_path: Path) -> None:
    state = tmp_path / "state"
    c = started(state)
    bodies = Bodies(tmp_path / "sent")
    with pytest.raises(Rejection) as caught:
        bodies.submit(c, "a", 0, [0.25, float("nan"), 0.125])
    assert caught.value.status == 422 and caught.value.kind == "non_finite"
    assert list((state / "inputs").iterdir()) == []
    assert bodies.submit(c, "a", 0, [0.25, 0.5, -0.125])["status"] == "accepted"
    assert bodies.submit(c, "a", 0, [0.25, 0.5, -0.125])["status"] == "duplicate"
    assert len(list((state / "inputs").iterdir())) == 1  # the first one's only
    killed(c)


def test_a_round_with_a_body_held_in_memory_logs_its_sums(tmp_path: Path) -> None:
    """A body that never was a file (--memory-bodies) has no copy: that round's step logs
    its sums as before, and its other body's copy goes."""
    state = tmp_path / "state"
    c = started(state, checkpoint_every=10)
    Bodies(tmp_path / "sent").submit(c, "a", 0, [0.25, 0.5, -0.125])
    c.submit("b", 0, {"w": torch.tensor([0.5, 0.0, 0.375], dtype=torch.bfloat16)})
    c.journal.settle()
    step_0 = state / "steps" / "gen-000000000000"
    names = sorted(p.name for p in step_0.iterdir())
    assert (
        names[0] == "manifest.json" and names[1:] and all(n.startswith("sums-") for n in names[1:])
    )
    assert list((state / "inputs").iterdir()) == []
    weights = c.masters["w"].clone()
    killed(c)
    again = coordinator(state, checkpoint_every=10)
    assert torch.equal(again.masters["w"], weights)
    killed(again)


def sums_logged(state: Path, step: int) -> bool:
    """Whether step `step`'s log holds its sums (and no bodies)."""
    names = sorted(p.name for p in (state / "steps" / f"gen-{step:012d}").iterdir())
    sums = names[1:]
    return names[0] == "manifest.json" and bool(sums) and all(n.startswith("sums-") for n in sums)


def test_a_disk_that_cannot_take_a_copy_leaves_its_round_logging_its_sums(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The upload is folded all the same (a worker is never turned away for the log's sake),
    and its step's log holds the sums, as before bodies were logged."""
    from diloco.server.state import step_inputs

    def full_disk(*_args) -> None:
        raise OSError(28, "No space left on device")

    state = tmp_path / "state"
    c = started(state, checkpoint_every=10)
    bodies = Bodies(tmp_path / "sent")
    with monkeypatch.context() as patched:
        patched.setattr(step_inputs, "copy_prefix", full_disk)
        assert bodies.submit(c, "a", 0, [0.25, 0.5, -0.125])["status"] == "accepted"
    (copy,) = c.round.inputs
    assert copy.failed
    assert bodies.submit(c, "b", 0, [0.5, 0.0, 0.375])["status"] == "accepted"
    c.journal.settle()
    assert c.round_number == 1 and c.model.broken is None and sums_logged(state, 0)
    assert list((state / "inputs").iterdir()) == []  # both copies went
    for worker, values in CHAIN[1]:  # the next round logs its bodies again
        bodies.submit(c, worker, 1, values)
    c.journal.settle()
    step_1 = state / "steps" / "gen-000000000001"
    assert sorted(p.name for p in step_1.glob("*.body")) == ["input-0000.body", "input-0001.body"]
    weights = c.masters["w"].clone()
    killed(c)
    again = coordinator(state, checkpoint_every=10)
    assert torch.equal(again.masters["w"], weights)
    killed(again)


def test_a_body_whose_fsync_failed_leaves_its_round_logging_its_sums(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from diloco.server.state import step_inputs

    def failing_fsync(_fd: int) -> None:
        raise OSError(5, "Input/output error")

    state = tmp_path / "state"
    c = started(state, checkpoint_every=10)
    bodies = Bodies(tmp_path / "sent")
    with monkeypatch.context() as patched:
        patched.setattr(step_inputs, "_fsync", failing_fsync)
        assert bodies.submit(c, "a", 0, [0.25, 0.5, -0.125])["status"] == "accepted"
        (copy,) = c.round.inputs
        with pytest.raises(OSError, match="Input/output error"):
            copy.durable()  # (its fsync, after the copy, before the patch goes)
    assert copy.failed
    assert bodies.submit(c, "b", 0, [0.5, 0.0, 0.375])["status"] == "accepted"
    c.journal.settle()
    assert c.round_number == 1 and c.model.broken is None and sums_logged(state, 0)
    assert list((state / "inputs").iterdir()) == []
    killed(c)


def test_fp32_bodies_of_two_workers_log_the_sums_and_of_one_worker_the_body(tmp_path: Path) -> None:
    """Two fp32 bodies are twice the sums' bytes to fsync: that round logs its sums. One
    fp32 worker's body is the sums' size and saves their write at the commit."""
    fp32 = ServerSettings(sync_every=2, min_workers=2)
    state = tmp_path / "two"
    c = coordinator(state, fp32, checkpoint_every=10)
    c.register("a", SPECS, 1)
    c.upload_initial("a", START)
    c.register("b", SPECS, 1)
    bodies = Bodies(tmp_path / "sent", torch.float32)
    run_chain(c, bodies, CHAIN[:1])
    assert c.round_number == 1 and sums_logged(state, 0)
    assert list((state / "inputs").iterdir()) == []
    killed(c)
    one = ServerSettings(sync_every=2, min_workers=1)
    state = tmp_path / "one"
    c = coordinator(state, one, checkpoint_every=10)
    c.register("a", SPECS, 1)
    c.upload_initial("a", START)
    bodies.submit(c, "a", 0, [0.25, 0.5, -0.125])
    c.journal.settle()
    step_0 = state / "steps" / "gen-000000000000"
    assert sorted(p.name for p in step_0.iterdir()) == ["input-0000.body", "manifest.json"]
    assert (step_0 / "input-0000.body").read_bytes() == bodies.sent[-1]
    killed(c)
