"""Fixtures of the deploy tests: a live tiny-model server with the ngram drafter (helpers: deploy_files.py)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def spec_server(serve, make_tiny_engine):
    """The tiny random Llama with drafters none (the default) and ngram, served as "tiny"."""
    engine = make_tiny_engine(drafters=("none", "ngram"))
    with serve(engine, served_model_name="tiny") as server:
        yield server
