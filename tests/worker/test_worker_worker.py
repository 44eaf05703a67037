"""DiLoCoWorker against a real server on 127.0.0.1: hooks, H, dtypes, settings, re-joining."""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from diloco.algorithm import OuterOptimizer, pseudo_gradient
from diloco.server.coordinator import Coordinator
from diloco.server.http.runner import build_server
from diloco.server.settings import ServerSettings
from diloco.server.state.journal import RoundJournal
from diloco.server.state.store import StateStore
from diloco.wire import decode_tensors, encode_tensors
from diloco.worker import DiLoCoClient, DiLoCoWorker, ServerSettingsError, WorkerSettings


def record_submits(worker: DiLoCoWorker) -> list[str]:
    """The server's answer to each of `worker`'s submissions from now on, as "UNITS STATUS"
    ("" for no units: " accepted"), in order."""
    client = worker._session.client
    submit, answers = client.submit, []

    def recorded(*args, **kwargs):
        reply = submit(*args, **kwargs)
        answers.append(f"{','.join(map(str, kwargs.get('units') or []))} {reply.get('status')}")
        return reply

    client.submit = recorded
    return answers


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))


def train(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    steps: int,
    accumulation: int = 1,
    seed: int = 1,
) -> None:
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for _ in range(accumulation):
            x = torch.randn(8, 4, generator=generator)
            (model(x).pow(2).mean() / accumulation).backward()
        optimizer.step()
        optimizer.zero_grad()


def server_weights(url: str) -> dict[str, torch.Tensor]:
    with DiLoCoClient(url) as client:
        body, _ = client.get_weights()
    return decode_tensors(body)


def test_h_counts_optimizer_steps_not_batches(live_server) -> None:
    with live_server(ServerSettings(sync_every=3)) as server:
        model = make_model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        worker = DiLoCoWorker(model, optimizer, server.url, worker_id="acc")
        train(model, optimizer, steps=9, accumulation=4)  # 36 backward passes, 9 steps
        assert worker.local_step == 9
        assert worker.rounds == 3
        assert server.coordinator.round_number == 3
        worker.close()


def test_one_worker_with_outer_sgd_lr1_keeps_its_local_model(live_server) -> None:
    """FedAvg of one worker is that worker: the sync must hand back exactly its weights."""
    settings = ServerSettings(sync_every=5, outer_optimizer="sgd", outer_lr=1.0)
    with live_server(settings) as server:
        model = make_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        worker = DiLoCoWorker(model, optimizer, server.url)
        reference = make_model()
        reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
        train(model, optimizer, steps=5)
        train(reference, reference_optimizer, steps=5)
        assert worker.rounds == 1
        for name, tensor in reference.state_dict().items():
            torch.testing.assert_close(model.state_dict()[name], tensor, rtol=0, atol=1e-7)
            torch.testing.assert_close(worker.anchor[name], tensor, rtol=0, atol=1e-7)
        worker.close(final_sync=False)


def test_rounds_reuse_the_anchor_and_download_memory(live_server) -> None:
    with live_server(ServerSettings(sync_every=2)) as server:
        model = make_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        worker = DiLoCoWorker(model, optimizer, server.url, heartbeat=False)
        addresses = {name: t.data_ptr() for name, t in worker.anchor.items()}
        downloads = {id(worker._download)}  # the join's weights came in it
        for round_number in range(1, 4):
            train(model, optimizer, steps=2, seed=round_number)
            assert worker.rounds == round_number
            downloads.add(id(worker._download))
            # fp32 both ways: the weights came back into the upload's own buffer
            assert worker._download is worker._uploads._plain_buffer[1]
            assert {n: t.data_ptr() for n, t in worker.anchor.items()} == addresses
            for name, tensor in server_weights(server.url).items():
                torch.testing.assert_close(worker.anchor[name], tensor, rtol=0, atol=0)
                torch.testing.assert_close(model.state_dict()[name], tensor, rtol=0, atol=0)
        # each round's weights came into the join's buffer, which each upload wrote over
        assert len(downloads) == 1
        worker.close(final_sync=False)


