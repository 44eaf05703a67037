"""K workers in one process, through the same `diloco.algorithm` code the server runs.

Each mode is a function over shared set-up (`SimSetup`); they differ only in when replicas
exchange what. Byte counts are what the real system would move over the network: uploads are
coded with the run's upload codec, with error feedback per worker (sim/compression.py);
downloads are the fp32 global weights, or with a download codec each step's coded delta of the
published weights, which workers then train from (as the server's --download-codec).
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from diloco.algorithm import (
    Contribution,
    DelayedNesterov,
    GraceWindow,
    OuterOptimizer,
    StreamingSchedule,
    alpha_merge,
    classify_tensors,
    dylu_local_steps,
    outer_step,
    plan_fragments,
    pseudo_gradient,
    staleness_scale,
    to_fp32_masters,
)
from diloco.algorithm.dylu import MAX_SPEED_RATIO
from diloco.data import BatchSampler, load_named_corpus, split_train_val, worker_shard
from diloco.evaluation import Evaluator
from diloco.models import block_prefixes
from diloco.sim.aggregation import SyncAggregation
from diloco.sim.compression import Downlink, UploadCodec, WorkerUplink
from diloco.sim.config import SimConfig
from diloco.training import Replica, autocast_dtype_of

FP32_BYTES = 4
Progress = Callable[[int], None]


@dataclass
class SimResult:
    """Figures of one run; `to_json` is the `--json` document."""

    config: SimConfig
    parameters: int
    final_eval_loss: float
    eval_curve: list[tuple[int, float]]
    outer_steps: int
    bytes_sent_per_worker: float
    bytes_received_per_worker: float
    peak_sync_bytes: int
    wall_seconds: float
    local_steps_per_worker: list[int] = field(default_factory=list)
    final_state: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)
    # async: (worker, local steps, simulated time) of each arrival, in the order applied
    arrivals: list[tuple[int, int, float]] = field(default_factory=list)
    # Each worker's error-feedback residuals at the end (what its checkpoint would hold);
    # empty dicts when none is kept (fp32, or beta 0)
    residuals: list[dict[str, torch.Tensor]] = field(default_factory=list, repr=False)
    # pseudo-gradients a robust --aggregation refused as outliers
    refused_contributions: int = 0

    def to_json(self) -> dict:
        c = self.config
        return {
            "mode": c.mode,
            "workers": c.effective_workers,
            "sync_every": c.sync_every,
            "steps": c.steps,
            "final_eval_loss": self.final_eval_loss,
            "eval_curve": [[step, loss] for step, loss in self.eval_curve],
            "outer_steps": self.outer_steps,
            "upload_codec": c.upload_codec,
            "error_feedback_beta": c.error_feedback_beta,
            "bytes_sent_per_worker": self.bytes_sent_per_worker,
            "bytes_received_per_worker": self.bytes_received_per_worker,
            "peak_sync_bytes": self.peak_sync_bytes,
            "parameters": self.parameters,
            "tokens_per_worker": c.steps * c.batch_size * c.seq_len,
            "local_steps_per_worker": self.local_steps_per_worker,
            "wall_seconds": self.wall_seconds,
            "arrivals": [list(a) for a in self.arrivals],
            "aggregation": c.aggregation,
            "hostile": c.hostile,
            "refused_contributions": self.refused_contributions,
            "config": c.to_dict(),
        }


class SimSetup:
    """Everything the modes share: initial weights, data shards, evaluator, byte sizes."""

    def __init__(self, config: SimConfig, corpus: bytes) -> None:
        self.config = config
        torch.manual_seed(config.seed)
        self.spec = config.spec
        template = self.spec.build()
        self.initial = {k: v.detach().clone() for k, v in template.state_dict().items()}
        self.kinds = classify_tensors(template)
        self.blocks = block_prefixes(template)
        self.parameters = sum(p.numel() for p in template.parameters())
        self.tensor_bytes = {
            k: v.numel() * FP32_BYTES for k, v in self.initial.items() if v.is_floating_point()
        }
        self.model_bytes = sum(self.tensor_bytes.values())
        # What one worker's upload of each tensor's pseudo-gradient weighs with the run's codec
        self.upload = UploadCodec(config.upload, config.error_feedback_beta, self.kinds)
        self.upload_bytes = {k: self.upload.entry_nbytes(k, v) for k, v in self.initial.items()}
        self.upload_model_bytes = sum(self.upload_bytes.values())
        split = split_train_val(corpus)
        workers = config.effective_workers
        self.samplers = [
            BatchSampler(
                worker_shard(split.train, w, workers),
                config.batch_size,
                config.seq_len,
                seed=config.seed * 1000 + w + 1,
            )
            for w in range(workers)
        ]
        self.evaluator = Evaluator(
            self.spec, split.val, config.batch_size, config.seq_len, config.eval_batches
        )

    def replica(self, worker: int, total_steps: int | None = None) -> Replica:
        c = self.config
        return Replica(
            self.spec,
            self.initial,
            self.samplers[worker],
            c.lr,
            c.warmup,
            total_steps or c.steps,
            c.weight_decay,
            device=c.device,
            autocast_dtype=autocast_dtype_of(c.dtype),
        )

    def downlink(self, masters: dict[str, torch.Tensor]) -> Downlink:
        """The published weights workers hold (the masters themselves without a codec)."""
        return Downlink(self.config.download, self.kinds, masters)

    def uplinks(self) -> list[WorkerUplink]:
        """One uplink per worker: each keeps its own error-feedback residuals."""
        return [self.upload.uplink() for _ in range(self.config.effective_workers)]

    def outer_optimizer(self) -> OuterOptimizer:
        c = self.config
        return OuterOptimizer(c.outer_optimizer, lr=c.outer_lr, momentum=c.outer_momentum)


@dataclass
class ModeOutcome:
    final_state: dict[str, torch.Tensor]
    eval_curve: list[tuple[int, float]]
    outer_steps: int = 0
    bytes_sent: float = 0.0
    bytes_received: float = 0.0
    peak_sync_bytes: int = 0
    local_steps: list[int] = field(default_factory=list)
    arrivals: list[tuple[int, int, float]] = field(default_factory=list)
    uplinks: list[WorkerUplink] = field(default_factory=list)
    refused: int = 0


def _on_cpu(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A replica's final weights where every mode's are: on the CPU (as they are, there)."""
    return {name: tensor.cpu() for name, tensor in state.items()}


