"""The server's durable state directory: SQLite (WAL) metadata, checkpoint tensors.

Layout of `--state-dir D`:

    D/state.sqlite          meta (format, protocol, settings), workers, rounds, audit log,
                            metrics history, and the work-unit tables of `workunits.WorkPool`
    D/checkpoints/gen-N/    weights and outer optimizer state (diloco.checkpoints)
    D/steps/gen-N/          the input of outer step N while its checkpoint is being written
                            (the step log: see state/journal.py)

The checkpoint generation is the authority for the global tensors and the round; SQLite rows
about rounds are written right after it in one transaction, and on start `reconcile` brings
SQLite back in line with the checkpoint that was actually loaded (rows of rounds the checkpoint
does not include are rolled back, and a commit the crash kept out of SQLite is replayed from
the checkpoint's own record of it). Every refusal here is a `StateDirError` whose message the
CLI prints as is.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import sqlite3
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from diloco.checkpoints import CheckpointStore
from diloco.wire import PROTOCOL_VERSION

__all__ = ["STATE_FORMAT", "StateDirError", "StateStore"]

STATE_FORMAT = 2  # 2: rounds.fragment / fragment_round and the submissions table
DATABASE_NAME = "state.sqlite"
CHECKPOINTS_NAME = "checkpoints"
STEPS_NAME = "steps"
LOCK_NAME = "lock"
# Dropped files kept to be written over (checkpoints.py): one checkpoint's (masters, momentum,
# published copy), and a step log chain's at the default --checkpoint-every (4 steps of up to
# 8 files each); a longer chain's rest is deleted as before.
RECYCLED_CHECKPOINT_FILES = 4
RECYCLED_STEP_FILES = 32
HELD_SLICES_NAME = "held-slices"  # a follower shard's (server/state/held_slices.py)
STEP_INPUTS_NAME = "inputs"  # one server's bodies, durable as they come (state/step_inputs.py)
_OURS = {
    DATABASE_NAME,
    f"{DATABASE_NAME}-wal",
    f"{DATABASE_NAME}-shm",
    CHECKPOINTS_NAME,
    STEPS_NAME,
    LOCK_NAME,
    HELD_SLICES_NAME,
    STEP_INPUTS_NAME,
}

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS workers (
    worker_id TEXT PRIMARY KEY,
    session TEXT,
    live INTEGER NOT NULL,
    registered_at REAL NOT NULL,
    last_event_at REAL NOT NULL,
    rounds_contributed INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS rounds (
    round INTEGER PRIMARY KEY,          -- the outer step (version) that committed: the weights
                                        -- it made are version round + 1 (sync: the round)
    committed_at REAL NOT NULL,         -- wall-clock seconds since the epoch
    contributors TEXT NOT NULL,         -- JSON list of worker ids
    units TEXT NOT NULL,                -- JSON list of work-unit ids completed by this commit
    tokens INTEGER NOT NULL,
    seconds REAL NOT NULL,              -- outer step, encoding and checkpoint
    fragment INTEGER NOT NULL DEFAULT 0,        -- streaming: which fragment stepped
    fragment_round INTEGER                      -- streaming: that fragment's round
);
CREATE TABLE IF NOT EXISTS submissions (        -- every pseudo-gradient an outer step used
    worker_id TEXT NOT NULL,
    round INTEGER NOT NULL,             -- the round it was sent for (async: its anchor version)
    fragment INTEGER NOT NULL,
    version INTEGER NOT NULL,           -- rounds.round of the outer step that applied it
    staleness INTEGER NOT NULL,         -- async: outer steps between its anchor and its step
    PRIMARY KEY (worker_id, round, fragment)
);
CREATE TABLE IF NOT EXISTS decided_sessions (  -- sharded servers: whose process each
    version INTEGER NOT NULL,                  -- contributor's slices came from (a digest
    worker_id TEXT NOT NULL,                   -- of its registration session), so every
    digest TEXT NOT NULL,                      -- shard folds the same process's slices
    PRIMARY KEY (version, worker_id)
);
CREATE TABLE IF NOT EXISTS screened (  -- robust aggregation: how a step used each of its
    version INTEGER NOT NULL,          -- contributors (sharded servers: the decision every
    worker_id TEXT NOT NULL,           -- shard folds its slices by)
    scale REAL NOT NULL,               -- 0: refused; below 1: clipped to that
    norm REAL,                         -- the L2 norm of its whole pseudo-gradient
    PRIMARY KEY (version, worker_id)
);
CREATE TABLE IF NOT EXISTS audit (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    at REAL NOT NULL,
    event TEXT NOT NULL,
    worker_id TEXT,
    round INTEGER,
    detail TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS metrics (
    round INTEGER PRIMARY KEY,
    at REAL NOT NULL,
    live_workers INTEGER NOT NULL,
    contributions INTEGER NOT NULL,
    bytes_in INTEGER NOT NULL,
    bytes_out INTEGER NOT NULL,
    seconds REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS worker_metrics (     -- each live worker as it stood at a commit
    round INTEGER NOT NULL,
    worker_id TEXT NOT NULL,
    step INTEGER NOT NULL,
    loss REAL,
    steps_per_second REAL NOT NULL,
    tokens INTEGER NOT NULL,
    PRIMARY KEY (round, worker_id)
);
"""


