"""The drafter platform: a drafter is one file (or one class in a test) registered by name, built
from the engine's `DrafterContext` plus its own declared options; undeclared options fail at
engine start-up, undeclared per-request options fail the request."""

from __future__ import annotations

import pytest
from helpers import make_llm_engine, run_requests

from specserve.drafters.base import (Drafter, DrafterContext, DrafterOptionError, drafter_class,
                                     drafter_options, make_drafter, register)
from specserve.engine.errors import InvalidRequestError
from specserve.engine.sampling_params import SamplingParams
from specserve.engine.tree import TokenTree

MIGRATED = ("ngram", "mag", "draft_model", "student", "medusa", "eagle", "parallelspec", "ctc", "falcon")
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@register("test_platform_echo")
class EchoDrafter(Drafter):
    """Proposes the last `lookahead` tokens again as a chain, plus one sibling under the root that
    is the token after the root in the vocabulary (so trees have branches). Declares one option,
    also settable per request."""

    name = "test_platform_echo"
    request_options = ("lookahead",)

    def __init__(self, ctx: DrafterContext, *, lookahead: int = 3):
        self.vocab = ctx.vocab_size
        self.lookahead = lookahead
        self.seen_options: list[dict] = []

    def propose(self, seqs, budgets):
        trees = []
        for seq, budget in zip(seqs, budgets):
            self.seen_options.append(dict(seq.options))
            k = min(seq.options.get("lookahead", self.lookahead), budget - 1, len(seq.token_ids))
            if k < 1:
                trees.append(None)
                continue
            chain = list(seq.token_ids[-k:])
            tokens = [seq.token_ids[-1], (seq.token_ids[-1] + 1) % self.vocab, *chain]
            parents = [-1, 0, 0, *range(2, 2 + k - 1)]
            trees.append(TokenTree(tokens, parents))
        return trees


def test_every_builtin_drafter_declares_its_options_without_a_catch_all():
    import inspect

    for name in MIGRATED:
        params = inspect.signature(drafter_class(name)).parameters.values()
        assert not any(p.kind is p.VAR_KEYWORD for p in params), name
        assert next(iter(params)).name == "ctx", name


def test_unknown_option_is_an_error_naming_the_valid_ones():
    with pytest.raises(DrafterOptionError, match=r"'max_ngrm' \(did you mean 'max_ngram'\?\); valid options: "
                                                 r"max_depth, max_matches, max_ngram, min_ngram"):
        make_drafter("ngram", max_ngrm=2)
    assert drafter_options(drafter_class("ngram")) == {"max_ngram": 4, "min_ngram": 1, "max_depth": 8,
                                                       "max_matches": 3}
    assert make_drafter("ngram", max_ngram=2).max_ngram == 2


def test_unknown_option_fails_engine_start_up(tiny_llama_dir):
    with pytest.raises(DrafterOptionError, match="did you mean 'max_ngram'"):
        make_llm_engine(tiny_llama_dir, ["ngram"], {"ngram": {"max_ngrm": 2}})
    with pytest.raises(DrafterOptionError, match="'draft_layer' .*did you mean 'draft_layers'"):
        make_llm_engine(tiny_llama_dir, ["draft_model"], {"draft_model": {"draft_layer": 1}})


def test_context_by_name_and_options_validated():
    """Callers without a DrafterContext name its fields; the drafter gets them in its `ctx`, and
    its options are still validated."""
    @register("test_platform_by_name")
    class ByName(Drafter):
        def __init__(self, ctx, *, width: int = 1):
            self.model_config, self.width = ctx.model_config, width

        def propose(self, seqs, budgets):
            return [None] * len(seqs)

    d = make_drafter("test_platform_by_name", model_config="cfg", width=3)
    assert (d.model_config, d.width) == ("cfg", 3)
    with pytest.raises(DrafterOptionError, match="did you mean 'width'"):
        make_drafter("test_platform_by_name", widht=3)
    ctx = DrafterContext(max_model_len=77)
    assert make_drafter("test_platform_echo", ctx, lookahead=5).lookahead == 5


def test_a_drafter_defined_here_is_served_greedy_identical(tiny_llama_dir):
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [40, 41, 42, 43, 44, 45, 46], [9, 10, 9, 10, 9, 10, 9]]
    plain = run_requests(make_llm_engine(tiny_llama_dir, []), prompts, GREEDY)
    engine = make_llm_engine(tiny_llama_dir, ["test_platform_echo"], {"test_platform_echo": {"lookahead": 2}})
    assert run_requests(engine, prompts, GREEDY) == plain
    stats = engine.get_stats().drafters["test_platform_echo"]
    assert stats.num_draft_tokens > 0 and stats.num_fallbacks == 0


def test_per_request_options_reach_the_drafter_and_others_are_refused(tiny_llama_dir):
    engine = make_llm_engine(tiny_llama_dir, ["test_platform_echo", "ngram"])
    engine.add_request("a", [5, 6, 7, 5, 6, 7], GREEDY, drafter="test_platform_echo",
                       drafter_options={"lookahead": 1})
    while engine.has_unfinished_requests():
        engine.step()
    seen = engine.drafters["test_platform_echo"].seen_options
    assert seen and all(o == {"lookahead": 1} for o in seen)
    with pytest.raises(InvalidRequestError, match=r"'lookahed' \(did you mean 'lookahead'\?\)") as exc:
        engine.add_request("b", [5, 6], GREEDY, drafter="test_platform_echo", drafter_options={"lookahed": 1})
    assert exc.value.param == "speculative.lookahed"
    with pytest.raises(InvalidRequestError, match="max_depth, max_matches") as exc:
        engine.add_request("c", [5, 6], GREEDY, drafter="ngram", drafter_options={"max_ngram": 1})
    assert exc.value.param == "speculative.max_ngram"     # an engine-wide option is not a per-request one
    with pytest.raises(InvalidRequestError, match="positive integer") as exc:
        engine.add_request("d", [5, 6], GREEDY, drafter="ngram", drafter_options={"max_depth": 0})
    assert exc.value.param == "speculative.max_depth"
    with pytest.raises(InvalidRequestError, match="takes no options"):
        engine.add_request("e", [5, 6], GREEDY, drafter="none", drafter_options={"max_depth": 2})
    assert not engine.has_unfinished_requests()


def test_ngram_per_request_depth_limits_its_trees(tiny_llama_dir):
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 5, 6, 7, 8, 9, 10, 11, 12, 5, 6]
    plain = run_requests(make_llm_engine(tiny_llama_dir, []), [prompt], GREEDY)
    engine = make_llm_engine(tiny_llama_dir, ["ngram"])
    got: dict[str, list[int]] = {}
    engine.add_request("r0", prompt, GREEDY, drafter_options={"max_depth": 1, "max_matches": 1})
    while engine.has_unfinished_requests():
        for out in engine.step():
            for d in out.outputs:
                got.setdefault(out.request_id, []).extend(d.token_ids)
    assert got == plain
    st = engine.get_stats().drafters["ngram"]
    assert st.num_steps > 0 and st.num_draft_tokens <= st.num_steps   # chains of one node
