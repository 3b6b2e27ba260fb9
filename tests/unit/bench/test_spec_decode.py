"""The speculative-decoding benchmark harness end to end on the tiny random Llama (numbers are
checked for shape and sense, never for speed), its option parsing, and its `specserve bench` route."""

from __future__ import annotations

import json
import time

import pytest
import torch

from specserve.bench import spec_decode

META_FIELDS = {"date", "datetime", "machine", "torch", "transformers", "command_line", "invocation", "model",
               "device", "dtype", "datasets", "num_prompts", "max_tokens", "temperatures", "batch_size", "seed",
               "drafters", "drafter_options", "num_speculative_tokens", "notes"}


@pytest.fixture
def tiny_dataset(tmp_path):
    rows = [{"id": 1, "category": "coding", "turns": ["def fibonacci(n): return n. def fibonacci(n): return"]},
            {"id": 2, "category": "qa", "turns": ["What is the capital of France? Paris is the capital"]},
            {"id": 3, "category": "qa", "turns": ["never read: --num-prompts is 2"]}]
    path = tmp_path / "tiny_prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_harness_end_to_end(tiny_llama_dir, tiny_dataset, tmp_path, capsys, monkeypatch):
    out = tmp_path / "results" / "spec"
    order = []   # the methods in the order the measured batches ran them (the real runs, recorded)
    real_run = spec_decode.run_engine_batch

    def recording_run(engine, prompts, params, drafter, tag):
        if not tag.startswith("warm-"):
            order.append(drafter)
        return real_run(engine, prompts, params, drafter, tag)

    monkeypatch.setattr(spec_decode, "run_engine_batch", recording_run)
    rc = spec_decode.main(["--model", str(tiny_llama_dir), "--datasets", str(tiny_dataset), "--num-prompts", "2",
                           "--max-tokens", "8", "--drafters", "ngram", "draft_model",
                           "--drafter-option", "draft_model.draft_layers=1", "--temperature", "0", "0.7",
                           "--draft-budget", "fixed", "--out", str(out)])   # every draft verified
    assert rc == 0
    result = json.loads(out.with_suffix(".json").read_text())
    meta = result["meta"]
    assert META_FIELDS <= set(meta)
    assert meta["drafters"] == ["ngram", "draft_model"]
    assert meta["drafter_options"] == {"draft_model": {"draft_layers": 1}}
    assert meta["machine"]["torch_threads"] >= 1 and meta["num_prompts"] == {"tiny_prompts": 2}
    # 2 prompts at batch 1 x 2 temperatures = 4 batches, the order reversing from one to the next
    forward = ["none", "ngram", "draft_model"]
    assert order == (forward + forward[::-1]) * 2
    assert meta["method_order"] == "reversed every other batch"

    rows = result["results"]
    assert all(set(r) == set(spec_decode.ROW_FIELDS) for r in rows)
    cells = {(r["temperature"], r["method"]): r for r in rows}
    methods = ["none", "ngram", "draft_model", "hf_generate", "hf_prompt_lookup"]
    assert set(cells) == {(t, m) for t in (0.0, 0.7) for m in methods}
    for (t, m), r in cells.items():
        assert r["dataset"] == "tiny_prompts" and r["num_prompts"] == 2
        assert r["num_tokens"] == 2 * 8, (t, m)          # every method generates exactly max_tokens per prompt
        assert r["tok_s"] > 0 and r["speedup"] > 0 and r["error"] is None
    assert cells[(0.0, "none")]["speedup"] == 1.0 and cells[(0.0, "none")]["tau"] == 1.0
    for t in (0.0, 0.7):   # one speedup per batch (2 prompts at batch 1), the cell's between them
        for d in ("ngram", "draft_model"):
            r = cells[(t, d)]
            assert len(r["speedup_by_batch"]) == 2
            assert min(r["speedup_by_batch"]) - 1e-9 <= r["speedup"] <= max(r["speedup_by_batch"]) + 1e-9
    for t in (0.0, 0.7):
        for d in ("ngram", "draft_model"):
            r = cells[(t, d)]
            assert r["tau"] >= 1.0
            assert r["alpha"] is None or 0.0 <= r["alpha"] <= 1.0
            assert r["num_accepted_tokens"] <= r["num_draft_tokens"]
            assert all(0.0 <= f <= 1.0 for f in r["accepted_by_depth"])
            assert sum(r["accepted_length_counts"]) == r["num_draft_steps"]
            assert r["num_fallbacks"] == 0
            assert r["greedy_mismatches"] == (0 if t == 0 else None)
    assert cells[(0.0, "draft_model")]["num_draft_steps"] > 0       # the draft model always proposes
    # standardized walltime: plain 1; ngram runs no network (SWI = tokens per target forward); the
    # one-layer draft model's runs cost its share of the target's parameters
    assert cells[(0.0, "none")]["swi"] == 1.0 and cells[(0.0, "hf_generate")]["swi"] is None
    from specserve.engine.config import ModelConfig
    from specserve.engine.loader import load_model
    from specserve.engine.model import LlamaModel

    loaded = load_model(str(tiny_llama_dir))
    target = LlamaModel.from_state_dict(ModelConfig.from_hf(loaded.hf_config), loaded.state_dict, max_positions=64,
                                        dtype=torch.float32, device="cpu")
    c = sum(p.numel() for p in target.truncated(1).parameters()) / sum(p.numel() for p in target.parameters())
    assert 0 < c < 1
    for t in (0.0, 0.7):
        ng, dm = cells[(t, "ngram")], cells[(t, "draft_model")]
        assert ng["model_runs"] == {} and ng["swi"] == pytest.approx(ng["num_tokens"] / ng["num_target_forwards"])
        runs = dm["model_runs"]["draft_model"]
        assert runs["cost"] == pytest.approx(c) and runs["runs"] >= dm["num_draft_steps"] > 0
        assert dm["swi"] == pytest.approx(dm["num_tokens"] / (dm["num_target_forwards"] + runs["runs"] * c))
        assert dm["swi"] < dm["num_tokens"] / dm["num_target_forwards"]
    assert result["num_greedy_mismatches"] == 0 and result["greedy_mismatches"] == []
    assert cells[(0.0, "hf_generate")]["identical_to_plain"] is not None

    table = out.with_suffix(".md").read_text()
    assert "| speedup | per batch | vs HF generate | τ | SWI | α |" in table
    assert "| ngram | tiny_prompts | 0 |" in table and "| draft_model | tiny_prompts | 0.7 |" in table
    assert table in capsys.readouterr().out
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_budget_policies_side_by_side(tiny_llama_dir, tiny_dataset, tmp_path, monkeypatch):
    """Several --draft-budget policies in one run: one engine per policy from one model load, every
    drafter once per policy against the one plain decoding, interleaved batch by batch."""
    out = tmp_path / "policies"
    runs = []   # (drafter, engine) of each measured batch, in the order run
    real_run = spec_decode.run_engine_batch

    def recording_run(engine, prompts, params, drafter, tag):
        if not tag.startswith("warm-"):
            runs.append((drafter, engine))
        return real_run(engine, prompts, params, drafter, tag)

    monkeypatch.setattr(spec_decode, "run_engine_batch", recording_run)
    rc = spec_decode.main(["--model", str(tiny_llama_dir), "--datasets", str(tiny_dataset), "--num-prompts", "2",
                           "--max-tokens", "8", "--drafters", "draft_model", "--drafter-option",
                           "draft_model.draft_layers=1", "--temperature", "0", "--draft-budget", "goodput", "fixed",
                           "--no-hf", "--out", str(out)])
    assert rc == 0
    result = json.loads(out.with_suffix(".json").read_text())
    assert result["meta"]["draft_budgets"] == ["goodput", "fixed"]
    rows = {r["method"]: r for r in result["results"]}
    assert set(rows) == {"none", "draft_model@goodput", "draft_model@fixed"}
    assert rows["none"]["draft_budget"] is None
    for policy in ("goodput", "fixed"):
        r = rows[f"draft_model@{policy}"]
        assert r["draft_budget"] == policy and r["greedy_mismatches"] == 0 and r["num_tokens"] == 2 * 8
        assert len(r["speedup_by_batch"]) == 2
    # the fixed policy drafts every decoding step; its figures are its engine's alone
    fixed = rows["draft_model@fixed"]
    assert fixed["num_draft_steps"] > 0 and fixed["num_target_forwards"] == 2 * 8 - fixed["num_accepted_tokens"]
    # two engines of the same model; plain runs on the first policy's; the order reverses per batch
    engines = {d: {id(e) for dd, e in runs if dd == d} for d in ("none", "draft_model")}
    assert len(engines["none"]) == 1 and len(engines["draft_model"]) == 2 and engines["none"] < engines["draft_model"]
    first, second = (e for d, e in runs[:3] if d == "draft_model")
    assert first is not second and torch.equal(first.model.layers[0].qkv.weight, second.model.layers[0].qkv.weight)
    assert [d for d, _ in runs] == ["none", "draft_model", "draft_model", "draft_model", "draft_model", "none"]
    assert "| draft_model@fixed | tiny_prompts | 0 |" in out.with_suffix(".md").read_text()


