"""The routes of sharded servers (docs/protocol.md, "Sharded servers"): a worker's
confirmation on shard 0, and the two questions shards ask each other."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from fastapi import Depends, FastAPI, Path, Query, Request
from starlette.concurrency import run_in_threadpool

from diloco.server.errors import Rejection
from diloco.server.http.request_json import json_body, json_body_schema
from diloco.server.members.credentials import ADMIN, OPEN, SHARD, Caller
from diloco.server.rounds.robust import ScreeningPart
from diloco.server.shards.commit import MAX_DECISION_WAIT, ShardCommit
from diloco.wire import MAX_COUNT, ShardPausedRequest, ShardScreeningPart


def add_shard_routes(
    app: FastAPI,
    shard: ShardCommit,
    authed: Sequence[Any],
    act_as: Callable[[Request, str], None],
    caller_of: Callable[[Request], Caller],
) -> None:
    async def shards_only(request: Request) -> None:
        """What shards ask each other is theirs (and an admin's) to read: 403 for any other
        secret, a worker's credential or the enrollment token included."""
        caller = caller_of(request)
        if caller.scope not in (SHARD, ADMIN, OPEN):
            raise Rejection(
                403,
                "forbidden",
                "the /v1/shard routes are for the shards' own secret (scope shard in "
                f"--tokens-file), not this credential (scope {caller.scope})",
                scope=caller.scope,
                required=SHARD,
            )

    async def shard_itself(request: Request) -> None:
        """What only a shard may do to another (shard 0 pausing a follower, a follower
        sending its part of a screening): not even an admin, who steers the run on shard 0
        (a follower refuses a pause of its own)."""
        caller = caller_of(request)
        if caller.scope not in (SHARD, OPEN):
            raise Rejection(
                403,
                "forbidden",
                "only shard 0 pauses and resumes the other shards (with the shards' own secret); "
                f"not this credential (scope {caller.scope}): pause shard 0 instead",
                scope=caller.scope,
                required=SHARD,
            )

    peers_only = [*authed, Depends(shards_only)]

    @app.post("/v1/rounds/{round_number}/confirm", dependencies=list(authed))
    async def confirm(
        request: Request,
        round_number: int = Path(..., ge=0, le=MAX_COUNT),
        worker_id: str = Query(..., max_length=200),
    ) -> dict:
        """Shard 0: every shard holds the worker's slice of the round; count it in."""
        act_as(request, worker_id)
        return await run_in_threadpool(shard.confirm, worker_id, round_number)

    @app.get("/v1/shard/prepared", dependencies=peers_only)
    async def prepared(
        round: int = Query(..., ge=0, le=MAX_COUNT),
        worker_id: str = Query(..., max_length=200),
        session_digest: str | None = Query(None, max_length=64),
    ) -> dict:
        """Whether this shard holds the worker's slice of the round (asked by shard 0; with
        `session_digest`: the slice from that process)."""
        return await run_in_threadpool(shard.prepared, round, worker_id, session_digest)

    @app.get("/v1/shard/members", dependencies=peers_only)
    async def member(
        worker_id: str = Query(..., max_length=200), session: str = Query(..., max_length=200)
    ) -> dict:
        """Shard 0: whether the worker is live under that session (asked by the others)."""
        return await run_in_threadpool(shard.member, worker_id, session)

    @app.get("/v1/shard/decisions/{round_number}", dependencies=peers_only)
    async def decision(
        round_number: int = Path(..., ge=0, le=MAX_COUNT),
        wait: float = Query(0.0, ge=0.0, le=MAX_DECISION_WAIT),
        shard_index: int | None = Query(None, alias="shard", ge=0, le=MAX_COUNT),
    ) -> dict:
        """Shard 0: who the round's step used, once it is durable (asked by the others);
        with `shard`, the asking shard is told at once when the round's screening waits
        for its part."""
        return await run_in_threadpool(shard.decision, round_number, wait, shard_index)

    @app.post(
        "/v1/shard/screening/{round_number}",
        dependencies=[*authed, Depends(shard_itself)],
        openapi_extra=json_body_schema(ShardScreeningPart),
    )
    async def screening(
        request: Request, round_number: int = Path(..., ge=0, le=MAX_COUNT)
    ) -> dict:
        """Shard 0: another shard's part of the open round's screening (robust rules)."""
        sent = await json_body(request, ShardScreeningPart)
        part = ScreeningPart(
            dict(sent.kept),
            dict(sent.dots),
            dict(sent.squares),
            sent.median_squares,
            tuple(sent.missing),
        )
        return await run_in_threadpool(shard.take_part, round_number, part, sent.shard)

    @app.get("/v1/shard/live", dependencies=peers_only)
    async def live() -> dict:
        """Shard 0: the live workers (streaming: the others evict whom shard 0 evicted)."""
        return await run_in_threadpool(shard.live_members)

    @app.post(
        "/v1/shard/paused",
        dependencies=[*authed, Depends(shard_itself)],
        openapi_extra=json_body_schema(ShardPausedRequest),
    )
    async def paused(request: Request) -> dict:
        """A streaming follower: shard 0 paused or resumed the rounds."""
        told = await json_body(request, ShardPausedRequest)
        return await run_in_threadpool(shard.told_paused, told.paused, told.stamp)

    @app.get("/v1/shard/plan", dependencies=peers_only)
    async def plan() -> dict:
        """Shard 0: the whole model's fragment plan (streaming: the others cut theirs from it)."""
        return await run_in_threadpool(shard.whole_plan)
