"""Seeded sampling reproduces whatever the drafts: the embedded SmolLM2 at temperature 0.9 with a seed
gives the same text as plain decoding with that seed, with every kind of drafter (n-gram, MAG,
EAGLE, Medusa's tree, an MCSD draft model configured for target-initialised forests), under the
default goodput budget (whose draft sizes change from step to step), alone or in a crowd.

The engines here are fp32, so greedy and keyed choices are exact; the goodput budget measures the
step times of this machine, so the draft sizes differ between runs: that is the point.
"""

from __future__ import annotations

import itertools

import pytest
from helpers import make_llm_engine, step_and_collect

from specserve.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

QUESTIONS = ["Write a short poem about the sea.", "Explain in two sentences why the sky is blue."]
PARAMS = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=24, seed=123, ignore_eos=True)
DRAFTERS = {
    "ngram": {},
    "mag": {},
    "eagle": {},
    "medusa": {},
    # MCSD: a 2-layer draft model drawing a (2, 2, 1) tree, with W = 2 target-initialised roots (the
    # lossy opt-in, which a seeded request must not get)
    "draft_model": {"draft_layers": 2, "k_config": "2,2,1", "target_init_width": 2},
}
ENGINE = dict(max_model_len=256, num_kv_blocks=512, max_num_batched_tokens=256, max_num_seqs=8,
              draft_budget="goodput")


@pytest.fixture(scope="module")
def prompts(default_model):
    tok = default_model.tokenizer
    return [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, return_dict=False, tokenize=True)
            for q in QUESTIONS]


@pytest.fixture(scope="module")
def plain(default_model, prompts):
    engine = make_llm_engine("default", loaded=default_model, **ENGINE)
    return [run(engine, [(p, PARAMS, "none")])[0] for p in prompts]


@pytest.fixture(scope="module")
def engine(default_model, tmp_path_factory):
    from specserve.bench.datasets import data_dir

    options = {name: dict(opts) for name, opts in DRAFTERS.items()}
    small = data_dir() / "mt_bench.jsonl"     # a small real corpus keeps MAG's table build short
    if small.is_file():
        options["mag"] = {"corpus": str(small), "cache_dir": str(tmp_path_factory.mktemp("mag"))}
    return make_llm_engine("default", list(DRAFTERS), options, loaded=default_model, **ENGINE)


_request_ids = itertools.count()


def run(engine, requests) -> list[list[int]]:
    """Add (prompt, params, drafter) requests at once and step until all finish: their tokens."""
    ids = [f"q{next(_request_ids)}" for _ in requests]
    for rid, (prompt, params, drafter) in zip(ids, requests):
        engine.add_request(rid, prompt, params, drafter=drafter)
    got: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        step_and_collect(engine, got)
    return [got[rid] for rid in ids]


@pytest.mark.parametrize("drafter", list(DRAFTERS))
def test_seeded_request_gives_plain_decodings_text_with_every_drafter(engine, prompts, plain, drafter):
    stats = engine.get_stats().drafters[drafter]
    drafted_before = stats.num_draft_tokens
    for prompt, expected in zip(prompts, plain):
        alone = run(engine, [(prompt, PARAMS, drafter)])
        # three copies in one batch, beside an unseeded request and another seed: other draft sizes
        crowd = run(engine, [(prompt, PARAMS, drafter)] * 3
                    + [(prompt, SamplingParams(temperature=0.9, max_tokens=24, ignore_eos=True), drafter),
                       (prompt, SamplingParams(temperature=0.9, max_tokens=24, seed=7, ignore_eos=True), drafter)])
        assert alone + crowd[:3] == [expected] * 4
        assert crowd[4] != expected                  # the seed matters
    stats = engine.get_stats().drafters[drafter]
    assert stats.num_draft_tokens > drafted_before   # speculation really happened
    assert stats.num_fallbacks == 0


def test_a_seeded_request_gets_no_target_initialised_roots(default_model, prompts):
    """The MCSD draft model is configured for forests: an unseeded sampled request gets them (its
    last sampled token is held back until the next verification picks among the roots), a seeded
    one never (its text is plain decoding's, which a forest's root choice would change). The fixed
    budget drafts every step, so the unseeded request's forests are sure to come."""
    engine = make_llm_engine("default", ["draft_model"], {"draft_model": DRAFTERS["draft_model"]},
                             loaded=default_model, **{**ENGINE, "draft_budget": "fixed"})

    def held_back_steps(rid: str, params) -> int:
        engine.add_request(rid, prompts[0], params)
        seq, held = engine.requests[rid].seqs[0], 0
        while engine.has_unfinished_requests():
            engine.step()
            held += seq.held_back
        return held

    assert held_back_steps("seeded", PARAMS) == 0
    assert held_back_steps("unseeded", SamplingParams(temperature=0.9, max_tokens=24, ignore_eos=True)) > 0
