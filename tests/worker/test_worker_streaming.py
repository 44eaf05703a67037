"""DiLoCoWorker in streaming and async mode against a real server on 127.0.0.1."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from test_worker_worker import make_model, record_submits, server_weights, train

from diloco.algorithm import alpha_merge
from diloco.data import VOCAB_SIZE, TokenWindows, encode, generated_corpus
from diloco.server.model.results import RoundResult
from diloco.server.settings import ServerSettings
from diloco.wire import decode_tensors
from diloco.worker import DiLoCoWorker
from diloco.worker.data.leased_sampler import LeasedBatches, LeasedSampler
from diloco.worker.net.ratelimit import UploadLimiter
from diloco.worker.schedule import start_position

STREAMING = dict(
    mode="streaming",
    sync_every=4,
    fragments=2,
    delay=1,
    alpha=0.5,
    heartbeat_interval=0.5,
    heartbeat_timeout=60,
)


def snapshot(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in tensors.items()}


def test_start_position_follows_the_fragment_rounds() -> None:
    # H = 600, P = 3 (S = 200): fresh; fragment 1's window is next in cycle 4; all even.
    assert start_position([0, 0, 0], 600, 3) == 0
    assert start_position([5, 4, 4], 600, 3) == 4 * 600 + 200
    assert start_position([5, 5, 5], 600, 3) == 5 * 600


def test_a_failed_fragment_sync_keeps_its_anchor_and_is_sent_again(live_server) -> None:
    """With a second worker missing, fragment syncs time out: the worker keeps its anchors,
    its fragment rounds and its local values and trains on; once the peer is there, the
    same fragment rounds are sent again and complete."""
    settings = ServerSettings(**STREAMING, min_workers=2)
    with live_server(settings) as server:
        model = make_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        a = DiLoCoWorker(
            model, optimizer, server.url, worker_id="a", fragment_timeout=0.3, result_wait=0.2
        )
        assert a.streamer is not None and a.streamer.plan == server.coordinator.plan
        initial = snapshot(a.anchor)
        train(model, optimizer, steps=4)  # sends at 1 and 3, both merges give up
        assert (a.streamer.failures, a.streamer.syncs) == (2, 0)
        assert a.streamer.fragment_rounds == [0, 0]
        for name, tensor in initial.items():
            torch.testing.assert_close(a.anchor[name], tensor, rtol=0, atol=0)  # old anchors
        assert server.coordinator.info()["fragment_rounds"] == [0, 0]

        # The peer arrives; a resends each fragment round at its next window.
        a.streamer.fragment_timeout = 60
        peer_model = make_model()
        peer_optimizer = torch.optim.SGD(peer_model.parameters(), lr=0.05)
        b = DiLoCoWorker(peer_model, peer_optimizer, server.url, worker_id="b")
        assert b.streamer is not None and b.streamer.step == 0
        peer = threading.Thread(target=train, args=(peer_model, peer_optimizer, 4, 1, 7))
        peer.start()
        train(model, optimizer, steps=4, seed=3)
        peer.join(timeout=60)
        assert a.streamer.fragment_rounds == [1, 1] == b.streamer.fragment_rounds
        assert (a.streamer.failures, a.streamer.syncs) == (2, 2)
        assert server.coordinator.info()["fragment_rounds"] == [1, 1]
        global_now = server_weights(server.url)
        for name, tensor in a.anchor.items():
            torch.testing.assert_close(tensor, global_now[name])  # both anchors are G' now
        a.close(final_sync=False)
        b.close(final_sync=False)


@pytest.mark.parametrize("alpha", [0.5, 0.0])
def test_a_merge_mixes_the_global_fragment_with_the_local_values(live_server, alpha) -> None:
    """tau = 1, one worker: at the merge step theta_f = (1 - alpha) G'_f + alpha L_f (alpha
    0.5: their mean; 0: G'_f exactly, copied), with L_f the local values one step after the
    send; the other fragment is left local."""
    with live_server(ServerSettings(**{**STREAMING, "alpha": alpha})) as server:
        model = make_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        worker = DiLoCoWorker(model, optimizer, server.url, worker_id="solo")
        assert worker.streamer is not None
        fragment_0 = worker.streamer.plan[0]
        train(model, optimizer, steps=1)  # step 1 sends fragment 0 in the background
        got = server.coordinator.wait_result(0, None, 30, fragment=0)
        assert isinstance(got, RoundResult) and got.round == 1
        global_fragment = decode_tensors(got.body)
        assert set(global_fragment) == set(fragment_0)
        # Step 2, by hand, so the local values right before the merge are known.
        generator = torch.Generator().manual_seed(11)
        model(torch.randn(8, 4, generator=generator)).pow(2).mean().backward()
        with torch.no_grad():
            for parameter in model.parameters():
                parameter -= 0.05 * parameter.grad
        local = snapshot(model.state_dict())
        worker._hook.remove()
        worker._after_step()  # the post-step hook of step 2: the merge
        expected = alpha_merge(global_fragment, local, alpha)
        state = model.state_dict()
        for name in fragment_0:
            torch.testing.assert_close(state[name], expected[name])
            if alpha == 0.0:  # the global values, bit for bit (the signs of zeros too)
                sent = global_fragment[name].to(state[name].dtype)
                assert torch.equal(state[name].view(torch.int32), sent.view(torch.int32))
            torch.testing.assert_close(worker.anchor[name], global_fragment[name])
        for name in worker.streamer.plan[1]:
            torch.testing.assert_close(state[name], local[name], rtol=0, atol=0)
        worker.close(final_sync=False)


def test_the_upload_limiter_paces_slices_to_the_rate() -> None:
    now = [0.0]
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        now[0] += seconds

    limiter = UploadLimiter(1_000_000, clock=lambda: now[0], sleep=sleep)  # 1 MB/s
    pieces = list(limiter.paced(bytearray(200_000)))
    assert sum(p.nbytes for p in pieces) == 200_000 and len(pieces) == 4  # 64 KiB slices
    # The first slice goes at once, each next one when the ones before had time to go out.
    assert slept == pytest.approx([0.065536] * 3) and now[0] == pytest.approx(0.196608)
    with pytest.raises(ValueError, match="upload rate must be > 0"):
        UploadLimiter.from_mbps(0)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"fragment_timeout": 0}, "fragment_timeout must be > 0 seconds, got 0"),
        ({"fragment_timeout": float("nan")}, "fragment_timeout must be > 0 seconds, got nan"),
        ({"max_upload_mbps": -8}, r"> 0 megabits per second \(max_upload_mbps\), got -8"),
        # (it was refused only at the first sync, after a whole round of training)
        ({"result_wait": 300}, r"result_wait must be in \(0, 120\] seconds .*, got 300"),
        ({"result_wait": 0}, r"result_wait must be in \(0, 120\] seconds .*, got 0"),
        ({"result_wait": True}, r"result_wait must be .*, got True"),
        ({"anchor_device": "gpu"}, r"anchor_device must be 'auto', 'cpu' or a device name .*'gpu'"),
        ({"anchor_device": 3}, r"anchor_device must be 'auto', 'cpu' or a device name .*got 3"),
        *(
            []
            if torch.cuda.is_available()
            else [({"anchor_device": "cuda"}, "anchor_device 'cuda': this machine has no CUDA")]
        ),
    ],
)
def test_bad_worker_arguments_are_refused_before_any_request(arguments: dict, message: str) -> None:
    """Nothing listens at the URL: the refusal must come before the first request."""
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match=message):
        DiLoCoWorker(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            "http://127.0.0.1:9",
            heartbeat=False,
            **arguments,
        )


def test_a_throttled_worker_uploads_no_faster_than_its_cap(live_server) -> None:
    """--max-upload-mbps 8 (1 MB/s): a 0.5 MB pseudo-gradient takes at least ~0.45 s."""
    with live_server(ServerSettings(mode="async", sync_every=1)) as server:
        model = torch.nn.Sequential(torch.nn.Linear(4, 512), torch.nn.Linear(512, 256))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        worker = DiLoCoWorker(
            model, optimizer, server.url, worker_id="slow-link", max_upload_mbps=8.0
        )
        train(model, optimizer, steps=1)  # H = 1: one async arrival
        assert worker.rounds == 1 and server.coordinator.version == 1
        seconds = worker.client.stats.blocked_by_operation["submit"]
        megabytes = sum(t.numel() * 4 for t in model.state_dict().values()) / 1e6
        assert megabytes > 0.5 and seconds >= 0.9 * megabytes
        worker.close(final_sync=False)


def test_streaming_reports_a_work_unit_once_every_fragment_has_synced_since(live_server) -> None:
    """A unit's samples shaped every fragment, so it counts as trained once each fragment has
    synced after it finished: it goes with the submission that completes that set, and it
    completes in the same transaction as that fragment round's commit."""
    settings = ServerSettings(**{**STREAMING, "delay": 0, "alpha": 0.0})
    windows = TokenWindows(encode(generated_corpus(num_bytes=20_000, seed=5)), 16)
    with live_server(settings) as server:
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Embedding(VOCAB_SIZE, 8), torch.nn.Linear(8, VOCAB_SIZE)
        )
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        worker = DiLoCoWorker(model, optimizer, server.url, worker_id="unit", heartbeat=False)
        leased = LeasedSampler.for_worker(worker, "windows", len(windows), unit_size=16)
        batches = LeasedBatches(windows, leased, batch_size=8)  # a unit every 2 steps
        for _ in range(8):  # fragments sync at 2 (f0), 4 (f1), 6 (f0), 8 (f1)
            x, y = batches.next_batch()
            loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        worker.close()  # the flush syncs fragment 0 (trained since step 6) once more
        completions = server.coordinator.pool.completions("windows")
        # Unit 1 finished by step 2: f0 synced then, f1 at 4 completes it (version 1), ...
        assert [(u["unit_id"], u["round"]) for u in completions] == [
            (1, 1),
            (2, 2),
            (3, 3),
            (4, 4),
        ]
        rounds = server.coordinator.journal.state.committed_rounds()
        assert [(r["fragment"], r["units"]) for r in rounds] == [
            (0, []),
            (1, [1]),
            (0, [2]),
            (1, [3]),
            (0, [4]),
        ]


