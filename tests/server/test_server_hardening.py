"""Defects an outside test found, each checked where a user meets it: raw HTTP (urllib3, never
our client) to a real `diloco server` process where a restart, a state dir, an injected fault or
the server's log is part of the defect, else to the same app on real uvicorn in a thread of the
test process (`in_thread`: no interpreter start per test, issue 26 item 5); expected values
computed by hand here."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from test_server_http import SHAPES, Api, check_error, gradient, registration

from diloco.server.settings import ServerSettings
from diloco.wire import decode_tensors
from processes import run_cli_in_process


def init_file(tmp_path: Path, value: float = 0.0) -> Path:
    path = tmp_path / "init.safetensors"
    save_file({name: torch.full(shape, value) for name, shape in SHAPES.items()}, str(path))
    return path


@pytest.fixture
def in_thread(live_server) -> Iterator[Callable[..., Api]]:
    """`in_thread(value, setting=...)`: what `diloco server --init (all `value`) --setting ...`
    serves, on a real uvicorn in a thread of this process (the same app and HTTP protocol;
    ServerSettings resolves what the options leave out as the command does); it stops after
    the test."""
    with ExitStack() as servers:

        def start(value: float = 0.0, **settings: object) -> Api:
            initial = {name: torch.full(shape, value) for name, shape in SHAPES.items()}
            server = servers.enter_context(live_server(ServerSettings(**settings), initial))
            return Api(server.url)

        yield start


def weights_of(api: Api) -> tuple[int, dict[str, torch.Tensor]]:
    response = api.call("GET", "/v1/weights")
    assert response.status == 200, response.data[:300]
    return int(response.headers["X-Diloco-Round"]), decode_tensors(response.data)


def test_delayed_nesterov_n4_cycle_applies_one_momentum_step_over_http(in_thread):
    """--dn-period 4 --dn-c 0.1, lr 1, beta 0.9, g = 1 per arrival from theta 0: by hand
    (tests/algorithm/test_algo_delayed_nesterov.py) -1.63 after 4 arrivals, -4.097 after 8;
    the (1 - c) reading of the c term gave -1.81 after 4."""
    api = in_thread(0.0, mode="async", dn_period=4, dn_c=0.1, outer_lr=1.0)
    api.register("a")
    seen = {}
    for version in range(8):
        response = api.submit("a", gradient(1.0), round_number=version)
        assert response.status == 200, response.data[:300]
        round_number, weights = weights_of(api)
        assert round_number == version + 1
        assert torch.all(weights["layer.weight"] == weights["layer.weight"].flatten()[0])
        seen[version + 1] = weights["layer.bias"][0].item()
    assert seen[4] == pytest.approx(-1.63, abs=1e-5)
    assert seen[8] == pytest.approx(-4.097, abs=1e-5)


def test_dn_c_over_its_bound_is_one_error_line():
    """The command in this process (a bad option's one line from a real process: the
    one-process case of tests/server/test_server_http_cli.py)."""
    result = run_cli_in_process(
        "server", "--mode", "async", "--dn-period", "8", "--dn-c", "0.2", "--port", "0"
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    assert "c must be in [0, 1/(N - 1)]" in lines[0]
    assert "Traceback" not in result.stderr


def test_token_weighting_refuses_a_submission_without_tokens(in_thread):
    """It would weigh 0: with every worker like it the model never moved, silently."""
    api = in_thread(10.0, weighting="tokens", outer_optimizer="sgd", outer_lr=1.0)
    api.register("a")
    before = api.snapshot()
    for query in ("", "&tokens=0"):
        error = api.rejects(api.submit("a", gradient(-2.0), query=query), 422, "tokens_required")
        assert error["detail"] == {"field": "tokens", "got": 0}
        assert "--weighting tokens" in error["error"]
    assert api.snapshot() == before
    assert api.submit("a", gradient(-2.0), query="&tokens=5").status == 200
    round_number, weights = weights_of(api)
    assert round_number == 1 and torch.all(weights["layer.weight"] == 12.0)


def test_integers_past_int64_are_refused_and_a_restart_still_works(server_process, tmp_path):
    """`tokens=2**63` once passed the query check, overflowed SQLite after the checkpoint was
    written, and left a state dir that could not be restarted. Every count is now bounded
    (2**48) at the door, and the largest allowed values commit and restart."""
    state = tmp_path / "state"
    args = ("--weighting", "tokens", "--outer-optimizer", "sgd", "--outer-lr", "1",
            "--state-dir", str(state))  # fmt: skip
    server = server_process(*args, "--init", str(init_file(tmp_path, 10.0)))
    api = Api(server.url)
    api.register("a")
    before = api.snapshot()
    huge = 2**63
    for query in (f"&tokens={huge}", f"&tokens={2**48 + 1}", f"&fragment={huge}"):
        api.rejects(api.submit("a", gradient(-2.0), query=query), 422, "invalid_request")
    api.rejects(api.submit("a", gradient(-2.0), round_number=huge), 422, "invalid_request")
    api.rejects(api.result("a", round_number=huge), 422, "invalid_request")
    beat = {"step": huge, "steps_per_second": 1.0, "loss": None, "tokens": 0}
    response = api.call("POST", "/v1/workers/a/heartbeat", json_body=beat)
    api.rejects(response, 422, "invalid_request", "step")
    response = api.call("POST", "/v1/workers/a/heartbeat", json_body={**beat, "step": 1,
                        "tokens": huge})  # fmt: skip
    api.rejects(response, 422, "invalid_request", "tokens")
    assert api.snapshot() == before
    assert api.submit("a", gradient(-2.0), query=f"&tokens={2**48}").status == 200
    assert weights_of(api)[0] == 1
    server.process.terminate()
    assert server.process.wait(timeout=30) == 0
    again = Api(server_process(*args).url)
    round_number, weights = weights_of(again)
    assert round_number == 1 and torch.all(weights["layer.weight"] == 12.0)


def test_values_that_could_overflow_the_round_sum_are_refused_naming_the_tensor(
    server_process, tmp_path
):
    """Each value finite, their fp32 sum not: 3e38 twice once raised inside the commit, left
    the round without sums and killed the eviction thread. Now a body whose weighted values
    could push the round's sum past 1e37 is a 422 naming the tensor, and nothing changes.
    SGD lr 1 from 10: 5e36 and 1 average to 2.5e36 + 0.5, so the weights end at -2.5e36."""
    server = server_process(
        "--outer-optimizer", "sgd", "--outer-lr", "1", "--init", str(init_file(tmp_path, 10.0))
    )  # fmt: skip
    api = Api(server.url)
    api.register("a")
    api.register("b")
    before = api.snapshot()
    error = api.rejects(api.submit("a", gradient(3e38)), 422, "sum_overflow", "layer.")
    assert error["detail"]["tensor"] in SHAPES
    assert api.snapshot() == before
    assert api.submit("a", gradient(5e36)).status == 200
    error = api.rejects(api.submit("b", gradient(6e36)), 422, "sum_overflow")
    assert error["detail"]["limit"] == pytest.approx(1e37 - 5e36, rel=1e-6)  # what is left
    assert api.submit("b", gradient(1.0)).status == 200
    round_number, weights = weights_of(api)
    assert round_number == 1
    assert torch.allclose(weights["layer.bias"], torch.full((3,), 10 - (5e36 + 1) / 2))
    assert "Traceback" not in server.log.read_text()


def test_after_a_failed_checkpoint_nothing_stepped_is_served_and_a_restart_resumes(
    server_process, tmp_path
):
    """The 2nd step's durable write (its step log) fails (an injected EIO): the stepped
    masters used to be served under the old round number by GET /v1/weights, though a restart
    has the old weights. Now weights, info and registrations answer 503 until the restart,
    which serves round 1 (12) and takes the resubmitted round 1 (14). (A failed checkpoint
    after a logged step: tests/server/test_server_journal.py.)"""
    state = tmp_path / "state"
    args = ("--outer-optimizer", "sgd", "--outer-lr", "1", "--state-dir", str(state))
    init = str(init_file(tmp_path, 10.0))
    server = server_process(*args, "--init", init, env={"DILOCO_FAIL_AT": "before_step_log:2"})
    api = Api(server.url)
    api.register("a")
    assert api.submit("a", gradient(-2.0), round_number=0).status == 200
    assert weights_of(api)[0] == 1
    api.rejects(api.submit("a", gradient(-2.0), round_number=1), 503, "checkpoint_failed")
    api.rejects(api.call("GET", "/v1/weights"), 503, "checkpoint_failed")
    api.rejects(api.call("GET", "/v1/info"), 503, "checkpoint_failed")
    api.rejects(api.call("POST", "/v1/workers", json_body=registration("late")), 503,
                "checkpoint_failed")  # fmt: skip
    api.rejects(api.result("a", round_number=1), 503, "checkpoint_failed")
    status = api.ok("GET", "/v1/status")
    assert status["round"] == 1 and "injected failure" in status["broken"]
    server.process.terminate()
    server.process.wait(timeout=30)
    again = Api(server_process(*args).url)
    round_number, weights = weights_of(again)
    assert round_number == 1 and torch.all(weights["layer.weight"] == 12.0)
    again.register("a2")
    assert again.submit("a2", gradient(-2.0), round_number=1).status == 200
    answer = again.submit("a", gradient(-2.0), round_number=1)  # a member again after restart
    assert answer.status == 200, answer.data[:300]
    round_number, weights = weights_of(again)
    assert round_number == 2 and torch.all(weights["layer.weight"] == 14.0)


def test_a_body_that_fails_part_way_into_shared_sums_stops_the_server_not_folds_twice(
    in_thread, monkeypatch
):
    """Round 0 holds a's body; b's fails part way into the same sums (an injected EIO reading
    its spooled pieces after the first). Its part cannot be taken out again, and a resend
    folded it twice (a 500, then 200 for the retry). Now b is answered 503 naming the fold,
    and so is everything after (the retry, the weights) until a restart."""
    from diloco.server.rounds.round import Round

    real = Round.add_pieces
    failed: list[str] = []

    def cut_after_one_piece(self, worker_id, fragment, shapes, pieces, *rest, **kwargs):
        if worker_id == "b" and not failed:
            failed.append(worker_id)

            def one_then_eio():
                iterator = iter(pieces)
                yield next(iterator)
                raise OSError(5, "Input/output error (injected)")

            return real(self, worker_id, fragment, shapes, one_then_eio(), *rest, **kwargs)
        return real(self, worker_id, fragment, shapes, pieces, *rest, **kwargs)

    monkeypatch.setattr(Round, "add_pieces", cut_after_one_piece)
    api = in_thread(0.0, outer_optimizer="sgd", outer_lr=1.0, min_workers=2)
    api.register("a")
    api.register("b")
    assert api.submit("a", gradient(1.0), round_number=0).status == 200
    error = api.rejects(api.submit("b", gradient(1.0), round_number=0), 503, "checkpoint_failed")
    assert "failed part way" in error["error"]
    assert "b's pseudo-gradient into round 0" in error["error"] and failed == ["b"]
    api.rejects(api.submit("b", gradient(1.0), round_number=0), 503, "checkpoint_failed")
    api.rejects(api.call("GET", "/v1/weights"), 503, "checkpoint_failed")
    assert "Input/output error" in api.ok("GET", "/v1/status")["broken"]


def test_an_outer_step_that_fails_without_a_step_log_serves_nothing_half_moved(
    in_thread, monkeypatch
):
    """No state dir: an outer step that fails part way (an injected error after it moved the
    masters) left them served under the old round, and the round's sums used up. Now the
    server answers 503 naming the step until a restart, as it does with a step log."""
    import diloco.server.model.global_model as global_model

    def half_then_fails(masters, *args, **kwargs):
        next(iter(masters.values())).add_(100.0)
        raise RuntimeError("injected failure")

    monkeypatch.setattr(global_model, "apply_running_mean", half_then_fails)
    api = in_thread(0.0, outer_optimizer="sgd", outer_lr=1.0)
    api.register("a")
    error = api.rejects(api.submit("a", gradient(1.0), round_number=0), 503, "checkpoint_failed")
    assert "the outer step of round 1 failed: injected failure" in error["error"]
    api.rejects(api.call("GET", "/v1/weights"), 503, "checkpoint_failed")
    api.rejects(api.result("a", round_number=0), 503, "checkpoint_failed")


def test_a_result_that_fails_to_encode_after_a_durable_step_stops_the_server(
    in_thread, monkeypatch
):
    """The step is durable, then encoding its result fails (out of memory, injected): the
    round stayed full with its sums used up, so every later submission was 409 future_round
    and every poll waited for ever. Now the server answers 503 naming it until a restart."""
    from diloco.server.rounds.barrier import BarrierRounds

    def out_of_memory(self, fragment, round_number):
        raise MemoryError("injected")

    monkeypatch.setattr(BarrierRounds, "_encode_result", out_of_memory)
    api = in_thread(0.0, outer_optimizer="sgd", outer_lr=1.0)
    api.register("a")
    error = api.rejects(api.submit("a", gradient(1.0), round_number=0), 503, "checkpoint_failed")
    assert "publishing round 0 after its durable step failed" in error["error"]
    api.rejects(api.submit("a", gradient(1.0), round_number=1), 503, "checkpoint_failed")
    api.rejects(api.result("a", round_number=0), 503, "checkpoint_failed")


def test_the_eviction_loop_survives_a_failing_tick() -> None:
    """An exception in one tick (once an AssertionError after a failed commit) ended the
    thread for good: no eviction for the rest of the run. It is logged and the loop goes on."""
    import threading
    from types import SimpleNamespace

    from diloco.server.http.runner import EvictionTicker

    ticks = []
    enough = threading.Event()

    def evict_stale() -> list[str]:
        ticks.append(1)
        if len(ticks) >= 3:
            enough.set()
        if len(ticks) == 1:
            raise AssertionError("a broken round")
        return []

    stub = SimpleNamespace(settings=SimpleNamespace(heartbeat_interval=0.02),
                           evict_stale=evict_stale)  # fmt: skip
    ticker = EvictionTicker(stub)  # type: ignore[arg-type]
    ticker.start()
    try:
        assert enough.wait(timeout=10), ticks
    finally:
        ticker.stop()
    assert ticker.thread.is_alive() is False and len(ticks) >= 3


def test_a_member_that_heartbeats_but_never_submits_is_evicted_at_the_barrier_timeout(
    server_process, tmp_path
):
    """b's training loop hangs while its heartbeat thread runs: the barrier used to answer 504
    for ever (retried without end). Past --barrier-timeout b is evicted and a's round commits
    alone: SGD lr 1 from 10 with a's -2 gives 12."""
    import threading
    import time

    server = server_process(
        "--outer-optimizer", "sgd", "--outer-lr", "1", "--barrier-timeout", "2",
        "--heartbeat-interval", "0.5", "--heartbeat-timeout", "30",
        "--init", str(init_file(tmp_path, 10.0)),
    )  # fmt: skip
    api = Api(server.url)
    api.register("a")
    api.register("b")
    stop = threading.Event()
    beats: list[int] = []

    def heartbeat_of_b() -> None:
        beat_api = Api(server.url)
        while not stop.wait(0.3):
            body = {"step": 3, "steps_per_second": 1.0, "loss": None, "tokens": 0}
            beats.append(beat_api.call("POST", "/v1/workers/b/heartbeat", json_body=body).status)

    thread = threading.Thread(target=heartbeat_of_b, daemon=True)
    thread.start()
    try:
        started = time.monotonic()
        assert api.submit("a", gradient(-2.0)).status == 200
        response = api.result("a", wait=20.0)
        while response.status in (202, 504) and time.monotonic() - started < 30:
            response = api.result("a", wait=20.0)
        assert response.status == 200, response.data[:300]
        assert time.monotonic() - started < 15
        assert torch.all(decode_tensors(response.data)["layer.weight"] == 12.0)
    finally:
        stop.set()
        thread.join(timeout=5)
    assert 200 in beats  # b's heartbeats were answered all along, and now b is out:
    body = {"step": 3, "steps_per_second": 1.0, "loss": None, "tokens": 0}
    api.rejects(api.call("POST", "/v1/workers/b/heartbeat", json_body=body), 404, "unknown_worker")
    workers = {w["worker_id"]: w["live"] for w in api.ok("GET", "/v1/status")["workers"]}
    assert workers == {"a": True, "b": False}
    assert "has not submitted within the barrier timeout" in server.log.read_text()


