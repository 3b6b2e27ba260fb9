"""The draft policies in the engine: lossless whatever they decide, drafting where it pays, a
drafter's contexts reaching the goodput policy, the budgets and the step cost model in the metrics."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from helpers import make_llm_engine, run_requests

from specserve.drafters.base import Drafter, register
from specserve.engine.draft_policy import budget_sizes
from specserve.engine.sampling_params import SamplingParams
from specserve.engine.tree import TokenTree

PLAIN: dict[tuple[int, ...], list[int]] = {}    # prompt -> plain greedy continuation


@register("test_budget_oracle")
class OracleChainDrafter(Drafter):
    """Drafts the plain greedy continuation as a chain, wrong at every fifth position."""

    def __init__(self, ctx):
        self.vocab = ctx.model_config.vocab_size

    def propose(self, seqs, budgets):
        trees = []
        for seq, budget in zip(seqs, budgets):
            truth = PLAIN[tuple(seq.token_ids[:seq.num_prompt_tokens])][seq.num_output_tokens:]
            drafts = [(t + 1) % self.vocab if (seq.num_output_tokens + k) % 5 == 4 else t
                      for k, t in enumerate(truth[:budget])]
            trees.append(TokenTree.chain(seq.token_ids[-1], drafts) if drafts else None)
        return trees


@pytest.fixture(scope="module")
def prompts_and_plain(tiny_llama_dir):
    import torch

    engine = make_llm_engine(tiny_llama_dir, [])
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, engine.model_config.vocab_size, (n,), generator=g).tolist()
               for n in (7, 21, 12, 30, 5)]
    plain = run_requests(engine, prompts, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    for i, p in enumerate(prompts):
        PLAIN[tuple(p)] = plain[f"r{i}"]
    return prompts, plain


def steps_costing(engine, per_token: float) -> None:
    """Make the engine's goodput policy see a step of n tokens as 10 ms * (1 + per_token * (n - 1)),
    whatever the tiny model's real timings (which it stops learning from)."""
    cost = engine.scheduler.policy.step_cost
    cost.calibrate({n: 0.010 * (1 + per_token * (n - 1)) for n in (1, 2, 4, 8, 16, 32, 64, 512)})
    cost.observe = lambda *args, **kwargs: None


def cheap_steps(engine) -> None:
    """Make the engine's goodput budget see steps as nearly free whatever their tokens and trees (the
    tiny model's forward is so cheap that the verification of a tree costs more than it, so that
    drafting rarely pays there; these tests want drafts), and stop it learning from real timings."""
    cost = engine.scheduler.policy.step_cost
    cost.calibrate({1: 0.010, 512: 0.011})
    cost.observe = lambda *args, **kwargs: None


def test_goodput_is_lossless_and_drafts(tiny_llama_dir, prompts_and_plain):
    prompts, plain = prompts_and_plain
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    # with the real timings: lossless whatever it decides
    engine = make_llm_engine(tiny_llama_dir, ["test_budget_oracle"], draft_budget="goodput", num_speculative_tokens=8)
    assert engine.scheduler.policy.step_cost.calibrated
    assert run_requests(engine, prompts, params) == plain
    assert sum(engine.get_stats().drafters["test_budget_oracle"].budget_counts) > 0
    # where drafting pays, it drafts, and stays lossless
    engine = make_llm_engine(tiny_llama_dir, ["test_budget_oracle", "ngram"], draft_budget="goodput",
                             num_speculative_tokens=8)
    cheap_steps(engine)
    assert run_requests(engine, prompts, params) == plain
    assert run_requests(engine, prompts, params, prefix="r") == plain   # again, with learnt models
    for i, p in enumerate(prompts):     # the n-gram drafter through the same engine
        engine.add_request(f"n{i}", p, params, drafter="ngram")
    got: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            for d in out.outputs:
                got.setdefault(out.request_id, []).extend(d.token_ids)
    assert got == {f"n{i}": plain[f"r{i}"] for i in range(len(prompts))}
    stats = engine.get_stats()
    oracle = stats.drafters["test_budget_oracle"]
    # it drafted, and well (how much depends on the timings the cost model sees: a loose bound)
    assert oracle.num_accepted_tokens > 0.3 * sum(map(len, plain.values()))
    counts = oracle.budget_counts
    assert sum(counts) > 0 and all(c == 0 for b, c in enumerate(counts) if b not in budget_sizes(8))
    assert stats.step_cost_tokens[:4] == [1, 2, 4, 8] and all(s > 0 for s in stats.step_cost_seconds)
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


@register("test_budget_always_wrong")
class AlwaysWrong(Drafter):
    def __init__(self, ctx):
        self.vocab = ctx.model_config.vocab_size

    def propose(self, seqs, budgets):
        return [TokenTree.chain(seq.token_ids[-1], [(PLAIN[tuple(seq.token_ids[:seq.num_prompt_tokens])]
                                                     [seq.num_output_tokens] + 1) % self.vocab] * b)
                for seq, b in zip(seqs, budgets)]


