"""Run a coordinator behind uvicorn, with the eviction ticker, until SIGINT/SIGTERM."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import signal
import socket
import ssl
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import anyio.to_thread
import torch
import uvicorn
from safetensors import SafetensorError
from safetensors.torch import load_file

from diloco.algorithm.compression import fused_int8
from diloco.server.coordinator import Coordinator
from diloco.server.http.app import create_app
from diloco.server.http.uvicorn_protocol import DilocoHttpProtocol, PlainHttpNoticed
from diloco.server.members.credentials import Credentials, shard_secret
from diloco.server.ops.tensorboard import TensorBoardScalars
from diloco.server.settings import ServerSettings
from diloco.server.shards.start import ShardStart
from diloco.server.state.journal import RoundJournal, keep_stored_outer
from diloco.server.state.store import DATABASE_NAME, StateStore

# Long-polls hold a thread each while they wait for a barrier; allow many workers.
THREAD_LIMIT = 512
M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 8 << 20  # above: mmap, returned when freed (see return_large_frees...)
log = logging.getLogger("diloco.server")


def load_initial_weights(path: Path) -> dict[str, torch.Tensor]:
    """`--init FILE.safetensors`: the global weights before any worker arrives."""
    if path.is_dir():
        raise ValueError(f"--init is a directory, expected a safetensors file: {path}")
    if not path.is_file():
        raise ValueError(f"--init file does not exist: {path}")
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise ValueError(f"--init {path} is not a readable safetensors file ({exc})") from None
    if not tensors:
        raise ValueError(f"--init {path} holds no tensors")
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"--init {path}: tensor {name!r} holds NaN or Inf")
    return tensors


def return_large_frees_to_the_os() -> None:
    """Have glibc serve every allocation over 8 MiB by mmap, so freeing it returns the memory.

    glibc raises its mmap threshold after the first large free (up to 32 MiB), after which the
    per-tensor buffers of a round come from the heap and stay resident once freed; a server that
    allocates and frees a model-sized sum every round would then hold on to it.

    Below 8 MiB stay the codecs' piece temporaries (512Ki elements: 2 MiB of fp32, 4 MiB of
    int64 top-k keys), made and freed a few times per piece: at a 1 MiB threshold each was an
    mmap whose pages faulted in anew, 184,000 page faults and twice the time for one int8
    delta of an 85M model (0.585 s -> 0.322 s on one core here, with pieces of 1 MiB). Fixing
    the mmap threshold also fixes the heap's trim threshold at 128 KiB, and uvicorn allocates
    and frees a few 256 KB buffers per socket read of an upload: every free then gave the
    heap's top back to the kernel and the next read faulted it in again. Up to 16 MiB of free
    heap is kept instead (a 100 MB upload through uvicorn: 130 -> 55 ms). No-op elsewhere.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
        libc.mallopt(M_TRIM_THRESHOLD, 16 << 20)
    except (OSError, AttributeError):
        pass


LOOPBACK = ("127.0.0.1", "localhost", "::1")
WILDCARD = ("", "0.0.0.0", "::")
NEW_TOKEN = 'python3 -c "import secrets; print(secrets.token_urlsafe(32))"'


def dashboard_line(url: str, credentials: Credentials) -> str:
    """The start log's line about the dashboard at `url`: where it is and how to sign in."""
    if credentials.open:
        return f"dashboard: {url} (no token configured: no sign-in)"
    if credentials.has_admin:
        return f"dashboard: {url} (sign in with an admin token from --tokens-file)"
    return (
        f"dashboard: {url} needs an admin token, and this server has none: put a line "
        f"'TOKEN admin' in a file (TOKEN from {NEW_TOKEN}) and restart with --tokens-file FILE"
    )


def url_host(host: str) -> str:
    """`host` as it goes in a URL: this machine's name for a wildcard, IPv6 in brackets."""
    if host in WILDCARD:
        return socket.gethostname()
    return f"[{host}]" if ":" in host else host


@dataclass(frozen=True)
class TlsFiles:
    """`--tls-cert` and `--tls-key`: PEM files, checked by `check` before the server starts."""

    cert: Path
    key: Path

    def check(self) -> None:
        """ValueError naming the option unless the pair loads as a server certificate."""
        for option, path in (("--tls-cert", self.cert), ("--tls-key", self.key)):
            if not Path(path).is_file():
                raise ValueError(f"{option} file does not exist: {path}")
        try:
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(
                str(self.cert), str(self.key)
            )
        except ssl.SSLError as exc:
            raise ValueError(
                f"--tls-cert {self.cert} and --tls-key {self.key} do not load as a PEM "
                f"certificate and its private key ({exc.reason or exc})"
            ) from None
        except OSError as exc:
            raise ValueError(
                f"--tls-cert {self.cert} / --tls-key {self.key} cannot be read ({exc.strerror})"
            ) from None