def _eval_due(step: int, interval: int, total: int) -> bool:
    return step % interval == 0 or step == total


def run_single(setup: SimSetup, progress: Progress) -> ModeOutcome:
    """One worker, no communication: the lower bound on what DiLoCo should beat."""
    c = setup.config
    replica = setup.replica(0)
    curve = [(0, setup.evaluator.loss(setup.initial))]
    for step in range(1, c.steps + 1):
        replica.train_step()
        progress(1)
        if _eval_due(step, c.eval_interval, c.steps):
            curve.append((step, setup.evaluator.loss(replica.state())))
    return ModeOutcome(_on_cpu(replica.state()), curve, local_steps=[c.steps])


def run_ddp(setup: SimSetup, progress: Progress) -> ModeOutcome:
    """Data parallel: each step uses the mean gradient of all K workers' batches (K x batch).

    The K equal-size batches go through one forward pass; the mean loss over the concatenation
    is the mean of the per-worker losses, so the gradient is the all-reduced mean.
    """
    c = setup.config
    k = c.effective_workers
    replica = setup.replica(0)
    curve = [(0, setup.evaluator.loss(setup.initial))]
    for step in range(1, c.steps + 1):
        batches = [sampler.next_batch() for sampler in setup.samplers]
        x = torch.cat([b[0] for b in batches])
        y = torch.cat([b[1] for b in batches])
        replica.loss_and_backward(x, y)
        replica.apply_gradients()
        progress(k)
        if _eval_due(step, c.eval_interval, c.steps):
            curve.append((step, setup.evaluator.loss(replica.state())))
    # Ring all-reduce: each worker sends and receives 2 (K - 1) / K of the fp32 gradient.
    per_step = 2 * (k - 1) / k * setup.model_bytes
    return ModeOutcome(
        _on_cpu(replica.state()),
        curve,
        bytes_sent=per_step * c.steps,
        bytes_received=per_step * c.steps,
        peak_sync_bytes=int(per_step),
        local_steps=[c.steps] * k,
    )


def _round_ends(steps: int, sync_every: int) -> list[int]:
    """Inner steps at which DiLoCo syncs; a last partial round syncs too, so no work is lost."""
    ends = list(range(sync_every, steps + 1, sync_every))
    if not ends or ends[-1] != steps:
        ends.append(steps)
    return ends


