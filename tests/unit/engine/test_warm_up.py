"""The start-up warm-up (`LLMEngine.warm_up`, on by default on CUDA): it drafts and verifies with
every drafter, then leaves no trace: the same greedy tokens, zeroed statistics, every KV block free."""

from __future__ import annotations

import torch

from specserve.engine.sampling_params import SamplingParams
from tests.helpers import make_llm_engine, run_requests

DRAFTERS = ["ngram", "draft_model"]
OPTIONS = {"draft_model": {"draft_layers": 1}}


def test_warm_up_drafts_with_every_drafter_and_leaves_no_trace(tiny_llama_dir):
    cold = make_llm_engine(tiny_llama_dir, DRAFTERS, OPTIONS, draft_budget="goodput", warm_up=False)
    warm = make_llm_engine(tiny_llama_dir, DRAFTERS, OPTIONS, draft_budget="goodput", warm_up=False)
    calls = {name: 0 for name in DRAFTERS}
    for name in DRAFTERS:
        propose = warm.drafters[name].propose

        def counted(*args, name=name, propose=propose, **kwargs):
            calls[name] += 1
            return propose(*args, **kwargs)
        warm.drafters[name].propose = counted
    assert warm.warm_up() > 0
    assert all(n > 0 for n in calls.values()), calls

    stats = warm.get_stats()
    assert stats.num_steps_total == 0 and stats.num_generation_tokens_total == 0 and stats.num_prompt_tokens_total == 0
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert all(d.num_steps == 0 and d.num_draft_tokens == 0 for d in stats.drafters.values())
    assert warm.blocks.num_free_blocks == stats.num_total_blocks

    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 200, (n,), generator=g).tolist() * 2 for n in (6, 9)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for drafter in (None, *DRAFTERS):
        assert run_requests(warm, prompts, params, drafter=drafter, prefix=f"{drafter}-") == \
            run_requests(cold, prompts, params, drafter=drafter, prefix=f"{drafter}-"), drafter


def test_warm_up_runs_at_start_up_when_asked(tiny_llama_dir):
    engine = make_llm_engine(tiny_llama_dir, ["ngram"], warm_up=True)
    stats = engine.get_stats()
    assert stats.num_steps_total == 0 and stats.drafters["ngram"].num_steps == 0
    assert engine.blocks.num_free_blocks == stats.num_total_blocks
