"""Fixtures of the deploy tests: a live tiny-model server with the ngram drafter (helpers: deploy_files.py)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def spec_server(serve, make_tiny_engine):
    """The tiny random Llama with drafters none (the default) and ngram, served as "tiny", with the
    fixed draft budget: the dashboards need drafts to show, and on the tiny model a tree's
    verification costs more than its forward, so the goodput policy rightly drafts little there."""
    engine = make_tiny_engine(drafters=("none", "ngram"), draft_budget="fixed")
    with serve(engine, served_model_name="tiny") as server:
        yield server
