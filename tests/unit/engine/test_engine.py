"""The engine end to end (no HTTP): greedy output equals transformers `generate` token for token,
with requests arriving at different steps; KV blocks all return; seeded sampling reproduces;
aborts free their KV; the async wrapper streams and aborts, its step loop the one OpenMP team."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest
import torch

from specserve.engine.async_engine import AsyncEngine
from specserve.engine.config import EngineConfig
from specserve.engine.core import LLMEngine
from specserve.engine.errors import InvalidRequestError, QueueFullError
from specserve.engine.sampling_params import SamplingParams
from specserve.kernels import cpu


def hf_greedy(hf_model, prompt: list[int], max_new: int, eos: list[int]) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                max_new_tokens=max_new, do_sample=False, eos_token_id=eos, pad_token_id=eos[0])
    return out[0, len(prompt):].tolist()


def drain(engine: LLMEngine, max_steps: int = 10_000) -> dict[str, dict[int, list[int]]]:
    tokens: dict[str, dict[int, list[int]]] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return tokens
        for out in engine.step():
            for d in out.outputs:
                tokens.setdefault(out.request_id, {}).setdefault(d.index, []).extend(d.token_ids)
    raise AssertionError("engine did not finish")


def staggered_greedy_matches_hf(engine: LLMEngine, hf_model, prompts: list[list[int]], max_new: int):
    """Requests join at different steps; every output must equal HF generate's."""
    eos = sorted(engine.eos_token_ids)
    expected = [hf_greedy(hf_model, p, max_new, eos) for p in prompts]
    got: dict[str, list[int]] = {}
    pending = list(enumerate(prompts))
    step = 0
    while pending or engine.has_unfinished_requests():
        # one new request every other step
        if pending and step % 2 == 0:
            i, p = pending.pop(0)
            engine.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=max_new))
        for out in engine.step():
            for d in out.outputs:
                got.setdefault(out.request_id, []).extend(d.token_ids)
        step += 1
        assert step < 10_000
    for i, exp in enumerate(expected):
        assert got[f"r{i}"] == exp, f"prompt {i} diverged"
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_tiny_llama_greedy_equals_hf_generate(tiny_llama_dir):
    import transformers
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, torch_dtype=torch.float32).eval()
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", device="cpu", max_num_seqs=4,
                                    max_num_batched_tokens=24, block_size=4, num_kv_blocks=64, max_model_len=128))
    g = torch.Generator().manual_seed(0)
    vocab = engine.model_config.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 31, 12, 3, 50, 8, 17, 26, 9)]
    staggered_greedy_matches_hf(engine, hf, prompts, max_new=20)


@pytest.mark.slow
def test_smollm2_greedy_equals_hf_generate(default_model):
    import transformers
    hf = transformers.LlamaForCausalLM(default_model.hf_config)
    hf.load_state_dict(default_model.state_dict, strict=False)
    hf.tie_weights()
    hf.eval()
    # the dequantized fp32 weights transformers computes with (the default serves the GGUF's int4)
    engine = LLMEngine(EngineConfig(dtype="float32", device="cpu", max_num_seqs=8, max_num_batched_tokens=64,
                                    max_model_len=512, quantization="none"), loaded=default_model)
    tok = default_model.tokenizer
    questions = ["What is the capital of France?", "Write a haiku about autumn.", "Explain gravity to a child.",
                 "List three prime numbers.", "def fibonacci(n):", "Translate 'good morning' to Spanish.",
                 "Why is the sky blue?", "Give me a recipe for pancakes.", "What is 17 times 3?"]
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, return_dict=False) for q in questions]
    staggered_greedy_matches_hf(engine, hf, prompts, max_new=24)


@pytest.fixture(scope="module")
def tiny_engine(tiny_llama_dir):
    return LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", device="cpu", max_num_seqs=4,
                                  max_num_batched_tokens=32, block_size=4, num_kv_blocks=48, max_model_len=96))


