"""A step that raises fails only the requests that cause it; the engine goes on.

Faults are injected by wrapping the real parts (the model runner, the scheduler, a detokenizer, a
drafter) so that they raise for one marked request; everything else runs as in production. Each test
checks that the marked request ends with finish_reason "error" and an error message, that the other
requests produce exactly what a fault-free run produces (greedy, fp32), and that every KV block is free
at the end.
"""

from __future__ import annotations

import pytest
import torch

from helpers import make_llm_engine, step_and_collect

from specserve.engine.errors import InvalidRequestError, RequestFailedError, is_unrecoverable
from specserve.engine.sampling_params import SamplingParams

PROMPTS = {"a": [5, 6, 7, 8, 9], "bad": [10, 11, 12], "b": [20, 21, 22, 23], "c": [7, 8, 9, 7, 8, 9, 7]}
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


class InjectedFault(RuntimeError):
    pass


def _run(engine, prompts=PROMPTS, params=GREEDY, drafter=None):
    """Add every prompt (one per step), step until done; id -> (tokens, finish reason, error)."""
    got: dict[str, list[int]] = {}
    finish: dict[str, tuple[str | None, str | None]] = {}
    pending = list(prompts.items())
    steps = 0
    while pending or engine.has_unfinished_requests():
        if pending:
            rid, prompt = pending.pop(0)
            engine.add_request(rid, prompt, params, **({} if drafter is None else {"drafter": drafter}))
        for out in engine.step():
            for d in out.outputs:
                got.setdefault(out.request_id, []).extend(d.token_ids)
                if d.finish_reason:
                    finish[out.request_id] = (d.finish_reason, out.error)
        steps += 1
        assert steps < 2000
    return {rid: (got.get(rid, []), *finish[rid]) for rid in prompts}


def _is_bad(seq) -> bool:
    return seq.request.request_id == "bad"


def _is_bad_view(seq) -> bool:
    """`_is_bad` for what a drafter sees (a DraftRequest: the tokens, not the request)."""
    return tuple(seq.token_ids[:seq.num_prompt_tokens]) == tuple(PROMPTS["bad"])


@pytest.fixture(scope="module")
def clean(tiny_llama_dir):
    """The fault-free outputs of PROMPTS (greedy)."""
    return _run(make_llm_engine(tiny_llama_dir))


def _check(results, clean, engine, failed=("bad",)):
    for rid, (tokens, reason, error) in results.items():
        if rid in failed:
            assert reason == "error" and error and "InjectedFault" in error, (rid, reason, error)
        else:
            assert (tokens, reason, error) == clean[rid], rid
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    assert not engine.has_unfinished_requests()
    stats = engine.get_stats()
    assert stats.num_failed_requests_total == len(failed)


def test_a_forward_that_raises_for_one_request_fails_only_that_request(tiny_llama_dir, clean):
    engine = make_llm_engine(tiny_llama_dir)
    execute = engine.runner.execute
    calls = {"n": 0}

    def faulty(batch, *args, **kwargs):
        calls["n"] += 1
        if any(_is_bad(s) for s in batch.seqs) and calls["n"] > 3:   # mid-decode, not at its prefill
            raise InjectedFault("the forward broke")
        return execute(batch, *args, **kwargs)

    engine.runner.execute = faulty
    results = _run(engine)
    _check(results, clean, engine)
    assert 0 < len(results["bad"][0]) < GREEDY.max_tokens    # it streamed some tokens, then failed
    assert engine.get_stats().num_step_failures_total >= 1


def test_a_fault_that_needs_the_whole_batch_fails_nobody(tiny_llama_dir, clean):
    """A forward that raises only for batches of several sequences (say, out of memory) is retried one
    sequence at a time: slower for that step, and nothing is lost."""
    engine = make_llm_engine(tiny_llama_dir)
    execute = engine.runner.execute
    raised = {"n": 0}

    def faulty(batch, *args, **kwargs):
        if len(batch.seqs) >= 3 and raised["n"] < 5:
            raised["n"] += 1
            raise InjectedFault("too big")
        return execute(batch, *args, **kwargs)

    engine.runner.execute = faulty
    _check(_run(engine), clean, engine, failed=())
    assert engine.get_stats().num_step_failures_total == raised["n"] == 5


def test_a_scheduling_fault_fails_only_that_request(tiny_llama_dir, clean):
    engine = make_llm_engine(tiny_llama_dir)
    admit = engine.scheduler._admit

    def faulty(batch, seq, budget):
        if _is_bad(seq):
            raise InjectedFault("cannot schedule")
        return admit(batch, seq, budget)

    engine.scheduler._admit = faulty
    results = _run(engine)
    _check(results, clean, engine)
    assert results["bad"][0] == []


def test_a_fault_while_committing_tokens_fails_only_that_request(tiny_llama_dir, clean):
    engine = make_llm_engine(tiny_llama_dir)
    add_request = engine.add_request

    def add(request_id, prompt, params, *args, **kwargs):
        add_request(request_id, prompt, params, *args, **kwargs)
        if request_id == "bad":
            detok = engine.requests["bad"].seqs[0].detokenizer
            real = detok.add_tokens

            def add_tokens(tokens):
                if len(detok_calls) >= 2:
                    raise InjectedFault("detokenizer broke")
                detok_calls.append(tokens)
                return real(tokens)
            detok_calls: list = []
            detok.add_tokens = add_tokens

    engine.add_request = add
    results = _run(engine)
    _check(results, clean, engine)
    assert len(results["bad"][0]) == 3   # two tokens were emitted, the third one broke


