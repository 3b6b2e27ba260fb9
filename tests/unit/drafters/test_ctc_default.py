"""The CTC drafter on the embedded SmolLM2-135M with its shipped checkpoint (fp32): found by the
target's fingerprint, greedy output identical to plain decoding for chat prompts arriving at
different steps, and drafts that get accepted."""

from __future__ import annotations

import pytest
from helpers import run_requests

from specserve.engine.config import EngineConfig
from specserve.engine.core import LLMEngine
from specserve.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number, then call it for n = 10.",
    "What is the capital of France?",
    "List three colours of the rainbow, then list them again in reverse order.",
    "Explain in two sentences why the sky is blue.",
]


def run_staggered(engine: LLMEngine, prompts: list[list[int]], drafter: str, max_tokens: int) -> list[list[int]]:
    """Greedy requests drafted by `drafter`, one added every third step; outputs in prompt order."""
    got = run_requests(engine, prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens), every=3,
                       prefix=f"{drafter}-", drafter=drafter)
    return [got[f"{drafter}-{i}"] for i in range(len(prompts))]


def test_shipped_checkpoint_reproduces_plain_greedy_decoding(default_model):
    engine = LLMEngine(EngineConfig(model="default", dtype="float32", device="cpu", max_num_seqs=4, max_model_len=512,
                                    drafters=("none", "ctc"), num_speculative_tokens=8, max_draft_tokens_per_step=32,
                                    draft_budget="fixed"), loaded=default_model)
    drafter = engine.drafters["ctc"]
    assert drafter.checkpoint_meta is not None and drafter.checkpoint_meta.kind == "ctc"   # the shipped one
    assert drafter.vocab.size == drafter.checkpoint_meta.hyperparams["vocab"]
    tok = engine.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, return_dict=False) for p in PROMPTS]
    plain = run_staggered(engine, prompts, "none", 40)
    assert all(len(t) > 5 for t in plain)
    assert run_staggered(engine, prompts, "ctc", 40) == plain
    stats = engine.drafter_stats["ctc"]
    assert stats.num_fallbacks == 0
    assert stats.num_accepted_tokens > 0.2 * stats.num_steps           # a trained drafter: drafts get accepted
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
