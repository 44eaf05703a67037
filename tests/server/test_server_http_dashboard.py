"""The dashboard's HTTP side over raw urllib3 against a `diloco server` process: the login
form's every refusal is the login page again (never a stack trace), a login sets an HttpOnly,
SameSite=Strict session cookie (the token in no URL), the cookie acts as the admin on the API
(writes still need the protocol header), and /v1/dashboard serves the metrics history."""

from __future__ import annotations

from pathlib import Path

import pytest
import urllib3
from test_server_http import TIMEOUT, Api, gradient, registration
from test_server_identity import init_file, secret_file

ENROLL = "enroll-token-0123456789"
ADMIN = "admin-token-0123456789abcdef"
FORM = {"Content-Type": "application/x-www-form-urlencoded"}


def raw(url: str, method: str, path: str, **kwargs) -> urllib3.BaseHTTPResponse:
    return urllib3.request(method, url + path, timeout=TIMEOUT, redirect=False, **kwargs)


def test_the_login_and_the_session_cookie(server_process, tmp_path: Path) -> None:
    tokens = secret_file(tmp_path, "tokens", f"{ENROLL} enroll\n{ADMIN} admin\n")
    server = server_process(
        "--init", str(init_file(tmp_path)), "--tokens-file", str(tokens),
        "--outer-optimizer", "sgd", "--outer-lr", "1", "--sync-every", "2",
        "--log-level", "info",
    )  # fmt: skip
    url = server.url
    # The start log says where the dashboard is and which token signs in.
    assert f"dashboard: {url}/ (sign in with an admin token from --tokens-file)" in (
        server.log.read_text()
    )

    home = raw(url, "GET", "/")
    assert home.status == 200 and b'name="token"' in home.data and b"Traceback" not in home.data
    refusals = [  # (body, headers, status, text shown)
        (b"token=wrong-token", FORM, 401, b"Wrong token."),
        (f"token={ENROLL}".encode(), FORM, 403, b"scope is enroll"),
        (b"token=", FORM, 401, b"Give the admin token."),
        (b"other=1", FORM, 401, b"Give the admin token."),
        (b"token=\xff\xfe", FORM, 400, b"not readable"),
        (b"token=" + b"x" * 5000, FORM, 400, b"The login was refused"),
    ]
    for body, headers, status, text in refusals:
        answer = raw(url, "POST", "/login", body=body, headers=headers)
        assert (answer.status, text in answer.data) == (status, True), (body[:20], answer.data)
        assert b'name="token"' in answer.data and "set-cookie" not in answer.headers

    login = raw(url, "POST", "/login", body=f"token={ADMIN}".encode(), headers=FORM)
    assert login.status == 303 and login.headers["location"] == "/"
    cookie = login.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie and ADMIN not in cookie
    session = {"Cookie": cookie.split(";")[0]}
    assert b'id="workers"' in raw(url, "GET", "/", headers=session).data

    # The cookie is the admin on the API: reads, and writes with the protocol header only.
    data = raw(url, "GET", "/v1/dashboard", headers=session).json()
    assert data["status"]["round"] == 0 and data["history"] == {"rounds": [], "workers": []}
    Api(url).rejects(raw(url, "POST", "/v1/admin/pause", headers=session), 400, "protocol_version")
    paused = raw(url, "POST", "/v1/admin/pause", headers={**session, "X-Diloco-Protocol": "1"})
    assert paused.status == 200 and paused.json()["paused"] is True
    stale = {"Cookie": "diloco_session=stale"}
    Api(url).rejects(raw(url, "GET", "/v1/dashboard", headers=stale), 401, "unauthorized")
    assert b'name="token"' in raw(url, "GET", "/", headers=stale).data
    worker = Api(url, ENROLL)
    worker.rejects(worker.call("GET", "/v1/dashboard"), 403, "forbidden")
    admin = Api(url, ADMIN)
    admin.rejects(admin.call("GET", "/v1/dashboard?after=-2"), 422, "invalid_request", "after")

    # One committed round: the history has its row, and the worker's.
    admin.ok("POST", "/v1/admin/resume")
    admin.ok("POST", "/v1/workers", json_body=registration("w0"))
    assert admin.submit("w0", gradient(-2.0)).status == 200
    history = admin.ok("GET", "/v1/dashboard?after=-1")["history"]
    assert [(r["round"], r["contributions"], r["live_workers"]) for r in history["rounds"]] == [
        (0, 1, 1)
    ]
    assert [(w["round"], w["worker_id"]) for w in history["workers"]] == [(0, "w0")]
    assert admin.ok("GET", "/v1/dashboard?after=0")["history"]["rounds"] == []

    logout = raw(url, "POST", "/logout", headers=session)
    assert logout.status == 303
    Api(url).rejects(raw(url, "GET", "/v1/dashboard", headers=session), 401, "unauthorized")

    assert (
        raw(url, "GET", "/static/dashboard.js")
        .headers["content-type"]
        .startswith("text/javascript")
    )
    assert b"MIT" in raw(url, "GET", "/static/uPlot.LICENSE.txt").data
    for path in ("/static/nothing.js", "/static/..%2Fdashboard%2F__init__.py"):
        assert raw(url, "GET", path).status == 404, path


def test_a_server_without_an_admin_token_says_how_to_make_one(
    server_process, tmp_path: Path
) -> None:
    """Issue 27: the README's recipe gave an enrollment token only, and the dashboard then
    refused every token it had."""
    server = server_process(
        "--token-file", str(secret_file(tmp_path, "token", ENROLL)), "--log-level", "info"
    )
    line = (
        f"dashboard: {server.url}/ needs an admin token, and this server has none: put a line "
        "'TOKEN admin' in a file (TOKEN from python3 -c \"import secrets; "
        'print(secrets.token_urlsafe(32))") and restart with --tokens-file FILE'
    )
    assert line in server.log.read_text()
    refused = raw(server.url, "POST", "/login", body=f"token={ENROLL}".encode(), headers=FORM)
    assert refused.status == 403 and b"the dashboard needs an admin token" in refused.data


@pytest.mark.slow  # in `make test-slow`: the browser test runs a server with tokens
def test_an_open_server_shows_the_dashboard_without_a_login(server_process) -> None:
    server = server_process("--log-level", "info")
    assert f"dashboard: {server.url}/ (no token configured: no sign-in)" in server.log.read_text()
    page = raw(server.url, "GET", "/")
    assert page.status == 200 and b'id="workers"' in page.data
    assert raw(server.url, "GET", "/v1/dashboard").json()["status"]["paused"] is False