def test_budget_policy_and_quantization_names_match_the_engine():
    from specserve.engine.config import DRAFT_BUDGETS
    from specserve.engine.quant import QUANTIZATIONS

    assert spec_decode.DRAFT_BUDGETS == DRAFT_BUDGETS
    assert spec_decode.QUANTIZATIONS == QUANTIZATIONS


def test_composite_drafters_report_their_parts(tiny_llama_dir, tiny_dataset, tmp_path):
    """A drafter whose trees carry provenance: its row holds per-part figures summing to its own."""
    from helpers import two_part_drafter

    name = two_part_drafter()
    out = tmp_path / "parts"
    rc = spec_decode.main(["--model", str(tiny_llama_dir), "--datasets", str(tiny_dataset), "--num-prompts", "2",
                           "--max-tokens", "8", "--drafters", name, "--temperature", "0", "--draft-budget", "fixed",
                           "--no-hf", "--out", str(out)])
    assert rc == 0
    result = json.loads(out.with_suffix(".json").read_text())
    row = next(r for r in result["results"] if r["method"] == name)
    assert row["greedy_mismatches"] == 0 and row["parts"]
    assert sum(p["draft_tokens"] for p in row["parts"].values()) == row["num_draft_tokens"] > 0
    assert sum(p["accepted_tokens"] for p in row["parts"].values()) == row["num_accepted_tokens"]
    plain = next(r for r in result["results"] if r["method"] == "none")
    assert plain["parts"] is None


