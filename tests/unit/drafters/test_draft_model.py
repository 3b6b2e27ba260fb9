"""The draft-model drafter (SpS chains and MCSD trees, own pruned KV cache): greedy output equals
plain decoding; sampled output has the target's distribution (statistical, through the engine)."""

from __future__ import annotations

import pytest
import torch
import transformers

from specserve.drafters.draft_model import parse_k_config
from specserve.engine.config import EngineConfig
from specserve.engine.core import LLMEngine
from specserve.engine.sampler import SamplingTensors, processed_probs
from specserve.engine.sampling_params import SamplingParams


def engine_with(tiny_llama_dir, drafters=(), options=None, **kw) -> LLMEngine:
    cfg = dict(model=str(tiny_llama_dir), dtype="float32", device="cpu", max_num_seqs=8, block_size=4,
               max_num_batched_tokens=128, num_kv_blocks=400, max_model_len=128, drafters=tuple(drafters),
               drafter_options=options or {}, num_speculative_tokens=12, max_draft_tokens_per_step=64)
    cfg.update(kw)
    return LLMEngine(EngineConfig(**cfg))


def run(engine, prompts, params):
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    got: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            for d in out.outputs:
                got.setdefault(f"{out.request_id}/{d.index}", []).extend(d.token_ids)
    return got


def test_parse_k_config():
    assert parse_k_config("4,2,2,1") == (4, 2, 2, 1)
    assert parse_k_config("chain:3") == (1, 1, 1)
    with pytest.raises(ValueError):
        parse_k_config("2,0")


@pytest.mark.parametrize("k_config", ["chain:4", "3,2,2,1", "2,2,1,1,1,1"])
def test_greedy_is_lossless(tiny_llama_dir, k_config):
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (5, 17, 9, 30, 12)]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    plain = run(engine_with(tiny_llama_dir), prompts, params)
    spec_engine = engine_with(tiny_llama_dir, ["draft_model"], {"draft_model": {"k_config": k_config, "draft_layers": 1}})
    got = run(spec_engine, prompts, params)
    assert got == plain
    stats = spec_engine.get_stats().drafters["draft_model"]
    assert stats.num_steps > 0 and stats.num_fallbacks == 0
    assert spec_engine.blocks.num_free_blocks == spec_engine.blocks.num_blocks
    drafter = spec_engine.drafters["draft_model"]
    assert drafter.blocks.num_free_blocks == drafter.blocks.num_blocks   # the draft cache is freed too


def test_full_depth_draft_model_is_accepted_everywhere(tiny_llama_dir):
    """A 'draft model' that is the whole target must have every greedy draft accepted."""
    params = SamplingParams(temperature=0.0, max_tokens=25, ignore_eos=True)
    eng = engine_with(tiny_llama_dir, ["draft_model"], {"draft_model": {"k_config": "chain:4", "draft_layers": 2}})
    run(eng, [[5, 9, 13, 200, 7]], params)
    st = eng.get_stats().drafters["draft_model"]
    assert st.num_accepted_tokens == st.num_draft_tokens > 0


@pytest.fixture(scope="module")
def peaky_dir(tiny_model_factory, tmp_path_factory):
    """Large initial weights: peaked, clearly non-uniform distributions that differ between the
    1-layer draft and the 2-layer target, so a wrong acceptance rule shows."""
    return tiny_model_factory(tmp_path_factory.mktemp("peaky"), initializer_range=0.15, seed=3)


@pytest.mark.parametrize("k_config", ["chain:3", "2,2,1"])
def test_sampling_matches_the_target_distribution(peaky_dir, k_config):
    """Joint law of the first two tokens (top_k=3 keeps the support at 9 outcomes) over many
    requests equals the target's, computed exactly with transformers."""
    tiny_llama_dir = peaky_dir
    prompt = [7, 100, 42, 9, 250, 31]
    params = SamplingParams(temperature=1.0, top_k=3, max_tokens=4, ignore_eos=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    st = SamplingTensors.from_params([params], "cpu")
    with torch.no_grad():
        p1 = processed_probs(hf(torch.tensor([prompt])).logits[0, -1:], st)[0]
        support = p1.nonzero().flatten().tolist()
        exact = {}
        for t in support:
            p2 = processed_probs(hf(torch.tensor([prompt + [t]])).logits[0, -1:], st)[0]
            for u in p2.nonzero().flatten().tolist():
                exact[(t, u)] = float(p1[t] * p2[u])
    torch.manual_seed(0)
    eng = engine_with(tiny_llama_dir, ["draft_model"], {"draft_model": {"k_config": k_config, "draft_layers": 1}},
                      max_num_seqs=32, num_kv_blocks=1200)
    trials = 1500
    counts: dict[tuple[int, int], int] = {}
    for start in range(0, trials, 250):
        for i in range(start, start + 250):
            eng.add_request(f"s{i}", prompt, params)
        got: dict[str, list[int]] = {}
        while eng.has_unfinished_requests():
            for out in eng.step():
                for d in out.outputs:
                    got.setdefault(out.request_id, []).extend(d.token_ids)
        for toks in got.values():
            counts[(toks[0], toks[1])] = counts.get((toks[0], toks[1]), 0) + 1
    assert eng.get_stats().drafters["draft_model"].num_accepted_tokens > 0
    print(sorted(exact.items(), key=lambda kv: -kv[1])[:5])
    keys = set(exact) | set(counts)
    tv = 0.5 * sum(abs(counts.get(k, 0) / trials - exact.get(k, 0.0)) for k in keys)
    print("tv", tv)
    assert tv < 0.05, tv
