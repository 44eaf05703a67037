"""Error feedback through a real server: what a worker keeps when the server never used a body."""

from __future__ import annotations

import threading
import time

import torch
from test_worker_worker import record_submits

from diloco.server.settings import ServerSettings
from diloco.worker import DiLoCoWorker


def _worker(url: str, worker_id: str) -> tuple[DiLoCoWorker, torch.nn.Linear]:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1, bias=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return DiLoCoWorker(model, optimizer, url, worker_id=worker_id), model


def _step(worker: DiLoCoWorker, model: torch.nn.Linear, scale: float) -> None:
    model(torch.full((1, 8), scale)).sum().backward()
    worker.optimizer.step()  # H = 1: the sync happens in here
    worker.optimizer.zero_grad()


def test_a_body_the_round_committed_without_leaves_nothing_in_the_residual(live_server) -> None:
    """topk:0.25 with error feedback, H = 1, two workers. Worker b trains its round only after
    the barrier timed out on it and the round committed with a alone: the server answers its
    late body `committed`, so none of it was used, and b's residual must hold none of it
    either (before, b kept e - C(e) of a pseudo-gradient whose sent part was thrown away)."""
    settings = ServerSettings(
        sync_every=1, barrier_timeout=1.0, upload_codec="topk:0.25",
        topk_chunk=8, error_feedback_beta=0.9, outer_optimizer="sgd", outer_lr=1.0,
        heartbeat_interval=0.2, heartbeat_timeout=30.0,
    )  # fmt: skip
    with live_server(settings) as server:
        a, model_a = _worker(server.url, "a")
        b, model_b = _worker(server.url, "b")
        first = threading.Thread(target=_step, args=(a, model_a, 1.0))
        first.start()
        deadline = time.monotonic() + 30
        while first.is_alive() and time.monotonic() < deadline:
            time.sleep(0.2)
            server.coordinator.evict_stale()  # the CLI server's eviction ticker does this
        # a's round committed once the barrier gave up on b
        assert not first.is_alive() and a.rounds == 1
        assert server.coordinator.status()["round"] == 1
        assert a._uploads.residual["weight"].count_nonzero() == 6  # 2 of 8 values went
        answers = record_submits(b)
        _step(b, model_b, 2.0)  # b's body for round 0 arrives after the round committed
        assert answers == [" committed"]
        assert b.round == 1  # b took the round's result: a's weights
        torch.testing.assert_close(model_b.weight, model_a.weight, rtol=0, atol=0)
        assert b._uploads.residual == {}  # nothing of the unused body is kept
        assert server.coordinator.status()["round"] == 1  # nothing of b's body was folded in
        a.close(final_sync=False)
        b.close(final_sync=False)


INT8_BOTH_WAYS = ServerSettings(
    sync_every=1, upload_codec="int8", download_codec="int8", error_feedback_beta=0.9,
    heartbeat_interval=0.2, heartbeat_timeout=30.0,
)  # fmt: skip


def _first_delta_refused_half_way(monkeypatch) -> list[str]:
    """The first coded delta a worker applies moves part of its anchor, then is refused (as
    a body with a bad block would be); later ones apply. The tensors refused, as they come."""
    import diloco.worker.anchor as anchors
    from diloco.wire import WireError

    real = anchors.apply_delta
    failures: list[str] = []

    def half_then_refused(delta, targets, codec, **kwargs):
        if failures:
            return real(delta, targets, codec, **kwargs)
        first = next(iter(targets))
        targets[first].add_(1.0)  # (a part of the anchor moved)
        failures.append(first)
        raise WireError(422, "invalid_tensor", f"tensor {first!r}: refused (injected)")

    monkeypatch.setattr(anchors, "apply_delta", half_then_refused)
    return failures