def test_a_coded_download_keeps_a_buffer_of_its_own(live_server) -> None:
    """fp32 up, int8 delta down: the delta has another layout than the upload, so it comes
    into the last delta's buffer, never the upload's; the whole weights the worker joined
    with fit no delta, so their buffer is let go at once."""
    settings = ServerSettings(sync_every=2, download_codec="int8")
    with live_server(settings) as server:
        model = make_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        worker = DiLoCoWorker(model, optimizer, server.url, heartbeat=False)
        assert worker._download is None
        downloads = set()
        for round_number in range(1, 4):
            train(model, optimizer, steps=2, seed=round_number)
            assert worker.rounds == round_number
            assert worker._download is not worker._uploads._plain_buffer[1]
            if round_number > 1:
                downloads.add(id(worker._download))
        assert len(downloads) == 1
        worker.close(final_sync=False)


def test_nesterov_round_gives_the_algorithm_s_weights(live_server) -> None:
    with live_server(ServerSettings(sync_every=4)) as server:
        model = make_model()
        start = {n: t.clone() for n, t in model.state_dict().items()}
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        worker = DiLoCoWorker(model, optimizer, server.url)
        local = make_model()
        local_optimizer = torch.optim.SGD(local.parameters(), lr=0.05)
        train(local, local_optimizer, steps=4)
        train(model, optimizer, steps=4)
        expected = {n: t.clone() for n, t in start.items()}
        grads = {n: start[n] - local.state_dict()[n] for n in start}
        OuterOptimizer("nesterov", lr=0.7, momentum=0.9).step(expected, grads)
        for name, tensor in expected.items():
            torch.testing.assert_close(model.state_dict()[name], tensor, rtol=1e-6, atol=1e-7)
        worker.close(final_sync=False)


def test_bf16_upload_and_download_are_adopted_from_the_server(live_server) -> None:
    settings = ServerSettings(
        sync_every=2, upload_dtype=torch.bfloat16, download_dtype=torch.bfloat16
    )
    with live_server(settings) as server:
        model = make_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        worker = DiLoCoWorker(model, optimizer, server.url)
        assert worker.settings.upload_dtype == torch.bfloat16
        train(model, optimizer, steps=2)  # an fp32 upload would be refused as wrong_dtype
        assert worker.rounds == 1 and server.coordinator.round_number == 1
        for _name, tensor in model.state_dict().items():  # weights came down as bf16 values
            torch.testing.assert_close(tensor, tensor.to(torch.bfloat16).float(), rtol=0, atol=0)
        masters = server.coordinator.masters
        assert masters is not None and all(t.dtype == torch.float32 for t in masters.values())
        worker.close(final_sync=False)


def test_a_later_worker_starts_from_the_server_s_weights(live_server) -> None:
    with live_server(ServerSettings(sync_every=100)) as server:
        first = make_model(seed=1)
        DiLoCoWorker(
            first, torch.optim.SGD(first.parameters(), lr=0.1), server.url, heartbeat=False
        )
        second = make_model(seed=2)  # different initialisation, replaced on join
        DiLoCoWorker(
            second, torch.optim.SGD(second.parameters(), lr=0.1), server.url, heartbeat=False
        )
        for name, tensor in first.state_dict().items():
            torch.testing.assert_close(second.state_dict()[name], tensor, rtol=0, atol=0)


