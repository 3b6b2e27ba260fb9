"""Rows and prompts from the datasets users have (the benchmarks' and training's common reader).

A dataset is a local file -- JSONL, JSON (a list of rows, or an object holding one under `data`,
`rows` or `examples`), CSV, or Parquet (needs `pyarrow`) -- or a Hugging Face dataset id
(`org/name`, optionally `org/name:split`) read from the offline hub cache when it has been
downloaded there (`HF_HUB_CACHE`, else `HF_HOME/hub`, else `~/.cache/huggingface/hub`): the
snapshot's data files of the split (`test` first, then `validation`, then `train`, unless one is
named). Nothing is downloaded.

A row's prompt is its first user turn: `prompt_field` names the field holding the text,
`messages_field` one holding chat messages (`[{"role", "content"}, ...]` or ShareGPT's
`[{"from", "value"}, ...]`); without either, the first of `turns`, `prompt`, `question`,
`instruction`, `input`, `text`, and of `messages` / `conversations` for chat data, that the rows
have. A row's answer (`answer_of`) is the first of `output`, `answer`, `response`, `completion`, or
the assistant turn after the first user turn. Errors say what was looked for, and where.
"""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

TEXT_FIELDS = ("turns", "prompt", "question", "instruction", "input", "text")
CHAT_FIELDS = ("messages", "conversations")
ANSWER_FIELDS = ("output", "answer", "response", "completion")
FORMATS = (".jsonl", ".json", ".csv", ".parquet")
SPLITS = ("test", "validation", "train")
USER, ASSISTANT = ("user", "human"), ("assistant", "gpt")      # OpenAI's roles, ShareGPT's `from`


def dataset_rows(name: str):
    """The rows of a local file or of a Hugging Face dataset in the offline cache, in order."""
    path = Path(name).expanduser()
    if path.is_file():
        yield from _file_rows(path)
        return
    files = _hub_files(name)
    if not files:
        raise FileNotFoundError(
            f"dataset {name!r} not found: not a file, and not a Hugging Face dataset in the offline cache "
            f"{hub_cache()} (looked for {_hub_dir(name.split(':')[0]).name}/snapshots/*/ with "
            f"{', '.join(FORMATS)} files)")
    for f in files:
        yield from _file_rows(f)


def _file_rows(path: Path):
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        with path.open(encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    yield json.loads(line)
    elif suffix == ".json":
        value = json.loads(path.read_text(encoding="utf-8"))
        if isinstance(value, dict):
            value = next((value[k] for k in ("data", "rows", "examples") if isinstance(value.get(k), list)), None)
        if not isinstance(value, list):
            raise ValueError(f"{path}: expected a list of rows (or an object with one under data, rows or examples)")
        yield from value
    elif suffix == ".csv":
        with path.open(encoding="utf-8", newline="") as f:
            yield from csv.DictReader(f)
    elif suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as exc:
            raise ImportError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow)") from exc
        yield from pq.read_table(path).to_pylist()
    else:
        raise ValueError(f"{path}: unknown format {suffix!r}; use one of {', '.join(FORMATS)}")


def hub_cache() -> Path:
    """The Hugging Face hub cache folder (where `huggingface-cli download` and `datasets` put files)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = Path(os.environ["HF_HOME"]) if os.environ.get("HF_HOME") else Path.home() / ".cache" / "huggingface"
    return home / "hub"


def _hub_dir(repo_id: str) -> Path:
    return hub_cache() / ("datasets--" + repo_id.replace("/", "--"))


def _hub_files(name: str) -> list[Path]:
    """The data files of `org/name[:split]` in the newest cached snapshot, one split's, in name order."""
    repo_id, _, split = name.partition(":")
    snapshots = sorted((_hub_dir(repo_id) / "snapshots").glob("*"), key=lambda p: p.stat().st_mtime, reverse=True)
    for snapshot in snapshots:
        files = sorted(p for p in snapshot.rglob("*") if p.suffix.lower() in FORMATS and p.is_file()
                       and not p.name.startswith("."))
        for wanted in ([split] if split else SPLITS):
            chosen = [p for p in files if _split_of(p) == wanted]
            if chosen:
                return chosen
        if files and not split:
            return files
    return []


def _split_of(path: Path) -> str | None:
    """The split a hub data file belongs to: `test-00000-of-00001.parquet`, `data/train.jsonl`, ..."""
    for part in (path.stem, path.parent.name):
        head = part.split("-")[0].split(".")[0]
        if head in SPLITS:
            return head
    return None


# ---- a row's prompt and answer ----------------------------------------------------------------


def prompt_of(row, prompt_field: str | None = None, messages_field: str | None = None, name: str = "") -> str:
    """A row's first user turn (see the module docstring)."""
    if not isinstance(row, dict):
        if isinstance(row, str) and not (prompt_field or messages_field):
            return row
        raise ValueError(f"{name}: a row is not an object: {str(row)[:80]!r}")
    if messages_field or (not prompt_field and any(k in row for k in CHAT_FIELDS)
                          and not any(k in row for k in TEXT_FIELDS)):
        field = messages_field or next(k for k in CHAT_FIELDS if k in row)
        return _first_user_turn(row.get(field), field, name)
    field = prompt_field or next((k for k in TEXT_FIELDS if k in row), None)
    if field is None or field not in row:
        raise KeyError(f"{name}: no prompt field in its rows (fields {sorted(row)[:12]}); name one with "
                       f"--prompt-field, or chat messages with --messages-field")
    value = row[field]
    if isinstance(value, list):       # our files' `turns`: the first one
        value = value[0] if value else ""
    if not isinstance(value, str):
        raise ValueError(f"{name}: field {field!r} holds {type(value).__name__}, not text")
    return value


def answer_of(row, messages_field: str | None = None) -> str | None:
    """A row's reference answer (see the module docstring), or None."""
    if not isinstance(row, dict):
        return None
    for field in ANSWER_FIELDS:
        if isinstance(row.get(field), str) and row[field]:
            return row[field]
    field = messages_field or next((k for k in CHAT_FIELDS if k in row), None)
    if field is None or not isinstance(row.get(field), list):
        return None
    seen_user = False
    for m in row[field]:
        role = m.get("role", m.get("from")) if isinstance(m, dict) else None
        if role in USER:
            seen_user = True
        elif role in ASSISTANT and seen_user and isinstance(m.get("content", m.get("value")), str):
            return m.get("content", m.get("value"))
    return None


def _first_user_turn(messages, field: str, name: str) -> str:
    if not isinstance(messages, list):
        raise ValueError(f"{name}: field {field!r} does not hold a list of messages")
    for m in messages:
        if not isinstance(m, dict):
            continue
        if m.get("role", m.get("from")) in USER:
            content = m.get("content", m.get("value"))
            if isinstance(content, str):
                return content
    raise ValueError(f"{name}: a row's {field!r} has no user turn")