def test_seeded_sampling_is_reproducible_and_n_choices_differ(tiny_engine):
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=12, n=3, ignore_eos=True)
    tiny_engine.add_request("a", [5, 6, 7, 8], params)
    first = drain(tiny_engine)["a"]
    # the same seed in a different batch composition gives the same tokens
    tiny_engine.add_request("noise", [9, 9, 9], SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True))
    tiny_engine.add_request("b", [5, 6, 7, 8], params)
    second = drain(tiny_engine)["b"]
    assert first == second
    assert len({tuple(v) for v in first.values()}) > 1, "n choices of one seeded request should differ"


def test_abort_and_preemption_return_every_block(tiny_engine):
    eng = tiny_engine
    for i in range(6):
        eng.add_request(f"p{i}", list(range(3, 3 + 20 + i)), SamplingParams(temperature=0.0, max_tokens=60,
                                                                             ignore_eos=True))
    for _ in range(12):
        eng.step()
    eng.abort_request("p0")
    eng.abort_request("p5")
    outs = drain(eng)
    assert "p1" in outs
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks
    assert not eng.scheduler.running and not eng.scheduler.waiting


def test_preempted_sequences_still_match_unpreempted_output(tiny_llama_dir):
    """A pool too small for everyone forces recomputation; greedy output must not change."""
    cfg = dict(model=str(tiny_llama_dir), dtype="float32", device="cpu", max_num_seqs=4, block_size=4,
               max_num_batched_tokens=64, max_model_len=64)
    small = LLMEngine(EngineConfig(**cfg, num_kv_blocks=20))
    big = LLMEngine(EngineConfig(**cfg, num_kv_blocks=200))
    prompts = {f"q{i}": list(range(4 + i, 20 + i)) for i in range(4)}
    results = []
    for eng in (small, big):
        for rid, p in prompts.items():
            eng.add_request(rid, p, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
        results.append(drain(eng))
    assert small.scheduler.num_preemptions > 0
    assert results[0] == results[1]


def test_invalid_requests_are_rejected_without_side_effects(tiny_engine):
    with pytest.raises(InvalidRequestError):
        tiny_engine.add_request("long", list(range(3, 100)), SamplingParams(max_tokens=10))
    with pytest.raises(InvalidRequestError):
        tiny_engine.add_request("empty", [], SamplingParams(max_tokens=10))
    with pytest.raises(InvalidRequestError):
        tiny_engine.add_request("oov", [10**7], SamplingParams(max_tokens=10))
    assert not tiny_engine.has_unfinished_requests()


def test_async_engine_streams_and_aborts(tiny_llama_dir):
    engine = AsyncEngine(LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", device="cpu",
                                                max_num_seqs=2, block_size=4, num_kv_blocks=64,
                                                max_model_len=96, max_queue_len=2)))
    engine.start()

    async def main():
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        outs = [o async for o in engine.add_request("s1", [4, 5, 6], params)]
        assert outs[-1].finished and sum(len(d.token_ids) for o in outs for d in o.outputs) == 8
        # abort mid-stream: the stream ends with finish_reason "abort" and the KV is freed
        long = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)
        stream = engine.add_request("s2", [4, 5, 6], long)
        await stream.__anext__()
        await stream.aclose()
        for _ in range(200):
            stats = engine.get_stats()
            if stats.num_running == 0 and stats.num_free_blocks == stats.num_total_blocks:
                break
            await asyncio.sleep(0.02)
        assert stats.num_running == 0 and stats.num_free_blocks == stats.num_total_blocks
        # queue limit: two waiting at most
        with pytest.raises(QueueFullError):
            for i in range(10):
                engine.add_request(f"q{i}", [4, 5], long)
        for i in range(10):
            engine.abort(f"q{i}")

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()


