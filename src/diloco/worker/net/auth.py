"""The bearer secret a worker sends, shared by its clients (training loop and heartbeat).

Until it registers, a worker sends the enrollment token; the registration's answer carries a
credential bound to its id, sent from then on (docs/protocol.md, "Auth"). A credential the
server refuses with 401 (a fresh server that never issued it) is dropped, and the call is
made again with the enrollment token: the server then says the worker is unknown, and the
worker registers again, which issues it a new credential.
"""

from __future__ import annotations

import os
import threading

TOKEN_ENV = "DILOCO_TOKEN"


def _check_secret(what: str, secret: str | None) -> None:
    if secret is not None and (not secret or any(c in secret for c in "\r\n")):
        raise ValueError(f"{what} must be a non-empty single line")


class BearerAuth:
    """The enrollment token and the issued credential; thread-safe, one per worker."""

    def __init__(self, token: str | None = None, credential: str | None = None) -> None:
        """`token` None reads $DILOCO_TOKEN (unset: no token)."""
        if token is None:
            token = os.environ.get(TOKEN_ENV, "").strip() or None
        _check_secret("token", token)
        _check_secret("credential", credential)
        self.token = token
        self._credential = credential
        self._lock = threading.Lock()

    @property
    def credential(self) -> str | None:
        return self._credential

    @credential.setter
    def credential(self, value: str | None) -> None:
        _check_secret("credential", value)
        with self._lock:
            self._credential = value

    def secret(self) -> str | None:
        """What the next request sends: the credential once there is one, else the token."""
        with self._lock:
            return self._credential or self.token

    def refused(self, sent: str | None) -> bool:
        """The server answered 401 to `sent`: whether another secret is worth one more try.

        The credential is dropped when the enrollment token can stand in for it; a secret
        replaced meanwhile (another thread registered again) is simply tried anew.
        """
        with self._lock:
            current = self._credential or self.token
            if sent != current:
                return current is not None
            if sent is not None and sent == self._credential and self.token is not None:
                self._credential = None
                return True
            return False
