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
from helpers import empirical_first_two_law, make_llm_engine, step_and_collect, total_variation

from specserve.engine.errors import InvalidRequestError
from specserve.engine.grammar import Grammars, GrammarState, allows
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


def test_forbidden_drafts_are_cut_before_verification(engine, prompts, plain):
    # the tiny random draft model drafts tokens the regex forbids; they are cut, the output unchanged
    before = engine.get_stats().drafters["draft_model"]
    assert decode(engine, prompts, CASES["regex"], "draft_model") == plain["regex"]
    after = engine.get_stats().drafters["draft_model"]
    pruned = after.num_pruned_tokens - before.num_pruned_tokens
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    assert pruned > 0 and after.num_draft_tokens - before.num_draft_tokens >= pruned + accepted


def test_masking_nodes_with_the_committed_state_is_caught(engine, prompts, plain, monkeypatch):
    real = GrammarState.tree_masks
    monkeypatch.setattr(GrammarState, "tree_masks",
                        lambda self, tokens, parents: (real(self, tokens, parents)[0][:1].repeat(len(tokens), axis=0),
                                                       list(range(len(tokens)))))
    changed = [case for case, guided in CASES.items() if decode(engine, prompts, guided, "draft_model") != plain[case]]
    assert changed


def test_a_request_carrying_its_compiled_constraint_is_not_compiled_again(engine, prompts, plain, monkeypatch):
    """The server compiles a constraint off its event loop and hands the matcher over with the
    request: neither the check nor the engine thread compiles it again (a heavy constraint the
    grammar cache dropped meanwhile once compiled on the event loop), and the output is the same."""
    started = {case: engine.grammars.compile(guided) for case, guided in CASES.items()}

    def no_compile(guided):
        raise AssertionError(f"compiled again: {guided}")

    monkeypatch.setattr(engine.grammars, "compile", no_compile)
    for case, guided in CASES.items():
        params = SamplingParams(temperature=0.0, max_tokens=40, guided=guided)
        got: dict[str, list[int]] = {}
        for i, p in enumerate(prompts):
            engine.add_request(f"h{i}", p, params, grammar=started[case])
        while engine.has_unfinished_requests():
            step_and_collect(engine, got)
        assert {f"g{i}": got[f"h{i}"] for i in range(len(prompts))} == \
            {rid: tokens for rid, (tokens, _) in plain[case].items()}, case


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


def test_seeded_sampling_under_a_grammar_is_the_same_with_every_drafter(engine, prompts):
    def seeded(drafter):
        params = SamplingParams(temperature=1.0, seed=7, max_tokens=40, guided=CASES["regex"], n=2)
        for i, p in enumerate(prompts):
            engine.add_request(f"k{i}", p, params, **({"drafter": drafter} if drafter else {}))
        got: dict[tuple[str, int], list[int]] = {}     # per choice: their tokens interleave differently by step
        while engine.has_unfinished_requests():
            for out in engine.step():
                for d in out.outputs:
                    got.setdefault((out.request_id, d.index), []).extend(d.token_ids)
        return got

    plain = seeded(None)
    for drafter in DRAFTERS:
        assert seeded(drafter) == plain, drafter


# ---- the sampling law under a grammar -------------------------------------------------------------

# three characters, one from each class: after the first, the second class is allowed, after the
# second the third. The prompt repeats "a d g" and "b e h", so the n-gram drafter proposes the second
# and third characters after the first: the third is drawn at a tree node whose path holds the second.
LAW_GUIDED = ("regex", "[ab][de][gh]")
LAW_PARAMS = SamplingParams(temperature=1.0, max_tokens=5, guided=LAW_GUIDED)
NGRAM = ("ngram", {"max_ngram": 1, "max_matches": 1})
TRIALS = 3000
TV_BOUND = 0.045


def char_ids(tokenizer, text: str) -> list[int]:
    return [tokenizer.convert_tokens_to_ids(c) for c in text]


@pytest.fixture(scope="module")
def masked_law(peaky_target) -> tuple[list[int], dict]:
    """The law prompt, and the exact joint law of the first three tokens under LAW_PARAMS: transformers'
    logits, masked with llguidance's state after each prefix."""
    import transformers

    from specserve.engine.grammar import Grammars, apply_masks
    from specserve.engine.sampler import SamplingTensors, processed_probs

    tokenizer = transformers.AutoTokenizer.from_pretrained(peaky_target)
    prompt = char_ids(tokenizer, "adgbehadgbehadgbeh")
    hf = transformers.AutoModelForCausalLM.from_pretrained(peaky_target, dtype=torch.float32).eval()
    grammars = Grammars(tokenizer, hf.config.vocab_size, [tokenizer.eos_token_id])
    st = SamplingTensors.from_params([LAW_PARAMS], "cpu")

    def law(output: list[int], p: float) -> dict:
        if len(output) == 3:
            return {tuple(output): p}
        matcher = grammars.compile(LAW_GUIDED).deep_copy()
        matcher.consume_tokens(output)
        mask = GrammarState(matcher).mask()
        logits = apply_masks(hf(torch.tensor([prompt + output])).logits[0, -1:], mask[None])
        q = processed_probs(logits, st)[0]
        return {k: v for t in q.nonzero().flatten().tolist() for k, v in law(output + [t], p * float(q[t])).items()}

    with torch.no_grad():
        return prompt, law([], 1.0)