def test_workers_starting_together_send_the_initial_weights_once(live_server) -> None:
    """Three workers join at once while the first upload is still arriving: the server tells
    one to upload and the others wait for it, so the model crosses the link once (before,
    every worker that registered before the first upload landed sent its whole model), and
    all start from the uploader's weights."""
    with live_server(ServerSettings(sync_every=100)) as server:
        coordinator = server.coordinator
        real_upload = coordinator.upload_initial
        uploads: list[str] = []

        def slow_upload(worker_id, tensors):  # a large model on a slow link
            uploads.append(worker_id)
            time.sleep(1.0)
            return real_upload(worker_id, tensors)

        coordinator.upload_initial = slow_upload
        models = [make_model(seed=s) for s in (1, 2, 3)]
        start = threading.Barrier(3)

        def join(model: torch.nn.Module, worker_id: str) -> None:
            start.wait(timeout=10)
            DiLoCoWorker(
                model, torch.optim.SGD(model.parameters(), lr=0.1), server.url,
                worker_id=worker_id, heartbeat=False,
            )  # fmt: skip

        threads = [threading.Thread(target=join, args=(m, f"w{i}")) for i, m in enumerate(models)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert len(uploads) == 1, uploads
        weights = server_weights(server.url)
        for model in models:
            for name, tensor in model.state_dict().items():
                torch.testing.assert_close(tensor, weights[name], rtol=0, atol=0)


def test_an_evicted_worker_registers_again_and_its_progress_counts(live_server) -> None:
    settings = ServerSettings(
        sync_every=3,
        outer_optimizer="sgd",
        outer_lr=1.0,
        heartbeat_interval=0.2,
        heartbeat_timeout=0.6,
    )
    with live_server(settings) as server:
        model = make_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        worker = DiLoCoWorker(model, optimizer, server.url, worker_id="sleepy", heartbeat=False)
        deadline = time.monotonic() + 10
        while server.coordinator.membership.is_live("sleepy"):  # no heartbeats: evicted
            assert time.monotonic() < deadline
            time.sleep(0.05)
        train(model, optimizer, steps=3)  # the submit meets 404, re-registers, resubmits
        assert worker.rounds == 1 and server.coordinator.round_number == 1
        record = server.coordinator.membership.workers["sleepy"]
        assert record.live and record.rounds_contributed == 1
        weights = server_weights(server.url)
        for name, tensor in model.state_dict().items():  # FedAvg of one: its own weights
            torch.testing.assert_close(weights[name], tensor, rtol=0, atol=1e-7)
        worker.close(final_sync=False)


def test_heartbeats_reach_the_server(live_server) -> None:
    settings = ServerSettings(sync_every=50, heartbeat_interval=0.1, heartbeat_timeout=5)
    with live_server(settings) as server:
        model = make_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        worker = DiLoCoWorker(model, optimizer, server.url, worker_id="beating")
        train(model, optimizer, steps=3)
        worker.report(loss=1.25, tokens=24)
        deadline = time.monotonic() + 10
        while True:
            (status,) = server.coordinator.status()["workers"]
            if status["step"] == 3 and status["loss"] == 1.25:
                break
            assert time.monotonic() < deadline, status
            time.sleep(0.05)
        assert status["tokens"] == 24
        worker.close(final_sync=False)
        assert not server.coordinator.membership.is_live("beating")  # close deregisters


def test_close_gives_up_deregistering_from_a_server_gone_for_good(
    live_server, monkeypatch, caplog
) -> None:
    """The run's retry policy retries forever once the server has answered (to ride out a
    restart); `close` must not: its deregistration is best effort (the server evicts a
    silent worker anyway), so it retries for LEAVE_SECONDS at most and says so in the log."""
    import diloco.worker.session as session_module

    monkeypatch.setattr(session_module, "LEAVE_SECONDS", 1.0)
    settings = ServerSettings(sync_every=50, heartbeat_interval=0.2, heartbeat_timeout=5)
    with live_server(settings) as server:
        model = make_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        worker = DiLoCoWorker(model, optimizer, server.url, worker_id="left")
    assert worker.client.retry.deadline is None  # the run's policy: no bound
    closing = threading.Thread(target=worker.close, kwargs={"final_sync": False}, daemon=True)
    with caplog.at_level("WARNING", logger="diloco.worker"):
        closing.start()
        closing.join(timeout=60)
    assert not closing.is_alive()
    assert any("deregister failed" in r.getMessage() for r in caplog.records)


@contextmanager
def info_server(settings: dict) -> Iterator[str]:
    """A misconfigured server whose /v1/info states only `settings`."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = json.dumps(
                {
                    "protocol_version": 1,
                    "mode": "sync",
                    "round": 0,
                    "model_fingerprint": None,
                    "settings": settings,
                }
            ).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_a_server_that_omits_a_required_setting_is_fatal() -> None:
    complete = ServerSettings().to_wire()
    partial = {k: v for k, v in complete.items() if k != "sync_every"}
    with info_server(partial) as url:
        model = make_model()
        with pytest.raises(ServerSettingsError, match="sync_every"):
            DiLoCoWorker(model, torch.optim.SGD(model.parameters(), lr=0.1), url)


def test_heartbeat_interval_at_or_above_timeout_is_a_value_error() -> None:
    wire = ServerSettings().to_wire()
    wire.update(heartbeat_interval=30.0, heartbeat_timeout=30.0)
    with pytest.raises(ValueError, match="heartbeat_interval"):
        WorkerSettings.from_info({"mode": "sync", "settings": wire}, "http://127.0.0.1:1")


class FlakyProxy:
    """A TCP proxy on 127.0.0.1 that cuts every other connection after 32 KiB upstream."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.connections = 0
        self.cut = 0
        self.stopped = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.stopped:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            limit = 32 * 1024 if self.connections % 2 == 1 else None
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=30)
            threading.Thread(target=self._pipe, args=(client, upstream, limit), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, None), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket, limit: int | None) -> None:
        moved = 0
        try:
            while True:
                data = source.recv(65536)
                if not data:
                    break
                if limit is not None and moved + len(data) > limit:
                    self.cut += 1
                    break
                sink.sendall(data)
                moved += len(data)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                with suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()

    def close(self) -> None:
        self.stopped = True
        self.listener.close()