def test_tied_tensors_are_refused_in_streaming_mode() -> None:
    from diloco.worker.worker import _refuse_tied_tensors

    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(4, 2)
            self.head = torch.nn.Linear(2, 4, bias=False)
            self.head.weight = self.embed.weight

    with pytest.raises(ValueError, match=r"tied tensors \(embed.weight, head.weight share"):
        _refuse_tied_tensors(Tied())
    _refuse_tied_tensors(torch.nn.Linear(2, 2))  # untied: nothing to say


def test_a_gpu_out_of_memory_coding_a_fragment_moves_the_anchor_to_the_cpu_and_goes_on(
    live_server, caplog, monkeypatch
) -> None:
    """Streaming int8 with error feedback, one worker: the first fragment's coding runs out
    of GPU memory halfway; the anchor and residual move to the CPU, the fragment is coded
    again, and after a whole cycle the worker holds exactly what a worker that never ran
    out holds (weights, residual, fragment rounds)."""
    import diloco.worker.anchor as anchors

    real_update = anchors.updated_anchor  # a "cuda" anchor's tensors stay on this CPU
    monkeypatch.setattr(
        anchors, "updated_anchor", lambda anchor, tensors, _device: real_update(anchor, tensors)
    )
    settings = ServerSettings(
        **{**STREAMING, "alpha": 0.0}, upload_codec="int8", error_feedback_beta=0.9
    )
    ended = []
    for inject in (False, True):
        with live_server(settings) as server:
            model = make_model()
            optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
            worker = DiLoCoWorker(model, optimizer, server.url, worker_id="solo")
            worker._anchor.device = torch.device("cuda")  # as on a GPU
            failed = []
            real = worker._uploads.body_from

            def out_of_memory(*args, real=real, failed=failed, **kwargs):
                if not failed:
                    failed.append(real(*args, **kwargs))  # its residuals half written
                    raise torch.OutOfMemoryError("CUDA out of memory (injected)")
                return real(*args, **kwargs)

            if inject:
                worker._uploads.body_from = out_of_memory
            train(model, optimizer, steps=8)  # two cycles of H = 4
            worker.streamer.flush()
            ended.append(
                (
                    snapshot(model.state_dict()),
                    snapshot(worker._uploads.residual),
                    list(worker.streamer.fragment_rounds),
                    worker._anchor.device.type,
                )
            )
            assert failed or not inject
            worker.close(final_sync=False)
    (weights, residual, rounds, device), (weights_2, residual_2, rounds_2, device_2) = ended
    assert device == "cuda" and device_2 == "cpu"
    assert rounds == rounds_2 and rounds[0] >= 2
    assert all(torch.equal(weights[n], weights_2[n]) for n in weights)
    assert residual.keys() == residual_2.keys() and residual
    assert all(torch.equal(residual[n], residual_2[n]) for n in residual)
    assert any("ran out of memory in a sync" in r.getMessage() for r in caplog.records)


