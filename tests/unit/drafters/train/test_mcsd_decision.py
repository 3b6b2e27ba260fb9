"""`specserve train mcsd-decision`: the command runs end to end on the tiny Llama (logging through the
real engine, both decision types trained and saved), its log labels exactly the nodes verification
accepted, its checkpoints serve dynamic MCSD losslessly, and trained models stop as their labels say
on synthetic cases (including a depth rule the features can express)."""

from __future__ import annotations

import json

import pytest
import torch

from specserve.drafters.nets.mcsd_decision import DecisionModel, topk_entropy_features
from specserve.drafters.train.mcsd_decision import DecisionLog, auc, fit_decision, log_outcomes, parse_types
from specserve.engine.sampling_params import SamplingParams
from specserve.engine.sequence import DraftRequest
from specserve.engine.tree import tree_depths

from helpers import make_llm_engine, run_requests

ENGINE = dict(max_num_seqs=4, num_speculative_tokens=12, max_draft_tokens_per_step=48, max_model_len=128,
              num_kv_blocks=300)


def test_command_end_to_end(tiny_llama_dir, pool_file, tmp_path):
    from specserve.server import cli

    out = tmp_path / "decision"
    argv = ["train", "mcsd-decision", "--model", str(tiny_llama_dir), "--data", str(pool_file), "--out", str(out),
            "--device", "cpu", "--dtype", "float32", "--epochs", "5", "--no-progress", "--cache-dir",
            str(tmp_path / "cache"), "--option", "drafter=draft_model", "--option", "drafter.draft_layers=1",
            "--option", "k_config=fork:3,4", "--option", "prompts=12", "--option", "max_tokens=16"]
    assert cli.main(argv) == 0
    assert not (tmp_path / "cache").exists()                 # no teacher shards were built
    for t in (1, 2):
        meta = json.loads((out / f"type{t}" / "meta.json").read_text())
        assert meta["kind"] == "mcsd-decision" and meta["hyperparams"]["type"] == t
        assert meta["data"]["prompts"] == 12 and meta["data"]["drafted_tokens"] > 100
        assert set(meta["data"]["accepted_rate_by_depth"]) == {"1", "2", "3", "4"}
        assert 0.0 <= meta["extra"]["held_back"]["base_rate"] <= 1.0
    assert meta["hyperparams"]["in_dim"] == 9                # top-8 probabilities + entropy
    # the checkpoints serve dynamic MCSD; greedy output is plain decoding's
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (6, 19, 11)]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    plain = run_requests(make_llm_engine(tiny_llama_dir, **ENGINE), prompts, params)
    for t in (1, 2):
        eng = make_llm_engine(tiny_llama_dir, ["draft_model"], {"draft_model": {
            "k_config": "fork:3,4", "draft_layers": 1, "decision": str(out / f"type{t}")}}, **ENGINE)
        assert run_requests(eng, prompts, params) == plain
        assert eng.drafters["draft_model"].decision.decision_type == t
    # only type 2 when asked; an unknown type is an error
    assert cli.main([*argv[:7], str(tmp_path / "only2"), *argv[8:], "--option", "types=2"]) == 0
    assert (tmp_path / "only2" / "type2").is_dir() and not (tmp_path / "only2" / "type1").exists()
    assert cli.main([*argv[:7], str(tmp_path / "bad"), *argv[8:], "--option", "types=3"]) == 1


def test_log_labels_the_accepted_path(tiny_llama_dir):
    """Every logged token is labelled 1 exactly when it is on the path verification accepted: per
    step, the positive labels form one chain from depth 1 down, and their number is what the engine
    counted as accepted; the type-2 features are the draft distribution's top-k and entropy."""
    eng = make_llm_engine(tiny_llama_dir, ["draft_model"], {"draft_model": {"k_config": "fork:3,3",
                                                                            "draft_layers": 2}}, **ENGINE)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (7, 12)]
    log = log_outcomes(eng, "draft_model", prompts, max_tokens=20, temperature=0.0)
    rows = log.tensors()
    stats = eng.get_stats().drafters["draft_model"]
    # all but each sequence's last tree (a finished sequence's verification is not reported)
    assert 0 < stats.num_draft_tokens - len(log) <= 2 * 9
    assert 0 <= stats.num_accepted_tokens - int(rows["labels"].sum()) <= 2 * 3
    assert int(rows["labels"].sum()) > 10                  # a 2-layer "draft" is the target itself
    assert rows["hidden"].shape == (len(log), eng.model_config.hidden_size)
    p = rows["topk"]
    assert p.shape == (len(log), 9) and torch.all(p[:, :7] >= p[:, 1:8]) and torch.all(p[:, 8] >= 0)
    # per tree, the positives are one path: one token at each depth 1..a
    for tree in rows["tree_ids"].unique():
        at = rows["tree_ids"] == tree
        pos_depths = sorted(rows["depths"][at][rows["labels"][at] > 0].tolist())
        assert pos_depths == list(range(1, len(pos_depths) + 1))