def _one_round(url: str, fail_in: str | None) -> tuple[DiLoCoWorker, torch.nn.Linear]:
    """One int8 round (both ways, error feedback) of a worker whose anchor is said to be on
    a GPU, and whose first `fail_in` ("body" or "values_after") runs out of GPU memory after
    doing its work halfway (the residuals of a half-coded body already written)."""
    worker, model = _worker(url, "a")
    worker._anchor.device = torch.device("cuda")  # as on a GPU (the tensors stay where they are)
    failed = []
    if fail_in == "body":
        target, name = worker._uploads, "body_from"
    elif fail_in == "values_after":
        target, name = worker._anchor, "values_after"
    if fail_in is not None:
        real = getattr(target, name)

        def out_of_memory(*args, **kwargs):
            if not failed:
                failed.append(real(*args, **kwargs))
                raise torch.OutOfMemoryError("CUDA out of memory (injected)")
            return real(*args, **kwargs)

        setattr(target, name, out_of_memory)
    _step(worker, model, 1.0)
    assert failed or fail_in is None
    return worker, model


def test_a_gpu_out_of_memory_in_a_sync_moves_the_anchor_to_the_cpu_and_the_round_goes_on(
    live_server, caplog, monkeypatch
) -> None:
    """The round ends exactly as one that never ran out of memory: same weights, same
    residual (nothing of the half-coded body kept), and the anchor now lives on the CPU."""
    import diloco.worker.anchor as anchors

    real_update = anchors.updated_anchor  # a "cuda" anchor's tensors stay on this CPU
    monkeypatch.setattr(
        anchors, "updated_anchor", lambda anchor, tensors, _device: real_update(anchor, tensors)
    )
    settings = ServerSettings(
        sync_every=1, upload_codec="int8", download_codec="int8", error_feedback_beta=0.9,
        outer_optimizer="sgd", outer_lr=1.0, heartbeat_interval=0.2, heartbeat_timeout=30.0,
    )  # fmt: skip
    ended = {}
    for fail_in in (None, "body", "values_after"):
        with live_server(settings) as server:
            worker, model = _one_round(server.url, fail_in)
            ended[fail_in] = (
                model.weight.detach().clone(),
                {n: t.clone() for n, t in worker._uploads.residual.items()},
                worker.round,
                worker._anchor.device.type,
            )
            worker.close(final_sync=False)
    clean = ended[None]
    assert clean[2] == 1 and clean[3] == "cuda" and clean[1]["weight"].count_nonzero() > 0
    for fail_in in ("body", "values_after"):
        weight, residual, round_number, device = ended[fail_in]
        assert round_number == 1 and device == "cpu", fail_in
        assert torch.equal(weight, clean[0]), fail_in
        assert residual.keys() == clean[1].keys(), fail_in
        assert all(torch.equal(residual[n], clean[1][n]) for n in residual), fail_in
    moved = [r for r in caplog.records if "ran out of memory in a sync" in r.getMessage()]
    assert len(moved) == 2 and all(r.levelname == "WARNING" for r in moved)


def test_a_delta_that_fails_part_way_gives_the_servers_whole_weights(
    live_server, caplog, monkeypatch
) -> None:
    """The anchor moves in place: when the coded delta is refused after half of it moved the
    anchor, the worker takes the server's whole current weights instead, with a warning,
    and ends the round exactly where a clean one ends (model and anchor equal to the
    server's published weights), then goes on with deltas."""
    from diloco.wire import decode_tensors

    failures = _first_delta_refused_half_way(monkeypatch)
    with live_server(INT8_BOTH_WAYS) as server:
        worker, model = _worker(server.url, "a")
        _step(worker, model, 1.0)
        assert failures and worker.round == 1 and not worker._anchor.torn
        published = decode_tensors(server.coordinator.weights().body)
        assert torch.equal(model.weight.detach(), published["weight"])
        assert torch.equal(worker._anchor.tensors["weight"], published["weight"])
        _step(worker, model, 2.0)  # the next round's delta applies as usual
        published = decode_tensors(server.coordinator.weights().body)
        assert worker.round == 2 and torch.equal(model.weight.detach(), published["weight"])
        worker.close(final_sync=False)
    taken = [r for r in caplog.records if "taking the server's whole weights" in r.getMessage()]
    assert len(taken) == 1 and taken[0].levelname == "WARNING"
    assert "refused part way" in taken[0].getMessage()


