"""The shipped falcon checkpoint on the embedded SmolLM2-135M (fp32): found by the target's
fingerprint, carrying its tree, and greedy output identical to plain decoding with drafts accepted,
for staggered chat prompts through one engine. (Deep acceptance is the trained-head tests' job: the
CPU-trained shipped head rarely gets a block's second token right.)"""

from __future__ import annotations

import pytest

from specserve.engine.config import EngineConfig
from specserve.engine.core import LLMEngine
from specserve.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number, then call it for n = 10.",
    "What is the capital of France?",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "List three colours of the rainbow, then list them again in reverse order.",
]


def run(engine: LLMEngine, prompts: list[list[int]], drafter: str) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=32)
    got: dict[str, list[int]] = {}
    pending, step = list(enumerate(prompts)), 0
    while pending or engine.has_unfinished_requests():
        if pending and step % 2 == 0:
            i, p = pending.pop(0)
            engine.add_request(f"{drafter}-{i}", p, params, drafter=drafter)
        for out in engine.step():
            for d in out.outputs:
                got.setdefault(out.request_id, []).extend(d.token_ids)
        step += 1
    return [got[f"{drafter}-{i}"] for i in range(len(prompts))]


def test_shipped_checkpoint_reproduces_plain_greedy_decoding(default_model):
    engine = LLMEngine(EngineConfig(model="default", dtype="float32", device="cpu", max_num_seqs=4,
                                    max_model_len=512, drafters=("none", "falcon"), num_speculative_tokens=12,
                                    max_draft_tokens_per_step=48, draft_budget="fixed"), loaded=default_model)
    drafter = engine.drafters["falcon"]
    meta = drafter.checkpoint_meta
    assert meta is not None and meta.kind == "falcon" and meta.target_name.startswith("SmolLM2")
    assert meta.tree and drafter.tree_name == meta.tree["name"] and drafter.order == meta.tree["order"]
    assert drafter.vocab.size == 8192                        # the default draft vocabulary, from its ranking
    tok = engine.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, return_dict=False) for p in PROMPTS]
    plain = run(engine, prompts, "none")
    assert all(len(t) > 5 for t in plain) and sum(map(len, plain)) > 60
    assert run(engine, prompts, "falcon") == plain
    stats = engine.drafter_stats["falcon"]
    assert stats.num_fallbacks == 0 and stats.num_accepted_tokens > 0.2 * sum(len(t) for t in plain)
    assert stats.accepted_by_depth and stats.accepted_by_depth[0] > 0
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    assert drafter.blocks.num_free_blocks == drafter.blocks.num_blocks
