"""Distillation data: the balanced prompt pool, rendering with its answer mask, teacher shards
(content, resume after a kill), self-distillation through the engine, and reading shards back."""

from __future__ import annotations

import json
import os

import pytest
import torch

from specserve.drafters.train import data as D
from specserve.drafters.train.data import (PAD_LABEL, Example, ShardDataset, balance_by_source, build_teacher_shards,
                                           load_prompt_pool, render_example, render_prompt, self_distill_examples)
from specserve.drafters.train.target import target_features, target_topk

# ---- the pool ----------------------------------------------------------------------------------------------------


def test_pool_is_balanced_across_sources(pool_file):
    pool = load_prompt_pool(pool_file, max_examples=12, seed=0)
    counts = D.source_counts(pool)
    assert counts == {"big": 5, "mid": 5, "small": 2}   # small gives all it has, the others share the rest
    # every prefix is balanced: the first 6 are two of each, one per source per round
    assert D.source_counts(pool[:6]) == {"big": 2, "mid": 2, "small": 2}
    assert [ex.source for ex in pool[:3]] == ["big", "mid", "small"]
    assert len({ex.id for ex in pool}) == 12
    assert [ex.id for ex in load_prompt_pool(pool_file, max_examples=12, seed=0)] == [ex.id for ex in pool]
    assert [ex.id for ex in load_prompt_pool(pool_file, max_examples=12, seed=1)] != [ex.id for ex in pool]
    assert len(load_prompt_pool(pool_file)) == 20
    assert D.source_counts(load_prompt_pool(pool_file, sources=["small", "mid"])) == {"mid": 6, "small": 2}
    with pytest.raises(ValueError, match="no source nope"):
        load_prompt_pool(pool_file, sources=["nope"])


def test_pool_location_and_rows_without_answers(tmp_path, monkeypatch, pool_writer):
    pool_writer(tmp_path / "train_prompts.jsonl", {"a": 3, "b": 2}, with_output=False)
    monkeypatch.setenv("SPECSERVE_DATA", str(tmp_path))
    assert D.default_pool_path() == tmp_path / "train_prompts.jsonl"
    assert D.default_pool_path(tmp_path / "x") == tmp_path / "x" / "train_prompts.jsonl"
    assert load_prompt_pool() == []                                   # no reference answers to teacher-force
    assert len(load_prompt_pool(require_output=False)) == 5           # fine for self-distillation
    assert len(load_prompt_pool(tmp_path, require_output=False)) == 5  # a folder works too
    with pytest.raises(FileNotFoundError, match="SPECSERVE_DATA"):
        load_prompt_pool(tmp_path / "missing.jsonl")


def test_the_pool_can_be_any_dataset_users_have(tmp_path, monkeypatch):
    """CSV rows with a question and an answer; ShareGPT-shaped chat rows (prompt: the first user
    turn, answer: the assistant's reply); a Hugging Face id in the offline cache; named fields."""
    import csv

    with (tmp_path / "qa.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["question", "answer"])
        w.writeheader()
        w.writerows([{"question": "2 + 2?", "answer": "4"}, {"question": "3 + 3?", "answer": "6"}])
    pool = load_prompt_pool(tmp_path / "qa.csv")
    assert sorted((ex.turns, ex.output, ex.source) for ex in pool) == [(["2 + 2?"], "4", "qa"), (["3 + 3?"], "6", "qa")]
    chat = [{"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"}]},
            {"conversations": [{"from": "human", "value": "Unanswered"}]}]
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    snapshot = tmp_path / "hub" / "datasets--org--chat" / "snapshots" / "0" / "data"
    snapshot.mkdir(parents=True)
    (snapshot / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chat))
    [answered] = load_prompt_pool("org/chat")                       # teacher forcing: rows with an answer
    assert answered.turns == ["Hi"] and answered.output == "Hello!" and answered.source == "org/chat"
    assert len(load_prompt_pool("org/chat", require_output=False)) == 2
    named = load_prompt_pool(tmp_path / "qa.csv", prompt_field="answer", require_output=False)
    assert sorted(ex.turns[0] for ex in named) == ["4", "6"]


