"""Medusa training: tree tuning on hand-worked examples (and against brute force), the row layout of
the heads' targets, the decoding-walk τ, the sampled-softmax loss, the trainer on tiny teacher
shards (its loss falls), and its checkpoint: round trip into the drafter, refusal for another target."""

from __future__ import annotations

import itertools
import json
import random

import pytest
import torch

from specserve.drafters.nets import tree_tuning as tt
from specserve.drafters.train.medusa import (MedusaExamples, MedusaHeads, chain_tau, fit_medusa, head_ranks,
                                             label_mask_from_answer, medusa_loss, sequence_examples, template_prefix,
                                             train_medusa, tree_tau, walk_tau)

# ---------------------------------------------------------------------------------------------- tree tuning

ACC = [[0.6, 0.2, 0.1],    # depth 1: P(rank-r candidate is right)
       [0.5, 0.3]]         # depth 2


def test_greedy_order_hand_worked():
    # frontier {[0] .6, [1] .2, [2] .1} -> take [0]; add [0,0] .3, [0,1] .18
    # take [0,0] .3; take [1] .2 (add [1,0] .1, [1,1] .06); take [0,1] .18;
    # then [2] .1 and [1,0] .1 tie: the shorter path first; then [1,0]; then [1,1] .06; [2,0] .05 ...
    order = tt.greedy_tree_order(ACC, 8)
    assert order == [[0], [0, 0], [1], [0, 1], [2], [1, 0], [1, 1], [2, 0]]
    assert tt.is_prefix_closed(order)
    assert tt.expected_accepted_length(ACC, order[:4]) == pytest.approx(0.6 + 0.3 + 0.2 + 0.18)
    assert tt.path_probability(ACC, [1, 1]) == pytest.approx(0.06)
    assert tt.path_probability(ACC, [0, 2]) == 0.0          # no such candidate
    assert tt.greedy_tree_order(ACC, 3, max_depth=1) == [[0], [1], [2]]
    assert len(tt.greedy_tree_order(ACC, 100)) == 9           # every node of probability > 0
    assert tt.greedy_tree_order([[0.0, 0.5]], 4) == [[1]]     # zero-probability nodes are never added


def _all_trees(candidates: list[tuple[int, ...]], size: int):
    for combo in itertools.combinations(candidates, size):
        s = set(combo)
        if all(len(p) == 1 or p[:-1] in s for p in combo):
            yield combo


@pytest.mark.parametrize("seed", range(4))
def test_greedy_order_is_the_best_tree_of_each_size(seed):
    rng = random.Random(seed)
    acc = [[rng.random() * 0.6, rng.random() * 0.4] for _ in range(3)]    # not sorted by rank on purpose
    candidates = [p for d in (1, 2, 3) for p in itertools.product(range(2), repeat=d)]   # 14 nodes
    order = tt.greedy_tree_order(acc, 7)
    for size in range(1, 8):
        best = max(tt.expected_accepted_length(acc, t) for t in _all_trees(candidates, size))
        assert tt.expected_accepted_length(acc, order[:size]) == pytest.approx(best)


def test_empirical_order_and_accepted_lengths_hand_worked():
    # rank of the right token at depths 1, 2 for six positions (-1 or >= max_rank: not a candidate)
    ranks = torch.tensor([[0, 0], [0, 0], [0, 1], [1, 0], [2, -1], [0, 5]])
    # P([0]) = 4/6, P([0,0]) = 2/6, P([1]) = P([0,1]) = P([1,0]) = P([2]) = 1/6
    order = tt.greedy_tree_order_empirical(ranks, 6, max_rank=3)
    assert order == [[0], [0, 0], [1], [2], [0, 1], [1, 0]]
    assert tt.accepted_lengths(ranks, [[0], [0, 0]]).tolist() == [2, 2, 1, 0, 0, 1]
    assert tt.accepted_lengths(ranks, order).tolist() == [2, 2, 2, 2, 1, 1]
    assert tt.empirical_accepted_length(ranks, [[0, 1]]) == pytest.approx(4 / 6 + 1 / 6)   # [0] is implied
    table = tt.acceptance_table(ranks, max_rank=3)
    assert table[0] == pytest.approx([4 / 6, 1 / 6, 1 / 6]) and table[1] == pytest.approx([3 / 6, 1 / 6, 0])


def test_template_prefix_keeps_a_preference_order_and_levels_otherwise():
    assert template_prefix([[0], [0, 0], [1], [0, 1]], 2) == [[0], [0, 0]]
    assert template_prefix([[0, 0], [1], [0]], 2) == [[0], [1]]      # not prefix-closed: level-major


# ---------------------------------------------------------------------------------------------- rows and τ