def test_sampling_under_a_grammar_with_a_tree_follows_the_masked_law(peaky_target, masked_law):
    prompt, law = masked_law
    emp, engine = empirical_first_two_law(peaky_target, *NGRAM, prompt, LAW_PARAMS, TRIALS, length=3)
    stats = engine.get_stats().drafters["ngram"]
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert all(k in law for k in emp)                 # never outside the grammar
    assert total_variation(emp, law) < TV_BOUND


def test_sampling_law_control_committed_state_masks_are_caught(peaky_target, masked_law, monkeypatch):
    prompt, law = masked_law
    real = GrammarState.tree_masks
    monkeypatch.setattr(GrammarState, "tree_masks",
                        lambda self, tokens, parents: (real(self, tokens, parents)[0][:1].repeat(len(tokens), axis=0),
                                                       list(range(len(tokens)))))
    emp, _ = empirical_first_two_law(peaky_target, *NGRAM, prompt, LAW_PARAMS, TRIALS, length=3)
    assert total_variation(emp, law) > TV_BOUND


def hf_constrained_greedy(model_dir, engine, prompt: list[int], guided, max_tokens: int) -> list[int]:
    """Greedy decoding under the constraint, one token at a time with transformers and a matcher of its
    own: what the engine must give, whatever it drafts."""
    import transformers

    from specserve.engine.grammar import apply_masks

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    state = GrammarState(engine.grammars.compile(guided).deep_copy())
    out: list[int] = []
    with torch.no_grad():
        while len(out) < max_tokens:
            logits = apply_masks(hf(torch.tensor([prompt + out])).logits[0, -1:], state.mask()[None])
            out.append(int(logits.argmax()))
            state.advance(out[-1:])
            if out[-1] in engine.eos_token_ids:
                break
    return out


def test_forced_tokens_are_drafted_for_free_and_change_nothing(tiny_llama_dir, engine, prompts, plain):
    before = engine.get_stats().drafters["grammar"]
    out = decode(engine, prompts, CASES["json"], "none")     # the grammar alone drafts
    stats = engine.get_stats().drafters["grammar"]
    assert stats.num_draft_tokens > before.num_draft_tokens and stats.num_accepted_tokens > before.num_accepted_tokens
    for i, p in enumerate(prompts):
        assert out[f"g{i}"][0] == hf_constrained_greedy(tiny_llama_dir, engine, p, CASES["json"], 40)


@pytest.mark.parametrize("drafter", ["ngram", "mag", "draft_model", "eagle", "medusa", "parallelspec", "ctc",
                                     "falcon", "cascade"])
def test_a_drafter_drafts_after_the_forced_tokens_in_the_same_tree(engine, prompts, plain, drafter):
    """Where the grammar forces tokens, a drafter that can draft from tokens not yet committed
    proposes the rest of the budget after them (its view extended by the forced tokens), in the
    same tree: the same tokens as plain constrained decoding, and each part counted as its own."""
    impl = engine.drafters[drafter]
    propose, extended = impl.propose, []

    def recording(seqs, budgets):
        extended.extend(s.hypothetical for s in seqs if s.hypothetical)
        return propose(seqs, budgets)

    impl.propose = recording
    before = {name: engine.get_stats().drafters[name] for name in ("grammar", drafter)}
    try:
        params = SamplingParams(temperature=0.0, max_tokens=40, guided=CASES["json"])
        for i, p in enumerate(prompts):
            engine.add_request(f"g{i}", p, params, drafter=drafter)
        got, specs = {}, {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                got.setdefault(out.request_id, []).extend(t for d in out.outputs for t in d.token_ids)
                specs[out.request_id] = out.spec
    finally:
        impl.propose = propose
    assert {rid: toks for rid, toks in got.items()} == {rid: toks for rid, (toks, _) in plain["json"].items()}
    assert extended, "no tree was drafted after forced tokens"
    after = {name: engine.get_stats().drafters[name] for name in ("grammar", drafter)}
    drafted = {name: after[name].num_draft_tokens - before[name].num_draft_tokens for name in after}
    assert drafted["grammar"] > 0 and drafted[drafter] > 0
    own = impl.part_names or (drafter,)    # a composite drafter's parts are its own (cascade: its levels)
    parts = {"grammar": sum(s.parts["grammar"].num_draft_tokens for s in specs.values()),
             drafter: sum(s.parts[name].num_draft_tokens for s in specs.values() for name in own if name in s.parts)}
    assert parts == drafted                                                   # per request, the same split
    assert sum(s.num_draft_tokens for s in specs.values()) == sum(drafted.values())
    assert after[drafter].num_fallbacks == before[drafter].num_fallbacks


@pytest.mark.slow
def test_the_default_models_byte_level_tokens_reach_the_grammar_as_their_bytes(default_model):
    """SmolLM2's tokenizer (converted from its GGUF) spells a leading space "Ġ" and a newline "Ċ":
    the grammar must read those tokens as b" ..." and b"\\n", or no grammar could emit either."""
    tok = default_model.tokenizer
    state = Grammars(tok, len(tok), default_model.eos_token_ids).state(("regex", r"No, because it is\n[a-z]+\."))
    ids = tok.encode("No, because it is\nwet.", add_special_tokens=False)
    assert tok.convert_ids_to_tokens(ids[2]) == "Ġbecause" and "Ċ" in tok.convert_ids_to_tokens(ids)
    for token in ids:
        assert allows(state.mask(), token), tok.convert_ids_to_tokens(token)
        state.advance([token])
    assert allows(state.mask(), default_model.eos_token_ids[0])
