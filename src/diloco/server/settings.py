"""The settings every worker must adopt; the server owns them and states them in /v1/info."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from diloco.algorithm import (
    APPLY_POLICIES,
    STALENESS_WEIGHTINGS,
    WEIGHTINGS,
    DelayedNesterov,
    OuterOptimizer,
)
from diloco.algorithm._checks import require_fraction, require_positive
from diloco.algorithm.compression.codecs import Codec, parse_codec, require_kept_values
from diloco.algorithm.fragments import StreamingSchedule
from diloco.algorithm.outer_optimizer import DEFAULT_MOMENTUM
from diloco.algorithm.recipes import (
    DENSE_DEFAULTS,
    INT8_FEEDBACK_RESULTS,
    OuterDefaults,
    aggregation_conflict,
    error_feedback_default,
    is_error_feedback_beta,
    outer_defaults,
    outer_warnings,
    resolve_aggregation,
    resolve_outer,
)
from diloco.algorithm.robust import DEFAULT_CLIP_MULTIPLE, DEFAULT_OUTLIER_RATIO, Aggregation
from diloco.wire import dtype_name

SERVER_MODES = ("sync", "streaming", "async")
DEFAULT_MAX_BODY_BYTES = 4 * 1024**3
DEFAULT_BARRIER_TIMEOUT = 600.0
# /v1/info settings that say how a value was chosen rather than set one: a restart on a state
# dir and a shard against shard 0 do not compare them.
DESCRIPTIVE_SETTINGS = frozenset({"outer_defaults_from_codec", "error_feedback_from_codec"})
OUTER_SETTINGS = ("outer_optimizer", "outer_lr", "outer_momentum")


@dataclass(frozen=True)
class ServerSettings:
    """Validated on construction: a bad value fails with the field's name and allowed range.

    A setting that belongs to another mode (fragments in sync mode, a barrier timeout in async
    mode, which has no barrier) is an error, not silently ignored.
    """

    mode: str = "sync"
    sync_every: int = 50
    # None: follow the upload codec (algorithm/recipes.py): top-k picks sgd, lr 1.0, no
    # momentum (SparseLoCo), any other codec nesterov, lr 0.7, momentum 0.9. A value given is
    # kept; a momentum not given is the optimizer's own (0.9, or 0 for sgd). Resolved on
    # construction; `outer_defaults_from_codec` names the ones the codec chose.
    outer_optimizer: str | None = None
    outer_lr: float | None = None
    outer_momentum: float | None = None
    weighting: str = "uniform"
    policy: str = "default"
    upload_dtype: torch.dtype = torch.float32
    download_dtype: torch.dtype = torch.float32
    # Pseudo-gradient compression (algorithm/compression/codecs.py): the codec, its
    # quantization block and top-k chunk, and the workers' error-feedback decay (None: the
    # upload codec's, `error_feedback_default`: off for bf16 and int8, else 0.95). fp32 and
    # bf16 go as plain tensors (upload_codec bf16 is upload_dtype bf16); the others as
    # compressed bodies.
    upload_codec: str = "fp32"
    # Downloads as coded deltas against the published weights every worker holds (fp32: full
    # weights every round, as download_dtype says); server/model/published_copy.py.
    download_codec: str = "fp32"
    codec_block: int = 128
    topk_chunk: int = 128
    error_feedback_beta: float | None = None
    heartbeat_interval: float = 5.0
    heartbeat_timeout: float = 30.0
    barrier_timeout: float | None = None  # None: 600 s with a barrier (sync, streaming)
    min_workers: int = 1
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    # streaming: P fragments, the delay tau (inner steps a transfer overlaps), the merge alpha
    fragments: int = 1
    delay: int = 0
    alpha: float = 0.0
    # async: Delayed Nesterov period N and c, the grace window, staleness scaling, DyLU
    dn_period: int = 1
    dn_c: float = 0.0
    grace_seconds: float = 0.0
    staleness_weighting: str = "none"
    dylu: bool = False
    # Robust aggregation (algorithm/robust.py): mean, or clipped_mean with outliers refused;
    # the clip bound and the outlier threshold are multiples of the median recent norm.
    # None: follows the upload codec (sparse_mean for top-k in sync and streaming rounds of
    # uniform weight, else mean; algorithm/recipes.py)
    aggregation: str | None = None
    clip_multiple: float = DEFAULT_CLIP_MULTIPLE
    outlier_ratio: float = DEFAULT_OUTLIER_RATIO
    # Server-side only (not sent to workers): how many tensor bodies may sit in RAM at once;
    # other uploads are written to `spool_dir` (the system temp dir if None) as they arrive.
    # 0 (the default) spools every submission: memory then stays ~4x the model for any K.
    memory_bodies: int = 0
    spool_dir: str | None = None
    # Sharded servers (issue 15): this process is shard `shard` of the shards at `shard_urls`
    # (shard 0 leads: membership and each round's decision); empty: one server, no shards.
    shard: int = 0
    shard_urls: tuple[str, ...] = ()
    outer_defaults_from_codec: tuple[str, ...] = field(default=(), init=False)
    # who chose error_feedback_beta: "given", "codec" (none given), "state dir" (a restart
    # kept the stored run's in place of the codec's)
    error_feedback_source: str = field(default="given", init=False)

    def __post_init__(self) -> None:
        if self.mode not in SERVER_MODES:
            raise ValueError(f"mode must be one of {', '.join(SERVER_MODES)}, got {self.mode!r}")
        for name in ("sync_every", "min_workers", "max_body_bytes", "fragments", "dn_period"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("heartbeat_interval", "heartbeat_timeout"):
            _require_seconds(name, getattr(self, name))
        if self.barrier_timeout is not None:
            _require_seconds("barrier_timeout", self.barrier_timeout)
        if not isinstance(self.memory_bodies, int) or self.memory_bodies < 0:
            raise ValueError(
                f"memory_bodies must be an integer >= 0 (0: every upload goes to disk), "
                f"got {self.memory_bodies!r}"
            )
        if self.heartbeat_interval >= self.heartbeat_timeout:
            raise ValueError(
                f"heartbeat_interval ({self.heartbeat_interval}) must be below "
                f"heartbeat_timeout ({self.heartbeat_timeout})"
            )
        if self.weighting not in WEIGHTINGS:
            raise ValueError(
                f"weighting must be one of {', '.join(WEIGHTINGS)}, got {self.weighting!r}"
            )
        if self.policy not in APPLY_POLICIES:
            raise ValueError(
                f"policy must be one of {', '.join(APPLY_POLICIES)}, got {self.policy!r}"
            )
        for name in ("upload_dtype", "download_dtype"):
            if getattr(self, name) not in (torch.float32, torch.bfloat16):
                raise ValueError(f"{name} must be float32 or bfloat16, got {getattr(self, name)}")
        self._check_codec_settings()
        self._resolve_outer()
        self._check_mode_settings()
        self._check_aggregation()
        self._check_shards()
        self.make_outer_optimizer()  # raises for a bad kind, lr, momentum, period or c

    def _check_codec_settings(self) -> None:
        codec = parse_codec(self.upload_codec, block=self.codec_block, chunk=self.topk_chunk)
        require_kept_values(codec)
        if codec.is_sparse or codec.is_quantized:
            if self.upload_dtype != torch.float32:
                raise ValueError(
                    f"upload_dtype {dtype_name(self.upload_dtype)} applies to plain uploads; "
                    f"with upload_codec {codec} give one or the other"
                )
        elif codec.values == "bf16":
            object.__setattr__(self, "upload_dtype", torch.bfloat16)
        elif self.upload_dtype == torch.bfloat16:  # the older spelling of upload_codec bf16
            codec = Codec("bf16", None, codec.block, codec.chunk)
        object.__setattr__(self, "upload_codec", str(codec))
        download = parse_codec(self.download_codec, block=self.codec_block, chunk=self.topk_chunk)
        require_kept_values(download)
        if not download.is_identity and self.download_dtype != torch.float32:
            raise ValueError(
                f"download_dtype {dtype_name(self.download_dtype)} applies to full-weight "
                f"downloads; with download_codec {download} the full weights are the fp32 "
                "published copy: give one or the other"
            )
        object.__setattr__(self, "download_codec", str(download))
        if self.error_feedback_beta is None:
            object.__setattr__(self, "error_feedback_beta", error_feedback_default(codec))
            object.__setattr__(self, "error_feedback_source", "codec")
        beta = self.error_feedback_beta
        if not is_error_feedback_beta(beta):
            raise ValueError(
                f"error_feedback_beta must be in [0, 1) (0: no error feedback), got {beta!r}"
            )

    def _resolve_outer(self) -> None:
        """Each of outer_optimizer, outer_lr, outer_momentum and aggregation not given follows
        the upload codec (`outer_defaults`); a given one is kept. Mode async always steps with
        Delayed Nesterov (lr 0.7, momentum 0.9 unless given) and the mean: SparseLoCo's sgd
        is measured for rounds that average K workers, not for arrivals applied one by one,
        so there the codec chooses nothing (and a top-k codec's momentum warning stands)."""
        outer = resolve_outer(
            self.outer_defaults,
            self.upload_codec,
            self.outer_optimizer,
            self.outer_lr,
            self.outer_momentum,
            DEFAULT_MOMENTUM,
        )
        object.__setattr__(self, "outer_optimizer", outer.optimizer)
        object.__setattr__(self, "outer_lr", outer.lr)
        object.__setattr__(self, "outer_momentum", outer.momentum)
        aggregation, codec_chose = resolve_aggregation(
            self.outer_defaults,
            self.aggregation,
            codec=self.upload,
            # (sharded servers too: each shard averages its own tensors' elements)
            uniform_rounds=self.mode != "async" and self.weighting == "uniform",
        )
        object.__setattr__(self, "aggregation", aggregation)
        chosen = outer.chosen + (("aggregation",) if codec_chose else ())
        from_codec = tuple(chosen) if self.mode != "async" else ()
        object.__setattr__(self, "outer_defaults_from_codec", from_codec)

    @property
    def outer_defaults(self) -> OuterDefaults:
        """What the upload codec picks for an outer setting not given (async: Delayed
        Nesterov's lr 0.7 and momentum 0.9, whatever the codec)."""
        return DENSE_DEFAULTS if self.mode == "async" else outer_defaults(self.upload)

    def outer_recipe(self) -> str:
        """The outer optimizer in words, saying which settings the codec chose (the server's
        start-up log line)."""
        described = self.make_outer_optimizer().describe()
        kind, lr, momentum = described["kind"], described["lr"], described["momentum"]
        text = f"outer optimizer {kind} lr {lr:g} momentum {momentum:g}, {self.aggregation}"
        chosen = [name.removeprefix("outer_") for name in self.outer_defaults_from_codec]
        if not chosen:
            given = "given" if self.mode != "async" else "mode async's Delayed Nesterov"
            return f"{text} ({given})"
        return (
            f"{text} ({', '.join(chosen)} chosen by upload codec {self.upload_codec}: "
            f"{self.outer_defaults.why})"
        )

    @property
    def error_feedback_from_codec(self) -> bool:
        """Whether error_feedback_beta is the upload codec's choice (/v1/info says it)."""
        return self.error_feedback_source == "codec"

    def feedback_recipe(self) -> str | None:
        """The workers' error feedback in words (the server's start-up log line), saying
        whether the codec chose it; None for a codec that sends every value exactly."""
        codec = self.upload
        if codec.is_identity:
            return None
        beta = float(self.error_feedback_beta)
        text = f"error feedback beta {beta:g}" if beta else "no error feedback"
        if self.error_feedback_source == "state dir":
            return f"{text} (the state dir's run began with it)"
        if self.error_feedback_source == "given":
            return f"{text} (given)"
        if beta:
            return f"{text} (chosen by upload codec {codec}: it keeps what the codec left out)"
        return (
            f"{text} (chosen by upload codec {codec}: the runs measured ended no worse "
            f"without it, {INT8_FEEDBACK_RESULTS}; --error-feedback-beta 0.95 turns it on at "
            "two more fp32 copies of the model per worker)"
        )

    def outer_warnings(self) -> list[str]:
        """The measured costs over 5 % this codec and outer optimizer risk, one sentence each
        (algorithm/recipes.py); a warning, never a refusal."""
        return outer_warnings(
            self.upload, str(self.outer_optimizer), float(self.outer_momentum), self.aggregation
        )

    def keep_stored_outer(self, stored: Mapping) -> list[str]:
        """A restart on a state dir: the outer settings this start let the codec choose take
        the values the stored run began with, so a run keeps its outer optimizer (and its
        momentum state) when the codec's defaults have changed since (runs of top-k codecs
        started before SparseLoCo's sgd became their default kept nesterov 0.7). Returns the
        settings taken, in words; none when they agree. `stored`: /v1/info settings."""
        said = self._keep_stored_feedback(stored)
        return said + self._keep_stored_outer_optimizer(stored)

    def _keep_stored_feedback(self, stored: Mapping) -> list[str]:
        """The error-feedback beta the codec chose takes the stored run's (runs of int8 and
        bf16 began with 0.95 before those codecs' default became 0): the workers' saved
        residuals belong to it."""
        if not self.error_feedback_from_codec or stored.get("upload_codec") != self.upload_codec:
            return []  # (another codec: the settings check names the difference)
        beta = stored.get("error_feedback_beta")
        if not is_error_feedback_beta(beta):
            return []  # not a beta we can take: the settings check names the difference
        if float(beta) == self.error_feedback_beta:
            return []
        said = (
            f"error_feedback_beta {float(beta)!r} (upload codec {self.upload_codec}'s "
            f"default: {self.error_feedback_beta!r})"
        )
        object.__setattr__(self, "error_feedback_beta", float(beta))
        object.__setattr__(self, "error_feedback_source", "state dir")
        return [said]

    def _keep_stored_outer_optimizer(self, stored: Mapping) -> list[str]:
        """`keep_stored_outer` for outer_optimizer, outer_lr, outer_momentum, aggregation."""
        outer = stored.get("outer_optimizer")
        if not isinstance(outer, dict) or not self.outer_defaults_from_codec:
            return []
        if outer.get("kind") not in ("sgd", "momentum", "nesterov"):
            return []  # another mode's optimizer: the settings check names the difference
        wanted = {
            "outer_optimizer": outer.get("kind"),
            "outer_lr": outer.get("lr"),
            "outer_momentum": outer.get("momentum"),
            "aggregation": stored.get("aggregation", "mean"),  # older servers: the mean
        }
        taken = {name: wanted[name] for name in self.outer_defaults_from_codec}
        if all(value == getattr(self, name) for name, value in taken.items()):
            return []
        kind = taken.get("outer_optimizer", self.outer_optimizer)
        lr = taken.get("outer_lr", self.outer_lr)
        momentum = taken.get("outer_momentum", self.outer_momentum)
        if taken.get("aggregation", "mean") not in ("mean", "sparse_mean"):
            return []  # not a rule a codec chooses: the settings check names the difference
        try:
            OuterOptimizer(str(kind), lr=lr, momentum=momentum)  # type: ignore[arg-type]
        except ValueError:
            return []  # not a setting we can take: the settings check names the difference
        said = [
            f"{name} {value!r} (upload codec {self.upload_codec}'s default: "
            f"{getattr(self, name)!r})"
            for name, value in taken.items()
            if value != getattr(self, name)
        ]
        for name, value in taken.items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "outer_defaults_from_codec", ())
        return said

    @property
    def upload(self) -> Codec:
        """The pseudo-gradient codec every worker uses."""
        return parse_codec(self.upload_codec, block=self.codec_block, chunk=self.topk_chunk)

    @property
    def download(self) -> Codec:
        """The codec of the weight deltas workers download (fp32: full weights instead)."""
        return parse_codec(self.download_codec, block=self.codec_block, chunk=self.topk_chunk)

    @property
    def delta_downloads(self) -> bool:
        """Whether a round's result is a coded delta against the published weights."""
        return not self.download.is_identity

    @property
    def compressed_uploads(self) -> bool:
        """Whether submissions are compressed bodies (not plain fp32 or bf16 tensors)."""
        upload = self.upload
        return upload.is_sparse or upload.is_quantized

    def _check_mode_settings(self) -> None:
        streaming = {"fragments": 1, "delay": 0, "alpha": 0.0}
        asynchronous = {
            "dn_period": 1,
            "dn_c": 0.0,
            "grace_seconds": 0.0,
            "staleness_weighting": "none",
            "dylu": False,
        }
        foreign = dict(streaming) if self.mode != "streaming" else {}
        if self.mode != "async":
            foreign.update(asynchronous)
        for name, default in foreign.items():
            if getattr(self, name) != default:
                owner = "streaming" if name in streaming else "async"
                raise ValueError(
                    f"{name} applies to mode {owner} only (got {name}={getattr(self, name)!r} "
                    f"with mode {self.mode})"
                )
        if self.mode == "streaming":
            if isinstance(self.delay, bool) or not isinstance(self.delay, int):
                raise ValueError(f"delay must be an integer, got {self.delay!r}")
            StreamingSchedule(self.sync_every, self.fragments, self.delay)  # P | H, tau < S
            require_fraction("alpha", self.alpha, include_one=True)
        if self.mode == "async":
            if self.barrier_timeout is not None:
                raise ValueError(
                    "barrier_timeout does not apply to mode async: it has no barrier "
                    f"(got barrier_timeout={self.barrier_timeout:g})"
                )
            if self.min_workers != 1:
                raise ValueError(
                    "min_workers does not apply to mode async: each arrival is applied "
                    f"alone (got min_workers={self.min_workers})"
                )
            if self.outer_optimizer != "nesterov":
                raise ValueError(
                    "mode async uses Delayed Nesterov (--dn-period, --dn-c); outer_optimizer "
                    f"must be nesterov, got {self.outer_optimizer!r}"
                )
            grace = self.grace_seconds
            grace_ok = isinstance(grace, (int, float)) and not isinstance(grace, bool)
            if not grace_ok or not math.isfinite(grace) or grace < 0:
                raise ValueError(f"grace_seconds must be a number >= 0, got {grace!r}")
            if self.staleness_weighting not in STALENESS_WEIGHTINGS:
                raise ValueError(
                    f"staleness_weighting must be one of {', '.join(STALENESS_WEIGHTINGS)}, "
                    f"got {self.staleness_weighting!r}"
                )

    def _check_aggregation(self) -> None:
        rule = self.robust.rule  # raises for an unknown rule, a bad F, multiple or ratio
        conflict = aggregation_conflict(self.upload, rule)
        if conflict is not None:
            raise ValueError(conflict)
        if rule == "sparse_mean" and (self.mode == "async" or self.weighting != "uniform"):
            raise ValueError(
                "aggregation sparse_mean averages each element over the workers of a round "
                "that sent it, with uniform weights: it needs mode sync or streaming and "
                f"weighting uniform (got mode {self.mode!r}, weighting {self.weighting!r})"
            )
        if rule in ("trimmed_mean", "median") and self.mode == "async":
            raise ValueError(
                f"aggregation {self.aggregation} combines a round's pseudo-gradients element "
                "by element, and mode async applies each arrival alone; use clipped_mean "
                "(screened against the running median norm) or mode sync/streaming"
            )
        if rule in ("trimmed_mean", "median") and self.compressed_uploads:
            raise ValueError(
                f"aggregation {self.aggregation} reads each pseudo-gradient tensor by tensor, "
                f"which compressed uploads (upload_codec {self.upload_codec}) do not allow; "
                "use fp32 or bf16 uploads, or clipped_mean"
            )
        if self.robust.screens and self.weighting != "uniform":
            raise ValueError(
                f"aggregation {rule} weighs every pseudo-gradient alike (a token count is a "
                f"claim a hostile worker could inflate); got weighting {self.weighting!r}"
            )

    @property
    def robust(self) -> Aggregation:
        """The aggregation rule with its clip multiple and outlier ratio."""
        return Aggregation.parse(self.aggregation, self.clip_multiple, self.outlier_ratio)

    def change_outer_lr(self, lr: float) -> None:
        """The one setting an operator may change mid-run (`diloco admin set-outer-lr`).

        Changed in place, so every part of the server that holds these settings sees the same
        value at once (and /v1/info and the next checkpoint state it); the caller sets the
        live optimizer's lr. Validated like the constructor's."""
        object.__setattr__(self, "outer_lr", require_positive("outer_lr", lr))
        chosen = tuple(name for name in self.outer_defaults_from_codec if name != "outer_lr")
        object.__setattr__(self, "outer_defaults_from_codec", chosen)  # an admin chose it

    @property
    def effective_barrier_timeout(self) -> float | None:
        """Seconds a barrier may wait; None in async mode (no barrier)."""
        if self.mode == "async":
            return None
        return DEFAULT_BARRIER_TIMEOUT if self.barrier_timeout is None else self.barrier_timeout

    def make_outer_optimizer(self) -> OuterOptimizer | DelayedNesterov:
        if self.mode == "async":
            momentum = 0.9 if self.outer_momentum is None else self.outer_momentum
            return DelayedNesterov(
                lr=self.outer_lr, momentum=momentum, delay=self.dn_period, c=self.dn_c
            )
        return OuterOptimizer(self.outer_optimizer, lr=self.outer_lr, momentum=self.outer_momentum)

    @property
    def shards(self) -> int:
        """How many server shards hold the model (1: one server)."""
        return max(1, len(self.shard_urls))

    @property
    def leads(self) -> bool:
        """Whether this process decides rounds: one server, or shard 0 of several."""
        return self.shard == 0

    def _check_shards(self) -> None:
        """Sharded servers take every codec and every aggregation one server takes in their
        mode (streaming shards own whole fragments, at least one each)."""
        count = len(self.shard_urls)
        if count == 0:
            if self.shard != 0:
                raise ValueError("shard needs the URLs of every shard (shard_urls)")
            return
        if count < 2:
            raise ValueError(f"shard_urls must name at least 2 shards, got {count}")
        if len(set(self.shard_urls)) != count:
            raise ValueError(f"shard_urls must be distinct, got {list(self.shard_urls)}")
        if isinstance(self.shard, bool) or not isinstance(self.shard, int):
            raise ValueError(f"shard must be an integer, got {self.shard!r}")
        if not 0 <= self.shard < count:
            raise ValueError(
                f"shard must be in [0, {count - 1}] for {count} shards, got {self.shard}"
            )
        if self.mode == "streaming" and self.fragments < count:
            raise ValueError(
                f"sharded servers in streaming mode need at least one fragment per shard (each "
                f"shard owns whole fragments): {self.fragments} fragments for {count} shards"
            )
        # Every mode takes every codec: a worker codes each tensor on its own and sends each
        # shard its tensors' parts (streaming: its fragments' bodies whole), which the shard
        # folds as one server would; each shard codes its tensors' delta, and the worker
        # joins the shards' deltas into one. sparse_mean counts each element's senders where
        # the element is folded. A streaming shard screens its own fragments' bodies, whole,
        # as one server does; shard 0 screens each worker's whole pseudo-gradient from every
        # shard's part of its sums in sync mode (server/shards/sync_decisions.py) and each
        # arrival by its whole norm in async mode, where the rules one server takes there
        # (clipped_mean) apply.

    def to_wire(self) -> dict:
        """The `settings` object of /v1/info (docs/protocol.md)."""
        return {
            "mode": self.mode,
            "sync_every": self.sync_every,
            "upload_dtype": dtype_name(self.upload_dtype),
            "download_dtype": dtype_name(self.download_dtype),
            "upload_codec": self.upload_codec,
            "download_codec": self.download_codec,
            "codec_block": self.codec_block,
            "topk_chunk": self.topk_chunk,
            "error_feedback_beta": float(self.error_feedback_beta),
            "heartbeat_interval": float(self.heartbeat_interval),
            "heartbeat_timeout": float(self.heartbeat_timeout),
            "barrier_timeout": self.effective_barrier_timeout,
            "fragments": self.fragments,
            "delay": self.delay,
            "alpha": float(self.alpha),
            "dylu": self.dylu,
            "grace_seconds": float(self.grace_seconds),
            "staleness_weighting": self.staleness_weighting,
            "weighting": self.weighting,
            "min_workers": self.min_workers,
            "max_body_bytes": self.max_body_bytes,
            "outer_optimizer": self.make_outer_optimizer().describe(),
            # which of outer_optimizer, outer_lr, outer_momentum the upload codec chose
            "outer_defaults_from_codec": list(self.outer_defaults_from_codec),
            # whether error_feedback_beta is the upload codec's choice (none was given)
            "error_feedback_from_codec": self.error_feedback_from_codec,
            "aggregation": self.aggregation,
            "clip_multiple": float(self.clip_multiple),
            "outlier_ratio": float(self.outlier_ratio),
            # only when sharded: one server's settings stay as protocol.md lists them
            **({"shards": list(self.shard_urls)} if self.shard_urls else {}),
        }


def _require_seconds(name: str, value: object) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not (ok and math.isfinite(value) and value > 0):  # type: ignore[arg-type]
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
