"""What the worker's client raises, so the worker can tell "fix something" from "wait longer"."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit


class ServerError(Exception):
    """The server answered with a rejection that retrying the same request will not fix.

    Fields come from the protocol's error body `{"error", "kind", "detail"}`; a body that is
    not that JSON (a proxy's HTML page, say) gives kind `http_<status>`.
    """

    def __init__(
        self, status: int, kind: str, error: str, detail: Any = None, *, url: str = ""
    ) -> None:
        self.status = status
        self.kind = kind
        self.error = error
        self.detail = detail
        self.url = url
        where = f" ({url})" if url else ""
        super().__init__(f"{status} {kind}: {error}{where}")


class AuthError(ServerError):
    """401: the bearer token is missing or wrong. Never retried: waiting will not fix it."""


class ServerUnavailable(Exception):
    """The server could not be reached, or kept answering "try later", until retries ran out.

    `cause` is the last failure: a transport exception, or a ServerError for the last 429, 502,
    503 or 504 answer (kind `barrier_timeout` when the round's barrier timed out).
    """

    def __init__(
        self, url: str, cause: BaseException | None, *, attempts: int, reason: str
    ) -> None:
        self.url = url
        self.cause = cause
        self.attempts = attempts
        self.reason = reason
        super().__init__(
            f"server unavailable at {url} after {attempts} attempt(s) ({reason}); "
            f"last cause: {cause!r}"
        )


class ServerUnreachable(ServerUnavailable):
    """No server has ever answered this client at its URL: nothing listens there (a wrong host
    or port, a server not started yet), or a TLS server was called with http://.

    Raised once RetryPolicy.first_contact (or the retries) ran out before any answer, or at
    once when a plain-HTTP request was dropped by a server that completes a TLS handshake
    (`https_url` is then the URL to use). A client that has had an answer never raises it: it
    goes on retrying through a server restart as its RetryPolicy says.
    """

    def __init__(
        self,
        url: str,
        cause: BaseException | None,
        *,
        server: str,
        attempts: int,
        why: str,
        seconds: float | None = None,
        https_url: str | None = None,
    ) -> None:
        super().__init__(url, cause, attempts=attempts, reason=why)
        self.server = server
        self.why = why
        self.seconds = seconds
        self.https_url = https_url

    def message(self, option: str | None = None) -> str:
        """One line for a user; `option` names where they gave the URL ("--server")."""
        if self.https_url is not None:
            use = f"{option} {self.https_url}" if option else self.https_url
            return (
                f"the server at {self.server} speaks TLS and dropped a plain-HTTP request: "
                f"use {use}"
            )
        tried = (
            f"for {self.seconds:g} s" if self.seconds is not None else f"in {self.attempts} tries"
        )
        return (
            f"no diloco server answered at {self.server} ({self.why}) {tried}: is it running? "
            f"check {option or 'the URL'}"
        )

    def __str__(self) -> str:
        return self.message()


class ClientClosed(RuntimeError):
    """The client was closed, possibly from another thread while a call was backing off."""


class UntrustedCertificate(ServerUnavailable):
    """An https:// server whose certificate this worker does not trust: waiting will not fix it,
    a CA file will (a self-signed certificate is its own CA)."""

    def __init__(self, url: str, cause: BaseException | None, *, attempts: int, why: str) -> None:
        super().__init__(url, cause, attempts=attempts, reason=f"untrusted certificate: {why}")
        parts = urlsplit(url)
        self.origin = f"{parts.scheme}://{parts.netloc}"
        self.why = why

    def __str__(self) -> str:
        return (
            f"the TLS certificate of {self.origin} is not trusted ({self.why}); pass the "
            "certificate or the CA that signed it with --ca-file (ca_file= in Python)"
        )


class AnchorTorn(Exception):
    """A coded delta failed part way through moving the anchor in place (refused, or the GPU
    ran out of memory): the anchor is no longer what the server published, and the round's
    result is taken as the server's whole current weights instead."""
