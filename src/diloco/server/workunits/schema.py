"""The work-unit pool's SQLite tables, its bounds and the checks of what requests name.

Apart from the pool's classes (`workunits.WorkPool`: its reads, leases and ledger) so that
their logic reads without the schema, and so that both writing halves check ids and counts
the same way; the bounds keep every integer that reaches SQLite inside int64.
"""

from __future__ import annotations

import re
import sqlite3
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from diloco.server.errors import Rejection

DATASET_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$"
_DATASET_ID_RE = re.compile(DATASET_ID_PATTERN)
MAX_LENGTH = 2**53
MAX_SEED = 2**63 - 1
MAX_UNIT_SIZE = 65_536
MAX_LEASE_COUNT = 1024
MAX_LEASE_SAMPLES = 65_536  # one lease answers at most this many indices (JSON size, CPU)
MAX_REPORTED_UNITS = 65_536

SCHEMA = """
CREATE TABLE IF NOT EXISTS wu_datasets (
    dataset_id TEXT PRIMARY KEY,
    length INTEGER NOT NULL,
    unit_size INTEGER NOT NULL,
    shuffle_seed INTEGER NOT NULL,
    units_per_epoch INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS wu_epochs (
    dataset_id TEXT NOT NULL REFERENCES wu_datasets(dataset_id),
    epoch INTEGER NOT NULL,
    next_unit INTEGER NOT NULL,
    PRIMARY KEY (dataset_id, epoch)
);
CREATE TABLE IF NOT EXISTS wu_units (
    unit_id INTEGER PRIMARY KEY AUTOINCREMENT,
    dataset_id TEXT NOT NULL,
    epoch INTEGER NOT NULL,
    unit_index INTEGER NOT NULL,
    state TEXT NOT NULL CHECK (state IN ('free', 'leased', 'completed')),
    worker_id TEXT,
    leased_at REAL,
    completed_round INTEGER,
    trained INTEGER NOT NULL DEFAULT 0,  -- samples of its prefix that committed rounds trained
    UNIQUE (dataset_id, epoch, unit_index),
    FOREIGN KEY (dataset_id, epoch) REFERENCES wu_epochs(dataset_id, epoch)
);
CREATE TABLE IF NOT EXISTS wu_lease_requests (
    worker_id TEXT NOT NULL,
    lease_key TEXT NOT NULL,
    dataset_id TEXT NOT NULL,
    units TEXT NOT NULL,               -- JSON list of the unit ids this request leased
    at REAL NOT NULL,
    PRIMARY KEY (worker_id, lease_key)
);
CREATE TABLE IF NOT EXISTS wu_progress (
    round INTEGER NOT NULL,            -- the outer step that trained the prefix
    unit_id INTEGER NOT NULL,
    before INTEGER NOT NULL,
    after INTEGER NOT NULL,
    PRIMARY KEY (round, unit_id)
);
CREATE INDEX IF NOT EXISTS wu_units_by_state
    ON wu_units(dataset_id, epoch, state, unit_index);
CREATE INDEX IF NOT EXISTS wu_units_by_worker ON wu_units(worker_id, state);
CREATE INDEX IF NOT EXISTS wu_units_by_round
    ON wu_units(completed_round) WHERE completed_round IS NOT NULL;
"""

REMEMBERED_LEASES = 8

UNIT_COLUMNS = (
    "unit_id, dataset_id, epoch, unit_index, state, worker_id, leased_at, completed_round, trained"
)


def create_tables(conn: sqlite3.Connection) -> None:
    """The `wu_*` tables and indices where they are missing (no transaction of its own)."""
    for statement in SCHEMA.split(";"):
        if statement.strip():
            conn.execute(statement)
    columns = {row[1] for row in conn.execute("PRAGMA table_info(wu_units)")}
    if "trained" not in columns:  # a state dir from before partial units
        conn.execute("ALTER TABLE wu_units ADD COLUMN trained INTEGER NOT NULL DEFAULT 0")


@contextmanager
def immediate(conn: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """A write transaction taken up front (BEGIN IMMEDIATE), committed or rolled back as one."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield conn
    except BaseException:
        conn.rollback()
        raise
    conn.commit()


def invalid(field: str, message: str) -> Rejection:
    return Rejection(422, "invalid_request", message, field=field)


def check_int(field: str, value: object, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise invalid(field, f"{field} must be an integer in {low}..{high}, got {value!r}")
    return value


def check_dataset_id(dataset_id: object) -> str:
    if not isinstance(dataset_id, str) or not _DATASET_ID_RE.fullmatch(dataset_id):
        raise invalid(
            "dataset_id",
            f"dataset_id must match {DATASET_ID_PATTERN}, got {dataset_id!r}",
        )
    return dataset_id


def check_worker_id(worker_id: object) -> str:
    if not isinstance(worker_id, str) or not worker_id:
        raise invalid("worker_id", f"worker_id must be a non-empty string, got {worker_id!r}")
    return worker_id


def check_unit_ids(unit_ids: Sequence[int]) -> list[int]:
    if isinstance(unit_ids, (str, bytes)) or not isinstance(unit_ids, Sequence):
        raise invalid("unit_ids", f"unit_ids must be a list of integers, got {unit_ids!r}")
    if len(unit_ids) > MAX_REPORTED_UNITS:
        raise invalid("unit_ids", f"at most {MAX_REPORTED_UNITS} unit_ids per submission")
    ids = [check_int("unit_ids", unit_id, 1, 2**63 - 1) for unit_id in unit_ids]
    if len(set(ids)) != len(ids):
        twice = sorted(unit_id for unit_id, n in Counter(ids).items() if n > 1)
        raise invalid("unit_ids", f"unit_ids name units {twice} more than once")
    return ids
