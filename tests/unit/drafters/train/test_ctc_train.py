"""The ctc trainer: CTC targets against hand-worked spans, the dense training forward is the serving
drafter's arithmetic, accepted lengths and decoding walks by hand, the loss falls on tiny
self-distilled shards, and the checkpoint round-trips (and is refused for another target)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import draft_view

from specserve.drafters.base import make_drafter
from specserve.drafters.ctc import ctc_collapse
from specserve.drafters.nets.ctc import CTCDraftNet, load_net, shipped_checkpoint
from specserve.drafters.nets.checkpoint import CheckpointMismatchError, read_meta
from specserve.drafters.train.ctc import (FIELDS, accepted_in_tree, class_table, ctc_targets, fit_ctc,
                                          held_back_slots, selection_tau, train_ctc, walk_tau)
from specserve.drafters.train.loop import TrainConfig
from specserve.drafters.train.target import target_features
from specserve.engine.model import rope_tables
from specserve.engine.tree import TokenTree

EOS = 2


def test_ctc_targets_hand_worked():
    """Spans of L = 3 after each root in T = 4 slots: cut at the answer's end, before a token outside
    the vocabulary and to what fits T slots; a span cut by the data's end without EOS is dropped."""
    #            t:  0   1   2   3   4   5   6   7   8
    labels = torch.tensor([[10, 11, 12, 12, 12, 13, 99, 14, EOS],
                           [20, 21, 22, 23, 24, 25, 26, -100, -100]])
    # loss_mask[t]: the token at t+1 is an answer token; row 0 answers from position 1, row 1 from 2 and
    # is cut (no EOS) after position 5
    loss_mask = torch.tensor([[0, 1, 1, 1, 1, 1, 1, 1, 1],
                              [0, 0, 1, 1, 1, 1, 0, 0, 0]], dtype=torch.bool)
    vocab = torch.arange(320)
    class_of = class_table(vocab[vocab != 99], 319, 320)          # 99 is outside the vocabulary
    select, targets, lengths = ctc_targets(labels, loss_mask, class_of, label_len=3, num_slots=4, eos_ids=[EOS])
    ys = [targets[i, :n].tolist() for i, n in enumerate(lengths.tolist())]
    cls = lambda toks: [int(class_of[t]) for t in toks]    # noqa: E731
    assert select[0].tolist() == [False, True, True, True, True, True, True, True, False]
    assert ys[:7] == [
        cls([12, 12, 12])[:2],   # t=1: 12 12 needs 3 slots (a blank between), 12 12 12 needs 5 > 4: cut to 12 12
        cls([12, 12, 13]),       # t=2: 12 ε 12 13 fits 4 slots
        cls([12, 13]),           # t=3: 99 is outside the vocabulary: cut before it
        cls([13]),               # t=4
        [],                      # t=5: 99 first: nothing the drafter could emit
        cls([14, EOS]),          # t=6: the span ends with EOS (answer over): kept though shorter than 3
        cls([EOS]),              # t=7
    ]
    # row 1: position 2 has a full span; 3..5 run past the cut without EOS: dropped
    assert select[1].tolist() == [False, False, True, False, False, False, False, False, False]
    assert ys[7:] == [cls([23, 24, 25])]


