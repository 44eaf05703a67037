"""The operator's client: the /v1/admin routes (docs/protocol.md), for `diloco admin`.

The same transport, retries, timeouts, auth and TLS as the worker's client; the token must
have the admin scope (403 otherwise).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

from diloco.worker.net.client import DiLoCoClient, Weights, _round_header
from diloco.worker.net.transport import success


class AdminClient(DiLoCoClient):
    """One method per admin route; answers are the server's JSON objects."""

    def pause(self) -> dict[str, Any]:
        return self._json_call("pause", "POST", "/v1/admin/pause")

    def resume(self) -> dict[str, Any]:
        return self._json_call("resume", "POST", "/v1/admin/resume")

    def set_outer_lr(self, lr: float) -> dict[str, Any]:
        return self._json_call("outer_lr", "PUT", "/v1/admin/outer-lr", payload={"outer_lr": lr})

    def evict(self, worker_id: str, *, ban: bool = False, reason: str = "") -> dict[str, Any]:
        path = f"/v1/admin/workers/{quote(worker_id, safe='')}/evict"
        return self._json_call("evict", "POST", path, payload={"ban": ban, "reason": reason})

    def unban(self, worker_id: str) -> dict[str, Any]:
        return self._json_call("unban", "DELETE", f"/v1/admin/bans/{quote(worker_id, safe='')}")

    def stop(self) -> dict[str, Any]:
        return self._json_call("stop", "POST", "/v1/admin/stop")

    def audit(self, after: int = 0, limit: int = 1000) -> dict[str, Any]:
        query = {"after": after, "limit": limit}
        return self._json_call("audit", "GET", "/v1/admin/audit", query=query)

    def master_weights(self) -> Weights:
        """The fp32 masters as safetensors bytes, with the round (version) they are at."""
        reply = success(self._call("admin_weights", "GET", "/v1/admin/weights"))
        return Weights(reply.body, _round_header(reply), None, None)