class StateDirError(ValueError):
    """A state directory that cannot be used; the message says which and what to do."""


def _check_directory(directory: Path) -> None:
    """Refuse what is not (or cannot become) a diloco state directory, before writing to it."""
    if directory.exists() and not directory.is_dir():
        raise StateDirError(f"--state-dir {directory} exists and is not a directory")
    if not directory.exists():
        parent = directory.parent if directory.parent != Path("") else Path(".")
        if not parent.is_dir():
            raise StateDirError(f"--state-dir {directory}: its parent directory does not exist")
        if not os.access(parent, os.W_OK | os.X_OK):
            raise StateDirError(
                f"--state-dir {directory} cannot be created: {parent} is not writable"
            )
        return
    entries = {entry.name for entry in directory.iterdir()}
    foreign = sorted(entries - _OURS)
    if foreign and not entries & _OURS:
        shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        raise StateDirError(
            f"--state-dir {directory} is not a diloco state directory (it holds {shown}); "
            "pass a new or empty directory, or the one a diloco server wrote"
        )
    if not os.access(directory, os.W_OK | os.X_OK):
        raise StateDirError(f"--state-dir {directory} is not writable by this user")


def _lock_exclusively(path: Path) -> int:
    """One server per state dir: a second writer would interleave generations and rows.

    flock is released by the kernel when the process dies, kill -9 included, so a crashed
    server never leaves a stale lock behind.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise StateDirError(
            f"--state-dir {path.parent} is in use by another diloco server; stop it first"
        ) from None
    return fd


class StateStore:
    """Opens (or creates) a state directory and owns its SQLite connection.

    Single writer: the coordinator calls in under its own lock, so one connection (opened with
    check_same_thread=False) serves every thread.
    """

    def __init__(self, directory: Path | None, keep_checkpoints: int = 3) -> None:
        """`directory=None`: the same tables in memory and no checkpoints (no --state-dir)."""
        self.directory = None if directory is None else Path(directory)
        self.checkpoints: CheckpointStore | None = None
        self.steps: CheckpointStore | None = None  # the step log (one step at a time)
        self._lock_file: int | None = None
        try:
            if self.directory is None:
                target: str | Path = ":memory:"
            else:
                _check_directory(self.directory)
                self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
                self._lock_file = _lock_exclusively(self.directory / LOCK_NAME)
                # Each writes over the files of the generations it dropped: CheckpointStore.
                self.checkpoints = CheckpointStore(
                    self.directory / CHECKPOINTS_NAME,
                    keep_checkpoints,
                    recycle=RECYCLED_CHECKPOINT_FILES,
                )
                self.steps = CheckpointStore(
                    self.directory / STEPS_NAME, keep=1, recycle=RECYCLED_STEP_FILES
                )
                target = self.directory / DATABASE_NAME
            self.conn = sqlite3.connect(
                target,
                check_same_thread=False,
                isolation_level=None,  # explicit BEGIN ... COMMIT in `transaction`
                timeout=30.0,
            )
        except (OSError, sqlite3.Error) as exc:
            self._unlock()
            raise StateDirError(f"--state-dir {self.directory} cannot be opened: {exc}") from None
        try:
            self.conn.execute("PRAGMA journal_mode=WAL")
            self.conn.execute("PRAGMA synchronous=FULL")  # a commit survives power loss
            self.conn.executescript(_SCHEMA)  # outside a transaction: executescript commits
            with self.transaction():
                self._check_format()
                self._migrate()
        except sqlite3.DatabaseError as exc:
            self.conn.close()
            self._unlock()
            raise StateDirError(
                f"--state-dir {self.directory}: {DATABASE_NAME} is not a usable SQLite database "
                f"({exc})"
            ) from None
        except StateDirError:
            self.conn.close()
            self._unlock()
            raise

    # ----------------------------------------------------------------- plumbing

    @property
    def durable(self) -> bool:
        return self.checkpoints is not None

    @contextlib.contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """One atomic write: everything inside commits together or not at all."""
        if self.conn.in_transaction:  # nested: the outer transaction decides
            yield self.conn
            return
        self.conn.execute("BEGIN IMMEDIATE")
        try:
            yield self.conn
        except BaseException:
            self.conn.execute("ROLLBACK")
            raise
        self.conn.execute("COMMIT")

    def close(self) -> None:
        with contextlib.suppress(sqlite3.Error):
            self.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        self.conn.close()
        self._unlock()

    def _unlock(self) -> None:
        if self._lock_file is not None:
            os.close(self._lock_file)  # releases the flock
            self._lock_file = None

    def _check_format(self) -> None:
        stored = self.get_meta("format")
        if stored is None:
            self.set_meta("format", STATE_FORMAT)
            self.set_meta("protocol_version", PROTOCOL_VERSION)
            self.set_meta("created_at", time.time())
            return
        if not isinstance(stored, int) or stored > STATE_FORMAT:
            raise StateDirError(
                f"--state-dir {self.directory} was written by a newer diloco (state format "
                f"{stored}; this version reads format {STATE_FORMAT}); upgrade diloco"
            )
        protocol = self.get_meta("protocol_version")
        if isinstance(protocol, int) and protocol > PROTOCOL_VERSION:
            raise StateDirError(
                f"--state-dir {self.directory} was written for protocol version {protocol}; "
                f"this diloco speaks version {PROTOCOL_VERSION}; upgrade diloco"
            )

    def _migrate(self) -> None:
        """Bring a state dir of an older format up to this one (format 1: no fragment columns)."""
        stored = self.get_meta("format")
        if stored == STATE_FORMAT:
            return
        columns = {row[1] for row in self.conn.execute("PRAGMA table_info(rounds)")}
        if "fragment" not in columns:
            self.conn.execute("ALTER TABLE rounds ADD COLUMN fragment INTEGER NOT NULL DEFAULT 0")
        if "fragment_round" not in columns:
            self.conn.execute("ALTER TABLE rounds ADD COLUMN fragment_round INTEGER")
        self.set_meta("format", STATE_FORMAT)
        self.audit("migrated", from_format=stored, to_format=STATE_FORMAT)

    def get_meta(self, key: str) -> Any:
        row = self.conn.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else json.loads(row[0])

    def set_meta(self, key: str, value: Any) -> None:
        self.conn.execute(
            "INSERT INTO meta (key, value) VALUES (?, ?) "
            "ON CONFLICT(key) DO UPDATE SET value = excluded.value",
            (key, json.dumps(value, sort_keys=True)),
        )

    # ----------------------------------------------------------------- workers

    def save_worker(self, worker_id: str, session: str | None, live: bool) -> None:
        now = time.time()
        self.conn.execute(
            "INSERT INTO workers (worker_id, session, live, registered_at, last_event_at) "
            "VALUES (?, ?, ?, ?, ?) ON CONFLICT(worker_id) DO UPDATE SET "
            "session = excluded.session, live = excluded.live, "
            "last_event_at = excluded.last_event_at",
            (worker_id, session, int(live), now, now),
        )

    def live_workers(self) -> list[tuple[str, str | None]]:
        """(worker_id, session) of the workers that were live when the server last ran."""
        rows = self.conn.execute(
            "SELECT worker_id, session FROM workers WHERE live = 1 ORDER BY worker_id"
        )
        return [(worker_id, session) for worker_id, session in rows]

    def departed_workers(self) -> list[str]:
        rows = self.conn.execute("SELECT worker_id FROM workers WHERE live = 0 ORDER BY worker_id")
        return [worker_id for (worker_id,) in rows]

    def workers(self) -> list[dict]:
        rows = self.conn.execute(
            "SELECT worker_id, live, rounds_contributed FROM workers ORDER BY worker_id"
        )
        return [
            {"worker_id": w, "live": bool(live), "rounds_contributed": n} for w, live, n in rows
        ]

    # ----------------------------------------------------------------- rounds and history

    def contributors_of(self, round_number: int) -> list[str] | None:
        """The workers whose pseudo-gradients the committed outer step `round_number` used
        (None if it has not committed): a sharded run's decision of that round."""
        row = self.conn.execute(
            "SELECT contributors FROM rounds WHERE round = ?", (round_number,)
        ).fetchone()
        return None if row is None else list(json.loads(row[0]))

    def record_commit(
        self,
        round_number: int,
        contributors: list[str],
        units: list[int],
        tokens: int,
        seconds: float,
        committed_at: float | None = None,
        *,
        fragment: int = 0,
        fragment_round: int | None = None,
        submissions: list[tuple[str, int, int]] = (),  # type: ignore[assignment]
        sessions: dict[str, str] | None = None,
    ) -> None:
        """The row of a committed outer step; a second commit of the same one fails loudly.
        `sessions` (sharded servers): each contributor's session digest.

        `submissions` are (worker, round sent for, staleness) of the pseudo-gradients it used;
        a second application of one of them fails loudly too (the table's primary key).
        """
        at = time.time() if committed_at is None else committed_at
        self.conn.execute(
            "INSERT INTO rounds (round, committed_at, contributors, units, tokens, seconds, "
            "fragment, fragment_round) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (
                round_number,
                at,
                json.dumps(sorted(contributors)),
                json.dumps(units),
                tokens,
                seconds,
                fragment,
                round_number if fragment_round is None else fragment_round,
            ),
        )
        self.conn.executemany(
            "INSERT INTO submissions (worker_id, round, fragment, version, staleness) "
            "VALUES (?, ?, ?, ?, ?)",
            [(w, sent_for, fragment, round_number, stale) for w, sent_for, stale in submissions],
        )
        self.conn.executemany(
            "INSERT INTO decided_sessions (version, worker_id, digest) VALUES (?, ?, ?)",
            [(round_number, w, digest) for w, digest in sorted((sessions or {}).items())],
        )
        self.conn.executemany(
            "UPDATE workers SET rounds_contributed = rounds_contributed + 1 WHERE worker_id = ?",
            [(w,) for w in contributors],
        )
        extra = (
            {}
            if fragment_round is None
            else {"fragment": fragment, "fragment_round": fragment_round}
        )
        self.audit("outer_step", round=round_number, contributors=sorted(contributors), **extra)

    def applied_version(self, worker_id: str, round_number: int, fragment: int = 0) -> int | None:
        """The outer step that used (worker, round, fragment)'s pseudo-gradient, if one did."""
        row = self.conn.execute(
            "SELECT version FROM submissions WHERE worker_id = ? AND round = ? AND fragment = ?",
            (worker_id, round_number, fragment),
        ).fetchone()
        return None if row is None else int(row[0])

    def sessions_of(self, version: int) -> dict[str, str]:
        """Sharded servers: the session digest of each contributor to step `version`."""
        rows = self.conn.execute(
            "SELECT worker_id, digest FROM decided_sessions WHERE version = ?", (version,)
        )
        return {w: d for w, d in rows}

    def record_screened(
        self, version: int, scales: dict[str, float], norms: dict[str, float]
    ) -> None:
        """Robust aggregation: each contributor's scale in step `version` (0: refused) and
        the norm it was screened by (inside the step's transaction)."""
        self.conn.executemany(
            "INSERT INTO screened (version, worker_id, scale, norm) VALUES (?, ?, ?, ?)",
            [(version, w, float(scale), norms.get(w)) for w, scale in sorted(scales.items())],
        )

    def screened_of(self, version: int) -> tuple[dict[str, float], dict[str, float]]:
        """({worker: scale}, {worker: norm}) of step `version` (empty: not screened)."""
        rows = self.conn.execute(
            "SELECT worker_id, scale, norm FROM screened WHERE version = ?", (version,)
        ).fetchall()
        scales = {w: float(scale) for w, scale, _ in rows}
        return scales, {w: float(norm) for w, _, norm in rows if norm is not None}

    def submissions_of(self, version: int) -> list[dict]:
        rows = self.conn.execute(
            "SELECT worker_id, round, fragment, staleness FROM submissions WHERE version = ? "
            "ORDER BY worker_id",
            (version,),
        )
        return [
            {"worker_id": w, "round": r, "fragment": f, "staleness": st} for w, r, f, st in rows
        ]

    def record_metrics(
        self,
        round_number: int,
        live_workers: int,
        contributions: int,
        bytes_in: int,
        bytes_out: int,
        seconds: float,
        workers: Sequence[Mapping[str, Any]] = (),
    ) -> None:
        """A commit's row, and one per live worker (its step, loss, speed, tokens then)."""
        self.conn.execute(
            "INSERT OR REPLACE INTO metrics "
            "(round, at, live_workers, contributions, bytes_in, bytes_out, seconds) "
            "VALUES (?, ?, ?, ?, ?, ?, ?)",
            (round_number, time.time(), live_workers, contributions, bytes_in, bytes_out, seconds),
        )
        self.conn.executemany(
            "INSERT OR REPLACE INTO worker_metrics "
            "(round, worker_id, step, loss, steps_per_second, tokens) VALUES (?, ?, ?, ?, ?, ?)",
            [
                (round_number, w["worker_id"], w["step"], w["loss"], w["steps_per_second"],
                 w["tokens"])
                for w in workers
            ],
        )  # fmt: skip

    def metrics_history(self, after: int = -1, limit: int = 1000) -> dict[str, list[dict]]:
        """The commits after round `after` (oldest first, at most `limit`) and the workers'
        rows of the same rounds: what the dashboard draws."""
        rows = self.conn.execute(
            "SELECT round, at, live_workers, contributions, bytes_in, bytes_out, seconds "
            "FROM metrics WHERE round > ? ORDER BY round LIMIT ?",
            (after, limit),
        ).fetchall()
        rounds = [
            dict(zip(("round", "at", "live_workers", "contributions", "bytes_in", "bytes_out",
                      "seconds"), row, strict=True))
            for row in rows
        ]  # fmt: skip
        last = rounds[-1]["round"] if rounds else after
        workers = [
            dict(zip(("round", "worker_id", "step", "loss", "steps_per_second", "tokens"), row,
                     strict=True))
            for row in self.conn.execute(
                "SELECT round, worker_id, step, loss, steps_per_second, tokens FROM "
                "worker_metrics WHERE round > ? AND round <= ? ORDER BY round, worker_id",
                (after, last),
            )
        ]  # fmt: skip
        return {"rounds": rounds, "workers": workers}

    def committed_rounds(self) -> list[dict]:
        rows = self.conn.execute(
            "SELECT round, committed_at, contributors, units, tokens, seconds, fragment, "
            "fragment_round FROM rounds ORDER BY round"
        )
        return [
            {
                "round": r,
                "committed_at": at,
                "contributors": json.loads(c),
                "units": json.loads(u),
                "tokens": t,
                "seconds": s,
                "fragment": f,
                "fragment_round": r if fr is None else fr,
            }
            for r, at, c, u, t, s, f, fr in rows
        ]

    def rounds_from(self, first: int) -> list[int]:
        rows = self.conn.execute(
            "SELECT round FROM rounds WHERE round >= ? ORDER BY round", (first,)
        )
        return [r for (r,) in rows]

    def forget_rounds_from(self, first: int) -> None:
        """Drop the rows of rounds a restart rolled back (their checkpoint was lost), and
        their contributors' counts of rounds contributed."""
        lost = self.conn.execute("SELECT contributors FROM rounds WHERE round >= ?", (first,))
        self.conn.executemany(
            "UPDATE workers SET rounds_contributed = MAX(0, rounds_contributed - 1) "
            "WHERE worker_id = ?",
            [(w,) for (contributors,) in lost.fetchall() for w in json.loads(contributors)],
        )
        self.conn.execute("DELETE FROM rounds WHERE round >= ?", (first,))
        self.conn.execute("DELETE FROM submissions WHERE version >= ?", (first,))
        self.conn.execute("DELETE FROM decided_sessions WHERE version >= ?", (first,))
        self.conn.execute("DELETE FROM screened WHERE version >= ?", (first,))
        self.conn.execute("DELETE FROM metrics WHERE round >= ?", (first,))
        self.conn.execute("DELETE FROM worker_metrics WHERE round >= ?", (first,))

    def audit(
        self, event: str, *, worker_id: str | None = None, round: int | None = None, **detail: Any
    ) -> None:
        self.conn.execute(
            "INSERT INTO audit (at, event, worker_id, round, detail) VALUES (?, ?, ?, ?, ?)",
            (time.time(), event, worker_id, round, json.dumps(detail, sort_keys=True)),
        )

    def audit_log(
        self, event: str | None = None, *, after: int = 0, limit: int | None = None
    ) -> list[dict]:
        """Rows with an id above `after` (of `event` only, if given), oldest first."""
        query = "SELECT id, at, event, worker_id, round, detail FROM audit WHERE id > ?"
        arguments: list[Any] = [after]
        if event is not None:
            query += " AND event = ?"
            arguments.append(event)
        query += " ORDER BY id LIMIT ?"
        arguments.append(-1 if limit is None else limit)
        rows = self.conn.execute(query, arguments)
        return [
            {"id": i, "at": at, "event": e, "worker_id": w, "round": r, "detail": json.loads(d)}
            for i, at, e, w, r, d in rows
        ]