def test_topk_entropy_features():
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [10.0, 0.0, float("-inf"), 0.0]])
    f = topk_entropy_features(logits, 2)
    torch.testing.assert_close(f[0], torch.tensor([0.25, 0.25, float(torch.log(torch.tensor(4.0)))]))
    q = torch.softmax(logits[1], -1)
    h = -(q[q > 0] * q[q > 0].log()).sum()
    torch.testing.assert_close(f[1], torch.tensor([q[0], q[1], h]))


def test_parse_types_and_auc():
    assert parse_types("1,2") == (1, 2) and parse_types(2) == (2,)
    with pytest.raises(ValueError):
        parse_types("0")
    assert auc(torch.tensor([0.1, 0.9, 0.4, 0.8]), torch.tensor([0.0, 1.0, 0.0, 1.0])) == 1.0
    assert auc(torch.tensor([0.5, 0.5]), torch.tensor([0.0, 1.0])) == 0.5
    assert auc(torch.tensor([0.5]), torch.tensor([1.0])) is None


def test_trained_on_a_synthetic_rule_the_model_stops_where_the_rule_says(tiny_llama_dir, tmp_path):
    """Synthetic labels 'a token is accepted iff its draft distribution's top-1 probability is at
    least t' (a rule type 2's features express): trained on them, the model's stops in a real
    propose follow the rule, chain by chain — a sequence goes on after a level exactly when one of its
    new tokens has top-1 >= t (β = 0.5), checked against the features of the tokens drafted."""
    from specserve.drafters.nets.checkpoint import target_fingerprint
    from specserve.drafters.nets.mcsd_decision import save_decision

    eng = make_llm_engine(tiny_llama_dir, ["draft_model"], {"draft_model": {"k_config": "fork:3,4",
                                                                            "draft_layers": 1}}, **ENGINE)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (9, 14, 20, 6)]
    rows = log_outcomes(eng, "draft_model", prompts, max_tokens=30, temperature=0.0).tensors()
    top1 = rows["topk"][:, 0]
    t = float(top1.quantile(0.6))
    torch.manual_seed(0)
    model = DecisionModel(2, 9, 32)
    fit_decision(model, rows["topk"], (top1 >= t).float(), epochs=150, lr=1e-2, batch_size=128)
    path = save_decision(tmp_path / "rule", model, target_name="tiny",
                         target_fingerprint=target_fingerprint(eng.model_config, eng.model))

    served = make_llm_engine(tiny_llama_dir, ["draft_model"], {"draft_model": {
        "k_config": "fork:3,4", "draft_layers": 1, "decision": str(path), "decision_threshold": 0.5}}, **ENGINE)
    drafter = served.drafters["draft_model"]
    log = DecisionLog()
    drafter.recorder = log                 # records the features of every level it scores
    params = SamplingParams(temperature=0.0)
    g = torch.Generator().manual_seed(9)
    seqs = [DraftRequest(600 + i, tuple(torch.randint(3, 320, (n,), generator=g).tolist()), n, params)
            for i, n in enumerate(range(4, 28))]
    trees = []
    for lo in range(0, len(seqs), 4):        # the drafter's KV holds max_num_seqs = 4 sequences
        batch = seqs[lo:lo + 4]
        for s in batch:
            drafter.start(s)
        trees += drafter.propose(batch, [12] * len(batch))
        for s in batch:
            drafter.finish(s)
    agree = total = 0
    stops = []
    for s, tree in zip(seqs, trees):
        depth = max(tree_depths(tree.parents))
        stops.append(depth)
        for nodes, d, _, feats in log.pending[s.seq_id]:
            if d == 4:
                continue                       # the last level: nothing to decide
            goes_on = bool((feats[:, 0] >= t).any())
            agree += goes_on == (depth > d)
            total += 1
            if depth == d:
                break
    assert total > 20 and agree / total >= 0.9, (agree, total)
    assert len(set(stops)) > 1, stops          # the rule lets some sequences go on and stops others
