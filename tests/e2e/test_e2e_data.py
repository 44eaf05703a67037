"""Server-dispatched data as a user runs it: `diloco worker` (default --data-dispatch server)
processes train the work units a `diloco server --state-dir` leases, and the server is killed
with SIGKILL between a lease and the completion of its units."""

from __future__ import annotations

import json
import signal
import socket
import sqlite3
from pathlib import Path

import pytest

from diloco.data import TokenWindows, generated_corpus, split_train_val
from diloco.faults import ENV_VAR
from processes import start_worker, wait_all
from tiny import TINY_MODEL

UNIT_SIZE = 4
STEPS, SYNC_EVERY = 24, 4


def free_port() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return str(probe.getsockname()[1])


@pytest.mark.slow  # in `make test-slow`; the default suite keeps a sample
def test_a_crash_between_lease_and_completion_skips_and_repeats_no_unit(
    server_process, tmp_path: Path
) -> None:
    # A corpus small enough that two workers go through it more than twice.
    corpus = tmp_path / "small.txt"
    corpus.write_bytes(generated_corpus(num_bytes=3_000, seed=3))
    windows = len(TokenWindows(split_train_val(corpus.read_bytes()).train, TINY_MODEL.context))
    units_per_epoch = -(-windows // UNIT_SIZE)
    port, state = free_port(), tmp_path / "state"
    args = ("--port", port, "--state-dir", str(state), "--sync-every", str(SYNC_EVERY))
    first = server_process(*args, env={ENV_VAR: "leased:5"})
    dispatch = ("--data-dispatch", "server", "--unit-size", str(UNIT_SIZE))
    workers = [
        start_worker(
            first.url,
            f"w{i}",
            0,
            1,
            STEPS,
            corpus,
            tmp_path,
            extra=(*dispatch, "--max-retry-delay", "1"),
            dispatch=None,
        )
        for i in range(2)
    ]
    first.process.wait(timeout=180)
    assert first.process.returncode == -signal.SIGKILL, first.log.read_text()
    server_process(*args)
    wait_all(workers, timeout=300)
    for i, worker in enumerate(workers):
        assert worker.returncode == 0, (tmp_path / f"w{i}.log").read_text()
    reports = [json.loads((tmp_path / f"w{i}.json").read_text()) for i in range(2)]
    assert all(r["data_dispatch"] == "server" for r in reports)

    with sqlite3.connect(state / "state.sqlite") as db:
        rows = db.execute(
            "SELECT epoch, unit_index, state, completed_round FROM wu_units ORDER BY epoch, "
            "unit_index"
        ).fetchall()
        committed = {r for (r,) in db.execute("SELECT round FROM rounds")}
        reported = [json.loads(u) for (u,) in db.execute("SELECT units FROM rounds")]
    samples_trained = 2 * STEPS * 4  # two workers, batch size 4
    assert samples_trained > 2 * windows  # the run crosses at least two epochs
    epochs = sorted({epoch for epoch, *_ in rows})
    assert len(epochs) >= 3
    for epoch in epochs[:-1]:  # every finished epoch: each unit completed exactly once
        units = [(index, st, rnd) for e, index, st, rnd in rows if e == epoch]
        assert [index for index, *_ in units] == list(range(units_per_epoch))
        assert all(st == "completed" and rnd in committed for _, st, rnd in units), units
    # The last epoch: no unit lost in a lease, every one completed or free (none held by the
    # departed workers), and nothing completed outside a committed round.
    last = [(st, rnd) for e, _, st, rnd in rows if e == epochs[-1]]
    assert all(st in ("completed", "free") for st, _ in last)
    assert all(rnd in committed for st, rnd in last if st == "completed")
    # No unit id was reported by two committed rounds.
    flat = [unit for units in reported for unit in units]
    assert len(flat) == len(set(flat))
