"""FastAPI adapter: HTTP in, coordinator calls, JSON or safetensors out. Nothing else.

Tensor bodies are read into one preallocated buffer (refused with 413 from Content-Length
before a byte is read), parsed without copies, and handed to the coordinator in a worker
thread. Every call that takes the coordinator's lock runs in a worker thread, so the event
loop keeps receiving uploads and heartbeats while a commit (outer step, checkpoint) holds it.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect

from diloco import __version__, faults
from diloco.server.coordinator import Coordinator
from diloco.server.errors import Rejection
from diloco.server.http.admin_routes import add_admin_routes
from diloco.server.http.dashboard import add_dashboard, session_caller
from diloco.server.http.request_json import json_body, json_body_schema
from diloco.server.http.shard_routes import add_shard_routes
from diloco.server.members.credentials import Caller, Credentials
from diloco.server.model.results import RoundResult
from diloco.wire import (
    MAX_COUNT,
    PROTOCOL_HEADER,
    DatasetRequest,
    EarlyHeader,
    FollowSpool,
    HeaderCheck,
    HeartbeatRequest,
    LeaseRequest,
    RegisterRequest,
    SpooledTensors,
    SpoolFiles,
    SpoolFollower,
    WireError,
    check_length,
    check_protocol_header,
    parse_content_length,
    parse_unit_reports,
    read_body,
    spool_body,
)
from diloco.wire.format.frames import decode_frame

TENSORS = "application/octet-stream"
log = logging.getLogger("diloco.server")


def _error_response(status: int, body: dict, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, content=body, headers=headers)


def _request_validation_message(exc: RequestValidationError) -> tuple[str, dict]:
    first = exc.errors()[0] if exc.errors() else {}
    loc = list(first.get("loc", ()))
    if loc and loc[0] in ("body", "query", "path", "header", "cookie"):
        loc = loc[1:]  # where FastAPI found it, not part of the field's name
    location = [str(part) for part in loc]
    field = ".".join(location) or "body"
    message = first.get("msg", "invalid request")
    if first.get("type") == "json_invalid":
        return f"the body is not valid JSON ({message})", {"field": "body", "type": "json_invalid"}
    return f"field {field!r}: {message}", {"field": field, "type": first.get("type")}


def caller_of(request: Request) -> Caller:
    """Who sent the request: 401 for a missing or wrong secret (identified once per request)."""
    caller = getattr(request.state, "caller", None)
    if caller is None:
        caller = session_caller(request)  # a signed-in dashboard (no Authorization header)
    if caller is None:
        credentials: Credentials = request.app.state.credentials
        caller = credentials.identify(request.headers.get("authorization"))
    request.state.caller = caller
    return caller


async def require_admin(request: Request) -> None:
    """Dependency of control routes (the dashboard's, later): 401 or 403 unless admin."""
    caller_of(request).require_admin()


def create_app(
    coordinator: Coordinator,
    credentials: Credentials | str | None = None,
    request_stop: Callable[[], None] | None = None,
) -> FastAPI:
    """The HTTP face of one coordinator, behind `credentials` on every route but /healthz.

    A plain string is an enrollment token (scopes: `server/members/credentials.py`); None is open.
    `request_stop` starts a graceful shutdown (`POST /v1/admin/stop`).
    """
    if not isinstance(credentials, Credentials):
        credentials = Credentials([credentials] if credentials else [])
    # The schema routes are added below behind the same token as everything else.
    app = FastAPI(
        title="diloco coordinator",
        version=__version__,
        openapi_url=None,
        docs_url=None,
        redoc_url=None,
    )
    metrics = coordinator.metrics
    app.state.credentials = credentials

    def reject(status: int, body: dict) -> JSONResponse:
        metrics.rejected.labels(kind=body["kind"]).inc()
        # A header of the answer rather than an HTTP middleware: Starlette's BaseHTTPMiddleware
        # wraps every receive() of a streamed body in a task group, which halved upload speed.
        headers = {"WWW-Authenticate": 'Bearer realm="diloco"'} if status == 401 else None
        return _error_response(status, body, headers)

    @app.exception_handler(Rejection)
    async def on_rejection(_request: Request, exc: Rejection) -> JSONResponse:
        return reject(exc.status, exc.to_body())

    @app.exception_handler(WireError)
    async def on_wire_error(_request: Request, exc: WireError) -> JSONResponse:
        return reject(exc.status, exc.to_body())

    @app.exception_handler(ClientDisconnect)
    async def on_disconnect(request: Request, _exc: ClientDisconnect) -> Response:
        # An ordinary event (a worker killed or cut off mid-upload): nothing was applied, and
        # nobody is left to read an answer.
        worker = request.path_params.get("worker_id") or request.query_params.get("worker_id")
        log.info(
            "client disconnected before its request was read: %s %s (worker %s)",
            request.method,
            request.url.path,
            worker or "unknown",
        )
        return Response(status_code=400)

    @app.exception_handler(Exception)
    async def on_unexpected(_request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error")
        return reject(
            500,
            {
                "error": f"internal error: {type(exc).__name__}",
                "kind": "internal_error",
                "detail": {},
            },
        )

    @app.exception_handler(RequestValidationError)
    async def on_invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        error, detail = _request_validation_message(exc)
        return reject(422, {"error": error, "kind": "invalid_request", "detail": detail})

    async def require_token(request: Request) -> None:
        caller_of(request)

    def act_as(request: Request, worker_id: str) -> None:
        """The caller may act as `worker_id` (its own credential, or admin); else 403, or the
        404 a request for an unregistered worker gets anyway (which tells a worker whose
        credential a fresh server refused to register again)."""
        caller = caller_of(request)
        if caller.may_act_as(worker_id):
            return
        if not coordinator.membership.is_live(worker_id):
            raise Rejection(
                404,
                "unknown_worker",
                f"worker {worker_id!r} is not registered (evicted or never registered); "
                "register again",
                worker_id=worker_id,
            )
        raise Rejection(
            403,
            "forbidden",
            f"this credential may not act as worker {worker_id!r} (its scope is {caller.scope})",
            worker_id=worker_id,
            scope=caller.scope,
        )

    async def require_protocol(request: Request) -> None:
        # Required on every request that changes state or carries data; a read may omit it.
        required = request.method not in ("GET", "HEAD")
        check_protocol_header(request.headers.get(PROTOCOL_HEADER), required)

    authed = [Depends(require_token), Depends(require_protocol)]  # in this order: 401 first

    settings = coordinator.settings
    in_memory = {"bodies": 0}  # tensor bodies held in RAM right now (one event loop: no lock)
    spool_files = SpoolFiles(settings.spool_dir)  # kept between uploads: no new file per body
    # Robust aggregation in sync and streaming mode holds each submission until its round
    # decides: on disk, never in RAM, whatever --memory-bodies says.
    # So do sharded servers, until shard 0 decides the round.
    held_by_rounds = (settings.robust.screens and settings.mode != "async") or settings.shards > 1

    @asynccontextmanager
    async def tensors_from(
        request: Request,
        may_spool: bool = True,
        check_header: HeaderCheck | None = None,
        follow: FollowSpool | None = None,
        max_header: int | None = None,
    ) -> AsyncIterator[tuple[dict | SpooledTensors, dict[str, str]]]:
        """The request's tensors and its header's `__metadata__` (a compressed body's codec):
        in RAM while few bodies are, else spooled to a file.

        The RAM slot is held until the handler is done with the tensors, so the number of
        bodies in memory never exceeds --memory-bodies, however many workers upload at once.
        `check_header` sees the safetensors header (entries and metadata) as soon as it has
        arrived, so a body it refuses is answered before the rest of it is read (the rest is
        then dropped unread). `follow`: a spooled body's follower (spool_body's). `max_header`:
        a longer header is 413 header_too_large, from its first 8 bytes (early_header.py).
        """
        length = parse_content_length(request.headers.get("content-length"))
        check_length(length, settings.max_body_bytes)
        if may_spool and (held_by_rounds or in_memory["bodies"] >= settings.memory_bodies):
            try:
                chunks = request.stream()
                if faults.ENABLED:
                    chunks = faults.watch_chunks(chunks)
                spooled = await spool_body(
                    chunks,
                    length,
                    settings.max_body_bytes,
                    files=spool_files,
                    check_header=check_header,
                    follow=follow,
                    max_header=max_header,
                )
            except OSError as exc:  # a full or missing spool disk heals; the worker retries
                raise Rejection(
                    503,
                    "spool_unavailable",
                    f"the server could not write the upload to disk ({exc.strerror or exc})",
                ) from None
            try:
                yield spooled, spooled.metadata
            finally:
                spooled.close()
            return
        in_memory["bodies"] += 1
        try:
            assert length is not None
            early = EarlyHeader(length, check_header, max_header)
            body = await read_body(request.stream(), length, settings.max_body_bytes, early)
            yield await run_in_threadpool(decode_frame, body)  # a large header takes seconds
        finally:
            in_memory["bodies"] -= 1

    def tensor_response(result: RoundResult, sent: Callable[[], None] | None = None) -> Response:
        """`sent`: called once the body is handed to the socket."""
        headers = {"X-Diloco-Round": str(result.round)}
        if result.fragment is not None:
            headers["X-Diloco-Fragment"] = str(result.fragment)
        if result.fragment_rounds is not None:
            headers["X-Diloco-Fragment-Rounds"] = ",".join(map(str, result.fragment_rounds))
        if result.delta_from is not None:  # a coded delta against that round's weights
            headers["X-Diloco-Delta-From"] = str(result.delta_from)
        content = result.body  # a view of the round's one buffer, never copied per worker
        if sent is None:
            return Response(content=content, media_type=TENSORS, headers=headers)
        return _SentReporting(content=content, media_type=TENSORS, headers=headers, sent=sent)

    @app.get("/openapi.json", dependencies=authed, include_in_schema=False)
    async def openapi() -> JSONResponse:
        return JSONResponse(app.openapi())

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"ok": True}

    @app.get("/v1/info", dependencies=authed)
    async def info() -> dict:
        return await run_in_threadpool(coordinator.info)

    @app.post("/v1/workers", dependencies=authed, openapi_extra=json_body_schema(RegisterRequest))
    async def register(request: Request) -> dict:
        message = await json_body(request, RegisterRequest)
        caller = caller_of(request)
        worker_id = credentials.registration_id(caller, message.worker_id)  # 403 if not its
        answer = await run_in_threadpool(
            coordinator.register,
            worker_id,
            message.specs(),
            message.protocol_version,
            message.session,
            message.waits_for_initial,
        )
        answer["credential"] = credentials.credential_for(caller, answer["worker_id"])
        return answer

    @app.delete("/v1/workers/{worker_id}", dependencies=authed)
    async def deregister(worker_id: str, request: Request) -> dict:
        act_as(request, worker_id)
        await run_in_threadpool(coordinator.deregister, worker_id)
        return {"worker_id": worker_id, "removed": True}

    @app.post(
        "/v1/workers/{worker_id}/heartbeat",
        dependencies=authed,
        openapi_extra=json_body_schema(HeartbeatRequest),
    )
    async def heartbeat(worker_id: str, request: Request) -> dict:
        act_as(request, worker_id)
        beat = await json_body(request, HeartbeatRequest)
        # On the event loop: it takes only the registry's short lock, so neither a commit
        # holding the coordinator nor a thread pool full of blocked uploads can delay it.
        return coordinator.heartbeat(
            worker_id,
            beat.step,
            beat.steps_per_second,
            beat.loss,
            beat.tokens,
            beat.windows,
        )

    @app.post("/v1/datasets", dependencies=authed, openapi_extra=json_body_schema(DatasetRequest))
    async def register_dataset(request: Request) -> dict:
        ask = await json_body(request, DatasetRequest)
        act_as(request, ask.worker_id)
        return await run_in_threadpool(
            coordinator.register_dataset,
            ask.worker_id,
            ask.dataset_id,
            ask.length,
            ask.shuffle_seed,
            ask.unit_size,
        )

    @app.get("/v1/datasets", dependencies=authed)
    async def datasets() -> dict:
        return {"datasets": await run_in_threadpool(coordinator.data_progress)}

    @app.post(
        "/v1/datasets/{dataset_id}/leases",
        dependencies=authed,
        openapi_extra=json_body_schema(LeaseRequest),
    )
    async def lease(dataset_id: str, request: Request) -> dict:
        ask = await json_body(request, LeaseRequest)
        act_as(request, ask.worker_id)
        return await run_in_threadpool(
            coordinator.lease_units,
            ask.worker_id,
            dataset_id,
            ask.count,
            ask.next_epoch,
            ask.lease_key,
        )

    @app.get("/v1/datasets/{dataset_id}/leases", dependencies=authed)
    async def leases(request: Request, dataset_id: str, worker_id: str = Query(...)) -> dict:
        act_as(request, worker_id)
        return await run_in_threadpool(coordinator.leases_of, worker_id, dataset_id)

    @app.put("/v1/weights/initial", dependencies=authed)
    async def upload_initial(request: Request, worker_id: str = Query(...)) -> dict:
        act_as(request, worker_id)
        limit = coordinator.max_header_bytes(None)
        async with tensors_from(request, may_spool=False, max_header=limit) as (tensors, _):
            round_number = await run_in_threadpool(coordinator.upload_initial, worker_id, tensors)
        return {"status": "stored", "round": round_number}

    @app.get("/v1/weights", dependencies=authed)
    async def weights(
        version: int | None = Query(
            None,
            ge=0,
            le=MAX_COUNT,
            description="Sharded servers in async mode: exactly this version's weights (409 "
            "future_round before this shard reaches it, version_gone once it keeps it no more).",
        ),
    ) -> Response:
        return tensor_response(await run_in_threadpool(coordinator.weights, version))

    @app.post("/v1/rounds/{round_number}/submissions", dependencies=authed)
    async def submit(
        request: Request,
        round_number: int,
        worker_id: str = Query(...),
        fragment: int = Query(0, ge=0, le=MAX_COUNT),
        tokens: int = Query(0, ge=0, le=MAX_COUNT),
        units: str = Query(
            "",
            description="Comma-separated work units finished (ID), or trained in part "
            "(ID:COUNT, its samples trained so far).",
        ),
    ) -> dict:
        act_as(request, worker_id)  # before the body is read, like the checks below
        # before the body is read: a bad list costs nothing
        unit_ids, progress = parse_unit_reports(units)

        def check_header(shapes, metadata) -> None:
            coordinator.check_header(fragment, shapes, metadata)

        def follow(source: int, nbytes: int, size: int) -> SpoolFollower | None:
            return coordinator.follow_upload(fragment, source, nbytes, size)

        # (a server that copies no uploads is not asked: no thread hop per upload)
        following = follow if coordinator.copies_uploads else None
        async with tensors_from(
            request,
            check_header=check_header,
            follow=following,
            max_header=coordinator.max_header_bytes(fragment),
        ) as (tensors, metadata):
            return await run_in_threadpool(
                lambda: coordinator.submit(
                    worker_id,
                    round_number,
                    tensors,
                    fragment=fragment,
                    tokens=tokens,
                    units=unit_ids,
                    progress=progress,
                    metadata=metadata,
                )
            )

    @app.get("/v1/rounds/{round_number}/result", dependencies=authed)
    async def result(
        request: Request,
        round_number: int,
        worker_id: str | None = Query(None),
        wait: float = Query(30.0, ge=0.0, le=120.0),
        fragment: int = Query(0, ge=0, le=MAX_COUNT),
        have: int | None = Query(
            None,
            ge=0,
            le=MAX_COUNT,
            description="The round of the caller's anchor: with --download-codec, a caller at "
            "the round the step started from gets the step's coded delta.",
        ),
        version: int | None = Query(
            None,
            ge=0,
            le=MAX_COUNT,
            description="Sharded servers in async mode: answer with exactly this version's "
            "weights (the one shard 0 answered with), waiting until this shard reaches it.",
        ),
    ) -> Response:
        if worker_id is not None:
            act_as(request, worker_id)
        outcome = await run_in_threadpool(
            coordinator.wait_result, round_number, worker_id, wait, fragment, have, version
        )
        if isinstance(outcome, RoundResult):
            if worker_id is None:
                return tensor_response(outcome)
            # a background checkpoint waits for the step's workers to have their result
            downloads, sent = coordinator.result_downloads, (worker_id, outcome.round)
            return tensor_response(outcome, sent=lambda: downloads.sent(*sent))
        return JSONResponse(
            status_code=202,
            content={
                "status": "waiting",
                "round": outcome.round,
                "waiting_for": outcome.waiting_for,
                "more_submissions_needed": outcome.more_submissions_needed,
            },
        )

    @app.get("/v1/status", dependencies=authed)
    async def status() -> dict:
        return await run_in_threadpool(coordinator.status)

    if coordinator.shard is not None:
        add_shard_routes(app, coordinator.shard, authed, act_as, caller_of)

    admin_only = [*authed, Depends(require_admin)]
    add_admin_routes(app, coordinator.admin, credentials, admin_only, caller_of, request_stop)

    def dashboard_data(after: int) -> dict:
        return {
            "status": coordinator.status(),
            "settings": coordinator.settings.to_wire(),
            "history": coordinator.admin.history(after),
        }

    add_dashboard(app, credentials, dashboard_data, caller_of, admin_only)

    @app.get("/metrics", dependencies=authed)
    async def prometheus() -> Response:
        return Response(content=metrics.render(), media_type="text/plain; version=0.0.4")

    return app


class _SentReporting(Response):
    """A tensor response that calls `sent` once the socket has taken its body (all but the
    transport's low-water mark), or the client went away meanwhile (uvicorn's send then
    returns as if it had gone: a checkpoint that waits for it starts a little early).
    uvicorn writes a body into the transport's buffer at once and waits for that buffer to
    drain only before the next write: an empty last chunk after the body is that wait."""

    def __init__(self, *args: Any, sent: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._sent = sent

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        start = {"type": "http.response.start", "status": self.status_code}
        await send({**start, "headers": self.raw_headers})
        await send({"type": "http.response.body", "body": self.body, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        self._sent()