def test_batch_speedups():
    """Per batch, the method's tokens/s over plain's; the cell's speedup (total tokens over total
    time, the same tokens per batch) lies between them; none when a tally failed or batches differ."""
    plain, fast = spec_decode.Tally(), spec_decode.Tally()
    for secs_plain, secs_fast in ((2.0, 1.0), (2.0, 4.0), (1.0, 1.0)):
        plain.add(10, secs_plain, [])
        fast.add(10, secs_fast, [])
    per_batch = spec_decode.batch_speedups(fast, plain)
    assert per_batch == pytest.approx([2.0, 0.5, 1.0])
    assert min(per_batch) <= fast.tok_s / plain.tok_s <= max(per_batch)
    assert spec_decode.spread(per_batch) == "0.50–2.00" and spec_decode.spread([1.234]) == "1.23"
    assert spec_decode.spread(None) == "–"
    fast.add(10, 1.0, [])
    assert spec_decode.batch_speedups(fast, plain) is None
    plain.error = "failed"
    assert spec_decode.batch_speedups(plain, plain) is None


def test_anchored_speedups_compare_with_plain_at_the_same_moment():
    """Plain decoding run before and after a method in the same batch: the method is compared with
    plain's rate interpolated at its own moment, so a machine slowing down between the runs is not
    read as the method's loss (against the first plain run alone it would be); one plain run per
    batch gives the tallies' tokens/s ratio, as without anchors."""
    plain, slow_machine = spec_decode.Tally(), spec_decode.Tally()
    plain.add(100, 5.0, [[1]], batch=0, at=0.0)        # 20 tok/s
    plain.add(100, 10.0, [[2]], batch=0, at=20.0)      # 10 tok/s: the machine slowed down
    slow_machine.add(100, 100 / 15, [[1]], batch=0, at=10.0)   # 15 tok/s, as plain would have been then
    assert spec_decode.anchored(plain, 0, 10.0) == pytest.approx(15.0)
    assert spec_decode.anchored(plain, 0, -1.0) == 20.0 and spec_decode.anchored(plain, 0, 99.0) == 10.0
    assert spec_decode.anchored(plain, 1, 0.0) is None
    assert spec_decode.batch_speedups(slow_machine, plain) == pytest.approx([1.0])
    assert spec_decode.cell_speedup(slow_machine, plain) == pytest.approx(1.0)
    assert plain.outputs == [[1]] and plain.batches == [(200, 15.0)]   # one batch, outputs of its first run
    first_only = spec_decode.Tally()
    first_only.add(100, 5.0, [[1]], batch=0, at=0.0)
    assert spec_decode.cell_speedup(slow_machine, first_only) == pytest.approx(0.75)
    # one plain run per batch: the ratio of tokens/s
    p2, m2 = spec_decode.Tally(), spec_decode.Tally()
    for secs_plain, secs_m in ((2.0, 1.0), (2.0, 4.0)):
        p2.add(10, secs_plain, [])
        m2.add(10, secs_m, [])
    assert spec_decode.cell_speedup(m2, p2) == pytest.approx(m2.tok_s / p2.tok_s)