def test_cut_connections_are_retried_and_each_round_counts_once(live_server, caplog) -> None:
    """Each retry is logged, and so is the answer that ends them: the server is back."""
    caplog.set_level("WARNING", logger="diloco.worker")
    settings = ServerSettings(sync_every=2, outer_optimizer="sgd", outer_lr=1.0)
    with live_server(settings) as server:
        proxy = FlakyProxy(int(server.url.rsplit(":", 1)[1]))
        try:
            torch.manual_seed(0)
            model = torch.nn.Linear(64, 256)  # ~66 KB of fp32: every upload exceeds the cut
            optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
            worker = DiLoCoWorker(
                model,
                optimizer,
                f"http://127.0.0.1:{proxy.port}",
                worker_id="flaky",
                heartbeat=False,
            )
            generator = torch.Generator().manual_seed(3)
            for _ in range(6):
                model(torch.randn(4, 64, generator=generator)).pow(2).mean().backward()
                optimizer.step()
                optimizer.zero_grad()
            assert worker.rounds == 3
            assert proxy.cut >= 1 and worker.stats()["retries"] >= 1
            retried = [m for m in caplog.messages if "; retrying in " in m]
            back = [m for m in caplog.messages if "the server answered again" in m]
            assert retried and back, caplog.messages
            operation = retried[0].split(":")[0]  # upload_initial or submit: ~66 KB bodies
            assert re.fullmatch(
                rf"{operation}: the server answered again after \d+ retr(y|ies) in \d+\.\d s",
                back[0],
            ), caplog.messages
            assert server.coordinator.membership.workers["flaky"].rounds_contributed == 3
            assert server.coordinator.round_number == 3
            weights = server_weights(server.url)
            for name, tensor in model.state_dict().items():
                torch.testing.assert_close(weights[name], tensor, rtol=0, atol=1e-7)
            worker.close(final_sync=False)
        finally:
            proxy.close()


