"""DiLoCoWorker: turns any torch optimizer loop into a DiLoCo worker.

A post-step hook counts optimizer steps (so gradient accumulation is handled: H counts steps,
not batches). The server's mode decides what happens then:
- sync: every H steps the worker sends anchor - local in the server's upload dtype, waits for
  the round's result and loads it as both the model and the new anchor;
- async: the same exchange, but the server applies the arrival at once (no barrier), and with
  DyLU the server's heartbeat answers set this worker's H for its next window;
- streaming: fragments are sent on a staggered schedule from a background thread and merged
  tau steps later (`worker.streaming`).
The anchor lives on the CPU in fp32. A network failure retries the same submission under the
same (worker, round, fragment) key, and an eviction re-registers under the same id: local
progress is never thrown away.
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from diloco.algorithm import classify_tensors, pseudo_gradient, to_fp32_masters
from diloco.wire import decode_tensors, encode_tensors, specs_of
from diloco.wire.validation import MAX_UNITS_PER_SUBMISSION
from diloco.worker import distributed
from diloco.worker.checkpoint import (
    WorkerCheckpoint,
    load_worker_checkpoint,
    restore_worker_checkpoint,
    save_worker_checkpoint,
)
from diloco.worker.client import DiLoCoClient, Weights
from diloco.worker.errors import ClientClosed, ServerError
from diloco.worker.heartbeat import Heartbeat
from diloco.worker.retry import RetryPolicy
from diloco.worker.settings import WorkerSettings
from diloco.worker.streaming import FragmentStreamer
from diloco.worker.tokens import TokenCounter
from diloco.worker.trace import SampleTrace

log = logging.getLogger("diloco.worker")


@dataclass(frozen=True)
class Exchanged:
    """A sync's outcome: the global values to take, and the round they start."""

    tensors: dict[str, torch.Tensor]
    round: int  # sync: the next round; streaming: the fragment's next round; async: a version
    rebase_rounds: list[int] | None = None  # the server was behind: full weights, its rounds


class ReportsUnits(Protocol):
    """A data source of server-leased work units (diloco.worker.data.LeasedSampler)."""

    def finished_units(self) -> list[int]: ...

    def reported(self, units: list[int]) -> None: ...

    def forget(self, units: list[int]) -> None: ...


def _log_retry(operation: str, cause: BaseException | int, delay: float) -> None:
    """A worker that waits on the server says why, so a stuck barrier is never silent."""
    reason = getattr(cause, "error", None) or cause
    log.warning("%s: %s; retrying in %.1f s", operation, reason, delay)


WAIT_REPORT_SECONDS = 60.0  # a result long-poll this long unanswered is logged, and again


def describe_wait(round_number: int, fragment: int, seconds: float, waiting: Mapping) -> str:
    """Why a round has not committed yet, from the server's "waiting" answer."""
    what = f"round {round_number}" + (f" of fragment {fragment}" if fragment else "")
    reasons = []
    if waiting.get("waiting_for"):
        reasons.append(f"waiting for {', '.join(waiting['waiting_for'])}")
    short = waiting.get("more_submissions_needed") or 0
    if short:
        reasons.append(
            f"the server's --min-workers needs {short} more submission{'s' if short > 1 else ''}"
            " than its live workers will send; it commits once more workers join and submit"
        )
    why = "; ".join(reasons) or "the server is committing it"
    return f"{what} still open after {seconds:.0f} s: {why}"


def _unwrap(model: nn.Module) -> nn.Module:
    """DDP / FSDP-style wrappers keep the real module in `.module`; its names are canonical."""
    return model.module if isinstance(getattr(model, "module", None), nn.Module) else model