def test_repeats_take_the_median_of_the_repeats_speedups():
    """Three repeats of one batch: 2x, 1x (the machine slowed the method's run alone) and 2x; the
    cell says 2x, not their time-weighted mean."""
    plain, method = spec_decode.Tally(), spec_decode.Tally()
    at = 0.0
    for rep, method_secs in enumerate((1.0, 2.0, 1.0)):
        plain.add(100, 2.0, [[1]], batch=0, at=at, repeat=rep)
        method.add(100, method_secs, [[1]], batch=0, at=at + 1, repeat=rep)
        plain.add(100, 2.0, [[1]], batch=0, at=at + 2, repeat=rep)
        at += 3
    assert spec_decode.batch_speedups(method, plain) == pytest.approx([2.0, 1.0, 2.0])
    assert spec_decode.cell_speedup(method, plain) == pytest.approx(2.0)
    assert method.outputs == [[1]] and method.num_tokens == 300     # outputs of the first run, tokens of all


def test_repeats_end_to_end(tiny_llama_dir, tiny_dataset, tmp_path):
    out = tmp_path / "repeated"
    rc = spec_decode.main(["--model", str(tiny_llama_dir), "--datasets", str(tiny_dataset), "--num-prompts", "2",
                           "--max-tokens", "6", "--drafters", "ngram", "--temperature", "0", "--no-hf",
                           "--draft-budget", "fixed", "--batch-size", "2", "--repeats", "3", "--out", str(out)])
    assert rc == 0
    result = json.loads(out.with_suffix(".json").read_text())
    assert result["meta"]["repeats"] == 3 and result["num_greedy_mismatches"] == 0
    cells = {r["method"]: r for r in result["results"]}
    assert cells["none"]["num_tokens"] == cells["ngram"]["num_tokens"] == 3 * 2 * 6
    assert len(cells["ngram"]["speedup_by_batch"]) == 3
    assert sorted(cells["ngram"]["speedup_by_batch"])[1] == pytest.approx(cells["ngram"]["speedup"])
    assert "median of 3 repeats" in out.with_suffix(".md").read_text()


