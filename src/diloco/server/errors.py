"""A refused request: the HTTP status, a stable kind and one sentence naming the problem."""

from __future__ import annotations

from diloco.wire import WireError


class Rejection(Exception):
    """Raised by the coordinator before it changes anything; the app turns it into JSON."""

    def __init__(self, status: int, kind: str, error: str, **detail: object) -> None:
        super().__init__(error)
        self.status = status
        self.kind = kind
        self.error = error
        self.detail = detail

    def to_body(self) -> dict:
        return {"error": self.error, "kind": self.kind, "detail": self.detail}


def rejection_of(error: WireError) -> Rejection:
    """A wire-level refusal (a malformed or mismatched body) as the coordinator's."""
    return Rejection(error.status, error.kind, error.error, **error.detail)
