"""Greedy losslessness of every built-in drafter (the trained ones with their shipped checkpoints)
on the embedded SmolLM2-135M as served (`--quantization auto`: the GGUF's int4 weights): a batch of
chat prompts of different lengths, arriving at different steps, decodes exactly the tokens plain
decoding gives, with one engine serving all drafters side by side (per-request choice); the same
under a JSON schema (structured output), where the output also parses and validates; and under the
logits processors (penalties, logit_bias) and the other grammar kinds (regex, choice, EBNF)."""

from __future__ import annotations

import json

import pytest
from helpers import run_requests

from specserve.bench.datasets import data_dir
from specserve.engine.config import EngineConfig
from specserve.engine.core import LLMEngine
from specserve.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number, then call it for n = 10.",
    "What is the capital of France?",
    "List three colours of the rainbow, then list them again in reverse order.",
    "Repeat after me: the quick brown fox jumps over the lazy dog. The quick brown fox",
]
DRAFTERS = ("ngram", "mag", "draft_model", "student", "medusa", "eagle", "eagle3", "parallelspec", "ctc", "falcon",
            "cascade")   # trained ones: shipped checkpoints; cascade: student reviewing mag


SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 40},
                                         "confidence": {"type": "integer", "minimum": 0, "maximum": 10}},
          "required": ["answer", "confidence"], "additionalProperties": False}


def run_staggered(engine: LLMEngine, prompts: list[list[int]], drafter: str, max_tokens: int = 24,
                  guided=None, **processing) -> list[list[int]]:
    """Greedy requests drafted by `drafter`, one added every third step; outputs in prompt order."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, guided=guided, **processing)
    got = run_requests(engine, prompts, params, every=3, prefix=f"{drafter}-", drafter=drafter)
    return [got[f"{drafter}-{i}"] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def engine(default_model):
    corpus = data_dir() / "mt_bench.jsonl"     # a small corpus keeps mag's bigram table quick to build
    engine = LLMEngine(EngineConfig(
        model="default", dtype="float32", device="cpu", max_num_seqs=4, max_model_len=512,
        drafters=("none", *DRAFTERS), num_speculative_tokens=6, max_draft_tokens_per_step=24, draft_budget="fixed",
        drafter_options={"draft_model": {"draft_layers": 20, "k_config": "2,2,1"},
                         "mag": {"corpus": str(corpus) if corpus.is_file() else None},
                         "cascade": {"level_options": {"mag": {"corpus": str(corpus)}} if corpus.is_file() else None}}),
        loaded=default_model)
    return engine


@pytest.fixture(scope="module")
def prompts(engine):
    return [engine.tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                 return_dict=False) for p in PROMPTS]


def test_every_drafter_reproduces_plain_greedy_decoding(engine, prompts):
    plain = run_staggered(engine, prompts, "none")
    assert all(len(t) > 5 for t in plain)
    for name in DRAFTERS:
        assert run_staggered(engine, prompts, name) == plain, name
        stats = engine.drafter_stats[name]
        assert stats.num_steps > 0 and stats.num_fallbacks == 0, name
    assert engine.drafter_stats["ngram"].num_accepted_tokens > 0
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_every_drafter_reproduces_plain_decoding_under_a_json_schema(engine, prompts):
    guided = ("json", json.dumps(SCHEMA))
    plain = run_staggered(engine, prompts, "none", max_tokens=48, guided=guided)
    for tokens in plain:
        assert tokens[-1] in engine.eos_token_ids, engine.tokenizer.decode(tokens)
        value = json.loads(engine.tokenizer.decode(tokens[:-1]))
        assert set(value) == {"answer", "confidence"} and 0 <= value["confidence"] <= 10
    for name in DRAFTERS:
        assert run_staggered(engine, prompts, name, max_tokens=48, guided=guided) == plain, name
        assert engine.drafter_stats[name].num_fallbacks == 0, name
    assert engine.drafter_stats["grammar"].num_accepted_tokens > 0
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


# penalties and a bias that bans the plain output's most common token and favours another; the
# grammar kinds besides JSON schemas (test_grammar.py has their validity on the tiny target)
KINDS = {"processors": dict(presence_penalty=0.6, frequency_penalty=0.4, repetition_penalty=1.3),
         "regex": dict(guided=("regex", r"(Yes|No), because [a-z ]{5,40}\.")),
         "choice": dict(guided=("choice", json.dumps(["Paris", "London", "Berlin", "Madrid"]))),
         "ebnf": dict(guided=("grammar", 'root ::= "The answer is " [0-9]+ "."'))}


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_drafter_reproduces_plain_decoding_under_processors_and_grammars(engine, prompts, kind):
    options = dict(KINDS[kind])
    if kind == "processors":   # ban the token plain greedy decoding emits most, favour a common word
        plain_ids = [t for p in run_staggered(engine, prompts, "none") for t in p]
        top = max(set(plain_ids), key=plain_ids.count)
        favoured = engine.tokenizer.encode(" the", add_special_tokens=False)[0]
        options["logit_bias"] = {top: -100.0, favoured: 2.0}
    max_tokens = 20 if kind == "processors" else 32    # the grammars end their outputs sooner
    plain = run_staggered(engine, prompts, "none", max_tokens=max_tokens, **options)
    if kind == "processors":
        assert top not in {t for p in plain for t in p}
    else:
        texts = [engine.tokenizer.decode(t[:-1] if t[-1] in engine.eos_token_ids else t) for t in plain]
        assert any(t[-1] in engine.eos_token_ids for t in plain), texts
        if kind == "choice":
            assert all(t in ("Paris", "London", "Berlin", "Madrid") for t, p in zip(texts, plain)
                       if p[-1] in engine.eos_token_ids), texts
    for name in DRAFTERS:
        assert run_staggered(engine, prompts, name, max_tokens=max_tokens, **options) == plain, (kind, name)
        assert engine.drafter_stats[name].num_fallbacks == 0, name
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
