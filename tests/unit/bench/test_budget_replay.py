"""bench/budget_replay.py: a replayed policy takes the steps the engine takes under it (fixed and
adaptive, tree for tree, on a tiny Llama), goodput replays deterministically and accounts for every
token, the step cost table, and the command end to end on the default model."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from helpers import make_llm_engine

from specserve.bench.budget_replay import _Acceptance, cost_table, main, record, replay

# prompts that repeat themselves, so the n-gram drafter finds matches (and misses)
PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6], [11, 12, 13, 11, 12, 14, 11, 12], [3, 4, 3, 4, 3, 4, 3, 20, 21]]
MAX_TOKENS = 40
PER_SEQ = 8


def recorded(tiny_llama_dir, budget: str):
    engine = make_llm_engine(tiny_llama_dir, ("ngram",), max_num_seqs=1, num_speculative_tokens=PER_SEQ,
                             draft_budget=budget)
    runs, seconds = record(engine, "ngram", PROMPTS, MAX_TOKENS)
    accept = [_Acceptance(engine.drafters["ngram"], run, i) for i, run in enumerate(runs)]
    return runs, seconds, accept


@pytest.fixture(scope="module")
def fixed_run(tiny_llama_dir):
    return recorded(tiny_llama_dir, "fixed")


def test_the_replayed_fixed_budget_is_the_engines(fixed_run):
    runs, seconds, accept = fixed_run
    steps = [run["steps"] for run in runs]
    flat = [s for run in steps for s in run]
    assert any(acc > 0 for _, acc in flat) and any(n > 0 and acc == 0 for n, acc in flat)   # not vacuous
    for run in runs:
        assert len(run["output"]) == MAX_TOKENS
        assert sum(1 + acc for _, acc in run["steps"]) == MAX_TOKENS - 1   # every decode step, the first token by the prompt's
    costs = cost_table(seconds, PER_SEQ + 1)
    assert replay("fixed", "ngram", accept, costs, MAX_TOKENS, PER_SEQ)["steps"] == steps


def test_the_replayed_adaptive_budget_is_the_engines(tiny_llama_dir, fixed_run):
    runs, seconds, accept = recorded(tiny_llama_dir, "adaptive")
    assert [run["output"] for run in runs] == [run["output"] for run in fixed_run[0]]   # lossless, so one recording serves all
    costs = cost_table(seconds, PER_SEQ + 1)
    replayed = replay("adaptive", "ngram", fixed_run[2], costs, MAX_TOKENS, PER_SEQ)["steps"]
    assert replayed == [run["steps"] for run in runs]
    assert replayed != [run["steps"] for run in fixed_run[0]]   # the rule changed something on these prompts


def test_goodput_replays_deterministically_and_commits_every_token(fixed_run):
    runs, seconds, accept = fixed_run
    costs = {n: 0.04 + 0.002 * (n - 1) for n in range(1, PER_SEQ + 2)}   # a CPU-like curve: trees pay here
    a = replay("goodput", "ngram", accept, costs, MAX_TOKENS, PER_SEQ)
    b = replay("goodput", "ngram", accept, costs, MAX_TOKENS, PER_SEQ)
    assert a == b and a["trees"] > 0
    for steps in a["steps"]:
        assert sum(1 + acc for _, acc in steps) == MAX_TOKENS - 1
    plain = {"speedup": 1.0}
    assert a["speedup"] > plain["speedup"]   # these prompts repeat: drafting pays on this curve


def test_goodput_hears_the_drafters_contexts_and_the_control_does_not(fixed_run, monkeypatch):
    from specserve.engine.draft_policy import GoodputPolicy

    runs, seconds, accept = fixed_run
    costs = {n: 0.04 + 0.002 * (n - 1) for n in range(1, PER_SEQ + 2)}
    heard = []
    allocate = GoodputPolicy.allocate
    monkeypatch.setattr(GoodputPolicy, "allocate", lambda self, cands, caps: heard.append([c.context for c in cands])
                        or allocate(self, cands, caps))
    told = replay("goodput", "ngram", accept, costs, MAX_TOKENS, PER_SEQ)
    contexts = [c[0] for c in heard]
    assert len(contexts) == len(heard) > 0 and {0, 1, 2} <= set(contexts)   # every step, several kinds
    assert contexts == [accept[0].context(1)] + contexts[1:] and accept[0].context(1) == \
        accept[0].drafter.context_of(SimpleNamespace(seq_id=0, token_ids=runs[0]["prompt"] + runs[0]["output"][:1]))
    heard.clear()
    blind = replay("goodput-no-contexts", "ngram", accept, costs, MAX_TOKENS, PER_SEQ)
    assert heard and all(c == [None] for c in heard)
    assert told["trees"] > 0 and blind["trees"] > 0
    with pytest.raises(ValueError, match="policy must be one of"):
        replay("goodput-blind", "ngram", accept, costs, MAX_TOKENS, PER_SEQ)


def test_cost_table_interpolates_and_extrapolates():
    table = cost_table({1: [0.04, 0.05, 0.045], 3: [0.05], 5: [0.06]}, 7)
    assert table[1] == pytest.approx(0.045) and table[2] == pytest.approx(0.0475)
    assert table[4] == pytest.approx(0.055) and table[7] == pytest.approx(0.07)
    with pytest.raises(ValueError):
        cost_table({}, 3)


def test_command_on_the_default_model(default_model, tmp_path):
    out = tmp_path / "replay"
    assert main(["--drafters", "ngram", "--datasets", "gsm8k", "--num-prompts", "1", "--max-tokens", "12",
                 "--out", str(out)]) == 0
    data = json.loads(out.with_suffix(".json").read_text())
    assert [r["policy"] for r in data["results"]] == ["fixed", "adaptive", "goodput", "goodput-no-contexts"]
    assert all(r["speedup"] > 0 for r in data["results"])
    assert set(data["meta"]["step_seconds"]["ngram"]) == {str(n) for n in range(1, 10)}
    assert "| ngram | gsm8k |" in out.with_suffix(".md").read_text()


def test_listed_as_a_benchmark():
    from specserve.server import cli

    assert cli.BENCHMARKS["replay"][0] == "specserve.bench.budget_replay"
