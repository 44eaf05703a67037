"""DiLoCoWorker: turns any torch optimizer loop into a DiLoCo worker.

A post-step hook counts optimizer steps (so gradient accumulation is handled: H counts steps,
not batches); every H steps the worker sends anchor - local in the server's upload dtype, waits
for the round's result and loads it as both the model and the new anchor. The anchor lives on
the CPU in fp32. A network failure retries the same submission under the same (worker, round)
key, and an eviction re-registers under the same id: local progress is never thrown away.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Mapping

import torch
from torch import nn

from diloco.algorithm import classify_tensors, pseudo_gradient
from diloco.wire import decode_tensors, encode_tensors, specs_of
from diloco.worker import distributed
from diloco.worker.client import DiLoCoClient
from diloco.worker.errors import ServerError
from diloco.worker.heartbeat import Heartbeat
from diloco.worker.retry import RetryPolicy
from diloco.worker.settings import WorkerSettings

log = logging.getLogger("diloco.worker")


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
    ) -> None:
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

        info = distributed.lead(self._fetch_info, distributed.broadcast_json)
        self.settings = WorkerSettings.from_info(info, server_url)
        self.settings.check_supported()
        self.worker_id = distributed.lead(self._join, self._share_join)
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
            self.client.upload_initial(self.worker_id, encode_tensors(self.model.state_dict()))
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

    def _exchange(self) -> tuple[dict[str, torch.Tensor], int]:
        assert self.client is not None
        gradient = pseudo_gradient(self.anchor, self.model.state_dict())
        body = encode_tensors(gradient, float_dtype=self.settings.upload_dtype)
        del gradient
        while True:
            try:
                self.client.submit(self.round, self.worker_id, body, tokens=self.tokens_in_round)
                break
            except ServerError as exc:
                if exc.kind != "unknown_worker":
                    raise
                self._reregister()
        return self._await_result()

    def _await_result(self) -> tuple[dict[str, torch.Tensor], int]:
        assert self.client is not None
        while True:
            try:
                got = self.client.wait_result(self.round, self.worker_id, wait=self.result_wait)
            except ServerError as exc:
                if exc.kind == "unknown_worker":
                    self._reregister()  # our submission stays in the round
                    continue
                if exc.kind == "result_expired":
                    body, round_number = self.client.get_weights()
                    return decode_tensors(body), round_number
                raise
            if got is not None:
                body, round_number = got
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