def test_units_reported_with_a_submission_answered_committed_complete_with_the_next_round(
    in_thread,
):
    """b registers after round 0's first submission, so round 0 commits without it; b's
    round-0 submission is answered `committed` and its units used to stay leased to it for
    ever (skipped until it left). They now complete with the open round."""
    api = in_thread(10.0, outer_optimizer="sgd", outer_lr=1.0)
    api.register("a")
    dataset = {"worker_id": "a", "dataset_id": "ds", "length": 40, "shuffle_seed": 1,
               "unit_size": 10}  # fmt: skip
    api.ok("POST", "/v1/datasets", json_body=dataset)
    leases = "/v1/datasets/ds/leases"
    a_unit = api.ok("POST", leases, json_body={"worker_id": "a"})["units"][0]["unit_id"]
    assert api.submit("a", gradient(-2.0), query="").status == 200  # round 0 commits alone
    api.register("b")
    b_units = [
        u["unit_id"]
        for u in api.ok("POST", leases, json_body={"worker_id": "b", "count": 2})["units"]
    ]
    late = api.submit("b", gradient(-100.0), query=f"&units={','.join(map(str, b_units))}")
    assert late.status == 200 and late.json()["status"] == "committed"
    progress = api.ok("GET", "/v1/datasets")["datasets"][0]
    assert (progress["completed"], progress["leased"]) == (0, 3)
    assert api.submit("a", gradient(-2.0), round_number=1, query=f"&units={a_unit}").status == 200
    assert api.submit("b", gradient(-4.0), round_number=1).status == 200
    round_number, weights = weights_of(api)
    assert round_number == 2 and torch.all(weights["layer.weight"] == 15.0)  # 12 + mean(2, 4)
    progress = api.ok("GET", "/v1/datasets")["datasets"][0]
    assert (progress["completed"], progress["leased"]) == (3, 0)


