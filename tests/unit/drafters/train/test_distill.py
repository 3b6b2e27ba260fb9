"""`specserve train distill` (drafters/train/distill.py) on the tiny Llama: the served target's own
answers (greedy ones equal plain decoding, sampled ones its seeded sampling), compact shards that a
later run continues and a run with other settings refuses, and a time cap. Training on them
(`specserve train DRAFTER --distilled DIR`) is tested in test_train_pipeline.py."""

from __future__ import annotations

import json

import numpy as np
from helpers import step_and_collect

from specserve.drafters.train.data import read_examples, render_prompt
from specserve.drafters.train.distill import read_answers, read_shard
from specserve.engine.config import EngineConfig
from specserve.engine.core import LLMEngine
from specserve.engine.sampling_params import SamplingParams
from specserve.server import cli


def distill_argv(model, pool, out, *extra):
    return ["train", "distill", "--model", str(model), "--data", str(pool), "--out", str(out), "--device", "cpu",
            "--max-tokens", "6", "--max-num-seqs", "3", "--shard-size", "4", "--no-progress",
            "--log-level", "warning", *extra]


def answers_alone(model, pool, rows, temperature):
    """Each prompt answered by its own engine request, as the server would."""
    engine = LLMEngine(EngineConfig(model=str(model), device="cpu", drafters=()))
    examples, out = read_examples(pool), {}
    for row in rows:
        seed = row if temperature > 0 else None
        engine.add_request(f"r{row}", render_prompt(engine.tokenizer, examples[row].turns),
                           SamplingParams(temperature=temperature, max_tokens=6, seed=seed))
        got: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            step_and_collect(engine, got)
        out[row] = got.get(f"r{row}", [])
    return out


def test_distill_answers_continue_and_refuse_other_settings(tiny_llama_dir, pool_writer, tmp_path, capsys):
    pool = pool_writer(tmp_path / "train_prompts.jsonl", {"a": 5, "b": 4}, with_output=False)
    out = tmp_path / "distill"
    assert cli.main(distill_argv(tiny_llama_dir, pool, out, "--max-prompts", "5")) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["answers"] == {"0": 5, "0.7": 5} and manifest["max_tokens"] == 6
    assert manifest["runs"][0]["answers"] == 10 and manifest["runs"][0]["tok_s"] > 0
    shard = np.load(sorted(out.glob("t0-*.npz"))[0])
    assert shard["tokens"].dtype == np.uint16 and shard["prompt_index"].dtype == np.int32
    first = {row: ids for s in sorted(out.glob("t0-*.npz")) for row, ids in read_shard(s).items()}
    assert sum(row < 5 for row in first) == 3 and len(first) == 5       # balanced: rows 0-4 are a, 5-8 b
    assert first == answers_alone(tiny_llama_dir, pool, sorted(first), 0.0)
    sampled = {row: ids for s in sorted(out.glob("t0.7-*.npz")) for row, ids in read_shard(s).items()}
    assert sampled == answers_alone(tiny_llama_dir, pool, sorted(sampled), 0.7)

    # a later run answers only what no shard holds; the first shards stay as they were
    before = {p.name: p.read_bytes() for p in out.glob("*.npz")}
    assert cli.main(distill_argv(tiny_llama_dir, pool, out)) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["answers"] == {"0": 9, "0.7": 9} and manifest["runs"][1]["answers"] == 8
    assert all(out.joinpath(name).read_bytes() == data for name, data in before.items())
    examples = read_answers(out, str(pool))
    assert len(examples) == 18 and len({ex.id for ex in examples}) == 18
    assert all(ex.output_ids and len(ex.output_ids) <= 6 for ex in examples)

    # other settings: refused, nothing written
    capsys.readouterr()
    assert cli.main(distill_argv(tiny_llama_dir, pool, out, "--max-tokens", "7")) == 1
    assert "other settings (max_tokens)" in capsys.readouterr().err
    # a time cap of 0: no prompt is taken
    assert cli.main(distill_argv(tiny_llama_dir, pool, tmp_path / "capped", "--time-limit", "0")) == 0
    assert json.loads((tmp_path / "capped" / "manifest.json").read_text())["runs"][0]["answers"] == 0


def test_a_folder_beside_another_answers_only_the_rest(tiny_llama_dir, pool_writer, tmp_path, capsys):
    """`--exclude-answered`: a second machine (another served target, so another folder) answers the
    prompts the first folder has not, at each temperature; the two together hold each prompt once."""
    pool = pool_writer(tmp_path / "train_prompts.jsonl", {"a": 5, "b": 4}, with_output=False)
    first, second = tmp_path / "cpu", tmp_path / "gpu"
    assert cli.main(distill_argv(tiny_llama_dir, pool, first, "--max-prompts", "3", "--temperatures", "0")) == 0
    assert cli.main(distill_argv(tiny_llama_dir, pool, second, "--exclude-answered", str(first))) == 0
    manifest = json.loads((second / "manifest.json").read_text())
    assert manifest["answers"] == {"0": 6, "0.7": 9}      # T=0: the 3 answered beside it are skipped
    assert manifest["runs"][0]["excluded"] == [str(first)]
    taken = {row for s in first.glob("t0-*.npz") for row in read_shard(s)}
    again = {row for s in second.glob("t0-*.npz") for row in read_shard(s)}
    assert len(taken) == 3 and not taken & again and taken | again == set(range(9))
    # the answers are the target's own, as in one folder
    assert {row: ids for s in second.glob("t0-*.npz") for row, ids in read_shard(s).items()} == \
        answers_alone(tiny_llama_dir, pool, sorted(again), 0.0)

    # a folder of another pool, or no distill folder at all, is refused before anything is answered
    other = pool_writer(tmp_path / "other.jsonl", {"a": 3}, with_output=False)
    capsys.readouterr()
    assert cli.main(distill_argv(tiny_llama_dir, other, tmp_path / "x", "--exclude-answered", str(first))) == 1
    assert "answered another prompt pool" in capsys.readouterr().err
    assert cli.main(distill_argv(tiny_llama_dir, pool, tmp_path / "y", "--exclude-answered", str(tmp_path))) == 1
    assert "not a `specserve train distill` folder" in capsys.readouterr().err
