"""Durable rounds: a coordinator rebuilt from its state dir continues exactly where it stood."""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

import pytest
import torch
from crashes import flip_last_byte, on_state_dir

from diloco import checkpoints
from diloco.faults import STALL_ENV_VAR
from diloco.server.coordinator import Coordinator
from diloco.server.errors import Rejection
from diloco.server.ops.launch import start_server
from diloco.server.settings import ServerSettings
from diloco.server.state import journal
from diloco.server.state.journal import RoundJournal
from diloco.server.state.store import StateStore
from diloco.wire import decode_tensors, specs_of

SETTINGS = ServerSettings(sync_every=2, min_workers=2)
START = {"w": torch.tensor([1.0, 2.0, 3.0]), "steps": torch.tensor(5)}
SPECS = specs_of(START, {"w": "trainable", "steps": "int_buffer"})


def coordinator(state: Path, settings: ServerSettings = SETTINGS, **kwargs) -> Coordinator:
    return on_state_dir(state, settings, **kwargs)


def crash(c: Coordinator) -> None:
    """What kill -9 leaves once the last checkpoint is on disk: the files as they are, and the
    state dir's lock released. (A crash before it: `never_written`.)"""
    with contextlib.suppress(Exception):
        c.journal.settle()
    c.journal.state.close()


def never_written(c: Coordinator) -> list[int]:
    """From now on the checkpoints of the coordinator's steps never reach the disk, as when
    kill -9 comes while one is written in the background: the rounds it would have written."""
    tried: list[int] = []
    c.journal._checkpoint_in_background = lambda round_number, *_a, **_k: tried.append(round_number)
    return tried


def round_of(c: Coordinator, number: int, a: float, b: float) -> None:
    for worker, value in (("a", a), ("b", b)):
        if not c.membership.is_live(worker):
            c.register(worker, SPECS, 1)
        c.submit(worker, number, {"w": torch.full((3,), value), "steps": torch.tensor(-1.0)})


def test_a_restarted_coordinator_resumes_round_weights_and_momentum(tmp_path: Path) -> None:
    first = coordinator(tmp_path)
    first.register("a", SPECS, 1)
    first.upload_initial("a", START)  # generation 0: the first worker's weights are durable
    round_of(first, 0, 0.2, 0.4)
    round_of(first, 1, 0.1, -0.3)
    assert first.round_number == 2

    # As after kill -9: nothing but the state dir survives. (A copy, so that `first` can go on
    # writing its own and the two can be compared: a state dir has one writer.)
    first.journal.settle()  # round 1's checkpoint is on disk
    shutil.copytree(tmp_path, tmp_path.parent / "copy")
    second = coordinator(tmp_path.parent / "copy")
    assert second.round_number == 2
    # The workers live at the crash are members again, and the open round waits for both.
    assert second.membership.live_ids() == {"a", "b"}
    assert second.round is not None and second.round.waiting_for() == ["a", "b"]
    for name, tensor in first.masters.items():
        assert torch.equal(second.masters[name], tensor), name
    old, new = first.model, second.model
    assert torch.equal(new.optimizer.state_dict()["w"], old.optimizer.state_dict()["w"])
    assert new.specs == old.specs and new.fingerprint == old.fingerprint

    round_of(first, 2, 0.3, 0.3)  # the same next round on both gives the same bytes
    round_of(second, 2, 0.3, 0.3)
    assert first.weights().body == second.weights().body
    assert decode_tensors(second.weights().body)["steps"].dtype == torch.int64


def rounds_contributed(c: Coordinator) -> dict[str, int]:
    """What `diloco status` shows in its "rounds" column, per worker."""
    return {w["worker_id"]: w["rounds_contributed"] for w in c.status()["workers"]}


def test_rounds_contributed_never_go_back_after_a_restart(tmp_path: Path) -> None:
    """Issue 27: `diloco status` showed rounds 2 before a SIGTERM and 1 after the restart."""
    first = coordinator(tmp_path)
    first.register("a", SPECS, 1)
    first.upload_initial("a", START)
    round_of(first, 0, 0.2, 0.4)
    round_of(first, 1, 0.1, -0.3)
    first.deregister("b")
    assert rounds_contributed(first) == {"a": 2, "b": 2}
    crash(first)

    second = coordinator(tmp_path)
    assert rounds_contributed(second) == {"a": 2}  # b had left: no member until it registers
    second.register("b", SPECS, 1)
    assert rounds_contributed(second) == {"a": 2, "b": 2}
    round_of(second, 2, 0.3, 0.3)
    assert rounds_contributed(second) == {"a": 3, "b": 3}
    crash(second)
    assert rounds_contributed(coordinator(tmp_path)) == {"a": 3, "b": 3}


