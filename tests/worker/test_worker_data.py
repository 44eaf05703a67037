"""LeasedSampler and LeasedBatches against a real server on 127.0.0.1 and the real client.

The server is the `live_server` fixture (a real coordinator behind uvicorn in a thread); the
samplers talk to it through `DiLoCoClient`, and what they yield is checked against the server's
own permutation (`Permutation(length, seed, epoch)`) and its work-unit records.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import pytest
import torch
from test_worker_worker import record_submits
from torch.utils.data import DataLoader

from diloco.algorithm.permutation import Permutation
from diloco.data import VOCAB_SIZE, TokenWindows, encode, generated_corpus
from diloco.server.settings import ServerSettings
from diloco.wire import decode_tensors, specs_of
from diloco.worker import DiLoCoClient, DiLoCoWorker, ServerError
from diloco.worker.data.leased_sampler import LeasedBatches, LeasedDataset, LeasedSampler

LENGTH, UNIT, SEED = 1000, 64, 3
UNITS = -(-LENGTH // UNIT)  # 16: fifteen of 64 samples and one of 40
SPECS = [s.to_json() for s in specs_of({"w": torch.zeros(2)}, {"w": "trainable"})]


@pytest.fixture
def server(live_server):
    with live_server(ServerSettings(), {"w": torch.zeros(2)}) as running:
        yield running


@pytest.fixture
def client(server) -> Iterator[DiLoCoClient]:
    with DiLoCoClient(server.url) as connection:
        for worker_id in ("w0", "w1"):
            connection.register(worker_id, SPECS)
        yield connection


def sampler(client: DiLoCoClient, worker_id: str = "w0", **options) -> LeasedSampler:
    return LeasedSampler(
        client, worker_id, "ds", LENGTH, shuffle_seed=SEED, unit_size=UNIT, **options
    )


def take(indices: Iterator[int], n: int) -> list[int]:
    return [next(indices) for _ in range(n)]


def order(epoch: int, length: int = LENGTH, seed: int = SEED) -> list[int]:
    permutation = Permutation(length, seed, epoch)
    return [permutation(p) for p in range(length)]


def progress(server) -> list[tuple[int, int, int, int]]:
    """(epoch, completed, leased, free) of `ds` on the server."""
    return [
        (p["epoch"], p["completed"], p["leased"], p["free"])
        for p in server.coordinator.data_progress()
        if p["dataset_id"] == "ds"
    ]


# ----------------------------------------------------------------------- one epoch


def test_one_sampler_yields_the_whole_permutation_once_then_opens_the_next_epoch(
    server, client
) -> None:
    leased = sampler(client, lease_count=3)
    assert leased.dataset["units_per_epoch"] == UNITS and leased.epoch == 0
    first = list(leased)
    assert len(first) == LENGTH and sorted(first) == list(range(LENGTH))
    assert first == order(0)  # one worker trains the server's order exactly
    assert leased.finished_units() == list(range(1, UNITS + 1))
    assert progress(server) == [(0, 0, UNITS, 0)]

    second = list(leased)  # the next iter() opens epoch 1: a new order of the same samples
    assert leased.epoch == 1
    assert sorted(second) == list(range(LENGTH)) and second == order(1) and second != first
    assert leased.finished_units() == list(range(1, 2 * UNITS + 1))
    assert progress(server) == [(0, 0, UNITS, 0), (1, 0, UNITS, 0)]


def test_two_workers_interleaved_split_the_epoch_between_them(server, client) -> None:
    samplers = {"w0": sampler(client, "w0"), "w1": sampler(client, "w1", lease_count=2)}
    streams = {worker: iter(s) for worker, s in samplers.items()}
    seen: dict[str, list[int]] = {"w0": [], "w1": []}
    step = 0
    while streams:
        worker = sorted(streams)[step % len(streams)]
        step += 1
        for _ in range(7 if worker == "w0" else 5):  # uneven strides cross unit boundaries
            try:
                seen[worker].append(next(streams[worker]))
            except StopIteration:
                del streams[worker]
                break
    a, b = set(seen["w0"]), set(seen["w1"])
    assert len(a) == len(seen["w0"]) and len(b) == len(seen["w1"])  # nothing twice
    assert not a & b and a | b == set(range(LENGTH))
    assert len(a) > 3 * UNIT and len(b) > 3 * UNIT  # both trained a real share
    # Each worker finished exactly the units the server leased to it, and they cover the epoch.
    units = {w: s.finished_units() for w, s in samplers.items()}
    assert sorted(units["w0"] + units["w1"]) == list(range(1, UNITS + 1))
    pool = server.coordinator.pool
    for worker, finished in units.items():
        assert [u["unit_id"] for u in pool.leases_of(worker)] == finished
        held = [i for u in pool.leases_of(worker, indices=True) for i in u["indices"]]
        assert held == seen[worker]  # in lease order, unit after unit
    assert progress(server) == [(0, 0, UNITS, 0)]


def test_a_unit_is_finished_when_its_last_index_is_out_and_reported_drops_it(
    server, client
) -> None:
    leased = sampler(client, lease_count=2)
    stream = iter(leased)
    take(stream, UNIT - 1)
    assert leased.finished_units() == []
    take(stream, 1)  # the last index of unit 1
    assert leased.finished_units() == [1]
    take(stream, UNIT)
    assert leased.finished_units() == [1, 2]
    take(stream, 1)  # the first of unit 3 (a new lease)
    assert leased.finished_units() == [1, 2]
    leased.reported([1])
    assert leased.finished_units() == [2]
    leased.forget([2, 99])
    assert leased.finished_units() == []
    assert [u["unit_id"] for u in server.coordinator.pool.leases_of("w0")] == [1, 2, 3, 4]


def test_state_dict_resumes_at_the_same_position(server, client) -> None:
    first = sampler(client, lease_count=4)  # 256 indices in hand: no lease while comparing
    stream = iter(first)
    take(stream, 100)
    saved = json.loads(json.dumps(first.state_dict()))  # JSON-able, as the worker saves it
    assert saved["dataset_id"] == "ds" and saved["offset"] == 100 - UNIT
    assert [u["unit_id"] for u in saved["queue"]] == [2, 3, 4] and saved["finished"] == [1]
    expected = take(stream, 120)

    resumed = sampler(client)  # a new process: registers the same dataset again
    resumed.load_state_dict(saved)
    assert resumed.finished_units() == [1] and resumed.epoch == 0
    assert take(iter(resumed), 120) == expected
    assert resumed.finished_units() == first.finished_units() == [1, 2, 3]
    assert resumed.state_dict() == first.state_dict()

    # A state saved just as a unit's last index went out resumes with the next unit.
    edge = {**saved, "offset": len(saved["queue"][0]["indices"])}
    at_edge = sampler(client)
    at_edge.load_state_dict(edge)
    assert next(iter(at_edge)) == saved["queue"][1]["indices"][0]
    assert at_edge.finished_units() == [1, 2]

    other = LeasedSampler(client, "w0", "other", 10, unit_size=5)
    with pytest.raises(ValueError, match="'ds'"):
        other.load_state_dict(saved)
    assert other.state_dict()["queue"] == [] and other.finished_units() == []


def test_a_sampler_for_another_shape_of_a_known_dataset_is_refused(server, client) -> None:
    sampler(client)
    with pytest.raises(ServerError) as caught:
        LeasedSampler(client, "w1", "ds", LENGTH + 1, shuffle_seed=SEED, unit_size=UNIT)
    assert caught.value.kind == "dataset_conflict"
    with pytest.raises(ValueError, match="lease_count"):
        sampler(client, lease_count=0)


# ----------------------------------------------------------------------- with token windows


@pytest.fixture(scope="module")
def windows() -> TokenWindows:
    return TokenWindows(encode(generated_corpus(num_bytes=20_000, seed=5)), 16)


def test_leased_batches_are_windows_in_leased_order_across_epochs(server, client, windows) -> None:
    count = len(windows)
    assert count == (20_000 - 1) // 16
    leased = LeasedSampler(client, "w0", "windows", count, shuffle_seed=1, unit_size=50)
    batches = LeasedBatches(windows, leased, batch_size=8)
    expected = order(0, count, 1) + order(1, count, 1)
    for step in range(count // 8 + 20):  # past the end of epoch 0
        x, y = batches.next_batch()
        assert x.shape == y.shape == (8, 16) and x.dtype == y.dtype == torch.int64
        assert torch.equal(x[:, 1:], y[:, :-1])  # y is x shifted by one token
        for row, index in enumerate(expected[8 * step : 8 * step + 8]):
            assert torch.equal(x[row], windows[index][0]), (step, row)
    assert batches.epochs_seen == 1 and leased.epoch == 1


def test_a_dataloader_trains_the_leased_indices(server, client, windows) -> None:
    count = len(windows)
    leased = LeasedSampler(client, "w0", "windows", count, unit_size=40, lease_count=2)
    loader = DataLoader(windows, batch_size=8, sampler=leased)
    rows = []
    for x, y in loader:
        assert x.shape[1:] == y.shape[1:] == (16,) and 1 <= len(x) <= 8
        rows.append(x)
    assert sum(len(x) for x in rows) == count
    starts = torch.cat(rows)[:, 0]
    # Window i starts at token 16 i: the loader saw every window once, in the server's order.
    tokens = windows.tokens.long()
    assert torch.equal(starts, tokens[torch.tensor(order(0, count, 0)) * 16])
    assert leased.finished_units() == list(range(1, -(-count // 40) + 1))


# ----------------------------------------------------------------------- with a DiLoCoWorker


class Bigram(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.table = torch.nn.Embedding(VOCAB_SIZE, VOCAB_SIZE)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.table(x)


def test_a_worker_reports_the_units_it_trained_and_they_complete(live_server, windows) -> None:
    settings = ServerSettings(sync_every=4, outer_optimizer="sgd", outer_lr=1.0)
    with live_server(settings) as server:
        model = Bigram()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        worker = DiLoCoWorker(model, optimizer, server.url, worker_id="trainer", heartbeat=False)
        leased = LeasedSampler.for_worker(worker, "windows", len(windows), unit_size=16)
        assert worker.data is leased
        batches = LeasedBatches(windows, leased, batch_size=8)
        for _ in range(12):  # 3 rounds of 4 steps, 32 windows (2 units) each
            x, y = batches.next_batch()
            loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            worker.report(loss=loss.item(), tokens=x.numel())
        assert worker.rounds == 3 and server.coordinator.round_number == 3
        # One worker with outer SGD at lr 1: the global weights are its trained weights.
        with DiLoCoClient(server.url) as observer:
            body, round_number = observer.get_weights()
        assert round_number == 3
        assert torch.equal(decode_tensors(body)["table.weight"], model.table.weight.detach())

        # Each round reported the two units whose last window it trained.
        completions = server.coordinator.pool.completions("windows")
        assert [(u["unit_id"], u["round"], u["worker_id"]) for u in completions] == [
            (1, 0, "trainer"),
            (2, 0, "trainer"),
            (3, 1, "trainer"),
            (4, 1, "trainer"),
            (5, 2, "trainer"),
            (6, 2, "trainer"),
        ]
        assert leased.finished_units() == []  # all reported and committed
        rounds = server.coordinator.journal.state.committed_rounds()
        assert [r["units"] for r in rounds] == [[1, 2], [3, 4], [5, 6]]
        with DiLoCoClient(server.url) as observer:
            (status,) = observer.status()["datasets"]
        assert (status["completed"], status["leased"]) == (6, 0)
        assert status["total"] == -(-len(windows) // 16)

        worker.close()  # nothing pending: no further round, nothing released
        assert server.coordinator.round_number == 3
        (after,) = server.coordinator.data_progress()
        assert (after["completed"], after["leased"]) == (6, 0)


def test_a_round_reports_at_most_what_one_submission_may_carry(live_server) -> None:
    """More finished units than a submission may list: the rest go with the next round."""
    with live_server(ServerSettings(sync_every=1)) as server:
        model = torch.nn.Linear(2, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        worker = DiLoCoWorker(model, optimizer, server.url, worker_id="many", heartbeat=False)
        leased = LeasedSampler.for_worker(worker, "singles", 5000, unit_size=1, lease_count=1024)
        stream = iter(leased)
        take(stream, 4100)
        assert len(leased.finished_units()) == 4100
        for _ in range(2):
            model(torch.ones(1, 2)).sum().backward()
            optimizer.step()  # sync_every=1: every step is a round
            optimizer.zero_grad()
        assert worker.rounds == 2 and leased.finished_units() == []
        rounds = [r["units"] for r in server.coordinator.journal.state.committed_rounds()]
        assert rounds == [list(range(1, 4097)), list(range(4097, 4101))]
        (progress,) = server.coordinator.data_progress()
        assert (progress["completed"], progress["leased"]) == (4100, 900)  # 5 leases of 1024
        worker.close(final_sync=False)


def _pausy(url: str) -> tuple[torch.nn.Module, torch.optim.Optimizer, DiLoCoWorker, LeasedSampler]:
    """A worker "pausy" without a heartbeat (a test evicts it and says when it finds out),
    on leased units of `ds`: its model, optimizer, worker and sampler."""
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    worker = DiLoCoWorker(model, optimizer, url, worker_id="pausy", heartbeat=False)
    leased = LeasedSampler.for_worker(worker, "ds", LENGTH, shuffle_seed=SEED, unit_size=UNIT)
    return model, optimizer, worker, leased


def test_an_evicted_worker_registers_again_and_leases_anew(live_server) -> None:
    """Evicted between two leases: the units it queued went back to the pool, so it drops
    them, registers again under its id, and goes on with units that are its own."""
    with live_server(ServerSettings(sync_every=100)) as server:
        _, _, worker, leased = _pausy(server.url)
        stream = iter(leased)
        first = take(stream, UNIT)  # the whole of unit 1; unit 2 not leased yet
        server.coordinator.deregister("pausy")  # what an eviction does to its membership
        assert server.coordinator.pool.leases_of("pausy") == []
        after = take(stream, UNIT)  # a new lease: 404, register again, lease again
        assert server.coordinator.membership.is_live("pausy")
        held = server.coordinator.pool.leases_of("pausy", indices=True)
        assert [unit["indices"] for unit in held] == [after]
        # The released unit is leased again first, to whoever asks: here the same worker,
        # which trains it again (never skipped; completed once, by the round that reports it).
        assert after == first
        assert leased.finished_units() == [held[0]["unit_id"]]  # listed once
        worker.close(final_sync=False)


def test_a_leased_dataset_yields_one_epoch_of_samples_and_refuses_worker_processes(
    server, client
) -> None:
    data = [torch.tensor(i) for i in range(LENGTH)]
    leased = LeasedDataset(data, sampler(client))
    assert [int(x) for x in leased] == order(0)
    loader = DataLoader(LeasedDataset(data, sampler(client, "w1")), batch_size=10, num_workers=1)
    with pytest.raises(RuntimeError, match="num_workers > 0"):
        next(iter(loader))


# ----------------------------------------------------------------------- counting what trained


def test_counting_trained_samples_reports_and_saves_what_was_trained_not_fetched(
    server, client
) -> None:
    """A loop that reads ahead (accelerate fetches the next batch early) hands out samples it
    has not trained: with count_trained the units, the prefix and the checkpoint follow
    `trained(n)`, and a resume hands the fetched-but-untrained samples out again."""
    leased = sampler(client, lease_count=2, count_trained=True)
    leased.trace = []
    stream = iter(leased)
    fetched = take(stream, UNIT + 10)  # all of unit 1 and 10 of unit 2 fetched
    assert leased.finished_units() == [] and leased.progress() == {}  # nothing trained
    leased.trained(UNIT - 1)
    assert leased.finished_units() == [] and leased.progress() == {1: UNIT - 1}
    leased.trained(1)  # the last sample of unit 1 trained
    assert leased.finished_units() == [1] and leased.progress() == {}
    leased.trained(4)
    assert leased.progress() == {2: 4}
    assert leased.drain_trace() == [(0, index) for index in fetched[: UNIT + 4]]

    saved = json.loads(json.dumps(leased.state_dict()))
    assert [u["unit_id"] for u in saved["queue"]] == [2] and saved["offset"] == 4
    assert saved["finished"] == [1] and saved["trace"] == []
    resumed = sampler(client, count_trained=True)
    resumed.load_state_dict(saved)
    # the 6 samples of unit 2 fetched but never trained come out again, then the rest
    assert take(iter(resumed), 6) == fetched[UNIT + 4 :]

    # trained more than was fetched: counted up to what was fetched, with a warning
    leased.trained(1000)
    assert leased.progress() == {2: 10}


def test_a_resume_that_drops_its_round_goes_back_to_the_round_start(server, client) -> None:
    """The saved round began after unit 1; the checkpoint is 20 samples into unit 2. When the
    worker drops the round's steps (the server went on), the sampler resumes where the round
    began: the 20 samples of unit 2 are trained again, not lost."""

    class Resumed:  # what LeasedSampler.for_worker reads of a DiLoCoWorker
        def __init__(self, saved: dict, dropped: bool) -> None:
            self.client, self.worker_id, self.sample_trace = client, "w0", None
            self.resumed = type("Saved", (), {"extra": {"data": saved}})()
            self.dropped_round = dropped
            self.data = None

        def rejoin(self) -> None:
            raise AssertionError("not evicted")

    first = LeasedSampler.for_worker(
        Resumed({}, False), "ds", LENGTH, shuffle_seed=SEED, unit_size=UNIT, lease_count=2,
        count_trained=True,
    )  # fmt: skip
    stream = iter(first)
    take(stream, UNIT + 20)
    first.trained(UNIT)
    first.round_started()  # a sync after unit 1
    first.trained(20)
    saved = json.loads(json.dumps(first.state_dict()))
    assert saved["round_start"]["offset"] == 0 and saved["offset"] == 20
    options = {"shuffle_seed": SEED, "unit_size": UNIT, "count_trained": True}
    kept = LeasedSampler.for_worker(Resumed(saved, False), "ds", LENGTH, **options)
    assert kept.progress() == {2: 20}
    dropped = LeasedSampler.for_worker(Resumed(saved, True), "ds", LENGTH, **options)
    assert dropped.progress() == {} and dropped.finished_units() == [1]
    second_unit = next(u for u in saved["queue"] if u["unit_id"] == 2)["indices"]
    assert take(iter(dropped), 20) == second_unit[:20]


def test_a_resume_inside_a_round_whose_leases_were_released_drops_the_round(
    live_server, windows, tmp_path
) -> None:
    """H = 2, units of 8 windows, batches of 4 counted as trained. Step 1 trains unit 1's
    first 4 windows; a checkpoint; the worker leaves (its leases go back to the pool, as at
    an eviction). The server is still in round 0, but the resumed worker must not keep step
    1: its 4 windows are free for anyone again. So it drops the step and, being alone, is
    leased unit 1 again and trains those 4 windows first."""

    def start() -> tuple[DiLoCoWorker, Bigram, LeasedSampler]:
        model = Bigram()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        worker = DiLoCoWorker(model, optimizer, server.url, worker_id="w", heartbeat=False,
                              checkpoint_dir=tmp_path, save_every_round=False)  # fmt: skip
        leased = LeasedSampler.for_worker(
            worker, "windows", len(windows), unit_size=8, count_trained=True
        )
        return worker, model, leased

    def step(worker: DiLoCoWorker, model: Bigram, stream: Iterator[int]) -> list[int]:
        indices = take(stream, 4)
        x = torch.stack([windows[i][0] for i in indices])
        y = torch.stack([windows[i][1] for i in indices])
        worker.data.trained(len(indices))  # what a framework callback counts
        torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        worker.optimizer.step()
        worker.optimizer.zero_grad()
        return indices

    with live_server(ServerSettings(sync_every=2, outer_optimizer="sgd", outer_lr=1.0)) as server:
        worker, model, leased = start()
        first = step(worker, model, iter(leased))
        worker.save_checkpoint()
        worker.close(final_sync=False)
        (pool,) = server.coordinator.data_progress()
        assert pool["leased"] == 0  # leaving gave unit 1 back

        resumed, model, leased = start()
        assert resumed.dropped_round and resumed.round == 0
        assert resumed._schedule.steps_in_round == 0  # the round starts afresh
        stream = iter(leased)
        assert step(resumed, model, stream) == first  # unit 1 again, from its start
        step(resumed, model, stream)  # the round's 2 steps: 8 windows, unit 1 whole
        assert resumed.rounds == 1
        rounds = server.coordinator.journal.state.committed_rounds()
        assert [r["units"] for r in rounds] == [[1]]
        resumed.close(final_sync=False)


def test_a_new_iteration_hands_out_again_what_the_last_fetched_and_never_trained(
    server, client
) -> None:
    """A framework's epoch ends with a batch fetched ahead; its next epoch iterates afresh.
    The fetched, untrained samples come out first, so none is skipped untrained."""
    from diloco.integrations.common import LeasedTrainSampler
    from diloco.worker.data.tokens import samples_in

    deferred = LeasedTrainSampler(LENGTH, "ds")
    deferred.leased = sampler(client, lease_count=2, count_trained=True)
    first = iter(deferred)
    fetched = take(first, 10)
    deferred.trained(6)
    again = take(iter(deferred), 6)  # the framework's next epoch
    assert again[:4] == fetched[6:] and again[4:] == take(iter(order(0)[10:12]), 2)
    assert deferred.leased.progress() == {1: 6}

    assert samples_in((torch.zeros(4, 3), torch.zeros(4))) == 4
    assert samples_in({"input_ids": torch.zeros(5, 2, dtype=torch.long)}) == 5
    assert samples_in([[], (torch.zeros(()),)]) == 1 and samples_in("text") == 0


def test_a_unit_whose_last_sample_was_fetched_but_not_trained_comes_back_whole(
    server, client
) -> None:
    """Unit 1's last 2 samples and unit 2's first 2 went out with a read-ahead; 62 were
    trained. Unit 1 is not finished, and the next iteration hands out those 4 again, in
    order, before anything new; unit 1 finishes once they are trained."""
    from diloco.integrations.common import LeasedTrainSampler

    deferred = LeasedTrainSampler(LENGTH, "ds")
    leased = deferred.leased = sampler(client, lease_count=2, count_trained=True)
    fetched = take(iter(deferred), UNIT + 2)
    deferred.trained(UNIT - 2)
    assert leased.finished_units() == [] and leased.progress() == {1: UNIT - 2}
    again = iter(deferred)
    assert take(again, 4) == fetched[UNIT - 2 :]
    deferred.trained(2)
    assert leased.finished_units() == [1] and leased.progress() == {}
    deferred.trained(2)
    assert leased.progress() == {2: 2}


def _one_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()  # (the worker's hook counts the step of its round)
    optimizer.zero_grad()


def test_a_round_that_trained_units_an_eviction_took_is_dropped_not_sent(
    live_server, caplog
) -> None:
    """Evicted mid-round, after training all of unit 1: the server gave unit 1 back to the
    pool, and the next lease gets it again and trains it again, so the round's
    pseudo-gradient holds its samples twice (or, leased to another worker, once more on that
    worker). The round is dropped, never folded: the worker takes the server's weights and
    reports nothing, and unit 1, whose training went with the round, is trained once more
    from its first sample and reported by a later round."""
    with live_server(ServerSettings(sync_every=100)) as server:
        model, optimizer, worker, leased = _pausy(server.url)
        stream = iter(leased)
        first = take(stream, UNIT)  # all of unit 1
        _one_step(model, optimizer)
        server.coordinator.deregister("pausy")  # what an eviction does
        assert take(stream, UNIT) == first  # the lease finds the eviction: unit 1 again
        _one_step(model, optimizer)
        with caplog.at_level("WARNING", logger="diloco.worker"):
            worker.sync()
        assert server.coordinator.round_number == 0  # nothing folded
        assert worker._session.dropped_rounds == 1
        assert any("dropping its pseudo-gradient" in r.getMessage() for r in caplog.records)
        weights = decode_tensors(server.coordinator.weights().body)
        assert all(torch.equal(p.detach(), weights[n]) for n, p in model.named_parameters())
        # unit 1 is still leased to it, but its training went with the round: it is not
        # reported as trained, and is trained again, from its first sample
        assert leased.finished_units() == []
        assert [u["unit_id"] for u in server.coordinator.pool.leases_of("pausy")] == [1]
        assert take(stream, UNIT) == first and leased.finished_units() == [1]
        worker.close(final_sync=False)


def test_a_round_reporting_a_unit_leased_to_another_worker_since_is_dropped(
    live_server, caplog
) -> None:
    """Evicted after training unit 1, found out only by its submission (unknown_worker,
    then it registers again); the server gave unit 1 to w1 meanwhile. The round's report of
    unit 1 is refused (unit_not_leased); its pseudo-gradient, which holds unit 1's samples
    that w1 trains too, was sent again without it and folded. Now it is dropped, and unit 1
    forgotten."""
    with live_server(ServerSettings(sync_every=100)) as server:
        model, optimizer, worker, leased = _pausy(server.url)
        take(iter(leased), UNIT)  # all of unit 1
        _one_step(model, optimizer)
        server.coordinator.deregister("pausy")  # evicted: unit 1 back to the pool
        kinds = {name: "trainable" for name in model.state_dict()}
        specs = [s.to_json() for s in specs_of(model.state_dict(), kinds)]
        with DiLoCoClient(server.url) as other:
            other.register("w1", specs)
            assert [u["unit_id"] for u in other.lease("w1", "ds", 1)["units"]] == [1]
        with caplog.at_level("WARNING", logger="diloco.worker"):
            worker.sync()
        assert server.coordinator.round_number == 0  # nothing folded
        assert worker._session.dropped_rounds == 1
        assert any("work unit 1, no longer ours" in r.getMessage() for r in caplog.records)
        assert leased.finished_units() == []
        worker.close(final_sync=False)


def test_units_of_a_body_answered_committed_go_again_with_the_next_round(live_server) -> None:
    """Round 0's members are a and c; b joins after a's submission (not a member) and finishes
    unit 1. Round 0 commits with a and c, so b's body is answered "committed" and its unit
    goes with the open round 1, in the server's memory only (a restart before round 1
    commits loses it). b keeps it and reports it again with its round 1, which completes it,
    once."""

    def joined(name: str) -> tuple[DiLoCoWorker, torch.nn.Module, torch.optim.Optimizer]:
        model = torch.nn.Linear(2, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        return DiLoCoWorker(model, optimizer, server.url, worker_id=name), model, optimizer

    def in_background(worker: DiLoCoWorker) -> threading.Thread:
        thread = threading.Thread(target=worker.sync, daemon=True)
        thread.start()
        return thread

    with live_server(ServerSettings(sync_every=100)) as server:
        a, c = joined("a"), joined("c")
        for _, model, optimizer in (a, c):
            _one_step(model, optimizer)
        waiting = in_background(a[0])  # round 0's first submission: it waits for c
        deadline = time.monotonic() + 30
        while server.coordinator.round.first_submission_at is None:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        b, model_b, optimizer_b = joined("b")
        leased = LeasedSampler.for_worker(b, "ds", LENGTH, shuffle_seed=SEED, unit_size=UNIT)
        take(iter(leased), UNIT)  # all of unit 1
        _one_step(model_b, optimizer_b)
        sent = record_submits(b)
        c[0].sync()
        waiting.join(timeout=30)
        assert server.coordinator.round_number == 1
        b.sync()  # round 0, committed without it
        assert sent == ["1 committed"] and leased.finished_units() == [1]
        for _, model, optimizer in (a, c, (b, model_b, optimizer_b)):
            _one_step(model, optimizer)
        others = [in_background(a[0]), in_background(c[0])]
        b.sync()  # round 1, with a and c: unit 1 again
        for thread in others:
            thread.join(timeout=30)
        assert server.coordinator.round_number == 2
        assert sent == ["1 committed", "1 accepted"] and leased.finished_units() == []
        completions = server.coordinator.data_leases.pool.completions("ds")
        assert [(c["unit_id"], c["round"], c["worker_id"]) for c in completions] == [(1, 1, "b")]
        for worker in (a[0], b, c[0]):
            worker.close(final_sync=False)


def test_an_eviction_the_heartbeat_finds_drops_the_round_that_trains_its_units_again(
    live_server, caplog
) -> None:
    """Evicted after training unit 1, found out by its heartbeat (which registers again and
    says nothing to the data): the sampler went on with its stale queue, the next lease
    gave back unit 1 itself (released units are leased first), its report was accepted and
    the round folded with unit 1's samples in it twice. Now the heartbeat's rejoin tells
    the sampler, which lets its units go at its next sample, and the round is dropped."""
    with live_server(ServerSettings(sync_every=100)) as server:
        model, optimizer, worker, leased = _pausy(server.url)
        stream = iter(leased)
        first = take(stream, UNIT)  # all of unit 1
        _one_step(model, optimizer)
        server.coordinator.deregister("pausy")  # evicted: unit 1 back to the pool
        worker._session.rejoin()  # what its heartbeat does on unknown_worker
        assert take(stream, UNIT) == first  # leased again, trained again
        _one_step(model, optimizer)
        with caplog.at_level("WARNING", logger="diloco.worker"):
            worker.sync()
        assert server.coordinator.round_number == 0  # nothing folded
        assert worker._session.dropped_rounds == 1
        assert any("an eviction gave back" in r.getMessage() for r in caplog.records)
        assert leased.finished_units() == []  # trained again from its first sample, later
        assert take(stream, UNIT) == first and leased.finished_units() == [1]
        worker.close(final_sync=False)
