"""Asynchronous DiLoCo through a real `diloco server --mode async` process."""

from __future__ import annotations

import re
import threading
import time

import torch

from diloco.server.settings import ServerSettings
from diloco.sim import SimConfig, prepare, simulate
from diloco.worker import DiLoCoClient, DiLoCoWorker, RetryPolicy
from processes import global_weights
from tiny import TINY_MODEL


def async_config(**overrides) -> SimConfig:
    settings = dict(
        mode="async",
        workers=2,
        sync_every=4,
        steps=12,
        speeds=(1.0, 0.5),
        async_delay=2,
        batch_size=4,
        seq_len=32,
        model=TINY_MODEL,
        warmup=2,
        seed=5,
    )
    settings.update(overrides)
    return SimConfig(**settings)


def replay_arrivals(url: str, config: SimConfig, simulated, corpus: bytes) -> list[DiLoCoWorker]:
    """The simulator's arrival order replayed by one in-process DiLoCoWorker per simulated
    worker: each trains the steps of its next arrival (the H-th step's hook sends and adopts
    the result; a shorter last window syncs by hand). The workers are left open."""
    setup = prepare(config, corpus)
    budgets = simulated.local_steps_per_worker
    replicas = [setup.replica(w, total_steps=budgets[w]) for w in range(config.workers)]
    workers = [
        DiLoCoWorker(r.model, r.optimizer, url, worker_id=f"w{w}", heartbeat=False)
        for w, r in enumerate(replicas)
    ]
    for w, steps, _ in simulated.arrivals:
        for _ in range(steps):
            replicas[w].train_step()
        if steps < config.sync_every:
            workers[w].sync()
    return workers


def metric(url: str, name: str) -> float:
    with DiLoCoClient(url, retry=RetryPolicy(attempts=3)) as client:
        reply = client._call("metrics", "GET", "/metrics")
    match = re.search(rf"^{name} (\S+)$", bytes(reply.body).decode(), re.MULTILINE)
    assert match, name
    return float(match.group(1))


def test_async_through_the_real_server_matches_the_simulator(server_process, small_corpus) -> None:
    """The simulator's arrival order, replayed by two real DiLoCoWorkers against the server:
    every arrival applied at once with Delayed Nesterov (N = 2), final weights equal."""
    config = async_config()
    simulated = simulate(config, corpus=small_corpus)
    # Speeds 1 and 0.5 with H = 4 over 12 steps: w0 arrives at t = 4, 8, 12; w1 at t = 8
    # (after w0, as the simulator breaks ties by worker) and at t = 12 with 2 steps left.
    assert [(w, n) for w, n, _ in simulated.arrivals] == [(0, 4), (0, 4), (1, 4), (0, 4), (1, 2)]
    server = server_process("--mode", "async", "--sync-every", "4", "--dn-period", "2")
    workers = replay_arrivals(server.url, config, simulated, small_corpus)
    for worker in workers:
        worker.close(final_sync=False)
    real, version = global_weights(server.url)
    assert version == len(simulated.arrivals) == 5
    for name, tensor in simulated.final_state.items():
        torch.testing.assert_close(real[name], tensor, rtol=1e-5, atol=1e-6, msg=name)
    # Staleness, the steps other workers applied since a worker's anchor: 0, 0, 2, 1, 1.
    assert metric(server.url, "diloco_staleness_sum") == 4.0
    assert metric(server.url, "diloco_staleness_count") == 5.0


def test_a_grace_window_gives_near_simultaneous_arrivals_one_step_as_the_simulator_does(
    server_process, small_corpus
) -> None:
    """Two equal workers, H = 2, 4 steps each, in threads: each pair of arrivals shares one
    outer step (the 30 s window closes early once both are in) and both workers get the same
    weights; the final weights equal `diloco simulate --mode async --grace 1`'s."""
    config = async_config(speeds=(), sync_every=2, steps=4, async_delay=1, grace=1.0)
    simulated = simulate(config, corpus=small_corpus)
    assert simulated.outer_steps == 2 and len(simulated.arrivals) == 4
    server = server_process(
        "--mode", "async", "--sync-every", "2", "--grace-seconds", "30", "--dn-period", "1"
    )  # fmt: skip
    setup = prepare(config, small_corpus)
    replicas = [setup.replica(w) for w in range(2)]
    workers = [
        DiLoCoWorker(r.model, r.optimizer, server.url, worker_id=f"w{w}", heartbeat=False)
        for w, r in enumerate(replicas)
    ]
    threads = [
        threading.Thread(target=lambda r=r: [r.train_step() for _ in range(4)]) for r in replicas
    ]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    # Both arrived well inside the 30 s windows: each closed early, as one outer step.
    assert time.monotonic() - started < 25
    real, version = global_weights(server.url)
    assert version == 2 and [w.round for w in workers] == [2, 2]
    for replica in replicas:
        for name, tensor in replica.state().items():
            torch.testing.assert_close(tensor, real[name].to(tensor.dtype), msg=name)
    for name, tensor in simulated.final_state.items():
        torch.testing.assert_close(real[name], tensor, rtol=1e-5, atol=1e-6, msg=name)
    for worker in workers:
        worker.close(final_sync=False)


def test_dylu_gives_the_slow_worker_fewer_local_steps(live_server) -> None:
    """Two real workers, one slowed to ~1/20 of the other's speed: from the heartbeats'
    per-window speeds the server recommends a smaller H for the slow one, which adopts it at
    its next window, while the fast one keeps the full H."""

    settings = ServerSettings(
        mode="async", sync_every=8, dylu=True, heartbeat_interval=0.1, heartbeat_timeout=30
    )
    with live_server(settings) as server:
        models = [torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)) for _ in "ab"]
        optimizers = [torch.optim.SGD(m.parameters(), lr=0.05) for m in models]
        fast, slow = (
            DiLoCoWorker(m, o, server.url, worker_id=name)
            for m, o, name in zip(models, optimizers, ("fast", "slow"), strict=True)
        )
        seen = {"fast": set(), "slow": set()}
        slow_done = threading.Event()

        def run(worker, model, optimizer, pause: float, steps: int | None) -> None:
            generator = torch.Generator().manual_seed(3)
            done = 0
            while (steps is None and not slow_done.is_set()) or (
                steps is not None and done < steps
            ):
                model(torch.randn(8, 4, generator=generator)).pow(2).mean().backward()
                optimizer.step()
                optimizer.zero_grad()
                seen[worker.worker_id].add(worker.window_sync_every)
                time.sleep(pause)
                done += 1

        runner = threading.Thread(target=run, args=(fast, models[0], optimizers[0], 0.001, None))
        runner.start()
        try:
            run(slow, models[1], optimizers[1], 0.03, 64)
        finally:
            slow_done.set()
            runner.join(timeout=60)
        assert seen["fast"] == {8}
        assert min(seen["slow"]) <= 4, seen
        status = {w["worker_id"]: w for w in server.coordinator.status()["workers"]}
        assert status["fast"]["recommended_sync_every"] == 8
        fast.close(final_sync=False)
        slow.close(final_sync=False)