_ONE_TEAM_CHILD = """
import asyncio, json, os, sys, time
import torch
import specserve.engine.async_engine as async_engine
from specserve.engine.config import EngineConfig
from specserve.engine.core import LLMEngine
from specserve.engine.sampling_params import SamplingParams
if sys.argv[2] == "keep":   # the broken variant: the starting thread keeps its team
    async_engine.release_thread_team = lambda: False
threads = lambda: len(os.listdir("/proc/self/task"))
engine = async_engine.AsyncEngine(LLMEngine(EngineConfig(model=sys.argv[1], dtype="float32", device="cpu")))
torch.ones(1 << 22).sum()             # a parallel region on this thread: it holds an OpenMP team
before = threads()
async def run():
    engine.start()
    async for _ in engine.generate("r", [4, 5, 6], SamplingParams(max_tokens=4, temperature=0.0)):
        pass
asyncio.run(run())
time.sleep(0.2)
print(json.dumps({"added": threads() - before}))
engine.shutdown()
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts the threads in /proc")
@pytest.mark.parametrize("variant", ["release", "keep"])
def test_the_step_loop_holds_the_only_openmp_team(tiny_llama_dir, tmp_path, variant):
    """The thread that starts the engine gives back its OpenMP team, so that libgomp, managing no
    more threads than cores, keeps the step loop's workers spinning between parallel regions: with
    two OpenMP threads, starting and running the engine adds the loop thread and its worker and
    removes the starter's worker (one thread more); the broken variant keeps it (two more)."""
    if not cpu.release_thread_team():
        pytest.skip("the OpenMP runtime here is not libgomp")
    script = tmp_path / "child.py"
    script.write_text(_ONE_TEAM_CHILD)
    proc = subprocess.run([sys.executable, str(script), str(tiny_llama_dir), variant], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    added = json.loads(proc.stdout.strip().splitlines()[-1])["added"]
    assert added == (1 if variant == "release" else 2)


def _admission_engine(tiny_llama_dir, **config) -> AsyncEngine:
    config = {"max_num_seqs": 8, "block_size": 4, "num_kv_blocks": 64, "max_model_len": 96, "max_queue_len": 2,
              **config}
    return AsyncEngine(LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", device="cpu", **config)))


def test_admission_takes_a_burst_into_free_slots(tiny_llama_dir):
    """Requests that free slots and KV room can take are not queued: max_num_seqs + max_queue_len
    added at once (the loop not even started) are all taken; the next is refused with a Retry-After."""
    engine = _admission_engine(tiny_llama_dir)
    long = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)

    async def main():
        for i in range(8 + 2):
            engine.add_request(f"b{i}", [4, 5, 6], long)
        assert engine.admission() == {"free_slots": 0, "free_blocks": 64 - 8 * 1, "queued": 2}
        with pytest.raises(QueueFullError) as exc:
            engine.add_request("over", [4, 5, 6], long)
        assert exc.value.retry_after is not None and exc.value.retry_after >= 1
        assert "over" not in engine._streams

    asyncio.run(main())


def test_a_burst_is_waiting_in_the_stats_before_the_loop_sees_it(tiny_llama_dir):
    """Once: 32 requests arriving during a long step showed as 0 waiting until that step ended."""
    engine = _admission_engine(tiny_llama_dir, max_queue_len=16)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

    async def main():
        for i in range(12):
            engine.add_request(f"w{i}", [4, 5, 6], params)
        assert engine.get_stats().num_waiting == 12     # the loop not started: every request still pending

    asyncio.run(main())


def test_admission_counts_kv_room_and_choices(tiny_llama_dir):
    """A prompt the free pool cannot hold yet is queued even with slots free, and so is every request
    behind it (the scheduler admits first come first served); a request's n choices take n slots."""
    engine = _admission_engine(tiny_llama_dir)   # 64 blocks of 4 tokens
    big = list(range(4, 64))                     # 60 tokens + 1: 16 blocks
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    async def main():
        for i in range(4):
            engine.add_request(f"big{i}", big, params)
        assert engine.admission() == {"free_slots": 4, "free_blocks": 0, "queued": 0}
        engine.add_request("big4", big, params)
        engine.add_request("small", [4, 5], params)   # would fit, but waits behind big4
        assert engine.admission()["queued"] == 2
        with pytest.raises(QueueFullError):
            engine.add_request("small2", [4, 5], params)

    asyncio.run(main())
    engine = _admission_engine(tiny_llama_dir, max_queue_len=1)

    async def choices():
        engine.add_request("n6", [4, 5], SamplingParams(temperature=1.0, max_tokens=8, n=6))
        assert engine.admission()["free_slots"] == 2
        engine.add_request("n3", [4, 5], SamplingParams(temperature=1.0, max_tokens=8, n=3))   # 3 > 2 free: queued
        assert engine.admission()["queued"] == 1
        with pytest.raises(QueueFullError):
            engine.add_request("n1", [4, 5], SamplingParams(temperature=1.0, max_tokens=8))

    asyncio.run(choices())


def test_admission_recounts_from_the_scheduler(tiny_llama_dir):
    """The loop recounts after every step: while the burst runs, free slots + running = max_num_seqs;
    once it has finished, every slot and block is free again and nothing is queued."""
    engine = _admission_engine(tiny_llama_dir, max_num_seqs=2)
    engine.start()
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)

    async def main():
        streams = [engine.add_request(f"r{i}", [4, 5, 6], params) for i in range(4)]
        with pytest.raises(QueueFullError):
            engine.add_request("r4", [4, 5, 6], params)
        first = await streams[0].__anext__()
        assert first.outputs and engine.admission()["free_slots"] == 0
        for stream in streams:
            async for _ in stream:
                pass
        for _ in range(100):
            if engine.admission() == {"free_slots": 2, "free_blocks": 64, "queued": 0}:
                break
            await asyncio.sleep(0.02)
        assert engine.admission() == {"free_slots": 2, "free_blocks": 64, "queued": 0}
        assert 1 <= engine.retry_after() <= AsyncEngine.MAX_RETRY_AFTER_S

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()


