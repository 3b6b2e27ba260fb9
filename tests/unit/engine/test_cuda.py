"""The engine on a CUDA device (skipped without one): speculative greedy decoding in fp32 equals
plain decoding token for token; seeded sampling (keyed draws) gives plain decoding's text with
every drafter, and the same text as on the CPU; unseeded sampling with stochastic multi-candidate
trees runs."""

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


def test_seeded_sampling_on_cuda_is_plain_decodings_and_the_cpus(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    prompts = [[5, 9, 13, 200, 7] * 3]
    params = SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True, seed=1234)
    plain = run(engine, prompts, params, "none")
    assert run(engine, prompts, params, "draft_model") == run(engine, prompts, params, "ngram") == plain
    assert len(plain["0"]) == 30
    assert engine.drafter_stats["draft_model"].num_steps > 0
    cpu = LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", device="cpu", block_size=4,
                                 num_kv_blocks=100, max_model_len=256))
    assert run(cpu, prompts, params, "none") == plain     # keyed draws are the same on every device


def test_unseeded_stochastic_trees_run_on_cuda(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    got = run(engine, [[5, 9, 13, 200, 7] * 3] * 3, SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True),
              "draft_model")
    assert all(len(v) == 30 for v in got.values())
    assert engine.drafter_stats["draft_model"].num_accepted_tokens > 0


def test_gpu_memory_utilization_sizes_the_pool_from_the_device(tiny_llama_dir):
    """vLLM's flag: the pool takes what the share leaves of the engine's own memory, never more than
    the share in all; a share too small for the weights is a clear error."""
    total = torch.cuda.get_device_properties(0).total_memory
    cfg = dict(model=str(tiny_llama_dir), device="cuda", max_num_seqs=4, max_model_len=256, enforce_eager=True)
    before = torch.cuda.memory_allocated()   # other tests' engines may still hold memory: not this one's
    small = LLMEngine(EngineConfig(**cfg, kv_cache_memory_gib=0.001, gpu_memory_utilization=0.01))
    kv = small.cache.kv.numel() * small.cache.kv.element_size()
    assert kv <= 0.01 * total and torch.cuda.memory_allocated() - before <= 0.01 * total + kv
    assert small.blocks.num_blocks > LLMEngine(EngineConfig(**cfg, kv_cache_memory_gib=0.0001)).blocks.num_blocks
    with pytest.raises(ValueError, match="nothing is left for the KV cache"):
        LLMEngine(EngineConfig(**cfg, gpu_memory_utilization=1e-6))