def test_a_fragment_s_body_is_coded_beside_the_next_steps_from_the_values_at_its_send(
    live_server, monkeypatch
) -> None:
    """With error feedback on a CPU anchor a send takes the fragment's e' = beta e + g on the
    training thread and codes the body on the fragment's thread, while training goes on. A
    coding held back until the next step has run (so the model's values have moved) ends
    the cycle exactly where a prompt one does: weights, residual and fragment rounds."""
    from diloco.worker.upload_coder import UploadCoder

    settings = ServerSettings(
        **{**STREAMING, "alpha": 0.0}, upload_codec="int8", error_feedback_beta=0.9
    )
    real = UploadCoder._accumulate_snapshots  # the coding thread's first work
    ended, overlapped = [], []
    for hold in (False, True):
        with live_server(settings) as server:
            model = make_model()
            optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
            worker = DiLoCoWorker(model, optimizer, server.url, worker_id="solo")

            holding = [hold]  # (not in the flush: its merge follows its send at once)

            def held(self, *args, holding=holding, worker=worker, **kwargs):
                if holding[0] and threading.current_thread().name.startswith("diloco-fragment"):
                    at, deadline = worker.local_step, time.monotonic() + 10
                    while worker.local_step == at and time.monotonic() < deadline:
                        time.sleep(0.01)  # the next step moves the model's values first
                    overlapped.append(worker.local_step > at)
                return real(self, *args, **kwargs)

            monkeypatch.setattr(UploadCoder, "_accumulate_snapshots", held)
            train(model, optimizer, steps=8)  # two cycles of H = 4: each fragment twice
            holding[0] = False
            worker.streamer.flush()
            stats = worker.stats()
            ended.append(
                (
                    snapshot(model.state_dict()),
                    snapshot(worker._uploads.residual),
                    list(worker.streamer.fragment_rounds),
                )
            )
            assert stats["background_coding_seconds"] > 0
            worker.close(final_sync=False)
    (weights, residual, rounds), (weights_2, residual_2, rounds_2) = ended
    assert rounds == rounds_2 and rounds[0] >= 2
    assert all(torch.equal(weights[n], weights_2[n]) for n in weights)
    assert residual.keys() == residual_2.keys() and residual
    assert all(torch.equal(residual[n], residual_2[n]) for n in residual)
    assert overlapped == [True] * 4  # each body of the two cycles coded after a step ran


