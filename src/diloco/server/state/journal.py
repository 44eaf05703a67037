"""Durable rounds: what the coordinator writes, when, and how a restart gets it back.

A checkpoint generation is one consistent global snapshot at an outer-step boundary: the
weights and outer optimizer state after round r's commit, the round number r + 1, the model's
tensor specs, the settings, and the record of that commit (its contributors, tokens and the work
units it completed). With `durability="round"` (the default) no acknowledged outer step is ever
lost or applied twice: before a step moves anything, its input (the round's bodies, made
durable as they came, see state/step_inputs.py, or else its running sums, one model-sized
fp32 file; the commit record, the optimizer's lr) goes to the step log (D/steps); then the
step is applied, recorded in SQLite and published. Every
`checkpoint_every`-th step (and at a graceful shutdown) its checkpoint is written in the
background while the workers train, and the step after it waits for that checkpoint; the
steps between stay in the log, a chain from the newest checkpoint. A restart applies the
chain again, step by step (the same sums through the same code: the same weights, bit for
bit), and writes the checkpoint of its last step before anything is served. (Writing the
whole checkpoint before the result, as sharded servers still do, cost 2-3 model-sized files
and their hashes on every round's critical path; writing it in the background every round
still competed for memory bandwidth and cores with the next round's delta and downloads.)
With `durability="interval"` there is no step log: only every `checkpoint_every`-th round
(and the state at a graceful shutdown) is checkpointed, and a crash rolls the run back to the
last one: the SQLite rows of the lost rounds are dropped and their work units go back to the
pool to be trained again.

SQLite (the `StateStore`) holds the metadata written in the same critical section: the round
row, the completed units, worker membership, audit and metrics history. A restart reconciles
it with the checkpoint actually loaded (see `restore`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from diloco import faults
from diloco.algorithm import RunningMean
from diloco.checkpoints import BODY_SUFFIX
from diloco.server.model.downloads import ResultDownloads
from diloco.server.ops.control import OUTER_LR
from diloco.server.settings import DESCRIPTIVE_SETTINGS, ServerSettings
from diloco.server.state.step_inputs import InputCopy
from diloco.server.state.store import StateStore
from diloco.server.workunits.pool import WorkPool
from diloco.wire import TensorSpec

log = logging.getLogger("diloco.server")
# A step log of sums at least this large is written around the page cache (O_DIRECT: see
# checkpoints.py's _write_direct). Measured here (benchmarks/results/model_scale-direct-step-log/):
# a 350M model's 1.4 GB log, whose recycled files the page cache no longer held, took the
# commit 1.09-1.10 s into the cache and 0.45-0.59 s around it; an 85M model's 342 MB, into
# pages still cached, 0.08-0.10 s (and 0.04-0.05 s of its fsync past the step) against
# 0.16-0.20 s around it. Where between the two the crossing lies depends on the machine's
# memory and disk; 1 GiB is in the measured gap.
DIRECT_STEP_LOG_BYTES = 1 << 30


def logged_around_page_cache(sums_bytes: int) -> bool:
    """Whether a step whose sums hold `sums_bytes` is logged around the page cache: its sums
    (`RoundJournal.log_step`), or a lone sender's body copied as it comes (`Intake._copy`)."""
    return sums_bytes >= DIRECT_STEP_LOG_BYTES


DURABILITY_MODES = ("round", "interval")
# Rounds between full checkpoints. With "round" the steps between stay in the step log (one
# model-sized fp32 file each) and are replayed after a crash; with "interval" a crash rolls
# back to the last checkpoint.
ROUND_CHECKPOINT_EVERY = 4
INTERVAL_CHECKPOINT_EVERY = 10


def default_checkpoint_every(durability: str, sharded: bool) -> int:
    """Sharded servers log no steps: with "round" every round is its own checkpoint."""
    if durability == "interval":
        return INTERVAL_CHECKPOINT_EVERY
    return 1 if sharded else ROUND_CHECKPOINT_EVERY