def test_partly_trained_units_over_http_and_their_bad_reports(in_thread):
    """`units=ID:COUNT` reports a unit's trained prefix; the round that commits records it,
    and after the worker leaves, the next lease hands out only the rest. Bad counts, syntax
    and units of others are 422 naming the field, and change nothing."""
    api = in_thread(10.0, outer_optimizer="sgd", outer_lr=1.0)
    api.register("a")
    api.register("b")
    dataset = {"worker_id": "a", "dataset_id": "ds", "length": 20, "shuffle_seed": 1,
               "unit_size": 10}  # fmt: skip
    api.ok("POST", "/v1/datasets", json_body=dataset)
    leases = "/v1/datasets/ds/leases"
    unit = api.ok("POST", leases, json_body={"worker_id": "a"})["units"][0]
    other = api.ok("POST", leases, json_body={"worker_id": "b"})["units"][0]["unit_id"]
    uid = unit["unit_id"]
    before = api.snapshot()
    for bad in (f"{uid}:0", f"{uid}:x", f"{uid}:", f"{uid}:10", f"{uid}:99", f"{uid},{uid}:3",
                f"{other}:3"):  # fmt: skip
        response = api.submit("a", gradient(-2.0), query=f"&units={bad}")
        body = check_error(response.status, response.data, 422, response.json()["kind"])
        assert body["kind"] in ("invalid_request", "unit_not_leased"), bad
        assert api.snapshot() == before, bad
    assert api.submit("a", gradient(-2.0), query=f"&units={uid}:4").status == 200
    assert api.submit("b", gradient(-2.0)).status == 200
    assert weights_of(api)[0] == 1
    held = api.ok("GET", f"{leases}?worker_id=a")["units"]
    assert [(u["unit_id"], u["start"], u["indices"]) for u in held] == [
        (uid, 4, unit["indices"][4:])
    ]
    assert api.call("DELETE", "/v1/workers/a").status == 200
    again = api.ok("POST", leases, json_body={"worker_id": "b"})["units"][0]
    assert (again["unit_id"], again["start"], again["indices"]) == (uid, 4, unit["indices"][4:])


