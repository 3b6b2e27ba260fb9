"""Connection hygiene: the read, write-stall and shutdown rules uvicorn's h11 protocol lacks.

    config = uvicorn.Config(app, http=guarded_protocol(ConnectionLimits(header_timeout=20)), ...)

uvicorn (0.30+, h11) times out a keep-alive connection that sends nothing after a response
(`timeout_keep_alive`, 5 s) but nothing else: a connection that sends its request head one byte a
minute (slowloris), or its body that slowly, or that never sends a byte after connecting, is held
for ever; and a client that stops reading its stream leaves the response pausing on a full
socket for ever. `GuardedH11Protocol` adds, per connection:

* **header timeout** (`header_timeout`, ``--header-timeout``, 20 s): the request line and headers
  must arrive whole within this time of the connection opening, or of the first byte of a later
  request on a keep-alive connection. Else the connection is closed -- after a 408
  ``request_timeout`` answer when part of a head had arrived, silently when nothing had.
* **body timeout** (`body_timeout`, ``--body-timeout``, 60 s): the whole body must arrive within
  this time of the head. The endpoint reading it is answered 408 ``request_timeout`` (with
  ``Connection: close``); a connection still sending a body nobody reads is closed a second later.
* **bounded send buffer and stream stall timeout** (`stall_timeout`, ``--stream-stall-timeout``,
  60 s): a response is sent through the socket's kernel send buffer, fixed at `SEND_BUFFER_BYTES`
  (256 KiB; Linux would grow it to 4 MiB per connection), and at most asyncio's write buffer (64 KiB,
  then writing pauses, and with it the SSE generator, so nothing more is taken from the engine's
  stream). A connection whose writes stay paused this long -- a client that stopped reading -- is
  reset (its buffered output dropped, kernel buffer included); its request sees the disconnect and
  is aborted in the engine, which frees its KV blocks. What the engine produced meanwhile waits in
  the request's output queue, so one stalled stream holds at most this many seconds of its output.
* **shutdown**: uvicorn closes its listening socket at SIGTERM (so *new* connections are refused
  from then on: a load balancer must stop routing here, which `/health` answering 503 tells it)
  and closes idle keep-alive connections at once, so a request a client had just sent on one met
  a reset. Here an idle connection stays open for up to `timeout_keep_alive` seconds instead:
  a request arriving on it is answered by the app (503 ``shutting_down``: see `app.begin_shutdown`)
  and the connection is then closed; requests in flight finish as before, their connection
  closing after the response.

``None`` switches a timeout off. The class replaces uvicorn's automatic choice (httptools when
installed), so the server always speaks HTTP/1.1 through h11.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import struct
from dataclasses import dataclass

import h11
from starlette.exceptions import HTTPException as StarletteHTTPException
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger("specserve.server")

DEFAULT_HEADER_TIMEOUT_S = 20.0        # nginx's client_header_timeout is 60 s; a real client sends its head at once
DEFAULT_BODY_TIMEOUT_S = 60.0          # 8 MiB in 60 s is 140 KB/s
DEFAULT_STREAM_STALL_TIMEOUT_S = 60.0
BODY_BACKSTOP_GRACE_S = 1.0            # past the body timeout, for the endpoint's 408 to leave first
SEND_BUFFER_BYTES = 256 * 1024         # SO_SNDBUF of every connection: 2.5 MB/s at 100 ms RTT, streams need far less


@dataclass(frozen=True)
class ConnectionLimits:
    """Seconds; None switches a rule off (see the module's docstring)."""

    header_timeout: float | None = DEFAULT_HEADER_TIMEOUT_S
    body_timeout: float | None = DEFAULT_BODY_TIMEOUT_S
    stall_timeout: float | None = DEFAULT_STREAM_STALL_TIMEOUT_S


class RequestBodyTimeout(StarletteHTTPException):
    """The request body did not arrive in time: a 408, after which the connection closes."""

    def __init__(self, timeout: float):
        super().__init__(408, f"The request body did not arrive within this server's body timeout of {timeout:g} s.",
                         headers={"Connection": "close"})


class BodyDeadline:
    """ASGI wrapper: the app's reads of the request body fail with `RequestBodyTimeout` once
    `timeout` seconds have passed since the request's head; reads after the whole body (the wait for
    ``http.disconnect``) are not limited."""

    def __init__(self, app, timeout: float):
        self.app = app
        self.timeout = timeout

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        body_done = False

        async def timed_receive():
            nonlocal body_done
            if body_done:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0.0))
            except asyncio.TimeoutError:
                raise RequestBodyTimeout(self.timeout) from None
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_done = True
            return message

        await self.app(scope, timed_receive, send)