@dataclass(frozen=True)
class CommitRecord:
    """What one outer step consumed: written with the checkpoint and with the SQLite row.

    `round` is the run's outer-step number (its version) before this step: the weights it
    produced are version round + 1. In sync mode that is the round; in streaming mode the step
    is fragment `fragment`'s round `fragment_round`; in async mode one arrival or grace window.
    `submissions` are (worker, round it was sent for, staleness) of the pseudo-gradients used.
    """

    round: int
    contributors: list[str]
    units: list[int] = field(default_factory=list)
    tokens: int = 0
    seconds: float = 0.0
    fragment: int = 0
    fragment_round: int | None = None
    submissions: list[tuple[str, int, int]] = field(default_factory=list)
    # Partly trained units: unit -> its trained prefix after this step; `released` are those
    # of workers that left, which go back to the pool with their prefix.
    progress: dict[int, int] = field(default_factory=dict)
    released: list[int] = field(default_factory=list)
    # Robust aggregation: the norms the step used, the scales it clipped to, its refusals
    # (worker -> reason), and every fragment's norm history after the step (for a restart).
    norms: dict[str, float] = field(default_factory=dict)
    clipped: dict[str, float] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)
    norm_history: list[list[float]] | None = None
    # Sharded servers: each contributor's session digest (which process's slices it used)
    sessions: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {
            "round": self.round,
            "contributors": sorted(self.contributors),
            "units": list(self.units),
            "tokens": self.tokens,
            "seconds": self.seconds,
            "fragment": self.fragment,
            "fragment_round": self.fragment_round,
            "submissions": [list(s) for s in self.submissions],
            "progress": {str(unit): count for unit, count in self.progress.items()},
            "released": list(self.released),
            "norms": dict(self.norms),
            "clipped": dict(self.clipped),
            "refused": dict(self.refused),
            "norm_history": self.norm_history,
            "sessions": dict(self.sessions),
        }

    @classmethod
    def from_json(cls, data: dict) -> CommitRecord:
        fragment_round = data.get("fragment_round")
        return cls(
            round=int(data["round"]),
            contributors=list(data["contributors"]),
            units=[int(u) for u in data.get("units", [])],
            tokens=int(data.get("tokens", 0)),
            seconds=float(data.get("seconds", 0.0)),
            fragment=int(data.get("fragment", 0)),
            fragment_round=None if fragment_round is None else int(fragment_round),
            submissions=[(str(w), int(r), int(st)) for w, r, st in data.get("submissions", [])],
            progress={int(u): int(n) for u, n in data.get("progress", {}).items()},
            released=[int(u) for u in data.get("released", [])],
            norms={str(w): float(n) for w, n in data.get("norms", {}).items()},
            clipped={str(w): float(n) for w, n in data.get("clipped", {}).items()},
            refused={str(w): str(r) for w, r in data.get("refused", {}).items()},
            norm_history=(
                None
                if data.get("norm_history") is None
                else [[float(n) for n in norms] for norms in data["norm_history"]]
            ),
            sessions={str(w): str(d) for w, d in data.get("sessions", {}).items()},
        )

    def apply_to(self, pool: WorkPool) -> None:
        """The step's work units in the pool: finished ones completed, prefixes recorded,
        the departed workers' partly trained units released (inside the step's transaction)."""
        pool.complete(self.units, self.round)
        pool.advance(self.progress, self.round)
        pool.release_units(self.released)

    def store_in(self, state: StateStore) -> None:
        """The SQLite row of this step and of each pseudo-gradient it used; its refusals and
        clippings in the audit log."""
        where = {"fragment": self.fragment}  # round: the version; a fragment's own round too
        if self.fragment_round is not None:
            where["fragment_round"] = self.fragment_round
        for worker_id, reason in sorted(self.refused.items()):
            state.audit(
                "contribution_refused",
                worker_id=worker_id,
                round=self.round,
                reason=reason,
                **where,
            )
        for worker_id, scale in sorted(self.clipped.items()):
            state.audit(
                "contribution_clipped",
                worker_id=worker_id,
                round=self.round,
                scale=scale,
                norm=self.norms.get(worker_id),
                **where,
            )
        state.record_commit(
            self.round,
            self.contributors,
            self.units,
            self.tokens,
            self.seconds,
            fragment=self.fragment,
            fragment_round=self.fragment_round,
            submissions=self.submissions,
            sessions=self.sessions,
        )
        if self.norms or self.refused:  # a screened step: how it used each contributor
            scales = {
                w: 0.0 if w in self.refused else self.clipped.get(w, 1.0) for w in self.contributors
            }
            state.record_screened(self.round, scales, self.norms)


