"""Server-dispatched data: a torch Sampler whose indices come from work units the server leases.

The server is the authority over which samples are trained: it cuts a dataset into units of a
seeded permutation and leases them. `LeasedSampler` yields the indices of its leased units, so
any `DataLoader(dataset, sampler=...)` trains them; a unit counts as finished once its last
index has been handed out (with a prefetching DataLoader that is a few batches before it is
trained), and the worker reports finished units with its next pseudo-gradient: they complete
when that round commits, so a worker that dies earlier loses no data for the run (its leases
go back to the pool).

The sampler runs in the training process (DataLoader iterates samplers in the main process even
with worker processes), and the DiLoCoWorker reads `finished_units()` from the same thread at
its sync, so there is no cross-process state. One sampler per worker; under torch.distributed
only rank 0 holds a client, so use it in single-process workers.

With `count_trained=True` the sampler reports what was trained, not what was handed out: the
training loop calls `trained(n)` as it consumes samples (the transformers callback counts its
model's training forwards), and units finish, prefixes are reported and checkpoints are taken
as of that count. A loop that reads ahead (accelerate fetches the next batch early, DataLoader
workers prefetch) then neither reports nor loses the samples it fetched but never trained.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import torch
from torch.utils.data import IterableDataset, Sampler, get_worker_info

from diloco.worker.errors import ServerError

log = logging.getLogger("diloco.worker")

__all__ = ["LeasedBatches", "LeasedDataset", "LeasedSampler"]


class LeaseClient(Protocol):
    def register_dataset(
        self, worker_id: str, dataset_id: str, length: int, shuffle_seed: int, unit_size: int
    ) -> dict[str, Any]: ...

    def lease(
        self, worker_id: str, dataset_id: str, count: int = 1, next_epoch: bool = False
    ) -> dict[str, Any]: ...


class WorkerLeaseClient(LeaseClient, Protocol):
    def leases(self, worker_id: str, dataset_id: str) -> dict[str, Any]: ...


class SavedWorker(Protocol):
    @property
    def extra(self) -> Mapping[str, Any]: ...


class LeasingWorker(Protocol):
    """What `LeasedSampler.for_worker` uses of a DiLoCoWorker."""

    data: Any  # the source whose finished units the worker reports with its submissions

    @property
    def client(self) -> WorkerLeaseClient | None: ...

    @property
    def worker_id(self) -> str: ...  # set once the worker has joined

    @property
    def sample_trace(self) -> object | None: ...

    @property
    def resumed(self) -> SavedWorker | None: ...

    @property
    def dropped_round(self) -> bool: ...  # the resumed round's steps were dropped

    def rejoin(self) -> None: ...


class LeasedSampler(Sampler[int]):
    """Indices of leased work units; one `iter()` is one epoch as this worker sees it.

    An iteration ends when the server answers that the epoch has nothing left to lease (other
    workers may still be finishing theirs); the next iteration opens the next epoch, whose
    permutation is a new one derived from the seed.
    """

    def __init__(
        self,
        client: LeaseClient,
        worker_id: str | Callable[[], str],
        dataset_id: str,
        length: int,
        *,
        shuffle_seed: int = 0,
        unit_size: int = 256,
        lease_count: int = 1,
        count_trained: bool = False,
    ) -> None:
        if isinstance(lease_count, bool) or not isinstance(lease_count, int) or lease_count < 1:
            raise ValueError(f"lease_count must be an integer >= 1, got {lease_count!r}")
        self.client = client
        self._worker_id = worker_id if callable(worker_id) else (lambda: worker_id)
        self.dataset_id = dataset_id
        self.length = length
        self.lease_count = lease_count
        self.dataset = client.register_dataset(
            self._worker_id(), dataset_id, length, shuffle_seed, unit_size
        )
        self._lock = threading.Lock()
        self._queue: list[dict] = []  # leased units not yet finished, the current one first
        self._offset = 0  # indices of the current unit already handed out
        self._finished: list[int] = []  # finished, not yet reported
        # samples of units an eviction gave back to the pool were trained (see
        # take_lost_training): the round's pseudo-gradient holds them
        self._lost_training = False
        self._evicted = False  # the server evicted us: let our leases go (_let_go_if_evicted)
        # (unit, samples of it trained) as the last report asked (`progress`), and as the
        # last submission the server folded carried it (`reported`)
        self._progress_asked: tuple[int, int] | None = None
        self._progress_reported: tuple[int, int] | None = None
        self._open_next_epoch = False
        self.rejoin: Callable[[], None] | None = None  # re-register after an eviction
        self.trace: list[tuple[int, int]] | None = None  # (epoch, index) handed out, if traced
        self.epoch = int(self.dataset.get("epoch", 0))
        # count_trained: the samples handed out and not yet trained, oldest first, as
        # (unit, position in it); units finish as `trained` consumes them
        self.count_trained = count_trained
        self._in_flight: deque[tuple[dict, int]] = deque()
        self._round_start: dict | None = None  # count_trained: the state as the round began

    @classmethod
    def for_worker(
        cls, worker: LeasingWorker, dataset_id: str, length: int, **options: Any
    ) -> LeasedSampler:
        """A sampler on `worker`'s connection whose finished units `worker` reports."""
        client = worker.client
        if client is None:
            raise ValueError("a LeasedSampler needs the worker's leader process (rank 0)")
        sampler = cls(client, lambda: worker.worker_id, dataset_id, length, **options)
        sampler.rejoin = worker.rejoin
        worker.data = sampler
        if worker.sample_trace is not None:
            sampler.trace = []
        resumed = worker.resumed
        saved = None if resumed is None else resumed.extra.get("data")
        if saved is not None and saved.get("dataset_id") == dataset_id:
            if worker.dropped_round and saved.get("round_start") is not None:
                # The steps trained into the saved round were dropped (the server went on):
                # so were the samples they trained, which the round's start still holds.
                saved = saved["round_start"]
            sampler.load_state_dict(saved)  # the leases it held stay leased to the same id
            # Rounds may have committed since the checkpoint (with our submission in them, or
            # without us after an eviction): the server's leases say what is left to train.
            sampler.reconcile(client.leases(worker.worker_id, dataset_id)["units"])
        sampler.round_started()
        return sampler

    def __iter__(self) -> Iterator[int]:
        next_epoch, self._open_next_epoch = self._open_next_epoch, False
        while True:
            if self._evicted:  # (a flag's read: no lock per sample on the training thread)
                with self._lock:
                    self._let_go_if_evicted()
            if not self._queue:
                reply = self._lease(next_epoch)
                next_epoch = False
                self.epoch = int(reply.get("epoch", self.epoch))
                if reply["status"] != "leased" or not reply["units"]:
                    self._open_next_epoch = True
                    return
                with self._lock:
                    self._queue.extend(reply["units"])
            unit = self._queue[0]
            indices = unit["indices"]
            index = indices[self._offset] if self._offset < len(indices) else None
            with self._lock:
                if index is not None and self.count_trained:
                    self._in_flight.append((unit, self._offset))
                self._offset += 1
                if self._offset >= len(indices):
                    # Its last index goes out now: finished before the caller gets it, so a
                    # sync right after this batch reports it (not a generator step later).
                    self._queue.pop(0)
                    self._offset = 0
                    if not self.count_trained:
                        self._finish(unit)
            if index is not None:
                if self.trace is not None and not self.count_trained:
                    self.trace.append((int(unit["epoch"]), int(index)))
                yield index

    def _finish(self, unit: dict) -> None:
        if int(unit["unit_id"]) not in self._finished:
            self._finished.append(int(unit["unit_id"]))

    def give_back_untrained(self) -> None:
        """A new iteration begins (count_trained): what the last one handed out and nothing
        trained (a dataloader's read-ahead, abandoned with its iterator) comes out again
        first, in its order."""
        with self._lock:
            if self._in_flight:
                queue, offset = self._trained_position()
                self._queue, self._offset = list(queue), offset
                self._in_flight.clear()

    def round_started(self) -> None:
        """A round begins (count_trained): a checkpoint inside it keeps the position it began
        at, for a resume that drops the round's steps."""
        if self.count_trained:
            state = self.state_dict()
            state.pop("round_start", None)
            self._round_start = state

    def trained(self, samples: int) -> None:
        """`samples` more of those handed out were trained, in the order they went out
        (count_trained only)."""
        with self._lock:
            if samples > len(self._in_flight):
                log.warning(
                    "%d samples trained, but only %d were handed out and not yet trained",
                    samples,
                    len(self._in_flight),
                )
            for _ in range(min(samples, len(self._in_flight))):
                unit, position = self._in_flight.popleft()
                if self.trace is not None:
                    self.trace.append((int(unit["epoch"]), int(unit["indices"][position])))
                if position == len(unit["indices"]) - 1:
                    self._finish(unit)

    def _lease(self, next_epoch: bool) -> dict:
        try:
            return self.client.lease(
                self._worker_id(), self.dataset_id, self.lease_count, next_epoch=next_epoch
            )
        except ServerError as exc:
            if exc.kind != "unknown_worker" or self.rejoin is None:
                raise
        # Evicted (a long pause, a partition): the server gave our leases to the pool, so
        # the units queued here are no longer ours. Come back under the same id and lease anew.
        log.warning("evicted while leasing work units; registering again")
        self.rejoin()
        with self._lock:
            self._evicted = True
            self._let_go_if_evicted()
        return self.client.lease(
            self._worker_id(), self.dataset_id, self.lease_count, next_epoch=next_epoch
        )

    # ----------------------------------------------------------------- for the DiLoCoWorker

    def drain_trace(self) -> list[tuple[int, int]]:
        """The (epoch, index) samples handed out since the last call (tracing on)."""
        with self._lock:
            drained, self.trace = self.trace or [], [] if self.trace is not None else None
        return drained

    def finished_units(self) -> list[int]:
        with self._lock:
            return list(self._finished)

    def progress(self) -> dict[int, int]:
        """The unit being trained, if it is under way: unit -> samples of it trained so far
        (counted from the unit's first sample). Reported with a submission, the committed
        round records that prefix, and only the rest is ever leased again."""
        with self._lock:
            queue, offset = self._trained_position()
            if not queue or offset == 0:
                self._progress_asked = None
                return {}
            unit = queue[0]
            self._progress_asked = (int(unit["unit_id"]), offset)
            return {int(unit["unit_id"]): int(unit.get("start", 0)) + offset}

    def _trained_position(self) -> tuple[list[dict], int]:
        """The units not yet wholly trained and the samples of the first one trained: what a
        report and a checkpoint speak of (with count_trained, samples handed out but not yet
        trained go back in front)."""
        if not self._in_flight:
            return self._queue, self._offset
        units: list[dict] = []
        for unit, _ in self._in_flight:
            if not any(unit is seen for seen in units):
                units.append(unit)
        pending = [u for u in units if not any(u is live for live in self._queue)]
        return pending + self._queue, self._in_flight[0][1]

    def reconcile(self, leased: Sequence[dict]) -> None:
        """Take the server's view of our leases (after a resume): units it no longer leases
        to us (completed, or released at an eviction) are dropped, and every unit restarts
        at the samples it still has to train, as the server counts them (its `start`), less
        those trained since that the resumed model holds (a checkpoint inside a round);
        units leased to us since the checkpoint follow ours."""
        held = {int(unit["unit_id"]): dict(unit) for unit in leased}
        with self._lock:
            current = self._queue[0] if self._queue else None
            self._finished = [u for u in self._finished if u in held]
            order = [int(u["unit_id"]) for u in self._queue if int(u["unit_id"]) in held]
            order += [u for u in sorted(held) if u not in order and u not in self._finished]
            self._queue = [held[u] for u in order if held[u]["indices"]]
            offset, self._offset = self._offset, 0
            if current is not None and self._queue:
                first = self._queue[0]
                if int(first["unit_id"]) == int(current["unit_id"]):
                    recorded = int(first.get("start", 0)) - int(current.get("start", 0))
                    self._offset = max(0, min(offset - recorded, len(first["indices"]) - 1))
            self._in_flight.clear()

    def evicted(self) -> None:
        """The server evicted us (the heartbeat's thread, or a call, found out and registered
        again): the leases we held went back to the pool. The training thread lets them go
        at its next sample or sync, not this thread under its feet."""
        with self._lock:
            self._evicted = True

    def _let_go_if_evicted(self) -> None:
        """(lock held) After an eviction: queued, in flight, or finished and unreported, none
        of our units is ours now; if any of it was trained, this round's pseudo-gradient holds
        samples of units anyone may lease again (`take_lost_training`)."""
        if not self._evicted:
            return
        self._evicted = False
        current = int(self._queue[0]["unit_id"]) if self._queue else None
        reported = self._progress_reported
        folded = reported[1] if reported is not None and reported[0] == current else 0
        trained = bool(self._finished or self._in_flight or self._offset > folded)
        self._lost_training = self._lost_training or trained
        self._progress_asked = self._progress_reported = None
        self._queue.clear()
        self._offset = 0
        self._in_flight.clear()
        self._finished.clear()

    def take_lost_training(self) -> bool:
        """Whether samples of units an eviction gave back to the pool (to be leased again,
        maybe to another worker) were trained since the last call: the round's
        pseudo-gradient holds them, so the worker drops it instead of sending it (else those
        samples would count twice). Cleared by the call."""
        with self._lock:
            self._let_go_if_evicted()
            lost, self._lost_training = self._lost_training, False
        return lost

    def keep_lost_training(self) -> None:
        """A drop that `take_lost_training` called for did not happen (its fetch of the
        server's weights failed): the next sync asks again."""
        with self._lock:
            self._lost_training = True

    def round_dropped(self) -> None:
        """The round's pseudo-gradient was dropped, not folded (a rebase onto an older
        server, a round that trained units an eviction took, an anchor a delta left torn):
        the units it finished are in no model now. Those still leased to us are not
        reported but trained again, from where the server's records start them, after the
        unit under way; units no longer ours are let go. The unit under way keeps its
        position (its samples handed out may sit in a loader's read-ahead: rewinding it
        could train them twice; those trained in the dropped round are lost instead)."""
        leased = self.client.leases(self._worker_id(), self.dataset_id)["units"]
        held = {int(unit["unit_id"]): dict(unit) for unit in leased}
        with self._lock:
            again = [held[u] for u in self._finished if u in held and held[u]["indices"]]
            self._finished.clear()
            current = self._queue[:1]
            if current and int(current[0]["unit_id"]) not in held:
                current, self._offset = [], 0
            later = [u for u in self._queue[1:] if int(u["unit_id"]) in held]
            self._queue = current + again + later

    def reported(self, units: Sequence[int]) -> None:
        """The round that carried `units` committed: they are completed on the server."""
        done = set(units)
        with self._lock:
            self._finished = [u for u in self._finished if u not in done]
            self._progress_reported = self._progress_asked

    def forget(self, units: Sequence[int]) -> None:
        """Units the server no longer leases to us (we were evicted): not ours to report, nor
        to train on."""
        gone = set(units)
        with self._lock:
            self._finished = [u for u in self._finished if u not in gone]
            if self._queue and int(self._queue[0]["unit_id"]) in gone:
                self._offset = 0
            self._queue = [u for u in self._queue if int(u["unit_id"]) not in gone]
            self._in_flight = deque(e for e in self._in_flight if int(e[0]["unit_id"]) not in gone)

    # ----------------------------------------------------------------- worker checkpoint

    def state_dict(self) -> dict:
        """JSON-able: the leases held, the position in the current one, what is unreported."""
        with self._lock:
            queue, offset = self._trained_position()
            state = {
                "dataset_id": self.dataset_id,
                "queue": [dict(unit) for unit in queue],
                "offset": offset,
                "finished": list(self._finished),
                "open_next_epoch": self._open_next_epoch,
                "epoch": self.epoch,
            }
            if self.count_trained:
                state["round_start"] = self._round_start
                if self.trace is not None:
                    state["trace"] = [list(sample) for sample in self.trace]  # trained, unsent
            return state

    def load_state_dict(self, state: dict) -> None:
        if state.get("dataset_id") != self.dataset_id:
            raise ValueError(
                f"the saved sampler state is for dataset {state.get('dataset_id')!r}, "
                f"not {self.dataset_id!r}"
            )
        with self._lock:
            self._queue = [dict(unit) for unit in state["queue"]]
            self._offset = int(state["offset"])
            self._finished = [int(u) for u in state["finished"]]
            self._open_next_epoch = bool(state["open_next_epoch"])
            self.epoch = int(state["epoch"])
            self._in_flight.clear()
            if self.trace is not None and "trace" in state:
                self.trace = [(int(e), int(i)) for e, i in state["trace"]]


