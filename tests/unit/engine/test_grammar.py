"""Structured output (engine/grammar.py, llguidance): a JSON schema, a regex, a choice and a Lark or
GBNF grammar constrain plain decoding; with every drafter (chains, trees, MCSD trees, cascades,
heads) the constrained greedy output is plain decoding's, token for token, because each tree node is
masked with the grammar state after its own path; masking every node with the committed state
instead (the control) changes it. Bad constraints are refused, and a grammar that cannot finish
within max_tokens ends with "length"."""

from __future__ import annotations

import json
import re

import pytest
import torch
from helpers import TINY_DRAFTERS as DRAFTERS
from helpers import make_llm_engine, step_and_collect

from specserve.engine.errors import InvalidRequestError
from specserve.engine.grammar import GrammarState
from specserve.engine.sampling_params import SamplingParams

pytest.importorskip("llguidance")

REGEX = r"[0-9]{3}-[a-z]{2,4}"
CHOICES = ["Paris", "London", "fox jumps"]
SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                         "n": {"type": "integer", "minimum": 0, "maximum": 999}},
          "required": ["city", "n"], "additionalProperties": False}
LARK = 'start: "hello " name\nname: /[a-z]{1,6}/'
GBNF = 'root ::= "yes" | "no" | "maybe " [0-9]'
CASES = {"regex": ("regex", REGEX), "choice": ("choice", json.dumps(CHOICES)), "json": ("json", json.dumps(SCHEMA)),
         "lark": ("grammar", LARK), "gbnf": ("grammar", GBNF)}


def valid(kind: str, text: str) -> bool:
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "choice":
        return text in CHOICES
    if kind == "lark":
        return re.fullmatch(r"hello [a-z]{1,6}", text) is not None
    if kind == "gbnf":
        return re.fullmatch(r"yes|no|maybe [0-9]", text) is not None
    value = json.loads(text)
    return value["city"] in ("Paris", "Rome") and isinstance(value["n"], int) and 0 <= value["n"] <= 999


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(2)
    return [[7, 100, 42, 9, 250, 31, 7, 100, 42, 9, 250, 31, 7, 100]] + \
        [torch.randint(3, 320, (n,), generator=g).tolist() * 2 for n in (5, 8)]


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    return make_llm_engine(tiny_llama_dir, list(DRAFTERS), DRAFTERS, max_model_len=200, num_kv_blocks=600)


def decode(engine, prompts, guided, drafter=None, max_tokens=40, temperature=0.0):
    """{request id: (tokens, finish reason)}."""
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, guided=guided)
    for i, p in enumerate(prompts):
        engine.add_request(f"g{i}", p, params, **({"drafter": drafter} if drafter else {}))
    got, reasons = {}, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(t for d in out.outputs for t in d.token_ids)
            for d in out.outputs:
                if d.finish_reason:
                    reasons[out.request_id] = d.finish_reason
    return {rid: (got[rid], reasons.get(rid)) for rid in got}


@pytest.fixture(scope="module")
def plain(engine, prompts):
    return {case: decode(engine, prompts, guided) for case, guided in CASES.items()}


@pytest.mark.parametrize("case", list(CASES))
def test_each_kind_constrains_plain_decoding(engine, plain, case):
    eos = engine.eos_token_ids
    for tokens, reason in plain[case].values():
        assert reason == "stop" and tokens[-1] in eos
        assert valid(case, engine.tokenizer.decode(tokens[:-1])), engine.tokenizer.decode(tokens)


@pytest.mark.parametrize("drafter", list(DRAFTERS))
def test_every_drafter_gives_plain_decodings_constrained_tokens(engine, prompts, plain, drafter):
    for case, guided in CASES.items():
        assert decode(engine, prompts, guided, drafter) == plain[case], case
    assert engine.get_stats().drafters[drafter].num_fallbacks == 0


def test_masking_nodes_with_the_committed_state_is_caught(engine, prompts, plain, monkeypatch):
    real = GrammarState.tree_masks
    monkeypatch.setattr(GrammarState, "tree_masks",
                        lambda self, tokens, parents: real(self, tokens, parents)[:1].repeat(len(tokens), axis=0))
    changed = [case for case, guided in CASES.items() if decode(engine, prompts, guided, "draft_model") != plain[case]]
    assert changed


def test_bad_constraints_are_refused(engine):
    for guided in (("regex", "(unclosed"), ("json", "{not json"), ("json", json.dumps({"type": "nope"})),
                   ("grammar", "start: undefined_rule"), ("choice", "[]"), ("yaml", "a: 1")):
        with pytest.raises(InvalidRequestError):
            engine.add_request("bad", [1, 2, 3], SamplingParams(guided=guided))
    assert not engine.has_unfinished_requests()


def test_a_grammar_that_cannot_finish_ends_with_length(engine, prompts):
    out = decode(engine, prompts[:1], ("regex", "[0-9]{30}"), "ngram", max_tokens=5)
    tokens, reason = out["g0"]
    assert reason == "length" and len(tokens) == 5 and engine.tokenizer.decode(tokens).isdigit()


def test_sampling_stays_inside_the_grammar(engine, prompts):
    for drafter in (None, "draft_model", "eagle"):
        out = decode(engine, prompts, CASES["regex"], drafter, temperature=1.0)
        for tokens, reason in out.values():
            assert reason == "stop" and valid("regex", engine.tokenizer.decode(tokens[:-1]))


def test_step_and_collect_sees_the_same_tokens(engine, prompts, plain):
    # the deltas the server streams carry the same constrained tokens
    engine.add_request("s", prompts[0], SamplingParams(temperature=0.0, max_tokens=40, guided=CASES["choice"]))
    got: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        step_and_collect(engine, got)
    assert got["s"] == plain["choice"]["g0"][0]
