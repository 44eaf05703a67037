"""Which server shard owns which part of the model (issue 15: sharded parameter servers).

Each shard owns whole units of the model, so that no tensor's outer step is split between two
processes: whole fragments in streaming mode (a fragment's rounds then live on one shard and
need no agreement on outer steps), whole tensors otherwise. Units go to shards balanced by
bytes, so that each shard's link carries about 1/S of each round when no one unit is larger
than that.
"""

from __future__ import annotations

from collections.abc import Sequence

from diloco.algorithm._checks import require_int_at_least


def assign_shards(unit_bytes: Sequence[int], shards: int) -> list[list[int]]:
    """Indices of `unit_bytes` (units in plan order) for each of `shards` shards.

    Largest unit first (ties: the earlier unit), each to the shard holding the fewest bytes so
    far (ties: the lower shard): Graham's longest-processing-time rule, whose largest shard is
    at most 4/3 of the best possible one. Every shard gets at least one unit; each shard's
    indices come back in plan order. The same sizes always give the same layout, so every
    shard and every worker computes it alike.
    """
    require_int_at_least("shards", shards, 1)
    for index, size in enumerate(unit_bytes):
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ValueError(f"unit {index} has a size of {size!r} bytes; sizes are integers >= 0")
    if shards > len(unit_bytes):
        raise ValueError(
            f"shards must be at most the {len(unit_bytes)} units of the model that a shard can "
            f"own whole (tensors, or fragments in streaming mode), got {shards}"
        )
    owned: list[list[int]] = [[] for _ in range(shards)]
    loads = [0] * shards
    for index in sorted(range(len(unit_bytes)), key=lambda i: (-unit_bytes[i], i)):
        # a shard still without a unit takes the next one, so that none is left empty
        empty = [s for s in range(shards) if not owned[s]]
        remaining = len(unit_bytes) - sum(len(units) for units in owned)
        candidates = empty if len(empty) == remaining else range(shards)
        lightest = min(candidates, key=lambda s: (loads[s], s))
        owned[lightest].append(index)
        loads[lightest] += unit_bytes[index]
    return [sorted(units) for units in owned]