@dataclass(frozen=True)
class LoggedInput:
    """One body a logged step folded, in the step log's generation (verified when read)."""

    path: Path
    worker_id: str
    round: int  # the round (streaming: the fragment's round) it was sent for
    tokens: int
    checked: bool  # folded by a reader that checked its values as it folded (else scanned)


@dataclass(frozen=True)
class LoggedStep:
    """An outer step's input, from the step log: a restart applies it again."""

    record: CommitRecord
    # the round's sums as they stood before the step; None when the log holds its bodies
    # instead (`inputs`, folded again in order: Intake.refold)
    running: RunningMean | None
    names: list[str] | None  # a streaming fragment's tensors; None: every tensor
    fragment_rounds: list[int]  # every fragment's round after the step
    lr: float  # the outer lr the step used (an admin may have changed it since)
    inputs: list[LoggedInput] = field(default_factory=list)
    # what the step's sums held (their totals, count and bound): a refold must agree
    weighting: str = "uniform"
    totals: dict[str, float] = field(default_factory=dict)
    count: int = 0
    bound: float = math.inf


@dataclass(frozen=True)
class RestoredState:
    round: int  # the version: outer steps committed
    masters: dict[str, torch.Tensor]
    optimizer_state: dict[str, torch.Tensor]
    specs: dict[str, TensorSpec]
    live_workers: list[tuple[str, str | None]]  # (worker_id, session)
    fragment_rounds: list[int]  # streaming: each fragment's round; else [round]
    published: dict[str, torch.Tensor] | None = None  # P, with --download-codec
    norm_history: list[list[float]] | None = None  # robust aggregation's, per fragment
    # the steps after `round`, logged but not checkpointed, in order (a restart applies them)
    pending: list[LoggedStep] = field(default_factory=list)
    rolled_back: bool = False  # rounds SQLite recorded were forgotten (workers may be ahead)


def keep_stored_outer(state: StateStore, settings: ServerSettings) -> None:
    """Before the model is built (and before a shard compares its settings with shard 0's):
    an outer setting this start left to the upload codec takes the value the stored run
    began with (ServerSettings.keep_stored_outer), so a run begun before the codec's defaults
    changed resumes as it ran. Said once; a second call finds nothing left to take."""
    stored = state.get_meta("settings")
    if not isinstance(stored, dict):
        return
    taken = settings.keep_stored_outer(stored)
    if taken:
        log.warning(
            "the state dir's run began with %s and keeps it; to change, give the setting "
            "(--outer-optimizer, --outer-lr, --outer-momentum, --aggregation, "
            "--error-feedback-beta) and --override-settings",
            ", ".join(taken),
        )


