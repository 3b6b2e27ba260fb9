"""bench/datasets.py: prompts from the datasets users have, on small files the test writes: JSONL,
JSON (a list, or rows under `data`), CSV and Parquet, with the prompt field found or named, chat
messages (OpenAI's and ShareGPT's shapes) by their first user turn; a Hugging Face dataset id read
from a fake offline hub cache (a split chosen, or named); our own benchmark names through
SPECSERVE_DATA; and errors that say what was looked for."""

from __future__ import annotations

import csv
import json

import pytest

from specserve.bench.datasets import load_prompts

ROWS = [{"question": "What is 2 + 2?", "answer": "4"}, {"question": "Name a colour.", "answer": "red"}]
CHAT = [{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
                      {"role": "assistant", "content": "Hello"}]},
        {"conversations": [{"from": "human", "value": "Tell a joke"}, {"from": "gpt", "value": "..."}]}]


def _write(path, rows):
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif path.suffix == ".json":
        path.write_text(json.dumps({"data": rows}))
    elif path.suffix == ".csv":
        with path.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    else:
        pq = pytest.importorskip("pyarrow.parquet")
        import pyarrow as pa

        pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".csv", ".parquet"])
def test_every_file_format_gives_its_prompts(tmp_path, suffix):
    path = _write(tmp_path / f"qa{suffix}", ROWS)
    assert load_prompts(str(path)) == ["What is 2 + 2?", "Name a colour."]
    assert load_prompts(str(path), 1, prompt_field="answer") == ["4"]


def test_chat_rows_give_their_first_user_turn(tmp_path):
    path = _write(tmp_path / "chat.jsonl", CHAT)
    assert load_prompts(str(path)) == ["Hi there", "Tell a joke"]
    mixed = _write(tmp_path / "mixed.jsonl", [{"text": "plain", "messages": CHAT[0]["messages"]}])
    assert load_prompts(str(mixed)) == ["plain"]
    assert load_prompts(str(mixed), messages_field="messages") == ["Hi there"]


def test_a_hugging_face_id_is_read_from_the_offline_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    snapshot = tmp_path / "hub" / "datasets--org--qa" / "snapshots" / "abc123" / "data"
    snapshot.mkdir(parents=True)
    _write(snapshot / "train-00000-of-00001.jsonl", [{"prompt": "train prompt"}])
    _write(snapshot / "test-00000-of-00001.jsonl", [{"prompt": "test prompt"}])
    assert load_prompts("org/qa") == ["test prompt"]              # test before train
    assert load_prompts("org/qa:train") == ["train prompt"]
    with pytest.raises(FileNotFoundError, match="datasets--org--other"):
        load_prompts("org/other")


def test_our_benchmarks_come_from_specserve_data(tmp_path, monkeypatch):
    _write(tmp_path / "gsm8k.jsonl", [{"id": 1, "category": "math", "turns": ["Add 2 and 3.", "And 4?"]}])
    monkeypatch.setenv("SPECSERVE_DATA", str(tmp_path))
    assert load_prompts("gsm8k") == ["Add 2 and 3."]
    with pytest.raises(FileNotFoundError, match="SPECSERVE_DATA"):
        load_prompts("mt_bench")


def test_errors_say_what_was_looked_for(tmp_path):
    path = _write(tmp_path / "odd.jsonl", [{"body": "x"}])
    with pytest.raises(KeyError, match="--prompt-field"):
        load_prompts(str(path))
    with pytest.raises(ValueError, match="no user turn"):
        load_prompts(str(_write(tmp_path / "c.jsonl", [{"messages": [{"role": "system", "content": "x"}]}])))
    (tmp_path / "rows.txt").write_text("x")
    with pytest.raises(ValueError, match="unknown format"):
        load_prompts(str(tmp_path / "rows.txt"))
