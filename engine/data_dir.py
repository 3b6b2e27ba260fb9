"""Where the shared third-party data lives (benchmark prompts, trees.json, corpora): read in place,
never copied into the project. Serving (drafters) and the benchmarks both look it up here."""

from __future__ import annotations

import os
from pathlib import Path


def data_dir() -> Path:
    """`$SPECSERVE_DATA`, else `../shared/data` beside the project root."""
    env = os.environ.get("SPECSERVE_DATA")
    if env:
        return Path(env)
    return Path(__file__).resolve().parent.parent.parent / "shared" / "data"
