"""The admin routes under /v1/admin: HTTP in, `AdminActions` calls, JSON or safetensors out.

Every route needs the admin scope (401 without a token, 403 with any other scope) and the
protocol header on writes, like the rest of the API. docs/protocol.md lists them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from fastapi import FastAPI, Query, Request
from fastapi.params import Depends
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from diloco.server.http.request_json import json_body, json_body_schema
from diloco.server.members.credentials import Caller, Credentials
from diloco.server.ops.admin import MAX_AUDIT_ROWS, AdminActions
from diloco.wire import MAX_COUNT, EvictRequest, OuterLrRequest

TENSORS = "application/octet-stream"


def add_admin_routes(
    app: FastAPI,
    admin: AdminActions,
    credentials: Credentials,
    dependencies: Sequence[Depends],
    caller_of: Callable[[Request], Caller],
    request_stop: Callable[[], None] | None,
) -> None:
    """`dependencies` authenticate and require the admin scope; `request_stop` starts the
    server's graceful shutdown (None: the route answers 501, e.g. an app in a test)."""
    guarded: Any = list(dependencies)

    def by(request: Request) -> str:
        return caller_of(request).scope

    @app.post("/v1/admin/pause", dependencies=guarded)
    async def pause(request: Request) -> dict:
        return await run_in_threadpool(admin.pause, by(request))

    @app.post("/v1/admin/resume", dependencies=guarded)
    async def resume(request: Request) -> dict:
        return await run_in_threadpool(admin.resume, by(request))

    @app.put(
        "/v1/admin/outer-lr", dependencies=guarded, openapi_extra=json_body_schema(OuterLrRequest)
    )
    async def outer_lr(request: Request) -> dict:
        ask = await json_body(request, OuterLrRequest)
        return await run_in_threadpool(admin.set_outer_lr, ask.outer_lr, by(request))

    @app.post(
        "/v1/admin/workers/{worker_id}/evict",
        dependencies=guarded,
        openapi_extra=json_body_schema(EvictRequest),
    )
    async def evict(worker_id: str, request: Request) -> dict:
        ask = await json_body(request, EvictRequest, optional=True)
        answer = await run_in_threadpool(
            lambda: admin.evict(worker_id, by(request), ban=ask.ban, reason=ask.reason)
        )
        if ask.ban:
            answer["credential_revoked"] = await run_in_threadpool(credentials.revoke, worker_id)
        return answer

    @app.delete("/v1/admin/bans/{worker_id}", dependencies=guarded)
    async def unban(worker_id: str, request: Request) -> dict:
        return await run_in_threadpool(admin.unban, worker_id, by(request))

    @app.get("/v1/admin/weights", dependencies=guarded)
    async def weights() -> Response:
        body, version = await run_in_threadpool(admin.masters_body)
        headers = {"X-Diloco-Round": str(version)}
        return Response(content=memoryview(body), media_type=TENSORS, headers=headers)

    @app.get("/v1/admin/audit", dependencies=guarded)
    async def audit(
        after: int = Query(0, ge=0, le=MAX_COUNT),
        limit: int = Query(MAX_AUDIT_ROWS, ge=1, le=MAX_AUDIT_ROWS),
    ) -> dict:
        events = await run_in_threadpool(admin.audit_log, after, limit)
        return {"events": events}

    @app.post("/v1/admin/stop", dependencies=guarded)
    async def stop(request: Request) -> dict:
        answer = await run_in_threadpool(admin.stop, by(request), request_stop is not None)
        if request_stop is not None:
            request_stop()  # uvicorn finishes this answer, drains, then the coordinator flushes
        return answer