class EvictionTicker:
    """Evicts silent workers a few times per heartbeat interval, so barriers never hang."""

    def __init__(self, coordinator: Coordinator) -> None:
        self.coordinator = coordinator
        self.stopped = threading.Event()
        self.period = min(1.0, coordinator.settings.heartbeat_interval / 2)
        self.thread = threading.Thread(target=self._run, name="diloco-evictor", daemon=True)

    def _run(self) -> None:
        while not self.stopped.wait(self.period):
            try:
                self.coordinator.evict_stale()
            except Exception:  # one bad tick must not end eviction for the rest of the run
                log.exception("eviction tick failed; trying again in %g s", self.period)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join(timeout=5)


class CoordinatorServer(uvicorn.Server):
    """uvicorn plus what a coordinator needs around it: the ticker and the bound port."""

    def __init__(self, config: uvicorn.Config, ticker: EvictionTicker, port_file: Path | None):
        super().__init__(config)
        self.ticker = ticker
        self.port_file = port_file
        self.bound_port: int | None = None
        self.flushed_at_shutdown = False
        self.announce: Callable[[int], str] | None = None  # the start log's line, by port

    async def startup(self, sockets=None) -> None:  # type: ignore[override]
        anyio.to_thread.current_default_thread_limiter().total_tokens = THREAD_LIMIT
        if self.config.ssl is not None:  # made by config.load(), which uvicorn ran just before
            self.config.ssl.sslobject_class = PlainHttpNoticed
        await super().startup(sockets)
        if self.servers and self.servers[0].sockets:
            self.bound_port = self.servers[0].sockets[0].getsockname()[1]
        if self.announce is not None and self.bound_port is not None:
            log.info(self.announce(self.bound_port))  # logged before the port file appears
        if self.port_file is not None and self.bound_port is not None:
            temporary = self.port_file.with_name(self.port_file.name + ".tmp")
            temporary.write_text(f"{self.bound_port}\n")
            temporary.replace(self.port_file)  # readers never see a half-written port
        self.ticker.start()

    async def shutdown(self, sockets=None) -> None:  # type: ignore[override]
        self.ticker.stop()
        self.ticker.coordinator.close()  # long-polls answer "waiting" now; workers poll again
        await super().shutdown(sockets)
        # Flush what the disk lacks and close the store.
        self.flushed_at_shutdown = self.ticker.coordinator.shutdown()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """SIGINT/SIGTERM stop the server gracefully, and the process then exits normally (0).

        uvicorn's own version re-raises the captured signal after the graceful shutdown, so
        `kill PID` would end `diloco server` by the signal (exit -15) and skip its last line.
        """
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def build_server(
    coordinator: Coordinator,
    host: str,
    port: int,
    credentials: Credentials | str | None,
    log_level: str = "info",
    port_file: Path | None = None,
    tls: TlsFiles | None = None,
) -> CoordinatorServer:
    """`credentials`: who may call what (a string is one enrollment token, None is open);
    `tls`: serve HTTPS with this certificate chain and key (TLS sits under the HTTP protocol,
    in asyncio's transport, so DilocoHttpProtocol sees the same bytes either way)."""
    built: list[CoordinatorServer] = []

    def request_stop() -> None:  # POST /v1/admin/stop: as SIGTERM, drain then flush
        built[0].should_exit = True

    config = uvicorn.Config(
        create_app(coordinator, credentials, request_stop),
        host=host,
        port=port,
        http=DilocoHttpProtocol,  # parser errors answered as JSON, after the whole requests
        log_level=log_level,
        access_log=False,
        timeout_keep_alive=75,
        timeout_graceful_shutdown=10,
        ssl_certfile=None if tls is None else str(tls.cert),
        ssl_keyfile=None if tls is None else str(tls.key),
    )
    built.append(CoordinatorServer(config, EvictionTicker(coordinator), port_file))
    if isinstance(credentials, Credentials):
        scheme = "http" if tls is None else "https"
        where = f"{scheme}://{url_host(host)}"
        built[0].announce = lambda bound: dashboard_line(f"{where}:{bound}/", credentials)
    return built[0]


