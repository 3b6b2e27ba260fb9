"""Greedy losslessness of every built-in drafter (the trained ones with their shipped checkpoints)
on the embedded SmolLM2-135M as served (`--quantization auto`: the GGUF's int4 weights): a batch of
chat prompts of different lengths, arriving at different steps, decodes exactly the tokens plain
decoding gives, with one engine serving all drafters side by side (per-request choice); the same
under structured output, one grammar kind per prompt in the same steps (a JSON schema, whose output
also parses and validates, a regex, a choice, an EBNF grammar); and under the logits processors
(penalties, logit_bias)."""

from __future__ import annotations

import json
import re

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
    """Greedy requests drafted by `drafter`, one added every third step; outputs in prompt order.
    `guided` is one grammar for every request, or a list with one per prompt."""
    guides = guided if isinstance(guided, list) else [guided] * len(prompts)
    params = [SamplingParams(temperature=0.0, max_tokens=max_tokens, guided=g, **processing) for g in guides]
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


# one grammar kind per prompt, side by side in the same steps: a JSON schema, a regex, a choice, an EBNF grammar
# (test_grammar.py has their validity on the tiny target)
CHOICES = ["Paris", "London", "Berlin", "Madrid"]
GRAMMARS = [("json", json.dumps(SCHEMA)), ("regex", r"(Yes|No), because [a-z ]{5,40}\."),
            ("choice", json.dumps(CHOICES)), ("grammar", 'root ::= "The answer is " [0-9]+ "."')]


def test_every_drafter_reproduces_plain_decoding_under_each_grammar_kind(engine, prompts):
    plain = run_staggered(engine, prompts, "none", max_tokens=48, guided=GRAMMARS)
    for tokens in plain:     # every kind ends its output with an EOS well inside 48 tokens
        assert tokens[-1] in engine.eos_token_ids, engine.tokenizer.decode(tokens)
    texts = [engine.tokenizer.decode(t[:-1]) for t in plain]
    value = json.loads(texts[0])
    assert set(value) == {"answer", "confidence"} and 0 <= value["confidence"] <= 10
    assert re.fullmatch(GRAMMARS[1][1], texts[1]) and texts[2] in CHOICES, texts
    assert re.fullmatch(r"The answer is [0-9]+\.", texts[3]), texts
    for name in DRAFTERS:
        assert run_staggered(engine, prompts, name, max_tokens=48, guided=GRAMMARS) == plain, name
        assert engine.drafter_stats[name].num_fallbacks == 0, name
    assert engine.drafter_stats["grammar"].num_accepted_tokens > 0
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_every_drafter_reproduces_plain_decoding_under_penalties_and_logit_bias(engine, prompts):
    """Penalties, and a bias that bans the plain output's most common token and favours a common word."""
    plain_ids = [t for p in run_staggered(engine, prompts, "none") for t in p]
    top = max(set(plain_ids), key=plain_ids.count)
    favoured = engine.tokenizer.encode(" the", add_special_tokens=False)[0]
    options = dict(presence_penalty=0.6, frequency_penalty=0.4, repetition_penalty=1.3,
                   logit_bias={top: -100.0, favoured: 2.0})
    plain = run_staggered(engine, prompts, "none", max_tokens=20, **options)
    assert top not in {t for p in plain for t in p}
    for name in DRAFTERS:
        assert run_staggered(engine, prompts, name, max_tokens=20, **options) == plain, name
        assert engine.drafter_stats[name].num_fallbacks == 0, name
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