def test_a_submission_for_a_round_lost_in_the_crash_is_simply_accepted(tmp_path: Path) -> None:
    first = coordinator(tmp_path)
    first.register("a", SPECS, 1)
    first.upload_initial("a", START)
    first.register("b", SPECS, 1)
    first.submit("a", 0, {"w": torch.full((3,), 0.2), "steps": torch.tensor(0.0)})
    # Crash before b submitted: round 0 never committed, so it was never published either.
    crash(first)
    second = coordinator(tmp_path)
    assert second.round_number == 0
    round_of(second, 0, 0.2, 0.4)
    assert second.round_number == 1


def test_other_settings_are_refused_by_name_unless_overridden(tmp_path: Path) -> None:
    first = coordinator(tmp_path)
    first.register("a", SPECS, 1)
    first.upload_initial("a", START)
    changed = ServerSettings(sync_every=7, min_workers=2)
    crash(first)
    with pytest.raises(ValueError, match=r"sync_every: 2 in the state dir, 7 now"):
        coordinator(tmp_path, changed)
    assert coordinator(tmp_path, changed, override_settings=True).round_number == 0


def test_init_weights_on_an_existing_state_dir_are_refused(tmp_path: Path) -> None:
    first = coordinator(tmp_path)
    first.register("a", SPECS, 1)
    first.upload_initial("a", START)
    crash(first)
    journal = RoundJournal(StateStore(tmp_path), SETTINGS)
    with pytest.raises(ValueError, match="drop --init"):
        Coordinator(SETTINGS, START, journal=journal)


def test_a_step_logged_but_never_checkpointed_is_replayed_bit_for_bit(tmp_path: Path) -> None:
    """Round 1 commits and is published, and the server dies before its checkpoint reaches
    the disk: the restart applies round 1 again from the step log, to the very weights and
    momentum the uninterrupted server has, records it in SQLite once, and checkpoints it."""
    state, copy = tmp_path / "state", tmp_path / "copy"
    first = coordinator(state)
    first.register("a", SPECS, 1)
    first.upload_initial("a", START)
    round_of(first, 0, 0.2, 0.4)
    first.journal.settle()
    tried = never_written(first)
    round_of(first, 1, 0.1, -0.3)
    first.journal.settle()
    assert first.round_number == 2 and tried == [2]
    # By hand (Nesterov, lr 0.7, momentum 0.9): mean 0.3, then -0.1; the buffer 0.3, then
    # 0.9 * 0.3 - 0.1 = 0.17; the weights move by 0.7 * (0.3 + 0.27) and 0.7 * (-0.1 + 0.153).
    expected = START["w"] - 0.7 * 0.57 - 0.7 * 0.053
    assert torch.allclose(first.masters["w"], expected, rtol=1e-6)
    shutil.copytree(state, copy)
    crash(first)
    second = coordinator(copy)
    assert second.round_number == 2
    assert torch.equal(second.masters["w"], first.masters["w"])
    momentum = second.model.optimizer.state_dict()["w"]
    assert torch.allclose(momentum, torch.full((3,), 0.17), rtol=1e-6)
    assert torch.equal(momentum, first.model.optimizer.state_dict()["w"])
    assert [r["round"] for r in second.journal.state.committed_rounds()] == [0, 1]
    (restarted,) = second.journal.state.audit_log("restarted")
    assert restarted["round"] == 2 and restarted["detail"]["replayed_step"] == 1
    newest = second.journal.state.checkpoints.load_latest()
    assert newest is not None and newest.metadata["round"] == 2  # written by the restart
    round_of(second, 2, 0.3, 0.3)  # and it goes on as the uninterrupted one
    crash(second)
    third = coordinator(copy)  # a clean restart replays nothing again
    assert third.round_number == 3
    assert [r["round"] for r in third.journal.state.committed_rounds()] == [0, 1, 2]


