"""Who may call what: each bearer secret the server accepts, and the scope it grants.

One shared token used to be all the identity there was: any holder could submit, beat or
leave as any worker. Now every secret has a scope:

- `enroll`: may register a worker (which issues it a credential) and read the run (info,
  status, weights, metrics); nothing that acts as a worker. The enrollment token comes from
  `--token-file` or `DILOCO_TOKEN` (or `--token`), and the tokens file may add more.
- `worker:ID`: acts as worker ID only, and reads the run. Issued by the server when ID
  registers with an enrollment (or admin) token, or written in the tokens file.
- `admin`: everything, acting as any worker included (control routes; the tokens file).
- `shard`: the secret sharded servers call each other's /v1/shard routes with (one line,
  the same on every shard); it reads the run, but registers and acts as no worker, and no
  other scope but admin may call those routes.

Issued credentials are random (`secrets.token_urlsafe(32)`); only their SHA-256 is kept, in
memory and, with `--state-dir`, in the `credentials` table of state.sqlite, so a restarted
server still accepts them. A new credential for an id replaces (revokes) its previous one.
A server with no secret at all is open, as before (loopback development).
"""

from __future__ import annotations

import contextlib
import hashlib
import secrets
import sqlite3
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from diloco.server.errors import Rejection
from diloco.wire import is_worker_id

__all__ = [
    "ADMIN",
    "ENROLL",
    "OPEN",
    "SHARD",
    "Caller",
    "Credentials",
    "TokensFileError",
    "load_tokens_file",
    "parse_tokens_file",
]

ENROLL = "enroll"
ADMIN = "admin"
SHARD = "shard"
OPEN = "open"  # the scope of every caller of a server without secrets
WORKER = "worker:"
MIN_TOKEN_CHARS = 16  # tokens-file secrets: guessing one must be hopeless

_SCHEMA = """
CREATE TABLE IF NOT EXISTS credentials (
    worker_id TEXT PRIMARY KEY,
    sha256 TEXT NOT NULL UNIQUE,      -- of the credential; the secret itself is never stored
    issued_at REAL NOT NULL
);
"""


class TokensFileError(ValueError):
    """A tokens file that cannot be used; the message names the file and the line."""


def digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def _check_scope(scope: str) -> str | None:
    """None when `scope` is one we grant, else why not."""
    if scope in (ENROLL, ADMIN, SHARD):
        return None
    if scope.startswith(WORKER):
        worker_id = scope[len(WORKER) :]
        if is_worker_id(worker_id):
            return None
        return f"worker id {worker_id!r} is not a valid id ([A-Za-z0-9][A-Za-z0-9._-]{{0,63}})"
    return f"unknown scope {scope!r} (expected admin, enroll, shard or worker:ID)"


def parse_tokens_file(text: str, source: str) -> dict[str, str]:
    """`TOKEN SCOPE` per line ('#' comments and blank lines ignored) -> {token: scope}.

    Errors name the line, never the token (the message may end up in a shared log).
    """
    tokens: dict[str, str] = {}
    first_line: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        fields = line.split()
        where = f"{source} line {number}"
        if len(fields) != 2:
            raise TokensFileError(f"{where}: expected 'TOKEN SCOPE', got {len(fields)} field(s)")
        token, scope = fields
        problem = _check_scope(scope)
        if problem is not None:
            raise TokensFileError(f"{where}: {problem}")
        if len(token) < MIN_TOKEN_CHARS or not token.isascii() or not token.isprintable():
            raise TokensFileError(
                f"{where}: a token must be at least {MIN_TOKEN_CHARS} printable ASCII characters"
            )
        if token in tokens:
            raise TokensFileError(f"{where}: the same token as line {first_line[token]}")
        tokens[token] = scope
        first_line[token] = number
    if not tokens:
        raise TokensFileError(f"{source} holds no tokens")
    shard_lines = [first_line[token] for token, scope in tokens.items() if scope == SHARD]
    if len(shard_lines) > 1:
        raise TokensFileError(
            f"{source} lines {shard_lines[0]} and {shard_lines[1]}: one 'shard' secret, the "
            "one every shard calls the others with"
        )
    return tokens


