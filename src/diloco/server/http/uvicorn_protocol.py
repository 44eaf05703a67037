"""uvicorn's httptools protocol with the protocol's JSON error for bytes that are not HTTP.

uvicorn answers a parser error (a bad, negative, huge or duplicated Content-Length, garbage
where a request should start) with a plain-text 400 and closes the connection at once, even
when the bytes before the garbage were a whole request that the app is still handling: that
request's answer was then lost, although the app might apply it (a submission folded into the
round while its sender was told "400"). Here the refusal is the documented JSON error
(`malformed_http`), and it waits for the requests before the bad bytes to be answered: each
whole request gets its own answer, the bad bytes get the 400, and then the connection closes.

On a TLS port, plain HTTP never reaches the protocol: the handshake fails under it, asyncio
drops the connection (logging it only in debug mode) and the client sees no answer at all.
`PlainHttpNoticed`, the SSL object asyncio makes for each connection, logs that one line.
An idle TLS connection is dropped, not closed, when the server stops (see `shutdown`).
"""

from __future__ import annotations

import json
import logging
import ssl

import httptools
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

log = logging.getLogger("diloco.server")


def malformed_http_response(reason: str, default_headers: list[tuple[bytes, bytes]]) -> bytes:
    """The whole 400 answer, headers and JSON body, as bytes for the transport."""
    body = json.dumps(
        {
            "error": f"the request is not valid HTTP/1.1 ({reason}); the connection is closed",
            "kind": "malformed_http",
            "detail": {"reason": reason},
        }
    ).encode()
    head = [STATUS_LINE[400]]
    for name, value in default_headers:
        head.extend([name, b": ", value, b"\r\n"])
    head.extend(
        [
            b"content-type: application/json\r\n",
            b"content-length: " + str(len(body)).encode("ascii") + b"\r\n",
            b"connection: close\r\n",
            b"\r\n",
            body,
        ]
    )
    return b"".join(head)


class DilocoHttpProtocol(HttpToolsProtocol):
    """HttpToolsProtocol whose parser errors are answered in order, as JSON (see the module)."""

    refusal: bytes | None = None  # the 400 to send once the requests before it are answered

    def data_received(self, data: bytes) -> None:
        if self.refusal is not None:
            return  # after bad bytes nothing on this connection is a request any more
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.refuse(str(exc) or "invalid HTTP request")
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()

    def shutdown(self) -> None:
        """The server stops: an idle TLS connection is dropped at once. uvicorn closes it,
        and asyncio then waits for the client's TLS close_notify, which a browser tab or a
        pooled client never sends: the stop hung for its whole graceful timeout (10 s).
        Nothing is lost: no request is under way on an idle connection."""
        idle = self.cycle is None or self.cycle.response_complete
        if idle and self.transport.get_extra_info("ssl_object") is not None:
            self.transport.abort()
            return
        super().shutdown()

    def refuse(self, reason: str) -> None:
        client = "{}:{}".format(*self.client) if self.client else "a client"
        log.info("malformed HTTP from %s: %s", client, reason)
        self.refusal = malformed_http_response(reason, self.server_state.default_headers)
        cycle = self.cycle
        if cycle is not None and not cycle.more_body and not cycle.response_complete:
            # The bytes before the bad ones were a whole request: its answer goes out first.
            self.flow.pause_reading()
            return
        # Nothing is being answered, or the request in progress is itself cut short: close
        # now (its handler then sees a disconnect and applies nothing).
        self.send_refusal()

    def send_refusal(self) -> None:
        assert self.refusal is not None
        if not self.transport.is_closing():
            self.transport.write(self.refusal)
            self.transport.close()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.refusal is not None and not self.pipeline:
            self._unset_keepalive_if_required()
            self.send_refusal()


class PlainHttpNoticed(ssl.SSLObject):
    """An SSLObject that logs a plain-HTTP request sent to this TLS port (OpenSSL recognises
    one as the first bytes of a handshake); the handshake still fails and the connection is
    dropped. Installed as the server context's `sslobject_class`, the hook the ssl module
    offers for it: asyncio's TLS transport makes each connection's object with `wrap_bio`."""

    def do_handshake(self) -> None:
        try:
            super().do_handshake()
        except ssl.SSLError as exc:
            if exc.reason == "HTTP_REQUEST":
                log.warning(
                    "a plain-HTTP request came to this TLS port and was dropped: its client "
                    "must use an https:// URL"
                )
            raise
