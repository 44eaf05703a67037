"""Prometheus metrics of one server (its own registry, so several servers can share a process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest


class ServerMetrics:
    """What /metrics exposes; the coordinator calls these as things happen."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.rounds = Counter("diloco_rounds_total", "Rounds committed", registry=r)
        self.round = Gauge("diloco_round", "Current round number", registry=r)
        self.live_workers = Gauge("diloco_live_workers", "Live workers", registry=r)
        self.bytes_in = Counter("diloco_bytes_in_total", "Tensor bytes received", registry=r)
        self.bytes_out = Counter("diloco_bytes_out_total", "Tensor bytes sent", registry=r)
        self.outer_step_seconds = Histogram(
            "diloco_outer_step_seconds",
            "Time of an outer step and result encoding",
            registry=r,
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        )
        self.barrier_wait_seconds = Histogram(
            "diloco_barrier_wait_seconds",
            "From a submission to its round's commit",
            registry=r,
            buckets=(0.01, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 600),
        )
        self.rejected = Counter(
            "diloco_rejected_requests_total", "Requests refused, by kind", ["kind"], registry=r
        )
        self.evictions = Counter("diloco_evictions_total", "Workers evicted", registry=r)
        self.screened = Counter(
            "diloco_screened_contributions_total",
            "Pseudo-gradients robust aggregation refused or clipped, by outcome",
            ["outcome"],
            registry=r,
        )
        self.staleness = Histogram(
            "diloco_staleness",
            "Async: outer steps between a worker's anchor and its arrival",
            registry=r,
            buckets=(0, 1, 2, 4, 8, 16, 32, 64),
        )

        self.round_part_seconds = Histogram(
            "diloco_round_part_seconds",
            "Each part of a round: scan and fold (per submission), step_log (the step's input "
            "written), outer_step, delta (coding the download delta), step_log_wait (the "
            "log's hashes and fsyncs past the delta), record, checkpoint (the durable write), "
            "commit (the whole step and its result, from the last fold to a servable result)",
            ["part"],
            registry=r,
            buckets=(0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)


class Traffic:
    """Tensor bytes received and sent: /v1/status, the metrics history, Prometheus."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self.bytes_in = 0
        self.bytes_out = 0

    def received(self, n: int) -> None:
        self.bytes_in += n
        self.metrics.bytes_in.inc(n)

    def sent(self, n: int) -> None:
        self.bytes_out += n
        self.metrics.bytes_out.inc(n)