def _timeout_body(message: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": "request_timeout"}}).encode()


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the header, body and stall timeouts and the shutdown rule of this
    module. Made with `guarded_protocol(limits)`, which sets `limits`."""

    limits: ConnectionLimits = ConnectionLimits()

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.limits.body_timeout is not None:
            self.app = BodyDeadline(self.app, self.limits.body_timeout)
        self._header_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._stall_timer: asyncio.TimerHandle | None = None
        self._shutdown_timer: asyncio.TimerHandle | None = None
        self._head_bytes = False      # part of a request head has arrived
        self._shutting_down = False

    # ---- timers -------------------------------------------------------------------------

    @staticmethod
    def _cancel(timer: asyncio.TimerHandle | None) -> None:
        if timer is not None:
            timer.cancel()

    def _cancel_all(self) -> None:
        for timer in (self._header_timer, self._body_timer, self._stall_timer, self._shutdown_timer):
            self._cancel(timer)
        self._header_timer = self._body_timer = self._stall_timer = self._shutdown_timer = None

    def _arm_header_timer(self) -> None:
        if self._header_timer is None and self.limits.header_timeout is not None:
            self._header_timer = self.loop.call_later(self.limits.header_timeout, self._header_timed_out)

    def _update_read_timers(self) -> None:
        """After h11 has seen new bytes: stop the header timer once the head is in, run the body
        timer while the body comes in."""
        if self.transport is None or self.transport.is_closing():
            return
        state = self.conn.their_state
        if state is not h11.IDLE:
            self._cancel(self._header_timer)
            self._header_timer = None
            self._head_bytes = False
        if state is h11.SEND_BODY:
            if self._body_timer is None and self.limits.body_timeout is not None:
                self._body_timer = self.loop.call_later(self.limits.body_timeout + BODY_BACKSTOP_GRACE_S,
                                                        self._body_timed_out)
        elif self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _header_timed_out(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        logger.info("closing a connection from %s: no whole request head within %g s",
                    self._peer(), self.limits.header_timeout)
        if self._head_bytes and self.conn.our_state is h11.IDLE:
            message = (f"The request head (request line and headers) did not arrive within this server's header "
                       f"timeout of {self.limits.header_timeout:g} s.")
            self._send_408_and_close(_timeout_body(message))
        else:
            self.transport.close()

    def _body_timed_out(self) -> None:
        self._body_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.SEND_BODY:
            return
        logger.info("closing a connection from %s: its request body did not arrive within %g s",
                    self._peer(), self.limits.body_timeout)
        self.transport.close()

    def _stall_timed_out(self) -> None:
        self._stall_timer = None
        if self.transport.is_closing():
            return
        logger.warning("resetting a connection from %s: it has read nothing of its response for %g s",
                       self._peer(), self.limits.stall_timeout)
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            try:   # a reset: the kernel drops what the client never read instead of trying on
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            except OSError:
                pass
        self.transport.abort()    # close() would wait for the full buffer to drain

    def _send_408_and_close(self, body: bytes) -> None:
        """Answer outside h11 (which has no request to answer) and close."""
        head = (f"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode()
        self.transport.write(head + body)
        self.transport.close()

    def _peer(self) -> str:
        return "%s:%d" % self.client if self.client else "?"

    # ---- uvicorn's protocol hooks ---------------------------------------------------------

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
            except OSError:
                pass
        self._arm_header_timer()   # a connection that never sends a head is closed too

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_all()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE and data:
            self._head_bytes = True
            self._arm_header_timer()
        super().data_received(data)
        self._update_read_timers()

    def handle_events(self) -> None:
        super().handle_events()
        if self._shutting_down and self.cycle is not None and not self.cycle.response_started:
            self.cycle.keep_alive = False    # answered (503 by the app), then closed

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._update_read_timers()

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._stall_timer is None and self.limits.stall_timeout is not None:
            self._stall_timer = self.loop.call_later(self.limits.stall_timeout, self._stall_timed_out)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._cancel(self._stall_timer)
        self._stall_timer = None

    def shutdown(self) -> None:
        """uvicorn's graceful shutdown (its listener is already closed): a connection with a request in
        flight closes after the response, as in uvicorn; an idle one is kept for up to
        `timeout_keep_alive` seconds so a request already on its way is answered (503) rather than
        reset, and closed after that answer or when the time is up."""
        self._shutting_down = True
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.keep_alive = False
            return
        if self.transport.is_closing():
            return
        if self._shutdown_timer is None:
            self._shutdown_timer = self.loop.call_later(max(float(self.timeout_keep_alive), 0.0),
                                                        self._close_if_idle)

    def _close_if_idle(self) -> None:
        self._shutdown_timer = None
        if self.transport.is_closing():
            return
        if self.cycle is None or self.cycle.response_complete:
            if self.conn.our_state is not h11.ERROR:
                try:
                    self.conn.send(h11.ConnectionClosed())
                except h11.LocalProtocolError:
                    pass
            self.transport.close()
        else:
            self.cycle.keep_alive = False


def guarded_protocol(limits: ConnectionLimits) -> type[GuardedH11Protocol]:
    """The protocol class to give uvicorn (``uvicorn.Config(http=...)``) for `limits`."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"limits": limits})
