"""The e2e folder's server: the tiny random Llama behind a real uvicorn server (the generic server
fixtures, `serve`, `make_tiny_engine` and `idle`, live in tests/conftest.py)."""

from __future__ import annotations

from typing import Iterator

import httpx
import pytest


@pytest.fixture(scope="module")
def tiny_server(serve, make_tiny_engine):
    """The tiny random Llama served as "tiny" (context 512, 8 sequences per step): a `LiveServer`."""
    with serve(make_tiny_engine(), served_model_name="tiny") as server:
        yield server


@pytest.fixture
def http(tiny_server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=tiny_server.base_url, timeout=60) as client:
        yield client
