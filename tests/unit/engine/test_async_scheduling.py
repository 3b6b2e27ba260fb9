"""Async scheduling (`EngineConfig.async_scheduling`): a step of plain decodes launches the next one
before the host reads its tokens. On the CPU it is off by default and forced on here; its outputs must
be the synchronous engine's token for token (greedy and seeded sampling, logprobs, stop rules, aborts,
requests arriving mid-decode, drafters and grammars beside it, a short KV pool), and steps must
actually have run ahead where the batch allows it."""

from __future__ import annotations

import pytest
import torch

from helpers import make_llm_engine
from specserve.engine.sampling_params import SamplingParams

PROMPTS = [[5, 17, 33, 8, 90, 41], [7, 7, 12], [100, 3, 55, 21, 9, 14, 60, 2, 77], [11, 250]]


def drain(engine, arrivals: dict[int, list[tuple]] | None = None, aborts: dict[int, str] | None = None,
          max_steps: int = 2000) -> dict[str, dict]:
    """Step until done; `arrivals[step]`: (request id, prompt, params[, drafter]) added before that
    step; `aborts[step]`: a request id aborted before it. Returns request id -> index -> what came out."""
    arrivals, aborts = arrivals or {}, aborts or {}
    got: dict[str, dict] = {}
    last = max([*arrivals, *aborts, 0])
    for step in range(max_steps):
        for args in arrivals.get(step, []):
            engine.add_request(*args[:3], drafter=args[3]) if len(args) > 3 else engine.add_request(*args)
        if step in aborts:
            engine.abort_request(aborts[step])
        if step > last and not engine.has_unfinished_requests():
            return got
        for out in engine.step():
            for d in out.outputs:
                o = got.setdefault(out.request_id, {}).setdefault(d.index, {"ids": [], "text": "", "lp": []})
                o["ids"] += d.token_ids
                o["text"] += d.text
                o["lp"] += [(lp.token_id, round(lp.logprob, 5), [t for t, _ in lp.top]) for lp in d.logprobs or []]
                if d.finish_reason is not None:
                    o["finish"] = (d.finish_reason, d.stop_reason)
    raise AssertionError("the engine did not finish")


def both(model_dir, scenario, **config):
    """(synchronous outputs, async outputs, the async engine's stats) of `scenario(engine)`."""
    sync = scenario(make_llm_engine(model_dir, async_scheduling=False, **config))
    engine = make_llm_engine(model_dir, async_scheduling=True, **config)
    return sync, scenario(engine), engine.get_stats()


def test_greedy_and_stop_rules_match_the_synchronous_engine(tiny_llama_dir):
    def scenario(engine):
        arrivals = {0: [("a", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))],
                    1: [("b", PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=1))],
                    2: [("c", PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=30, logprobs=2, n=2,
                                                        ignore_eos=True))],
                    9: [("d", PROMPTS[3], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))]}
        return drain(engine, arrivals)

    sync, got, stats = both(tiny_llama_dir, scenario)
    assert got == sync
    assert [len(got["a"][0]["ids"]), len(got["b"][0]["ids"]), len(got["d"][0]["ids"])] == [24, 1, 2]
    assert got["c"][0]["lp"] and len(got["c"]) == 2
    assert stats.num_async_steps_total > 20     # most decode steps ran ahead


def test_stop_tokens_and_strings_end_on_the_same_token(tiny_llama_dir):
    """A sequence ended by its token (a stop token id, a stop string) after the next step was launched:
    that step's row is dropped, nothing after the stop is emitted."""
    free = make_llm_engine(tiny_llama_dir, async_scheduling=False)
    ids = drain(free, {0: [("x", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))]})
    ids = ids["x"][0]["ids"]
    stop_id = ids[6]
    text = free.tokenizer.decode(ids[:12])

    def scenario(engine):
        return drain(engine, {0: [("t", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=20,
                                                                   stop_token_ids=[stop_id], ignore_eos=True)),
                                  ("s", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=20,
                                                                   stop=[text[-3:]], ignore_eos=True)),
                                  ("long", PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=20,
                                                                      ignore_eos=True))]})

    sync, got, stats = both(tiny_llama_dir, scenario)
    assert got == sync
    assert got["t"][0]["finish"] == ("stop", stop_id) and got["t"][0]["ids"][-1] == stop_id
    assert got["s"][0]["finish"][0] == "stop"
    assert stats.num_async_steps_total > 5


def test_seeded_sampling_is_the_same_draw(tiny_llama_dir):
    """Seeded rows draw from (seed, output position): a step launched ahead draws its row at the next
    position, as the synchronous step would."""
    def scenario(engine):
        p = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=25, ignore_eos=True, n=2)
        q = SamplingParams(temperature=0.7, seed=99, max_tokens=18, ignore_eos=True, logprobs=1)
        return drain(engine, {0: [("p", PROMPTS[0], p)], 3: [("q", PROMPTS[2], q)]})

    sync, got, stats = both(tiny_llama_dir, scenario)
    assert got == sync
    assert got["p"][0]["ids"] != got["p"][1]["ids"]
    assert stats.num_async_steps_total > 10


