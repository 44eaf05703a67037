"""The web dashboard `diloco server` serves at `/`: a login with the admin token, then live
tables and charts of the run, and the admin actions as buttons.

The page is static HTML and JavaScript (static/), with uPlot 1.6.32 (MIT, from the npm
registry, vendored with its license) for the charts; nothing is fetched from elsewhere. It
polls `GET /v1/dashboard` (status, settings and the SQLite metrics history after the last
round it has, so a browser that connects late draws the whole run) and calls the /v1/admin
routes for its buttons.

A login trades the admin token for a session: a random id in an HttpOnly, SameSite=Strict
cookie, kept in this process's memory for 12 hours (a restarted server asks for a login
again). The token never appears in a URL. A request with that cookie and no Authorization
header acts with the admin scope; writes still need the protocol header, which no other site's
form can send. A server without any secret (loopback development) needs no login.
"""

from __future__ import annotations

import asyncio
import functools
import html
import secrets
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

from fastapi import FastAPI, Query, Request
from fastapi.responses import FileResponse, HTMLResponse, RedirectResponse, Response
from starlette.concurrency import run_in_threadpool

from diloco.server.errors import Rejection
from diloco.server.members.credentials import ADMIN, Caller, Credentials
from diloco.wire import WireError, parse_content_length, read_body

STATIC = Path(__file__).parent / "static"
FILES = {  # what /static serves, and as what
    "uPlot.iife.min.js": "text/javascript",
    "uPlot.min.css": "text/css",
    "uPlot.LICENSE.txt": "text/plain",
    "dashboard.js": "text/javascript",
    "dashboard.css": "text/css",
}
COOKIE = "diloco_session"
SESSION_SECONDS = 12 * 3600
MAX_LOGIN_BYTES = 4096
FAILED_LOGIN_DELAY = 1.0  # seconds before a wrong token's answer


class DashboardSessions:
    """Logged-in browsers: session id -> its expiry (monotonic seconds), in memory only."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._expiry: dict[str, float] = {}
        self._lock = threading.Lock()

    def start(self) -> str:
        session = secrets.token_urlsafe(32)
        with self._lock:
            now = self.clock()
            self._expiry = {s: t for s, t in self._expiry.items() if t > now}  # drop the old
            self._expiry[session] = now + SESSION_SECONDS
        return session

    def valid(self, session: str | None) -> bool:
        if not session:
            return False
        with self._lock:
            expiry = self._expiry.get(session)
            return expiry is not None and expiry > self.clock()

    def end(self, session: str | None) -> None:
        with self._lock:
            self._expiry.pop(session or "", None)


def session_caller(request: Request) -> Caller | None:
    """The admin scope for a request that carries a live dashboard session and no
    Authorization header; None otherwise (the bearer secret decides then)."""
    sessions: DashboardSessions | None = getattr(request.app.state, "sessions", None)
    if sessions is None or request.headers.get("authorization") is not None:
        return None
    return Caller(ADMIN) if sessions.valid(request.cookies.get(COOKIE)) else None


@functools.cache
def _template(name: str) -> str:
    return (STATIC / name).read_text()  # once per process, not per request


def _page(name: str, **values: str) -> str:
    text = _template(name)
    for key, value in values.items():
        text = text.replace("{{" + key + "}}", value)
    return text


# No other page may frame these (clickjacking the buttons); scripts and styles from here only.
PAGE_HEADERS = {
    "X-Frame-Options": "DENY",
    "Content-Security-Policy": "default-src 'self'; frame-ancestors 'none'; form-action 'self'",
    "Cache-Control": "no-store",
}


def _login_page(message: str = "", status: int = 200) -> HTMLResponse:
    shown = f'<p class="error" role="alert">{html.escape(message)}</p>' if message else ""
    page = _page("login.html", message=shown)
    return HTMLResponse(page, status_code=status, headers=PAGE_HEADERS)


def add_dashboard(
    app: FastAPI,
    credentials: Credentials,
    dashboard_data: Callable[[int], dict[str, Any]],
    caller_of: Callable[[Request], Caller],
    dependencies: list[Any],
) -> None:
    """Routes `/`, `/login`, `/logout`, `/static/{name}` and `GET /v1/dashboard`.

    `dashboard_data(after)` is the JSON of /v1/dashboard; `dependencies` authenticate it and
    require the admin scope, like the admin routes."""
    sessions = DashboardSessions()
    app.state.sessions = sessions

    def signed_in(request: Request) -> bool:
        if credentials.open:
            return True
        return session_caller(request) is not None

    @app.get("/", include_in_schema=False)
    async def home(request: Request) -> Response:
        if not signed_in(request):
            return _login_page()
        page = _page("index.html", open_server="true" if credentials.open else "")
        return HTMLResponse(page, headers=PAGE_HEADERS)

    @app.post("/login", include_in_schema=False)
    async def login(request: Request) -> Response:
        try:
            length = parse_content_length(request.headers.get("content-length"))
            body = await read_body(request.stream(), length, MAX_LOGIN_BYTES)
            token = parse_qs(body.decode("utf-8"), max_num_fields=4).get("token", [""])[0]
        except WireError as error:  # no length, too large, cut short: the form again
            return _login_page(f"The login was refused: {error.error}", 400)
        except ValueError:  # not UTF-8, or too many fields
            return _login_page("The login form was not readable; try again.", 400)
        token = token.strip()
        if not token:
            return _login_page("Give the admin token.", 401)
        try:
            caller = credentials.identify(f"Bearer {token}")
        except Rejection:
            await asyncio.sleep(FAILED_LOGIN_DELAY)  # guessing costs time
            return _login_page("Wrong token.", 401)
        if not caller.is_admin:
            return _login_page(
                f"This token's scope is {caller.scope}; the dashboard needs an admin token.", 403
            )
        response = RedirectResponse("/", status_code=303)
        response.set_cookie(
            COOKIE,
            sessions.start(),
            max_age=SESSION_SECONDS,
            httponly=True,
            samesite="strict",
            secure=request.url.scheme == "https",
        )
        return response

    @app.post("/logout", include_in_schema=False)
    async def logout(request: Request) -> Response:
        sessions.end(request.cookies.get(COOKIE))
        response = RedirectResponse("/", status_code=303)
        response.delete_cookie(COOKIE)
        return response

    @app.get("/static/{name}", include_in_schema=False)
    async def static(name: str) -> Response:
        media = FILES.get(name)
        if media is None:
            raise Rejection(404, "not_found", f"no static file {name!r}", name=name)
        return FileResponse(STATIC / name, media_type=media)

    @app.get("/v1/dashboard", dependencies=dependencies)
    async def data(after: int = Query(-1, ge=-1, le=2**48)) -> dict:
        """The run for the dashboard: status, settings, and the metrics history after round
        `after` (-1: all of it)."""
        return await run_in_threadpool(dashboard_data, after)