def test_sequence_rows_target_the_labels_k_ahead():
    # 8 positions; labels[t] = 100 + t; the answer's labels are trained from t = 3 on
    labels = torch.arange(100, 108)
    answer = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1], dtype=torch.bool)     # tokens 4..7 are the answer
    mask = label_mask_from_answer(answer)
    assert mask.tolist() == [False, False, False, True, True, True, True, False]
    hidden = torch.arange(8, dtype=torch.float32).view(8, 1).repeat(1, 4)
    topk = torch.stack([labels, labels + 50], dim=1)
    ex = sequence_examples(hidden, labels, 3, mask, topk, hard_negatives=1)
    # rows: t = 3 (root = labels[3], the first answer token), 4, 5 (t = 6: labels[7] is not trained)
    assert ex.hidden[:, 0].tolist() == [3, 4, 5]
    assert ex.targets.tolist() == [[104, 105, 106], [105, 106, -1], [106, -1, -1]]
    assert ex.hard[0].tolist() == [103, 104, 105, 106]          # own top-1, then the label positions' top-1
    joined = MedusaExamples.cat([ex, ex], 3, 4)
    assert joined.seq.tolist() == [0, 0, 0, 1, 1, 1]


def test_walk_tau_crosses_accepted_stretches():
    # per-row accepted drafts on two sequences of 6 and 3 rows
    accepted = torch.tensor([2, 9, 9, 0, 1, 0, 3, 0, 0])
    seq = torch.tensor([0, 0, 0, 0, 0, 0, 1, 1, 1])
    # seq 0: row 0 (+3) -> row 3 (+1) -> row 4 (+2) -> past the end; seq 1: row 6 (+4) -> past
    assert walk_tau(accepted, seq) == pytest.approx((3 + 1 + 2 + 4) / 4)
    ranks = torch.tensor([[0, 1, 0], [0, 0, 0], [1, 0, 0], [0, 0, 2]])      # leading top-1 hits: 1, 3, 0, 2
    assert chain_tau(ranks) == pytest.approx(1 + (1 + 3 + 0 + 2) / 4)              # per position
    assert chain_tau(ranks, torch.zeros(4, dtype=torch.long)) == pytest.approx((2 + 1 + 3) / 3)   # rows 0, 2, 3
    ranks = torch.tensor([[0, 0, 1], [0, 1, 0], [2, 0, 0]])
    assert tree_tau(ranks, [[0], [0, 0], [0, 1], [2]], None) == pytest.approx(1 + (2 + 2 + 1) / 3)


# ---------------------------------------------------------------------------------------------- loss

def test_heads_start_as_the_targets_next_token_prediction():
    heads = MedusaHeads(3, 16)
    h = torch.randn(5, 16)
    assert torch.equal(heads(h), h.unsqueeze(1).expand(5, 3, 16))


def test_sampled_softmax_equals_the_full_one_when_the_candidates_cover_the_vocabulary():
    torch.manual_seed(0)
    vocab, H = 40, 8
    W = torch.randn(vocab, H)
    heads = MedusaHeads(3, H).randomize_(0.3)
    batch = MedusaExamples(torch.randn(6, H), torch.randint(vocab, (6, 3)), torch.arange(vocab).repeat(6, 1),
                           torch.zeros(6, dtype=torch.long))
    batch.targets[0, 2] = -1
    full, logs_full = medusa_loss(heads, W, batch, num_negatives=None)
    sampled, logs = medusa_loss(heads, W, batch, num_negatives=0)
    assert sampled.item() == pytest.approx(full.item(), rel=1e-5)
    assert logs["acc1"] == logs_full["acc1"]
    few = MedusaExamples(batch.hidden, batch.targets, torch.zeros(6, 0, dtype=torch.long), batch.seq)
    assert medusa_loss(heads, W, few, num_negatives=0)[0].item() < full.item()   # fewer classes, lower CE


def test_head_ranks_against_a_sort():
    torch.manual_seed(1)
    vocab, H = 30, 8
    W = torch.randn(vocab, H)
    heads = MedusaHeads(2, H).randomize_(0.5)
    ex = MedusaExamples(torch.randn(7, H), torch.randint(vocab, (7, 2)), torch.zeros(7, 0, dtype=torch.long),
                        torch.zeros(7, dtype=torch.long))
    ex.targets[3, 1] = -1
    ranks = head_ranks(heads, W, ex, chunk_rows=3)
    logits = heads(ex.hidden) @ W.t()
    for n in range(7):
        for k in range(2):
            t = int(ex.targets[n, k])
            want = -1 if t < 0 else int((logits[n, k].argsort(descending=True) == t).nonzero())
            assert ranks[n, k] == want


# ---------------------------------------------------------------------------------------------- the trainer

def _prompts(n: int, seed: int = 0):
    from specserve.drafters.train.data import Example

    rng = random.Random(seed)
    words = "the quick brown fox jumps over lazy dog hello world capital of France Paris is what".split()
    return [Example(id=f"p{i}", turns=[" ".join(rng.choice(words) for _ in range(rng.randint(3, 10)))],
                    source=f"s{i % 2}") for i in range(n)]


