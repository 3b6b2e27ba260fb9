"""The prompt-size bound never refuses a prompt that fits (random texts through real tokenizers:
the tiny byte-level BPE and, when present, SmolLM2's), and the tokenizer lanes: a full large lane
refuses at once while the small lane still runs."""

from __future__ import annotations

import asyncio
import random
import threading

import pytest

from specserve.server.openai_routes import TokenRenderer
from specserve.server.prompt_guard import LaneFull, PromptBound, TokenizerLanes, default_body_limit, text_bytes

PIECES = ["a ", "word ", " ", "\n", "    ", "\n" + " " * 80, "é", "日本語", "🙂", "<|im_start|>", "<|endoftext|>",
          "def f(x):\n    return x\n", "1234567890", "ab" * 20, "\t\t", "Ġ", "\u200b"]


def random_texts(n: int, seed: int = 0):
    rng = random.Random(seed)
    for _ in range(n):
        yield "".join(rng.choice(PIECES) * rng.randint(1, 30) for _ in range(rng.randint(1, 40)))


def check_bound(tokenizer):
    renderer = TokenRenderer(tokenizer)
    bound = PromptBound(tokenizer, lambda i: renderer.render(i)[1])
    loose = PromptBound(tokenizer)                      # without exact token bytes: never tighter
    assert loose.max_token_bytes >= bound.max_token_bytes >= 1
    tight = 0
    for text in random_texts(300):
        n = len(tokenizer.encode(text, add_special_tokens=False))
        least = bound.min_tokens(text_bytes([text]))
        assert least <= n, (text[:80], least, n)
        tight += least * 2 >= n
    return bound, tight


def test_the_bound_holds_for_the_tiny_tokenizer(tiny_llama_dir):
    from transformers import AutoTokenizer

    bound, _ = check_bound(AutoTokenizer.from_pretrained(tiny_llama_dir))
    assert default_body_limit(512, bound) == 2**20          # small contexts: the 1 MiB floor


@pytest.mark.slow
def test_the_bound_holds_for_smollm2(default_model):
    bound, tight = check_bound(default_model.tokenizer)
    assert bound.max_token_bytes == 81                       # a newline and 80 spaces
    assert 2 * 2**20 < default_body_limit(8192, bound) < 3 * 2**20
    assert tight > 0                                         # whitespace runs come close to it


def test_a_full_large_lane_refuses_and_the_small_lane_runs_on():
    lanes = TokenizerLanes(small_threads=1, large_threads=1, large_depth=2, small_bytes=100)
    release = threading.Event()

    async def scenario():
        held = [asyncio.ensure_future(lanes.run(1000, release.wait, 10)) for _ in range(2)]
        await asyncio.sleep(0.05)
        with pytest.raises(LaneFull):
            await lanes.run(1000, lambda: "never")
        assert await asyncio.wait_for(lanes.run(10, lambda: "small"), 2) == "small"
        release.set()
        assert await asyncio.gather(*held) == [True, True]
        assert await lanes.run(1000, lambda: "large again") == "large again"

    try:
        asyncio.run(scenario())
    finally:
        lanes.shutdown()
