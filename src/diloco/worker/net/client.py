"""The worker's client for the coordinator's wire protocol (docs/protocol.md, version 1).

One method per route, on top of `Transport` (transport.py), which sends, retries and counts.
It speaks bytes for tensor bodies (the caller encodes and decodes safetensors) and plain dicts
for JSON, so it knows nothing of torch or of the wire schemas. Here live what the routes
mean: their paths and queries, the JSON of requests, and the parsing of answers (round
headers, "waiting" long-polls, a 409 that means another worker won).
"""

from __future__ import annotations

import json
import math
import os
import random
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any
from urllib.parse import quote

from diloco.wire.validation import PROTOCOL_VERSION
from diloco.worker.errors import ServerError
from diloco.worker.net.auth import BearerAuth
from diloco.worker.net.retry import RetryPolicy
from diloco.worker.net.transport import (
    Body,
    ClientStats,
    OnRecovered,
    OnRetry,
    Reply,
    Transport,
    server_error,
    success,
)

__all__ = ["ClientStats", "DiLoCoClient", "Weights"]

_MAX_STEPS_PER_SECOND = 1e6  # the server's bound on a heartbeat's speed (422 above it)
MAX_RESULT_WAIT = 120.0  # the server's cap on `wait` for a result long-poll


def _json_dict(reply: Reply) -> dict[str, Any]:
    """The JSON object of a success answer; an empty body reads as {}."""
    if not reply.body:
        return {}
    try:
        payload = json.loads(reply.body)
    except ValueError:
        payload = None
    if not isinstance(payload, dict):
        raise ServerError(
            reply.status, "invalid_response", "the answer is not a JSON object", url=reply.url
        )
    return payload