def test_a_worker_held_by_min_workers_says_why(live_server, caplog) -> None:
    """Alone under --min-workers 2, the worker's wait is logged with the server's reason
    (never silent), once until a minute has passed; a second worker's submission then
    releases it."""
    caplog.set_level("WARNING", logger="diloco.worker")
    with live_server(ServerSettings(sync_every=2, min_workers=2)) as server:
        models = [make_model(), make_model()]
        optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
        first = DiLoCoWorker(
            models[0], optimizers[0], server.url, worker_id="a", wait_report_after=1.0
        )
        trainer = threading.Thread(target=train, args=(models[0], optimizers[0], 2))
        trainer.start()
        deadline = time.monotonic() + 30
        while "still open" not in caplog.text:
            assert time.monotonic() < deadline, caplog.text
            time.sleep(0.05)
        time.sleep(0.5)  # the long-poll goes on: no second line before a minute
        [line] = caplog.messages
        assert re.fullmatch(
            r"round 0 still open after \d+ s, waiting for: 1 more submission \(--min-workers\);"
            r" the round commits once more workers join and submit",
            line,
        )
        assert first.rounds == 0 and trainer.is_alive()
        second = DiLoCoWorker(models[1], optimizers[1], server.url, worker_id="b")
        train(models[1], optimizers[1], 2, seed=2)
        trainer.join(timeout=30)
        assert not trainer.is_alive() and first.rounds == 1 and second.rounds == 1
        assert server.coordinator.round_number == 1
        first.close(final_sync=False)
        second.close(final_sync=False)


def test_a_round_s_blocked_time_is_split_into_its_phases(live_server) -> None:
    """The phases add up to the blocked time (what is not encode, upload, wait, download or
    apply is `other`), none is negative, and the download read the result's bytes."""
    with live_server(ServerSettings(sync_every=2)) as server:
        model = make_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        worker = DiLoCoWorker(model, optimizer, server.url, heartbeat=False)
        assert worker.last_round_phases is None
        received = worker.client.stats.bytes_received
        train(model, optimizer, steps=2)
        phases = worker.last_round_phases
        assert phases is not None
        parts = ("encode", "upload", "wait", "download", "apply", "other")
        assert set(phases) == {"blocked", "save", *parts}
        assert all(phases[name] >= 0 for name in phases), phases
        assert sum(phases[name] for name in parts) == pytest.approx(phases["blocked"], abs=1e-3)
        assert phases["upload"] > 0 and phases["download"] > 0 and phases["encode"] > 0
        assert worker.client.stats.bytes_received > received
        worker.close(final_sync=False)


def test_a_coded_delta_s_apply_counts_as_apply_not_other(live_server, monkeypatch) -> None:
    """With --download-codec int8 the result is a delta applied onto the anchor: its time is
    the round's `apply` (it was `other`, 0.55-0.75 s of an 85M int8 round, unexplained)."""
    from diloco.worker.anchor import Anchor

    applying = Anchor.values_after

    def slow_apply(self, *args, **kwargs):
        time.sleep(0.3)
        return applying(self, *args, **kwargs)

    monkeypatch.setattr(Anchor, "values_after", slow_apply)
    settings = ServerSettings(sync_every=2, upload_codec="int8", download_codec="int8")
    with live_server(settings) as server:
        model = make_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        worker = DiLoCoWorker(model, optimizer, server.url, heartbeat=False)
        train(model, optimizer, steps=2)
        phases = worker.last_round_phases
        assert phases is not None
        assert phases["apply"] >= 0.3 and phases["other"] < 0.3, phases
        worker.close(final_sync=False)