def _topk_round_worker(server_url: str, fail_wait: bool) -> tuple[DiLoCoWorker, torch.nn.Linear]:
    worker, model = _worker(server_url, "a")
    if fail_wait:
        from diloco.worker.errors import ServerUnavailable

        client, real = worker._session.client, worker._session.client.wait_result
        failed: list[bool] = []

        def fails_once(*args, **kwargs):
            if not failed:
                failed.append(True)
                raise ServerUnavailable(server_url, None, attempts=3, reason="injected")
            return real(*args, **kwargs)

        client.wait_result = fails_once
    return worker, model


def test_a_sync_that_fails_after_the_server_took_its_body_keeps_that_body_s_residual(
    live_server,
) -> None:
    """topk:0.25 of 8 values (2 sent) with error feedback, H = 1, one worker. The server
    takes the body ("accepted") and commits; then the worker's wait fails. The body is in
    the round, so its residual must stand, equal to a clean round's (6 of 8 values left);
    before, it was dropped as if the server had never used the body. The next sync of the
    same round sends another body, answered "duplicate": that is the first body's, so the
    second's residual is not taken either, and the worker ends on the server's weights."""
    from diloco.worker.errors import ServerUnavailable

    settings = ServerSettings(
        sync_every=1, upload_codec="topk:0.25", topk_chunk=8, error_feedback_beta=0.9,
        outer_optimizer="sgd", outer_lr=1.0, heartbeat_interval=0.2, heartbeat_timeout=30.0,
    )  # fmt: skip
    with live_server(settings) as server:
        clean, model = _topk_round_worker(server.url, fail_wait=False)
        _step(clean, model, 1.0)
        expected = clean._uploads.residual["weight"].clone()
        clean.close(final_sync=False)
    assert expected.count_nonzero() == 6
    with live_server(settings) as server:
        worker, model = _topk_round_worker(server.url, fail_wait=True)
        try:
            _step(worker, model, 1.0)
        except ServerUnavailable:
            pass
        else:
            raise AssertionError("the injected failure did not reach the sync")
        assert server.coordinator.status()["round"] == 1  # the body went into round 0
        assert worker.round == 0
        assert torch.equal(worker._uploads.residual["weight"], expected)
        answers = record_submits(worker)
        _step(worker, model, 2.0)  # another body for round 0
        assert answers == [" duplicate"]
        assert worker.round == 1
        assert torch.equal(worker._uploads.residual["weight"], expected)
        masters = server.coordinator.model.masters
        torch.testing.assert_close(model.weight, masters["weight"], rtol=0, atol=0)
        worker.close(final_sync=False)


def test_an_anchor_left_torn_is_repaired_from_the_server_before_any_body_is_coded(
    live_server, caplog, monkeypatch
) -> None:
    """A delta refused half way leaves the anchor torn, and the whole weights that repair it
    fail to come too (the server unreachable then): the sync raises. The next sync must not
    code a body from the half-moved anchor (nor send one: round 0 has this worker's body
    already); it takes the server's current weights, and the worker ends on them."""
    from diloco.wire import decode_tensors
    from diloco.worker.errors import ServerUnavailable

    failures = _first_delta_refused_half_way(monkeypatch)
    with live_server(INT8_BOTH_WAYS) as server:
        worker, model = _worker(server.url, "a")
        session = worker._session
        real_fetch = session.fetch_weights

        def unreachable():
            raise ServerUnavailable(server.url, None, attempts=3, reason="injected")

        session.fetch_weights = unreachable
        try:
            _step(worker, model, 1.0)
        except ServerUnavailable:
            pass
        else:
            raise AssertionError("the injected failure did not reach the sync")
        assert failures and worker._anchor.torn and worker.round == 0
        session.fetch_weights = real_fetch
        sent = record_submits(worker)
        with caplog.at_level("WARNING", logger="diloco.worker"):
            worker.sync()  # (a step's sync would train first: sync now, as close does)
        assert sent == [] and not worker._anchor.torn and worker.round == 1
        published = decode_tensors(server.coordinator.weights().body)
        assert torch.equal(model.weight.detach(), published["weight"])
        assert torch.equal(worker._anchor.tensors["weight"], published["weight"])
        assert any("left torn" in r.getMessage() for r in caplog.records)
        worker.close(final_sync=False)