CHAIN = [(0.2, 0.4), (0.1, -0.3), (0.3, 0.3), (-0.2, 0.0), (0.5, 0.1)]  # each round's a, b


def nesterov_by_hand(start: float, rounds: list[tuple[float, float]]) -> tuple[float, float]:
    """The weight and momentum after `rounds` (the mean of a and b each), written out:
    buffer = 0.9 * buffer + g, then w -= 0.7 * (g + 0.9 * buffer)."""
    w, buffer = start, 0.0
    for a, b in rounds:
        g = (a + b) / 2
        buffer = 0.9 * buffer + g
        w -= 0.7 * (g + 0.9 * buffer)
    return w, buffer


def chained(state: Path) -> Coordinator:
    """Five rounds with a checkpoint every third: round 3's in the background, and the step
    log keeps steps 3 and 4 (a crash then loses their checkpoint, never the steps)."""
    first = coordinator(state, checkpoint_every=3)
    first.register("a", SPECS, 1)
    first.upload_initial("a", START)
    for number, (a, b) in enumerate(CHAIN):
        round_of(first, number, a, b)
    first.journal.settle()
    return first


@pytest.mark.parametrize("direct", [False, True], ids=["page_cache", "o_direct"])
def test_steps_since_the_last_checkpoint_are_replayed_in_order_bit_for_bit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, direct: bool
) -> None:
    """`direct`: the step log's sums written around the page cache, as a log of at least
    DIRECT_STEP_LOG_BYTES is (here every log is); else through it, as these small ones are."""
    written_directly = []
    real_write_direct = checkpoints._write_direct

    def spied(*args):
        written_directly.append(args[0].name)
        return real_write_direct(*args)

    monkeypatch.setattr(checkpoints, "_write_direct", spied)
    if direct:
        monkeypatch.setattr(journal, "DIRECT_STEP_LOG_BYTES", 0)
    state, copy = tmp_path / "state", tmp_path / "copy"
    first = chained(state)
    assert bool(written_directly) == direct
    assert all(name.startswith("sums-") for name in written_directly)
    assert first.round_number == 5
    rounds = [g.metadata["round"] for g in map(first.journal.state.checkpoints.load, [0, 1])]
    assert rounds == [0, 3] and first.journal.state.checkpoints.generations() == [0, 1]
    assert first.journal.state.steps.generations() == [3, 4]  # steps 0-2 went with round 3's
    weight, buffer = nesterov_by_hand(2.0, CHAIN)  # START's w[1] is 2.0
    assert torch.allclose(first.masters["w"][1], torch.tensor(weight), rtol=1e-6)
    shutil.copytree(state, copy)  # as kill -9 leaves it; `first` goes on in its own dir

    second = coordinator(copy, checkpoint_every=3)
    assert second.round_number == 5 and not second.sent_rounds.rollback_possible
    assert torch.equal(second.masters["w"], first.masters["w"])
    momentum = second.model.optimizer.state_dict()["w"]
    assert torch.equal(momentum, first.model.optimizer.state_dict()["w"])
    assert torch.allclose(momentum, torch.full((3,), buffer), rtol=1e-6)
    assert [r["round"] for r in second.journal.state.committed_rounds()] == [0, 1, 2, 3, 4]
    (restarted,) = second.journal.state.audit_log("restarted")
    assert restarted["detail"]["replayed_steps"] == [3, 4] and restarted["round"] == 5
    newest = second.journal.state.checkpoints.load_latest()
    assert newest is not None and newest.metadata["round"] == 5  # written by the restart
    assert second.journal.state.steps.generations() == []
    round_of(second, 5, 0.3, -0.1)  # and it goes on as the uninterrupted one
    round_of(first, 5, 0.3, -0.1)
    assert first.weights().body == second.weights().body
    crash(second)
    third = coordinator(copy, checkpoint_every=3)  # round 5's step in the log, replayed
    assert third.round_number == 6 and torch.equal(third.masters["w"], first.masters["w"])
    crash(first)


