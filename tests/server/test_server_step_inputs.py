"""One server's step log holds each round's bodies, durable as they came, not its sums: a
restart folds them again, in the order they were folded, to the same weights bit for bit."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
import xxhash
from crashes import flip_last_byte, killed, on_state_dir

from diloco.algorithm.compression.codecs import Codec
from diloco.server.coordinator import Coordinator
from diloco.server.errors import Rejection
from diloco.server.settings import ServerSettings
from diloco.server.state import journal, step_inputs
from diloco.wire import decode_tensors, encode_tensors, specs_of
from diloco.wire.compressed.body import encode_compressed
from diloco.wire.format.spool import open_spooled

# int8 uploads in blocks of 16: two bodies of a 48-element tensor hold 2 x (48 codes + 3 fp32
# scales) = 120 bytes, under 3/4 of the 192 bytes of fp32 sums, so the log holds the bodies.
BLOCK = 16
INT8 = Codec("int8", block=BLOCK)
SETTINGS = ServerSettings(
    sync_every=2,
    min_workers=2,
    upload_codec="int8",
    codec_block=BLOCK,
    outer_optimizer="nesterov",
    outer_lr=0.7,
    outer_momentum=0.9,
)


def blocks(values: list[float]) -> torch.Tensor:
    """One value per block of 16 (each block one magnitude: int8 codes it as +-127 times its
    scale, so it decodes to the value within an ulp)."""
    return torch.tensor(values).repeat_interleave(BLOCK)


START = {"w": blocks([1.0, 2.0, 3.0])}
SPECS = specs_of(START, {"w": "trainable"})


def coordinator(state: Path, settings: ServerSettings = SETTINGS, **kwargs) -> Coordinator:
    return on_state_dir(state, settings, **kwargs)


class Bodies:
    """Upload bodies as the HTTP intake spools them: files on disk, opened piece by piece;
    `sent` keeps each body's bytes, to check the log against by hand. `codec` None: fp32."""

    def __init__(self, directory: Path, codec: Codec | None = INT8) -> None:
        self.directory = directory
        self.codec = codec
        directory.mkdir(exist_ok=True)
        self.sent: list[bytes] = []

    def write(self, w: list[float]) -> Path:
        tensors = {"w": blocks(w)}
        data = encode_tensors(tensors) if self.codec is None else encode_compressed(tensors, INT8)
        self.sent.append(bytes(data))
        path = self.directory / f"{len(self.sent)}.body"
        path.write_bytes(data)
        return path

    def submit(self, c: Coordinator, worker: str, number: int, w: list[float]) -> dict:
        spooled = open_spooled(self.write(w))
        try:
            return c.submit(worker, number, spooled)
        finally:
            spooled.close()

    def submit_in_memory(self, c: Coordinator, worker: str, number: int, w: list[float]) -> dict:
        """The same body read into RAM first (as --memory-bodies keeps it): no file."""
        path = self.write(w)
        spooled = open_spooled(path)
        metadata = spooled.metadata
        spooled.close()
        return c.submit(worker, number, decode_tensors(path.read_bytes()), metadata=metadata)


def started(state: Path, **kwargs) -> Coordinator:
    c = coordinator(state, **kwargs)
    c.register("a", SPECS, 1)
    c.upload_initial("a", START)
    c.register("b", SPECS, 1)
    return c


# each round's two bodies (one value per block): b first in round 1, so the log keeps the
# order they came in
CHAIN = [
    (("a", [0.25, 0.5, -0.125]), ("b", [0.5, 0.0, 0.375])),
    (("b", [0.125, -0.375, 0.25]), ("a", [-0.375, 0.125, 0.0625])),
    (("a", [0.375, 0.375, 0.375]), ("b", [0.5, -0.5, 0.125])),
]


