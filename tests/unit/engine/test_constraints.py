"""A constraint's limits before it is compiled (engine/constraints.py), the compile sandbox
(engine/grammar_sandbox.py) and the matcher's errors mid-generation (engine/grammar.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from specserve.engine import constraints
from specserve.engine.constraints import check_limits, repetition_size
from specserve.engine.errors import ConstraintError, InvalidRequestError


def refused(kind: str, text: str) -> str:
    with pytest.raises(InvalidRequestError) as exc:
        check_limits(kind, text)
    return str(exc.value)


@pytest.mark.parametrize("regex, size", [("abc", 1), ("a{5}", 5), ("a{2,7}", 7), ("a{3,}", 3), ("(a{10}){10}", 100),
                                         ("((ab){4}c){5}", 20), (r"\{9999}", 1), ("[{]{3}", 3),
                                         ("(a{100})b{1000}", 1000), ("x{1000000}", 1_000_000)])
def test_repetition_size_multiplies_through_nested_groups(regex, size):
    assert repetition_size(regex) == size


def test_a_grammar_literal_is_not_read_as_a_repetition():
    assert repetition_size('start: "{1000000}" x{3}', skip_quoted=True) == 3


@pytest.mark.parametrize("kind, text, words", [
    ("regex", "a{1000000}", ["repeats 1000000", "100000"]),
    ("regex", "(a{1000}){1000}", ["repeats 1000000"]),
    ("grammar", 'start: /a{500000}/', ["repeats 500000"]),
    ("json", json.dumps({"type": "string", "pattern": "b{200000}"}), ["a pattern repeats 200000"]),
    ("choice", json.dumps(["x"] * 100_001), ["100001 choices"]),
    ("json", json.dumps({"type": "object", "properties": {f"p{i}": {} for i in range(401)}}), ["401 optional"]),
    ("json", json.dumps({"enum": list(range(100_001))}), ["enum has 100001"]),
    ("grammar", "start: a\n" + "a: b\n" * 60_000, ["bytes"]),
])
def test_each_limit_is_a_400_naming_it(kind, text, words):
    message = refused(kind, text)
    assert "over a limit" in message
    for word in words:
        assert word in message


def test_a_deep_schema_and_a_long_ref_chain_are_refused_without_recursion():
    deep: dict = {"type": "string"}
    for _ in range(constraints.MAX_SCHEMA_DEPTH):
        deep = {"type": "array", "items": deep}
    assert "nests deeper" in refused("json", json.dumps(deep))
    n = constraints.MAX_REF_DEPTH + 1
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "integer"}
    assert "$ref" in refused("json", json.dumps({"$defs": defs, "$ref": "#/$defs/d0"}))
    defs.pop(f"d{n}")
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(1000)} | {"d1000": {"type": "integer"}}
    check_limits("json", json.dumps({"$defs": defs, "$ref": "#/$defs/d0"}))   # 1,000 is within the limit


@pytest.mark.parametrize("schema", [
    {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
    {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
    {"type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]},
    {"type": "array", "minItems": 2, "items": {"$ref": "#"}},
    {"anyOf": [{"$ref": "#"}, {"allOf": [{"$ref": "#"}]}]},
    False,
])
def test_a_schema_without_a_finite_instance_is_refused(schema):
    assert "no finite instance" in refused("json", json.dumps(schema))


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}},
    {"type": "object", "properties": {"next": {"$ref": "#"}}},
    {"anyOf": [{"$ref": "#"}, {"type": "null"}]},
    {"$defs": {"a": {"anyOf": [{"$ref": "#/$defs/b"}, {"const": 1}]}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/b"},
    {"type": ["object", "null"], "properties": {"x": {"$ref": "#"}}, "required": ["x"]},
    {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(400)}},
    {"$ref": "#/$defs/missing"},   # llguidance reports what cannot resolve
    True, {},
])
def test_schemas_with_an_end_are_let_through(schema):
    check_limits("json", json.dumps(schema))


# ---- the sandbox ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_llama_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama_dir)


@pytest.fixture(scope="module")
def tokenizer_json(tiny_tokenizer):
    from specserve.engine.grammar import tokenizer_json

    return tokenizer_json(tiny_tokenizer)


def lark_chain(n: int) -> str:
    return "start: r0\n" + "\n".join(f"r{i}: r{i + 1}" for i in range(n)) + f'\nr{n}: "x"'


def test_a_compile_that_crashes_the_sandbox_fails_alone_and_the_next_one_compiles(tiny_tokenizer, tokenizer_json):
    """A chain of 20,000 rules overflows an 8 MiB stack inside llguidance: in the sandbox child that
    kills the child, not this process; the caller gets the reason, the next compile a new child."""
    from specserve.engine.grammar_sandbox import Sandbox

    box = Sandbox(tokenizer_json, len(tiny_tokenizer), [tiny_tokenizer.eos_token_id], stack=8 << 20)
    try:
        error = box.check("grammar", lark_chain(20_000))
        assert "failed on it" in error and "SIGSEGV" in error
        assert box.check("regex", "(yes|no)") is None
        assert box.num_restarts == 1
        assert "does not compile" in box.check("regex", "a(b")
    finally:
        box.close()


def test_a_compile_past_the_timeout_kills_the_sandbox(tiny_tokenizer, tokenizer_json):
    from specserve.engine.grammar_sandbox import Sandbox

    box = Sandbox(tokenizer_json, len(tiny_tokenizer), [tiny_tokenizer.eos_token_id], timeout=0.05)
    try:
        assert box.check("regex", "(a|b)") is None      # started
        heavy = json.dumps([f"h{i:06d}" for i in range(100_000)])
        assert "did not compile within 0.05 s" in box.check("choice", heavy)
        assert box.check("regex", "(a|b)") is None
    finally:
        box.close()


def test_the_sandbox_has_a_memory_limit(tiny_tokenizer, tokenizer_json):
    """Under a 100 MiB address space the child starts but cannot build a 100,000-string lexer: an
    error for that request, not a server that swaps."""
    from specserve.engine.grammar_sandbox import Sandbox

    box = Sandbox(tokenizer_json, len(tiny_tokenizer), [tiny_tokenizer.eos_token_id], memory=100 << 20,
                  stack=8 << 20, timeout=5)
    try:
        assert box.check("regex", "(a|b)") is None
        error = box.check("choice", json.dumps([f"m{i:07d}" for i in range(100_000)]))
        assert error is not None and ("failed on it" in error or "did not compile within" in error)
        assert box.check("regex", "(a|b)") is None
    finally:
        box.close()


# ---- matcher errors mid-generation ------------------------------------------------------------------


@pytest.fixture(scope="module")
def grammars(tiny_tokenizer):
    from specserve.engine.grammar import Grammars

    g = Grammars(tiny_tokenizer, len(tiny_tokenizer), [tiny_tokenizer.eos_token_id])
    yield g
    g.close()


def first_allowed(mask: np.ndarray) -> int:
    return int(np.nonzero(np.unpackbits(mask.view(np.uint8), bitorder="little"))[0][0])


def test_a_matcher_in_error_raises_instead_of_allowing_eos(grammars):
    state = grammars.state(("grammar", 'start: "x" start'))   # llguidance's item limit after one token
    with pytest.raises(ConstraintError, match="during generation after 1 tokens: .*Too many items"):
        state.advance([first_allowed(state.mask())])


def test_a_draft_path_that_puts_the_matcher_in_error_is_cut_and_the_state_kept(grammars, tiny_tokenizer):
    """Drafts are tried on the sequence's own matcher and rolled back; an error there (sticky in
    llguidance) must not leak into the committed state: the node is cut, the matcher rebuilt. (500
    optional properties, past the limit `check_limits` keeps: the matcher fails on the first `{`.)"""
    import llguidance

    from specserve.engine.constraints import grammar_text
    from specserve.engine.grammar import GrammarState

    schema = json.dumps({"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(500)}})
    start = llguidance.LLMatcher(grammars.tokenizer, grammar_text("json", schema), log_level=0)
    state = GrammarState(start.deep_copy(), [tiny_tokenizer.eos_token_id], "json", start=start)
    brace = tiny_tokenizer.convert_tokens_to_ids("{")
    before = state.mask()
    masks, allowed = state.tree_masks([0, brace], [-1, 0])
    assert allowed == [0] and len(masks) == 1     # the "{" node (the matcher's error) cut
    assert not state.matcher.is_error()
    assert np.array_equal(state.mask(), before)
    assert (state.masks_after([], [[brace]]) == -1).all()   # a drafter's path there: a forbidden path's row
    assert not state.matcher.is_error()
    with pytest.raises(ConstraintError, match="json constraint failed during generation"):
        state.advance([brace])                   # committed, as plain decoding would: the request's error