def test_aborts_and_arrivals_while_a_step_is_in_flight(tiny_llama_dir):
    """An abort between steps drops the aborted sequence's launched row; a request arriving while the
    batch runs ahead is admitted at the next step; the KV pool is whole once all are done."""
    def scenario(engine):
        params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
        out = drain(engine, {0: [("a", PROMPTS[0], params), ("b", PROMPTS[1], params)],
                             12: [("c", PROMPTS[2], params)], 20: [("d", PROMPTS[3], params)]},
                    aborts={8: "b", 25: "c"})
        assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
        return out

    sync, got, stats = both(tiny_llama_dir, scenario)
    assert {k: got[k] for k in "ad"} == {k: sync[k] for k in "ad"}
    for k in "bc":   # cut at another token: a step ahead's engine admits an arrival one call later
        ids, full = got[k][0]["ids"], sync[k][0]["ids"]
        assert got[k][0]["finish"] == sync[k][0]["finish"] == ("abort", None)
        assert ids and (ids == full[:len(ids)] or full == ids[:len(full)])
    assert len(got["a"][0]["ids"]) == len(got["d"][0]["ids"]) == 30
    assert stats.num_async_steps_total > 10


@pytest.mark.parametrize("kind", ["drafter", "grammar", "penalty"])
def test_sequences_that_need_their_tokens_keep_the_batch_synchronous(tiny_llama_dir, kind):
    """A drafter's tree, a grammar's mask and penalties' counts depend on the tokens of the step before:
    while such a sequence is in the batch, no step runs ahead; outputs stay the synchronous engine's."""
    special = {"drafter": dict(drafter="ngram"),
               "grammar": dict(params=SamplingParams(temperature=0.0, max_tokens=16,
                                                     guided=("regex", "[a-z ]{4,30}"))),
               "penalty": dict(params=SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True,
                                                     frequency_penalty=1.5))}[kind]

    def scenario(engine):
        plain = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        other = ("x", PROMPTS[2], special.get("params", SamplingParams(temperature=0.0, max_tokens=16))) + ((special["drafter"],) if "drafter" in special
                                                                  else ())
        return drain(engine, {0: [("plain", PROMPTS[0], plain, "none")], 3: [other]})

    config = dict(drafters=("ngram",)) if kind == "drafter" else {}
    sync, got, stats = both(tiny_llama_dir, scenario, **config)
    assert got == sync
    # only the plain sequence's steps before "x" arrives and after it finishes ran ahead; "x" takes
    # 16 tokens: at least 2 steps and its admission
    assert 0 < stats.num_async_steps_total <= 40 - 3


def test_a_short_kv_pool_runs_synchronously_rather_than_preempt(tiny_llama_dir):
    """A step ahead takes its sequences' next KV slots only from free blocks: with a pool too short for
    every sequence the outputs and preemptions are the synchronous engine's."""
    def scenario(engine):
        params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        out = drain(engine, {0: [(f"r{i}", p, params) for i, p in enumerate(PROMPTS)]})
        out["preemptions"] = engine.get_stats().num_preemptions_total
        return out

    sync, got, _ = both(tiny_llama_dir, scenario, num_kv_blocks=40, max_model_len=80)
    assert got == sync
    assert sync["preemptions"] > 0


def test_a_failed_step_ahead_is_scheduled_again(tiny_llama_dir):
    """A step launched ahead whose read raises changes nothing: it is counted as a failed step and its
    sequences are scheduled again; the outputs are the synchronous engine's."""
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    sync = drain(make_llm_engine(tiny_llama_dir, async_scheduling=False), {0: [("a", PROMPTS[0], params)]})
    engine = make_llm_engine(tiny_llama_dir, async_scheduling=True)
    launch, calls = engine.runner.launch, {"n": 0, "raised": 0}

    def broken():
        calls["raised"] += 1
        raise RuntimeError("lost the step")

    def flaky(*args, **kwargs):
        launched = launch(*args, **kwargs)
        if kwargs.get("ahead") is not None:
            calls["n"] += 1
            if calls["n"] in (3, 4, 9):   # 4 is launched ahead of 3's read, and dropped with it
                launched.collect = broken
        return launched

    engine.runner.launch = flaky
    got = drain(engine, {0: [("a", PROMPTS[0], params)]})
    assert got == sync
    assert engine.get_stats().num_step_failures_total == calls["raised"] == 2
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_steps_ahead_replay_graphs_without_a_sync_and_match(tiny_llama_dir):
    """On CUDA (on by default there, with the captured graphs): outputs equal the synchronous engine's
    in fp32, and launching a step ahead waits for nothing on the device (`set_sync_debug_mode`)."""
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=7, max_tokens=40, ignore_eos=True, logprobs=2)]

    def scenario(engine):
        return drain(engine, {0: [("g", PROMPTS[0], params[0]), ("s", PROMPTS[2], params[1])],
                              5: [("h", PROMPTS[1], params[0]), ("e", PROMPTS[3], params[0], "eagle")]})

    # eagle's sequence rides along (no room for drafts): its features are gathered in each read
    config = dict(device="cuda", num_kv_blocks=400, max_model_len=256, drafters=("eagle",),
                  drafter_options={"eagle": {"random_init": True}}, max_draft_tokens_per_step=0)
    sync = scenario(make_llm_engine(tiny_llama_dir, async_scheduling=False, **config))
    engine = make_llm_engine(tiny_llama_dir, **config)
    assert engine.async_scheduling and engine.runner.graphs is not None
    launch, synced = engine.runner.launch, []

    def strict(*args, **kwargs):
        if kwargs.get("ahead") is None:
            return launch(*args, **kwargs)
        torch.cuda.set_sync_debug_mode("error")
        try:
            return launch(*args, **kwargs)
        except RuntimeError as exc:
            synced.append(str(exc))
            raise
        finally:
            torch.cuda.set_sync_debug_mode(0)

    engine.runner.launch = strict
    got = scenario(engine)
    assert not synced, synced[:1]
    assert got == sync
    assert engine.get_stats().num_async_steps_total > 30


