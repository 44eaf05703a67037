"""Robust aggregation on sync sharded servers as a user runs them (issue 28, item 1): two
`diloco server --shard I --aggregation RULE` processes, three real workers (the opposed
check runs from 3 kept), shards killed with SIGKILL inside the screening that spans them
and restarted on their state dirs.

Shard 0 screens each worker's whole pseudo-gradient from every shard's part of its sums, so
the run ends where the simulator's one model ends under the same rule (rtol 1e-5: the shards
sum in another order), and a killed run ends bit-identical to an unbroken one. All of it
runs with `-m slow`; the default suite proves the screening across shards over raw HTTP in
process (tests/server/test_server_http_shard_robust.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from e2e.test_e2e_shard_crash import (
    STEPS,
    SYNC_EVERY,
    ShardKill,
    run_with_kill,
    unbroken_run,
)

WORKERS = 3
MEDIAN = ("--sync-every", str(SYNC_EVERY), "--min-workers", str(WORKERS),
          "--aggregation", "median")  # fmt: skip
KILLS = [
    ShardKill("shard 1 summed its part of a screening, not sent", 1, "screening_part:2"),
    ShardKill("shard 0 as shard 1's part of a screening arrives", 0, "screening_part_arrived:2"),
    ShardKill("shard 0 deciding, before its checkpoint", 0, "before_checkpoint:2"),
    ShardKill("shard 1 applying the decision, checkpoint written", 1, "after_checkpoint:2"),
]


def simulated(corpus: bytes, rule: str) -> dict[str, torch.Tensor]:
    from e2e.test_e2e_sync import simulated_run

    return simulated_run(corpus, workers=WORKERS, steps=STEPS, aggregation=rule).final_state


def assert_close_to(weights: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> None:
    assert weights.keys() == reference.keys()
    for name, tensor in reference.items():
        torch.testing.assert_close(weights[name], tensor, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.slow  # ~13 s alone; the default suite proves the screening across shards over real
# HTTP in process, a follower's decision loop included (test_server_http_shard_robust.py)
def test_median_shards_with_a_follower_killed_in_the_screening_end_like_the_simulator(
    corpus_file: Path, small_corpus: bytes, tmp_path: Path
) -> None:
    """Shard 1 dies between summing its part of a round's screening and sending it;
    restarted, it takes its held slices back from disk, sums its part again when shard 0
    asks, and the run ends where the simulator's median run ends (which the plain mean's
    does not)."""
    (kill,) = [k for k in KILLS if k.spec.startswith("screening_part:")]
    weights = run_with_kill(kill, corpus_file, tmp_path, mode=MEDIAN, count=WORKERS)
    median = simulated(small_corpus, "median")
    assert_close_to(weights, median)
    mean = simulated(small_corpus, "mean")
    assert any(not torch.allclose(mean[n], t, rtol=1e-5, atol=1e-6) for n, t in median.items())


@pytest.fixture(scope="module")
def unbroken_median(tmp_path_factory: pytest.TempPathFactory, corpus_file: Path):
    return unbroken_run(tmp_path_factory, corpus_file, MEDIAN, WORKERS)


@pytest.mark.slow
@pytest.mark.parametrize("kill", KILLS, ids=str)
def test_median_shards_killed_in_the_screening_end_as_unbroken(
    kill: ShardKill, unbroken_median, corpus_file: Path, tmp_path: Path
) -> None:
    weights = run_with_kill(kill, corpus_file, tmp_path, mode=MEDIAN, count=WORKERS)
    assert weights.keys() == unbroken_median.keys()
    for name, tensor in unbroken_median.items():
        assert torch.equal(weights[name], tensor), name


@pytest.mark.slow
def test_clipped_mean_shards_end_like_the_simulator(
    tmp_path_factory: pytest.TempPathFactory, corpus_file: Path, small_corpus: bytes
) -> None:
    """clipped_mean: each worker scaled by its whole pseudo-gradient's norm against the
    median of the recent ones; an unbroken sharded run ends where the simulator's does."""
    mode = (*MEDIAN[:-1], "clipped_mean")
    weights = unbroken_run(tmp_path_factory, corpus_file, mode, WORKERS)
    assert_close_to(weights, simulated(small_corpus, "clipped_mean"))