class LeasedBatches:
    """`next_batch()` over a map-style dataset of (x, y) pairs in leased order, epoch after epoch.

    The interface of `diloco.data.BatchSampler`, so the bundled recipe trains either way.
    """

    def __init__(self, dataset: Any, sampler: LeasedSampler, batch_size: int) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.dataset = dataset
        self.sampler = sampler
        self.batch_size = batch_size
        self._indices = iter(sampler)
        self.epochs_seen = 0

    def _next_index(self) -> int:
        for _ in range(2):  # at most one epoch boundary per index
            try:
                return next(self._indices)
            except StopIteration:
                self.epochs_seen += 1
                self._indices = iter(self.sampler)
        raise RuntimeError(f"dataset {self.sampler.dataset_id!r} gave no units in a new epoch")

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        pairs = [self.dataset[self._next_index()] for _ in range(self.batch_size)]
        return torch.stack([x for x, _ in pairs]), torch.stack([y for _, y in pairs])


class LeasedDataset(IterableDataset):
    """The samples of a map-style `dataset` in leased order, one epoch per iteration.

    For loops that want an IterableDataset. Use it with `num_workers=0`: DataLoader worker
    processes would each hold a copy of the sampler and report nothing back; with worker
    processes, pass the `LeasedSampler` as `sampler=` instead (it stays in this process).
    """

    def __init__(self, dataset: Any, sampler: LeasedSampler) -> None:
        self.dataset = dataset
        self.sampler = sampler

    def __iter__(self) -> Iterator[Any]:
        if get_worker_info() is not None:
            raise RuntimeError(
                "LeasedDataset cannot run in DataLoader worker processes (num_workers > 0); "
                "use DataLoader(dataset, sampler=LeasedSampler(...)) instead"
            )
        for index in self.sampler:
            yield self.dataset[index]