def log_outer_recipe(settings: ServerSettings) -> None:
    """The start-up lines of the outer optimizer and the workers' error feedback: which
    settings the upload codec chose (after a restart kept a state dir's), and each measured
    cost over 5 % the run risks."""
    log.info(settings.outer_recipe())
    feedback = settings.feedback_recipe()
    if feedback is not None:
        log.info(feedback)
    for warning in settings.outer_warnings():
        log.warning(warning)


def serve(
    settings: ServerSettings,
    host: str,
    port: int,
    init: Path | None = None,
    token: str | None = None,
    log_level: str = "info",
    port_file: Path | None = None,
    state_dir: Path | None = None,
    keep_checkpoints: int = 3,
    override_settings: bool = False,
    durability: str = "round",
    checkpoint_every: int = 1,
    tokens: Mapping[str, str] | None = None,
    tls: TlsFiles | None = None,
    tensorboard: Path | None = None,
    ca_file: Path | None = None,
) -> dict:
    """Serve until SIGINT/SIGTERM (uvicorn handles both and drains open requests).

    With `state_dir`, every round is durable before its result is published (its step log;
    a full checkpoint every `checkpoint_every`-th round), or with durability "interval" only
    every `checkpoint_every`-th round; a restart on the same directory resumes from the
    newest verified checkpoint and the steps logged since. So are the worker credentials it
    issued. `token` is
    the enrollment token, `tokens` the tokens file's {token: scope}; sharded servers with
    any secret call each other with its `shard` one, trusting `ca_file` for https:// URLs.
    """
    level = "DEBUG" if log_level.lower() == "trace" else log_level.upper()  # (uvicorn's own)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return_large_frees_to_the_os()
    fused_int8.prepare_for(settings.upload, settings.download)  # (at its thread budget)
    # No local name keeps the loaded file alive: the coordinator's fp32 masters are the copy.
    initial = load_initial_weights(init) if init is not None else None
    sharding = None
    if settings.shards > 1:
        secret = shard_secret(tokens)
        if secret is None and (token or tokens):
            raise ValueError(
                "sharded servers with tokens call each other with a secret of their own: add "
                "a line 'SECRET shard' to --tokens-file, the same on every shard (the "
                "enrollment token no longer speaks for a shard)"
            )
        where = None if ca_file is None else str(ca_file)
        sharding = ShardStart(settings, secret, initial, durability, state_dir, where)
    if sharding is not None:
        initial = sharding.own_part(initial)
    state = StateStore(state_dir, keep_checkpoints)
    if sharding is not None:
        try:
            # what this shard will run, its stored run's outer settings taken first (a run
            # begun before a codec's defaults changed): shard 0 keeps its own the same way
            keep_stored_outer(state, settings)
            sharding.check_against_shard_0()
        except BaseException:
            state.close()
            raise
    plan = None if sharding is None else sharding.fragment_plan  # a streaming --init's
    if plan is not None and state.get_meta("fragment_plan") is None:  # (else: refused next)
        state.set_meta("fragment_plan", plan)
        state.set_meta("whole_fragment_plan", sharding.whole_plan)
    database = None if state.directory is None else state.directory / DATABASE_NAME
    try:
        journal = RoundJournal(state, settings, override_settings, durability, checkpoint_every)
        scalars = None if tensorboard is None else TensorBoardScalars(tensorboard)
        peers = None if sharding is None else sharding.peers
        coordinator = Coordinator(settings, initial, journal=journal, scalars=scalars, peers=peers)
        credentials = Credentials([token] if token else [], tokens, database)
    except BaseException:
        state.close()
        raise
    del initial
    log_outer_recipe(coordinator.settings)
    log.log(logging.WARNING if credentials.open else logging.INFO, credentials.describe())
    if tls is None and host not in LOOPBACK:
        log.warning(
            "serving plain HTTP on %s: tokens and weights cross the network unencrypted "
            "(give --tls-cert and --tls-key)",
            host,
        )
    server = build_server(coordinator, host, port, credentials, log_level, port_file, tls)
    try:
        follower = None if sharding is None else sharding.follow(coordinator)
    except BaseException:
        coordinator.journal.close()
        raise
    try:
        server.run()
    finally:
        if follower is not None:
            follower.stop()
    return {"round": coordinator.round_number, "flushed": server.flushed_at_shutdown}