def test_a_merge_that_gives_up_on_a_body_still_coding_never_sends_it(
    live_server, monkeypatch
) -> None:
    """The fragment's timeout ends a merge while its body is still being coded on the sync's
    thread: the merge waits for the coding, then the body is never submitted, the residual
    is as it was (nothing sent), and the fragment goes again at its next window."""
    from diloco.worker.net.client import DiLoCoClient
    from diloco.worker.upload_coder import UploadCoder

    settings = ServerSettings(**STREAMING, upload_codec="int8", error_feedback_beta=0.9)
    real_code, real_submit = UploadCoder._compressed, DiLoCoClient.submit
    submitted, slowed = [], []

    def slow(self, *args, **kwargs):
        if not slowed and threading.current_thread().name.startswith("diloco-fragment"):
            slowed.append(True)
            time.sleep(1.0)  # past the merge's 0.3 s
        return real_code(self, *args, **kwargs)

    def submit(self, round, worker_id, body, **kwargs):
        submitted.append((kwargs.get("fragment", 0), round))
        return real_submit(self, round, worker_id, body, **kwargs)

    monkeypatch.setattr(UploadCoder, "_compressed", slow)
    monkeypatch.setattr(DiLoCoClient, "submit", submit)
    with live_server(settings) as server:
        model = make_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        worker = DiLoCoWorker(model, optimizer, server.url, worker_id="solo")
        worker.streamer.fragment_timeout = 0.3
        started = time.monotonic()
        train(model, optimizer, steps=2)  # fragment 0 sent at step 1, given up at step 2
        assert time.monotonic() - started >= 1.0  # the merge waited for the coding
        time.sleep(0.5)  # (the sync's thread ends: it must not submit)
        assert (worker.streamer.failures, worker.streamer.syncs) == (1, 0)
        assert submitted == [] and worker._uploads.residual == {}
        assert server.coordinator.info()["fragment_rounds"] == [0, 0]
        train(model, optimizer, steps=4, seed=2)  # fragment 0 goes again, then 1
        assert worker.streamer.fragment_rounds == [1, 1]
        assert submitted == [(1, 0), (0, 0)]  # fragment 1's window, then 0's again
        worker.close(final_sync=False)