class RoundJournal:
    """Saves and restores the coordinator's global state; owns the checkpoint policy."""

    def __init__(
        self,
        state: StateStore,
        settings: ServerSettings,
        override_settings: bool = False,
        durability: str = "round",
        checkpoint_every: int = 1,
    ) -> None:
        if durability not in DURABILITY_MODES:
            raise ValueError(
                f"durability must be one of {', '.join(DURABILITY_MODES)}, got {durability!r}"
            )
        if isinstance(checkpoint_every, bool) or not isinstance(checkpoint_every, int):
            raise ValueError(f"checkpoint_every must be an integer >= 1, got {checkpoint_every!r}")
        if checkpoint_every < 1:
            raise ValueError(f"checkpoint_every must be an integer >= 1, got {checkpoint_every}")
        self.state = state
        self.settings = settings
        self.override_settings = override_settings
        keep_stored_outer(state, settings)
        self.durability = durability
        self.checkpoint_every = checkpoint_every
        self.pool = WorkPool(state.conn)
        self.saved_round: int | None = None  # the round of the newest checkpoint on disk
        # Steps are logged and checkpointed in the background unless the caller says not
        # (sharded servers: their commits are decided across shards, not replayed from one).
        self.log_steps = True
        self._writer: threading.Thread | None = None  # the checkpoint being written
        self._go = threading.Event()  # set: the writer starts now, downloads or not
        # the results sent to each worker, which a background checkpoint waits for its
        # step's contributors to have (None: it starts at once; model/downloads.py)
        self.downloads: ResultDownloads | None = None
        self._write_error: BaseException | None = None
        self.on_checkpoint_written: Callable[[float], None] | None = None  # its seconds
        self.on_checkpoint_failed: Callable[[str], None] | None = None  # why

    @property
    def durable(self) -> bool:
        return self.state.durable

    @property
    def logs_steps(self) -> bool:
        """Each step's input is logged, and every `checkpoint_every`-th step's checkpoint
        written in the background."""
        return self.durable and self.durability == "round" and self.log_steps

    # ----------------------------------------------------------------- writing

    def _write_checkpoint(
        self,
        round_number: int,
        masters: Mapping[str, torch.Tensor],
        optimizer_state: Mapping[str, torch.Tensor],
        specs: Mapping[str, TensorSpec],
        commit: CommitRecord | None,
        fragment_rounds: list[int] | None = None,
        published: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        store = self.state.checkpoints
        assert store is not None
        existing = store.generations()
        generation = existing[-1] + 1 if existing else 0
        groups = {"weights": masters, "outer_state": optimizer_state}
        if published is not None:
            groups["published"] = published  # what every worker holds (--download-codec)
        store.write(
            generation,
            groups,
            {
                "round": round_number,
                "fragment_rounds": list(fragment_rounds or [round_number]),
                "specs": [spec.to_json() for spec in specs.values()],
                "settings": self.settings.to_wire(),
                "commit": None if commit is None else commit.to_json(),
            },
        )
        self.saved_round = round_number

    def save_initial(
        self,
        masters: Mapping[str, torch.Tensor],
        optimizer_state: Mapping[str, torch.Tensor],
        specs: Mapping[str, TensorSpec],
        fragment_rounds: list[int] | None = None,
        published: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        """Round 0's weights: from --init or the first worker; always durable at once."""
        if self.durable:
            self._write_checkpoint(
                0, masters, optimizer_state, specs, None, fragment_rounds, published
            )
        with self.state.transaction():
            self.state.set_meta("settings", self.settings.to_wire())
            self.state.audit("initial_weights", round=0, tensors=len(specs))

    def commit(
        self,
        record: CommitRecord,
        masters: Mapping[str, torch.Tensor],
        optimizer_state: Mapping[str, torch.Tensor],
        specs: Mapping[str, TensorSpec],
        metrics: dict[str, Any],
        fragment_rounds: list[int] | None = None,
        published: Mapping[str, torch.Tensor] | None = None,
        started: float | None = None,
    ) -> None:
        """Make round `record.round`'s commit durable as policy says, then record it in SQLite.

        The checkpoint goes first: a crash between the two leaves a checkpoint whose commit
        record `restore` replays into SQLite, never a SQLite row without its weights.
        `started`: the perf_counter() when the step began; the SQLite rows then give the
        step's seconds (outer step, delta coding, checkpoint) instead of the record's.
        """
        new_round = record.round + 1
        logged = self.logs_steps

        def write_checkpoint() -> None:
            faults.crash_point("before_checkpoint")
            self._write_checkpoint(
                new_round, masters, optimizer_state, specs, record, fragment_rounds, published
            )
            faults.crash_point("after_checkpoint")

        if (
            not logged
            and self.durable
            and (self.durability == "round" or new_round % self.checkpoint_every == 0)
        ):
            write_checkpoint()
        if started is not None:
            record = replace(record, seconds=time.perf_counter() - started)
        with self.state.transaction():
            record.store_in(self.state)
            record.apply_to(self.pool)
            self.state.record_metrics(record.round, seconds=record.seconds, **metrics)
        faults.crash_point("after_store_commit")
        if logged and self.checkpoint_due(new_round):
            # (the checkpoint then holds the record with its measured seconds)
            self._checkpoint_in_background(new_round, write_checkpoint, record.contributors)

    def checkpoint_due(self, new_round: int) -> bool:
        """Whether a logged step that makes `new_round` is checkpointed: every
        `checkpoint_every`-th round since the last checkpoint (the log holds the rest; the
        last one's write has settled, since every step waits for it first)."""
        last = self.saved_round
        return last is None or new_round - last >= self.checkpoint_every

    # ----------------------------------------------------------------- the step log

    def log_step(
        self,
        record: CommitRecord,
        running: RunningMean,
        names: Sequence[str] | None,
        fragment_rounds: Sequence[int],
        lr: float,
        inputs: Sequence[InputCopy] = (),
    ) -> Callable[[], None]:
        """Write step `record.round`'s input before the step moves anything: its sums (fp32
        files), totals, count and bound, its record, the fragments' rounds after it and the lr
        it uses. The log keeps the steps since the newest checkpoint.

        With `inputs` (the round's bodies, copied into the state dir as they came, in fold
        order: state/step_inputs.py) the log holds those files, moved in, instead of the
        sums; a restart folds them again (totals, count and bound are kept to check it).

        Returns the function that makes the log durable (the sums' files hashed back from the
        page cache beside their fsyncs, or, from `DIRECT_STEP_LOG_BYTES` on, written around it
        and hashed as they went, so their fsyncs have little to write; the bodies' fsyncs, or a
        direct copy's write and fsync, waited for): the step may run meanwhile, since the
        files no longer read the sums, but nothing may be recorded or published before it has
        returned."""
        steps = self.state.steps
        assert steps is not None
        faults.crash_point("before_step_log")
        adopted = {f"input-{at:04d}{BODY_SUFFIX}": copy for at, copy in enumerate(inputs)}
        direct = not inputs and logged_around_page_cache(_bytes_of(running.sums))
        durable = steps.stage(  # the steps before the last checkpoint went once it was written
            record.round,
            {} if inputs else _sum_groups(running.sums, min(8, os.cpu_count() or 1)),
            {
                "record": record.to_json(),
                "weighting": running.weighting,
                "totals": dict(running.totals),
                "count": running.count,
                "bound": running.bound if math.isfinite(running.bound) else None,
                "names": None if names is None else list(names),
                "fragment_rounds": list(fragment_rounds),
                "lr": lr,
                "inputs": [
                    {
                        "file": name,
                        "worker": copy.sender[0],
                        "round": copy.sender[1],
                        "tokens": copy.sender[2],
                        "checked": copy.checked,
                    }
                    for name, copy in zip(adopted, inputs, strict=True)
                ],
            },
            # a large log around the page cache, hashed as written (little left to fsync);
            # a smaller one into it, hashed back from it beside the fsync (off the step's path)
            direct=direct,
            hash_when_durable=not direct,
            adopted=adopted,
        )

        def logged() -> None:
            durable()
            faults.crash_point("after_step_log")

        return logged

    def _logged_steps(self, round_number: int) -> list[LoggedStep]:
        """The chain of logged steps that starts from `round_number` (the newest
        checkpoint's): steps round_number, round_number + 1, ... up to the first one the log
        lacks. Any other logged step is stale and dropped: an older one is in the checkpoint;
        one past a gap cannot apply (a gap needs a step lost from the disk: it is logged)."""
        steps = self.state.steps
        if steps is None:
            return []
        chain: list[LoggedStep] = []
        on_disk = steps.generations()
        while (loaded := steps.load(round_number + len(chain))) is not None:
            chain.append(_logged_step_of(loaded.metadata, loaded.tensors, loaded.bodies))
        reached = round_number + len(chain)
        steps.drop(last=round_number - 1)
        if any(g >= reached for g in on_disk):
            aside = steps.directory.parent / "steps-set-aside"
            moved = steps.set_aside(reached, aside)
            log.error(
                "the step log's steps %s cannot be applied (step %d is missing or does not "
                "read back and verify): the run resumes at round %d; they are moved to %s, "
                "not deleted",
                [path.name for path in moved],
                reached,
                reached,
                aside,
            )
        return chain

    def write_replayed(
        self,
        step: LoggedStep,
        masters: Mapping[str, torch.Tensor],
        optimizer_state: Mapping[str, torch.Tensor],
        specs: Mapping[str, TensorSpec],
        published: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        """The checkpoint of a step applied again from the log, written before anything
        is served (its SQLite rows were reconciled by `restore`)."""
        self._write_checkpoint(
            step.record.round + 1,
            masters,
            optimizer_state,
            specs,
            step.record,
            step.fragment_rounds,
            published,
        )
        self._drop_logged(through=step.record.round)

    def _drop_logged(self, through: int) -> None:
        """The step log's steps up to `through`: their checkpoints are written."""
        steps = self.state.steps
        assert steps is not None
        steps.drop(last=through)

    # ----------------------------------------------------------------- background checkpoints

    def _checkpoint_in_background(
        self, round_number: int, write: Callable[[], None], contributors: Sequence[str] = ()
    ) -> None:
        """Run `write` (round `round_number`'s checkpoint) on a thread of its own while the
        workers train: once each of the step's `contributors` has been sent its result
        (`downloads`: it slowed those downloads about twofold at 85M on 2 cores), or
        `settle` needs it. The tensors are read, never copied: the caller settles before the
        next step moves them."""
        self.settle()
        go = self._go = threading.Event()
        downloads_out = (
            None if self.downloads is None else self.downloads.waiter(contributors, round_number)
        )

        def run() -> None:
            if downloads_out is not None:
                downloads_out(go)
            started = time.perf_counter()
            try:
                write()
                self._drop_logged(through=round_number - 1)  # the step is in its checkpoint
            except Exception as exc:
                self._write_error = exc
                why = f"writing the checkpoint of round {round_number} failed: {exc}"
                log.error("%s; the step log keeps the step: restart the server", why, exc_info=True)
                if self.on_checkpoint_failed is not None:
                    self.on_checkpoint_failed(why)
                return
            if self.on_checkpoint_written is not None:
                self.on_checkpoint_written(time.perf_counter() - started)

        self._writer = threading.Thread(target=run, name="diloco-checkpoint", daemon=True)
        self._writer.start()

    def settle(self) -> None:
        """Wait for the checkpoint being written in the background; raise its error if it
        failed (every later step then waits for a restart, which replays from the log)."""
        writer = self._writer
        if writer is not None:
            self._go.set()
            if self.downloads is not None:
                self.downloads.wake()
            writer.join()
            self._writer = None
        if self._write_error is not None:
            raise self._write_error

    def flush(
        self,
        round_number: int,
        masters: Mapping[str, torch.Tensor],
        optimizer_state: Mapping[str, torch.Tensor],
        specs: Mapping[str, TensorSpec],
        last_commit: CommitRecord | None,
        fragment_rounds: list[int] | None = None,
        published: Mapping[str, torch.Tensor] | None = None,
    ) -> bool:
        """At a graceful shutdown: checkpoint the current round if the disk is behind it
        (the checkpoint being written in the background is waited for first)."""
        try:
            self.settle()
        except Exception:
            return False  # logged when it failed; the step log keeps the step
        if self.durable and self.saved_round != round_number:
            self._write_checkpoint(
                round_number,
                masters,
                optimizer_state,
                specs,
                last_commit,
                fragment_rounds,
                published,
            )
            if self.state.steps is not None:
                self._drop_logged(through=round_number - 1)  # the steps it holds
            log.info("checkpoint of round %d written at shutdown", round_number)
            return True
        return False

    def save_registered_specs(self, specs: Mapping[str, TensorSpec]) -> None:
        """The model of the first registration, before any weights exist (see restore)."""
        with self.state.transaction():
            self.state.set_meta("specs", [spec.to_json() for spec in specs.values()])

    def registered_specs(self) -> dict[str, TensorSpec] | None:
        stored = self.state.get_meta("specs")
        if stored is None:
            return None
        specs = [TensorSpec.from_json(s) for s in stored]
        return {spec.name: spec for spec in specs}

    def worker_joined(self, worker_id: str, session: str | None, round_number: int) -> None:
        with self.state.transaction():
            self.state.save_worker(worker_id, session, live=True)
            self.state.audit("registered", worker_id=worker_id, round=round_number)

    def worker_left(
        self,
        worker_id: str,
        round_number: int,
        event: str,
        keep_units: set[int] = frozenset(),
        **detail: object,
    ) -> int:
        """Membership ends: its unfinished work units go back to the pool.

        `keep_units` were reported with a submission that stays in the open round: they
        complete when it commits, so they are not leased again.
        """
        with self.state.transaction():
            self.state.save_worker(worker_id, None, live=False)
            released = self.pool.release_worker(worker_id, keep=keep_units)
            self.state.audit(
                event, worker_id=worker_id, round=round_number, released=released, **detail
            )
        return released

    def close(self, reason: str = "shutdown") -> None:
        with contextlib.suppress(Exception):  # logged when it failed; the log keeps the step
            self.settle()
        try:
            with self.state.transaction():
                self.state.audit(reason)
        finally:
            self.state.close()

    # ----------------------------------------------------------------- restoring

    def restore(self) -> RestoredState | None:
        """The newest verified state, or None for a new run; refuses conflicting settings.

        Reconciles SQLite with the checkpoint loaded: rounds the checkpoint does not include
        (lost with an interval checkpoint or a corrupt newest generation) are forgotten and
        their work units return to the pool; a commit the checkpoint has but SQLite missed
        (a crash between the two writes) is recorded now.
        """
        if self.state.checkpoints is None:
            return None
        loaded = self.state.checkpoints.load_latest()
        if loaded is None:
            if self.state.rounds_from(0):
                raise ValueError(
                    f"the state dir {self.state.directory} records committed rounds but holds "
                    "no checkpoint that verifies; refusing to start an empty run over it"
                )
            return None
        round_number = int(loaded.metadata["round"])
        pending = self._logged_steps(round_number)
        self._check_settings(loaded.metadata["settings"], bool(pending))
        commit = loaded.metadata.get("commit")
        records = [] if commit is None else [CommitRecord.from_json(commit)]
        records += [step.record for step in pending]
        # the round SQLite keeps: the checkpoint's, or the last logged step's
        reached = round_number + len(pending)
        with self.state.transaction():
            lost = self.state.rounds_from(reached)
            if lost:
                log.warning(
                    "rounds %d..%d were not in the newest checkpoint and are rolled back; "
                    "their work units return to the pool",
                    lost[0],
                    lost[-1],
                )
                self.state.forget_rounds_from(reached)
                self.pool.rollback_after(reached - 1)
                self.state.audit("rolled_back", round=reached, rounds=lost)
            for record in records:  # a crash between a step's log and its rows
                if not self.state.rounds_from(record.round):
                    record.store_in(self.state)
                    record.apply_to(self.pool)
            for departed in self.state.departed_workers():
                # Units a departed worker kept for an open round the crash lost: lease again.
                self.pool.release_worker(departed)
            self.state.audit(
                "restarted",
                round=reached,  # past the replayed steps when the log held some
                checkpoint=str(loaded.path),
                replayed_step=pending[-1].record.round if pending else None,
                replayed_steps=[step.record.round for step in pending],
            )
        self.saved_round = round_number
        specs = [TensorSpec.from_json(s) for s in loaded.metadata["specs"]]
        log.info("resuming round %d from %s", round_number, loaded.path)
        return RestoredState(
            round=round_number,
            masters=dict(loaded.tensors["weights"]),
            optimizer_state=dict(loaded.tensors.get("outer_state", {})),
            specs={spec.name: spec for spec in specs},
            live_workers=self.state.live_workers(),
            fragment_rounds=[
                int(r) for r in loaded.metadata.get("fragment_rounds", [round_number])
            ],
            published=dict(loaded.tensors["published"]) if "published" in loaded.tensors else None,
            norm_history=records[-1].norm_history if records else None,
            pending=pending,
            rolled_back=bool(lost),
        )

    def _check_settings(self, stored: dict, step_pending: bool = False) -> None:
        """Refuse settings that differ from the stored ones (unless overridden, and never
        while a logged step waits to be applied again under the settings it was logged with)."""
        current = self.settings.to_wire()
        admin_lr = self.state.get_meta(OUTER_LR)
        if admin_lr is not None and isinstance(stored.get("outer_optimizer"), dict):
            # An admin changed the lr after this checkpoint: that change is the run's lr now.
            stored = {**stored, "outer_optimizer": {**stored["outer_optimizer"], "lr": admin_lr}}
        conflicts = [
            f"{key}: {stored[key]!r} in the state dir, {current.get(key)!r} now"
            for key in sorted(stored)
            if stored[key] != current.get(key) and key not in DESCRIPTIVE_SETTINGS
        ]
        fixed = [
            key for key in ("mode", "fragments") if key in stored and stored[key] != current[key]
        ]
        if fixed:
            raise ValueError(
                "the state dir was written with "
                + ", ".join(f"{key} {stored[key]!r}" for key in fixed)
                + " and the server now has "
                + ", ".join(f"{key} {current[key]!r}" for key in fixed)
                + "; the outer optimizer state and the rounds cannot carry over (even with "
                "--override-settings): use a new --state-dir"
            )
        if conflicts and step_pending:
            raise ValueError(
                "the step log holds steps the server applied before it stopped, and they must "
                "be applied again with the settings they were logged under ("
                + "; ".join(conflicts)
                + "): start once with the stored settings (the steps are replayed and "
                "checkpointed at once), then restart with the new ones"
            )
        if conflicts and not self.override_settings:
            raise ValueError(
                "the state dir was written with other settings ("
                + "; ".join(conflicts)
                + "); start with the same settings, or pass --override-settings"
            )
        for conflict in conflicts:
            log.warning("overriding a stored setting: %s", conflict)
        if conflicts:
            with self.state.transaction():
                self.state.set_meta("settings", self.settings.to_wire())
                self.state.audit("settings_overridden", conflicts=conflicts)


def _logged_step_of(
    meta: dict,
    tensors: Mapping[str, Mapping[str, torch.Tensor]],
    bodies: Mapping[str, Path],
) -> LoggedStep:
    """A step log generation's step: its sums (every "sums-*" group) or its bodies (folded
    again by the coordinator), and its totals and record."""
    bound = math.inf if meta.get("bound") is None else float(meta["bound"])
    inputs = [
        LoggedInput(
            bodies[str(item["file"])],
            str(item["worker"]),
            int(item["round"]),
            int(item["tokens"]),
            bool(item["checked"]),
        )
        for item in meta.get("inputs", [])
    ]
    totals = {str(n): float(t) for n, t in meta["totals"].items()}
    running = None
    if not inputs:
        running = RunningMean.restored(
            str(meta["weighting"]),
            {
                name: tensor
                for group, group_tensors in tensors.items()
                if group == "sums" or group.startswith("sums-")
                for name, tensor in group_tensors.items()
            },
            totals,
            int(meta["count"]),
            bound,
        )
    return LoggedStep(
        record=CommitRecord.from_json(meta["record"]),
        running=running,
        names=None if meta.get("names") is None else [str(n) for n in meta["names"]],
        fragment_rounds=[int(r) for r in meta["fragment_rounds"]],
        lr=float(meta["lr"]),
        inputs=inputs,
        weighting=str(meta["weighting"]),
        totals=totals,
        count=int(meta["count"]),
        bound=bound,
    )


def _bytes_of(tensors: Mapping[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _sum_groups(
    sums: Mapping[str, torch.Tensor], groups: int
) -> dict[str, dict[str, torch.Tensor]]:
    """The sums in up to `groups` files of about equal bytes, in order ("sums-0", ...): each
    file is written by a thread of its own, so a model-sized log is written on up to `groups`
    cores at once."""
    share = max(1, -(-_bytes_of(sums) // max(1, groups)))
    out: dict[str, dict[str, torch.Tensor]] = {}
    filled = 0
    for name, tensor in sums.items():
        out.setdefault(f"sums-{min(filled // share, groups - 1)}", {})[name] = tensor
        filled += tensor.numel() * tensor.element_size()
    return out or {"sums-0": {}}
