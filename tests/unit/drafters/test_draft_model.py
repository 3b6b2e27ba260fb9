"""The draft-model drafter (SpS chains and MCSD trees, own pruned KV cache): greedy output equals
plain decoding. Its sampled output's law is tested in tests/unit/engine/test_sampling_lossless.py."""

from __future__ import annotations

import pytest
import torch

from specserve.drafters.draft_model import parse_k_config
from specserve.engine.config import EngineConfig
from specserve.engine.core import LLMEngine
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
