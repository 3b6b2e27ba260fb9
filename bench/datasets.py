"""Benchmark prompts, from the datasets users have.

A dataset is named by one of our benchmark files (`mt_bench`, `humaneval`, `gsm8k`:
`{id, category, turns}` JSONL, third-party data read in place from `SPECSERVE_DATA`, or
`../shared/data` beside the project), or as `engine/datasets.py` reads them: a local JSONL, JSON,
CSV or Parquet file, or a Hugging Face dataset id in the offline hub cache, each row's prompt its
first user turn (`--prompt-field`, `--messages-field`).
"""

from __future__ import annotations

import re
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


# ---- prompt kinds -------------------------------------------------------------------------------

KINDS = ("writing", "qa", "coding", "math", "extraction", "summarization", "rag", "translation")
# the kinds whose answer copies from the prompt: where lookup drafting has the most to find
GROUNDED_KINDS = ("extraction", "summarization", "rag")
_MAX_PER_KIND = 10      # MT-Bench has 10 prompts per category


def prompt_kinds(per_kind: int, kinds: tuple[str, ...] = KINDS) -> dict[str, list[str]]:
    """`per_kind` chat prompts of each kind, from the benchmark files (read in place, module
    docstring): writing (MT-Bench writing and roleplay), qa (MT-Bench stem and humanities), coding
    (HumanEval), math (GSM8K), extraction (MT-Bench's extraction questions, each quoting its
    document); and three kinds whose input is built from them: summarization (two GSM8K problems
    and a worked solution to summarise), rag (a HumanEval function with its reference solution as
    the context of a question about it), translation (a GSM8K problem into French). Deterministic:
    the same prompts every run, taken apart from those the other kinds use."""
    unknown = set(kinds) - set(KINDS)
    if unknown:
        raise ValueError(f"unknown prompt kinds {sorted(unknown)}; known: {', '.join(KINDS)}")
    if not 1 <= per_kind <= _MAX_PER_KIND:
        raise ValueError(f"per_kind must be 1..{_MAX_PER_KIND}")
    rows = {name: list(dataset_rows(str(data_dir() / file))) for name, file in DATASETS.items()}
    mt, he, gs = rows["mt_bench"], rows["humaneval"], rows["gsm8k"]

    def mt_bench(*categories: str) -> list[str]:
        return [r["turns"][0] for r in mt if r["category"] in categories]

    def solution(row: dict) -> str:
        return re.sub(r"<<[^>]*>>", "", row["solution"]).replace("\n#### ", "\nAnswer: ")

    build = {
        "writing": lambda i: mt_bench("writing", "roleplay")[i],
        "qa": lambda i: mt_bench("stem", "humanities")[i],
        "coding": lambda i: he[i]["turns"][0],
        "math": lambda i: gs[i]["turns"][0],
        "extraction": lambda i: mt_bench("extraction")[i],
        "summarization": lambda i: ("Summarize the following text in three sentences.\n\n"
                                    f"{gs[20 + 2 * i]['turns'][0]}\n{solution(gs[20 + 2 * i])}\n\n"
                                    f"{gs[21 + 2 * i]['turns'][0]}"),
        "rag": lambda i: ("Answer using only the context.\n\nContext:\n```python\n"
                          f"{he[40 + i]['prompt']}{he[40 + i]['reference']}```\n\n"
                          "Question: what does this function do, what are its arguments, and what does it return?"),
        "translation": lambda i: f"Translate into French:\n\n{gs[60 + i]['turns'][0]}",
    }
    return {kind: [build[kind](i) for i in range(per_kind)] for kind in kinds}