def test_goodput_stops_drafting_what_is_never_accepted(tiny_llama_dir, prompts_and_plain):
    prompts, plain = prompts_and_plain
    engine = make_llm_engine(tiny_llama_dir, ["test_budget_always_wrong"], num_speculative_tokens=8,
                             draft_budget="goodput")
    got = run_requests(engine, prompts, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    assert got == plain
    st = engine.get_stats().drafters["test_budget_always_wrong"]
    assert st.num_accepted_tokens == 0
    decode_steps = sum(st.budget_counts)
    assert st.num_steps < 0.35 * decode_steps     # mostly no draft at all


@register("test_budget_context")
class ContextOracle(Drafter):
    """Tells context 1 at even output positions, where it drafts the plain continuation, and 2 at
    odd ones, where it drafts a wrong chain."""

    def __init__(self, ctx):
        self.vocab, self.told = ctx.model_config.vocab_size, 0
        self.asked = {1: [], 2: []}   # context -> the budgets it was asked to draft

    def context_of(self, seq):
        self.told += 1
        return 1 + seq.num_output_tokens % 2

    def propose(self, seqs, budgets):
        trees = []
        for seq, budget in zip(seqs, budgets):
            truth = PLAIN[tuple(seq.token_ids[:seq.num_prompt_tokens])][seq.num_output_tokens:][:budget]
            self.asked[1 + seq.num_output_tokens % 2].append(budget)
            drafts = truth if seq.num_output_tokens % 2 == 0 else [(t + 1) % self.vocab for t in truth]
            trees.append(TokenTree.chain(seq.token_ids[-1], drafts) if drafts else None)
        return trees


@register("test_budget_context_raises")
class ContextRaises(OracleChainDrafter):
    def __init__(self, ctx):
        super().__init__(ctx)
        self.told = 0

    def context_of(self, seq):
        self.told += 1
        raise RuntimeError("no context today")


def test_the_engine_hands_drafter_contexts_to_the_policy(tiny_llama_dir, prompts_and_plain, caplog):
    """A drafter's contexts reach the goodput policy, which sizes trees per context (deep where
    they are accepted, little where they are not), losslessly; a drafter whose `context_of` raises
    is asked once (logged), and goes on drafting from its record."""
    prompts, plain = prompts_and_plain
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    engine = make_llm_engine(tiny_llama_dir, ["test_budget_context", "test_budget_context_raises"],
                             draft_budget="goodput", num_speculative_tokens=8)
    steps_costing(engine, 0.05)   # a draft node costs 5 % of a step: worth it only where drafts are accepted
    assert run_requests(engine, prompts, params, drafter="test_budget_context") == plain
    drafter = engine.drafters["test_budget_context"]
    assert drafter.told > 0
    good, bad = (drafter.asked[c][len(drafter.asked[c]) // 2:] for c in (1, 2))   # once learnt
    assert sum(good) / len(good) > 2 * max(1.0, sum(bad) / max(1, len(bad)))
    assert engine.get_stats().drafters["test_budget_context"].num_accepted_tokens > 0
    with caplog.at_level("ERROR", logger="specserve"):
        assert run_requests(engine, prompts, params, drafter="test_budget_context_raises", prefix="x") == \
            {f"x{i}": plain[f"r{i}"] for i in range(len(prompts))}
    assert engine.drafters["test_budget_context_raises"].told == 1
    assert sum("failed to tell a context" in r.getMessage() for r in caplog.records) == 1
    assert engine.get_stats().drafters["test_budget_context_raises"].num_accepted_tokens > 0


def test_fixed_and_adaptive_policies_work(tiny_llama_dir, prompts_and_plain):
    prompts, plain = prompts_and_plain
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for mode in ("fixed", "adaptive"):
        engine = make_llm_engine(tiny_llama_dir, ["test_budget_oracle"], draft_budget=mode)
        assert engine.get_stats().step_cost_tokens == []
        assert run_requests(engine, prompts[:2], params) == {k: plain[k] for k in ("r0", "r1")}
        assert sum(engine.get_stats().drafters["test_budget_oracle"].budget_counts) > 0


def test_metrics_export_the_budgets_and_the_cost_model(tiny_llama_dir, prompts_and_plain):
    from prometheus_client.parser import text_string_to_metric_families

    from specserve.server.metrics import ServerMetrics

    prompts, plain = prompts_and_plain
    engine = make_llm_engine(tiny_llama_dir, ["test_budget_oracle"], num_speculative_tokens=8, draft_budget="goodput")
    cheap_steps(engine)
    run_requests(engine, prompts[:2], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    front = SimpleNamespace(engine=engine, get_stats=engine.get_stats, drafter_names=engine.drafter_names,
                            max_model_len=engine.max_model_len)
    text = ServerMetrics(front, "tiny").exposition().decode()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    name = "specserve_spec_decode_draft_budget_tokens"
    buckets = {float(dict(k)["le"]): v for (n, k), v in samples.items() if n == name + "_bucket"}
    assert sorted(buckets) == [0.0, 1.0, 2.0, 4.0, 8.0, float("inf")]
    counts = engine.get_stats().drafters["test_budget_oracle"].budget_counts
    count = samples[(name + "_count", (("drafter", "test_budget_oracle"),))]
    assert count == sum(counts) == buckets[float("inf")] > 0
    assert list(buckets.values()) == sorted(buckets.values())       # cumulative
    total = samples[(name + "_sum", (("drafter", "test_budget_oracle"),))]
    assert 0 < total <= 8 * count
    cost = {int(dict(k)["tokens"]): v for (n, k), v in samples.items() if n == "specserve_step_cost_estimate_seconds"}
    assert min(cost) == 1 and all(0 < v < 10 for v in cost.values())
    assert [cost[k] for k in sorted(cost)] == sorted(cost.values())
    assert "# HELP specserve_spec_decode_draft_budget_tokens" in text
