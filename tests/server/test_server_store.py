"""StateStore: what it refuses (with one sentence naming the directory) and what it keeps."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
import torch
from crashes import killed

from diloco.server.coordinator import Coordinator
from diloco.server.settings import ServerSettings
from diloco.server.state.journal import RoundJournal
from diloco.server.state.store import STATE_FORMAT, StateDirError, StateStore
from diloco.wire import PROTOCOL_VERSION, specs_of

START = {"w": torch.tensor([1.0, 2.0])}
SPECS = specs_of(START, {"w": "trainable"})


def test_a_new_directory_is_created_marked_and_reopened(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "state")
    assert store.get_meta("format") == STATE_FORMAT
    assert store.get_meta("protocol_version") == PROTOCOL_VERSION
    assert store.conn.execute("PRAGMA journal_mode").fetchone() == ("wal",)
    store.close()
    again = StateStore(tmp_path / "state")  # our own directory opens again
    assert again.get_meta("format") == STATE_FORMAT
    again.close()


def test_a_foreign_directory_is_refused_and_left_alone(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(StateDirError, match=r"not a diloco state directory .*notes\.txt"):
        StateStore(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_an_empty_directory_is_adopted(tmp_path: Path) -> None:
    StateStore(tmp_path).close()
    assert (tmp_path / "state.sqlite").exists() and (tmp_path / "checkpoints").is_dir()


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [("format", STATE_FORMAT + 1, "state format"), ("protocol_version", 99, "protocol version")],
)
def test_a_directory_from_a_newer_diloco_is_refused(
    tmp_path: Path, key: str, value: int, message: str
) -> None:
    StateStore(tmp_path).close()
    with sqlite3.connect(tmp_path / "state.sqlite") as db:
        db.execute("UPDATE meta SET value = ? WHERE key = ?", (str(value), key))
    with pytest.raises(StateDirError, match=f"newer diloco|{message}") as caught:
        StateStore(tmp_path)
    assert "upgrade diloco" in str(caught.value)


def test_a_corrupt_database_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "state.sqlite").write_bytes(b"this is not SQLite" * 100)
    with pytest.raises(StateDirError, match=r"state\.sqlite is not a usable SQLite database"):
        StateStore(tmp_path)


def test_a_file_and_an_unwritable_place_are_refused(tmp_path: Path) -> None:
    file = tmp_path / "file"
    file.write_text("x")
    with pytest.raises(StateDirError, match="exists and is not a directory"):
        StateStore(file)
    with pytest.raises(StateDirError, match="parent directory does not exist"):
        StateStore(tmp_path / "missing" / "state")
    with pytest.raises(StateDirError, match="cannot be"):  # even root cannot write in /proc
        StateStore(Path("/proc/diloco-state"))


def test_one_server_per_directory_and_the_lock_dies_with_its_owner(tmp_path: Path) -> None:
    first = StateStore(tmp_path)
    with pytest.raises(StateDirError, match="in use by another diloco server"):
        StateStore(tmp_path)
    first.close()  # what the kernel does when the owner dies, kill -9 included
    StateStore(tmp_path).close()


def test_rounds_without_any_verifying_checkpoint_are_never_silently_empty(tmp_path: Path) -> None:
    settings = ServerSettings(sync_every=1)
    c = Coordinator(settings, START, journal=RoundJournal(StateStore(tmp_path), settings))
    c.register("a", SPECS, PROTOCOL_VERSION)
    c.submit("a", 0, {"w": torch.tensor([0.1, 0.1])})
    killed(c)
    for data in (tmp_path / "checkpoints").glob("gen-*/weights.safetensors"):
        data.write_bytes(b"\0" * data.stat().st_size)  # every generation fails its checksum
    journal = RoundJournal(StateStore(tmp_path), settings)
    with pytest.raises(ValueError, match="records committed rounds but holds no checkpoint"):
        Coordinator(settings, journal=journal)
    journal.state.close()


def test_the_store_records_rounds_once_and_the_audit_trail(tmp_path: Path) -> None:
    settings = ServerSettings(sync_every=1)
    c = Coordinator(settings, START, journal=RoundJournal(StateStore(tmp_path), settings))
    c.register("a", SPECS, PROTOCOL_VERSION)
    for number in range(3):
        c.submit("a", number, {"w": torch.tensor([0.1, 0.1])})
    c.deregister("a")
    store = c.journal.state
    assert [r["round"] for r in store.committed_rounds()] == [0, 1, 2]
    assert [r["contributors"] for r in store.committed_rounds()] == [["a"]] * 3
    events = [e["event"] for e in store.audit_log()]
    assert events == ["initial_weights", "registered"] + ["outer_step"] * 3 + ["deregistered"]
    assert store.workers() == [{"worker_id": "a", "live": False, "rounds_contributed": 3}]
    # A round can never be recorded twice.
    with pytest.raises(sqlite3.IntegrityError), store.transaction():
        store.record_commit(1, ["a"], [], 0, 0.0)
    assert [r["round"] for r in store.committed_rounds()] == [0, 1, 2]  # rolled back
    c.shutdown()