def test_balance_handles_an_exhausted_pool():
    exs = [Example(id=str(i), turns=["q"], output="a", source="s" if i < 3 else "t") for i in range(5)]
    assert len(balance_by_source(exs, max_examples=100)) == 5
    assert balance_by_source(exs, max_examples=0) == []


# ---- rendering ---------------------------------------------------------------------------------------------------


def test_answer_mask_hand_worked(tiny_loaded):
    """Tiny chat template: "<s>{role}\\n{content}</s>\\n" per message, then "<s>assistant\\n"."""
    tok = tiny_loaded.tokenizer
    ex = Example(id="x", turns=["Hello world!"], output="Paris is the capital of France.")
    r = render_example(tok, ex, max_len=512)
    prompt = tok.encode("<s>user\nHello world!</s>\n<s>assistant\n", add_special_tokens=False)
    answer = tok.encode("Paris is the capital of France.", add_special_tokens=False)
    assert prompt[0] == 1 and prompt[-1] != 2                  # starts with <s>, ends with the generation prompt
    assert r.input_ids == prompt + answer + [2]                # the answer ends with EOS (</s> = 2)
    assert r.answer_mask == [False] * len(prompt) + [True] * (len(answer) + 1)
    assert tok.decode([t for t, m in zip(r.input_ids, r.answer_mask) if m]) == "Paris is the capital of France.</s>"
    assert render_prompt(tok, ex.turns) == prompt
    # truncation keeps the first max_len tokens; no answer token left -> None
    cut = render_example(tok, ex, max_len=len(prompt) + 2)
    assert cut.input_ids == (prompt + answer)[:len(prompt) + 2] and cut.num_answer_tokens == 2
    assert render_example(tok, ex, max_len=len(prompt)) is None
    assert render_example(tok, Example(id="y", turns=["Hi"]), max_len=64) is None          # no answer at all
    # self-distilled answers are taken as generated token ids (EOS included or not)
    own = render_example(tok, Example(id="z", turns=["Hello world!"], output="ignored", output_ids=[50, 60]))
    assert own.input_ids == prompt + [50, 60] and own.answer_mask[-3:] == [False, True, True]


# ---- teacher shards ----------------------------------------------------------------------------------------------


def _examples(n: int = 10) -> list[Example]:
    words = "the quick brown fox jumps over the lazy dog Paris France world".split()
    return [Example(id=f"ex-{i}", turns=[" ".join(words[i % 5:i % 5 + 3])], source="ab"[i % 2],
                    output=" ".join(words[(i * 2) % 7:(i * 2) % 7 + 2 + i % 4])) for i in range(n)]