def test_a_chain_missing_a_step_resumes_at_the_step_before_the_gap(tmp_path: Path) -> None:
    """A step log file lost from the disk (an operator, a broken disk): the steps after it
    cannot apply, so the run resumes where the chain stops, its later rows rolled back."""
    first = chained(tmp_path)
    w_at_4, _ = nesterov_by_hand(2.0, CHAIN[:4])
    crash(first)
    steps = tmp_path / "steps"
    shutil.rmtree(steps / "gen-000000000004")  # steps 3 kept, 4 gone
    second = coordinator(tmp_path, checkpoint_every=3)
    assert second.round_number == 4
    # the workers may hold round 5's weights: a delta against them must not be sent
    assert second.sent_rounds.rollback_possible
    assert torch.allclose(second.masters["w"][1], torch.tensor(w_at_4), rtol=1e-6)
    assert [r["round"] for r in second.journal.state.committed_rounds()] == [0, 1, 2, 3]
    crash(second)
    first = chained(tmp_path.parent / "again")
    crash(first)
    shutil.rmtree(tmp_path.parent / "again" / "steps" / "gen-000000000003")  # 3 gone, 4 kept
    third = coordinator(tmp_path.parent / "again", checkpoint_every=3)
    assert third.round_number == 3  # step 4 cannot apply without step 3
    assert third.journal.state.steps.generations() == []
    assert [r["round"] for r in third.journal.state.committed_rounds()] == [0, 1, 2]
    aside = tmp_path.parent / "again" / "steps-set-aside"
    assert [p.name[:16] for p in aside.iterdir()] == ["gen-000000000004"]  # moved, not deleted
    crash(third)


def test_a_step_that_does_not_verify_is_set_aside_with_the_steps_after_it(tmp_path: Path) -> None:
    """A step log file changed on disk (a bad sector, a partial copy): its hash fails, so it
    and step 4 after it cannot be applied; both are moved aside, the run resumes at 3."""
    crash(chained(tmp_path))
    flip_last_byte(next((tmp_path / "steps" / "gen-000000000003").glob("sums-*.safetensors")))
    second = coordinator(tmp_path, checkpoint_every=3)
    assert second.round_number == 3 and second.sent_rounds.rollback_possible
    aside = sorted(p.name[:16] for p in (tmp_path / "steps-set-aside").iterdir())
    assert aside == ["gen-000000000003", "gen-000000000004"]
    crash(second)
    assert coordinator(tmp_path, checkpoint_every=3).round_number == 3  # and it starts again


def test_a_graceful_stop_checkpoints_the_chain_and_empties_the_log(tmp_path: Path) -> None:
    first = chained(tmp_path)
    weights = first.masters["w"].clone()
    assert first.shutdown()  # round 5 was only in the log
    assert not list((tmp_path / "steps").glob("gen-*"))
    second = coordinator(tmp_path, checkpoint_every=3)
    assert second.round_number == 5 and torch.equal(second.masters["w"], weights)
    assert second.journal.state.audit_log("restarted")[-1]["detail"]["replayed_steps"] == []


def test_a_failed_step_log_stops_the_server_before_anything_moves(tmp_path: Path) -> None:
    first = coordinator(tmp_path)
    first.register("a", SPECS, 1)
    first.upload_initial("a", START)
    first.register("b", SPECS, 1)
    first.submit("a", 0, {"w": torch.full((3,), 0.2), "steps": torch.tensor(0.0)})

    def broken_write(*_args, **_kwargs):
        raise OSError("No space left on device")

    first.journal.state.steps.stage = broken_write
    with pytest.raises(Rejection) as caught:
        first.submit("b", 0, {"w": torch.full((3,), 0.4), "steps": torch.tensor(0.0)})
    assert caught.value.status == 503 and caught.value.kind == "checkpoint_failed"
    assert torch.equal(first.masters["w"], START["w"])  # nothing stepped
    published = first.model.published
    assert published is None or published.round == 0  # round 0's result never published
    with pytest.raises(Rejection, match="No space left"):
        first.wait_result(0, "a", 0)
    crash(first)
    assert coordinator(tmp_path).round_number == 0  # a restart resumes the last durable round


