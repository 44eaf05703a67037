"""The one exception type for everything the wire layer rejects.

Each rejection carries its HTTP status and a stable `kind` so that the server's routes only
translate, never decide: `WireError.to_body()` is the JSON error body of docs/protocol.md.
"""

from __future__ import annotations

from typing import Any


class WireError(ValueError):
    """A request or payload the protocol refuses, with the status and kind to answer it with.

    `error` is one human sentence naming the problem (which tensor or field, what was expected,
    what came); `detail` holds the same facts as machine-readable fields.
    """

    def __init__(self, status: int, kind: str, error: str, **detail: Any) -> None:
        super().__init__(error)
        self.status = status
        self.kind = kind
        self.error = error
        self.detail: dict[str, Any] = detail

    def to_body(self) -> dict[str, Any]:
        """The JSON error body: `{"error": str, "kind": str, "detail": object}`."""
        return {"error": self.error, "kind": self.kind, "detail": dict(self.detail)}

    def __repr__(self) -> str:
        return f"WireError({self.status}, {self.kind!r}, {self.error!r})"
