"""`diloco server --tensorboard DIR`: each commit's scalars in TensorBoard event files, read
back here by hand (TFRecord framing: length, its CRC, the Event protobuf, its CRC)."""

from __future__ import annotations

import struct
import time
from pathlib import Path

import pytest
import torch

from diloco.server.coordinator import Coordinator
from diloco.server.ops.tensorboard import TensorBoardScalars
from diloco.server.settings import ServerSettings
from diloco.wire import TensorSpec
from processes import run_all

event_pb2 = pytest.importorskip("tensorboardX.proto.event_pb2")
SPECS = [TensorSpec("w", (4,), torch.float32, "trainable")]


def scalars_in(directory: Path) -> dict[tuple[str, int], float]:
    """{(tag, step): value} of every event file in `directory`."""
    found = {}
    for path in sorted(directory.glob("events.out.tfevents.*")):
        data, at = path.read_bytes(), 0
        while at < len(data):
            (length,) = struct.unpack("<Q", data[at : at + 8])
            event = event_pb2.Event.FromString(data[at + 12 : at + 12 + length])
            at += 12 + length + 4
            for value in event.summary.value:
                found[(value.tag, event.step)] = value.simple_value
    return found


def test_each_commit_writes_run_and_worker_scalars(tmp_path: Path) -> None:
    settings = ServerSettings(outer_optimizer="sgd", outer_lr=1.0)
    scalars = TensorBoardScalars(tmp_path / "tb")
    c = Coordinator(settings, {"w": torch.zeros(4)}, scalars=scalars)
    for worker in ("a", "b"):
        c.register(worker, SPECS, 1)
    c.heartbeat("a", step=2, steps_per_second=4.0, loss=2.5, tokens=64)
    for round_number in range(2):
        for worker in ("a", "b"):
            c.submit(worker, round_number, {"w": torch.ones(4)})
    c.shutdown()  # closes (flushes) the writer
    found = scalars_in(tmp_path / "tb")
    assert found[("run/contributions", 0)] == found[("run/contributions", 1)] == 2
    assert found[("run/live_workers", 1)] == 2
    assert found[("worker/a/loss", 0)] == 2.5 and found[("worker/a/step", 1)] == 2
    assert found[("worker/a/steps_per_second", 0)] == 4.0
    assert ("worker/b/loss", 0) not in found  # b never reported a loss
    assert found[("run/mb_in_per_round", 0)] == pytest.approx(2 * 4 * 4 / 1e6)
    assert ("run/round_seconds", 0) not in found and ("run/round_seconds", 1) in found


@pytest.mark.slow  # in `make test-slow`: a server process for one refused option
def test_a_tensorboard_path_that_is_a_file_is_one_error_line(tmp_path: Path) -> None:
    taken = tmp_path / "file"
    taken.write_text("")
    code, _, err = run_all({"tb": ["server", "--port", "0", "--tensorboard", str(taken)]})["tb"]
    assert code == 2 and "is a file, not a directory" in err and "Traceback" not in err


def test_a_stuck_or_failing_writer_never_holds_a_commit(tmp_path: Path) -> None:
    """tensorboardX blocks when its queue is full (a slow or full disk): commits go on."""
    import threading

    scalars = TensorBoardScalars(tmp_path / "tb")
    stuck = threading.Event()
    calls = []

    def blocked(*args) -> None:
        calls.append(args)
        stuck.wait(timeout=30)
        raise OSError("no space left on device")

    scalars.writer.add_scalar = blocked
    c = Coordinator(ServerSettings(outer_optimizer="sgd", outer_lr=1.0), {"w": torch.zeros(4)},
                    scalars=scalars)  # fmt: skip
    c.register("a", SPECS, 1)
    c.submit("a", 0, {"w": torch.ones(4)})
    deadline = time.monotonic() + 30
    while not calls:  # the writer thread takes round 0's first scalar, and is stuck there
        assert time.monotonic() < deadline
        time.sleep(0.01)
    for round_number in (1, 2):
        c.submit("a", round_number, {"w": torch.ones(4)})
    assert c.round_number == 3 and len(calls) == 1 and not stuck.is_set()
    stuck.set()  # each write now fails; logged, and the close still returns
    c.shutdown()
    assert c.masters["w"].tolist() == [-3.0] * 4