def test_ctc_loss_of_a_target_is_minus_log_of_its_alignments():
    """F.ctc_loss as the trainer calls it is -log of the summed probability of every raw slot
    sequence that collapses to the target (brute force over a 3-class, 3-slot example)."""
    g = torch.Generator().manual_seed(0)
    logp = torch.randn(3, 3, generator=g).log_softmax(-1)           # T = 3 slots, classes {0, 1, blank = 2}
    for target in ([0], [0, 0], [0, 1], []):
        total = 0.0
        for a in range(27):
            raw = [a // 9, (a // 3) % 3, a % 3]
            if ctc_collapse([-1 if c == 2 else c for c in raw]) == target:
                total += float(torch.exp(sum(logp[i, c] for i, c in enumerate(raw))))
        tgt = torch.tensor([target + [0] * (2 - len(target))])
        loss = F.ctc_loss(logp[:, None], tgt, torch.tensor([3]), torch.tensor([len(target)]), blank=2,
                          reduction="none")
        assert float(loss) == pytest.approx(-torch.log(torch.tensor(total)).item(), rel=1e-5)


def test_accepted_in_tree_and_walk_tau_hand_worked():
    tree = TokenTree([9, 5, 6, 7, 8], [-1, 0, 0, 1, 3])             # 9 -> {5 -> 7 -> 8, 6}
    assert accepted_in_tree(tree, [5, 7, 8, 1]) == 3
    assert accepted_in_tree(tree, [5, 7, 1]) == 2
    assert accepted_in_tree(tree, [6, 7]) == 1
    assert accepted_in_tree(tree, [4]) == 0 and accepted_in_tree(None, [5]) == 0
    # positions 0..5 of one sequence: from 0 accept 2 (commit 3) -> 3: accept 0 -> 4: accept 1 -> past 5
    rows = [("a", t, a) for t, a in enumerate([2, 9, 9, 0, 1, 9])] + [("b", 7, 0)]
    assert walk_tau(rows) == pytest.approx((3 + 1 + 2 + 1) / 4)


def perturbed_net(target, seed: int = 0, scale: float = 0.05, num_slots: int = 4) -> CTCDraftNet:
    net = CTCDraftNet.from_target(target.model_config, target.model, num_slots=num_slots, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return net


def test_dense_training_forward_is_the_serving_drafters_arithmetic(tiny_target):
    """The slot log-probabilities of forward_dense (every position of a padded batch at once) equal
    the serving drafter's (rows caught up in two observe chunks, slots over the cached rows)."""
    net = perturbed_net(tiny_target)
    cfg, model = tiny_target.model_config, tiny_target.model
    g = torch.Generator().manual_seed(3)
    lengths = [14, 9]
    seqs = [torch.randint(3, cfg.vocab_size, (n,), generator=g).tolist() for n in lengths]
    feats = target_features(model, seqs)
    width = max(lengths)
    f = torch.zeros(2, width, cfg.hidden_size)
    ids = torch.zeros(2, width, dtype=torch.long)
    for b, (s, h) in enumerate(zip(seqs, feats)):
        f[b, :len(s)] = h
        ids[b, :len(s)] = torch.tensor(s)
    e = F.pad(model.embed(ids[:, 1:]).detach(), (0, 0, 0, 1))
    cos, sin = rope_tables(cfg, 64, torch.device("cpu"))
    select = torch.zeros(2, width, dtype=torch.bool)
    select[0, [3, 12]] = True                                    # drafting after rows 3 and 12 of sequence 0
    select[1, 7] = True
    with torch.no_grad():
        dense = net.log_probs(net.forward_dense(f, e, select, cos, sin), model.lm_head_weight)
    drafter = make_drafter("ctc", target=model, model_config=cfg, device=torch.device("cpu"), dtype=torch.float32,
                           max_model_len=64, net=net)
    served = []
    for (b, t) in select.nonzero().tolist():
        seq = draft_view(10 * b + t, seqs[b][:t + 2])                  # the root is x_{t+1}
        drafter.start(seq)
        drafter.observe([seq], [(0, feats[b][:2])])
        drafter.observe([seq], [(2, feats[b][2:t + 1])])
        assert drafter.catch_up([seq]) == [True]
        with torch.no_grad():
            served.append(drafter.slot_log_probs([seq])[0])
    torch.testing.assert_close(dense, torch.stack(served), atol=1e-5, rtol=1e-5)


def test_loss_falls_and_held_back_tau_is_the_engines(tiny_distill, tiny_llama_dir):
    """A few epochs on the tiny target's own greedy answers: the CTC loss falls; through the engine the
    trained drafter decodes exactly the plain greedy tokens, and the offline decoding walk of the
    serving drafter's trees predicts the engine's τ on those answers."""
    from helpers import make_llm_engine, run_requests

    from specserve.drafters.train.data import render_prompt
    from specserve.engine.sampling_params import SamplingParams

    target, data = tiny_distill
    batches = lambda e: data.train.batches(512, epoch=e, fields=FIELDS)     # noqa: E731
    held = list(data.held_back.batches(1024, shuffle=False, fields=FIELDS))
    config = TrainConfig(epochs=8, lr=1e-2, warmup_steps=2, patience=None, progress=False, log_every=1)
    fit = fit_ctc(target.model, batches, held, config=config, rank=None, vocab=0, num_slots=4, label_len=3,
                  eos_ids=[EOS], max_len=256)
    losses = fit.result.loss_history
    assert len(losses) >= 40 and sum(losses[-3:]) < 0.85 * sum(losses[:3])
    taus = [e["tau"] for e in fit.result.eval_history]
    assert taus[-1] > 1.3 and taus[-1] > taus[0] + 0.1
    # the engine on the held-back prompts (greedy, budget 8): its τ is the offline walk's
    prompts = [render_prompt(target.tokenizer, ex.turns) for ex in data.held_back_examples()]
    engine = make_llm_engine(tiny_llama_dir, ("ctc",),
                             {"ctc": {"net": fit.net}}, max_num_seqs=8, max_num_batched_tokens=512,
                             num_kv_blocks=800, max_model_len=256, num_speculative_tokens=8,
                             max_draft_tokens_per_step=64)
    params = SamplingParams(temperature=0.0, max_tokens=48)
    got = run_requests(engine, prompts, params, stagger=False)
    plain = make_llm_engine(tiny_llama_dir, max_num_seqs=8, max_num_batched_tokens=512, num_kv_blocks=800,
                            max_model_len=256)
    assert got == run_requests(plain, prompts, params, stagger=False)          # greedy: lossless when trained too
    stats = engine.get_stats().drafters["ctc"]
    engine_tau = (stats.num_accepted_tokens + stats.num_steps) / stats.num_steps
    slots = held_back_slots(fit.net, held, embed=target.model.embed, vocab_weight=fit.vocab_weight,
                            vocab_ids=None, rope=fit.rope, k=4)
    offline = selection_tau(slots, top_k=4, candidates=64, budget=8)
    assert engine_tau > 1.3
    assert engine_tau == pytest.approx(offline, abs=0.05)


def test_trainer_checkpoint_round_trip_and_refusal(tiny_distill, tmp_path, tiny_model_factory):
    target, data = tiny_distill
    out = train_ctc({"out": tmp_path / "ckpt", "epochs": 1, "lr": 1e-3, "train_batch_tokens": 512, "max_len": 256,
                     "progress": False, "final_positions": 256, "engine_tau_prompts": 0, "num_slots": 4,
                     "label_len": 3}, target, data)
    meta = read_meta(out)
    assert meta.kind == "ctc" and meta.target_fingerprint == target.fingerprint
    assert meta.hyperparams["num_slots"] == 4 and meta.hyperparams["label_len"] == 3
    assert meta.hyperparams["vocab"] == target.model_config.vocab_size            # min(4096, 320)
    sel = meta.hyperparams["selection"]
    assert sel["top_k"] >= 1 and sel["candidates"] >= 1 and meta.tau >= 1.0
    net, _ = load_net(out, model_config=target.model_config, target=target.model)
    assert net.vocab_rank is not None and net.num_slots == 4
    drafter = make_drafter("ctc", target=target.model, model_config=target.model_config, device=torch.device("cpu"),
                           dtype=torch.float32, max_model_len=128, checkpoint=str(out))
    assert (drafter.top_k, drafter.num_candidates) == (sel["top_k"], sel["candidates"])
    for p, q in zip(drafter.net.parameters(), net.parameters()):
        assert torch.equal(p, q)
    assert shipped_checkpoint(target.model_config, target.model, root=tmp_path) == out
    # another target (same shapes, other weights) is refused
    from specserve.drafters.train.pipeline import prepare_target
    from specserve.engine.loader import load_model

    other = prepare_target(loaded=load_model(str(tiny_model_factory(tmp_path / "other", seed=7))), device="cpu",
                           dtype="float32")
    with pytest.raises(CheckpointMismatchError):
        load_net(out, model_config=other.model_config, target=other.model)
