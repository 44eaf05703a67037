"""Pydantic models of every JSON message in docs/protocol.md.

Requests forbid unknown fields and use strict types, so a typo or a string where a number
belongs is a 422 naming the field, not a silent default. Responses ignore unknown fields, so an
older client keeps working against a newer server that adds some.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    field_validator,
)

from diloco.wire.format.dtypes import torch_dtype
from diloco.wire.format.specs import TensorSpec
from diloco.wire.validation import PROTOCOL_VERSION, validation_error_to_wire

__all__ = [
    "MAX_STEPS_PER_SECOND",
    "PROTOCOL_VERSION",
    "WORKER_ID_PATTERN",
    "DatasetRequest",
    "DeregisterResponse",
    "ErrorBody",
    "EvictRequest",
    "HealthResponse",
    "HeartbeatRequest",
    "HeartbeatResponse",
    "InfoResponse",
    "LeaseRequest",
    "OuterLrRequest",
    "OuterOptimizerSummary",
    "RegisterRequest",
    "RegisterResponse",
    "Settings",
    "StatusResponse",
    "SubmitResponse",
    "TensorSpecModel",
    "WaitingResponse",
    "WorkerStatus",
    "is_worker_id",
    "validation_error_to_wire",
]

WORKER_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
_WORKER_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")

DtypeName = Literal[
    "float32", "bfloat16", "float16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool"
]
WireFloatName = Literal["float32", "bfloat16"]
KindName = Literal["trainable", "frozen", "float_buffer", "int_buffer", "bool_buffer"]
WorkerId = Annotated[StrictStr, Field(pattern=WORKER_ID_PATTERN)]
# The largest count a message may carry (tokens, steps, rounds, shape dimensions): 2**48 is
# 281 trillion, far past any real run, and sums of up to 2**14 of them still fit SQLite's
# int64 (an unbounded `tokens=2**63` once overflowed it after a checkpoint was written).
MAX_COUNT = 2**48
Count = Annotated[StrictInt, Field(ge=0, le=MAX_COUNT)]
# The fastest a worker may say it trains: 1e6 optimizer steps per second is 1 microsecond a
# step, beyond any real model; above it the heartbeat is refused (422 naming the field).
MAX_STEPS_PER_SECOND = 1e6
StepsPerSecond = Annotated[
    float, Field(ge=0, le=MAX_STEPS_PER_SECOND, allow_inf_nan=False, strict=True)
]
Finite = Annotated[float, Field(allow_inf_nan=False, strict=True)]


def is_worker_id(text: str) -> bool:
    """Whether `text` is a valid worker id (for ids that arrive in a URL path or query)."""
    return isinstance(text, str) and _WORKER_ID_RE.fullmatch(text) is not None


class _Request(BaseModel):
    """A message a client sends: unknown fields are errors."""

    model_config = ConfigDict(extra="forbid")


class _Response(BaseModel):
    """A message the server sends: unknown fields are ignored, for forward compatibility."""

    model_config = ConfigDict(extra="ignore")


class TensorSpecModel(_Request):
    """One tensor of a registration: `{"name", "shape", "dtype", "kind"}`."""

    name: Annotated[StrictStr, Field(min_length=1)]
    shape: list[Count]
    dtype: DtypeName
    kind: KindName

    def to_spec(self) -> TensorSpec:
        return TensorSpec(
            name=self.name, shape=tuple(self.shape), dtype=torch_dtype(self.dtype), kind=self.kind
        )

    @classmethod
    def from_spec(cls, spec: TensorSpec) -> TensorSpecModel:
        return cls.model_validate(spec.to_json())


class RegisterRequest(_Request):
    """`POST /v1/workers`: a null `worker_id` asks the server to generate one."""

    protocol_version: StrictInt
    worker_id: WorkerId | None
    tensors: Annotated[list[TensorSpecModel], Field(min_length=1)]
    # A random value a worker process picks once: a retried registration (its answer lost)
    # carries the same session, so the server answers it again instead of 409.
    session: Annotated[StrictStr, Field(min_length=8, max_length=64)] | None = None
    # The worker waits for another's initial weights rather than offering its own: while none
    # exist the server tells one such registrant to upload them (`needs_initial_weights`) and
    # the others who does (`initial_upload_by`), so a slow link carries the model once.
    waits_for_initial: StrictBool = False

    @field_validator("tensors")
    @classmethod
    def _unique_names(cls, tensors: list[TensorSpecModel]) -> list[TensorSpecModel]:
        seen: set[str] = set()
        for spec in tensors:
            if spec.name in seen:
                raise ValueError(f"tensor {spec.name!r} is listed twice")
            seen.add(spec.name)
        return tensors

    def specs(self) -> list[TensorSpec]:
        return [tensor.to_spec() for tensor in self.tensors]


class OuterOptimizerSummary(_Response):
    """The server's outer optimizer, for a worker to log and to check against its config."""

    kind: str
    lr: float
    momentum: float


