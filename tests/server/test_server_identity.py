"""Per-worker identity over real HTTP: a `diloco server` process and raw urllib3 requests.

One shared token used to let any holder act as any worker. Now the enrollment token only
registers (and reads); each registration returns a credential bound to the worker's id, and
every route that acts as a worker needs that credential (or an admin token). Refusals are
the protocol's JSON, and they change nothing: `/v1/status`, the weights and the info are
compared before and after.
"""

from __future__ import annotations

import hashlib
import signal
from pathlib import Path

import torch
from safetensors.torch import save_file
from test_server_http import Api, gradient, registration, state

from diloco.wire import decode_tensors

ENROLL = "enroll-token-0123456789"
ADMIN = "admin-token-0123456789abcdef"
W0_TOKEN = "w0-static-token-0123456789"
BEAT = {"step": 3, "steps_per_second": 2.0, "loss": 1.5, "tokens": 30}
SGD = ("--outer-optimizer", "sgd", "--outer-lr", "1", "--sync-every", "2")


def init_file(tmp_path: Path) -> Path:
    """The tests' two tensors at 10.0, as the server's --init."""
    path = tmp_path / "init.safetensors"
    save_file(state(10.0), str(path))
    return path


def secret_file(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def snapshot(api: Api) -> dict:
    return {**api.snapshot(), "datasets": api.ok("GET", "/v1/datasets")}


def test_a_credential_acts_as_its_own_worker_only(server_process, tmp_path: Path) -> None:
    token_file = secret_file(tmp_path, "token", ENROLL + "\n")
    server = server_process(
        "--init", str(init_file(tmp_path)), "--token-file", str(token_file), *SGD
    )
    enroll = Api(server.url, ENROLL)
    first = enroll.register("w0")
    second = enroll.register("w1")
    a, b = first["credential"], second["credential"]
    assert isinstance(a, str) and len(a) >= 40 and a not in (b, ENROLL)  # token_urlsafe(32)
    w0, w1 = Api(server.url, a), Api(server.url, b)
    w1.ok("POST", "/v1/datasets", json_body={"worker_id": "w1", "dataset_id": "d",
          "length": 20, "unit_size": 10})  # fmt: skip
    before = snapshot(enroll)

    as_w1 = [  # w0's credential, each route that acts as w1
        ("POST", "/v1/workers/w1/heartbeat", {"json_body": BEAT}),
        ("POST", "/v1/rounds/0/submissions?worker_id=w1", {"body": gradient(-8.0)}),
        ("GET", "/v1/rounds/0/result?worker_id=w1&wait=0", {}),
        ("PUT", "/v1/weights/initial?worker_id=w1", {"body": gradient(1.0)}),
        ("POST", "/v1/datasets", {"json_body": {"worker_id": "w1", "dataset_id": "e",
                                                "length": 20, "unit_size": 10}}),
        ("POST", "/v1/datasets/d/leases", {"json_body": {"worker_id": "w1"}}),
        ("GET", "/v1/datasets/d/leases?worker_id=w1", {}),
        ("DELETE", "/v1/workers/w1", {}),
    ]  # fmt: skip
    for method, path, kwargs in as_w1:
        body = w0.rejects(w0.call(method, path, **kwargs), 403, "forbidden", "'w1'")
        assert body["detail"] == {"worker_id": "w1", "scope": "worker:w0"}, (method, path)
    # The enrollment token registers but does not act as anyone.
    for method, path, kwargs in as_w1[:1] + as_w1[-1:]:
        enroll.rejects(enroll.call(method, path, **kwargs), 403, "forbidden", "'w1'", "enroll")
    # Nor may w0's credential register (take over) w1's id.
    w0.rejects(w0.call("POST", "/v1/workers", json_body=registration("w1")), 403, "forbidden")
    # A wrong token is still 401, wherever it goes.
    stranger = Api(server.url, "not-a-token")
    stranger.rejects(stranger.call("DELETE", "/v1/workers/w1"), 401, "unauthorized")
    stranger.rejects(stranger.call("GET", "/v1/status"), 401, "unauthorized")
    assert snapshot(enroll) == before  # w1 is live, unchanged; round 0 holds no submission

    # Each credential reads the run and acts as its own worker: an exact round.
    for api in (w0, w1):
        assert api.ok("GET", "/v1/info")["round"] == 0
        assert api.call("GET", "/metrics").status == 200
    assert w0.ok("POST", "/v1/workers/w0/heartbeat", json_body=BEAT)["round"] == 0
    assert w0.submit("w0", gradient(-2.0)).json()["status"] == "accepted"
    assert w1.submit("w1", gradient(-8.0)).json()["current_round"] == 1
    # Outer SGD, lr 1: 10 - mean(-2, -8) = 15.
    weights = decode_tensors(w1.result("w1", wait=5).data)
    assert all(torch.equal(t, torch.full_like(t, 15.0)) for t in weights.values())
    assert w1.ok("DELETE", "/v1/workers/w1") == {"worker_id": "w1", "removed": True}
    status = enroll.ok("GET", "/v1/status")
    assert {w["worker_id"]: w["live"] for w in status["workers"]} == {"w0": True, "w1": False}


def test_issued_credentials_outlive_a_restart_and_are_stored_hashed(
    server_process, tmp_path: Path
) -> None:
    state_dir = tmp_path / "state"
    args = ("--init", str(init_file(tmp_path)), "--state-dir", str(state_dir), *SGD)
    server = server_process(*args, env={"DILOCO_TOKEN": ENROLL})  # the token from the environment
    reply = Api(server.url, ENROLL).ok(
        "POST", "/v1/workers", json_body=registration("w0", session="session-1")
    )
    credential = reply["credential"]
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(timeout=30) == 0, server.log.read_text()
    database = (state_dir / "state.sqlite").read_bytes()
    assert credential.encode() not in database  # only its SHA-256 is kept
    assert hashlib.sha256(credential.encode()).hexdigest().encode() in database

    again = server_process(*args[2:], env={"DILOCO_TOKEN": ENROLL})
    w0 = Api(again.url, credential)
    assert w0.ok("POST", "/v1/workers/w0/heartbeat", json_body=BEAT)["round"] == 0
    # Registering again with its own credential (same session: a retry) keeps it.
    retried = w0.ok("POST", "/v1/workers", json_body=registration("w0", session="session-1"))
    assert retried["credential"] == credential
    # Deregistered, then enrolled again with the enrollment token: a new credential, and the
    # old one is revoked.
    w0.ok("DELETE", "/v1/workers/w0")
    renewed = Api(again.url, ENROLL).register("w0")["credential"]
    assert renewed != credential
    w0.rejects(w0.call("POST", "/v1/workers/w0/heartbeat", json_body=BEAT), 401, "unauthorized")
    assert Api(again.url, renewed).ok("POST", "/v1/workers/w0/heartbeat", json_body=BEAT)


def test_tokens_file_scopes(server_process, tmp_path: Path) -> None:
    tokens = secret_file(
        tmp_path,
        "tokens",
        f"# token scope\n{ENROLL} enroll\n\n{ADMIN}   admin\n{W0_TOKEN} worker:w0\n",
    )
    server = server_process("--init", str(init_file(tmp_path)), "--tokens-file", str(tokens))
    enroll, admin, w0 = (Api(server.url, t) for t in (ENROLL, ADMIN, W0_TOKEN))

    # worker:w0 registers w0 only (a null id is its own), and keeps its token as credential.
    w0.rejects(w0.call("POST", "/v1/workers", json_body=registration("w5")), 403, "forbidden")
    own = w0.ok("POST", "/v1/workers", json_body=registration(None))
    assert (own["worker_id"], own["credential"]) == ("w0", W0_TOKEN)
    # The tokens file reserves w0: the enrollment token may not claim it, even once w0 leaves.
    w0.ok("DELETE", "/v1/workers/w0")
    enroll.rejects(enroll.call("POST", "/v1/workers", json_body=registration("w0")), 403,
                   "forbidden", "'w0'")  # fmt: skip
    w5 = Api(server.url, enroll.register("w5")["credential"])
    w0.rejects(w0.call("POST", "/v1/workers/w5/heartbeat", json_body=BEAT), 403, "forbidden")
    assert w5.ok("POST", "/v1/workers/w5/heartbeat", json_body=BEAT)

    # admin acts as any worker and reads everything.
    assert admin.ok("POST", "/v1/workers/w5/heartbeat", json_body=BEAT)["round"] == 0
    assert admin.ok("DELETE", "/v1/workers/w5")["removed"] is True
    assert admin.register("w0")["worker_id"] == "w0"  # reserved ids too
    workers = {w["worker_id"]: w["live"] for w in admin.ok("GET", "/v1/status")["workers"]}
    assert workers == {"w0": True, "w5": False}


def test_the_admin_dependency_guards_control_routes(live_server) -> None:
    """`require_admin` is what later control routes depend on: admin passes, others 403."""
    from fastapi import Depends

    from diloco.server.http.app import require_admin
    from diloco.server.members.credentials import Credentials

    credentials = Credentials([ENROLL], {ADMIN: "admin", W0_TOKEN: "worker:w0"})
    with live_server(None, state(10.0), credentials) as server:
        app = server.server.config.app
        app.add_api_route("/v1/probe", lambda: {"ok": True}, dependencies=[Depends(require_admin)])
        assert Api(server.url, ADMIN).ok("GET", "/v1/probe") == {"ok": True}
        for token in (ENROLL, W0_TOKEN):
            api = Api(server.url, token)
            api.rejects(api.call("GET", "/v1/probe"), 403, "forbidden", "admin")
        Api(server.url, "nope").rejects(Api(server.url, "nope").call("GET", "/v1/probe"), 401,
                                        "unauthorized")  # fmt: skip


def test_an_open_server_issues_no_credential_and_says_it_is_open(server_process) -> None:
    server = server_process()
    reply = Api(server.url).ok("POST", "/v1/workers", json_body=registration("w0"))
    assert reply["credential"] is None
    assert Api(server.url).ok("POST", "/v1/workers/w0/heartbeat", json_body=BEAT)
    assert "no token configured: every route is open" in server.log.read_text()