def nesterov_by_hand(start: list[float], rounds) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights and momentum after `rounds` (the mean of each round's two bodies), written
    out per block: buffer = 0.9 * buffer + g, then w -= 0.7 * (g + 0.9 * buffer)."""
    w, buffer = list(start), [0.0] * len(start)
    for (_, x), (_, y) in rounds:
        for i in range(len(w)):
            g = (x[i] + y[i]) / 2
            buffer[i] = 0.9 * buffer[i] + g
            w[i] -= 0.7 * (g + 0.9 * buffer[i])
    return blocks(w), blocks(buffer)


def weighs_as_by_hand(c: Coordinator, rounds) -> bool:
    w, _ = nesterov_by_hand([1.0, 2.0, 3.0], rounds)
    return torch.allclose(c.masters["w"], w, rtol=1e-6)


def sums_logged(state: Path, step: int) -> bool:
    """Whether step `step`'s log holds its sums (and no bodies)."""
    names = sorted(p.name for p in (state / "steps" / f"gen-{step:012d}").iterdir())
    sums = names[1:]
    return names[0] == "manifest.json" and bool(sums) and all(n.startswith("sums-") for n in sums)


def restarts_to_the_same_weights(c: Coordinator, state: Path) -> bool:
    """Killed and started again on `state`: the weights it had, bit for bit."""
    weights = c.masters["w"].clone()
    killed(c)
    again = coordinator(state, checkpoint_every=10)
    try:
        return torch.equal(again.masters["w"], weights)
    finally:
        killed(again)


def completes_logging_sums(c: Coordinator, bodies: Bodies, state: Path) -> bool:
    """b's body completes round 0 (a's is in): the step logs its sums, the server healthy,
    no copy left behind."""
    assert bodies.submit(c, "b", 0, [0.5, 0.0, 0.375])["status"] == "accepted"
    c.journal.settle()
    healthy = c.round_number == 1 and c.model.broken is None
    return healthy and sums_logged(state, 0) and list((state / "inputs").iterdir()) == []


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
            "xxh3_128": xxhash.xxh3_128(sent).hexdigest(),
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
    assert torch.allclose(second.masters["w"], w, rtol=1e-6)
    assert torch.allclose(momentum, buffer, rtol=1e-6)
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


def test_a_state_dir_written_with_sha256_checksums_restarts_and_replays_its_steps(
    tmp_path: Path,
) -> None:
    """A server upgraded onto a state dir from before XXH3-128: every manifest (its
    checkpoint and the steps it logged as bodies) names format 1 and each file's SHA-256
    (hashlib's, over the bytes on disk). The restart verifies them with SHA-256, replays the
    3 steps and ends at the weights and momentum worked by hand."""
    state = tmp_path / "state"
    first = started(state, checkpoint_every=10)
    run_chain(first, Bodies(tmp_path / "sent"))
    killed(first)
    manifests = sorted(state.rglob("manifest.json"))
    assert len(manifests) >= 4  # the start's checkpoint and the 3 logged steps
    for path in manifests:
        manifest = json.loads(path.read_text())
        manifest["format"] = 1
        for name, entry in manifest["files"].items():
            del entry["xxh3_128"]
            entry["sha256"] = hashlib.sha256((path.parent / name).read_bytes()).hexdigest()
        path.write_text(json.dumps(manifest))
    second = coordinator(state, checkpoint_every=10)
    assert second.round_number == 3
    (restarted,) = second.journal.state.audit_log("restarted")
    assert restarted["detail"]["replayed_steps"] == [0, 1, 2]
    w, buffer = nesterov_by_hand([1.0, 2.0, 3.0], CHAIN)
    assert torch.allclose(second.masters["w"], w, rtol=1e-6)
    assert torch.allclose(second.model.optimizer.state_dict()["w"], buffer, rtol=1e-6)
    killed(second)


def test_a_body_that_does_not_verify_sets_its_step_aside_with_the_steps_after_it(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    first = started(state, checkpoint_every=10)
    run_chain(first, Bodies(tmp_path / "sent"))
    killed(first)
    flip_last_byte(state / "steps" / "gen-000000000001" / "input-0001.body")
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


def test_copies_write_over_the_files_of_dropped_steps(tmp_path: Path) -> None:
    """A checkpoint drops the steps it covers: their bodies wait in `steps/recycled/`, and the
    next round's copies are written over them (the same inodes), cut to their own size, so a
    body lands on pages the page cache already holds."""
    state = tmp_path / "state"
    c = started(state, checkpoint_every=1)  # every step dropped once its checkpoint is in
    bodies = Bodies(tmp_path / "sent")
    run_chain(c, bodies, CHAIN[:1])
    c.journal.settle()
    pool = state / "steps" / "recycled"
    pooled = sorted(pool.iterdir())
    assert sorted(p.read_bytes() for p in pooled) == sorted(bodies.sent)  # round 0's two
    for path in pooled:  # longer than the next bodies: their tails must go
        with path.open("ab") as extra:
            extra.write(b"\xff" * 1000)
    inodes = {p.stat().st_ino for p in pooled}
    answer = bodies.submit(c, "b", 1, CHAIN[1][0][1])
    assert answer["status"] == "accepted" and {p.stat().st_ino for p in pool.iterdir()} < inodes
    (copy,) = (state / "inputs").iterdir()
    assert copy.stat().st_ino in inodes  # a pooled file, taken before it is written
    assert bodies.submit(c, "a", 1, CHAIN[1][1][1])["status"] == "accepted"
    c.journal.settle()
    assert c.round_number == 2 and weighs_as_by_hand(c, CHAIN[:2])
    # step 1's bodies went back to the pool after its checkpoint: the same files, cut to size
    again = sorted(pool.iterdir())
    assert {p.stat().st_ino for p in again} == inodes
    assert sorted(p.read_bytes() for p in again) == sorted(bodies.sent[2:])
    killed(c)


def test_a_refused_or_duplicate_body_leaves_no_copy(tmp_path: Path) -> None:
    state = tmp_path / "state"
    c = started(state)
    bodies = Bodies(tmp_path / "sent")
    with pytest.raises(Rejection) as caught:
        bodies.submit(c, "a", 0, [0.25, float("nan"), 0.125])
    assert caught.value.status == 422 and caught.value.kind == "malformed_compressed"
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
    bodies = Bodies(tmp_path / "sent")
    bodies.submit(c, "a", 0, [0.25, 0.5, -0.125])
    bodies.submit_in_memory(c, "b", 0, [0.5, 0.0, 0.375])
    c.journal.settle()
    assert c.round_number == 1 and sums_logged(state, 0)
    assert list((state / "inputs").iterdir()) == []
    assert restarts_to_the_same_weights(c, state)


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
    with pytest.raises(OSError, match="No space left"):  # (its thread may still be ending)
        copy.durable()
    assert copy.failed
    assert completes_logging_sums(c, bodies, state)  # both copies went
    for worker, values in CHAIN[1]:  # the next round logs its bodies again
        bodies.submit(c, worker, 1, values)
    c.journal.settle()
    step_1 = state / "steps" / "gen-000000000001"
    assert sorted(p.name for p in step_1.glob("*.body")) == ["input-0000.body", "input-0001.body"]
    assert restarts_to_the_same_weights(c, state)


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
    assert completes_logging_sums(c, bodies, state)
    killed(c)


def fp32_round(tmp_path: Path, workers: int) -> tuple[Coordinator, Path, Bodies]:
    """Round 0 of `workers` fp32 workers (CHAIN's first values) on a state dir of its own,
    committed and its checkpoint settled."""
    fp32 = ServerSettings(sync_every=2, min_workers=workers)
    state = tmp_path / f"k{workers}"
    c = coordinator(state, fp32, checkpoint_every=10)
    c.register("a", SPECS, 1)
    c.upload_initial("a", START)
    if workers == 2:
        c.register("b", SPECS, 1)
    bodies = Bodies(tmp_path / f"sent{workers}", codec=None)
    for worker, values in CHAIN[0][:workers]:
        bodies.submit(c, worker, 0, values)
    c.journal.settle()
    return c, state, bodies


def test_fp32_bodies_log_the_sums_with_one_worker_or_two(tmp_path: Path) -> None:
    """An fp32 body is the sums' size: copied, one worker's rounds measured 50 % slower
    (a copy into new pages and its fsync against the sums' write into recycled ones), two
    workers' too (twice the bytes). Both log their sums."""
    for workers in (1, 2):
        c, state, _ = fp32_round(tmp_path, workers)
        assert c.round_number == 1 and sums_logged(state, 0)
        assert list((state / "inputs").iterdir()) == []
        killed(c)


def test_fp32_bodies_of_a_log_written_around_the_page_cache_are_copied_around_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the sums would be written around the page cache (from DIRECT_STEP_LOG_BYTES on:
    every model here), an fp32 body of one worker, the sums' size, is copied around it too,
    as it comes (`copy_file_direct`), and its step logs it instead of the sums: the file is
    the body byte for byte, its checksum the xxhash package's, and a restart folds it again
    to the same weights bit for bit (one body: w -= 0.7 * (1 + 0.9) * g, by hand). Two
    workers' bodies hold twice the sums' bytes: their step logs the sums (a direct copy is
    for a round of one sender)."""
    monkeypatch.setattr(journal, "DIRECT_STEP_LOG_BYTES", 0)
    copied_directly = []
    real_copy = step_inputs.copy_file_direct

    def spied(source: int, target: int, size: int, *waits) -> str:
        copied_directly.append(size)
        return real_copy(source, target, size, *waits)

    monkeypatch.setattr(step_inputs, "copy_file_direct", spied)
    for workers in (1, 2):
        c, state, bodies = fp32_round(tmp_path, workers)
        assert c.round_number == 1 and list((state / "inputs").iterdir()) == []
        if workers == 2:
            assert sums_logged(state, 0)
            assert copied_directly == [len(bodies.sent[0])]  # the one-worker run's, no more
            killed(c)
            continue
        step_0 = state / "steps" / "gen-000000000000"
        assert sorted(p.name for p in step_0.iterdir()) == ["input-0000.body", "manifest.json"]
        sent = bodies.sent[0]
        assert (step_0 / "input-0000.body").read_bytes() == sent
        manifest = json.loads((step_0 / "manifest.json").read_text())
        assert manifest["files"]["input-0000.body"] == {
            "bytes": len(sent),
            "xxh3_128": xxhash.xxh3_128(sent).hexdigest(),
        }
        g = blocks([0.25, 0.5, -0.125])
        expected = blocks([1.0, 2.0, 3.0]) - 0.7 * 1.9 * g
        assert torch.allclose(c.masters["w"], expected, rtol=1e-6)
        weights = c.masters["w"].clone()
        killed(c)
        again = coordinator(state, ServerSettings(sync_every=2, min_workers=1), checkpoint_every=10)
        assert again.journal.state.audit_log("restarted")[-1]["detail"]["replayed_steps"] == [0]
        assert torch.equal(again.masters["w"], weights)
        killed(again)