def test_anchor_every_end_to_end(tiny_llama_dir, tiny_dataset, tmp_path, monkeypatch):
    """--anchor-every 1: plain decoding runs before, between and after the drafted methods of each
    batch (the order still reversing), every plain run gives the same greedy output, and each
    speedup is taken against plain at the method's moment."""
    out = tmp_path / "anchored"
    order, plain_outputs = [], []
    real_run = spec_decode.run_engine_batch

    def recording_run(engine, prompts, params, drafter, tag):
        result = real_run(engine, prompts, params, drafter, tag)
        if not tag.startswith("warm-"):
            order.append(drafter)
            if drafter == "none":
                plain_outputs.append(result[2])
        return result

    monkeypatch.setattr(spec_decode, "run_engine_batch", recording_run)
    rc = spec_decode.main(["--model", str(tiny_llama_dir), "--datasets", str(tiny_dataset), "--num-prompts", "2",
                           "--max-tokens", "8", "--drafters", "ngram", "draft_model", "--drafter-option",
                           "draft_model.draft_layers=1", "--temperature", "0", "--no-hf", "--draft-budget", "fixed",
                           "--anchor-every", "1", "--out", str(out)])
    assert rc == 0
    assert order == ["none", "ngram", "none", "draft_model", "none", "none", "draft_model", "none", "ngram", "none"]
    assert plain_outputs[0] == plain_outputs[1] == plain_outputs[2] and plain_outputs[3] == plain_outputs[4]
    result = json.loads(out.with_suffix(".json").read_text())
    assert result["meta"]["anchor_every"] == 1 and result["num_greedy_mismatches"] == 0
    cells = {r["method"]: r for r in result["results"]}
    assert cells["none"]["num_tokens"] == 3 * 2 * 8                  # three plain runs of each batch
    for d in ("ngram", "draft_model"):
        r = cells[d]
        assert r["num_tokens"] == 2 * 8 and len(r["speedup_by_batch"]) == 2 and r["greedy_mismatches"] == 0
        assert min(r["speedup_by_batch"]) - 1e-9 <= r["speedup"] <= max(r["speedup_by_batch"]) + 1e-9
    assert "at the same moment" in out.with_suffix(".md").read_text()


def test_lockstep_pairing_end_to_end(tiny_llama_dir, tiny_dataset, tmp_path, monkeypatch):
    """--pairing lockstep: every drafted method's batch runs in lockstep with plain decoding of the
    same batch on a second engine, each batch speedup is that pair's ratio of tokens/s, and plain
    decoding gives the same greedy output in every pair."""
    out = tmp_path / "lockstep"
    pairs = []
    real_lockstep = spec_decode.run_lockstep

    def recording_lockstep(runs):
        results = real_lockstep(runs)
        if not any(r[4].startswith("warm-") for r in runs):
            pairs.append(([(r[0], r[3]) for r in runs], results))
        return results

    monkeypatch.setattr(spec_decode, "run_lockstep", recording_lockstep)
    rc = spec_decode.main(["--model", str(tiny_llama_dir), "--datasets", str(tiny_dataset), "--num-prompts", "2",
                           "--max-tokens", "8", "--drafters", "ngram", "draft_model", "--drafter-option",
                           "draft_model.draft_layers=1", "--temperature", "0", "--no-hf", "--draft-budget", "fixed",
                           "--batch-size", "2", "--admission", "continuous", "--repeats", "2",
                           "--pairing", "lockstep", "--out", str(out)])
    assert rc == 0
    # one pair per drafted method and repeat, the order reversing; plain on its own engine
    assert [[d for _, d in runs] for runs, _ in pairs] == [["none", "ngram"], ["none", "draft_model"],
                                                           ["none", "draft_model"], ["none", "ngram"]]
    twins = {id(runs[0][0]) for runs, _ in pairs}
    drafting = {id(runs[1][0]) for runs, _ in pairs}
    assert len(twins) == 1 and len(drafting) == 1 and twins != drafting
    assert all(res[0][2] == pairs[0][1][0][2] for _, res in pairs)
    result = json.loads(out.with_suffix(".json").read_text())
    assert result["meta"]["pairing"] == "lockstep" and result["num_greedy_mismatches"] == 0
    cells = {r["method"]: r for r in result["results"]}
    assert cells["none"]["num_tokens"] == 4 * 2 * 8                  # a plain run in every pair
    for d in ("ngram", "draft_model"):
        expected = [(n / s) / (pn / ps) for runs, ((pn, ps, _, _), (n, s, _, _)) in pairs if runs[1][1] == d]
        assert cells[d]["speedup_by_batch"] == pytest.approx(expected)
        assert cells[d]["num_tokens"] == 2 * 2 * 8 and cells[d]["greedy_mismatches"] == 0
    assert "in lockstep" in out.with_suffix(".md").read_text()


