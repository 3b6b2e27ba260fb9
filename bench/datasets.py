"""Benchmark prompts from the `{id, category, turns}` JSONL files (MT-Bench, HumanEval, GSM8K).

The files are third-party data and are read in place, never copied into the project: from
`SPECSERVE_DATA`, or `../shared/data` beside the project root, or an explicit path.
"""

from __future__ import annotations

import json
from pathlib import Path

from specserve.engine.data_dir import data_dir  # noqa: F401  (re-exported for the benchmarks)

DATASETS = {"mt_bench": "mt_bench.jsonl", "humaneval": "humaneval.jsonl", "gsm8k": "gsm8k.jsonl"}


def dataset_label(name_or_path: str) -> str:
    """The name a dataset's rows carry in the results: a file's stem, else the name itself."""
    return Path(name_or_path).stem if Path(name_or_path).is_file() else name_or_path


def load_prompts(name_or_path: str, limit: int | None = None) -> list[str]:
    """First user turn of each row, in file order."""
    path = Path(name_or_path)
    if not path.is_file():
        if name_or_path not in DATASETS:
            raise FileNotFoundError(f"{name_or_path!r} is neither a file nor one of {sorted(DATASETS)}")
        path = data_dir() / DATASETS[name_or_path]
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: set SPECSERVE_DATA to the folder holding {DATASETS[name_or_path]}")
    prompts = []
    with path.open() as f:
        for line in f:
            if line.strip():
                prompts.append(json.loads(line)["turns"][0])
            if limit is not None and len(prompts) >= limit:
                break
    return prompts