def _updated_anchor(
    anchor: dict[str, torch.Tensor], tensors: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """`tensors` as CPU copies (fp32 for floating ones), written over `anchor` where it fits.

    Copying into the anchor's own memory spares a model-sized allocation, and its page faults,
    every round; a new anchor is built when the names, shapes or dtypes differ.
    """
    fresh = {
        name: (torch.float32 if t.is_floating_point() else t.dtype, t.shape)
        for name, t in tensors.items()
    }
    if fresh.keys() == anchor.keys() and all(
        (a.dtype, a.shape) == fresh[name] and a.device.type == "cpu" for name, a in anchor.items()
    ):
        for name, target in anchor.items():
            target.copy_(tensors[name].detach())
        return anchor
    return to_fp32_masters(tensors)


class DiLoCoWorker:
    """One DiLoCo worker (one process, or one torch.distributed group led by rank 0)."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        server_url: str,
        worker_id: str | None = None,
        token: str | None = None,
        *,
        retry: RetryPolicy | None = None,
        result_wait: float = 30.0,
        heartbeat: bool = True,
        data: ReportsUnits | None = None,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        scheduler: Any = None,
        fragment_timeout: float | None = None,
        max_upload_mbps: float | None = None,
        ca_file: str | os.PathLike[str] | None = None,
    ) -> None:
        """`checkpoint_dir`: after every round the worker saves its inner optimizer (and
        `scheduler`) state, RNG state, step, round, session and data position there, and a
        worker started on the same directory resumes from it under the same id (see
        diloco.worker.checkpoint); a saved state that does not fit is ignored with a warning.

        `fragment_timeout` (streaming): the longest a merge waits for its fragment's sync
        before it gives up on it for this window (keeping the old anchor); None waits as long
        as the retry policy keeps trying. `max_upload_mbps` caps the upload bandwidth (a
        shared link); None sends as fast as the network allows.

        `token` is the enrollment token (None: $DILOCO_TOKEN); registering with it gets this
        worker a credential of its own, sent from then on and kept in the checkpoint.
        `ca_file`: PEM certificates an https:// server's certificate must chain to.
        """
        # Checked before anything reaches the server (the upload cap by the client's limiter).
        if fragment_timeout is not None and not (
            isinstance(fragment_timeout, (int, float)) and 0 < fragment_timeout < math.inf
        ):
            raise ValueError(f"fragment_timeout must be > 0 seconds, got {fragment_timeout!r}")
        self.model = _unwrap(model)
        self.optimizer = optimizer
        self.server_url = server_url
        self.worker_id = worker_id
        self.result_wait = result_wait
        self.is_leader = distributed.rank() == 0
        self.kinds = classify_tensors(self.model)
        self.specs = specs_of(self.model.state_dict(), self.kinds)
        self.client = (
            DiLoCoClient(
                server_url,
                token,
                retry=retry or RetryPolicy(),
                on_retry=_log_retry,
                max_upload_mbps=max_upload_mbps,
                ca_file=ca_file,
            )
            if self.is_leader
            else None
        )
        self._register_lock = threading.Lock()
        self.session = secrets.token_hex(16)  # makes a retried registration idempotent
        self.local_step = 0
        self.steps_in_round = 0
        self.tokens_in_round = 0
        self.tokens_total = 0
        self.rounds = 0
        self.round = 0
        self.last_loss: float | None = None
        self._started = time.monotonic()
        self.anchor: dict[str, torch.Tensor] = {}
        # The last downloaded weights' buffer, loaded already: the next download reuses it.
        self._download: bytearray | None = None
        self._closed = False
        self.rebases = 0
        self.blocked_seconds = 0.0  # training-thread time spent waiting on the server
        self.windows = 0  # sync windows finished (rounds, async arrivals, fragment merges)
        self.last_window_speed: float | None = None  # steps/s of compute in the last window
        self._window_mark = (time.monotonic(), 0, 0.0)  # (when, local step, blocked) at its start
        # (when, blocked seconds) after the first window and when training ended: the steady
        # state between them leaves out start-up skew between workers and the final flush.
        self._steady_from: tuple[float, float] | None = None
        self._steady_to: tuple[float, float] | None = None
        self.recommended_sync_every: int | None = None  # DyLU, from heartbeat answers (async)
        self.streamer: FragmentStreamer | None = None
        self.fragment_plan: list[list[str]] | None = None
        self.fragment_rounds: list[int] = []
        self.data = data  # a LeasedSampler (diloco.worker.data) whose units we report
        self.sample_trace = SampleTrace.from_env()  # DILOCO_TRACE_SAMPLES: audits only
        self.scheduler = scheduler
        self.checkpoint_dir = checkpoint_dir
        self.resumed: WorkerCheckpoint | None = None
        if checkpoint_dir is not None:
            if distributed.group_size() > 1:
                raise ValueError(
                    "checkpoint_dir is for single-process workers; under torch.distributed "
                    "save each rank's state with your trainer's own checkpointing"
                )
            self._resume(checkpoint_dir)

        info = distributed.lead(self._fetch_info, distributed.broadcast_json)
        self.settings = WorkerSettings.from_info(info, server_url)
        self.settings.check_supported()
        self.window_sync_every = self.settings.sync_every  # H of this window (DyLU may lower it)
        self.worker_id = distributed.lead(self._join, self._share_join)
        if self.settings.mode == "streaming":
            assert self.fragment_plan is not None
            self.streamer = FragmentStreamer(
                self, self.fragment_plan, self.fragment_rounds, fragment_timeout
            )
        sync_resume = self.settings.mode == "sync" and self.resumed is not None
        if sync_resume and self.round > self.resumed.anchor_round:  # type: ignore[union-attr]
            # Rounds committed while we were down already hold our work (the barrier waited
            # for us) or went on without us (we were evicted): either way we start at the
            # server's round, and our step count and data position follow it.
            assert self.resumed is not None
            ahead = (self.round - self.resumed.anchor_round) * self.settings.sync_every
            self.local_step += ahead
            log.warning(
                "the server is %d round(s) past our checkpoint: skipping %d steps",
                self.round - self.resumed.anchor_round,
                ahead,
            )
        self._hook = optimizer.register_step_post_hook(self._after_step)
        # Token weighting needs token counts; a loop that reports none is counted for.
        self._tokens_counted_in_round = 0
        self._token_counter = (
            TokenCounter(self.model, self._count_tokens)
            if self.settings.weighting == "tokens"
            else None
        )
        self._heartbeat: Heartbeat | None = None
        if self.is_leader and heartbeat:
            beat_client = DiLoCoClient(
                server_url,
                auth=self.client.auth,  # one credential: re-registering renews it for both
                retry=RetryPolicy(attempts=1),
                ca_file=ca_file,
            )
            self._heartbeat = Heartbeat(
                beat_client,
                lambda: self.worker_id or "",
                self.settings.heartbeat_interval,
                self._heartbeat_report,
                self._reregister,
                self._heartbeat_answer,
            )
            self._heartbeat.start()

    # ----------------------------------------------------------------- resuming

    def _resume(self, directory: str | os.PathLike[str]) -> None:
        """Restore a saved worker (before joining, so that it registers under its old id)."""
        saved = load_worker_checkpoint(
            directory, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler
        )
        if saved is None:
            return
        if self.worker_id is not None and self.worker_id != saved.worker_id:
            log.warning(
                "the checkpoint in %s is worker %r's, not %r's: starting fresh",
                directory,
                saved.worker_id,
                self.worker_id,
            )
            return
        restore_worker_checkpoint(
            saved, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler
        )
        self.worker_id = saved.worker_id
        self.session = str(saved.extra.get("session") or self.session)
        if self.client is not None and saved.extra.get("credential"):
            self.client.credential = str(saved.extra["credential"])  # refused: enrolls again
        self.local_step = saved.local_step
        self.tokens_total = saved.tokens
        self.rounds = int(saved.extra.get("rounds", 0))
        self.resumed = saved
        log.warning(
            "worker %s resumes at local step %d (round %d) from %s",
            saved.worker_id,
            saved.local_step,
            saved.anchor_round,
            saved.path,
        )

    def save_checkpoint(self) -> None:
        """Save the worker's state now (done after every round when checkpoint_dir is set)."""
        if self.checkpoint_dir is None or self.worker_id is None:
            return
        extra: dict[str, Any] = {"session": self.session, "rounds": self.rounds}
        if self.client is not None and self.client.credential:
            extra["credential"] = self.client.credential  # the file is 0600, like the dir
        state_dict = getattr(self.data, "state_dict", None)
        if callable(state_dict):
            extra["data"] = state_dict()
        save_worker_checkpoint(
            self.checkpoint_dir,
            worker_id=self.worker_id,
            model=self.model,
            optimizer=self.optimizer,
            anchor=self.anchor,
            anchor_round=self.round,
            local_step=self.local_step,
            steps_in_round=self.steps_in_round,
            tokens=self.tokens_total,
            scheduler=self.scheduler,
            extra=extra,
        )

    # ----------------------------------------------------------------- joining

    def _fetch_info(self) -> dict:
        assert self.client is not None
        return self.client.info()

    def _register(self) -> dict:
        assert self.client is not None
        reply = self.client.register(
            self.worker_id, [s.to_json() for s in self.specs], session=self.session
        )
        self.worker_id = reply["worker_id"]
        return reply

    def _reregister(self) -> None:
        """Come back under the same id after an eviction or a server restart."""
        with self._register_lock:
            try:
                self._register()
            except ServerError as exc:
                if exc.kind != "worker_id_taken":  # taken: another thread already re-registered
                    raise

    def _register_when_free(self) -> dict:
        """Register; while our id is held by a live worker (most often an earlier process of
        ours, killed before it saved a checkpoint, that the server has not evicted yet), wait
        for the server to evict it, up to twice its heartbeat timeout, saying so in the log."""
        timeout = self.settings.heartbeat_timeout
        deadline = time.monotonic() + 2 * timeout + 5
        told = -math.inf
        while True:
            try:
                return self._register()
            except ServerError as exc:
                if exc.kind != "worker_id_taken" or time.monotonic() > deadline:
                    if exc.kind == "worker_id_taken":
                        raise ServerError(
                            exc.status,
                            exc.kind,
                            f"worker id {self.worker_id!r} is still held by a live worker "
                            f"after {2 * timeout + 5:g} s: another process with this id is "
                            "running; give this one another --worker-id",
                        ) from None
                    raise
            if time.monotonic() - told >= 10:
                told = time.monotonic()
                log.warning(
                    "worker id %r is held by a live worker (an earlier process of ours that "
                    "the server has not evicted yet?); waiting for its eviction (heartbeat "
                    "timeout %g s)",
                    self.worker_id,
                    timeout,
                )
            time.sleep(min(1.0, self.settings.heartbeat_interval))

    def _join(self) -> str:
        """Register; the first worker uploads its weights; everyone starts from the server's."""
        assert self.client is not None
        with self._register_lock:
            reply = self._register_when_free()
        if reply["needs_initial_weights"]:
            try:
                self.client.upload_initial(self.worker_id, encode_tensors(self.model.state_dict()))
            except ServerError as exc:
                # Another worker won, or ours landed and the answer was lost (a restart):
                # either way the server's copy is what every worker starts from.
                if exc.kind != "weights_exist":
                    raise
        weights = self._fetch_weights()
        self._adopt(decode_tensors(weights.body), weights.round)
        self.fragment_rounds = weights.fragment_rounds or [weights.round]
        if self.settings.mode == "streaming":
            self.fragment_plan = self._fetch_info().get("fragment_plan")
            if not self.fragment_plan:
                raise ServerError(
                    200, "invalid_response", "the streaming server states no fragment_plan"
                )
        log.info("worker %s joined at round %d", self.worker_id, weights.round)
        return self.worker_id

    def _share_join(self, worker_id: str | None) -> str:
        distributed.broadcast_tensors_(self.model.state_dict())
        self.round = distributed.broadcast_json(self.round)
        self.fragment_rounds = distributed.broadcast_json(self.fragment_rounds)
        self.fragment_plan = distributed.broadcast_json(self.fragment_plan)
        return distributed.broadcast_json(worker_id)

    # ----------------------------------------------------------------- the round

    def _after_step(self, *_args: object, **_kwargs: object) -> None:
        self.local_step += 1
        if self.streamer is not None:
            self.streamer.after_step()
            return
        self.steps_in_round += 1
        if self.steps_in_round >= self.window_sync_every:
            self.sync()

    def report(self, loss: float | None = None, tokens: int = 0) -> None:
        """Tell the worker the latest training loss and tokens (for heartbeats and weighting).

        The first explicit token count replaces the worker's own (see worker/tokens.py)."""
        if loss is not None:
            self.last_loss = float(loss)
        if tokens and self._token_counter is not None:
            self._token_counter.remove()
            self._token_counter = None
            self.tokens_in_round -= self._tokens_counted_in_round
            self.tokens_total -= self._tokens_counted_in_round
        self.tokens_in_round += tokens
        self.tokens_total += tokens

    def _count_tokens(self, tokens: int) -> None:
        self._tokens_counted_in_round += tokens
        self.tokens_in_round += tokens
        self.tokens_total += tokens

    def sync(self) -> None:
        """Sync now: send this round's pseudo-gradient, wait for the result, load it everywhere.

        In streaming mode: merge the fragment in flight, then sync every fragment trained since
        its last merge (what `close` does at the end, so no training is lost).
        """
        if self.streamer is not None:
            started, before = time.monotonic(), self.blocked_seconds
            self.streamer.flush()  # its merges count their waits; the whole flush counts once
            self.blocked_seconds = before + (time.monotonic() - started)
            self.save_checkpoint()
            return
        if self.steps_in_round == 0:
            return
        started = time.monotonic()
        distributed.lead(self._exchange_round, self._share_result)
        self.blocked_seconds += time.monotonic() - started
        self.rounds += 1
        self.steps_in_round = 0
        self.tokens_in_round = 0
        self._tokens_counted_in_round = 0
        self.window_done()
        self.save_checkpoint()

    def _exchange_round(self) -> Exchanged:
        assert self.client is not None
        gradient = pseudo_gradient(self.anchor, self.model.state_dict())
        body = encode_tensors(gradient, float_dtype=self.settings.upload_dtype)
        del gradient
        units = self.units_to_report()
        progress = self.progress_to_report()
        drain = getattr(self.data, "drain_trace", None)
        if self.sample_trace is not None and callable(drain) and self.worker_id is not None:
            self.sample_trace.record(self.worker_id, self.round, drain())
        result = self.exchange(body, units, self.round, progress=progress)
        if result.rebase_rounds is None:
            self.units_reported(units)
        return result

    def exchange(
        self,
        body: bytearray,
        units: list[int],
        round_number: int,
        *,
        fragment: int = 0,
        cancelled: Callable[[], bool] | None = None,
        tokens: int | None = None,
        progress: dict[int, int] | None = None,
    ) -> Exchanged:
        """Submit one pseudo-gradient (of a fragment) and wait for its result, riding through
        evictions, restarts and lost answers; a server behind us is a rebase. `tokens`
        defaults to the tokens trained this round; `progress` is the unit under way."""
        tokens = self.tokens_in_round if tokens is None else tokens
        progress = dict(progress or {})
        try:
            self._submit(body, units, round_number, fragment, tokens, progress)
            return self._await_result(
                body, units, round_number, fragment, cancelled, tokens, progress
            )
        except ServerError as exc:
            if exc.kind != "future_round":
                raise
            return self._rebase(round_number)

    def units_to_report(self) -> list[int]:
        """Work units finished since the last submission (a server-dispatched data source).

        At most what one submission may carry; the rest stay finished and go with the next.
        """
        if self.data is None:
            return []
        return self.data.finished_units()[:MAX_UNITS_PER_SUBMISSION]

    def progress_to_report(self) -> dict[int, int]:
        """The unit under way and the samples of it trained (a server-dispatched source)."""
        progress = getattr(self.data, "progress", None)
        return progress() if callable(progress) else {}

    def units_reported(self, units: list[int]) -> None:
        if self.data is not None:
            self.data.reported(units)

    def _submit(
        self,
        body: bytearray,
        units: list[int],
        round_number: int,
        fragment: int,
        tokens: int,
        progress: dict[int, int],
    ) -> None:
        assert self.client is not None and self.worker_id is not None
        while True:
            try:
                self.client.submit(
                    round_number,
                    self.worker_id,
                    body,
                    fragment=fragment,
                    tokens=tokens,
                    units=units,
                    progress=progress,
                )
                return
            except ServerError as exc:
                detail = exc.detail if isinstance(exc.detail, dict) else {}
                lost_unit = detail.get("unit_id")
                lost = lost_unit in units or lost_unit in progress
                if exc.kind in ("unit_not_leased", "unknown_unit") and lost:
                    # We were evicted and our leases went to others: not ours to report.
                    log.warning(
                        "work unit %s is no longer leased to us; not reporting it", lost_unit
                    )
                    if lost_unit in units:
                        units.remove(lost_unit)
                    progress.pop(lost_unit, None)
                    if self.data is not None:
                        self.data.forget([lost_unit])
                    continue
                if exc.kind != "unknown_worker":
                    raise
                self._reregister()

    def _await_result(
        self,
        body: bytearray,
        units: list[int],
        round_number: int,
        fragment: int,
        cancelled: Callable[[], bool] | None,
        tokens: int,
        progress: dict[int, int],
    ) -> Exchanged:
        assert self.client is not None and self.worker_id is not None
        started = time.monotonic()
        next_report = started + WAIT_REPORT_SECONDS
        while True:
            if cancelled is not None and cancelled():
                raise ClientClosed(f"the sync of round {round_number} was given up")
            now = time.monotonic()
            if now >= next_report:
                waited = now - started
                log.warning(describe_wait(round_number, fragment, waited, self.client.last_waiting))
                next_report = now + WAIT_REPORT_SECONDS
            try:
                got = self.client.wait_result(
                    round_number,
                    self.worker_id,
                    wait=self.result_wait,
                    fragment=fragment,
                    into=self._reusable_download(),
                )
            except ServerError as exc:
                if exc.kind == "unknown_worker":
                    self._reregister()  # our submission stays in the round
                    continue
                if exc.kind == "not_submitted":  # the server restarted without it: send again
                    log.warning("round %d lost our submission; sending it again", round_number)
                    self._submit(body, units, round_number, fragment, tokens, progress)
                    continue
                if exc.kind == "result_expired":
                    return self._from_current_weights(fragment)
                raise
            if got is not None:
                result, next_round = got
                self._downloaded(result)
                return Exchanged(decode_tensors(result), next_round)

    def _reusable_download(self) -> bytearray | None:
        """The last downloaded weights' buffer, already loaded, for the next download to
        overwrite (sync and async). Streaming keeps each fragment's result until its merge,
        from another thread, so it always downloads into a new buffer."""
        return self._download if self.streamer is None else None

    def _downloaded(self, body: bytearray) -> None:
        if self.streamer is None:
            self._download = body

    def _fetch_weights(self) -> Weights:
        assert self.client is not None
        weights = self.client.get_weights_detail(into=self._reusable_download())
        self._downloaded(weights.body)
        return weights

    def _from_current_weights(self, fragment: int) -> Exchanged:
        """The round's result is gone (newer ones exist): take the current weights instead."""
        weights = self._fetch_weights()
        tensors = decode_tensors(weights.body)
        if self.streamer is None:
            return Exchanged(tensors, weights.round)
        names = self.streamer.plan[fragment]
        rounds = weights.fragment_rounds or [weights.round]
        return Exchanged({n: tensors[n] for n in names}, rounds[fragment])

    def _rebase(self, round_number: int) -> Exchanged:
        """The server is behind us: it restarted from an older checkpoint (durability interval).

        The pending pseudo-gradient is relative to an anchor the server no longer has, so it is
        dropped; the worker adopts the server's weights and round and trains on from there
        (its inner optimizer state, step count and schedule carry on).
        """
        assert self.client is not None
        weights = self._fetch_weights()
        log.warning(
            "the server is at round %d, behind our round %d (it restarted from an older "
            "checkpoint): adopting its weights, dropping this round's pseudo-gradient",
            weights.round,
            round_number,
        )
        self.rebases += 1
        return Exchanged(
            decode_tensors(weights.body),
            weights.round,
            rebase_rounds=weights.fragment_rounds or [weights.round],
        )

    def _share_result(self, result: Exchanged | None) -> None:
        if result is not None:
            self._adopt(result.tensors, result.round)
        distributed.broadcast_tensors_(self.model.state_dict())
        self.round = distributed.broadcast_json(self.round)
        self.window_sync_every = distributed.broadcast_json(
            self.recommended_sync_every or self.settings.sync_every
        )

    # ----------------------------------------------------------------- streaming helpers

    def finished_units(self) -> list[int]:
        return [] if self.data is None else list(self.data.finished_units())

    def adopt_everywhere(self, tensors: Mapping[str, torch.Tensor], round_number: int) -> None:
        """Every rank takes the full global weights (rank 0 has them): a streaming rebase."""
        if self.is_leader:
            self._adopt(tensors, round_number)
        distributed.broadcast_tensors_(self.model.state_dict())
        self.round = distributed.broadcast_json(self.round)

    def broadcast_fragment(
        self, tensors: Mapping[str, torch.Tensor], names: list[str]
    ) -> dict[str, torch.Tensor]:
        """Rank 0's G'_f on every rank, on the model's device (followers get fresh buffers)."""
        state = self.model.state_dict()
        if self.is_leader:
            out = {n: tensors[n].to(device=state[n].device) for n in names}
        else:
            out = {}
            for n in names:
                dtype = self.settings.download_dtype if state[n].is_floating_point() else None
                out[n] = torch.empty_like(state[n], dtype=dtype)
        distributed.broadcast_tensors_(out)
        return out

    def set_anchor(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """The fragment's new anchor (rank 0 keeps the anchor, on the CPU in fp32)."""
        if not self.is_leader:
            return
        part = {name: self.anchor[name] for name in tensors if name in self.anchor}
        self.anchor.update(_updated_anchor(part, tensors))  # into its memory where it fits

    def window_done(self) -> None:
        """A sync window ended: its compute speed (steps per second not spent blocked) is the
        sample a heartbeat reports for DyLU; the next window's H is the server's advice."""
        now = time.monotonic()
        when, step, blocked = self._window_mark
        compute = (now - when) - (self.blocked_seconds - blocked)
        steps = self.local_step - step
        if steps > 0 and compute > 0:
            self.last_window_speed = steps / compute
            self.windows += 1
        self._window_mark = (now, self.local_step, self.blocked_seconds)
        if self._steady_from is None:
            self._steady_from = (now, self.blocked_seconds)

    def _adopt(self, tensors: Mapping[str, torch.Tensor], round_number: int) -> None:
        """New global weights become the model and (on the leader) the fp32 CPU anchor."""
        state = self.model.state_dict()
        with torch.no_grad():
            for name, target in state.items():
                target.copy_(tensors[name])
        self.anchor = _updated_anchor(self.anchor, tensors)
        self.round = round_number

    # ----------------------------------------------------------------- reporting and exit

    def _heartbeat_report(self) -> dict:
        speed = self.last_window_speed
        if speed is None:
            speed = self.local_step / max(1e-9, time.monotonic() - self._started)
        return {
            "step": self.local_step,
            "steps_per_second": speed,
            "loss": self.last_loss,
            "tokens": self.tokens_total,
            "windows": self.windows,
        }

    def _heartbeat_answer(self, answer: dict) -> None:
        recommended = answer.get("recommended_sync_every")
        if isinstance(recommended, int) and recommended >= 1:
            if recommended != self.recommended_sync_every:
                log.info("the server recommends H = %d for this worker (DyLU)", recommended)
            self.recommended_sync_every = recommended

    def stats(self) -> dict:
        """Figures for `diloco worker --json` (leader's view)."""
        client = self.client.stats if self.client is not None else None
        streamer = self.streamer
        steady = None
        if self._steady_from is not None and self._steady_to is not None:
            span = self._steady_to[0] - self._steady_from[0]
            if span > 0:
                steady = (self._steady_to[1] - self._steady_from[1]) / span
        return {
            "worker_id": self.worker_id,
            "mode": self.settings.mode,
            "rounds": self.rounds if streamer is None else streamer.syncs,
            "round": self.round,
            "fragment_rounds": None if streamer is None else list(streamer.fragment_rounds),
            "fragment_failures": 0 if streamer is None else streamer.failures,
            "local_steps": self.local_step,
            "bytes_sent": client.bytes_sent if client else 0,
            "bytes_received": client.bytes_received if client else 0,
            "blocked_seconds": self.blocked_seconds,
            "client_seconds": client.blocked_seconds if client else 0.0,
            "largest_upload_bytes": client.largest_upload if client else 0,
            "retries": client.retries if client else 0,
            "rebases": self.rebases,
            "sync_every_now": self.window_sync_every,
            # blocked share of wall time from the end of the first window to close(), or None
            "steady_blocked_fraction": steady,
        }

    def close(self, final_sync: bool = True) -> None:
        """Sync a last partial round (unless told not to), stop beating, leave the run."""
        if self._closed:
            return
        self._closed = True
        self._steady_to = (time.monotonic(), self.blocked_seconds)
        try:
            if final_sync:
                self.sync()
        finally:
            self._hook.remove()
            if self._token_counter is not None:
                self._token_counter.remove()
            if self._heartbeat is not None:
                self._heartbeat.stop()
                self._heartbeat.client.close()
            if self.client is not None:
                try:
                    self.client.deregister(self.worker_id)
                except Exception as exc:  # leaving is best effort; eviction would follow
                    log.warning("deregister failed: %s", exc)
                self.client.close()

    def __enter__(self) -> DiLoCoWorker:
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        self.close(final_sync=exc_type is None)
