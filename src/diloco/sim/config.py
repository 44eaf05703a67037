"""Settings of one simulated run, validated up front so a bad value fails before any training."""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, field

import torch

from diloco.algorithm import STALENESS_WEIGHTINGS
from diloco.algorithm.compression.codecs import Codec, parse_codec, require_kept_values
from diloco.algorithm.outer_optimizer import DEFAULT_MOMENTUM
from diloco.algorithm.recipes import (
    DENSE_DEFAULTS,
    OuterDefaults,
    aggregation_conflict,
    error_feedback_default,
    is_error_feedback_beta,
    outer_defaults,
    outer_warnings,
    resolve_aggregation,
    resolve_outer,
)
from diloco.algorithm.robust import Aggregation
from diloco.models import GPTConfig, ModelSpec
from diloco.models.causal_lm import CausalLMConfig
from diloco.sim.hostile import check_hostile
from diloco.training import autocast_dtype_of, training_device

MODES = ("single", "ddp", "diloco", "streaming", "async")


@functools.lru_cache(maxsize=16)
def _read_model_config(path: str) -> CausalLMConfig:
    """Reading checks the file by building the model once: a sweep or a run's several uses of
    `spec` pay that once per file, not once per access."""
    return CausalLMConfig.from_file(path)


@dataclass(frozen=True)
class SimConfig:
    """What `diloco simulate` runs. Steps are inner optimizer steps per worker (equal tokens)."""

    mode: str = "diloco"
    workers: int = 4
    sync_every: int = 50
    steps: int = 500
    # None: follow the upload codec, as the server's (server/settings.py, algorithm/recipes.py):
    # top-k sgd 1.0 with no momentum, any other codec nesterov 0.7 momentum 0.9; a value given
    # is kept. Resolved on construction; `outer_defaults_from_codec` names the codec's choices.
    outer_optimizer: str | None = None
    outer_lr: float | None = None
    outer_momentum: float | None = None
    fragments: int = 1
    delay: int = 0
    alpha: float = 0.0
    lr: float = 3e-3
    warmup: int = 50
    weight_decay: float = 0.1
    batch_size: int = 16
    seq_len: int = 64
    model: GPTConfig = field(default_factory=lambda: GPTConfig(context=64, width=64, depth=4))
    # A transformers causal-LM config file to train instead of `model` (models/causal_lm.py)
    model_config: str | None = None
    corpus: str | None = None
    seed: int = 0
    eval_every: int = 0
    eval_batches: int = 8
    speeds: tuple[float, ...] = ()
    dylu: bool = False
    async_delay: int = 0
    async_c: float = 0.0
    # Async, as the server's --grace-seconds and --staleness-weighting, in simulated time units
    grace: float = 0.0
    staleness_weighting: str = "none"
    # Pseudo-gradient compression, as the server's settings of the same names (sim/compression.py)
    upload_codec: str = "fp32"
    download_codec: str = "fp32"  # not fp32: workers get coded deltas of the published weights
    codec_block: int = 128
    topk_chunk: int = 128
    error_feedback_beta: float | None = None  # None: the upload codec's (0 for bf16, int8)
    # Robust aggregation (algorithm/robust.py) and a bad last worker (sim/hostile.py)
    aggregation: str | None = None  # None: follows the upload codec, as the server's
    hostile: str = "none"
    # Where the replicas train (cpu, cuda, cuda:N; auto is stored as what it resolved to) and
    # whether their forward passes run under bf16 autocast, as `diloco worker --device/--dtype`
    # (training.py); the global weights, the outer step and the evals stay fp32 on the CPU.
    device: str = "cpu"
    dtype: str = "fp32"
    outer_defaults_from_codec: tuple[str, ...] = field(default=(), init=False)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; choose one of {', '.join(MODES)}")
        for name in ("workers", "sync_every", "steps", "batch_size", "seq_len", "eval_batches"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("warmup", "eval_every", "async_delay", "delay"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if isinstance(self.device, torch.device):
            object.__setattr__(self, "device", str(self.device))
        if not isinstance(self.device, str) or not isinstance(self.dtype, str):
            raise ValueError(f"device and dtype are names, got {self.device!r}, {self.dtype!r}")
        object.__setattr__(self, "device", str(training_device(self.device)))
        autocast_dtype_of(self.dtype)  # fp32 or bf16
        context = self.model.context if self.model_config is None else self.spec.context
        if context is not None and self.seq_len > context:
            raise ValueError(f"seq_len ({self.seq_len}) must be <= the model context ({context})")
        if self.speeds:
            if self.mode != "async":
                raise ValueError("speeds apply to --mode async only")
            if len(self.speeds) != self.workers:
                raise ValueError(
                    f"speeds must give one value per worker ({self.workers}), "
                    f"got {len(self.speeds)}"
                )
            if any(not s > 0 for s in self.speeds):
                raise ValueError(f"speeds must all be > 0, got {list(self.speeds)}")
        if self.dylu and self.mode != "async":
            raise ValueError("dylu applies to --mode async only")
        if not (isinstance(self.grace, (int, float)) and 0 <= self.grace < math.inf):
            raise ValueError(f"grace must be a number >= 0 (simulated time), got {self.grace!r}")
        if self.grace and self.mode != "async":
            raise ValueError("grace applies to --mode async only")
        if self.staleness_weighting not in STALENESS_WEIGHTINGS:
            raise ValueError(
                "staleness_weighting must be one of "
                f"{', '.join(STALENESS_WEIGHTINGS)}, got {self.staleness_weighting!r}"
            )
        if self.staleness_weighting != "none" and self.mode != "async":
            raise ValueError("staleness_weighting applies to --mode async only")
        self._check_codec_settings()
        self._resolve_outer()
        object.__setattr__(self, "aggregation", str(Aggregation.parse(self.aggregation)))
        conflict = aggregation_conflict(self.upload, self.aggregation)
        if conflict is not None:
            raise ValueError(conflict)
        check_hostile(self.hostile)
        sparse_in_streaming = self.aggregation == "sparse_mean" and self.mode == "streaming"
        robust = self.aggregation != "mean" and not sparse_in_streaming
        if (robust or self.hostile != "none") and self.mode != "diloco":
            raise ValueError(
                "aggregation and hostile apply to --mode diloco in the simulator (sync rounds; "
                "sparse_mean also to --mode streaming)"
            )

    def _check_codec_settings(self) -> None:
        """As the server's: the codec spec is stored in its canonical spelling."""
        codec = parse_codec(self.upload_codec, block=self.codec_block, chunk=self.topk_chunk)
        object.__setattr__(self, "upload_codec", str(require_kept_values(codec)))
        download = parse_codec(self.download_codec, block=self.codec_block, chunk=self.topk_chunk)
        require_kept_values(download)
        object.__setattr__(self, "download_codec", str(download))
        if not download.is_identity and self.mode in ("single", "ddp"):
            raise ValueError(
                f"download_codec {download} applies to modes diloco, streaming and async only "
                f"(mode {self.mode} has no global weights to download)"
            )
        if self.error_feedback_beta is None:  # the upload codec's, as the server's
            object.__setattr__(self, "error_feedback_beta", error_feedback_default(codec))
        beta = self.error_feedback_beta
        if not is_error_feedback_beta(beta):
            raise ValueError(
                f"error_feedback_beta must be in [0, 1) (0: no error feedback), got {beta!r}"
            )
        if not codec.is_identity and self.mode in ("single", "ddp"):
            raise ValueError(
                f"upload_codec {codec} applies to modes diloco, streaming and async only "
                f"(mode {self.mode} sends no pseudo-gradients)"
            )

    def _resolve_outer(self) -> None:
        """As the server's: each outer setting (and the aggregation) not given follows the
        upload codec; mode async steps with Delayed Nesterov (lr 0.7, momentum 0.9 unless
        given) and the mean, which the codec does not change; single and ddp have no outer
        step (their recorded defaults are unused)."""
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
        rounds = self.mode in ("diloco", "streaming")
        aggregation, codec_chose = resolve_aggregation(
            self.outer_defaults, self.aggregation, uniform_rounds=rounds, codec=self.upload
        )
        object.__setattr__(self, "aggregation", aggregation)
        chosen = outer.chosen + (("aggregation",) if codec_chose else ())
        from_codec = tuple(chosen) if rounds else ()
        object.__setattr__(self, "outer_defaults_from_codec", from_codec)

    @property
    def outer_defaults(self) -> OuterDefaults:
        """What the upload codec picks for an outer setting not given (async: Delayed
        Nesterov's 0.7 and 0.9 whatever the codec)."""
        return DENSE_DEFAULTS if self.mode == "async" else outer_defaults(self.upload)

    def outer_warnings(self) -> list[str]:
        """The measured costs over 5 % this run's codec and outer optimizer risk (none for
        single and ddp, which send no pseudo-gradients)."""
        if self.mode in ("single", "ddp"):
            return []
        return outer_warnings(
            self.upload, str(self.outer_optimizer), float(self.outer_momentum), self.aggregation
        )

    @property
    def spec(self) -> ModelSpec:
        """What each replica trains: the bundled GPT, or the model of `model_config`."""
        if self.model_config is None:
            return self.model
        return _read_model_config(self.model_config)

    @property
    def download(self) -> Codec:
        """The codec of the published weights' deltas (fp32: full weights)."""
        return parse_codec(self.download_codec, block=self.codec_block, chunk=self.topk_chunk)

    @property
    def upload(self) -> Codec:
        """The pseudo-gradient codec every simulated worker uses."""
        return parse_codec(self.upload_codec, block=self.codec_block, chunk=self.topk_chunk)

    @property
    def effective_workers(self) -> int:
        """`single` trains one replica whatever --workers says."""
        return 1 if self.mode == "single" else self.workers

    @property
    def worker_speeds(self) -> tuple[float, ...]:
        return self.speeds or (1.0,) * self.effective_workers

    @property
    def eval_interval(self) -> int:
        """Inner steps between evaluations: an outer round for DiLoCo, else about 20 points."""
        if self.eval_every:
            return self.eval_every
        if self.mode in ("diloco", "streaming", "async"):
            return self.sync_every
        return max(1, self.steps // 20)

    def to_dict(self) -> dict:
        """Every setting as resolved (outer ones too), and which the upload codec chose."""
        data = asdict(self)
        data["speeds"] = list(self.worker_speeds)
        data["outer_defaults_from_codec"] = list(self.outer_defaults_from_codec)
        return data

    @classmethod
    def from_dict(cls, data: dict) -> SimConfig:
        """The inverse of `to_dict` (a sweep's child process gets its run this way, as JSON)."""
        fields = dict(data)
        # what the codec chose it chooses again (the same codec: the same values)
        for name in fields.pop("outer_defaults_from_codec", ()):
            fields[name] = None
        fields["model"] = GPTConfig(**fields["model"])
        # to_dict writes every worker's speed; only async runs take them as a setting
        fields["speeds"] = tuple(fields["speeds"]) if fields["mode"] == "async" else ()
        return cls(**fields)
