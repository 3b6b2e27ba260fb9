"""Running the app under uvicorn: graceful shutdown and the process's exit status.

    status = run_server(build_server(app, host="0.0.0.0", port=8000, shutdown_timeout=25), engine)

SIGTERM or SIGINT starts a graceful shutdown (`app.begin_shutdown`): readiness fails and new
requests get 503 at once, in-flight requests run on for up to `shutdown_timeout` seconds and then
end with a clear 503 error (an SSE error event on a stream); the process then exits with status 0.
If the engine's step loop dies (an unrecoverable device error) the server shuts down as well and
the status is 1, so that an orchestrator restarts it.

Connections (server/connection.py): the listening socket stays open while requests are in flight
(up to the shutdown timeout), so a request arriving during the drain, on a new connection or a
keep-alive one, is answered 503 ``shutting_down`` rather than refused; once nothing runs, uvicorn
closes the socket and its connections. A second signal exits at once. Request heads and bodies that arrive too slowly (`header_timeout`,
`body_timeout`) and clients that stop reading their response (`stream_stall_timeout`) are cut off.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from types import FrameType

import uvicorn

from specserve.server.app import begin_shutdown
from specserve.server.connection import (DEFAULT_BODY_TIMEOUT_S, DEFAULT_HEADER_TIMEOUT_S,
                                         DEFAULT_STREAM_STALL_TIMEOUT_S, ConnectionLimits, guarded_protocol)

logger = logging.getLogger("specserve.server")

# uvicorn's own drain limit, past `shutdown_timeout`: time for the requests ended at the deadline to
# send their error and for their connections to close, after which uvicorn cancels what is left
CLOSE_GRACE_S = 5.0
DRAIN_POLL_S = 0.05   # how often the drain looks for requests still running


class SpecserveServer(uvicorn.Server):
    """uvicorn's server, with a signal starting `begin_shutdown` and the exit status left to us
    (uvicorn re-raises a caught SIGTERM after its shutdown, which would end the process with 143)."""

    def __init__(self, config: uvicorn.Config, shutdown_timeout: float | None):
        super().__init__(config)
        self.shutdown_timeout = shutdown_timeout

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        begin_shutdown(self.config.app, self.shutdown_timeout)
        if not getattr(self, "_draining", False):   # the first signal: answer 503s until the requests end
            self._draining = True
            threading.Thread(target=self._exit_when_drained, args=(sig,), name="specserve-drain",
                             daemon=True).start()
            return
        self.force_exit = True
        super().handle_exit(sig, frame)
        self._captured_signals.clear()

    def _exit_when_drained(self, sig: int) -> None:
        """uvicorn's own shutdown (which closes the listening socket) once no request task runs, or at
        the shutdown timeout plus its grace (what is left then, uvicorn's shutdown ends)."""
        deadline = None if self.shutdown_timeout is None else time.monotonic() + self.shutdown_timeout + CLOSE_GRACE_S
        while not self.should_exit and (deadline is None or time.monotonic() < deadline):
            if not any(not task.done() for task in list(self.server_state.tasks)):
                break
            time.sleep(DRAIN_POLL_S)
        super().handle_exit(sig, None)
        self._captured_signals.clear()


def build_server(app, *, host: str = "127.0.0.1", port: int = 8000, shutdown_timeout: float | None = 25.0,
                 log_level: str = "info", access_log: bool = True, root_path: str = "",
                 header_timeout: float | None = DEFAULT_HEADER_TIMEOUT_S,
                 body_timeout: float | None = DEFAULT_BODY_TIMEOUT_S,
                 stream_stall_timeout: float | None = DEFAULT_STREAM_STALL_TIMEOUT_S) -> SpecserveServer:
    """A server for `app` whose graceful shutdown lasts `shutdown_timeout` seconds (None: unbounded);
    the three timeouts (seconds, None: off) are server/connection.py's; `root_path`: the path prefix
    a reverse proxy serves it under; `access_log`: a log line per request."""
    grace = None if shutdown_timeout is None else shutdown_timeout + CLOSE_GRACE_S
    limits = ConnectionLimits(header_timeout=header_timeout, body_timeout=body_timeout,
                              stall_timeout=stream_stall_timeout)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=access_log,
                            root_path=root_path, lifespan="on",
                            timeout_graceful_shutdown=grace, http=guarded_protocol(limits))
    return SpecserveServer(config, shutdown_timeout)


def run_server(server: SpecserveServer, engine, sockets: list[socket.socket] | None = None) -> int:
    """Serve until a signal (or `server.handle_exit`) or the engine's death; return the exit status."""
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            if engine.dead.wait(0.2):
                logger.error("the engine died; shutting the server down (exit status 1)")
                server.should_exit = True
                return

    watcher = threading.Thread(target=watch, name="specserve-engine-watch", daemon=True)
    watcher.start()
    try:
        server.run(sockets=sockets)
    finally:
        done.set()
        watcher.join(timeout=1)
    return 1 if engine.dead.is_set() else 0
