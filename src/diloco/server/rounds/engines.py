"""The round engines: when the coordinator combines pseudo-gradients into an outer step.

`BarrierRounds` (sync, streaming) waits for every member of a fragment's round;
`AsyncArrivals` (async) applies each arrival at once, or what a grace window gathered. The
coordinator calls them under its lock and owns what they share (masters, optimizer, journal).
Their interface is `engine.RoundEngine`.
"""

from __future__ import annotations

from diloco.server.rounds.async_arrivals import AsyncArrivals
from diloco.server.rounds.barrier import BarrierRounds
from diloco.server.rounds.engine import EngineContext, ShardEngine
from diloco.server.shards.role import ShardRole

__all__ = ["engine_for"]


def engine_for(context: EngineContext, role: ShardRole) -> ShardEngine:
    """The mode's engine, with this server's part in it (`role`): sharded servers hold slices
    until shard 0 decides each round (each step, async)."""
    if context.settings.mode == "async":
        return AsyncArrivals(context, role.arrivals_part(context))
    return BarrierRounds(context, role.rounds_part(context))
