"""The admin routes over real HTTP (a `diloco server` process, raw urllib3): who may call them,
and every bad request is a 4xx JSON body naming the problem that changes nothing."""

from __future__ import annotations

from pathlib import Path

import torch
from test_server_http import Api, gradient, state
from test_server_identity import init_file, secret_file

from diloco.wire import decode_tensors

ENROLL = "enroll-token-0123456789"
ADMIN = "admin-token-0123456789abcdef"
ROUTES = [
    ("POST", "/v1/admin/pause", None),
    ("POST", "/v1/admin/resume", None),
    ("PUT", "/v1/admin/outer-lr", {"outer_lr": 0.5}),
    ("POST", "/v1/admin/workers/w0/evict", {}),
    ("DELETE", "/v1/admin/bans/w0", None),
    ("GET", "/v1/admin/weights", None),
    ("GET", "/v1/admin/audit", None),
    ("POST", "/v1/admin/stop", None),
]


def admin_state(api: Api) -> dict:
    status = api.ok("GET", "/v1/status")
    return {
        **{k: status[k] for k in ("round", "paused", "outer_lr", "banned", "waiting_for")},
        "live": sorted(w["worker_id"] for w in status["workers"] if w["live"]),
        "weights": api.call("GET", "/v1/weights").data,
    }


def test_admin_routes_refuse_other_scopes_and_bad_requests_change_nothing(
    server_process, tmp_path: Path
) -> None:
    tokens = secret_file(tmp_path, "tokens", f"{ENROLL} enroll\n{ADMIN} admin\n")
    server = server_process(
        "--init", str(init_file(tmp_path)), "--tokens-file", str(tokens),
        "--outer-optimizer", "sgd", "--outer-lr", "1", "--sync-every", "2",
    )  # fmt: skip
    enroll, admin = Api(server.url, ENROLL), Api(server.url, ADMIN)
    credential = enroll.register("w0")["credential"]
    worker = Api(server.url, credential)
    before = admin_state(admin)

    for method, path, body in ROUTES:
        anonymous = Api(server.url).call(method, path, json_body=body)
        Api(server.url).rejects(anonymous, 401, "unauthorized")
        for caller, scope in ((enroll, "enroll"), (worker, "worker:w0")):
            refused = caller.rejects(caller.call(method, path, json_body=body), 403, "forbidden")
            assert refused["detail"] == {"scope": scope, "required": "admin"}, (path, refused)
    assert admin_state(admin) == before

    bad = [  # (method, path, body, status, kind, field)
        ("PUT", "/v1/admin/outer-lr", {}, 422, "invalid_request", "outer_lr"),
        ("PUT", "/v1/admin/outer-lr", {"outer_lr": 0}, 422, "invalid_request", "outer_lr"),
        ("PUT", "/v1/admin/outer-lr", {"outer_lr": -0.5}, 422, "invalid_request", "outer_lr"),
        ("PUT", "/v1/admin/outer-lr", {"outer_lr": "0.5"}, 422, "invalid_request", "outer_lr"),
        ("PUT", "/v1/admin/outer-lr", {"outer_lr": 1e300}, 422, "invalid_request", "outer_lr"),
        ("PUT", "/v1/admin/outer-lr", {"outer_lr": 0.5, "lr": 1}, 422, "invalid_request", "lr"),
        ("PUT", "/v1/admin/outer-lr", [0.5], 422, "invalid_request", None),
        ("POST", "/v1/admin/workers/w0/evict", {"ban": "yes"}, 422, "invalid_request", "ban"),
        ("POST", "/v1/admin/workers/w0/evict", {"reason": "x" * 501}, 422, "invalid_request",
         "reason"),
        ("POST", "/v1/admin/workers/-w/evict", {}, 422, "invalid_request", "worker_id"),
        ("POST", "/v1/admin/workers/ghost/evict", {}, 404, "unknown_worker", "worker_id"),
        ("DELETE", "/v1/admin/bans/w0", None, 404, "not_banned", "worker_id"),
        ("DELETE", "/v1/admin/bans/..", None, 422, "invalid_request", "worker_id"),
        ("GET", "/v1/admin/audit?after=-1", None, 422, "invalid_request", "after"),
        ("GET", "/v1/admin/audit?limit=0", None, 422, "invalid_request", "limit"),
        ("GET", "/v1/admin/audit?limit=1001", None, 422, "invalid_request", "limit"),
        ("GET", "/v1/admin/audit?after=x", None, 422, "invalid_request", "after"),
    ]  # fmt: skip
    for method, path, body, status, kind, name in bad:
        error = admin.rejects(admin.call(method, path, json_body=body), status, kind)
        if name is not None:
            named = name in error["error"] or name in error["detail"]
            assert named or error["detail"].get("field") == name, (path, error)
    not_json = admin.call("PUT", "/v1/admin/outer-lr", body=b"{outer_lr: 1}")
    admin.rejects(not_json, 422, "invalid_request")
    assert admin_state(admin) == before

    # And the good ones: a pause holds w0's round; the masters download as fp32.
    assert admin.ok("POST", "/v1/admin/pause")["paused"] is True
    assert worker.submit("w0", gradient(-2.0)).status == 200
    assert admin.ok("GET", "/v1/status")["round"] == 0
    lr = admin.ok("PUT", "/v1/admin/outer-lr", json_body={"outer_lr": 0.25})
    assert (lr["outer_lr"], lr["previous"], lr["from_round"]) == (0.25, 1.0, 0)
    assert admin.ok("POST", "/v1/admin/resume")["round"] == 1
    masters = admin.call("GET", "/v1/admin/weights")
    assert masters.headers["X-Diloco-Round"] == "1"
    expected = state(10.5)  # pseudo-gradient -2 at lr 0.25: 10 + 0.5
    got = decode_tensors(masters.data)
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[n], expected[n]) for n in expected)
    # Evicting without a body (curl -X POST) takes the defaults: no ban.
    assert admin.ok("POST", "/v1/admin/workers/w0/evict") == {
        "worker_id": "w0",
        "evicted": True,
        "banned": False,
        "pending_dropped": False,
    }
    events = admin.ok("GET", "/v1/admin/audit?after=0&limit=1000")["events"]
    admin_events = {"paused", "outer_lr_changed", "resumed", "admin_evicted"}
    names = [e["event"] for e in events if e["event"] in admin_events]
    assert names == ["paused", "outer_lr_changed", "resumed", "admin_evicted"], events
    after = admin.ok("GET", f"/v1/admin/audit?after={events[-2]['id']}")["events"]
    assert after == events[-1:]