class Settings(_Response):
    """Settings every worker adopts verbatim from the server; all are required."""

    sync_every: int
    upload_dtype: WireFloatName
    download_dtype: WireFloatName
    upload_codec: str = "fp32"  # docs/protocol.md, Compressed bodies
    download_codec: str = "fp32"  # not fp32: results are coded deltas (Delta downloads)
    codec_block: int = 128
    topk_chunk: int = 128
    error_feedback_beta: float = 0.0
    heartbeat_interval: float
    heartbeat_timeout: float
    barrier_timeout: float | None  # null in async mode (no barrier)
    fragments: int
    delay: int
    alpha: float
    dylu: bool
    grace_seconds: float = 0.0
    staleness_weighting: str = "none"
    weighting: str
    min_workers: int
    max_body_bytes: int
    outer_optimizer: OuterOptimizerSummary
    # which of outer_optimizer, outer_lr, outer_momentum the upload codec chose; for people
    outer_defaults_from_codec: list[str] = []
    error_feedback_from_codec: bool = False  # error_feedback_beta is the codec's; for people
    aggregation: str = "mean"  # the server's; a worker needs nothing of it
    clip_multiple: float = 2.0
    outlier_ratio: float = 10.0


class InfoResponse(_Response):
    """`GET /v1/info`; `model_fingerprint` is null before the global weights exist."""

    protocol_version: int
    mode: str
    round: int
    fragment_rounds: list[int] | None = None  # each fragment's round (one entry but streaming)
    fragment_plan: list[list[str]] | None = None  # tensor names per fragment, once known
    model_fingerprint: str | None
    settings: Settings


class RegisterResponse(_Response):
    """`POST /v1/workers` 200."""

    worker_id: str
    round: int
    fragment_rounds: list[int] | None = None
    needs_initial_weights: bool
    initial_upload_by: str | None = None  # the worker uploading the initial weights, if waited on
    model_fingerprint: str | None
    settings: Settings
    # The worker's own bearer secret from now on (null from a server without tokens): new
    # when it registered with an enrollment or admin token, its own when it used that.
    credential: str | None = None


class SubmitResponse(_Response):
    """`POST /v1/rounds/{round}/submissions` 200."""

    status: Literal["accepted", "duplicate", "committed"]
    round: int
    fragment: int = 0
    current_round: int
    waiting_for: list[str]
    applied_version: int | None = None  # async: the outer step that applied it, once it has
    staleness: int | None = None  # async: outer steps between its anchor and its arrival


class WaitingResponse(_Response):
    """`GET /v1/rounds/{round}/result` 202: the wait elapsed first; poll again."""

    status: Literal["waiting"]
    round: int
    waiting_for: list[str]
    # Submissions the round needs beyond those of `waiting_for` (--min-workers is more than
    # its members): they must come from workers that join; 0 otherwise.
    more_submissions_needed: int = 0


class DatasetRequest(_Request):
    """`POST /v1/datasets`: a worker states the dataset it trains; the server cuts it into units.

    The pool's own limits (id pattern, length, unit size, seed range) are checked by the
    coordinator, which names the field; here only the types.
    """

    worker_id: WorkerId
    dataset_id: StrictStr
    length: StrictInt
    shuffle_seed: StrictInt = 0
    unit_size: StrictInt