def test_a_step_log_that_cannot_be_made_durable_publishes_nothing(tmp_path: Path) -> None:
    """The log's files are written, then their fsyncs (run beside the step) fail: the step
    has moved the masters in memory, so the server refuses everything, publishes nothing,
    and a restart resumes the last durable round."""
    first = coordinator(tmp_path)
    first.register("a", SPECS, 1)
    first.upload_initial("a", START)
    first.register("b", SPECS, 1)
    first.submit("a", 0, {"w": torch.full((3,), 0.2), "steps": torch.tensor(0.0)})
    steps = first.journal.state.steps
    stage = steps.stage

    def staged_but_never_durable(*args, **kwargs):
        stage(*args, **kwargs)  # written into the page cache, never fsynced

        def durable():
            raise OSError("Input/output error")

        return durable

    steps.stage = staged_but_never_durable
    with pytest.raises(Rejection) as caught:
        first.submit("b", 0, {"w": torch.full((3,), 0.4), "steps": torch.tensor(0.0)})
    assert caught.value.status == 503 and "Input/output error" in caught.value.error
    assert "logging the outer step of round 1" in (first.model.broken or "")
    published = first.model.published
    assert published is None or published.round == 0
    assert first.journal.state.committed_rounds() == []  # nothing recorded
    crash(first)
    assert coordinator(tmp_path).round_number == 0


def test_a_failed_background_checkpoint_stops_the_server_and_a_restart_replays(
    tmp_path: Path,
) -> None:
    """The step was logged, so it stands: the server refuses everything until restarted
    (the disk needs an operator), and the restart has the round the workers were given."""
    first = coordinator(tmp_path)
    first.register("a", SPECS, 1)
    first.upload_initial("a", START)
    first.journal.settle()

    def broken_write(*_args, **_kwargs):
        raise OSError("No space left on device")

    first.journal.state.checkpoints.write = broken_write
    round_of(first, 0, 0.2, 0.4)
    assert first.round_number == 1  # published: its input is durable in the step log
    with pytest.raises(OSError):
        first.journal.settle()
    assert "No space left on device" in (first.model.broken or "")
    with pytest.raises(Rejection) as caught:
        first.wait_result(1, "a", 0)
    assert caught.value.status == 503 and caught.value.kind == "checkpoint_failed"
    weights = first.masters["w"].clone()
    first.journal.state.close()
    second = coordinator(tmp_path)
    assert second.round_number == 1 and torch.equal(second.masters["w"], weights)
    assert torch.allclose(weights, START["w"] - 0.7 * 0.57, rtol=1e-6)  # by hand, as above


def test_a_logged_step_is_replayed_only_under_the_settings_it_was_logged_with(
    tmp_path: Path,
) -> None:
    """--override-settings could give the replay another optimizer than the live step had,
    and the workers' anchors would no longer match: refused by name until the step is in."""
    first = coordinator(tmp_path)
    first.register("a", SPECS, 1)
    first.upload_initial("a", START)
    first.journal.settle()
    never_written(first)
    round_of(first, 0, 0.2, 0.4)
    crash(first)
    changed = ServerSettings(sync_every=2, min_workers=2, outer_momentum=0.5)
    refused = r"step log holds steps .*momentum.: 0.9} in the state dir"
    with pytest.raises(ValueError, match=refused):
        coordinator(tmp_path, changed, override_settings=True)
    replayed = coordinator(tmp_path)  # the stored settings: replayed and checkpointed
    assert replayed.round_number == 1
    assert torch.allclose(replayed.masters["w"], START["w"] - 0.7 * 0.57, rtol=1e-6)
    crash(replayed)
    assert coordinator(tmp_path, changed, override_settings=True).round_number == 1


def test_the_step_log_splits_its_sums_into_files_of_about_equal_bytes() -> None:
    """Each file is hashed by its own thread: 400 + 400 bytes, then 800, for two files."""
    from diloco.server.state.journal import _sum_groups

    sums = {"a": torch.zeros(100), "b": torch.zeros(100), "c": torch.zeros(200)}
    groups = _sum_groups(sums, 2)
    assert {group: list(tensors) for group, tensors in groups.items()} == {
        "sums-0": ["a", "b"],
        "sums-1": ["c"],
    }
    assert all(groups["sums-0"][n] is sums[n] for n in ("a", "b"))  # no copies
    assert list(_sum_groups(sums, 8)) == ["sums-0", "sums-2", "sums-4"]  # each its own file
    assert _sum_groups({}, 4) == {"sums-0": {}}


