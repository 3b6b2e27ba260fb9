"""The engine on a CUDA device (skipped without one): speculative greedy decoding in fp32 equals
plain decoding token for token, and seeded sampling with stochastic multi-candidate trees runs
(per-request CUDA generators in verification) and is reproducible."""

from __future__ import annotations

import pytest
import torch

from specserve.engine.config import EngineConfig
from specserve.engine.core import LLMEngine
from specserve.engine.sampling_params import SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def make_engine(model_dir, dtype: str = "float32") -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=str(model_dir), dtype=dtype, device="cuda", max_num_seqs=8, block_size=4, num_kv_blocks=400,
        max_model_len=256, drafters=("none", "ngram", "draft_model"),
        drafter_options={"draft_model": {"draft_layers": 1, "k_config": "2,2,1"}}))


def run(engine: LLMEngine, prompts, params, drafter: str) -> dict[str, list[int]]:
    got: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        engine.add_request(f"{drafter}-{i}", p, params, drafter=drafter)
    while engine.has_unfinished_requests():
        for out in engine.step():
            for d in out.outputs:
                got.setdefault(out.request_id.split("-", 1)[1], []).extend(d.token_ids)
    return got


def test_greedy_speculation_equals_plain_on_cuda(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 320, (n,), generator=g).tolist() * 2 for n in (5, 17, 9)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    plain = run(engine, prompts, params, "none")
    for name in ("ngram", "draft_model"):
        assert run(engine, prompts, params, name) == plain, name
    assert engine.drafter_stats["ngram"].num_accepted_tokens > 0


def test_seeded_speculative_sampling_on_cuda_is_reproducible(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    prompts = [[5, 9, 13, 200, 7] * 3]
    params = SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True, seed=1234)
    first, second = (run(engine, prompts, params, "draft_model") for _ in range(2))
    assert first == second and len(first["0"]) == 30
    assert engine.drafter_stats["draft_model"].num_steps > 0