def _read(path):
    """(metadata, {name: tensor as a list}) of a shard (the header's key order is not fixed)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return f.metadata(), {k: f.get_tensor(k).tolist() for k in f.keys()}


def _mtimes(folder):
    return {p.name: p.stat().st_mtime_ns for p in folder.glob("shard-*.safetensors")}


def test_shards_hold_the_teacher_pass(tiny_target, tmp_path):
    from safetensors.torch import load_file

    target = tiny_target
    exs = _examples(7)
    manifest = build_teacher_shards(target.model, target.tokenizer, exs, tmp_path, max_len=64, shard_size=3, top_k=4,
                                    batch_tokens=40, target_name="tiny", progress=False)
    assert [s["file"] for s in manifest["shards"]] == [f"shard-0000{i}.safetensors" for i in range(3)]
    assert manifest["num_examples"] == 7 and manifest["num_dropped"] == 0
    assert manifest["target"] == {"name": "tiny", "fingerprint": target.fingerprint}
    assert manifest["sources"] == {"a": 4, "b": 3} and manifest["config"]["top_k"] == 4
    assert json.loads((tmp_path / "manifest.json").read_text()) == manifest
    rendered = [render_example(target.tokenizer, ex, max_len=64) for ex in exs]
    assert manifest["num_tokens"] == sum(len(r.input_ids) for r in rendered)
    # shard 1 = examples 3..5, exactly the target's features and top-k
    shard = load_file(str(tmp_path / "shard-00001.safetensors"))
    feats = target_features(target.model, [r.input_ids for r in rendered[3:6]])
    hidden = torch.cat(feats)
    ids, logprobs = target_topk(target.model, hidden, 4)
    assert shard["offsets"].tolist() == [0] + torch.tensor([len(r.input_ids) for r in rendered[3:6]]).cumsum(0).tolist()
    assert shard["input_ids"].tolist() == [t for r in rendered[3:6] for t in r.input_ids]
    assert shard["answer_mask"].tolist() == [m for r in rendered[3:6] for m in r.answer_mask]
    assert shard["hidden"].dtype == torch.float16
    torch.testing.assert_close(shard["hidden"].float(), hidden, atol=2e-3, rtol=1e-3)
    assert torch.equal(shard["labels"], ids[:, 0]) and torch.equal(shard["topk_ids"], ids)
    torch.testing.assert_close(shard["topk_logprobs"], logprobs)


def test_shard_build_resumes_after_a_kill(tiny_target, tmp_path, monkeypatch):
    target = tiny_target
    exs = _examples(10)
    kwargs = dict(max_len=32, shard_size=3, top_k=3, batch_tokens=64, progress=False)
    first = build_teacher_shards(target.model, target.tokenizer, exs, tmp_path, **kwargs)
    assert first["shards_reused"] == 0 and len(first["shards"]) == 4
    before = _mtimes(tmp_path)
    content = {name: _read(tmp_path / name) for name in before}

    # a kill half-way: shard 1 cut short, shard 2 never renamed (only its temporary file), manifest gone
    path1 = tmp_path / "shard-00001.safetensors"
    path1.write_bytes(path1.read_bytes()[:200])
    (tmp_path / "shard-00002.safetensors").rename(tmp_path / "shard-00002.safetensors.tmp")
    (tmp_path / "manifest.json").unlink()

    seen: list[list[int]] = []
    original = D.render_example

    def counting(tokenizer, example, **kw):
        seen.append(example.id)
        return original(tokenizer, example, **kw)

    monkeypatch.setattr(D, "render_example", counting)
    again = build_teacher_shards(target.model, target.tokenizer, exs, tmp_path, **kwargs)
    assert sorted(seen) == ["ex-3", "ex-4", "ex-5", "ex-6", "ex-7", "ex-8"]   # only shards 1 and 2 were redone
    after = _mtimes(tmp_path)
    assert after["shard-00000.safetensors"] == before["shard-00000.safetensors"]
    assert after["shard-00003.safetensors"] == before["shard-00003.safetensors"]
    assert after["shard-00001.safetensors"] != before["shard-00001.safetensors"]
    assert not list(tmp_path.glob("*.tmp"))
    assert {name: _read(tmp_path / name) for name in after} == content   # rebuilt identically
    assert again["shards_reused"] == 2
    assert {k: v for k, v in again.items() if k not in ("shards_reused", "build_seconds", "created")} == \
        {k: v for k, v in first.items() if k not in ("shards_reused", "build_seconds", "created")}

    # nothing to do on a third run; another top-k makes every shard stale
    seen.clear()
    build_teacher_shards(target.model, target.tokenizer, exs, tmp_path, **kwargs)
    assert seen == []
    build_teacher_shards(target.model, target.tokenizer, exs[:4], tmp_path, **{**kwargs, "top_k": 2})
    assert len(seen) == 4 and sorted(_mtimes(tmp_path)) == ["shard-00000.safetensors", "shard-00001.safetensors"]


def test_examples_without_answer_tokens_are_dropped(tiny_target, tmp_path):
    target = tiny_target
    exs = _examples(3) + [Example(id="no-answer", turns=["q"], source="c")]
    manifest = build_teacher_shards(target.model, target.tokenizer, exs, tmp_path, max_len=32, shard_size=2,
                                    top_k=2, progress=False)
    assert manifest["num_examples"] == 3 and manifest["num_dropped"] == 1 and "c" not in manifest["sources"]


# ---- reading shards back -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shard_dir(tiny_target, tmp_path_factory):
    out = tmp_path_factory.mktemp("shards")
    build_teacher_shards(tiny_target.model, tiny_target.tokenizer, _examples(12), out, max_len=40, shard_size=5,
                         top_k=3, progress=False)
    return out


def test_split_by_example_id(shard_dir):
    everything = ShardDataset(shard_dir)
    train = ShardDataset(shard_dir, split="train", eval_examples=3)
    held = ShardDataset(shard_dir, split="eval", eval_examples=3)
    assert len(everything) == 12 and len(held) == 3 and len(train) == 9
    assert set(train.ids) | set(held.ids) == set(everything.ids) and not set(train.ids) & set(held.ids)
    assert held.held_back == set(held.ids) == train.held_back
    assert set(ShardDataset(shard_dir, split="eval", eval_fraction=0.25).ids) == set(held.ids)
    # the choice depends on the ids, not on their order; one more id changes at most one choice
    assert D.held_back_ids(everything.ids, 3) == D.held_back_ids(list(reversed(everything.ids)), 3)
    assert len(D.held_back_ids(everything.ids, 3) & D.held_back_ids(everything.ids + ["other"], 3)) >= 2
    assert held.data_summary()["num_examples"] == 3
    with pytest.raises(ValueError, match="split"):
        ShardDataset(shard_dir, split="test")
    with pytest.raises(FileNotFoundError, match="manifest.json"):
        ShardDataset(shard_dir / "nowhere")


def test_sequence_batches(shard_dir):
    ds = ShardDataset(shard_dir)
    plan = ds.batches(96, epoch=0, seed=0)
    seen = []
    for batch in plan:
        rows, width = batch["input_ids"].shape
        assert rows * width <= 96 or rows == 1
        assert batch["hidden"].shape == (rows, width, ds.hidden_size) and batch["hidden"].dtype == torch.float32
        assert batch["topk_ids"].shape == (rows, width, 3) and batch["topk_logprobs"].shape == (rows, width, 3)
        for r, eid in enumerate(batch["ids"]):
            n = int(batch["lengths"][r])
            ex = ds.example(ds.ids.index(eid))
            assert torch.equal(batch["input_ids"][r, :n], ex["input_ids"].long())
            assert torch.equal(batch["labels"][r, :n], ex["labels"].long())
            assert torch.equal(batch["hidden"][r, :n], ex["hidden"].float())
            assert torch.equal(batch["answer_mask"][r, :n], ex["answer_mask"])
            assert torch.equal(batch["loss_mask"][r, :n - 1], ex["answer_mask"][1:])
            assert not batch["loss_mask"][r, n - 1]
            assert batch["valid"][r].sum() == n and torch.equal(batch["positions"][r, :n], torch.arange(n))
            assert (batch["labels"][r, n:] == PAD_LABEL).all() and not batch["loss_mask"][r, n:].any()
            seen.append(eid)
    assert sorted(seen) == sorted(ds.ids)                           # every example once per epoch
    order = [b["ids"] for b in plan]
    assert order == [b["ids"] for b in plan]                        # re-iterable, same order
    assert order == [b["ids"] for b in ds.batches(96, epoch=0, seed=0)]
    assert order != [b["ids"] for b in ds.batches(96, epoch=1, seed=0)]
    assert len(plan) == len(order)
    fixed = [b["ids"] for b in ds.batches(96, shuffle=False)]
    assert [i for ids in fixed for i in ids] == ds.ids
    only = next(iter(ds.batches(96, fields=("labels",))))
    assert "hidden" not in only and "labels" in only and "loss_mask" in only


def test_window_batches(shard_dir):
    ds = ShardDataset(shard_dir)
    windows = list(ds.batches(64, window=8, shuffle=False))
    assert all(b["input_ids"].shape[1] <= 8 for b in windows)
    first = ds.example(0)
    n = first["input_ids"].shape[0]
    pieces = [(b["ids"][r], b["positions"][r], b["valid"][r], b["loss_mask"][r], b["input_ids"][r])
              for b in windows for r in range(len(b["ids"])) if b["ids"][r] == ds.ids[0]]
    loss_full = torch.zeros(n, dtype=torch.bool)
    loss_full[:-1] = first["answer_mask"][1:]
    for _, pos, valid, loss, ids in pieces:
        p = pos[valid]
        assert torch.equal(ids[valid], first["input_ids"][p].long())
        assert torch.equal(loss[valid], loss_full[p])               # the window's last row looks past its end
        assert bool(loss[valid].any())                              # windows with nothing to learn are skipped
    assert sum(int(loss[valid].sum()) for _, _, valid, loss, _ in pieces) == int(loss_full.sum())


# ---- self-distillation -------------------------------------------------------------------------------------------


def test_self_distillation_through_the_engine(tiny_loaded, tmp_path, monkeypatch):
    from specserve.engine.config import EngineConfig
    from specserve.engine.core import LLMEngine

    engine = LLMEngine(EngineConfig(model="tiny", dtype="float32", device="cpu", max_num_seqs=2, max_model_len=64,
                                    num_kv_blocks=64), loaded=tiny_loaded)
    prompts = _examples(5)
    prompts.append(Example(id="too-long", turns=["fox " * 200], source="a"))
    cache = tmp_path / "answers.jsonl"
    got = self_distill_examples(engine, prompts, max_tokens=6, cache_path=cache, max_in_flight=3, progress=False)
    assert [ex.id for ex in got] == [ex.id for ex in prompts[:5]]   # the prompt that does not fit is skipped
    assert not engine.has_unfinished_requests()
    for ex, prompt in zip(got, prompts):
        assert (ex.turns, ex.source) == (prompt.turns, prompt.source)
        assert 1 <= len(ex.output_ids) <= 6 and isinstance(ex.output, str)
        # greedy: the same answer as the engine gives one request alone
        engine.add_request("check", render_prompt(engine.tokenizer, prompt.turns), _params(6), drafter="none")
        alone = []
        while engine.has_unfinished_requests():
            for out in engine.step():
                for d in out.outputs:
                    alone.extend(d.token_ids)
        assert ex.output_ids == alone
    # the cache resumes: nothing is generated again
    monkeypatch.setattr(engine, "step", lambda: pytest.fail("generated again"))
    again = self_distill_examples(engine, prompts[:5], max_tokens=6, cache_path=cache, progress=False)
    assert [(e.id, e.output_ids) for e in again] == [(e.id, e.output_ids) for e in got]
    # other settings are not taken from the cache
    monkeypatch.undo()
    other = self_distill_examples(engine, prompts[:2], max_tokens=3, cache_path=cache, progress=False)
    assert all(len(e.output_ids) <= 3 for e in other)


def _params(max_tokens):
    from specserve.engine.sampling_params import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens)


def test_self_distilled_examples_feed_the_shards(tiny_target, tmp_path):
    exs = [Example(id="s0", turns=["fox"], output="x", output_ids=[40, 41, 2], source="a")]
    manifest = build_teacher_shards(tiny_target.model, tiny_target.tokenizer, exs, tmp_path, max_len=32, top_k=2,
                                    progress=False)
    ds = ShardDataset(tmp_path)
    ex = ds.example(0)
    assert ex["input_ids"][-3:].tolist() == [40, 41, 2] and ex["answer_mask"].sum() == 3
    assert manifest["num_answer_tokens"] == 3
    assert os.path.isfile(tmp_path / "manifest.json")


@pytest.mark.slow
def test_smollm2_rendering_and_fingerprint(default_model):
    """The default target: ChatML (with its default system prompt) then the answer and <|im_end|>;
    its fingerprint is the same in fp32 and bf16."""
    from specserve.drafters.nets.checkpoint import target_fingerprint
    from specserve.engine.config import ModelConfig
    from specserve.engine.model import LlamaModel

    tok = default_model.tokenizer
    r = render_example(tok, Example(id="q", turns=["What is 2+2?"], output="2+2 = 4."), max_len=512)
    text = tok.decode(r.input_ids)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n2+2 = 4.<|im_end|>")
    assert tok.decode([t for t, m in zip(r.input_ids, r.answer_mask) if m]) == "2+2 = 4.<|im_end|>"
    cfg = ModelConfig.from_hf(default_model.hf_config)
    fps = {target_fingerprint(cfg, LlamaModel.from_state_dict(cfg, default_model.state_dict, max_positions=64,
                                                               dtype=dtype, device=torch.device("cpu")))
           for dtype in (torch.float32, torch.bfloat16)}
    assert len(fps) == 1 and fps == {target_fingerprint(cfg, default_model.state_dict)}