def test_a_top_k_run_begun_before_its_codec_chose_sgd_resumes_as_it_ran(
    tmp_path: Path, caplog
) -> None:
    """Issue 30, item 1: a top-k codec now picks outer sgd 1.0 when none is given. A state
    dir whose run began with the old default (nesterov 0.7, momentum 0.9) must still start
    with the same command line, keeping its optimizer (and its momentum buffers)."""
    old = ServerSettings(
        sync_every=2, min_workers=2, upload_codec="topk:0.03+int2",
        outer_optimizer="nesterov", outer_lr=0.7,
    )  # fmt: skip
    first = coordinator(tmp_path, old)
    first.register("a", SPECS, 1)
    first.upload_initial("a", START)
    crash(first)
    now = ServerSettings(sync_every=2, min_workers=2, upload_codec="topk:0.03+int2")
    assert now.outer_optimizer == "sgd"  # what a new run would get
    with caplog.at_level("WARNING", logger="diloco.server"):
        second = coordinator(tmp_path, now)
    assert second.round_number == 0
    assert second.model.optimizer.describe() == {"kind": "nesterov", "lr": 0.7, "momentum": 0.9}
    assert second.info()["settings"]["outer_defaults_from_codec"] == []
    assert any("the state dir's run began with outer_optimizer 'nesterov'" in r.getMessage()
               for r in caplog.records)  # fmt: skip
    crash(second)
    # What was given on the command line is compared as before: other values are refused.
    given = ServerSettings(
        sync_every=2, min_workers=2, upload_codec="topk:0.03+int2", outer_optimizer="sgd",
        outer_lr=1.0,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"outer_optimizer: .*'nesterov'.* in the state dir"):
        coordinator(tmp_path, given)


def test_an_int8_run_begun_with_error_feedback_resumes_with_it(tmp_path: Path, caplog) -> None:
    """int8 now runs without error feedback when no beta is given. A state dir whose run began
    with the old default (0.95) starts with the same command line and keeps 0.95, so the
    workers' saved residuals still belong to the run; a beta given otherwise is refused."""
    old = ServerSettings(
        sync_every=2, min_workers=2, upload_codec="int8", error_feedback_beta=0.95
    )  # fmt: skip
    first = coordinator(tmp_path, old)
    first.register("a", SPECS, 1)
    first.upload_initial("a", START)
    crash(first)
    now = ServerSettings(sync_every=2, min_workers=2, upload_codec="int8")
    assert now.error_feedback_beta == 0.0  # what a new run would get
    with caplog.at_level("WARNING", logger="diloco.server"):
        second = coordinator(tmp_path, now)
    settings = second.info()["settings"]
    assert (settings["error_feedback_beta"], settings["error_feedback_from_codec"]) == (0.95, False)
    assert any(
        "the state dir's run began with error_feedback_beta 0.95 (upload codec int8's default: 0.0)"
        in r.getMessage()
        for r in caplog.records
    )
    crash(second)
    given = ServerSettings(sync_every=2, min_workers=2, upload_codec="int8", error_feedback_beta=0)
    with pytest.raises(ValueError, match=r"error_feedback_beta: .*0.95.* in the state dir"):
        coordinator(tmp_path, given)


def test_a_start_that_hangs_dumps_where_it_is(tmp_path: Path) -> None:
    """A real `diloco server` restarted on a chain whose replay stalls (a disk that hangs in
    the replayed step's checkpoint): past its timeout the launcher has the process dump its
    threads' stacks into the log before it goes (PYTHONFAULTHANDLER, SIGABRT), so a start
    that hangs in a test says where."""
    crash(chained(tmp_path / "state"))
    log = tmp_path / "server.log"
    stalled = {"PYTHONFAULTHANDLER": "1", STALL_ENV_VAR: "checkpoint_file:60"}
    with pytest.raises(RuntimeError, match="did not start"):
        start_server(
            tmp_path / "port",
            *("--state-dir", str(tmp_path / "state"), "--checkpoint-every", "3"),
            *("--sync-every", "2", "--min-workers", "2"),
            output=log.open("wb"),
            timeout=8,
            env=stalled,
        )
    dump = log.read_text()
    assert "Fatal Python error: Aborted" in dump
    assert "in _replay" in dump and "in write_replayed" in dump and "in crash_point" in dump