def run_diloco(setup: SimSetup, progress: Progress) -> ModeOutcome:
    """Synchronous DiLoCo: H inner steps, then one outer step on the mean pseudo-gradient."""
    c = setup.config
    replicas = [setup.replica(w) for w in range(c.effective_workers)]
    uplinks = setup.uplinks()
    optimizer = setup.outer_optimizer()
    masters = to_fp32_masters(setup.initial)
    downlink = setup.downlink(masters)
    published = downlink.published  # what workers hold: the masters, or P (--download-codec)
    names = list(masters)
    curve = [(0, setup.evaluator.loss(published))]
    combine = SyncAggregation(c.aggregation, c.hostile, len(replicas), c.seed)
    done = 0
    rounds = 0
    for end in _round_ends(c.steps, c.sync_every):
        contributions = []
        for w, replica in enumerate(replicas):
            for _ in range(end - done):
                replica.train_step()
                progress(1)
            gradient = combine.sent(w, pseudo_gradient(published, replica.state()), setup.kinds)
            contributions.append(
                Contribution(
                    uplinks[w].send(gradient),
                    tokens=(end - done) * c.batch_size * c.seq_len,
                    worker=str(w),
                )
            )
        combine.apply(masters, contributions, optimizer, setup.kinds)
        downlink.publish(names)
        for replica in replicas:
            replica.load(published)
        done = end
        rounds += 1
        if _eval_due(end, c.eval_interval, c.steps):
            curve.append((end, setup.evaluator.loss(published)))
    return ModeOutcome(
        published,
        curve,
        outer_steps=rounds,
        bytes_sent=rounds * setup.upload_model_bytes,
        bytes_received=rounds * downlink.delta_nbytes(names),
        peak_sync_bytes=setup.model_bytes,
        local_steps=[c.steps] * len(replicas),
        uplinks=uplinks,
        refused=combine.refused,
    )


def run_streaming(setup: SimSetup, progress: Progress) -> ModeOutcome:
    """Streaming DiLoCo: fragment f is sent at step S - tau of its window and merged at S.

    The outer step for a fragment runs when it is sent (all replicas are in lockstep); its result
    G' is held back and mixed into each replica tau steps later: theta = (1 - a) G' + a L.
    At the end, as a real worker's `close` does, merges still pending are applied and every
    fragment whose local values are not its global ones (trained since its last merge, or
    mixed with alpha > 0) is synced once more: no training is lost, replicas end on G.
    """
    c = setup.config
    schedule = StreamingSchedule(c.sync_every, c.fragments, c.delay)
    if not 0.0 <= c.alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {c.alpha}")
    sizes = [(name, t.numel()) for name, t in setup.initial.items()]
    fragments = plan_fragments(sizes, c.fragments, setup.blocks)
    replicas = [setup.replica(w) for w in range(c.effective_workers)]
    uplinks = setup.uplinks()
    optimizer = setup.outer_optimizer()
    combine = SyncAggregation(c.aggregation, "none", len(replicas), c.seed)  # mean, sparse_mean
    masters = to_fp32_masters(setup.initial)
    downlink = setup.downlink(masters)
    published = downlink.published  # what workers hold: the masters, or P (--download-codec)
    curve = [(0, setup.evaluator.loss(published))]
    pending: dict[int, list[tuple[int, dict[str, torch.Tensor]]]] = {}
    last_merge = [0] * len(fragments)
    syncs = 0
    sent = 0
    received = 0
    peak = 0

    def sync_fragment(f: int) -> dict[str, torch.Tensor]:
        nonlocal sent, received, peak, syncs
        names = fragments[f]
        contributions = []
        for w, replica in enumerate(replicas):
            local = replica.state()
            anchor = {n: published[n] for n in names}
            gradient = pseudo_gradient(anchor, {n: local[n] for n in names})
            contributions.append(Contribution(uplinks[w].send(gradient), worker=str(w)))
        combine.apply(masters, contributions, optimizer, setup.kinds)
        downlink.publish(names)
        fragment_bytes = sum(setup.tensor_bytes.get(n, 0) for n in names)
        sent += sum(setup.upload_bytes[n] for n in names)
        received += downlink.delta_nbytes(names)
        peak = max(peak, fragment_bytes)
        syncs += 1
        return {n: published[n].clone() for n in names}

    def merge(f: int, snapshot: dict[str, torch.Tensor], alpha: float, step: int) -> None:
        for replica in replicas:
            local = replica.state()
            replica.load(alpha_merge(snapshot, {n: local[n] for n in snapshot}, alpha))
        last_merge[f] = step

    for step in range(1, c.steps + 1):
        for replica in replicas:
            replica.train_step()
            progress(1)
        for f in schedule.fragments_sent_at(step):
            pending.setdefault(step + c.delay, []).append((f, sync_fragment(f)))
        for f, snapshot in pending.pop(step, []):
            merge(f, snapshot, c.alpha, step)
        if _eval_due(step, c.eval_interval, c.steps) and step != c.steps:
            curve.append((step, setup.evaluator.loss(published)))
    for due in sorted(pending):  # sent, but due after the last step: merged now
        for f, snapshot in pending.pop(due):
            merge(f, snapshot, c.alpha, c.steps)
    for f in range(len(fragments)):
        if last_merge[f] < c.steps or c.alpha > 0:  # local values are not the global ones
            merge(f, sync_fragment(f), 0.0, c.steps)
    curve.append((c.steps, setup.evaluator.loss(published)))
    return ModeOutcome(
        published,
        curve,
        outer_steps=syncs,
        bytes_sent=sent,
        bytes_received=received,
        peak_sync_bytes=peak,
        local_steps=[c.steps] * len(replicas),
        uplinks=uplinks,
    )