def test_run_lockstep_steps_the_engines_in_turn(tiny_llama_dir):
    """Two engines decode their batches one step each in turn, each run's outputs are those it
    gives alone, and its seconds count its own engine's calls only."""
    from specserve.engine.config import EngineConfig
    from specserve.engine.core import LLMEngine
    from specserve.engine.sampling_params import SamplingParams

    engines = [LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", device="cpu", max_model_len=128,
                                      drafters=("none", "ngram"))) for _ in range(2)]
    log = []
    for k, engine in enumerate(engines):
        real_step = engine.step

        def step(real_step=real_step, k=k):
            log.append(k)
            return real_step()
        engine.step = step
    prompts = [[1, 5, 9, 5, 9, 5], [2, 7, 3]]

    def params(max_tokens):
        return [SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True) for _ in prompts]

    alone = [spec_decode.run_engine_batch(engines[0], prompts, params(m), d, f"alone-{d}")
             for d, m in (("none", 4), ("ngram", 12))]
    log.clear()
    t0 = time.perf_counter()
    pair = spec_decode.run_lockstep([(engines[0], prompts, params(4), "none", "a"),
                                     (engines[1], prompts, params(12), "ngram", "b")])
    wall = time.perf_counter() - t0
    steps_a = log.count(0)
    assert log[:2 * steps_a] == [0, 1] * steps_a and set(log[2 * steps_a:]) == {1}   # in turn, then the rest
    for (n, s, outs, specs), (n1, _, outs1, _) in zip(pair, alone):
        assert (n, outs) == (n1, outs1) and 0 < s < wall
    assert pair[0][1] + pair[1][1] <= wall
    assert all(spec is not None for spec in pair[1][3])
    with pytest.raises(ValueError, match="an engine each"):
        spec_decode.run_lockstep([(engines[0], prompts, params(2), "none", "c"),
                                  (engines[0], prompts, params(2), "none", "d")])


def test_anchored_order():
    assert spec_decode.anchored_order(["none", "a", "b", "c"], 0, "none") == ["none", "a", "b", "c"]
    assert spec_decode.anchored_order(["none", "a", "b", "c"], 2, "none") == ["none", "a", "b", "none", "c", "none"]
    assert spec_decode.anchored_order(["c", "b", "a", "none"], 1, "none") == ["none", "c", "none", "b", "none",
                                                                               "a", "none"]


def test_method_order_balances_a_linear_drift():
    methods = ["none", "a", "b", "c"]
    assert spec_decode.method_order(methods, 0) == methods
    assert spec_decode.method_order(methods, 1) == ["c", "b", "a", "none"]
    assert spec_decode.method_order(methods, 2) == methods
    # over two batches each method's mean position is the same, so a drift linear in time weighs
    # on every method, plain included, alike
    positions = {m: sum(spec_decode.method_order(methods, k).index(m) for k in (0, 1)) for m in methods}
    assert set(positions.values()) == {len(methods) - 1}


def test_drafter_selection():
    available = ["draft_model", "ngram"]
    assert spec_decode.select_drafters(None, available) == (["ngram", "draft_model"], ["mag"])
    assert spec_decode.select_drafters(["draft_model", "none", "draft_model"], available) == (["draft_model"], [])
    with pytest.raises(SystemExit, match="unknown drafter"):
        spec_decode.select_drafters(["nope"], available)


def test_greedy_mismatches_are_found_and_loud():
    plain = [[1, 2, 3, 4], [5, 6, 7]]
    assert spec_decode.find_mismatches("ds", "ngram", plain, [[1, 2, 3, 4], [5, 6, 7]]) == []
    found = spec_decode.find_mismatches("ds", "ngram", plain, [[1, 2, 9, 4], [5, 6, 7]])
    assert found == [{"dataset": "ds", "drafter": "ngram", "prompt_index": 0, "first_difference_at": 2,
                      "plain": [3, 4], "drafter_output": [9, 4]}]
    assert "LOSSLESSNESS BUG" in spec_decode.mismatch_alarm(found, "float32")
    assert "LOSSLESSNESS BUG" not in spec_decode.mismatch_alarm(found, "bfloat16")
