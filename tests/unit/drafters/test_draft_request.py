"""Drafters see `DraftRequest` views, not engine sequences, and draft from an extended prefix
(hypothetical tokens after the committed ones) as if those tokens were committed, without letting
them into their committed state."""

from __future__ import annotations

import dataclasses

import pytest
from helpers import make_llm_engine, run_requests

from specserve.drafters.base import Drafter, DraftRequest, make_drafter, register
from specserve.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def view(seq_id, tokens, **kw) -> DraftRequest:
    return DraftRequest(seq_id, tuple(tokens), kw.pop("num_prompt_tokens", 2), kw.pop("params", GREEDY), **kw)


def test_view_is_frozen_and_slotted():
    v = view(3, [1, 2, 3, 4], options={"max_depth": 2})
    with pytest.raises(dataclasses.FrozenInstanceError):
        v.token_ids = (1,)
    assert not hasattr(v, "__dict__") and not hasattr(v, "held_back")
    ext = v.extend([7, 8])
    assert ext.token_ids == (1, 2, 3, 4, 7, 8) and ext.hypothetical == (7, 8) and ext.is_extended
    assert ext.committed_token_ids == v.token_ids and ext.num_committed == 4 and ext.options == {"max_depth": 2}
    assert not v.is_extended and v.hypothetical == () and v.num_output_tokens == 2
    assert ext.extend([9]).hypothetical == (7, 8, 9)


@register("test_view_recorder")
class Recorder(Drafter):
    def __init__(self, ctx):
        self.calls: list[tuple[str, type]] = []

    def start(self, seq):
        self.calls.append(("start", type(seq)))

    def propose(self, seqs, budgets):
        self.calls.extend(("propose", type(s)) for s in seqs)
        return [None] * len(seqs)

    def finish(self, seq):
        self.calls.append(("finish", type(seq)))


def test_the_engine_hands_views(tiny_llama_dir):
    engine = make_llm_engine(tiny_llama_dir, ["test_view_recorder"])
    run_requests(engine, [[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    calls = engine.drafters["test_view_recorder"].calls
    assert {c for c, _ in calls} == {"start", "propose", "finish"}
    assert {t for _, t in calls} == {DraftRequest}


PREFIX = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 10, 11, 5, 6]
HYP = [7, 8]


@pytest.mark.parametrize("name, options", [("ngram", {}), ("mag", {"bigram": False, "max_tokens": 4})])
def test_statistical_drafters_draft_from_an_extended_prefix(name, options):
    d = make_drafter(name, **options)
    d.propose([view(0, PREFIX)], [6])                              # buffers the committed prefix
    extended = d.propose([view(0, PREFIX).extend(HYP)], [6])[0]
    plain = make_drafter(name, **options).propose([view(0, PREFIX + HYP)], [6])[0]
    assert extended is not None and (extended.tokens, extended.parents) == (plain.tokens, plain.parents)
    # the hypothetical tokens never became part of what the drafter holds for the sequence
    other = PREFIX + [9, 10]
    got = d.propose([view(0, other)], [6])[0]
    fresh = make_drafter(name, **options).propose([view(0, other)], [6])[0]
    assert (got.tokens, got.parents) == (fresh.tokens, fresh.parents)


def test_draft_model_drafts_from_an_extended_prefix(tiny_llama_dir):
    options = {"draft_layers": 1, "k_config": "2,2,1", "block_size": 4}
    engine = make_llm_engine(tiny_llama_dir, ["draft_model"], {"draft_model": options})
    ctx = dict(target=engine.model, model_config=engine.model_config, device=engine.device, dtype=engine.dtype,
               max_model_len=engine.max_model_len)

    def fresh_tree(tokens):
        d = make_drafter("draft_model", **ctx, **options)
        d.start(view(1, tokens))
        return d.propose([view(1, tokens)], [8])[0]

    d = make_drafter("draft_model", **ctx, **options)
    d.start(view(1, PREFIX))
    first = d.propose([view(1, PREFIX)], [8])[0]
    assert first.tokens == fresh_tree(PREFIX).tokens
    extended = d.propose([view(1, PREFIX).extend(HYP)], [8])[0]
    assert extended.tokens[0] == HYP[-1] and extended.tokens == fresh_tree(PREFIX + HYP).tokens
    assert d.state[1].draft_len <= len(PREFIX)             # only committed tokens stay in its cache
    other = PREFIX + [11, 12, 13]
    assert d.propose([view(1, other)], [8])[0].tokens == fresh_tree(other).tokens