def _delayed_nesterov(config: SimConfig) -> DelayedNesterov:
    momentum = 0.9 if config.outer_momentum is None else config.outer_momentum
    return DelayedNesterov(
        lr=config.outer_lr,
        momentum=momentum,
        delay=config.async_delay or config.effective_workers,
        c=config.async_c,
    )


def run_async(setup: SimSetup, progress: Progress) -> ModeOutcome:
    """Asynchronous DiLoCo in simulated time: each arrival is applied at once (Delayed Nesterov).

    Worker w runs at `speeds[w]` steps per time unit for a budget of steps * v_w / max(v) steps,
    so every worker stops at the time the fastest one has done `steps`. With DyLU, slow workers
    get H_w = floor(v_w / max(v) * H) local steps per round so that rounds take equal time
    (max(v) capped at 16x the slowest speed, as on the server).

    With a grace window (`grace` > 0, as the server's --grace-seconds), arrivals within `grace`
    of the first pending one are averaged into one outer step; the window closes at that
    deadline, or at the last arrival once every worker still training has arrived, and its
    workers start their next window from the step's result then. Staleness (outer steps since a
    worker's anchor) may scale a pseudo-gradient by (1 + staleness)^-1/2, as on the server.
    """
    c = setup.config
    speeds = c.worker_speeds
    fastest = max(speeds)
    k = c.effective_workers
    if c.dylu:  # the server's rule, its speed cap included
        local_h = dylu_local_steps(list(speeds), c.sync_every, MAX_SPEED_RATIO)
    else:
        local_h = [c.sync_every] * k
    budgets = [max(1, int(c.steps * v / fastest + 1e-9)) for v in speeds]
    optimizer = _delayed_nesterov(c)
    grace = GraceWindow(c.grace)
    masters = to_fp32_masters(setup.initial)
    downlink = setup.downlink(masters)
    published = downlink.published  # what workers hold: the masters, or P (--download-codec)
    names = list(masters)
    replicas = [setup.replica(w, total_steps=budgets[w]) for w in range(k)]
    uplinks = setup.uplinks()
    anchors = [{n: t.clone() for n, t in masters.items()} for _ in range(k)]
    anchor_versions = [0] * k
    received = 0.0
    curve = [(0, setup.evaluator.loss(published))]
    events: list[tuple[float, int, int]] = []

    def schedule(w: int, now: float) -> None:
        n = min(local_h[w], budgets[w] - replicas[w].steps_done)
        if n > 0:
            heapq.heappush(events, (now + n / speeds[w], w, n))

    for w in range(k):
        schedule(w, 0.0)
    next_eval = c.eval_interval
    version = 0  # outer steps applied
    order: list[tuple[int, int, float]] = []
    while events:
        window = [heapq.heappop(events)]
        opened = window[0][0]
        while events and grace.takes(opened, events[0][0]):
            window.append(heapq.heappop(events))
        # The server's rule; nobody else training is "every live worker arrived" (a worker has
        # one arrival pending at most).
        closes = grace.closes_at(opened, window[-1][0], all_arrived=not events)
        while next_eval < min(closes * fastest, c.steps):
            curve.append((next_eval, setup.evaluator.loss(published)))
            next_eval += c.eval_interval
        contributions = []
        for when, w, n in window:
            replica = replicas[w]
            for _ in range(n):
                replica.train_step()
                progress(1)
            # Coded by the worker; the server scales what it decodes.
            gradient = uplinks[w].send(pseudo_gradient(anchors[w], replica.state()))
            scale = staleness_scale(version - anchor_versions[w], c.staleness_weighting)
            if scale != 1.0:
                gradient = {name: t * scale for name, t in gradient.items()}
            contributions.append(Contribution(gradient, worker=str(w)))
            order.append((w, n, when))
        # A window is a round of its arrivals: the same outer_step, with Delayed Nesterov.
        outer_step(masters, contributions, optimizer, setup.kinds)
        downlink.publish(names)
        delta_bytes = downlink.delta_nbytes(names)
        for _, w, _ in window:  # the step's delta for an anchor at its start, else P whole
            received += delta_bytes if anchor_versions[w] == version else setup.model_bytes
        version += 1
        for _, w, _ in window:
            replicas[w].load(published)
            anchors[w] = {name: t.clone() for name, t in published.items()}
            anchor_versions[w] = version
            schedule(w, closes)
    while next_eval < c.steps:
        curve.append((next_eval, setup.evaluator.loss(published)))
        next_eval += c.eval_interval
    curve.append((c.steps, setup.evaluator.loss(published)))
    return ModeOutcome(
        published,
        curve,
        outer_steps=version,
        bytes_sent=len(order) * setup.upload_model_bytes / k,
        bytes_received=received / k,
        peak_sync_bytes=setup.model_bytes,
        local_steps=[r.steps_done for r in replicas],
        arrivals=order,
        uplinks=uplinks,
    )