def test_a_verification_fault_falls_back_to_plain_decoding(tiny_llama_dir, clean):
    """A forward that raises whenever it carries a draft tree (a drafter handing out something the
    verifier cannot take) costs speculation, not output: every request still equals plain decoding."""
    engine = make_llm_engine(tiny_llama_dir, drafters=("ngram",))
    execute = engine.runner.execute
    raised = {"n": 0}

    def faulty(batch, trees=None, *args, **kwargs):
        if trees:
            raised["n"] += 1
            raise InjectedFault("verification broke")
        return execute(batch, trees, *args, **kwargs)

    engine.runner.execute = faulty
    _check(_run(engine, drafter="ngram"), clean, engine, failed=())
    assert raised["n"] > 0


def test_a_drafter_failing_to_start_means_plain_decoding(tiny_llama_dir, clean):
    engine = make_llm_engine(tiny_llama_dir, drafters=("ngram",))
    drafter = engine.drafters["ngram"]
    start = drafter.start

    def faulty(seq):
        if _is_bad_view(seq):
            raise InjectedFault("start broke")
        start(seq)

    drafter.start = faulty
    _check(_run(engine, drafter="ngram"), clean, engine, failed=())
    assert engine.get_stats().drafters["ngram"].num_fallbacks == 1   # the marked request's only


def test_an_unrecoverable_device_error_escapes_the_step(tiny_llama_dir):
    engine = make_llm_engine(tiny_llama_dir)

    def broken(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    engine.runner.execute = broken
    engine.add_request("r", PROMPTS["a"], GREEDY)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        engine.step()


@pytest.mark.parametrize("exc, fatal", [
    (RuntimeError("CUDA error: device-side assert triggered"), True),
    (RuntimeError("CUBLAS_STATUS_EXECUTION_FAILED when calling cublasGemmEx"), True),
    (KeyboardInterrupt(), True),
    (RuntimeError("Overflow when unpacking long long"), False),
    (ValueError("Overflow when unpacking long long"), False),
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), False),
    (IndexError("index out of range in self"), False),
])
def test_unrecoverable_errors_are_device_faults_only(exc, fatal):
    assert is_unrecoverable(exc) is fatal


def test_a_top_k_beyond_int32_is_refused_at_the_engine_edge():
    """The request that once killed the engine loop (top_k packed into an int64 tensor overflowed)."""
    with pytest.raises(InvalidRequestError) as exc:
        SamplingParams(temperature=0.8, top_k=9223372036854775808)
    assert exc.value.param == "top_k"
    assert SamplingParams(temperature=0.8, top_k=2**31 - 1).top_k == 2**31 - 1


def test_async_engine_raises_the_failure_in_that_request_stream_only(tiny_llama_dir):
    import asyncio

    from helpers import make_llm_engine as make

    from specserve.engine.async_engine import AsyncEngine

    llm = make(tiny_llama_dir)
    execute = llm.runner.execute

    def faulty(batch, *args, **kwargs):
        if any(_is_bad(s) for s in batch.seqs):
            raise InjectedFault("the forward broke")
        return execute(batch, *args, **kwargs)

    llm.runner.execute = faulty
    engine = AsyncEngine(llm)
    engine.start()

    async def consume(rid):
        tokens = []
        try:
            async for out in engine.generate(rid, PROMPTS[rid], GREEDY):
                for d in out.outputs:
                    tokens.extend(d.token_ids)
        except RequestFailedError as exc:
            return "failed", str(exc)
        return "ok", tokens

    async def main():
        return await asyncio.gather(*(consume(rid) for rid in PROMPTS))

    try:
        results = dict(zip(PROMPTS, asyncio.run(main())))
    finally:
        engine.shutdown()
    assert results["bad"][0] == "failed" and "InjectedFault" in results["bad"][1]
    assert all(results[rid][0] == "ok" and len(results[rid][1]) == GREEDY.max_tokens for rid in ("a", "b", "c"))
    assert engine.is_alive is False and not engine.dead.is_set()   # shut down, not dead


def test_auto_goes_on_without_a_drafter_that_fails(tiny_llama_dir, clean):
    """drafter auto on the tiny model (ngram, mag): mag raises in every propose, and ngram cannot
    start the marked request. Every request still gets its fault-free tokens; the failures are
    fallbacks, ngram's trees are still verified."""
    engine = make_llm_engine(tiny_llama_dir, drafters=("auto",), drafter_options={"mag": {"bigram": False}},
                             draft_budget="goodput")
    assert engine.auto_drafters == ("ngram", "mag")
    ngram, mag = engine.drafters["ngram"], engine.drafters["mag"]
    start = ngram.start

    def faulty_start(seq):
        if _is_bad_view(seq):
            raise InjectedFault("start broke")
        start(seq)

    def faulty_propose(seqs, budgets):
        raise InjectedFault("propose broke")

    ngram.start, mag.propose = faulty_start, faulty_propose
    _check(_run(engine, drafter="auto"), clean, engine, failed=())
    stats = engine.get_stats().drafters
    assert stats["ngram"].num_fallbacks == 1 and stats["mag"].num_fallbacks >= 1
    assert stats["ngram"].num_steps > 0
