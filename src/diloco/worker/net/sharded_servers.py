"""A worker's client of sharded servers: one DiLoCoClient per shard, used as one.

The session (worker/session.py) calls it as it calls one server's client. A body is cut into
each shard's tensors (the layout every shard computes, wire/format/shard_layout.py) and the parts
go out in parallel; results and weights come back in parallel and are joined into one body.
A submission counts only once shard 0 confirmed that every shard holds its slice, and a
result is taken only once every shard has applied the round, so the worker never holds a
model made of two versions (docs/architecture.md, "Sharded servers").
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from diloco.wire import TensorSpec
from diloco.wire.compressed.body import join_bodies, split_body
from diloco.wire.format.shard_layout import shard_layout
from diloco.worker.errors import ServerError
from diloco.worker.net.client import DiLoCoClient, Weights
from diloco.worker.net.retry import RetryPolicy
from diloco.worker.net.transport import Body, ClientStats

log = logging.getLogger("diloco.worker")
T = TypeVar("T")
CONFIRM_TRIES = 20  # resending slices a shard lost (it restarted) before giving up
SAME_VERSION_SECONDS = 120.0  # how long weights may differ in version across shards
WAIT_REPORT_SECONDS = 60.0  # a follower's result unanswered this long is logged, and again


@dataclass
class _Pending:
    """The slices of the submission under way, kept to send again to a shard that lost one."""

    round: int
    worker_id: str
    parts: list[bytearray]
    tokens: int


class ShardedClient:
    """The DiLoCoClient calls a session makes, spread over every shard."""

    def __init__(self, clients: Sequence[DiLoCoClient], mode: str = "sync") -> None:
        """`mode`, the servers': async, where versions move while a worker fetches S parts,
        asks every shard for exactly the version shard 0 answered with; streaming, where
        each shard owns whole fragments, sends a fragment to its shard alone."""
        self.clients = list(clients)
        self.mode = mode
        self.exact_versions = mode == "async"
        self.fragment_owner: list[int] | None = None  # streaming: each fragment's shard
        self.leader = self.clients[0]
        self.auth = self.leader.auth  # the heartbeat's: heartbeats go to shard 0
        self.base_url = self.leader.base_url
        self.last_waiting: dict[str, Any] = {}
        self.layout: list[list[str]] | None = None
        self._pending: _Pending | None = None
        self._pool = ThreadPoolExecutor(len(self.clients), thread_name_prefix="diloco-shard")

    # ----------------------------------------------------------------- helpers

    def _each(self, call: Callable[[int, DiLoCoClient], T], shards: Sequence[int] = ()) -> list[T]:
        """`call` on every shard (or on `shards`) in parallel; the first failure is raised
        once all have ended (a retry then finds the others done: every call is idempotent)."""
        chosen = list(shards) or list(range(len(self.clients)))
        futures = [self._pool.submit(call, s, self.clients[s]) for s in chosen]
        errors = [f.exception() for f in futures]
        for error in errors:
            if error is not None:
                raise error
        return [f.result() for f in futures]

    def set_model(self, specs: Sequence[TensorSpec]) -> None:
        if self.mode != "streaming":  # (streaming: what the shards state, see _learn_layout)
            self.layout = shard_layout(list(specs), len(self.clients))

    def _learn_layout(self, infos: Sequence[Mapping[str, Any]]) -> None:
        """Streaming: the tensors and fragments each shard states it owns (known once the
        first worker registered)."""
        parts = [info.get("shards") or {} for info in infos]
        owned = [part.get("owned") for part in parts]
        fragments = [part.get("fragments") for part in parts]
        if any(o is None for o in owned) or any(f is None for f in fragments):
            return
        owner: dict[int, int] = {}
        for shard, mine in enumerate(fragments):
            for fragment in mine:
                if int(fragment) in owner:
                    raise ServerError(
                        200, "invalid_response", f"two shards state fragment {fragment}"
                    )
                owner[int(fragment)] = shard
        names = [name for part in owned for name in part]
        if sorted(owner) != list(range(len(owner))) or len(names) != len(set(names)):
            raise ServerError(
                200,
                "invalid_response",
                f"the shards' fragments {fragments} and tensors do not cut the model in parts "
                "(shards started apart?)",
            )
        self.layout = [list(names) for names in owned]
        self.fragment_owner = [owner[f] for f in range(len(owner))]

    def _streaming_infos(self) -> list[dict[str, Any]]:
        infos = self._each(lambda _s, client: client.info())
        self._learn_layout(infos)
        return infos

    def _owner(self, fragment: int) -> int:
        if self.fragment_owner is None:
            self._streaming_infos()
        if self.fragment_owner is None or not 0 <= fragment < len(self.fragment_owner):
            raise ServerError(
                200, "invalid_response", f"no shard states that it owns fragment {fragment}"
            )
        return self.fragment_owner[fragment]

    def _split(self, body: Body) -> list[bytearray]:
        """Each shard's slice of a body: its tensors, or a compressed body's parts of them."""
        assert self.layout is not None, "register first: the layout comes from the model"
        return split_body(body, self.layout)

    @staticmethod
    def _join(bodies: Sequence[bytearray]) -> bytearray:
        """The shards' weights, or their coded deltas, as one body."""
        try:
            return join_bodies(bodies)
        except ValueError as exc:
            raise ServerError(200, "invalid_response", f"the shards' bodies: {exc}") from None

    # ----------------------------------------------------------------- identity and counters

    @property
    def credential(self) -> str | None:
        return self.leader.credential

    @credential.setter
    def credential(self, value: str | None) -> None:
        self.leader.credential = value  # the other shards enroll again with the token

    @property
    def stats(self) -> ClientStats:
        """Every shard's counters added up (the largest upload: the largest one slice)."""
        snapshots = [client.stats for client in self.clients]
        merged: dict[str, float] = {}
        for snap in snapshots:
            for key, seconds in snap.blocked_by_operation.items():
                merged[key] = merged.get(key, 0.0) + seconds
        return ClientStats(
            bytes_sent=sum(snap.bytes_sent for snap in snapshots),
            bytes_received=sum(snap.bytes_received for snap in snapshots),
            blocked_seconds=max(snap.blocked_seconds for snap in snapshots),  # in parallel
            retries=sum(snap.retries for snap in snapshots),
            blocked_by_operation=merged,
            largest_upload=max(snap.largest_upload for snap in snapshots),
            body_seconds=max(snap.body_seconds for snap in snapshots),  # in parallel
        )

    # ----------------------------------------------------------------- shard 0's routes

    def info(self) -> dict[str, Any]:
        """Shard 0's; in streaming mode with the whole model's fragment plan and rounds, each
        fragment's from the shard that owns it."""
        if self.mode != "streaming":
            return self.leader.info()
        infos = self._streaming_infos()
        merged = dict(infos[0])
        plans = [info.get("fragment_plan") for info in infos]
        rounds = [info.get("fragment_rounds") or [] for info in infos]
        owner = self.fragment_owner
        whole = owner is not None and all(
            plan is not None and len(plan) == len(owner) == len(r)
            for plan, r in zip(plans, rounds, strict=True)
        )
        merged["fragment_plan"] = None  # until every shard states its part (the weights exist)
        if whole:
            assert owner is not None
            merged["fragment_plan"] = [plans[owner[f]][f] for f in range(len(owner))]
            merged["fragment_rounds"] = [rounds[owner[f]][f] for f in range(len(owner))]
        return merged

    def healthz(self) -> dict[str, Any]:
        return self.leader.healthz()

    def status(self) -> dict[str, Any]:
        return self.leader.status()

    def heartbeat(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return self.leader.heartbeat(*args, **kwargs)

    def register_dataset(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return self.leader.register_dataset(*args, **kwargs)

    def lease(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return self.leader.lease(*args, **kwargs)

    def leases(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return self.leader.leases(*args, **kwargs)

    # ----------------------------------------------------------------- every shard

    def register(
        self,
        worker_id: str | None,
        tensors: list[dict[str, Any]],
        protocol_version: int | None = None,
        *,
        session: str | None = None,
        waits_for_initial: bool = False,
    ) -> dict[str, Any]:
        """Shard 0 admits us (and names us); the others then register the same id. Every
        early worker offers its weights to sharded servers (`waits_for_initial` is not sent):
        shard 0 keeps the first and only its sender gives the other shards theirs."""
        self.set_model([TensorSpec.from_json(t) for t in tensors])
        extra = {} if protocol_version is None else {"protocol_version": protocol_version}
        first = self.leader.register(worker_id, tensors, session=session, **extra)
        named = first["worker_id"]
        rest = self._each(
            lambda _s, client: client.register(named, tensors, session=session, **extra),
            range(1, len(self.clients)),
        )
        needs = [bool(first["needs_initial_weights"])] + [r["needs_initial_weights"] for r in rest]
        self._needs_initial = needs
        if self.mode == "streaming":
            self._streaming_infos()
        return {**first, "needs_initial_weights": any(needs)}

    def upload_initial(self, worker_id: str, body: Body) -> dict[str, Any]:
        """Shard 0 takes the first weights it gets; only the worker it took them from sends
        the other shards theirs, so no shard starts from another worker's model."""
        parts = self._split(body)
        answer = self.leader.upload_initial(worker_id, parts[0])
        # ours, or ours whose answer was lost (a retry then finds them there): we send the rest
        if answer.get("status") == "exists" and answer.get("initial_from") != worker_id:
            return answer  # another worker's weights: it sends the other shards theirs
        needy = [s for s in range(1, len(self.clients)) if self._needs_initial[s]]
        self._each(lambda s, client: client.upload_initial(worker_id, parts[s]), needy)
        return {"status": "accepted"}

    def get_weights_detail(self, into: bytearray | None = None) -> Weights:
        """Every shard's weights at one version: a shard still applying the last decision
        (or still waiting for its first weights) is asked again."""
        if self.exact_versions:
            return self._weights_of_one_version()
        if self.mode == "streaming":
            return self._weights_of_fragments()
        deadline = time.monotonic() + SAME_VERSION_SECONDS
        while True:
            try:
                got = self._each(lambda _s, client: client.get_weights_detail())
            except ServerError as exc:
                if exc.kind != "no_weights" or time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
                continue
            rounds = {weights.round for weights in got}
            if len(rounds) == 1:
                return Weights(self._join([w.body for w in got]), got[0].round)
            if time.monotonic() > deadline:
                raise ServerError(
                    200,
                    "shards_apart",
                    f"the shards' weights stayed at different versions {sorted(rounds)} for "
                    f"{SAME_VERSION_SECONDS:g} s",
                )
            time.sleep(0.05)

    def _weights_of_fragments(self) -> Weights:
        """Streaming: every shard's fragments as they are (each fragment has its own round,
        taken from the shard that owns it)."""
        deadline = time.monotonic() + SAME_VERSION_SECONDS
        while True:
            try:
                got = self._each(lambda _s, client: client.get_weights_detail())
                break
            except ServerError as exc:
                if exc.kind != "no_weights" or time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        owner = self.fragment_owner
        if owner is None:
            self._streaming_infos()
            owner = self.fragment_owner
        if owner is None:
            raise ServerError(200, "invalid_response", "the shards state no fragments")
        rounds = [w.fragment_rounds or [] for w in got]
        if any(len(r) != len(owner) for r in rounds):
            raise ServerError(200, "invalid_response", f"the shards state fragment rounds {rounds}")
        fragment_rounds = [rounds[owner[f]][f] for f in range(len(owner))]
        return Weights(self._join([w.body for w in got]), got[0].round, fragment_rounds)

    def _weights_of_one_version(self) -> Weights:
        """Async: shard 0's current weights, then every other shard's part of exactly that
        version (a shard not there yet is asked again; one past it serves a version it kept;
        one that no longer keeps it sends us back to shard 0)."""
        deadline = time.monotonic() + SAME_VERSION_SECONDS
        while True:
            first = self.leader.get_weights_detail()

            def part(
                _shard: int, client: DiLoCoClient, version: int = first.round
            ) -> Weights | None:
                while True:
                    try:
                        return client.get_weights_detail(version=version)
                    except ServerError as exc:
                        if exc.kind == "version_gone":
                            return None
                        if exc.kind not in ("future_round", "no_weights"):
                            raise
                        if time.monotonic() > deadline:
                            raise
                        time.sleep(0.05)

            rest = self._each(part, range(1, len(self.clients)))
            if all(got is not None for got in rest):
                bodies = [first.body, *[got.body for got in rest if got is not None]]
                return Weights(self._join(bodies), first.round)
            if time.monotonic() > deadline:
                raise ServerError(
                    200,
                    "shards_apart",
                    f"the shards kept no common version for {SAME_VERSION_SECONDS:g} s",
                )

    def submit(
        self,
        round: int,
        worker_id: str,
        body: Body,
        *,
        fragment: int = 0,
        tokens: int = 0,
        units: Sequence[int] = (),
        progress: Mapping[int, int] | None = None,
    ) -> dict[str, Any]:
        """Every shard's slice in parallel (work units go to shard 0), then the confirmation
        on shard 0: its answer is the submission's ("committed": the round went on without
        us)."""
        if self.mode == "streaming":  # the fragment's shard alone commits its round
            return self.clients[self._owner(fragment)].submit(
                round, worker_id, body, fragment=fragment, tokens=tokens
            )
        parts = self._split(body)
        self._pending = _Pending(round, worker_id, parts, tokens)

        def send(shard: int, client: DiLoCoClient) -> dict[str, Any]:
            reports = {"units": units, "progress": progress} if shard == 0 else {}
            return client.submit(round, worker_id, parts[shard], tokens=tokens, **reports)

        self._each(send)
        # Confirmed even when shard 0 says the round committed: its answer then says whether
        # the decision used our slices (a retry after a lost answer) or went on without us.
        for attempt in range(CONFIRM_TRIES):
            if attempt:
                time.sleep(min(2.0, 0.1 * 2**attempt))
            try:
                return self.leader.confirm(round, worker_id)
            except ServerError as exc:
                detail = exc.detail if isinstance(exc.detail, dict) else {}
                if exc.kind not in ("not_prepared", "not_submitted"):
                    raise
                # not_submitted: shard 0 itself lost our slice (it restarted since)
                lost = [int(s) for s in detail.get("shards", [0])]
                log.warning("shard(s) %s lost our slice of round %d; sending again", lost, round)
                self._each(send, lost)
        raise ServerError(409, "not_prepared", f"shards kept losing our slice of round {round}")

    def wait_result(
        self,
        round: int,
        worker_id: str,
        wait: float = 30.0,
        *,
        fragment: int = 0,
        into: bytearray | None = None,
        have: int | None = None,
    ) -> Weights | None:
        """Shard 0's result (None while the round is open), then every other shard's (async:
        of exactly the version shard 0 answered with; shard 0 is asked again when a shard
        no longer keeps it)."""
        if self.mode == "streaming":
            client = self.clients[self._owner(fragment)]
            got = client.wait_result(
                round, worker_id, wait, fragment=fragment, into=into, have=have
            )
            self.last_waiting = client.last_waiting
            return got
        deadline = time.monotonic() + SAME_VERSION_SECONDS
        for attempt in range(1_000_000):
            if attempt:  # a shard moved on past what it keeps: back off, then again
                time.sleep(min(2.0, 0.05 * 2**attempt))
            first = self.leader.wait_result(round, worker_id, wait, have=have)
            self.last_waiting = self.leader.last_waiting
            if first is None:
                return None
            version = first.round if self.exact_versions else None
            rest = self._each(
                lambda s, _client, v=version: self._follower_result(
                    s, round, worker_id, wait, v, have
                ),
                range(1, len(self.clients)),
            )
            if all(got is not None for got in rest):
                got = [first, *[weights for weights in rest if weights is not None]]
                joined = self._joined_result(got, round, worker_id, version)
                if joined is not None:
                    return joined
            log.info("a shard moved past version %d before we took it; again", first.round)
            if time.monotonic() > deadline:
                break
        raise ServerError(
            200,
            "shards_apart",
            f"the shards kept no common version for {SAME_VERSION_SECONDS:g} s (they move on "
            "faster than a download; fewer, larger steps: --grace-seconds)",
        )

    def _joined_result(
        self, got: list[Weights], round: int, worker_id: str, version: int | None
    ) -> Weights | None:
        """Every shard's result as one: their coded deltas joined when each sent one against
        the same round (a shard sends one only when our anchor is its last step's start);
        else their full weights, asking a shard that sent a delta for its weights instead
        (None, to ask again, when an async shard no longer keeps that version)."""
        rounds = {weights.round for weights in got}
        if len(rounds) != 1:  # sync shards apply one decision: never expected
            raise ServerError(
                200, "shards_apart", f"the shards answered round {round} with {sorted(rounds)}"
            )
        deltas = {weights.delta_from for weights in got}
        if len(deltas) == 1:
            return Weights(
                self._join([w.body for w in got]), got[0].round, delta_from=got[0].delta_from
            )
        try:
            full = [
                weights
                if weights.delta_from is None
                else self.clients[shard].wait_result(round, worker_id, 0.0, version=version)
                for shard, weights in enumerate(got)
            ]
        except ServerError as exc:
            if exc.kind != "version_gone":
                raise
            return None
        if any(
            weights is None or weights.delta_from is not None or weights.round != got[0].round
            for weights in full
        ):
            raise ServerError(
                200, "invalid_response", f"a shard gave no whole weights of round {round}"
            )
        return Weights(self._join([w.body for w in full if w is not None]), got[0].round)

    def _follower_result(
        self,
        shard: int,
        round: int,
        worker_id: str,
        wait: float,
        version: int | None,
        have: int | None = None,
    ) -> Weights | None:
        """A shard's result of a round shard 0 decided (None: it no longer keeps `version`);
        a slice it lost goes again."""
        client = self.clients[shard]
        started = time.monotonic()
        next_report = started + WAIT_REPORT_SECONDS
        while True:
            if time.monotonic() >= next_report:
                next_report = time.monotonic() + WAIT_REPORT_SECONDS
                log.warning(
                    "shard %d has not applied shard 0's decision of round %d after %.0f s "
                    "(it waits for a decided slice that a restart lost, from a worker that "
                    "has not sent it again?)",
                    shard,
                    round,
                    time.monotonic() - started,
                )
            try:
                got = client.wait_result(round, worker_id, wait, version=version, have=have)
            except ServerError as exc:
                if exc.kind == "version_gone":
                    return None
                pending = self._pending
                if exc.kind != "not_submitted" or pending is None or pending.round != round:
                    raise
                log.warning("shard %d lost our slice of round %d; sending again", shard, round)
                client.submit(round, worker_id, pending.parts[shard], tokens=pending.tokens)
                continue
            if got is not None:
                return got

    def deregister(self, worker_id: str) -> dict[str, Any]:
        answers = self._each(lambda _s, client: client.deregister(worker_id))
        return answers[0]

    @property
    def retry(self) -> RetryPolicy:
        """The policy the shards' calls retry under (the same for each)."""
        return self.leader.retry

    @retry.setter
    def retry(self, policy: RetryPolicy) -> None:
        for client in self.clients:
            client.retry = policy

    def close(self) -> None:
        for client in self.clients:
            client.close()
        self._pool.shutdown(wait=False)

    @property
    def closed(self) -> bool:
        return self.leader.closed


def shard_urls(info: Mapping[str, Any]) -> list[str] | None:
    """The shards' URLs a server's /v1/info states (None: one server)."""
    shards = info.get("shards")
    if not isinstance(shards, Mapping):
        return None
    urls = shards.get("urls")
    if not isinstance(urls, list) or len(urls) < 2 or not all(isinstance(u, str) for u in urls):
        raise ServerError(200, "invalid_response", f"/v1/info states shards without URLs: {shards}")
    return list(urls)


def clients_of_shards(
    info: Mapping[str, Any],
    client: DiLoCoClient,
    connect: Callable[[str, float | None], DiLoCoClient],
) -> ShardedClient | None:
    """None for one server; for sharded servers (their /v1/info names every shard, so a
    worker needs one URL) a client of each, made by `connect(url, upload cap)`: the link's
    cap is shared by the parallel uploads. `client` (the first one's) is closed then."""
    urls = shard_urls(info)
    if urls is None:
        return None
    cap = client.max_upload_mbps
    client.close()
    sharded = ShardedClient(
        [connect(url, None if cap is None else cap / len(urls)) for url in urls],
        mode=str(info.get("mode", "sync")),
    )
    sharded.credential = client.credential  # one a checkpoint brought back, for shard 0
    return sharded