def test_a_streaming_worker_s_blocked_time_counts_its_sends_and_merges_as_a_sync_does(
    live_server, monkeypatch
) -> None:
    """A send's coding on the training thread and a merge (its wait for the sync, then the
    mix) are time the training gives its syncs, as a sync round's encode, wait and apply
    are: both count as blocked, each once, and `merge_wait_seconds` is the merges' waits."""
    from diloco.worker.session import ServerSession
    from diloco.worker.upload_coder import UploadCoder

    real_body, real_exchange = UploadCoder.body_from, ServerSession.exchange

    def slow_body(self, *args, **kwargs):  # int8 without error feedback codes at the send
        time.sleep(0.25)
        return real_body(self, *args, **kwargs)

    def slow_exchange(self, *args, **kwargs):  # on the sync's thread: the merge waits
        time.sleep(0.4)
        return real_exchange(self, *args, **kwargs)

    monkeypatch.setattr(UploadCoder, "body_from", slow_body)
    monkeypatch.setattr(ServerSession, "exchange", slow_exchange)
    settings = ServerSettings(**STREAMING, upload_codec="int8")
    with live_server(settings) as server:
        model = make_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        worker = DiLoCoWorker(model, optimizer, server.url, worker_id="solo")
        train(model, optimizer, steps=4)  # one cycle: two sends, two merges
        streamer = worker.streamer
        assert streamer.syncs == 2
        assert 0.8 - 0.1 <= streamer.merge_wait_seconds < 0.8 + 0.5  # 0.4 s each, nearly
        rest = worker.blocked_seconds - streamer.merge_wait_seconds
        assert 0.5 <= rest < 0.5 + 0.2  # the two slowed sends, once, and two small mixes
        assert streamer.coding_seconds < 0.1  # nothing was coded on the syncs' threads
        split = streamer.blocked_split()  # each part on its own, adding up to the whole
        assert 0.5 <= split["send"] < 0.5 + 0.1  # the two slowed sends
        assert split["wait"] == streamer.merge_wait_seconds
        assert 0.0 <= split["mix"] < 0.1
        assert sum(split.values()) == pytest.approx(worker.blocked_seconds, abs=1e-3)
        (cycle,) = worker.stats()["round_figures"]  # the cycle's line carries its split
        assert cycle["phases"] == pytest.approx(split)
        assert cycle["blocked_seconds"] == pytest.approx(worker.blocked_seconds)
        worker.close(final_sync=False)


def test_a_streaming_worker_keeps_no_copy_of_the_join_s_weights(live_server) -> None:
    """Streaming reads every fragment's result into a buffer of its own, so the whole-model
    buffer the join's weights came in is let go (it was kept for good: 1x the model), and
    fragment results are never kept after their merge."""
    with live_server(ServerSettings(**STREAMING)) as server:
        model = make_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        worker = DiLoCoWorker(model, optimizer, server.url, worker_id="solo")
        assert worker._download is None
        train(model, optimizer, steps=8)  # two cycles: every fragment merged twice
        assert worker.streamer is not None and worker.streamer.syncs >= 3
        assert worker._download is None
        worker.close(final_sync=False)


@pytest.mark.parametrize("fragments", [2, 1])
def test_a_merge_copies_a_coded_download_s_values_into_the_fragment_s_anchor(
    live_server, monkeypatch, fragments: int
) -> None:
    """With an int8 delta download the sync's thread computes G'_f in copies of the anchor
    (`Anchor.values_after`), never in the anchor itself: it runs beside training and a merge
    may give up on it. With one fragment of every tensor it once moved the anchor in place,
    as a sync round does on the training thread. The merge copies the values into the
    anchor's own tensors (which stay the same objects), and the anchor is then the server's
    published weights bit for bit."""
    from diloco.worker.anchor import Anchor

    made: list[dict[str, torch.Tensor]] = []
    real = Anchor.values_after

    def recorded(self, *args, **kwargs):
        values = real(self, *args, **kwargs)
        made.append(dict(values))
        return values

    monkeypatch.setattr(Anchor, "values_after", recorded)
    settings = ServerSettings(
        **{**STREAMING, "fragments": fragments, "alpha": 0.0},
        upload_codec="int8",
        download_codec="int8",
    )
    with live_server(settings) as server:
        model = make_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        worker = DiLoCoWorker(model, optimizer, server.url, worker_id="solo")
        own = dict(worker._anchor.tensors)
        train(model, optimizer, steps=4 * (3 - fragments))  # two merges
        assert worker.streamer.syncs == 2 and len(made) == 2
        assert set().union(*made) == set(own)  # every tensor's values came as copies
        anchor = worker._anchor.tensors
        assert all(anchor[name] is tensor for name, tensor in own.items())  # its own memory
        latest: dict[str, torch.Tensor] = {}
        for values in made:
            assert all(t.data_ptr() != own[n].data_ptr() for n, t in values.items())
            latest.update(values)
        # each tensor's last values, copied in as they were made
        assert all(torch.equal(anchor[name], tensor) for name, tensor in latest.items())
        published = server_weights(server.url)
        for name, tensor in anchor.items():
            assert torch.equal(tensor.view(torch.int32), published[name].view(torch.int32))
        worker.close(final_sync=False)