@pytest.fixture(scope="module")
def tiny_setup(tiny_llama_dir, tmp_path_factory):
    """Self-distilled teacher shards of the tiny Llama, and its TrainTarget."""
    from specserve.drafters.train import TrainData, TrainTarget
    from specserve.drafters.nets.checkpoint import target_fingerprint
    from specserve.drafters.train.data import ShardDataset, build_teacher_shards, self_distill_examples
    from specserve.engine.config import EngineConfig
    from specserve.engine.core import LLMEngine
    from specserve.engine.loader import load_model

    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", device="cpu", max_model_len=256,
                                    max_num_seqs=16))
    examples = self_distill_examples(engine, _prompts(60), max_tokens=48, progress=False)
    shards = tmp_path_factory.mktemp("medusa_shards")
    manifest = build_teacher_shards(engine.model, engine.tokenizer, examples, shards, max_len=256, top_k=4,
                                    shard_size=32, progress=False)
    data = TrainData(shards, manifest, ShardDataset(shards, split="train", eval_examples=12),
                     ShardDataset(shards, split="eval", eval_examples=12), examples)
    target = TrainTarget(loaded=load_model(str(tiny_llama_dir)), model=engine.model,
                         model_config=engine.model_config,
                         fingerprint=target_fingerprint(engine.model_config, engine.model),
                         device=torch.device("cpu"), dtype=torch.float32)
    return target, data


def test_fit_loss_falls_and_tau_rises(tiny_setup):
    from specserve.drafters.train.loop import TrainConfig
    from specserve.drafters.train.medusa import dataset_examples

    target, data = tiny_setup
    train = dataset_examples(data.train, 4)
    held = dataset_examples(data.held_back, 4)
    assert len(train) > 500 and len(held) > 100
    heads, result = fit_medusa(target.model, train, held, batch_size=64, num_negatives=256,
                               config=TrainConfig(epochs=3, lr=3e-3, progress=False, eval_at_start=True,
                                                  patience=None))
    first, last = result.loss_history[:5], result.loss_history[-5:]
    assert sum(last) / 5 < 0.9 * sum(first) / 5
    taus = [e["tau"] for e in result.eval_history]
    assert taus[-1] > taus[0]


def test_trainer_checkpoint_round_trip_and_refusal(tiny_setup, tmp_path, tiny_llama_dir, tiny_model_factory):
    from specserve.drafters import medusa  # noqa: F401  (registers the drafter)
    from specserve.drafters.base import make_drafter
    from specserve.drafters.train import get_trainer
    from specserve.drafters.nets.checkpoint import CheckpointMismatchError, load_checkpoint
    from specserve.engine.config import EngineConfig
    from specserve.engine.core import LLMEngine

    target, data = tiny_setup
    assert get_trainer("medusa") is train_medusa
    out = train_medusa({"out": str(tmp_path / "ckpt"), "epochs": 1, "batch_size": 64, "lr": 3e-3,
                        "num_negatives": 256, "progress": False, "tuned_nodes": 20}, target, data)
    tensors, meta = load_checkpoint(out, kind="medusa", fingerprint=target.fingerprint)
    assert tuple(tensors["weight"].shape) == (4, 64, 64) and tuple(tensors["bias"].shape) == (4, 64)
    assert meta.tau is not None and meta.tau > 1.0
    engine = meta.tau_details["engine"]                   # τ measured through the engine on held-back prompts
    assert engine["num_prompts"] == 8 and engine["tau"] == meta.tau and engine["num_accepted_tokens"] > 0
    order = meta.tree["choices"]
    assert 0 < len(order) <= 20 and tt.is_prefix_closed(order)
    assert json.loads(json.dumps(meta.tau_details))["tau_tuned"]

    kwargs = dict(target=target.model, model_config=target.model_config, device=torch.device("cpu"),
                  dtype=torch.float32, max_model_len=256, max_num_seqs=4)
    drafter = make_drafter("medusa", checkpoint=str(out), **kwargs)
    assert drafter.order == order                          # the tuned tree is used
    assert torch.equal(drafter.heads.weight, tensors["weight"].float())
    vocab = target.model_config.vocab_size                  # the training labels' ranking travels with it
    assert sorted(tensors["vocab_rank"].tolist()) == list(range(vocab))
    assert torch.equal(drafter.heads.vocab_rank, tensors["vocab_rank"].long())
    assert make_drafter("medusa", checkpoint=str(out), draft_vocab=50, **kwargs).vocab.size == 50
    assert drafter.target.lm_head_weight is target.model.lm_head_weight   # shared, not copied
    assert make_drafter("medusa", checkpoint=str(out), tree="chain", **kwargs).order == [[0], [0, 0], [0, 0, 0],
                                                                                         [0, 0, 0, 0]]

    other_dir = tiny_model_factory(tmp_path / "other", seed=7)
    with pytest.raises(CheckpointMismatchError, match="does not fit this target"):
        LLMEngine(EngineConfig(model=str(other_dir), dtype="float32", device="cpu", max_model_len=128,
                               drafters=("medusa",), drafter_options={"medusa": {"checkpoint": str(out)}}))
    with pytest.raises(ValueError, match="specserve train medusa"):
        make_drafter("medusa", **kwargs)                   # no checkpoint, none shipped for this target