@pytest.mark.parametrize("prepack", [True, False])
def test_engine_prepacks_cpu_weights_unless_told_not_to(tiny_llama_dir, prepack):
    """On the CPU the engine prepacks the target's projections and LM head and the drafters' own
    decoder layers (here a 1-layer draft model loaded from a folder), and leaves them as they are
    with `prepack_weights=False`; greedy outputs are the same either way."""
    from specserve.engine.model import _PACK_DTYPES

    if torch.float32 not in _PACK_DTYPES:
        pytest.skip("oneDNN cannot prepack fp32 weights with this torch on this CPU")
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", device="cpu", max_num_seqs=2,
                                    block_size=4, num_kv_blocks=48, max_model_len=96, drafters=("draft_model",),
                                    drafter_options={"draft_model": {"draft_model": str(tiny_llama_dir)}},
                                    prepack_weights=prepack))
    target, draft = engine.model, engine.drafters["draft_model"].model
    assert draft is not target and draft.layers[0] is not target.layers[0]
    weights = [w for m in (target, draft) for layer in m.layers
               for w in (layer.qkv.weight, layer.o.weight, layer.gate_up.weight, layer.down.weight)]
    assert all(hasattr(w, "_specserve_packed") == prepack for w in weights + [target.lm_head_weight])
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    engine.add_request("spec", [5, 6, 7, 8, 5, 6, 7], params, drafter="draft_model")
    engine.add_request("plain", [5, 6, 7, 8, 5, 6, 7], params, drafter="none")
    out = drain(engine)
    assert out["spec"] == out["plain"] and len(out["spec"][0]) == 16
    assert engine.drafter_stats["draft_model"].num_draft_tokens > 0


def test_each_step_samples_with_the_settings_of_the_requests_in_it(tiny_engine):
    """One row, then one row of another request with other settings: each is sampled with its own
    (the runner reuses the last step's sampling tensors only for the same requests)."""
    sampled = SamplingParams(temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    tiny_engine.add_request("s0", [5, 6, 7, 8], sampled)
    sampled_alone = drain(tiny_engine)["s0"][0]
    tiny_engine.add_request("g0", [5, 6, 7, 8], greedy)
    greedy_alone = drain(tiny_engine)["g0"][0]
    assert sampled_alone != greedy_alone
    for k in range(2):
        tiny_engine.add_request(f"s{k + 1}", [5, 6, 7, 8], SamplingParams(temperature=1.0, seed=7, max_tokens=8,
                                                                         ignore_eos=True))
        assert drain(tiny_engine)[f"s{k + 1}"][0] == sampled_alone
        tiny_engine.add_request(f"g{k + 1}", [5, 6, 7, 8], greedy)
        assert drain(tiny_engine)[f"g{k + 1}"][0] == greedy_alone
