"""The `student` drafter through the engine: greedy output equals plain decoding (chains and MCSD
trees, a batch arriving at different steps). Its sampled law rides the draft-model machinery
tested in tests/unit/engine/test_sampling_lossless.py."""

from __future__ import annotations

import pytest
import torch

from specserve.engine.config import EngineConfig
from specserve.engine.core import LLMEngine
from specserve.engine.sampling_params import SamplingParams


def engine_with(tiny_llama_dir, drafters=(), options=None) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", device="cpu", max_num_seqs=8,
                                  block_size=4, max_num_batched_tokens=128, num_kv_blocks=400, max_model_len=128,
                                  drafters=tuple(drafters), drafter_options=options or {}, num_speculative_tokens=12,
                                  draft_budget="fixed"))


def run(engine, prompts, params) -> dict[str, list[int]]:
    got: dict[str, list[int]] = {}
    pending = list(enumerate(prompts))
    while pending or engine.has_unfinished_requests():
        if pending:   # one new request per step: they arrive at different steps
            i, p = pending.pop(0)
            engine.add_request(f"r{i}", p, params)
        for out in engine.step():
            for d in out.outputs:
                got.setdefault(out.request_id, []).extend(d.token_ids)
    return got


@pytest.mark.parametrize("k_config", ["chain:3", "2,2,1"])
def test_student_greedy_is_lossless(tiny_llama_dir, k_config):
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (6, 14, 25)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = run(engine_with(tiny_llama_dir), prompts, params)
    eng = engine_with(tiny_llama_dir, ["student"], {"student": {"random_init": True, "num_layers": 1,
                                                                "k_config": k_config}})
    assert run(eng, prompts, params) == plain
    stats = eng.get_stats().drafters["student"]
    assert stats.num_steps > 0 and stats.num_fallbacks == 0