def shard_secret(tokens: Mapping[str, str] | None) -> str | None:
    """The tokens file's `shard` secret, if it has one."""
    return next((token for token, scope in (tokens or {}).items() if scope == SHARD), None)


def load_tokens_file(path: Path) -> dict[str, str]:
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc)
        raise TokensFileError(f"--tokens-file {path} cannot be read ({reason})") from None
    return parse_tokens_file(text, f"--tokens-file {path}")


@dataclass(frozen=True)
class Caller:
    """An authenticated request's identity: its scope and the secret it presented."""

    scope: str
    secret: str | None = None

    @property
    def worker_id(self) -> str | None:
        """The worker this caller is (scope `worker:ID`), else None."""
        return self.scope[len(WORKER) :] if self.scope.startswith(WORKER) else None

    @property
    def is_admin(self) -> bool:
        return self.scope in (ADMIN, OPEN)

    def may_act_as(self, worker_id: str) -> bool:
        return self.is_admin or self.worker_id == worker_id

    def require_admin(self) -> None:
        """403 unless admin: the check of control routes."""
        if not self.is_admin:
            raise Rejection(
                403,
                "forbidden",
                f"this route needs an admin token; the credential's scope is {self.scope}",
                scope=self.scope,
                required=ADMIN,
            )


class IssuedTable:
    """The durable half of issued credentials: (worker id, SHA-256) rows in state.sqlite.

    A connection per write (registrations are rare), separate from the coordinator's, whose
    transactions must not interleave with ours; SQLite's WAL serializes the two writers.
    """

    def __init__(self, database: Path) -> None:
        self.database = database
        with self._connect() as db:
            db.executescript(_SCHEMA)

    @contextlib.contextmanager
    def _connect(self):
        db = sqlite3.connect(self.database, timeout=30.0, isolation_level=None)
        try:
            db.execute("PRAGMA synchronous=FULL")  # per connection: a row survives power loss
            yield db
        finally:
            db.close()

    def rows(self) -> list[tuple[str, str]]:
        with self._connect() as db:
            return list(db.execute("SELECT worker_id, sha256 FROM credentials"))

    def delete(self, worker_id: str) -> None:
        with self._connect() as db:
            db.execute("DELETE FROM credentials WHERE worker_id = ?", (worker_id,))

    def save(self, worker_id: str, sha256: str) -> None:
        with self._connect() as db:
            db.execute(
                "INSERT INTO credentials (worker_id, sha256, issued_at) VALUES (?, ?, ?) "
                "ON CONFLICT(worker_id) DO UPDATE SET sha256 = excluded.sha256, "
                "issued_at = excluded.issued_at",
                (worker_id, sha256, time.time()),
            )