def test_the_fp32_body_is_computed_into_one_buffer_kept_across_rounds(live_server) -> None:
    """anchor - local is written straight into the upload body: the same bytes as encoding
    the pseudo-gradient, in the same buffer every round."""
    with live_server(ServerSettings(sync_every=2)) as server:
        model = make_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        worker = DiLoCoWorker(model, optimizer, server.url, heartbeat=False)
        buffers = set()
        for round_number in range(1, 4):
            train(model, optimizer, steps=1, seed=round_number)
            expected = encode_tensors(pseudo_gradient(worker.anchor, model.state_dict()))
            body = worker._uploads.plain_body(worker.anchor, model.state_dict())
            assert body == expected
            buffers.add(id(body))
            train(model, optimizer, steps=1, seed=10 + round_number)  # the round's sync
            assert worker.rounds == round_number
        assert len(buffers) == 1
        worker.close(final_sync=False)


@contextmanager
def server_on(
    settings: ServerSettings, state: Path, port: int = 0
) -> Iterator[tuple[str, Coordinator, int]]:
    """A server on `state` (a restart keeps the same `port`), shut down as on SIGTERM: its
    URL, coordinator and port."""
    journal = RoundJournal(StateStore(state), settings)
    coordinator = Coordinator(settings, None, journal=journal)
    server = build_server(coordinator, "127.0.0.1", port, None, log_level="warning")
    thread = threading.Thread(target=server.run, name="test-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while server.bound_port is None:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{server.bound_port}", coordinator, server.bound_port
    finally:
        server.should_exit = True
        thread.join(timeout=15)


def test_a_lost_fp32_upload_is_built_again_and_sent(tmp_path, caplog) -> None:
    """fp32 both ways, where the result comes back into the upload's own buffer: a server
    restarted while the round waited for its second worker has lost our upload and asks for
    it again (not_submitted); anchor - local is built again and sent, and the round's weights
    are the mean of both workers' local models (outer SGD at lr 1), as if nothing happened."""
    settings = ServerSettings(
        sync_every=2, min_workers=2, outer_optimizer="sgd", outer_lr=1.0, heartbeat_timeout=60
    )
    state = tmp_path / "state"
    model_a, model_b = make_model(), make_model()
    opt_a = torch.optim.SGD(model_a.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(model_b.parameters(), lr=0.1)
    initial = {n: t.clone() for n, t in model_a.state_dict().items()}
    # what each trains in its round, by hand: the same steps from the same start
    expected_a, expected_b = make_model(), make_model()
    train(expected_a, torch.optim.SGD(expected_a.parameters(), lr=0.1), steps=2, seed=5)
    train(expected_b, torch.optim.SGD(expected_b.parameters(), lr=0.1), steps=2, seed=6)
    with server_on(settings, state) as (url, first, port):
        a = DiLoCoWorker(model_a, opt_a, url, worker_id="a", heartbeat=False)
        b = DiLoCoWorker(model_b, opt_b, url, worker_id="b", heartbeat=False)
        training = threading.Thread(target=train, args=(model_a, opt_a, 2, 1, 5))
        training.start()  # its second step submits and waits for b
        deadline = time.monotonic() + 30
        while first.status()["waiting_for"] != ["b"]:
            assert time.monotonic() < deadline, first.status()
            time.sleep(0.02)
    with caplog.at_level("WARNING"), server_on(settings, state, port) as (_, second, _):
        train(model_b, opt_b, steps=2, seed=6)
        training.join(timeout=60)
        assert not training.is_alive()
        assert "round 0 lost our submission; sending it again" in caplog.text
        assert a.rounds == b.rounds == 1 and second.round_number == 1
        for name, start in initial.items():
            mean = (expected_a.state_dict()[name] + expected_b.state_dict()[name]) / 2
            torch.testing.assert_close(model_a.state_dict()[name], mean)
            torch.testing.assert_close(model_b.state_dict()[name], mean)
            assert not torch.equal(mean, start)
        assert a._download is a._uploads._plain_buffer[1]
        a.close(final_sync=False)
        b.close(final_sync=False)
