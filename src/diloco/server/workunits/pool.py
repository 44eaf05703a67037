"""Work units: the server's record of which training samples are leased, trained and pending.

A worker registers a dataset by (dataset_id, length, shuffle_seed, unit_size). Epoch e of the
dataset is the order `Permutation(length, shuffle_seed, e)` (every epoch, 0 included, derives
its own keys from the pair), cut into units of `unit_size` consecutive positions; the last unit
may be shorter. A unit is leased to one worker at a time and counts as completed only when the
round that trained it commits, so after any crash every sample of an epoch is trained once.

A unit may also be trained in part: a submission reports `unit:count`, the count of its
samples trained so far (from the unit's first), and the round that commits it records the
unit's `trained` prefix. A unit that goes back to the pool keeps its prefix, and its next lease
hands out only the rest, so no sample is trained twice whoever trains the unit next.

Units are created lazily: an epoch is a cursor `next_unit` (units below it have a row) and a
row per unit ever leased, so a dataset of 1e9 samples costs nothing until it is trained. A
released unit keeps its row in state 'free' and its stable unit_id, and is leased again before
any unit above the cursor (oldest epoch first, then lowest index).

All state lives in `wu_*` tables of the SQLite connection given. The pool never begins or
commits a transaction: `complete` runs inside the transaction that commits a round, so the
round and its units are durable together. `workunit_schema.immediate(conn)` is there for
callers (and tests) that want a write transaction of their own.

The pool is three classes, one job each, so that no file holds both halves: `UnitReads`
(workunit_reads.py) reads; `UnitLeases` (workunit_leases.py) registers datasets and leases
units; `UnitLedger` (workunit_ledger.py) checks what submissions report and completes units
at commit. The two writing halves call nothing of each other's, only the reads. This file is
the design above and `WorkPool`, the two halves on one connection, which callers hold; the
tables, bounds and request checks are in workunit_schema.py.
"""

from __future__ import annotations

import sqlite3

from diloco.server.workunits.leases import UnitLeases
from diloco.server.workunits.ledger import UnitLedger
from diloco.server.workunits.schema import create_tables


class WorkPool(UnitLeases, UnitLedger):
    """Leases, completions and progress of every registered dataset, on one SQLite connection."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        super().__init__(conn)
        create_tables(conn)