def test_a_refused_fragment_delta_takes_the_server_s_weights_and_training_goes_on(
    live_server, monkeypatch, caplog
) -> None:
    """A fragment's coded delta that the worker refuses (a block it cannot decode) is not the
    end of the run: the fragment's values come from the server's whole weights instead, the
    merge counts, and the anchor ends equal to the server's published weights."""
    import diloco.worker.anchor as anchor_module
    from diloco.wire import WireError

    real = anchor_module.apply_delta
    calls = {"n": 0}

    def refuses_the_first(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise WireError(422, "invalid_body", "tensor 'weight': a block's scale is NaN")
        return real(*args, **kwargs)

    monkeypatch.setattr(anchor_module, "apply_delta", refuses_the_first)
    settings = ServerSettings(
        **{**STREAMING, "alpha": 0.0}, upload_codec="int8", download_codec="int8"
    )
    with live_server(settings) as server:
        model = make_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        worker = DiLoCoWorker(model, optimizer, server.url, worker_id="solo")
        with caplog.at_level("WARNING", logger="diloco.worker"):
            train(model, optimizer, steps=4)  # one cycle: both fragments merged
        assert calls["n"] == 2
        assert worker.streamer.syncs == 2 and worker.streamer.failures == 0
        assert any(
            "for fragment 0 was refused" in r.getMessage() and "whole weights" in r.getMessage()
            for r in caplog.records
        )
        published = server_weights(server.url)
        for name, tensor in worker._anchor.tensors.items():
            assert torch.equal(tensor.view(torch.int32), published[name].view(torch.int32))
        worker.close(final_sync=False)


def test_a_merge_that_gives_up_after_the_server_took_the_body_keeps_its_residual(
    live_server,
) -> None:
    """Top-k with error feedback, a second worker missing: each fragment's body is taken
    ("accepted") but its round cannot commit, so the merges give up. The bodies are in their
    rounds, so their residuals stand (before, they were dropped as if never used). Once the
    peer is there the same rounds are sent again with other bodies, answered "duplicate":
    those are the first bodies, so the new bodies' residuals are not taken either."""
    settings = ServerSettings(
        **STREAMING, min_workers=2, upload_codec="topk:0.25", topk_chunk=4,
        error_feedback_beta=0.9,
    )  # fmt: skip
    with live_server(settings) as server:
        model = make_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        a = DiLoCoWorker(
            model, optimizer, server.url, worker_id="a", fragment_timeout=1.0, result_wait=0.2
        )
        # sends at 1 and 3, both answered at once; both merges give up a second later
        train(model, optimizer, steps=4)
        assert (a.streamer.failures, a.streamer.syncs) == (2, 0)
        assert a.streamer.folded_rounds == {0: 0, 1: 0}
        trained = {name for name, p in model.named_parameters()}
        taken = snapshot(a._uploads.residual)
        assert set(taken) == trained and all(t.count_nonzero() > 0 for t in taken.values())

        answers = record_submits(a)
        a.streamer.fragment_timeout = 60
        peer_model = make_model()
        peer_optimizer = torch.optim.SGD(peer_model.parameters(), lr=0.05)
        b = DiLoCoWorker(peer_model, peer_optimizer, server.url, worker_id="b")
        peer = threading.Thread(target=train, args=(peer_model, peer_optimizer, 4, 1, 7))
        peer.start()
        train(model, optimizer, steps=4, seed=3)
        peer.join(timeout=60)
        assert answers == [" duplicate", " duplicate"]
        assert a.streamer.fragment_rounds == [1, 1] and a.streamer.syncs == 2
        assert a.streamer.folded_rounds == {}
        residual = a._uploads.residual
        assert set(residual) == trained
        for name, tensor in taken.items():
            assert torch.equal(residual[name], tensor), name
        a.close(final_sync=False)
        b.close(final_sync=False)
