"""DiLoCoWorker: turns any torch optimizer loop into a DiLoCo worker.

A post-step hook counts optimizer steps (so gradient accumulation is handled: H counts steps,
not batches); every H steps the worker sends anchor - local in the server's upload dtype, waits
for the round's result and loads it as both the model and the new anchor. The anchor lives on
the CPU in fp32. A network failure retries the same submission under the same (worker, round)
key, and an eviction re-registers under the same id: local progress is never thrown away.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from collections.abc import Mapping
from typing import Any, Protocol

import torch
from torch import nn

from diloco.algorithm import classify_tensors, pseudo_gradient
from diloco.wire import decode_tensors, encode_tensors, specs_of
from diloco.wire.validation import MAX_UNITS_PER_SUBMISSION
from diloco.worker import distributed
from diloco.worker.checkpoint import (
    WorkerCheckpoint,
    load_worker_checkpoint,
    restore_worker_checkpoint,
    save_worker_checkpoint,
)
from diloco.worker.client import DiLoCoClient
from diloco.worker.errors import ServerError
from diloco.worker.heartbeat import Heartbeat
from diloco.worker.retry import RetryPolicy
from diloco.worker.settings import WorkerSettings

log = logging.getLogger("diloco.worker")


class ReportsUnits(Protocol):
    """A data source of server-leased work units (diloco.worker.data.LeasedSampler)."""

    def finished_units(self) -> list[int]: ...

    def reported(self, units: list[int]) -> None: ...

    def forget(self, units: list[int]) -> None: ...


def _log_retry(operation: str, cause: BaseException | int, delay: float) -> None:
    """A worker that waits on the server says why, so a stuck barrier is never silent."""
    reason = getattr(cause, "error", None) or cause
    log.warning("%s: %s; retrying in %.1f s", operation, reason, delay)


def _unwrap(model: nn.Module) -> nn.Module:
    """DDP / FSDP-style wrappers keep the real module in `.module`; its names are canonical."""
    return model.module if isinstance(getattr(model, "module", None), nn.Module) else model


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
    ) -> None:
        """`checkpoint_dir`: after every round the worker saves its inner optimizer (and
        `scheduler`) state, RNG state, step, round, session and data position there, and a
        worker started on the same directory resumes from it under the same id (see
        diloco.worker.checkpoint); a saved state that does not fit is ignored with a warning.
        """
        self.model = _unwrap(model)
        self.optimizer = optimizer
        self.server_url = server_url
        self.worker_id = worker_id
        self.result_wait = result_wait
        self.is_leader = distributed.rank() == 0
        self.kinds = classify_tensors(self.model)
        self.specs = specs_of(self.model.state_dict(), self.kinds)
        self.client = (
            DiLoCoClient(server_url, token, retry=retry or RetryPolicy(), on_retry=_log_retry)
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
        self._closed = False
        self.rebases = 0
        self.data = data  # a LeasedSampler (diloco.worker.data) whose units we report
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
        self.worker_id = distributed.lead(self._join, self._share_join)
        if self.resumed is not None and self.round > self.resumed.anchor_round:
            # Rounds committed while we were down already hold our work (the barrier waited
            # for us) or went on without us (we were evicted): either way we start at the
            # server's round, and our step count and data position follow it.
            ahead = (self.round - self.resumed.anchor_round) * self.settings.sync_every
            self.local_step += ahead
            log.warning(
                "the server is %d round(s) past our checkpoint: skipping %d steps",
                self.round - self.resumed.anchor_round,
                ahead,
            )
        self._hook = optimizer.register_step_post_hook(self._after_step)
        self._heartbeat: Heartbeat | None = None
        if self.is_leader and heartbeat:
            beat_client = DiLoCoClient(server_url, token, retry=RetryPolicy(attempts=1))
            self._heartbeat = Heartbeat(
                beat_client,
                lambda: self.worker_id or "",
                self.settings.heartbeat_interval,
                self._heartbeat_report,
                self._reregister,
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

    def _join(self) -> str:
        """Register; the first worker uploads its weights; everyone starts from the server's."""
        assert self.client is not None
        with self._register_lock:
            reply = self._register()
        if reply["needs_initial_weights"]:
            try:
                self.client.upload_initial(self.worker_id, encode_tensors(self.model.state_dict()))
            except ServerError as exc:
                # Another worker won, or ours landed and the answer was lost (a restart):
                # either way the server's copy is what every worker starts from.
                if exc.kind != "weights_exist":
                    raise
        body, round_number = self.client.get_weights()
        self._adopt(decode_tensors(body), round_number)
        log.info("worker %s joined at round %d", self.worker_id, round_number)
        return self.worker_id

    def _share_join(self, worker_id: str | None) -> str:
        distributed.broadcast_tensors_(self.model.state_dict())
        self.round = distributed.broadcast_json(self.round)
        return distributed.broadcast_json(worker_id)

    # ----------------------------------------------------------------- the round

    def _after_step(self, *_args: object, **_kwargs: object) -> None:
        self.local_step += 1
        self.steps_in_round += 1
        if self.steps_in_round >= self.settings.sync_every:
            self.sync()

    def report(self, loss: float | None = None, tokens: int = 0) -> None:
        """Tell the worker the latest training loss and tokens (for heartbeats and weighting)."""
        if loss is not None:
            self.last_loss = float(loss)
        self.tokens_in_round += tokens
        self.tokens_total += tokens

    def sync(self) -> None:
        """Send this round's pseudo-gradient, wait for the result, load it everywhere."""
        if self.steps_in_round == 0:
            return
        distributed.lead(self._exchange, self._share_result)
        self.rounds += 1
        self.steps_in_round = 0
        self.tokens_in_round = 0
        self.save_checkpoint()

    def _exchange(self) -> tuple[dict[str, torch.Tensor], int]:
        assert self.client is not None
        gradient = pseudo_gradient(self.anchor, self.model.state_dict())
        body = encode_tensors(gradient, float_dtype=self.settings.upload_dtype)
        del gradient
        units = self.units_to_report()
        try:
            self._submit(body, units)
            result = self._await_result(body, units)
        except ServerError as exc:
            if exc.kind != "future_round":
                raise
            return self._rebase(exc)
        self.units_reported(units)
        return result

    def units_to_report(self) -> list[int]:
        """Work units finished since the last submission (a server-dispatched data source).

        At most what one submission may carry; the rest stay finished and go with the next.
        """
        if self.data is None:
            return []
        return self.data.finished_units()[:MAX_UNITS_PER_SUBMISSION]

    def units_reported(self, units: list[int]) -> None:
        if self.data is not None:
            self.data.reported(units)

    def _submit(self, body: bytearray, units: list[int]) -> None:
        assert self.client is not None
        while True:
            try:
                self.client.submit(
                    self.round, self.worker_id, body, tokens=self.tokens_in_round, units=units
                )
                return
            except ServerError as exc:
                detail = exc.detail if isinstance(exc.detail, dict) else {}
                lost_unit = detail.get("unit_id")
                if exc.kind in ("unit_not_leased", "unknown_unit") and lost_unit in units:
                    # We were evicted and our leases went to others: not ours to report.
                    log.warning(
                        "work unit %s is no longer leased to us; not reporting it", lost_unit
                    )
                    units.remove(lost_unit)
                    if self.data is not None:
                        self.data.forget([lost_unit])
                    continue
                if exc.kind != "unknown_worker":
                    raise
                self._reregister()

    def _await_result(
        self, body: bytearray, units: list[int]
    ) -> tuple[dict[str, torch.Tensor], int]:
        assert self.client is not None
        while True:
            try:
                got = self.client.wait_result(self.round, self.worker_id, wait=self.result_wait)
            except ServerError as exc:
                if exc.kind == "unknown_worker":
                    self._reregister()  # our submission stays in the round
                    continue
                if exc.kind == "not_submitted":  # the server restarted without it: send again
                    log.warning("round %d lost our submission; sending it again", self.round)
                    self._submit(body, units)
                    continue
                if exc.kind == "result_expired":
                    body, round_number = self.client.get_weights()
                    return decode_tensors(body), round_number
                raise
            if got is not None:
                body, round_number = got
                return decode_tensors(body), round_number

    def _rebase(self, exc: ServerError) -> tuple[dict[str, torch.Tensor], int]:
        """The server is behind us: it restarted from an older checkpoint (durability interval).

        The pending pseudo-gradient is relative to an anchor the server no longer has, so it is
        dropped; the worker adopts the server's weights and round and trains on from there
        (its inner optimizer state, step count and schedule carry on).
        """
        assert self.client is not None
        body, round_number = self.client.get_weights()
        log.warning(
            "the server is at round %d, behind our round %d (it restarted from an older "
            "checkpoint): adopting its weights, dropping this round's pseudo-gradient",
            round_number,
            self.round,
        )
        self.rebases += 1
        return decode_tensors(body), round_number

    def _share_result(self, result: tuple[dict[str, torch.Tensor], int] | None) -> None:
        if result is not None:
            self._adopt(*result)
        distributed.broadcast_tensors_(self.model.state_dict())
        self.round = distributed.broadcast_json(self.round)

    def _adopt(self, tensors: Mapping[str, torch.Tensor], round_number: int) -> None:
        """New global weights become the model and (on the leader) the fp32 CPU anchor."""
        state = self.model.state_dict()
        with torch.no_grad():
            for name, target in state.items():
                target.copy_(tensors[name])
        self.anchor = {
            name: t.detach().to(device="cpu", dtype=torch.float32, copy=True)
            if t.is_floating_point()
            else t.detach().to("cpu", copy=True)
            for name, t in tensors.items()
        }
        self.round = round_number

    # ----------------------------------------------------------------- reporting and exit

    def _heartbeat_report(self) -> dict:
        elapsed = max(1e-9, time.monotonic() - self._started)
        return {
            "step": self.local_step,
            "steps_per_second": self.local_step / elapsed,
            "loss": self.last_loss,
            "tokens": self.tokens_total,
        }

    def stats(self) -> dict:
        """Figures for `diloco worker --json` (leader's view)."""
        client = self.client.stats if self.client is not None else None
        return {
            "worker_id": self.worker_id,
            "rounds": self.rounds,
            "round": self.round,
            "local_steps": self.local_step,
            "bytes_sent": client.bytes_sent if client else 0,
            "bytes_received": client.bytes_received if client else 0,
            "blocked_seconds": client.blocked_seconds if client else 0.0,
            "retries": client.retries if client else 0,
            "rebases": self.rebases,
        }

    def close(self, final_sync: bool = True) -> None:
        """Sync a last partial round (unless told not to), stop beating, leave the run."""
        if self._closed:
            return
        self._closed = True
        try:
            if final_sync:
                self.sync()
        finally:
            self._hook.remove()
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
