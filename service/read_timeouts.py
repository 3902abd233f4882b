"""Slow clients cannot hold connections: deadlines for a request's headers and for its body.

uvicorn closes idle keep-alive connections, but a client that sends its headers a byte at a time,
or announces a body and never sends it, held its connection (and a file descriptor) for as long as
it liked: 300 slow-header and 50 slow-body connections stayed open 60 s and more. This protocol is
uvicorn's httptools protocol with two timers: the headers must be complete `header_timeout_s` after
the connection opens or the request's first byte arrives, and the body `body_timeout_s` after the
headers. Past either, the client gets 408 (when nothing was answered yet) and the connection closes.

uvicorn builds protocols from an import string in every worker process, so the limits come from the
settings object of the environment (`get_settings()`), as the app of `PIPEPLAN_HTTP_WORKERS` does.
"""

from __future__ import annotations

import asyncio
import json

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from pipeplan.settings import get_settings

PROTOCOL = "pipeplan.service.read_timeouts:ReadTimeoutProtocol"  # uvicorn's `http=` option

_BODY = json.dumps({"error": "request_timeout", "message": "the request was not received in time"}).encode()
_REQUEST_TIMEOUT = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
                    b"content-length: %d\r\n\r\n%s" % (len(_BODY), _BODY))


class ReadTimeoutProtocol(HttpToolsProtocol):
    """HttpToolsProtocol with header and body read deadlines (see the module docstring)."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        settings = get_settings()
        self._limits = (settings.header_timeout_s, settings.body_timeout_s)
        self._deadline: asyncio.TimerHandle | None = None
        self._arm(self._limits[0])

    def _arm(self, seconds: float) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(seconds, self._too_slow)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _too_slow(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        if self.cycle is None or not self.cycle.response_started:
            self.transport.write(_REQUEST_TIMEOUT)
        self.transport.close()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._deadline is None:  # a new request on a kept-alive connection
            self._arm(self._limits[0])

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        self._arm(self._limits[1])  # a request without a body completes at once and disarms it

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)
