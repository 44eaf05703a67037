"""This server's shard role: one server, shard 0 of sharded servers, or another shard.

One object, built once at start and handed to whoever behaves differently by role: the round
engine (its part, `rounds_part` / `arrivals_part`: shard 0 decides each step, the others
apply its decisions, one server decides alone), the registrar (who may register here, and
whose plan a streaming shard takes), admin actions (a run is steered on shard 0), the
eviction tick (membership is shard 0's). The calls it makes to shard 0 go through
`ShardPeers`; no HTTP here.
"""

from __future__ import annotations

from diloco.server.errors import Rejection
from diloco.server.rounds.async_arrivals import ArrivalsRole, OneServerArrivals
from diloco.server.rounds.barrier import OneServer, RoundsRole
from diloco.server.rounds.engine import EngineContext
from diloco.server.settings import ServerSettings
from diloco.server.shards.async_decisions import AsyncFollower, AsyncLeader
from diloco.server.shards.peers import PeerUnavailable, ShardPeers
from diloco.server.shards.sync_decisions import SyncFollower, SyncLeader


class ShardRole:
    """What differs between one server, shard 0 (it leads) and the other shards (they follow)."""

    def __init__(self, settings: ServerSettings, peers: ShardPeers | None = None) -> None:
        self.index = settings.shard
        self.shards = settings.shards
        self.mode = settings.mode
        self.peers = peers  # the other shards (None: one server, or a test's lone shard)

    @property
    def single(self) -> bool:
        """One server: no shards."""
        return self.shards == 1

    @property
    def leads(self) -> bool:
        """One server, or shard 0: membership, evictions, steering and every decision."""
        return self.index == 0

    @property
    def follows(self) -> bool:
        """Another shard: membership and decisions are shard 0's."""
        return not self.leads

    @property
    def decides(self) -> bool:
        """Shard 0 decides every step for all shards (sync, async). In streaming mode each
        shard commits its own fragments' rounds: nothing is decided across shards."""
        return not self.single and self.mode != "streaming"

    @property
    def serves_versions(self) -> bool:
        """Async shards serve exact versions (a worker takes every shard's part of one)."""
        return self.decides and self.mode == "async"

    @property
    def admits_alone(self) -> bool:
        """Whether a new worker may register here without shard 0 vouching for it: not on a
        streaming follower, which commits rounds alone (only workers shard 0 admitted may
        reach them)."""
        return not (self.mode == "streaming" and self.follows)

    def rounds_part(self, context: EngineContext) -> RoundsRole:
        """A `BarrierRounds`'s role: sync shards hold every slice until shard 0 decides the
        round; one server's rounds and a streaming shard's (each commits its own fragments)
        change nothing."""
        if not self.decides:
            return OneServer()
        return SyncLeader(context) if self.leads else SyncFollower(context)

    def arrivals_part(self, context: EngineContext) -> ArrivalsRole:
        """An `AsyncArrivals`'s role: async shards hold every slice until shard 0 decides the
        step; one server's arrivals change nothing."""
        if not self.decides:
            return OneServerArrivals()
        return AsyncLeader(context) if self.leads else AsyncFollower(context)

    def known_to_shard0(self, worker_id: str, session: str) -> bool:
        """A follower (lock held: a rare call, one round trip): whether shard 0 holds
        `worker_id` live under `session`. Never on one server or shard 0."""
        if self.leads or self.peers is None:
            return False
        try:
            return self.peers.member_session(worker_id, session)
        except PeerUnavailable as exc:
            raise Rejection(
                503, "shard_unavailable", f"shard 0 cannot be reached to vouch for it: {exc}"
            ) from None

    def leader_plan(self) -> list[list[str]]:
        """A streaming follower (lock held: once, at the first registration): shard 0's
        whole fragment plan; 503 while shard 0 cannot be reached or has none yet."""
        assert self.peers is not None
        try:
            plan = self.peers.whole_plan()
        except PeerUnavailable as exc:
            raise Rejection(
                503, "shard_unavailable", f"shard 0 cannot be reached for its plan: {exc}"
            ) from None
        if plan is None:
            raise Rejection(
                503,
                "shard_unavailable",
                "shard 0 has no fragment plan yet: register there first, then here",
            )
        return plan