class Credentials:
    """The secrets a server accepts: enrollment tokens, a tokens file, issued credentials."""

    def __init__(
        self,
        enrollment: Iterable[str] = (),
        tokens: Mapping[str, str] | None = None,
        database: Path | None = None,
    ) -> None:
        """`database`: state.sqlite of a --state-dir (issued credentials outlive a restart);
        None keeps them in memory."""
        self._static: dict[str, str] = {}  # sha256 -> scope (enrollment tokens, tokens file)
        for token in enrollment:
            self._static[digest(token)] = ENROLL
        for token, scope in (tokens or {}).items():
            problem = _check_scope(scope)
            if problem is not None:
                raise ValueError(problem)
            self._static[digest(token)] = scope
        self._reserved = {
            scope[len(WORKER) :] for scope in self._static.values() if scope.startswith(WORKER)
        }
        self._lock = threading.Lock()
        self._table = None if database is None else IssuedTable(database)
        self._issued: dict[str, str] = {}  # sha256 -> worker id
        self._by_worker: dict[str, str] = {}  # worker id -> sha256 of its credential
        for worker_id, sha256 in self._table.rows() if self._table is not None else ():
            self._issued[sha256] = worker_id
            self._by_worker[worker_id] = sha256

    @property
    def open(self) -> bool:
        """No secret configured: every caller may do everything (loopback development)."""
        return not self._static

    @property
    def has_admin(self) -> bool:
        """An admin secret is configured: the dashboard and `diloco admin` can sign in."""
        return ADMIN in self._static.values()

    def describe(self) -> str:
        """One line for the start log: what callers need."""
        if self.open:
            return (
                "no token configured: every route is open to anyone who can connect "
                "(fine on loopback; give --token-file or --tokens-file otherwise)"
            )
        counts: dict[str, int] = {}
        for scope in self._static.values():
            key = "worker" if scope.startswith(WORKER) else scope
            counts[key] = counts.get(key, 0) + 1
        listed = ", ".join(f"{n} {scope}" for scope, n in sorted(counts.items()))
        return (
            f"bearer tokens required ({listed}); {len(self._by_worker)} issued worker "
            "credential(s) on record"
        )

    def identify(self, authorization: str | None) -> Caller:
        """The caller behind an Authorization header; 401 for a missing or unknown secret."""
        if self.open:
            return Caller(OPEN)
        scheme, _, given = (authorization or "").partition(" ")
        secret = given.strip()
        if scheme.lower() == "bearer" and secret:
            key = digest(secret)
            scope = self._static.get(key)
            if scope is None:
                with self._lock:
                    worker_id = self._issued.get(key)
                scope = None if worker_id is None else WORKER + worker_id
            if scope is not None:
                return Caller(scope, secret)
        raise Rejection(401, "unauthorized", "missing or wrong bearer token")

    def registration_id(self, caller: Caller, worker_id: str | None) -> str | None:
        """The id `caller` registers when it asks for `worker_id` (None: the server picks).

        403 when it may not: a worker's own credential registers only its id (a null id means
        that one), and an id the tokens file names only with that token or an admin's.
        """
        if caller.scope == SHARD:
            raise Rejection(
                403,
                "forbidden",
                "a shard secret registers no worker: enroll with the enrollment token",
                scope=caller.scope,
            )
        if caller.worker_id is not None:
            if worker_id not in (None, caller.worker_id):
                raise Rejection(
                    403,
                    "forbidden",
                    f"this credential may not register worker {worker_id!r} (its scope is "
                    f"{caller.scope})",
                    worker_id=worker_id,
                    scope=caller.scope,
                )
            return caller.worker_id
        if worker_id is not None and worker_id in self._reserved and not caller.is_admin:
            raise Rejection(
                403,
                "forbidden",
                f"worker id {worker_id!r} belongs to a token of the server's tokens file; "
                "register with that token",
                worker_id=worker_id,
                scope=caller.scope,
            )
        return worker_id

    def credential_for(self, caller: Caller, worker_id: str) -> str | None:
        """What a registration of `worker_id` by `caller` answers as its `credential`.

        A worker's own secret is answered back (it keeps it); an enrollment or admin token
        gets a new credential, which revokes the id's previous one; an open server has none.
        """
        if caller.scope == OPEN:
            return None
        if caller.worker_id == worker_id:
            return caller.secret
        return self.issue(worker_id)

    def issue(self, worker_id: str) -> str:
        """A new random credential for `worker_id`, durable (with a state dir) before it is
        answered; the id's previous credential stops working."""
        secret = secrets.token_urlsafe(32)
        key = digest(secret)
        with self._lock:
            if self._table is not None:
                try:
                    self._table.save(worker_id, key)
                except sqlite3.Error as exc:
                    raise Rejection(
                        503,
                        "credential_unavailable",
                        f"the server could not store worker {worker_id!r}'s credential "
                        f"({exc}); register again",
                        worker_id=worker_id,
                    ) from None
            old = self._by_worker.get(worker_id)
            if old is not None:
                self._issued.pop(old, None)
            self._issued[key] = worker_id
            self._by_worker[worker_id] = key
        return secret

    def revoke(self, worker_id: str) -> bool:
        """The credential issued to `worker_id` stops working (a ban); False if it had none.

        A `worker:ID` token of the tokens file is the operator's own and stays: a banned id
        cannot register with it anyway."""
        with self._lock:
            key = self._by_worker.pop(worker_id, None)
            if key is None:
                return False
            self._issued.pop(key, None)
            if self._table is not None:
                self._table.delete(worker_id)
        return True