class LeaseRequest(_Request):
    """`POST /v1/datasets/{dataset_id}/leases`: ask for work units to train."""

    worker_id: WorkerId
    count: StrictInt = 1
    next_epoch: StrictBool = Field(
        default=False, description="Open the next epoch when the current one has nothing free."
    )
    lease_key: Annotated[StrictStr, Field(min_length=8, max_length=64)] | None = Field(
        default=None, description="Retries of one request carry the same key: same units back."
    )


class HeartbeatRequest(_Request):
    """`POST /v1/workers/{id}/heartbeat`."""

    step: Count
    steps_per_second: StepsPerSecond
    loss: Finite | None
    tokens: Count
    # Sync windows the worker has finished; when it grows, `steps_per_second` is the compute
    # speed of the window just finished, a DyLU sample (docs/protocol.md).
    windows: Count | None = None


class HeartbeatResponse(_Response):
    """Heartbeat 200: the current round, an optional new H (DyLU) and an optional command."""

    round: int
    recommended_sync_every: int | None
    command: str | None


class DeregisterResponse(_Response):
    """`DELETE /v1/workers/{id}` 200."""

    worker_id: str
    removed: bool


class HealthResponse(_Response):
    """`GET /healthz`."""

    ok: bool


class WorkerStatus(_Response):
    """One worker in `GET /v1/status`."""

    worker_id: str
    live: bool
    step: int
    steps_per_second: float
    loss: float | None
    tokens: int
    last_seen_seconds_ago: float
    rounds_contributed: int
    recommended_sync_every: int | None = None


class StatusResponse(_Response):
    """`GET /v1/status`."""

    round: int
    mode: str
    broken: str | None = None  # why the server refuses requests until restarted
    fragment_rounds: list[int] | None = None
    workers: list[WorkerStatus]
    waiting_for: list[str]
    more_submissions_needed: int = 0  # the largest shortfall of --min-workers over open rounds
    bytes_in: int
    bytes_out: int
    rounds_per_hour: float
    uptime_seconds: float
    paused: bool = False  # an admin holds the outer steps (`diloco admin pause`)
    outer_lr: float | None = None  # the outer lr of the next step (an admin may change it)
    banned: list[str] = []  # worker ids an admin banned


class EvictRequest(_Request):
    """`POST /v1/admin/workers/{id}/evict` (admin scope)."""

    ban: StrictBool = False  # also refuse the id's registrations (and revoke its credential)
    reason: Annotated[StrictStr, Field(max_length=500)] = ""  # kept in the audit log


class OuterLrRequest(_Request):
    """`PUT /v1/admin/outer-lr` (admin scope): the outer lr of every later step."""

    outer_lr: Annotated[float, Field(gt=0, le=1e6, allow_inf_nan=False, strict=True)]


class ShardPausedRequest(_Request):
    """`POST /v1/shard/paused` (shard scope): streaming shard 0 paused or resumed the rounds."""

    paused: StrictBool
    # orders shard 0's words (a follower takes only one newer than the last it took); absent:
    # taken whatever came before
    stamp: Annotated[int, Field(ge=0, strict=True)] | None = None


_Squares = Annotated[float, Field(ge=0, allow_inf_nan=False, strict=True)]
_WorkerId = Annotated[StrictStr, Field(max_length=200)]
_Slices = Annotated[
    dict[_WorkerId, Annotated[StrictStr, Field(max_length=64)]], Field(max_length=100_000)
]


class ShardScreeningPart(_Request):
    """`POST /v1/shard/screening/{round}` (shard scope): a follower's part of shard 0's
    screening of a sync round under a robust rule: over its tensors of the `kept` slices
    (worker -> session digest), each one's dot with the element-wise median and its squares,
    and the median's squares (algorithm/robust.py's OpposedCheck); or the kept slices it
    lacks."""

    shard: Annotated[int, Field(ge=0, strict=True)]
    kept: _Slices
    dots: dict[_WorkerId, Finite]
    squares: dict[_WorkerId, _Squares]
    median_squares: _Squares
    # the kept workers whose slices the shard lacks (lost in a restart): it sums nothing yet,
    # and shard 0 tells their workers to send them again
    missing: Annotated[list[_WorkerId], Field(max_length=100_000)] = []


class ErrorBody(_Response):
    """Every rejection: one sentence, a stable kind, and the facts as fields."""

    error: str
    kind: str
    detail: dict[str, Any]
