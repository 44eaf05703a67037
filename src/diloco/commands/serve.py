"""`diloco server`: the coordinator over HTTP."""

from __future__ import annotations

import math
import socket
from pathlib import Path

import typer

from diloco.algorithm.compression import fused_int8
from diloco.algorithm.recipes import error_feedback_note
from diloco.algorithm.robust import DEFAULT_CLIP_MULTIPLE, DEFAULT_OUTLIER_RATIO
from diloco.commands.options import (
    ASYNC_PANEL,
    AUTH_PANEL,
    CODEC_PANEL,
    DURABILITY_PANEL,
    ERROR_FEEDBACK_HELP,
    OUTER_LR_HELP,
    OUTER_MOMENTUM_HELP,
    OUTER_OPTIMIZER_HELP,
    OUTPUTS_PANEL,
    STREAMING_PANEL,
    TokenFileOption,
    TokenOption,
    check_ca_file,
    read_token,
)
from diloco.commands.threads import (
    SERVER_DEFAULT_THREADS,
    apply_thread_budget,
    server_threads,
)
from diloco.console import check_output_path, err, fail, warn
from diloco.server.http.runner import TlsFiles, serve
from diloco.server.members.credentials import TokensFileError, load_tokens_file
from diloco.server.settings import ServerSettings
from diloco.server.state.journal import (
    INTERVAL_CHECKPOINT_EVERY,
    ROUND_CHECKPOINT_EVERY,
    default_checkpoint_every,
)
from diloco.wire import parse_wire_dtype

# --help panels of this command's own options (the shared ones are in options.py).
ROUNDS_PANEL = "Rounds and outer optimizer"
ROBUST_PANEL = "Robust aggregation"
MEMBERSHIP_PANEL = "Membership"
UPLOADS_PANEL = "Upload limits"
SHARDING_PANEL = "Sharding"

# Options of one mode, with their defaults there; given with another mode they are an error.
MODE_DEFAULTS = {
    "streaming": {"fragments": 1, "delay": 0, "alpha": 0.5},
    "async": {
        "dn_period": 1,
        "dn_c": 0.0,
        "grace_seconds": 0.0,
        "staleness_weighting": "none",
        "dylu": False,
    },
}


# uvicorn's log levels (--log-level), checked before anything starts
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def check_host(host: str) -> None:
    """--host must name an address this machine can resolve (a typo was uvicorn's error,
    exit 3, after the state dir was written); whether it can bind there is the bind's."""
    try:
        socket.getaddrinfo(host, None)
    except (OSError, UnicodeError) as exc:
        raise fail(f"--host {host!r} is not an address here ({exc})") from None


def _mode_options(mode: str, **given: object) -> dict:
    """The mode's own options (defaults filled in); an option of another mode is refused."""
    options: dict = {}
    for owner, defaults in MODE_DEFAULTS.items():
        for name, default in defaults.items():
            value = given[name]
            flag = "--" + name.replace("_", "-")
            if owner != mode and value is not None:
                raise ValueError(f"{flag} applies to --mode {owner} only (the mode is {mode})")
            if owner == mode:
                options[name] = default if value is None else value
    return options


