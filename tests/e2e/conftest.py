"""A real uvicorn server on a free loopback port, in a background thread of the test process
(so tests can also look at the engine behind it)."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import httpx
import pytest
import uvicorn


@dataclass
class LiveServer:
    engine: object           # the AsyncEngine behind it
    app: object
    base_url: str            # http://127.0.0.1:PORT

    @property
    def v1(self) -> str:
        return self.base_url + "/v1"


@contextmanager
def live_server(engine, **app_kwargs) -> Iterator[LiveServer]:
    """Serve `engine` through `create_app(engine, **app_kwargs)` until the block ends."""
    from specserve.server.app import create_app

    app = create_app(engine, **app_kwargs)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield LiveServer(engine=engine, app=app, base_url=f"http://127.0.0.1:{port}")
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


def tiny_engine(model_dir, **config):
    from specserve.engine.async_engine import AsyncEngine
    from specserve.engine.config import EngineConfig

    config = {"dtype": "float32", "device": "cpu", "max_model_len": 512, "max_num_seqs": 8, **config}
    return AsyncEngine.from_config(EngineConfig(model=str(model_dir), **config))


def wait_until_idle(engine, timeout: float = 10.0):
    """Poll the engine's stats until nothing runs or waits and every KV block is free; return them."""
    deadline = time.monotonic() + timeout
    while True:
        stats = engine.get_stats()
        if stats.num_running == 0 and stats.num_waiting == 0 and stats.num_free_blocks == stats.num_total_blocks:
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"engine not idle after {timeout} s: {stats}")
        time.sleep(0.02)


@pytest.fixture(scope="module")
def tiny_server(tiny_llama_dir) -> Iterator[LiveServer]:
    """The tiny random Llama served as "tiny" (context 512, 8 sequences per step)."""
    with live_server(tiny_engine(tiny_llama_dir), served_model_name="tiny") as server:
        yield server


@pytest.fixture
def http(tiny_server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=tiny_server.base_url, timeout=60) as client:
        yield client


@pytest.fixture(scope="session")
def serve():
    """`with serve(engine, **create_app_kwargs) as server:` -- a LiveServer for one test."""
    return live_server


@pytest.fixture(scope="session")
def make_tiny_engine(tiny_llama_dir):
    """`make_tiny_engine(**EngineConfig overrides)` -- an AsyncEngine over the tiny random Llama (not started)."""
    return lambda **config: tiny_engine(tiny_llama_dir, **config)


@pytest.fixture(scope="session")
def idle():
    """`idle(engine)` waits until the engine runs nothing and every KV block is free; returns its stats."""
    return wait_until_idle