MODE_RUNNERS: dict[str, Callable[[SimSetup, Progress], ModeOutcome]] = {
    "single": run_single,
    "ddp": run_ddp,
    "diloco": run_diloco,
    "streaming": run_streaming,
    "async": run_async,
}


def total_inner_steps(config: SimConfig) -> int:
    """Progress total: inner steps summed over replicas (async: over every worker's budget)."""
    if config.mode == "async":
        fastest = max(config.worker_speeds)
        return sum(max(1, int(config.steps * v / fastest + 1e-9)) for v in config.worker_speeds)
    return config.steps * config.effective_workers


def validate_algorithm_settings(config: SimConfig) -> None:
    """Build the algorithm objects once so that a bad outer setting fails before training."""
    if config.mode in ("diloco", "streaming"):
        OuterOptimizer(config.outer_optimizer, lr=config.outer_lr, momentum=config.outer_momentum)
    if config.mode == "streaming":
        StreamingSchedule(config.sync_every, config.fragments, config.delay)
        if not 0.0 <= config.alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {config.alpha}")
    if config.mode == "async":
        _delayed_nesterov(config)


def prepare(config: SimConfig, corpus: bytes | None = None) -> SimSetup:
    """Check every setting and load the data, so that bad input fails before any training.

    `corpus` defaults to `config.corpus` (Shakespeare if that is None).
    """
    validate_algorithm_settings(config)
    data = corpus if corpus is not None else load_named_corpus(config.corpus)
    return SimSetup(config, data)


def run(setup: SimSetup, progress: Progress | None = None) -> SimResult:
    """Train the prepared run; `progress(n)` is called after every n inner steps."""
    started = time.perf_counter()
    outcome = MODE_RUNNERS[setup.config.mode](setup, progress or (lambda _n: None))
    return SimResult(
        config=setup.config,
        parameters=setup.parameters,
        final_eval_loss=outcome.eval_curve[-1][1],
        eval_curve=outcome.eval_curve,
        outer_steps=outcome.outer_steps,
        bytes_sent_per_worker=outcome.bytes_sent,
        bytes_received_per_worker=outcome.bytes_received,
        peak_sync_bytes=outcome.peak_sync_bytes,
        wall_seconds=time.perf_counter() - started,
        local_steps_per_worker=outcome.local_steps,
        final_state=outcome.final_state,
        arrivals=outcome.arrivals,
        residuals=[dict(uplink.residual) for uplink in outcome.uplinks],
        refused_contributions=outcome.refused,
    )


def simulate(
    config: SimConfig, corpus: bytes | None = None, progress: Progress | None = None
) -> SimResult:
    """Prepare and run one simulated training."""
    return run(prepare(config, corpus), progress)