def server_command(
    host: str = typer.Option("127.0.0.1", help="Address to listen on."),
    port: int = typer.Option(8470, help="Port (0 picks a free one; see --port-file)."),
    port_file: Path = typer.Option(None, help="Write the bound port here once listening."),
    init: Path = typer.Option(None, help="Initial global weights (.safetensors)."),
    state_dir: Path = typer.Option(
        None,
        help="Make every round durable here; restarting on it resumes the run.",
        rich_help_panel=DURABILITY_PANEL,
    ),
    keep_checkpoints: int = typer.Option(
        3, help="Checkpoint generations kept in --state-dir.", rich_help_panel=DURABILITY_PANEL
    ),
    override_settings: bool = typer.Option(
        False,
        "--override-settings",
        help="Resume a --state-dir even though its stored settings differ.",
        rich_help_panel=DURABILITY_PANEL,
    ),
    durability: str = typer.Option(
        "round",
        help="round: every round is on disk before its result is sent (its input in the "
        "step log; a full checkpoint every --checkpoint-every rounds, the steps since "
        "replayed after a crash); interval: a checkpoint every --checkpoint-every rounds "
        "and no step log (a crash then rolls back to the last checkpoint).",
        rich_help_panel=DURABILITY_PANEL,
    ),
    checkpoint_every: int = typer.Option(
        None,
        help="Rounds between full checkpoints (default "
        f"{ROUND_CHECKPOINT_EVERY} with --durability round, whose step log keeps the rounds "
        f"between: about one model-sized file each; {INTERVAL_CHECKPOINT_EVERY} with interval).",
        rich_help_panel=DURABILITY_PANEL,
    ),
    mode: str = typer.Option(
        "sync",
        help="sync: a barrier per round; streaming: P fragments on staggered schedules "
        "(--fragments, --delay, --alpha); async: each arrival applied at once (Delayed "
        "Nesterov: --dn-period, --dn-c; --grace-seconds, --staleness-weighting, --dylu).",
        rich_help_panel=ROUNDS_PANEL,
    ),
    sync_every: int = typer.Option(
        50, help="H: inner optimizer steps per round.", rich_help_panel=ROUNDS_PANEL
    ),
    outer_optimizer: str = typer.Option(
        None, help=OUTER_OPTIMIZER_HELP, rich_help_panel=ROUNDS_PANEL
    ),
    outer_lr: float = typer.Option(None, help=OUTER_LR_HELP, rich_help_panel=ROUNDS_PANEL),
    outer_momentum: float = typer.Option(
        None, help=OUTER_MOMENTUM_HELP, rich_help_panel=ROUNDS_PANEL
    ),
    weighting: str = typer.Option(
        "uniform", help="uniform or tokens.", rich_help_panel=ROUNDS_PANEL
    ),
    aggregation: str = typer.Option(
        None,
        help="How pseudo-gradients combine: mean; clipped_mean (each scaled down to "
        "--clip-multiple x the median recent norm); trimmed_mean:F or median (element by "
        "element; sync and streaming, plain uploads). The robust rules refuse norms over "
        "--outlier-ratio x the median (audited); rounds decide at their barrier, async at "
        "each arrival. sparse_mean: each element over the workers that sent it "
        "(SparseLoCo's; sync and streaming, weighting uniform). Default: follows "
        "--upload-codec: sparse_mean for top-k in sync and streaming mode with weighting "
        "uniform, else mean.",
        rich_help_panel=ROBUST_PANEL,
    ),
    clip_multiple: float = typer.Option(
        DEFAULT_CLIP_MULTIPLE,
        help="clipped_mean: the clip bound, in median norms.",
        rich_help_panel=ROBUST_PANEL,
    ),
    outlier_ratio: float = typer.Option(
        DEFAULT_OUTLIER_RATIO,
        help="Robust aggregation: refuse norms over this x the median.",
        rich_help_panel=ROBUST_PANEL,
    ),
    upload_dtype: str = typer.Option(
        "fp32", help="Pseudo-gradient dtype: fp32 or bf16.", rich_help_panel=CODEC_PANEL
    ),
    download_dtype: str = typer.Option(
        "fp32", help="Global weights dtype: fp32 or bf16.", rich_help_panel=CODEC_PANEL
    ),
    upload_codec: str = typer.Option(
        "fp32",
        help="Pseudo-gradient codec: fp32, bf16, int8, int4, int2, topk:F or topk:F+VALUES "
        "(e.g. topk:0.03+int2: the largest 3% per chunk, 2-bit values); docs/protocol.md.",
        rich_help_panel=CODEC_PANEL,
    ),
    download_codec: str = typer.Option(
        "fp32",
        help="Weights download codec: fp32 sends full weights; any other codec sends each "
        "round's change of the published weights, coded (workers' anchors stay bit-identical).",
        rich_help_panel=CODEC_PANEL,
    ),
    codec_block: int = typer.Option(
        128,
        help="Values per quantization scale of int8/int4/int2 (a power of two, 8-65536).",
        rich_help_panel=CODEC_PANEL,
    ),
    topk_chunk: int = typer.Option(
        128, help="Elements per top-k chunk (a power of two, 2-65536).", rich_help_panel=CODEC_PANEL
    ),
    error_feedback_beta: float = typer.Option(
        None, help=ERROR_FEEDBACK_HELP, rich_help_panel=CODEC_PANEL
    ),
    heartbeat_interval: float = typer.Option(
        5.0, help="Seconds between worker heartbeats.", rich_help_panel=MEMBERSHIP_PANEL
    ),
    heartbeat_timeout: float = typer.Option(
        30.0, help="Evict a worker silent this long.", rich_help_panel=MEMBERSHIP_PANEL
    ),
    barrier_timeout: float = typer.Option(
        None,
        help="A round open this long answers 504 (default 600; not in async mode).",
        rich_help_panel=MEMBERSHIP_PANEL,
    ),
    min_workers: int = typer.Option(
        1, help="Contributions a round needs to commit.", rich_help_panel=ROUNDS_PANEL
    ),
    max_body_mib: float = typer.Option(
        None,
        help="Largest tensor body accepted, in MiB (1 MiB = 1,048,576 bytes; default 4096).",
        rich_help_panel=UPLOADS_PANEL,
    ),
    # The old name, kept (it always counted MiB); hidden so that --help lists one name.
    max_body_mb: float = typer.Option(None, "--max-body-mb", hidden=True),
    fragments: int = typer.Option(
        None,
        help="Streaming: fragments P (must divide H; default 1).",
        rich_help_panel=STREAMING_PANEL,
    ),
    delay: int = typer.Option(
        None,
        help="Streaming: tau, inner steps a fragment's transfer overlaps (0 <= tau < H/P).",
        rich_help_panel=STREAMING_PANEL,
    ),
    alpha: float = typer.Option(
        None,
        help="Streaming: merge theta = (1 - alpha) global + alpha local (default 0.5).",
        rich_help_panel=STREAMING_PANEL,
    ),
    dn_period: int = typer.Option(
        None,
        help="Async: Delayed Nesterov N, arrivals per momentum update (default 1).",
        rich_help_panel=ASYNC_PANEL,
    ),
    dn_c: float = typer.Option(
        None,
        help="Async: Delayed Nesterov c, the share of momentum applied at each arrival "
        "between momentum updates, in [0, 1/(N-1)] (default 0).",
        rich_help_panel=ASYNC_PANEL,
    ),
    grace_seconds: float = typer.Option(
        None,
        help="Async: average arrivals within this many seconds into one outer step.",
        rich_help_panel=ASYNC_PANEL,
    ),
    staleness_weighting: str = typer.Option(
        None,
        help="Async: none, or inverse_sqrt to scale a stale pseudo-gradient by "
        "(1 + staleness)^-1/2.",
        rich_help_panel=ASYNC_PANEL,
    ),
    dylu: bool = typer.Option(
        False,
        "--dylu",
        help="Async: give slower workers fewer local steps (DyLU), sent in heartbeats.",
        rich_help_panel=ASYNC_PANEL,
    ),
    memory_bodies: int = typer.Option(
        0,
        help="Submissions held in RAM at once; the rest stream to disk (0: all do).",
        rich_help_panel=UPLOADS_PANEL,
    ),
    spool_dir: Path = typer.Option(
        None, help="Where spooled uploads go (default: temp dir).", rich_help_panel=UPLOADS_PANEL
    ),
    token: str = TokenOption,
    token_file: Path = TokenFileOption,
    tokens_file: Path = typer.Option(
        None,
        help="More tokens: a file of lines 'TOKEN SCOPE' (TOKEN: 16+ characters, no spaces; "
        "SCOPE: enroll, admin, shard or worker:ID; lines starting with # are comments). An "
        "admin token signs in to the dashboard and diloco admin; sharded servers with tokens "
        "call each other with their one shard line (docs/protocol.md, Auth). With no token at "
        "all the server is open.",
        rich_help_panel=AUTH_PANEL,
    ),
    tls_cert: Path = typer.Option(
        None,
        help="Serve HTTPS with this PEM certificate (chain); needs --tls-key.",
        rich_help_panel=AUTH_PANEL,
    ),
    tls_key: Path = typer.Option(
        None, help="The PEM private key of --tls-cert.", rich_help_panel=AUTH_PANEL
    ),
    ca_file: Path = typer.Option(
        None,
        help="Sharded servers: the PEM certificate (or CA) that signs the other shards' "
        "certificates, for https:// --shard-url (default: the system's trusted ones).",
        rich_help_panel=AUTH_PANEL,
    ),
    tensorboard: Path = typer.Option(
        None,
        help="Also write each commit's metrics (run and per-worker scalars) as TensorBoard "
        "event files in this directory (needs diloco[tensorboard]).",
        rich_help_panel=OUTPUTS_PANEL,
    ),
    shard: int = typer.Option(
        None,
        help="Sharded servers: this process is shard I (0 decides rounds); needs --shard-url.",
        rich_help_panel=SHARDING_PANEL,
    ),
    shard_url: list[str] = typer.Option(
        None,
        metavar="<url>",
        help="Sharded servers: every shard's URL, in shard order (repeat the option); each "
        "shard owns whole tensors, balanced by bytes. Sync mode, plain uploads (issue 15).",
        rich_help_panel=SHARDING_PANEL,
    ),
    log_level: str = typer.Option("info", help="uvicorn log level.", rich_help_panel=OUTPUTS_PANEL),
    threads: int = typer.Option(
        None,
        help="Threads for the server's tensor work (fold, outer step, codecs); default "
        f"min({SERVER_DEFAULT_THREADS}, cores), or OMP_NUM_THREADS when set. Lower it where "
        "workers share the machine.",
    ),
) -> None:
    """Run the coordinator: workers register, send pseudo-gradients, get global weights.

    Workers enroll with --token-file's token (or $DILOCO_TOKEN): docs/protocol.md, Auth.
    """
    secret = read_token(token, token_file)
    tls = None
    if (tls_cert is None) != (tls_key is None):
        raise fail("--tls-cert and --tls-key go together: give both or neither")
    try:
        tokens = load_tokens_file(tokens_file) if tokens_file is not None else None
        if tls_cert is not None and tls_key is not None:
            tls = TlsFiles(tls_cert, tls_key)
            tls.check()
    except (TokensFileError, ValueError) as exc:
        raise fail(str(exc)) from None
    check_output_path(port_file, "--port-file")
    if tensorboard is not None and tensorboard.exists() and not tensorboard.is_dir():
        raise fail(f"--tensorboard {tensorboard} is a file, not a directory")
    if log_level.lower() not in LOG_LEVELS:
        raise fail(f"--log-level must be one of {', '.join(LOG_LEVELS)}, got {log_level!r}")
    check_host(host)
    if not 0 <= port <= 65535:
        raise fail(f"--port must be in [0, 65535], got {port}")
    if spool_dir is not None and not spool_dir.is_dir():
        raise fail(f"--spool-dir is not a directory: {spool_dir}")
    if (shard is None) != (not shard_url):
        raise fail("--shard and --shard-url go together: give both or neither")
    if ca_file is not None and not shard_url:
        raise fail("--ca-file is for sharded servers' calls to each other (with --shard-url)")
    check_ca_file(ca_file)  # the worker's check: PEM certificates, one line otherwise
    if max_body_mib is not None and max_body_mb is not None:
        raise fail("give --max-body-mib or its old name --max-body-mb, not both")
    if max_body_mib is None:
        max_body_mib = 4096.0 if max_body_mb is None else max_body_mb
    if not (math.isfinite(max_body_mib) and max_body_mib * 1024 * 1024 >= 1):
        raise fail(f"--max-body-mib must be a finite size of at least one byte, got {max_body_mib}")
    try:
        apply_thread_budget(server_threads(threads))
        fused_int8.check_setting()
    except ValueError as exc:
        raise fail(str(exc)) from None
    try:
        mode_options = _mode_options(
            mode,
            fragments=fragments,
            delay=delay,
            alpha=alpha,
            dn_period=dn_period,
            dn_c=dn_c,
            grace_seconds=grace_seconds,
            staleness_weighting=staleness_weighting,
            dylu=dylu or None,
        )
        if mode == "async" and barrier_timeout is not None:
            raise ValueError("--barrier-timeout does not apply to --mode async: it has no barrier")
        settings = ServerSettings(
            mode=mode,
            **mode_options,
            sync_every=sync_every,
            outer_optimizer=outer_optimizer,
            outer_lr=outer_lr,
            outer_momentum=outer_momentum,
            weighting=weighting,
            aggregation=aggregation,
            clip_multiple=clip_multiple,
            outlier_ratio=outlier_ratio,
            upload_dtype=parse_wire_dtype(upload_dtype),
            download_dtype=parse_wire_dtype(download_dtype),
            upload_codec=upload_codec,
            download_codec=download_codec,
            codec_block=codec_block,
            topk_chunk=topk_chunk,
            error_feedback_beta=error_feedback_beta,  # None: the upload codec's
            heartbeat_interval=heartbeat_interval,
            heartbeat_timeout=heartbeat_timeout,
            barrier_timeout=barrier_timeout,
            min_workers=min_workers,
            max_body_bytes=int(max_body_mib * 1024 * 1024),
            memory_bodies=memory_bodies,
            spool_dir=str(spool_dir) if spool_dir is not None else None,
            shard=0 if shard is None else shard,
            shard_urls=tuple(shard_url or ()),
        )
        note = error_feedback_note(settings.upload, settings.error_feedback_beta)
        if error_feedback_beta is not None and note is not None:
            warn(note)
        if keep_checkpoints < 1:
            raise ValueError(f"--keep-checkpoints must be >= 1, got {keep_checkpoints}")
        if durability not in ("round", "interval"):
            raise ValueError(f"--durability must be round or interval, got {durability!r}")
        if checkpoint_every is not None and checkpoint_every < 1:
            raise ValueError(f"--checkpoint-every must be >= 1, got {checkpoint_every}")
        if checkpoint_every is not None and checkpoint_every > 1 and shard_url:
            raise ValueError(
                "sharded servers checkpoint every round (their steps are decided across "
                "shards, not replayed from a step log): drop --checkpoint-every"
            )
        if durability == "interval" and state_dir is None:
            raise ValueError("--durability interval needs --state-dir (nothing is written without)")
        stopped = serve(
            settings,
            host,
            port,
            init=init,
            token=secret,
            log_level=log_level,
            port_file=port_file,
            state_dir=state_dir,
            keep_checkpoints=keep_checkpoints,
            override_settings=override_settings,
            durability=durability,
            checkpoint_every=(
                checkpoint_every or default_checkpoint_every(durability, bool(shard_url))
            ),
            tokens=tokens,
            tls=tls,
            tensorboard=tensorboard,
            ca_file=ca_file,
        )
    except ValueError as exc:
        raise fail(str(exc)) from None
    where = f"; state in {state_dir}" if state_dir is not None else ""
    flushed = " (checkpoint written at shutdown)" if stopped["flushed"] else ""
    err.print(f"server stopped at round {stopped['round']}{where}{flushed}")
