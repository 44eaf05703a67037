"""DiLoCoWorker: turns any torch optimizer loop into a DiLoCo worker.

A post-step hook counts optimizer steps (so gradient accumulation is handled: H counts steps,
not batches). The server's mode decides what happens then:
- sync: every H steps the worker sends anchor - local in the server's upload dtype, waits for
  the round's result and loads it as both the model and the new anchor;
- async: the same exchange, but the server applies the arrival at once (no barrier), and with
  DyLU the server's heartbeat answers set this worker's H for its next window;
- streaming: fragments are sent on a staggered schedule from a background thread and merged
  tau steps later (`worker.streaming`).
The anchor lives on the CPU in fp32. A network failure retries the same submission under the
same (worker, round, fragment) key, and an eviction re-registers under the same id: local
progress is never thrown away.

The worker is a facade over one part per job: `ServerSession` (join, submit, await, rebase),
`Anchor` (the global weights the model started from; `ShardedAnchor` under FSDP2), a schedule
(`EveryH`, `DyLU`, or the `FragmentStreamer`'s windows), `TokenTally`, `UnitReports` (work
units), `Pace` (blocked time, window speeds), `Resumption` (its own checkpoints,
worker/state/resumption.py) and `Heartbeat`. It wires them together and owns the optimizer hook,
the step count and the report.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any, TypeVar

import torch
from torch import nn

from diloco.algorithm import classify_tensors
from diloco.algorithm.compression import fused_int8
from diloco.wire import WireError, decode_tensors, encode_tensors, specs_of
from diloco.worker.anchor import (
    Anchor,
    anchor_copies,
    choose_anchor_device,
    parse_anchor_device,
)
from diloco.worker.data.tokens import TokenTally
from diloco.worker.data.trace import SampleTrace
from diloco.worker.data.units import ReportsUnits, UnitReports
from diloco.worker.errors import AnchorTorn
from diloco.worker.heartbeat import Heartbeat
from diloco.worker.net.client import MAX_RESULT_WAIT, DiLoCoClient
from diloco.worker.net.retry import RetryPolicy
from diloco.worker.net.sharded_servers import ShardedClient, clients_of_shards
from diloco.worker.net.transport import ClientStats
from diloco.worker.pace import Pace
from diloco.worker.parallel import distributed
from diloco.worker.parallel.fsdp import (
    ShardedAnchor,
    check_sharded_settings,
    is_sharded,
    refuse_fsdp1,
)
from diloco.worker.round_log import RoundLines, joined_line, log_recovered
from diloco.worker.schedule import DyLU, EveryH
from diloco.worker.session import Exchanged, ServerSession, SubmitAnswer, wait_report_seconds
from diloco.worker.settings import WorkerSettings
from diloco.worker.state.checkpoint import WorkerCheckpoint
from diloco.worker.state.resumption import Progress, Rejoined, Resumption
from diloco.worker.streaming import FragmentStreamer
from diloco.worker.upload_coder import UploadCoder

log = logging.getLogger("diloco.worker")
T = TypeVar("T")


def _log_retry(operation: str, cause: BaseException | int, delay: float) -> None:
    """A worker that waits on the server says why, so a stuck barrier is never silent."""
    reason = getattr(cause, "error", None) or cause
    log.warning("%s: %s; retrying in %.1f s", operation, reason, delay)


def _unwrap(model: nn.Module) -> nn.Module:
    """DDP / FSDP-style wrappers keep the real module in `.module`; its names are canonical."""
    return model.module if isinstance(getattr(model, "module", None), nn.Module) else model


def _refuse_tied_tensors(model: nn.Module) -> None:
    """Streaming merges fragments one at a time: two names of one tensor (GPT-2's tied input
    and output embeddings) may sit in two fragments, and each merge would move both."""
    names_by_storage: dict[tuple[int, int], list[str]] = {}
    for name, tensor in model.state_dict().items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        names_by_storage.setdefault(key, []).append(name)
    tied = [names for names in names_by_storage.values() if len(names) > 1]
    if tied:
        raise ValueError(
            f"streaming mode cannot sync tied tensors ({', '.join(tied[0])} share memory) as "
            "separate fragments; untie them (transformers: tie_word_embeddings false) or use "
            "sync or async mode"
        )


class DiLoCoWorker:
    """One DiLoCo worker (one process, or one torch.distributed group led by rank 0)."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        server_url: str,
        worker_id: str | None = None,
        token: str | None = None,
        *,
        retry: RetryPolicy | None = None,
        result_wait: float = 30.0,
        heartbeat: bool = True,
        data: ReportsUnits | None = None,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        scheduler: Any = None,
        fragment_timeout: float | None = None,
        max_upload_mbps: float | None = None,
        ca_file: str | os.PathLike[str] | None = None,
        save_every_round: bool = True,
        anchor_device: str | torch.device = "auto",
        wait_report_after: float | None = None,
    ) -> None:
        """`checkpoint_dir`: after every round (unless `save_every_round` is False: then only
        when `save_checkpoint` is called, e.g. with a trainer's own checkpoints) the worker
        saves its inner optimizer (and `scheduler`) state, RNG state, step, round, session and
        data position there, and a worker started on the same directory resumes from it under
        the same id (see diloco.worker.state.checkpoint); a saved state that does not fit is ignored
        with a warning. In a torch.distributed group every rank passes it (with
        save_every_round False): rank 0 saves and loads the state, and the other ranks'
        model, optimizer and RNG are their trainer's to restore.

        `fragment_timeout` (streaming): the longest a merge waits for its fragment's sync
        before it gives up on it for this window (keeping the old anchor; a body still being
        coded on the sync's thread is waited for, then never sent); None waits as long as
        the retry policy keeps trying. `max_upload_mbps` caps the upload bandwidth (a
        shared link); None sends as fast as the network allows.

        `token` is the enrollment token (None: $DILOCO_TOKEN); registering with it gets this
        worker a credential of its own, sent from then on and kept in the checkpoint.
        `ca_file`: PEM certificates an https:// server's certificate must chain to.

        `anchor_device`: where the fp32 anchor and the error-feedback residuals live. "auto"
        (the default) keeps them beside a model on a GPU when they fit in half of its free
        memory, so that a round's arithmetic and coding run there; "cpu" keeps them in host
        memory (the GPU's memory then holds only training); or a device name.

        `wait_report_after`: a sync whose result has not come after this many seconds is
        logged (WARNING, logger "diloco.worker") with what the server waits for, and again
        at most once a minute; None: $DILOCO_WAIT_REPORT_SECONDS, else 30 s. The logger also
        says (INFO) when the worker joins and each round, and (WARNING) when the server
        answers again after retries.
        """
        # Checked before anything reaches the server (the upload cap by the client's limiter).
        if isinstance(result_wait, bool) or not (
            isinstance(result_wait, (int, float)) and 0 < result_wait <= MAX_RESULT_WAIT
        ):
            raise ValueError(
                f"result_wait must be in (0, {MAX_RESULT_WAIT:g}] seconds (one long-poll; the "
                f"worker polls again until its result comes), got {result_wait!r}"
            )
        if fragment_timeout is not None and not (
            isinstance(fragment_timeout, (int, float)) and 0 < fragment_timeout < math.inf
        ):
            raise ValueError(f"fragment_timeout must be > 0 seconds, got {fragment_timeout!r}")
        requested_anchor_device = parse_anchor_device(anchor_device)
        report_after = wait_report_seconds(wait_report_after)
        refuse_fsdp1(model)  # (before its state_dict(), a collective, is read on one rank)
        self.model = _unwrap(model)
        self.optimizer = optimizer
        self.server_url = server_url
        self.worker_id = worker_id
        self.is_leader = distributed.rank() == 0
        self.specs = specs_of(self.model.state_dict(), classify_tensors(self.model))
        self.sharded = is_sharded(self.model)  # FSDP2: each rank holds rows of each tensor
        # DDP: every rank holds the one replica, checked before each sync
        self._replicated = distributed.group_size() > 1 and not self.sharded
        distributed.check_same_model(self.specs, self.sharded)
        client_options = {
            "retry": retry or RetryPolicy(),
            "on_retry": _log_retry,
            "on_recovered": log_recovered,
            "max_upload_mbps": max_upload_mbps,
            "ca_file": ca_file,
        }
        self._connect = lambda url, cap: DiLoCoClient(
            url, token, **{**client_options, "max_upload_mbps": cap}
        )
        self.client: DiLoCoClient | ShardedClient | None = (
            self._connect(server_url, max_upload_mbps) if self.is_leader else None
        )
        self._closed = False
        self._scheduler = scheduler
        self._save_every_round = save_every_round
        self.local_step = 0
        self.rounds = 0
        self.last_loss: float | None = None
        self._pace = Pace()
        self._round_lines = RoundLines()
        self._split_at: dict[str, float] = {}  # streaming: blocked_split at the last cycle
        self._tokens = TokenTally()
        self._units = UnitReports(data)
        self.sample_trace = SampleTrace.from_env()  # DILOCO_TRACE_SAMPLES: audits only
        self.streamer: FragmentStreamer | None = None
        self.fragment_plan: list[list[str]] | None = None
        self.fragment_rounds: list[int] = []
        self.resumed: WorkerCheckpoint | None = None
        # where the last round's blocked time went (see _phases); None before the first
        self.last_round_phases: dict[str, float] | None = None
        self._encode_seconds = self._apply_seconds = self._delta_seconds = 0.0
        # the round whose body the server took in a sync that then failed (None: none)
        self._folded_round: int | None = None
        self.dropped_round = False  # a resume inside a round the server had gone past
        distributed.check_same_choice("checkpoint_dir", checkpoint_dir is not None)
        if checkpoint_dir is not None and (
            self.sharded or (distributed.group_size() > 1 and save_every_round)
        ):
            raise ValueError(
                "checkpoint_dir is for unsharded workers, and under torch.distributed only "
                "with save_every_round=False: rank 0 then saves the worker state beside a "
                "trainer's own checkpoints, which restore every rank's model, optimizer "
                "and RNG (under FSDP the worker state is not saved)"
            )
        self._resumption = Resumption(
            self.model,
            optimizer,
            scheduler,
            checkpoint_dir,
            leader=self.is_leader,
            sharded=self.sharded,
        )
        saved = self._resumption.load(self.worker_id)
        if saved is not None:  # registering under the saved id, counting on from its counters
            self.resumed = saved
            self.worker_id = saved.worker_id
            self.local_step = saved.local_step
            self._tokens.total = saved.tokens
            self.rounds = int(saved.extra.get("rounds", 0))
        self._session = (
            ServerSession(
                self.client,
                self.specs,
                self._units,
                worker_id=self.worker_id,
                saved_identity=None if self.resumed is None else self.resumed.extra,
                result_wait=result_wait,
                wait_report_after=report_after,
            )
            if self.client is not None
            else None
        )

        info = distributed.lead(self._server_info, distributed.broadcast_json)
        self.settings = WorkerSettings.from_info(info, server_url)
        self.settings.check_supported()
        fused_int8.check_setting()
        fused_int8.prepare_for(self.settings.upload_codec, self.settings.download_codec)
        if self.sharded:
            check_sharded_settings(self.settings)
        if self.settings.mode == "streaming":
            _refuse_tied_tensors(self.model)
            if self._session is not None:  # each fragment's result keeps its own buffer
                self._session.reuse_downloads = False  # (nor is the join's kept)
        self._schedule = (DyLU if self.settings.dylu else EveryH)(self.settings.sync_every)
        if self.sharded:
            if requested_anchor_device not in (None, torch.device("cpu")):
                raise ValueError(
                    "anchor_device: a sharded (FSDP2) model's anchor rows stay on the CPU"
                )
            self._anchor = ShardedAnchor(
                self.model, leader=self.is_leader, download_dtype=self.settings.download_dtype
            )
        else:
            self._anchor = Anchor(
                self.model,
                leader=self.is_leader,
                download_dtype=self.settings.download_dtype,
                device=self._anchor_device(requested_anchor_device),
            )
        # A sharded group gathers its weights for the server only when it has none yet.
        first = self.sharded and info.get("model_fingerprint") is None
        initial = self._gathered(self._anchor.local_values) if first else None
        self.worker_id = distributed.lead(lambda: self._join(initial), self._share_join)
        self._uploads = UploadCoder(
            self.settings.upload_codec,
            self.settings.error_feedback_beta,
            self.specs,
            self.fragment_plan if self.settings.mode == "streaming" else None,
            device=getattr(self._anchor, "device", "cpu"),
        )
        if self.resumed is not None:
            self._uploads.restore(self.resumed.residual, self.resumed.extra.get("residual_key"))
        if self._session is not None and not self.settings.download_codec.is_identity:
            self._session.apply_delta = self._values_after_delta
        if self.settings.mode == "streaming":
            assert self.fragment_plan is not None
            if self._session is not None:
                self._session.plan = self.fragment_plan
            self.streamer = FragmentStreamer(
                self.settings,
                self.fragment_plan,
                self.fragment_rounds,
                fragment_timeout,
                session=self._session,
                anchor=self._anchor,
                units=self._units,
                tokens=self._tokens,
                pace=self._pace,
                on_merged=self._fragment_merged,
                uploads=self._uploads,
                before_send=self._check_replicas,
                coding=lambda code: self._on_host_after_oom(code, coding=True),
            )
        self._go_on(
            self._resumption.after_join(
                self.round,
                self.settings.mode,
                self.settings.sync_every,
                self.client,
                self.worker_id,
            )
        )
        self._round_lines.since(self.client.stats if self.client is not None else None)
        self._hook = optimizer.register_step_post_hook(self._after_step)
        if self.settings.weighting == "tokens":  # token weighting needs counts: count them
            self._tokens.count_forwards(self.model)
        self._heartbeat: Heartbeat | None = None
        if self._session is not None and heartbeat:
            assert self.client is not None
            beat_client = DiLoCoClient(
                self.client.base_url,  # shard 0 of sharded servers
                auth=self.client.auth,  # one credential: re-registering renews it for both
                retry=RetryPolicy(attempts=1),
                ca_file=ca_file,
            )
            session = self._session
            self._heartbeat = Heartbeat(
                beat_client,
                lambda: session.worker_id or "",
                self.settings.heartbeat_interval,
                self._heartbeat_report,
                session.rejoin,
                self._schedule.advise,
            )
            self._heartbeat.start()

    def _go_on(self, rejoined: Rejoined) -> None:
        """Where the resumption says a resumed worker goes on after joining."""
        self.local_step += rejoined.steps_skipped
        self.dropped_round = rejoined.dropped_round
        inside = rejoined.inside_round
        if inside is not None:
            self._schedule.steps_in_round = inside.steps
            if inside.window is not None:
                self._schedule.window = inside.window
            self._tokens.resume_round(inside.tokens)

    def _anchor_device(self, requested: torch.device | None) -> torch.device:
        """The anchor's device (see `anchor_device`); said once at the start when it is not
        the CPU, or when a GPU model's anchor must stay on the CPU for want of memory."""
        settings = self.settings
        lossy = not settings.upload_codec.is_identity and settings.error_feedback_beta > 0
        copies = anchor_copies(
            settings.upload_codec,
            settings.error_feedback_beta,
            settings.download_codec,
            streaming=settings.mode == "streaming",
        )
        device = choose_anchor_device(self.model, requested, fp32_copies=copies)
        on_gpu = any(t.is_cuda for t in self.model.state_dict().values())
        if self.is_leader and (device.type != "cpu" or (on_gpu and requested is None)):
            log.info(
                "the fp32 anchor%s lives on %s%s",
                " and error-feedback residual" if lossy else "",
                device,
                "" if device.type != "cpu" else " (they do not fit in half the GPU's free memory)",
            )
        return device

    # ----------------------------------------------------------------- the parts' state

    @property
    def anchor(self) -> dict[str, torch.Tensor]:
        """The fp32 CPU copy of the global weights the model last started from (rank 0; an
        FSDP-sharded worker keeps each rank's own rows, and rank 0 the replicated tensors)."""
        return self._anchor.tensors

    @property
    def round(self) -> int:
        """The round the anchor starts (sync), or the version (async)."""
        return self._anchor.round

    @property
    def window_sync_every(self) -> int:
        """H of the window under way (DyLU may lower it)."""
        return self._schedule.window

    @property
    def data(self) -> ReportsUnits | None:
        """The server-dispatched data source whose finished units the worker reports."""
        return self._units.source

    @data.setter
    def data(self, source: ReportsUnits | None) -> None:
        self._units.source = source

    @property
    def blocked_seconds(self) -> float:
        """Training-thread time given to syncs: coding what is sent, waiting on the server,
        taking the result in (a streaming merge's mix too); a checkpoint is not counted."""
        return self._pace.blocked_seconds

    @property
    def _download(self) -> bytearray | None:
        """The buffer the last weights came in; the next download overwrites it."""
        return None if self._session is None else self._session.download_buffer

    def _leader_session(self) -> ServerSession:
        """Rank 0's session (the other ranks never talk to the server)."""
        assert self._session is not None
        return self._session

    def _server_info(self) -> dict:
        """The server's /v1/info; sharded servers: from then on the client is every shard's."""
        session = self._leader_session()
        info = session.info()
        assert isinstance(self.client, DiLoCoClient)
        sharded = clients_of_shards(info, self.client, self._connect)
        if sharded is not None:
            self.client = session.client = sharded  # type: ignore[assignment]
        return info

    def rejoin(self) -> None:
        """Register again under the same id (after an eviction or a server restart)."""
        self._leader_session().rejoin()

    # ----------------------------------------------------------------- joining

    def _gathered(self, pieces: Any) -> bytearray | None:
        """A sharded worker's body of `pieces()` from every rank (on rank 0; None elsewhere)."""
        assert isinstance(self._anchor, ShardedAnchor)
        return self._anchor.gather_body(pieces())

    def _join(self, initial: bytearray | None = None) -> str:
        """Register; the first worker uploads its weights (`initial`, when a sharded group
        gathered them); everyone starts from the server's."""
        session = self._leader_session()
        weights = session.join(
            lambda: self._initial_body(initial),
            self.settings.heartbeat_timeout,
            self.settings.heartbeat_interval,
        )
        self._anchor.adopt(decode_tensors(weights.body), weights.round)
        if not self.settings.download_codec.is_identity:
            session.drop_download_buffer()  # results come as smaller coded deltas
        self.fragment_rounds = weights.fragment_rounds or [weights.round]
        if self.settings.mode == "streaming":
            self.fragment_plan = session.fragment_plan()
        assert session.worker_id is not None
        settings = self.settings
        log.info(
            joined_line(
                session.worker_id,
                self.server_url,
                weights.round,
                settings.mode,
                settings.sync_every,
                self.local_step,
            )
        )
        return session.worker_id

    def _initial_body(self, gathered: bytearray | None) -> bytearray:
        """The weights this worker offers as the run's first (a sharded group's, gathered)."""
        if gathered is not None:
            return gathered
        if self.sharded:
            raise ValueError(
                "the server had global weights when this worker started and has none now "
                "(restarted without --state-dir?); start the worker again"
            )
        return encode_tensors(self.model.state_dict())

    def _share_join(self, worker_id: str | None) -> str:
        self._anchor.share()
        self.fragment_rounds = distributed.broadcast_json(self.fragment_rounds)
        self.fragment_plan = distributed.broadcast_json(self.fragment_plan)
        return distributed.broadcast_json(worker_id)

    # ----------------------------------------------------------------- the round

    def _after_step(self, *_args: object, **_kwargs: object) -> None:
        self.local_step += 1
        if self.streamer is not None:
            self.streamer.after_step()
            return
        if self._schedule.stepped():
            self.sync()

    def report(self, loss: float | None = None, tokens: int = 0) -> None:
        """Tell the worker the latest training loss and tokens (for heartbeats and weighting).

        The first explicit token count replaces the worker's own (see worker/data/tokens.py)."""
        if loss is not None:
            self.last_loss = float(loss)
        self._tokens.report(tokens)

    def sync(self) -> None:
        """Sync now: send this round's pseudo-gradient, wait for the result, load it everywhere.

        In streaming mode: merge the fragment in flight, then sync every fragment trained since
        its last merge (what `close` does at the end, so no training is lost).
        """
        if self.streamer is not None:
            started, before = time.monotonic(), self._pace.blocked_seconds
            self.streamer.flush()  # its merges count their waits; the whole flush counts once
            self._pace.blocked_seconds = before + (time.monotonic() - started)
            self._saved_round()
            return
        if self._schedule.steps_in_round == 0:
            return
        self._check_replicas()
        started = time.monotonic()
        submitted = self.round
        calls = self.client.stats if self.client is not None else None
        body = self._gathered(self._sharded_upload) if self.sharded else None
        # every rank's counted forwards (a DDP or FSDP group's batches are split over ranks)
        tokens = self._tokens.in_round_over(distributed.sum_over_group)
        try:
            distributed.lead(lambda: self._exchange_round(body, tokens), self._share_result)
        except distributed.LeaderFailed:
            self._uploads.settle(folded=False)  # rank 0 settled its own rows already
            self._pace.blocked_seconds += time.monotonic() - started
            raise
        except BaseException:  # a sync cut short (a failure, a signal) blocked training too
            self._pace.blocked_seconds += time.monotonic() - started
            raise
        exchanged = time.monotonic()
        self._pace.blocked_seconds += exchanged - started
        self.rounds += 1
        self._schedule.round_done()
        self._tokens.round_done()
        self._units.round_started()
        self._pace.window_done(self.local_step)
        self._saved_round()
        self.last_round_phases = self._phases(calls, exchanged - started)
        self.last_round_phases["save"] = time.monotonic() - exchanged
        if self.settings.mode == "async":
            what = f"sync {self.rounds} (server version {self.round})"
        else:
            what = f"round {submitted}"
        self._log_round(what, self.last_round_phases)

    def _log_round(self, what: str, phases: dict[str, float] | None = None) -> None:
        """The round's line (rank 0's): see round_log.RoundLines; `phases`: the round's
        split of its blocked time, kept with its figures (a sync or async round's)."""
        if not self.is_leader:
            return
        client = self.client.stats if self.client is not None else None
        figures = self._round_lines.record(
            self.local_step,
            self.last_loss,
            client,
            self._pace.blocked_seconds,
            phases,
        )
        log.info(self._round_lines.line(what, figures))

    def _phases(self, before: ClientStats | None, blocked: float) -> dict[str, float]:
        """Where the round's blocked time went (rank 0's view; seconds): encode (the
        pseudo-gradient and its upload body), upload (the submit call), wait (the long-poll
        until the result was ready), download (reading the result), apply (a coded delta onto
        the anchor, then the new weights into model and anchor), other (the rest: a sharded
        group's gathers, broadcasts)."""
        applied = self._apply_seconds + self._delta_seconds  # a coded delta's, then the load
        phases = {"blocked": blocked, "encode": self._encode_seconds, "apply": applied}
        if before is not None and self.client is not None:
            after = self.client.stats

            def spent(*operations: str) -> float:
                return sum(
                    after.blocked_by_operation.get(o, 0.0) - before.blocked_by_operation.get(o, 0.0)
                    for o in operations
                )

            phases["upload"] = spent("submit", "confirm")
            result = spent("wait_result", "get_weights")
            phases["download"] = min(result, after.body_seconds - before.body_seconds)
            phases["wait"] = result - phases["download"]
        accounted = sum(v for k, v in phases.items() if k != "blocked")
        phases["other"] = max(0.0, blocked - accounted)
        return phases

    def _check_replicas(self) -> None:
        """Before any values leave: every rank of an unsharded group holds one replica."""
        if self._replicated:
            state = self.model.state_dict()
            trained = {spec.name: state[spec.name] for spec in self.specs if spec.trained}
            distributed.check_replicas_agree(trained, self.local_step)

    def _saved_round(self) -> None:
        """A round (or a streaming cycle) ended: checkpoint it, unless saves are the caller's."""
        if self._save_every_round:
            self.save_checkpoint()

    def save_checkpoint(self, directory: str | os.PathLike[str] | None = None) -> None:
        """Save the worker's state now (done after every round when checkpoint_dir is set),
        into `directory` if given (a trainer's checkpoint folder; mid-round is fine: the
        anchor, the steps into the round and the residual are saved with the model). In a
        torch.distributed group rank 0 saves the group's state; the other ranks do nothing."""
        self._resumption.save(self._progress, directory)

    def _progress(self) -> Progress:
        """What a checkpoint keeps of this worker now (rank 0's parts)."""
        assert self.worker_id is not None  # set by the join, before any save
        residual, residual_key = self._uploads.state()
        return Progress(
            worker_id=self.worker_id,
            identity=self._leader_session().identity(),
            rounds=self.rounds,
            local_step=self.local_step,
            anchor=self.anchor,
            anchor_round=self.round,
            steps_in_round=self._schedule.steps_in_round,
            window=self._schedule.window,
            tokens=self._tokens.total,
            round_tokens=self._tokens.round_state(),
            data=self._units.state(),
            residual=residual,
            residual_key=residual_key,
        )

    def _exchange_round(self, body: bytearray | None, tokens: int) -> Exchanged:
        """Send this round's pseudo-gradient (`body` when a sharded group gathered it) and
        the tokens the worker (every rank of a group) trained for it."""
        session = self._leader_session()
        if self._anchor.torn:
            # A delta failed part way and the whole weights that repair it never came (the
            # sync raised): this round's body is in already, so take the server's weights
            # now instead of coding a body from a half-moved anchor.
            log.warning(
                "the anchor was left torn by a delta that failed part way: taking the "
                "server's current weights (the steps trained since are dropped)"
            )
            self._folded_round = None
            weights = session.current_weights()
            self._units.round_dropped()  # the units those steps finished go again
            return weights
        encoding = time.monotonic()
        self._delta_seconds = 0.0  # (set again if this round's result comes as a delta)
        # fp32 both ways: the weights come back into the upload's buffer, which anchor - local
        # can fill again should the server ask for the upload a second time
        rebuild = None
        if body is None:
            body = self._on_host_after_oom(self._upload_body, coding=True)
            if self._fp32_both_ways:
                rebuild = self._upload_body_again
        self._encode_seconds = time.monotonic() - encoding
        units = self._units.to_report()
        progress = self._units.progress()
        if self.sample_trace is not None and self.worker_id is not None:
            samples = self._units.drain_trace()
            if samples is not None:
                self.sample_trace.record(self.worker_id, self.round, samples)
        answer = SubmitAnswer(earlier_folded=self._folded_round == self.round)
        try:
            result = session.exchange(
                body,
                units,
                self.round,
                tokens=tokens,
                progress=progress,
                rebuild=rebuild,
                answer=answer,
            )
        except BaseException:
            # The body's error feedback stands if the server took it before the failure (a
            # wait given up, the server gone after it answered); a later sync of this round
            # then sends another body, whose "duplicate" is that one's, not its own.
            self._uploads.settle(folded=answer.folded)
            if answer.folded:
                self._folded_round = self.round
            raise
        self._folded_round = None
        self._uploads.settle(result.folded)
        if result.folded:
            self._units.reported(units)
        elif result.rebase_rounds is not None:  # dropped: its samples are in no model
            self._units.round_dropped()
        # (else they go again with the next round: a round that committed without this body
        # took its units into the open round, in memory only until that round commits, and a
        # server restarted before then has lost them; a report of a unit completed since is
        # accepted and not counted twice)
        return result

    def _upload_body(self) -> bytearray:
        """This round's upload body: anchor - local, coded (with error feedback)."""
        if self._uploads.codec.is_identity:
            # fp32 both ways: the buffer the last weights came in, loaded already, takes the
            # body (the first round: the join's; later ones: the last body's, same buffer)
            spare = self._download if self._fp32_both_ways else None
            return self._uploads.plain_body(
                self._anchor.tensors, self.model.state_dict(), spare=spare
            )
        # sync mode: this round's exchange starts after the last one's has ended
        return self._uploads.body_from(self._anchor.tensors, self.model.state_dict(), reuse=True)

    def _upload_body_again(self) -> bytearray:
        """For a resend: the same bytes, built as the first time (a GPU out of memory too)."""
        return self._on_host_after_oom(self._upload_body, coding=True)

    @property
    def _fp32_both_ways(self) -> bool:
        """Uploads and downloads are whole fp32 tensors of one layout: one buffer holds both."""
        return self._uploads.codec.is_identity and self.settings.download_codec.is_identity

    def _on_host_after_oom(self, work: Callable[[], T], coding: bool = False) -> T:
        """`work`; if the GPU runs out of memory on it (the anchor's arithmetic and coding
        share the GPU with training), the anchor and residuals move to the CPU for the rest
        of the run, with a warning, and `work` runs again there: the round goes on.
        `coding`: `work` codes an upload, and nothing of a half-coded body is kept."""
        try:
            return work()
        except torch.OutOfMemoryError:
            if self._anchor.device.type == "cpu":
                raise
            if coding:
                self._uploads.settle(folded=False)  # the half-coded body's residuals go
            self._to_host_after_oom()
            return work()

    def _to_host_after_oom(self) -> None:
        log.warning(
            "the GPU ran out of memory in a sync: the fp32 anchor and error-feedback "
            "residual move to the CPU for the rest of the run (anchor_device='cpu' "
            "keeps them there from the start)"
        )
        self._anchor.move_to("cpu")
        self._uploads.move_to("cpu")
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _values_after_delta(self, body: bytearray, fragment: int) -> dict[str, torch.Tensor]:
        """A result sent as a coded delta (--download-codec): the new values from our anchor.

        In sync mode the whole anchor moves in place: a delta refused or out of GPU memory
        part way raises AnchorTorn, and the session takes the server's whole weights instead
        (after an OOM the anchor lives on the CPU from then on). In streaming mode copies
        move (`Anchor.values_after`: the sync runs beside training, and a merge may give up
        on it), even for one fragment of every tensor: an OOM runs the apply again on the
        CPU, and a refused delta takes the fragment's values from the server's whole weights
        (AnchorTorn, the anchor untouched) instead of ending the run at the merge."""
        streaming = self.streamer is not None
        names = self.fragment_plan[fragment] if streaming else list(self._anchor.tensors)
        coded = self._uploads.coded_names  # trainable tensors: coded both ways

        def values() -> dict[str, torch.Tensor]:
            started = time.monotonic()
            try:
                return self._anchor.values_after(
                    body, names, self.settings.download_codec, coded, in_place=not streaming
                )
            finally:
                self._delta_seconds = time.monotonic() - started

        if streaming:
            try:
                return self._on_host_after_oom(values)
            except WireError as exc:
                raise AnchorTorn(
                    f"the server's delta for fragment {fragment} was refused: {exc}"
                ) from exc
        try:
            return values()
        except torch.OutOfMemoryError as exc:
            if self._anchor.device.type == "cpu":
                raise
            self._anchor.torn = True  # (whatever part of it moved)
            self._to_host_after_oom()
            raise AnchorTorn(f"the GPU ran out of memory applying the delta: {exc}") from exc
        except WireError as exc:
            raise AnchorTorn(f"the server's delta was refused part way: {exc}") from exc

    def _sharded_upload(self) -> dict[str, torch.Tensor]:
        """This rank's rows of the upload (and its own rows' error-feedback residual)."""
        return self._uploads.dense(self._anchor.pseudo_gradient())

    def _share_result(self, result: Exchanged | None) -> None:
        applying = time.monotonic()
        if result is not None:
            self._anchor.adopt(result.tensors, result.round)
        self._anchor.share()
        self._apply_seconds = time.monotonic() - applying
        if self.sharded:  # each rank keeps the residual of its own rows: settle it
            folded = distributed.broadcast_json(None if result is None else result.folded)
            if not self.is_leader:
                self._uploads.settle(folded)
        self._schedule.window = distributed.broadcast_json(self._schedule.next_window())

    def _fragment_merged(self, fragment: int) -> None:
        """A fragment's window ended: a speed sample; a checkpoint once a cycle."""
        self._pace.window_done(self.local_step)
        if self.streamer is not None and fragment == self.streamer.last_fragment:
            self._saved_round()
            rounds = self.streamer.fragment_rounds
            shown = ", ".join(str(r) for r in rounds)
            plural = "s" if len(rounds) > 1 else ""
            self._log_round(
                f"a cycle of {len(rounds)} fragment{plural} (rounds now {shown})",
                self._cycle_split(),
            )

    def _cycle_split(self) -> dict[str, float]:
        """A streaming cycle's blocked time by part since the last cycle's line (the
        streamer's `blocked_split`): send, wait and mix, which add up to its blocked time."""
        assert self.streamer is not None
        now = self.streamer.blocked_split()
        before, self._split_at = self._split_at, now
        return {part: seconds - before.get(part, 0.0) for part, seconds in now.items()}

    # ----------------------------------------------------------------- reporting and exit

    def _heartbeat_report(self) -> dict:
        return {
            "step": self.local_step,
            "steps_per_second": self._pace.speed(self.local_step),
            "loss": self.last_loss,
            "tokens": self._tokens.total,
            "windows": self._pace.windows,
        }

    def stats(self) -> dict:
        """Figures for `diloco worker --json` (leader's view)."""
        client = self.client.stats if self.client is not None else None
        streamer = self.streamer
        return {
            "worker_id": self.worker_id,
            "mode": self.settings.mode,
            "rounds": self.rounds if streamer is None else streamer.syncs,
            "round": self.round,
            "fragment_rounds": None if streamer is None else list(streamer.fragment_rounds),
            "fragment_failures": 0 if streamer is None else streamer.failures,
            # streaming: seconds its fragments' bodies took to code on their own threads (a
            # CPU anchor, a quantized or sparse codec and error feedback; else about 0)
            "background_coding_seconds": 0.0 if streamer is None else streamer.coding_seconds,
            "local_steps": self.local_step,
            "bytes_sent": client.bytes_sent if client else 0,
            "bytes_received": client.bytes_received if client else 0,
            "blocked_seconds": self._pace.blocked_seconds,
            "client_seconds": client.blocked_seconds if client else 0.0,
            "largest_upload_bytes": client.largest_upload if client else 0,
            "retries": client.retries if client else 0,
            "rebases": 0 if self._session is None else self._session.rebases,
            "sync_every_now": self._schedule.window,
            # blocked share of wall time from the end of the first window to close(), or None
            "steady_blocked_fraction": self._pace.steady_blocked_fraction(),
            # each round's own: the step it ended at, MB up and down, seconds blocked
            "round_figures": [asdict(figures) for figures in self._round_lines.rounds],
        }

    def close(self, final_sync: bool = True) -> None:
        """Sync a last partial round (unless told not to), stop beating, leave the run."""
        if self._closed:
            return
        self._closed = True
        self._pace.training_ended()
        try:
            if final_sync:
                self.sync()
        finally:
            self._hook.remove()
            self._tokens.stop_counting()
            if self._heartbeat is not None:
                self._heartbeat.stop()
                self._heartbeat.client.close()
            if self._session is not None:
                self._session.leave()

    def __enter__(self) -> DiLoCoWorker:
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        self.close(final_sync=exc_type is None)