def test_heartbeats_are_answered_while_a_slow_checkpoint_write_holds_the_commit(
    server_process, tmp_path
):
    """Every step's durable write (its step log, under the commit's lock) takes 4 s (an
    injected slow disk) and silence past 2 s evicts.
    Heartbeats used to wait for the commit's lock, so they were all 4 s late at once and the
    eviction that ran first after the write took every worker out. Now each is answered at
    once during the write and both workers are still members when the round has committed."""
    import threading
    import time

    server = server_process(
        "--outer-optimizer", "sgd", "--outer-lr", "1", "--heartbeat-interval", "0.25",
        "--heartbeat-timeout", "2", "--init", str(init_file(tmp_path, 10.0)),
        "--state-dir", str(tmp_path / "state"), env={"DILOCO_STALL_AT": "before_step_log:4"},
    )  # fmt: skip
    api = Api(server.url)
    api.register("a")
    api.register("b")
    stop = threading.Event()
    latencies: dict[str, list[float]] = {"a": [], "b": []}
    statuses: list[int] = []

    def heartbeats() -> None:
        beat_api = Api(server.url)
        body = {"step": 3, "steps_per_second": 1.0, "loss": None, "tokens": 0}
        while not stop.wait(0.2):
            for worker_id in ("a", "b"):
                started = time.monotonic()
                response = beat_api.call(
                    "POST", f"/v1/workers/{worker_id}/heartbeat", json_body=body
                )
                latencies[worker_id].append(time.monotonic() - started)
                statuses.append(response.status)

    thread = threading.Thread(target=heartbeats, daemon=True)
    thread.start()
    try:
        assert api.submit("a", gradient(-2.0)).status == 200
        started = time.monotonic()
        assert api.submit("b", gradient(-2.0)).status == 200  # commits: the 4 s write
        assert time.monotonic() - started >= 3.5  # the stall did hold this commit
        time.sleep(1.0)  # the eviction ticker has run after the write
    finally:
        stop.set()
        thread.join(timeout=10)
    assert set(statuses) == {200}
    assert max(latencies["a"] + latencies["b"]) < 1.0, latencies
    assert len(latencies["a"]) >= 10
    workers = {w["worker_id"]: w["live"] for w in api.ok("GET", "/v1/status")["workers"]}
    assert workers == {"a": True, "b": True}
    round_number, weights = weights_of(api)
    assert round_number == 1 and torch.all(weights["layer.weight"] == 12.0)


def test_the_codecs_piece_temporaries_stay_under_the_servers_mmap_threshold() -> None:
    """Above the threshold every allocation is an mmap whose pages fault in anew: a piece's
    temporaries (fp32 values, int64 top-k keys) must come from the heap and be reused,
    while a model-sized buffer (a real model's sums: hundreds of MiB) is returned when freed."""
    from diloco.algorithm.compression.codecs import piece_elements
    from diloco.server.http.runner import MMAP_THRESHOLD_BYTES

    largest_temporary = piece_elements(torch.device("cpu")) * torch.int64.itemsize
    assert largest_temporary < MMAP_THRESHOLD_BYTES <= 8 << 20
