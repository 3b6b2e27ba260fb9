"""`specserve train prompts` (drafters/train/prompts.py) on a tiny Llama: the target's own user
messages, each the seeded sample that one request alone gives, kept only when the model ended them;
a run that continues and one with other settings refused; a model that never ends its turn stops
the run; and distill answers the pool in its own folder, which the trainers read against it."""

from __future__ import annotations

import json

import pytest
from helpers import step_and_collect

from specserve.drafters.train.distill import read_answers, read_folders
from specserve.drafters.train.prompts import MIN_TOKENS, user_turn_prefix
from specserve.engine.config import EngineConfig
from specserve.engine.core import LLMEngine
from specserve.engine.sampling_params import SamplingParams
from specserve.server import cli


@pytest.fixture(scope="module")
def talker(tmp_path_factory, tiny_model_factory):
    """A tiny Llama whose end-of-turn token is likely enough that some of its messages end."""
    from safetensors.torch import load_file, save_file

    path = tiny_model_factory(tmp_path_factory.mktemp("talker"))
    weights = load_file(path / "model.safetensors")
    weights["lm_head.weight"][2] *= 6.0
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


def prompts_argv(model, out, *extra):
    return ["train", "prompts", "--model", str(model), "--out", str(out), "--device", "cpu", "--max-num-seqs", "4",
            "--prompt-max-tokens", "12", "--no-progress", "--log-level", "warning", *extra]


def distill_own_argv(model, folder, max_tokens):
    """`train distill` answering the folder's own pool into the folder, greedy."""
    return ["train", "distill", "--model", str(model), "--data", str(folder), "--out", str(folder), "--device", "cpu",
            "--temperatures", "0", "--max-tokens", str(max_tokens), "--max-num-seqs", "3", "--no-progress",
            "--log-level", "warning"]


def messages_alone(model, requests):
    """Request i sampled by its own engine request (seed i, temperature 1), as the server would."""
    engine = LLMEngine(EngineConfig(model=str(model), device="cpu", drafters=()))
    prefix = user_turn_prefix(engine.tokenizer)
    out = {}
    for i in range(requests):
        engine.add_request(f"r{i}", prefix, SamplingParams(temperature=1.0, max_tokens=12, seed=i))
        got: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            step_and_collect(engine, got)
        out[i] = got.get(f"r{i}", [])
    return engine, out


def test_prompts_are_the_models_own_ended_messages_and_continue(talker, tmp_path, capsys):
    out = tmp_path / "chat"
    assert cli.main(prompts_argv(talker, out, "--num-prompts", "3")) == 0
    manifest = json.loads((out / "prompts.json").read_text())
    first = (out / "train_prompts.jsonl").read_text()
    last = int(json.loads(first.splitlines()[-1])["id"].rsplit("-", 1)[1])
    assert manifest["prompts"] == 3 and manifest["temperature"] == 1.0
    assert manifest["requests"] == last + 1          # the requests after the last prompt wanted count as not made

    # continued: the first rows stay, later requests follow them
    assert cli.main(prompts_argv(talker, out, "--num-prompts", "6")) == 0
    manifest = json.loads((out / "prompts.json").read_text())
    assert (out / "train_prompts.jsonl").read_text().startswith(first)
    rows = [json.loads(line) for line in (out / "train_prompts.jsonl").read_text().splitlines()]
    assert len(rows) == manifest["prompts"] == 6 and manifest["runs"][1]["requests"] > 0
    assert all(r["source"] == "self-chat" and r["id"].startswith("self-chat-") for r in rows)

    # each kept message is what its request alone samples, ended by the model; the others were not kept
    engine, alone = messages_alone(talker, manifest["requests"])
    kept = {int(r["id"].rsplit("-", 1)[1]): r["turns"][0] for r in rows}
    assert sorted(kept) == list(kept)                                   # rows in request order
    for i, ids in alone.items():
        ended = bool(ids) and ids[-1] in engine.eos_token_ids and len(ids) - 1 >= MIN_TOKENS
        text = engine.tokenizer.decode(ids[:-1], skip_special_tokens=True).strip()
        if i in kept:
            assert ended and kept[i] == text
        elif ended and text and i < max(kept):
            assert text.lower() in {t.lower() for t in kept.values()}   # dropped only as a repeat

    # other settings: refused, nothing written
    capsys.readouterr()
    assert cli.main(prompts_argv(talker, out, "--num-prompts", "9", "--prompt-temperature", "0.8")) == 1
    assert "other settings (temperature)" in capsys.readouterr().err
    assert len((out / "train_prompts.jsonl").read_text().splitlines()) == 6


def test_a_model_that_never_ends_its_turn_stops_the_run(tiny_llama_dir, tmp_path):
    out = tmp_path / "chat"
    argv = prompts_argv(tiny_llama_dir, out, "--num-prompts", "50", "--prompt-max-tokens", "1")
    assert cli.main(argv) == 0         # one token is below MIN_TOKENS: no message can be kept
    manifest = json.loads((out / "prompts.json").read_text())
    assert manifest["prompts"] == 0 and manifest["requests"] == 32


def test_distill_answers_the_folders_own_pool(talker, tiny_llama_dir, pool_writer, tmp_path):
    out = tmp_path / "chat"
    assert cli.main(prompts_argv(talker, out, "--num-prompts", "4")) == 0
    distill = distill_own_argv(talker, out, 5)
    assert cli.main(distill) == 0
    other = pool_writer(tmp_path / "train_prompts.jsonl", {"a": 3}, with_output=False)
    examples = read_answers(out, str(other))           # the folder's own pool wins over --data
    turns = {json.loads(line)["turns"][0] for line in (out / "train_prompts.jsonl").read_text().splitlines()}
    assert len(examples) == 4 and {ex.turns[0] for ex in examples} == turns
    assert all(ex.source == "self-chat" and 1 <= len(ex.output_ids) <= 5 for ex in examples)
    assert [ex.id for ex in read_folders([out], str(other))] == [ex.id for ex in examples]


def test_a_grown_pool_is_read_and_continued(talker, tmp_path):
    """`train prompts` run again appends to the folder's pool: its answers stay readable, and distill
    continues the folder, answering the new rows only; a pool changed otherwise is refused."""
    out = tmp_path / "chat"
    assert cli.main(prompts_argv(talker, out, "--num-prompts", "3")) == 0
    distill = distill_own_argv(talker, out, 4)
    assert cli.main(distill) == 0
    first = {ex.id: ex.output_ids for ex in read_answers(out)}
    assert cli.main(prompts_argv(talker, out, "--num-prompts", "5")) == 0
    assert {ex.id: ex.output_ids for ex in read_answers(out)} == first        # grown: still readable
    assert cli.main(distill) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["rows"] == 5 and manifest["runs"][1]["answers"] == 2
    later = {ex.id: ex.output_ids for ex in read_answers(out)}
    assert len(later) == 5 and all(later[k] == v for k, v in first.items())

    pool = out / "train_prompts.jsonl"
    pool.write_text("".join(reversed(pool.read_text().splitlines(keepends=True))))   # changed, not grown
    with pytest.raises(ValueError, match="another prompt pool"):
        read_answers(out)
    assert cli.main(distill) == 1
