"""The run's global model: fp32 masters, the outer optimizer, the version, and the outer step.

One job: hold the weights every worker's anchor comes from and move them by one outer step at
a time. A step is a value in this sense: `commit` applies it and makes it durable before the
version counts it, and when the durable write fails the model refuses to be read (`broken`)
instead of serving a step that a restart would not have. The durable state on disk is then the
truth, and a restart resumes from exactly it. (Rolling back in memory instead would need a
second copy of the masters and the momentum, 2x the model, for a failure that needs an
operator anyway: a full or failing disk.)
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from diloco.algorithm import (
    DelayedNesterov,
    OuterOptimizer,
    RunningMean,
    TensorKind,
    apply_running_mean,
    block_prefixes_from_names,
    plan_fragments,
)
from diloco.server.errors import Rejection
from diloco.server.model.master_frames import MasterFrames
from diloco.server.model.published_copy import PublishedCopy
from diloco.server.model.results import Published
from diloco.server.settings import ServerSettings
from diloco.wire import TensorSpec, encode_tensors, fingerprint, header_limit
from diloco.wire.format.layout import LentBytes

log = logging.getLogger("diloco.server")
# Makes a step's log durable (its fsyncs) while the step and its delta run: one at a time.
_SYNCS = ThreadPoolExecutor(1, thread_name_prefix="diloco-step-log")


def fragment_plan(specs: Sequence[TensorSpec], fragments: int) -> list[list[str]]:
    """Which tensor names each fragment holds: strided over the model's blocks when its names
    show them (as `diloco simulate` plans from the module), else contiguous by parameter count.
    """
    sizes = [(spec.name, math.prod(spec.shape)) for spec in specs]
    if fragments == 1:
        return [[name for name, _ in sizes]]
    prefixes = block_prefixes_from_names([name for name, _ in sizes])
    return plan_fragments(sizes, fragments, prefixes or None)


def specs_of(
    tensors: Mapping[str, torch.Tensor], kinds: Mapping[str, str] | None
) -> dict[str, TensorSpec]:
    """Specs of weights that arrive without them (--init): floats trainable, ints and bools
    buffers, unless `kinds` (a registration's) says otherwise."""

    def kind_of(name: str, tensor: torch.Tensor) -> str:
        if kinds and kinds.get(name):
            return kinds[name]
        if tensor.is_floating_point():
            return TensorKind.TRAINABLE.value
        if tensor.dtype == torch.bool:
            return TensorKind.BOOL_BUFFER.value
        return TensorKind.INT_BUFFER.value

    return {
        name: TensorSpec(name, tuple(t.shape), t.dtype, kind_of(name, t))
        for name, t in tensors.items()
    }


class GlobalModel:
    """Masters (in the download's byte layout), specs and fragment plan, optimizer, version."""

    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self.optimizer: OuterOptimizer | DelayedNesterov = settings.make_outer_optimizer()
        self.frames: MasterFrames | None = None  # the masters, in the result's byte layout
        self.specs: dict[str, TensorSpec] | None = None
        self.plan: list[list[str]] | None = None  # names per fragment (one fragment but streaming)
        # a streaming shard: the whole model's plan, other shards' fragments empty
        self.fixed_plan: list[list[str]] | None = None
        self.owner: dict[str, int] = {}  # name -> its fragment (from the plan)
        # the longest safetensors header a body may have (wire.header_limit): of every tensor
        # (the initial weights), and of each fragment's (None: none of its tensors are here)
        self.header_limit: int | None = None
        self.fragment_header_limits: list[int | None] = []
        self.kinds_known = False
        self.version = 0  # outer steps committed: the round in sync mode
        self.published: Published | None = None  # the current full weights, encoded once
        # --download-codec: P, what every worker holds, and the delta of the last step
        self.copy: PublishedCopy | None = None
        # (the version it leads to, the step's tensors, its body)
        self.delta: tuple[int, frozenset[str], LentBytes] | None = None
        # each step's tensors (the whole model, or a streaming fragment's) -> its last delta
        # body, written over by its next step's (`_reusable_delta`)
        self._delta_bodies: dict[frozenset[str], LentBytes] = {}
        self.broken: str | None = None  # why it refuses to be read, until restarted
        self.step_seconds: dict[str, float] = {}  # the parts of the last commit (metrics)

    # ----------------------------------------------------------------- what it is

    @property
    def masters(self) -> dict[str, torch.Tensor] | None:
        """The fp32 master weights (int/bool buffers keep their dtype); None before any.

        Read them here; an update goes through `frames.writable()` (see MasterFrames)."""
        return None if self.frames is None else self.frames.masters

    @property
    def fingerprint(self) -> str | None:
        return None if self.specs is None else fingerprint(list(self.specs.values()))

    def kinds(self) -> dict[str, str]:
        assert self.specs is not None
        return {name: spec.kind for name, spec in self.specs.items()}

    def set_specs(self, specs: dict[str, TensorSpec], *, kinds_known: bool) -> None:
        """The model's tensors; the fragment plan follows from them (ValueError if it cannot),
        unless it is fixed (a streaming shard's: its fragments of the whole model's plan)."""
        plan = self.fixed_plan or fragment_plan(list(specs.values()), self.settings.fragments)
        self.specs, self.plan, self.kinds_known = specs, plan, kinds_known
        self.owner = {name: f for f, members in enumerate(plan) for name in members}
        self.header_limit = header_limit(specs)
        self.fragment_header_limits = [header_limit(names) if names else None for names in plan]

    def adopt(
        self,
        tensors: Mapping[str, torch.Tensor],
        version: int = 0,
        published: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        """These weights become the masters at `version` (the initial ones, or restored with
        the `published` copy that workers hold, when downloads are deltas)."""
        assert self.specs is not None
        dtypes = {n: self.wire_dtype(n, t) for n, t in tensors.items()}
        self.frames = MasterFrames(tensors, dtypes)
        self.version = version
        self.published = None
        self.delta = None
        self._delta_bodies = {}
        if self.settings.delta_downloads:
            coded = {n for n, spec in self.specs.items() if spec.trained}
            source = published if published is not None else self.frames.masters
            self.copy = PublishedCopy(source, dtypes, self.settings.download, coded)

    @property
    def published_tensors(self) -> dict[str, torch.Tensor] | None:
        """P, for the checkpoint (None when downloads are full weights: P is the masters)."""
        return None if self.copy is None else self.copy.tensors

    # ----------------------------------------------------------------- health

    def require_healthy(self) -> None:
        if self.broken is not None:
            raise Rejection(503, "checkpoint_failed", self.broken)

    def stop_serving(self, why: str, exc_info: bool = False) -> Rejection:
        """From now on every request is refused until a restart (memory that can no longer
        be trusted, or that the disk may contradict); the 503 to raise for this one."""
        self.broken = why
        log.error("%s; refusing requests until restarted", why, exc_info=exc_info)
        return Rejection(503, "checkpoint_failed", why)

    def durably(self, what: str, write: Callable[[], None]) -> None:
        """Run a state write; a failure stops the model being served until restarted.

        After a failed write the memory and the disk may disagree, and answering from memory
        could publish an outer step a restart would not have: refusing is the safe state.
        """
        try:
            write()
        except Exception as exc:
            raise self.stop_serving(f"{what} failed: {exc}", exc_info=True) from None

    # ----------------------------------------------------------------- the outer step

    def sums_storage(self) -> dict[str, torch.Tensor]:
        """The buffers a running mean's sums are written over, the same every step."""
        assert self.frames is not None
        return self.frames.sums()

    def fragment_sums_storage(
        self, names: Sequence[str], fresh: bool = False
    ) -> dict[str, torch.Tensor]:
        """The buffers a streaming fragment's running mean is written over: a pool shared by
        the fragments' rounds, or (`fresh`: another fragment's sums are open) new ones
        (`MasterFrames.fragment_sums`)."""
        assert self.frames is not None
        return self.frames.fragment_sums(names, fresh=fresh)

    def senders_storage(self) -> dict[str, torch.Tensor]:
        """The buffers a running mean's counts of senders are written over (sparse_mean);
        none before the weights exist."""
        return {} if self.frames is None else self.frames.senders()

    def commit(
        self,
        running: RunningMean,
        new_version: int,
        write: Callable[[], None],
        names: Sequence[str] | None = None,
        log_step: Callable[[], Callable[[], None]] | None = None,
    ) -> None:
        """Apply one outer step (its running sums, used up here) to `names` (a streaming
        fragment; None: every tensor), move the published copy by its coded delta, make it
        durable with `write`, and only then count it as `new_version`. Rejection 503 if the
        write fails.

        `log_step`, when given, writes the step's input (the sums) before anything moves and
        returns what makes it durable: its fsyncs run on a thread beside the step and the
        delta, and `write` (which then only records the step: the journal writes its
        checkpoint in the background, see state/journal.py) waits for them."""
        assert self.frames is not None and self.specs is not None
        self.require_healthy()
        logging_started = time.perf_counter()
        syncing: Future[None] | None = None
        if log_step is not None:
            staged: list[Callable[[], None]] = []
            what = f"logging the outer step of round {new_version}"
            self.durably(what, lambda: staged.append(log_step()))
            syncing = _SYNCS.submit(staged[0])
        started = time.perf_counter()
        try:
            if running.count:  # (writable() copies the masters away from a straggler's download)
                frames, kinds = self.frames, self.kinds()

                def step() -> None:  # a step that fails part way leaves the masters half moved
                    apply_running_mean(
                        frames.writable(),
                        running,
                        self.optimizer,
                        kinds,
                        policy=self.settings.policy,
                    )

                # Half-moved masters must not be served, logged or not (without a step log
                # they were, under the old round, and the round's used-up sums stalled it).
                self.durably(f"the outer step of round {new_version}", step)
            stepped = time.perf_counter()
            if self.copy is not None:
                copy, masters = self.copy, self.frames.masters
                step_names = list(self.specs) if names is None else list(names)

                reuse = self._reusable_delta(step_names)

                def code_delta() -> None:  # P half moved is as unsafe to serve as a failed write
                    self.delta = None  # (a half-written body is never served)
                    self.published = None
                    if reuse is None:
                        body = LentBytes(copy.advance(masters, step_names))
                    else:  # the same object: every loan of its bytes is counted in one place
                        body = reuse
                        written = copy.advance(masters, step_names, reuse.data)
                        if written is not reuse.data:  # (the body served must be this one)
                            raise RuntimeError("the delta was not written over the last body")
                    self.delta = (new_version, frozenset(step_names), body)
                    self._delta_bodies[frozenset(step_names)] = body

                self.durably(f"coding the download delta of round {new_version}", code_delta)
            coded = time.perf_counter()
        except BaseException:  # no write goes on after the commit has failed
            if syncing is not None:
                with contextlib.suppress(Exception):
                    syncing.result()
            raise
        if syncing is not None:  # the step's log is durable before anything is recorded
            self.durably(f"logging the outer step of round {new_version}", syncing.result)
        synced = time.perf_counter()
        what = "recording" if log_step is not None else "writing the checkpoint of"
        self.durably(f"{what} round {new_version}", write)
        self.version = new_version
        self.step_seconds = {
            "outer_step": stepped - started,
            "delta": coded - stepped,
            # the step log (written before the step, made durable beside the step and the
            # delta, then waited for), then its record; or the checkpoint, written before the
            # result
            **(
                {
                    "step_log": started - logging_started,  # written, before the step
                    "step_log_wait": synced - coded,  # its hashes and fsyncs, past the delta
                    "record": time.perf_counter() - synced,
                }
                if log_step is not None
                else {"checkpoint": time.perf_counter() - coded}
            ),
        }

    def _reusable_delta(self, names: Sequence[str]) -> LentBytes | None:
        """The delta body of the last step of the same tensors, to be written over by this
        step's when nobody reads it any more: it saves allocating and page-faulting a new
        body (0.26x the model with int8, beside the 4 fp32 copies) every step, and in
        streaming mode keeps one body per fragment instead of a third at each commit.

        The result that served it stops being served once this step commits: the whole
        model's because the version moves (every engine encodes the result anew per
        version), a streaming fragment's because the fragment's result is replaced right
        after its step, under the same lock (a poll for the old round then gets 410). Every
        response takes its loan under that lock, and one still sending the body holds it
        (`lent`). A commit that fails part way leaves the server broken: it serves nothing
        more, so a half-written body is never read."""
        body = self._delta_bodies.get(frozenset(names))
        return None if body is None or body.lent else body

    # ----------------------------------------------------------------- what workers download

    def wire_dtype(self, name: str, master: torch.Tensor) -> torch.dtype:
        """How a master goes out: floating ones in the download dtype, int and bool buffers in
        their spec's dtype (as the workers' own tensors are)."""
        assert self.specs is not None
        if master.is_floating_point():
            return self.settings.download_dtype
        spec_dtype = self.specs[name].dtype
        return master.dtype if spec_dtype.is_floating_point else spec_dtype

    def current_weights(self, fragment_rounds: Sequence[int]) -> Published:
        """The full weights of this version, encoded at most once."""
        assert self.frames is not None
        if self.published is None or self.published.round != self.version:
            whole = self.plan is not None and len(self.plan) == 1  # a fragment's is partial
            delta = self.fragment_delta(self.version, self.plan[0]) if whole else None
            self.published = Published(
                self.version,
                self.frames.result() if self.copy is None else self.copy.current,
                fragment_rounds=(
                    tuple(fragment_rounds) if self.settings.mode == "streaming" else None
                ),
                delta=delta,
            )
        return self.published

    def encode(self, names: Sequence[str]) -> bytearray:
        """The masters of `names` (a streaming fragment) in the download dtype, ints as their
        spec: a copy, so later outer steps of other fragments leave it as it is."""
        assert self.masters is not None
        masters = self.masters if self.copy is None else self.copy.tensors
        out = {n: masters[n].to(self.wire_dtype(n, masters[n])) for n in names}
        return encode_tensors(out, float_dtype=self.settings.download_dtype)

    def fragment_delta(self, version: int, names: Sequence[str]) -> LentBytes | None:
        """The delta body of the step that made `version` from the tensors `names` (a
        streaming fragment's), if that is the last step: after a restart the last step may
        be another fragment's, whose delta is no answer for this one."""
        if self.delta is None or self.delta[0] != version or self.delta[1] != frozenset(names):
            return None
        return self.delta[2]
