"""Reported speeds are bounded over real HTTP: a heartbeat claiming more than 1e6 steps/s, NaN
or Infinity is a 422 naming the field that changes nothing, and DyLU gives no worker fewer
than about H / 16 steps whatever speed another one claims (docs/protocol.md, heartbeat)."""

from __future__ import annotations

import json

import pytest
from test_server_http import Api, check_error, state

from diloco.server.settings import ServerSettings

BEAT = {"step": 3, "steps_per_second": 2.0, "loss": 1.5, "tokens": 30}


@pytest.mark.parametrize(
    ("speed", "reason"),
    [
        ("1000000.5", "must be <= 1000000.0, got 1000000.5"),
        ("1e300", "must be <= 1000000.0, got 1e+300"),
        ("NaN", "must be a finite number, got NaN"),
        ("Infinity", "must be a finite number, got Infinity"),
        ("-1.0", "must be >= 0.0, got -1.0"),
    ],
)
def test_an_absurd_or_non_finite_speed_is_refused(live_server, speed: str, reason: str) -> None:
    with live_server(None, state(10.0)) as server:
        api = Api(server.url)
        api.register("w0")
        before = api.snapshot()
        raw = json.dumps(BEAT).replace('"steps_per_second": 2.0', f'"steps_per_second": {speed}')
        response = api.pool.request(
            "POST", "/v1/workers/w0/heartbeat", body=raw.encode(),
            headers={"Content-Type": "application/json", "X-Diloco-Protocol": "1"},
        )  # fmt: skip
        body = check_error(response.status, response.data, 422, "invalid_request")
        assert body["detail"]["field"] == "steps_per_second" and reason in body["error"], body
        assert api.snapshot() == before
        fastest = {**BEAT, "steps_per_second": 1e6}  # the bound itself is a speed
        assert api.ok("POST", "/v1/workers/w0/heartbeat", json_body=fastest)["round"] == 0


def test_dylu_gives_nobody_fewer_than_h_over_16_whatever_another_claims(live_server) -> None:
    settings = ServerSettings(mode="async", sync_every=64, dylu=True)
    with live_server(settings, state(10.0)) as server:
        api = Api(server.url)
        api.register("honest")
        api.register("liar")

        def beat(worker: str, speed: float) -> dict:
            report = {**BEAT, "steps_per_second": speed, "windows": 1}
            return api.ok("POST", f"/v1/workers/{worker}/heartbeat", json_body=report)

        beat("honest", 1.0)
        # The reference speed is min(max v, 16 * min v) = min(1e6, 16) = 16, so the honest
        # worker gets floor(1 / 16 * 64) = 4 steps (not max(1, floor(1e-6 * 64)) = 1), and
        # the liar, faster than the reference, gets H = 64.
        assert beat("liar", 1e6)["recommended_sync_every"] == 64
        assert beat("honest", 1.0)["recommended_sync_every"] == 4