def _round_header(reply: Reply) -> int:
    value = reply.headers.get("X-Diloco-Round")
    try:
        return int(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ServerError(
            reply.status,
            "invalid_response",
            f"tensor answer without a valid X-Diloco-Round header (got {value!r})",
            url=reply.url,
        ) from None


@dataclass(frozen=True)
class Weights:
    """Global weights as the server sent them, with the rounds its headers state."""

    body: bytearray
    round: int  # what they start: the round (sync), the version (async, streaming)
    fragment_rounds: list[int] | None = None  # streaming: each fragment's round
    delta_from: int | None = None  # the body is a coded delta against this round's weights


def _weights(reply: Reply) -> Weights:
    rounds = reply.headers.get("X-Diloco-Fragment-Rounds")
    fragment_rounds = None
    if rounds:
        try:
            fragment_rounds = [int(r) for r in rounds.split(",")]
        except ValueError:
            raise ServerError(
                reply.status,
                "invalid_response",
                f"X-Diloco-Fragment-Rounds is not a list of integers (got {rounds!r})",
                url=reply.url,
            ) from None
    delta = reply.headers.get("X-Diloco-Delta-From")
    try:
        delta_from = None if delta is None else int(delta)
    except ValueError:
        raise ServerError(
            reply.status,
            "invalid_response",
            f"X-Diloco-Delta-From is not an integer (got {delta!r})",
            url=reply.url,
        ) from None
    return Weights(reply.body, _round_header(reply), fragment_rounds, delta_from)


class DiLoCoClient:
    """Calls of the coordinator's routes, with retries, timeouts, auth and byte counters.

    Safe to share between threads (the training loop and the heartbeat). `close()`, from any
    thread, also wakes a call that is sleeping between retries; it then raises ClientClosed.
    `sleep`, `clock` and `rng` are for tests.
    """

    def __init__(
        self,
        base_url: str,
        token: str | None = None,
        *,
        connect_timeout: float = 10.0,
        read_timeout: float = 300.0,
        retry: RetryPolicy = RetryPolicy(),  # noqa: B008 -- frozen, so sharing it is safe
        on_retry: OnRetry | None = None,
        sleep: Callable[[float], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
        max_upload_mbps: float | None = None,
        auth: BearerAuth | None = None,
        ca_file: str | os.PathLike[str] | None = None,
        on_recovered: OnRecovered | None = None,
    ) -> None:
        """`max_upload_mbps` paces tensor uploads to that many megabits per second; `token`,
        `auth`, `ca_file`, `on_retry` and `on_recovered` as `Transport` takes them
        (enrollment, credentials, TLS, retries and recoveries)."""
        self._transport = Transport(
            base_url,
            token,
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            retry=retry,
            on_retry=on_retry,
            sleep=sleep,
            clock=clock,
            rng=rng,
            max_upload_mbps=max_upload_mbps,
            auth=auth,
            ca_file=ca_file,
            on_recovered=on_recovered,
        )
        self.auth = self._transport.auth
        self.base_url = self._transport.base_url
        self.max_upload_mbps = max_upload_mbps
        # The last "waiting" answer of a result long-poll: who the round waits for
        # (`waiting_for`, `more_submissions_needed`), for a caller that reports a long wait.
        self.last_waiting: dict[str, Any] = {}

    @property
    def credential(self) -> str | None:
        """This worker's own credential, from its registration (or a checkpoint)."""
        return self.auth.credential

    @credential.setter
    def credential(self, value: str | None) -> None:
        self.auth.credential = value

    @property
    def retry(self) -> RetryPolicy:
        """The policy every later call retries under."""
        return self._transport.retry

    @retry.setter
    def retry(self, policy: RetryPolicy) -> None:
        self._transport.retry = policy

    # -- counters -----------------------------------------------------------------------------

    @property
    def stats(self) -> ClientStats:
        """A consistent snapshot of every counter at once."""
        return self._transport.stats

    @property
    def bytes_sent(self) -> int:
        return self.stats.bytes_sent

    @property
    def bytes_received(self) -> int:
        return self.stats.bytes_received

    @property
    def blocked_seconds(self) -> float:
        return self.stats.blocked_seconds

    @property
    def retries(self) -> int:
        return self.stats.retries

    # -- routes -------------------------------------------------------------------------------

    def healthz(self) -> dict[str, Any]:
        return self._json_call("healthz", "GET", "/healthz")

    def info(self) -> dict[str, Any]:
        return self._json_call("info", "GET", "/v1/info")

    def register(
        self,
        worker_id: str | None,
        tensors: list[dict[str, Any]],
        protocol_version: int = PROTOCOL_VERSION,
        *,
        session: str | None = None,
        waits_for_initial: bool = False,
    ) -> dict[str, Any]:
        """Register; with a `session`, a retry whose first answer was lost is answered again.
        `waits_for_initial`: while no weights exist, upload them only if the server says so
        (else wait for the worker it names) instead of every early worker offering its own."""
        payload: dict[str, Any] = {
            "protocol_version": protocol_version,
            "worker_id": worker_id,
            "tensors": tensors,
        }
        if session is not None:
            payload["session"] = session
        if waits_for_initial:
            payload["waits_for_initial"] = True
        answer = self._json_call("register", "POST", "/v1/workers", payload=payload)
        if answer.get("credential"):  # none from an open server
            self.auth.credential = answer["credential"]
        return answer

    def upload_initial(self, worker_id: str, body: Body) -> dict[str, Any]:
        """Offer the first global weights; {"status": "exists"} when another worker won."""
        reply = self._call(
            "upload_initial",
            "PUT",
            "/v1/weights/initial",
            query={"worker_id": worker_id},
            body=body,
            content_type="application/octet-stream",
        )
        if reply.status == 409:
            error = server_error(reply)
            if error.kind == "weights_exist":
                detail = error.detail if isinstance(error.detail, dict) else {}
                return {"status": "exists", "initial_from": detail.get("initial_from")}
            raise error
        return _json_dict(success(reply))

    def get_weights(self, into: bytearray | None = None) -> tuple[bytearray, int]:
        """The current global weights (safetensors bytes) and the round they start.

        With `into`, a buffer of the right size is overwritten with the weights and returned
        (see `wait_result`).
        """
        weights = self.get_weights_detail(into=into)
        return weights.body, weights.round

    def get_weights_detail(
        self, into: bytearray | None = None, *, version: int | None = None
    ) -> Weights:
        """The current global weights with every round header (streaming: per fragment);
        `version`: exactly that version's (sharded servers in async mode)."""
        query = None if version is None else {"version": str(int(version))}
        reply = success(self._call("get_weights", "GET", "/v1/weights", query=query, into=into))
        return _weights(reply)

    def submit(
        self,
        round: int,
        worker_id: str,
        body: Body,
        *,
        fragment: int = 0,
        tokens: int = 0,
        units: Sequence[int] = (),
        progress: Mapping[int, int] | None = None,
    ) -> dict[str, Any]:
        """Send one pseudo-gradient; a retry of the same (worker, round, fragment) counts once.

        `units`: ids of the work units finished since the last submission; they complete when
        this round commits. `progress`: units trained in part, unit -> samples of it trained
        so far; the round records that prefix, and the rest is all that is ever leased again.
        """
        query: dict[str, Any] = {"worker_id": worker_id, "fragment": fragment, "tokens": tokens}
        reports = [str(int(u)) for u in units]
        reports += [f"{int(u)}:{int(n)}" for u, n in (progress or {}).items()]
        if reports:
            query["units"] = ",".join(reports)
        reply = self._call(
            "submit",
            "POST",
            f"/v1/rounds/{int(round)}/submissions",
            query=query,
            body=body,
            content_type="application/octet-stream",
        )
        answer = _json_dict(success(reply))
        self._transport.count_upload(memoryview(body).nbytes)
        return answer

    def confirm(self, round: int, worker_id: str) -> dict[str, Any]:
        """Sharded servers: tell shard 0 that every shard holds our slice of `round`."""
        return self._json_call(
            "confirm", "POST", f"/v1/rounds/{int(round)}/confirm", query={"worker_id": worker_id}
        )

    def wait_result(
        self,
        round: int,
        worker_id: str,
        wait: float = 30.0,
        *,
        fragment: int = 0,
        into: bytearray | None = None,
        have: int | None = None,
        version: int | None = None,
    ) -> Weights | None:
        """Long-poll round `round`'s result (the weights and the round they start), or None
        while it is open. `have`: the round of our anchor, so that a server with a download
        codec may answer with a coded delta against it (`delta_from` then says so).
        `version`: only exactly that version's weights (sharded servers in async mode).

        In streaming mode `fragment` names the fragment whose round this is, and the weights
        are that fragment's tensors; in async mode `round` is the version the arrival was for.
        With `into` (the buffer the last weights came in, once they have been loaded), weights
        of the same size are read into it and it is returned; its old content is then gone,
        even when the call fails part way. Otherwise a new buffer is allocated.
        """
        if not (math.isfinite(wait) and 0 <= wait <= MAX_RESULT_WAIT):
            raise ValueError(f"wait must be in [0, {MAX_RESULT_WAIT:g}] seconds, got {wait!r}")
        query = {"worker_id": worker_id, "wait": f"{wait:g}"}
        if fragment:
            query["fragment"] = str(int(fragment))
        if have is not None:
            query["have"] = str(int(have))
        if version is not None:
            query["version"] = str(int(version))
        reply = self._call(
            "wait_result",
            "GET",
            f"/v1/rounds/{int(round)}/result",
            query=query,
            # The server holds the answer for `wait`, and may then still be committing the
            # round (a durable checkpoint), so the usual read timeout comes on top.
            read_timeout=wait + self._transport.read_timeout,
            into=into,
        )
        if reply.status == 202:
            try:
                waiting = json.loads(reply.body)
            except ValueError:
                waiting = None
            self.last_waiting = waiting if isinstance(waiting, dict) else {}
            return None
        return _weights(success(reply))

    def register_dataset(
        self, worker_id: str, dataset_id: str, length: int, shuffle_seed: int, unit_size: int
    ) -> dict[str, Any]:
        """State the dataset this worker trains (idempotent for the same shape)."""
        return self._json_call(
            "register_dataset",
            "POST",
            "/v1/datasets",
            payload={
                "worker_id": worker_id,
                "dataset_id": dataset_id,
                "length": length,
                "shuffle_seed": shuffle_seed,
                "unit_size": unit_size,
            },
        )

    def lease(
        self, worker_id: str, dataset_id: str, count: int = 1, next_epoch: bool = False
    ) -> dict[str, Any]:
        """Lease work units: `status` "leased" with `units`, or "exhausted" for this epoch.

        Every retry of this call carries one random key, so a lost answer is replayed rather
        than leasing other units.
        """
        return self._json_call(
            "lease",
            "POST",
            f"/v1/datasets/{quote(dataset_id, safe='')}/leases",
            payload={
                "worker_id": worker_id,
                "count": count,
                "next_epoch": next_epoch,
                "lease_key": secrets.token_hex(12),
            },
        )

    def leases(self, worker_id: str, dataset_id: str) -> dict[str, Any]:
        """The units of `dataset_id` leased to `worker_id` now, each with the samples still to
        train (after a resume, the truth about what the rounds since the checkpoint trained)."""
        return self._json_call(
            "leases",
            "GET",
            f"/v1/datasets/{quote(dataset_id, safe='')}/leases",
            query={"worker_id": worker_id},
        )

    def heartbeat(
        self,
        worker_id: str,
        step: int,
        steps_per_second: float,
        loss: float | None,
        tokens: int,
        windows: int | None = None,
    ) -> dict[str, Any]:
        """A sign of life; `windows` (sync windows finished) makes `steps_per_second` that
        window's compute speed, which the server's DyLU smooths into a recommended H."""
        # JSON has no NaN: a diverged loss is reported as unknown rather than failing the beat.
        if loss is not None and not math.isfinite(loss):
            loss = None
        if not math.isfinite(steps_per_second) or steps_per_second < 0:
            steps_per_second = 0.0
        steps_per_second = min(steps_per_second, _MAX_STEPS_PER_SECOND)
        payload: dict[str, Any] = {
            "step": step,
            "steps_per_second": steps_per_second,
            "loss": loss,
            "tokens": tokens,
        }
        if windows is not None:
            payload["windows"] = windows
        path = f"/v1/workers/{quote(worker_id, safe='')}/heartbeat"
        return self._json_call("heartbeat", "POST", path, payload=payload)

    def deregister(self, worker_id: str) -> dict[str, Any]:
        return self._json_call("deregister", "DELETE", f"/v1/workers/{quote(worker_id, safe='')}")

    def status(self) -> dict[str, Any]:
        return self._json_call("status", "GET", "/v1/status")

    # -- lifecycle ----------------------------------------------------------------------------

    def close(self) -> None:
        """Close the connections; a call sleeping between retries wakes and raises."""
        self._transport.close()

    @property
    def closed(self) -> bool:
        return self._transport.closed

    def __enter__(self) -> DiLoCoClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    # -- requests -----------------------------------------------------------------------------

    def _call(self, operation: str, method: str, path: str, **options: Any) -> Reply:
        """One request through the transport (retried until retrying cannot change it)."""
        return self._transport.call(operation, method, path, **options)

    def _json_call(
        self,
        operation: str,
        method: str,
        path: str,
        *,
        payload: Any = None,
        query: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        body = None
        if payload is not None:
            body = json.dumps(payload, allow_nan=False, separators=(",", ":")).encode()
        content_type = "application/json" if body is not None else None
        reply = self._call(
            operation, method, path, query=query, body=body, content_type=content_type
        )
        return _json_dict(success(reply))
