"""Benchmark prompts, from the datasets users have.

A dataset is named by one of our benchmark files (`mt_bench`, `humaneval`, `gsm8k`:
`{id, category, turns}` JSONL, third-party data read in place from `SPECSERVE_DATA`, or
`../shared/data` beside the project), or as `engine/datasets.py` reads them: a local JSONL, JSON,
CSV or Parquet file, or a Hugging Face dataset id in the offline hub cache, each row's prompt its
first user turn (`--prompt-field`, `--messages-field`).
"""

from __future__ import annotations

from pathlib import Path

from specserve.engine.data_dir import data_dir  # noqa: F401  (re-exported for the benchmarks)
from specserve.engine.datasets import CHAT_FIELDS, TEXT_FIELDS, dataset_rows, prompt_of

DATASETS = {"mt_bench": "mt_bench.jsonl", "humaneval": "humaneval.jsonl", "gsm8k": "gsm8k.jsonl"}


def dataset_label(name_or_path: str) -> str:
    """The name a dataset's rows carry in the results: a file's stem, else the name itself."""
    return Path(name_or_path).stem if Path(name_or_path).is_file() else name_or_path


def add_dataset_args(ap) -> None:
    """`--prompt-field` and `--messages-field` for a benchmark's argument parser."""
    ap.add_argument("--prompt-field", default=None, metavar="FIELD",
                    help="the field of a dataset's rows holding the prompt text (default: the first of "
                         f"{', '.join(TEXT_FIELDS)})")
    ap.add_argument("--messages-field", default=None, metavar="FIELD",
                    help="the field holding chat messages, whose first user turn is the prompt (default: the "
                         f"first of {', '.join(CHAT_FIELDS)})")


def load_prompts(name_or_path: str, limit: int | None = None, *, prompt_field: str | None = None,
                 messages_field: str | None = None) -> list[str]:
    """Each row's first user turn, in the dataset's order (see the module docstring)."""
    name = name_or_path
    if name in DATASETS and not Path(name).is_file():
        path = data_dir() / DATASETS[name]
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: set SPECSERVE_DATA to the folder holding {DATASETS[name]}")
        name = str(path)
    prompts = []
    try:
        for row in dataset_rows(name):
            prompts.append(prompt_of(row, prompt_field, messages_field, name_or_path))
            if limit is not None and len(prompts) >= limit:
                break
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"{exc}; nor one of our benchmarks {sorted(DATASETS)} (in {data_dir()}, "
                                f"$SPECSERVE_DATA)") from None
    return prompts