def test_drafter_sequences_ride_along_behind_a_step_that_drafts_nothing(tiny_llama_dir):
    """A step whose draft policy grants no draft (here: no draft tokens allowed per step) is plain for
    its drafters' sequences too: the steps after it run ahead with them, and the drafters that read
    features get those of the steps ahead (the feature store as the synchronous engine's); outputs
    unchanged."""
    config = dict(drafters=("eagle", "ngram"), drafter_options={"eagle": {"random_init": True}},
                  max_draft_tokens_per_step=0)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    engines = [make_llm_engine(tiny_llama_dir, async_scheduling=on, **config) for on in (False, True)]
    for engine in engines:
        engine.add_request("e", PROMPTS[0], params, drafter="eagle")
        engine.add_request("n", PROMPTS[2], params, drafter="ngram")
        for _ in range(12):
            engine.step()
    seqs = [engine.requests["e"].seqs[0] for engine in engines]
    assert seqs[0].token_ids == seqs[1].token_ids
    stores = [engine.features for engine in engines]
    n = stores[0].length(seqs[0].seq_id)
    assert n == stores[1].length(seqs[1].seq_id) == seqs[0].num_computed_tokens > len(PROMPTS[0])
    torch.testing.assert_close(stores[1].view(seqs[1].seq_id, 0, n), stores[0].view(seqs[0].seq_id, 0, n))
    got = [drain(engine) for engine in engines]
    assert got[0] == got[1]
    steps = engines[1].get_stats()
    assert steps.num_async_steps_total > 0.6 * steps.num_steps_total


def step_kinds(engine, n: int) -> str:
    """`n` steps of `engine`: "S" for a scheduled step (the draft policy decides), "A" for one run ahead."""
    kinds = ""
    for _ in range(n):
        before = engine.get_stats().num_async_steps_total
        engine.step()
        kinds += "A" if engine.get_stats().num_async_steps_total > before else "S"
    return kinds


def test_the_policy_decides_less_often_while_it_grants_nothing_and_at_once_after_a_grant(tiny_llama_dir):
    """After the k-th decision in a row that grants drafter sequences nothing they ride along
    min(2^(k-1), MAX_RIDES) steps ahead; a grant starts the count over. Outputs stay the synchronous
    engine's."""
    from specserve.engine.scheduler import MAX_QUIET_STEPS as MAX_RIDES
    from specserve.engine.draft_policy.fixed import FixedPolicy

    params = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)
    engines = [make_llm_engine(tiny_llama_dir, async_scheduling=on, drafters=("ngram",)) for on in (False, True)]
    for engine in engines:
        engine.add_request("n", PROMPTS[2], params, drafter="ngram")
        engine.add_request("m", PROMPTS[0], params, drafter="ngram")
        engine.step()                                   # the prefills
    engine = engines[1]
    engine.scheduler.policy = FixedPolicy(0)            # grants nothing
    want = "SA" + "SAA" + "SAAAA" + ("S" + "A" * MAX_RIDES) * 3
    quiet = step_kinds(engine, len(want))
    engine.scheduler.policy = FixedPolicy(4)            # grants every step: no step runs ahead
    busy = step_kinds(engine, 4)
    engine.scheduler.policy = FixedPolicy(0)
    again = step_kinds(engine, 5)
    assert (quiet, busy, again) == (want, "SSSS", "SASAA")
    seqs = [[r.seqs[0] for r in e.requests.values()] for e in engines]
    for e in engines:
        drain(e)
    assert [s.token_ids for s in seqs[1]] == [s.token_ids for s in seqs[0]]

