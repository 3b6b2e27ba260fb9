"""Dynamic MCSD (MCSD+) in the draft-model drafters: fork k-configurations, draft masks sliced from
one full-depth mask, and early stopping by a decision model. Greedy output stays exactly plain
decoding's; the masks the draft forwards use equal freshly built ones; a decision model trained
on "everything rejected" stops every tree after one level, one trained on "everything accepted"
drafts to full depth, and one in between stops some trees early."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specserve.drafters.draft_model import parse_k_config
from specserve.drafters.nets.checkpoint import CheckpointMismatchError
from specserve.drafters.nets.mcsd_decision import DecisionModel, load_decision, save_decision
from specserve.drafters.train.mcsd_decision import fit_decision, log_outcomes
from specserve.engine.sampling_params import SamplingParams
from specserve.engine.sequence import DraftRequest
from specserve.engine.tree import TreeTemplate, ancestor_mask, build_tree_buffers, tree_depths

from helpers import make_llm_engine, run_requests

FORK = "fork:3,4"          # 3 chains of depth 4: 12 draft nodes
ENGINE = dict(max_num_seqs=5, num_speculative_tokens=12, max_draft_tokens_per_step=64, max_model_len=128,
              num_kv_blocks=400)


def prompts(n=5, seed=11):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 320, (k,), generator=g).tolist() for k in (5, 17, 9, 30, 12)[:n]]


def fork_engine(model_dir, drafter="draft_model", **options):
    opts = {"k_config": FORK, **options}
    if drafter == "draft_model":
        opts.setdefault("draft_layers", 1)
    else:
        opts.update(random_init=True, num_layers=1)
    return make_llm_engine(model_dir, [drafter], {drafter: opts}, **ENGINE)


# ---- decision checkpoints trained on features logged through the engine -------------------------------

@pytest.fixture(scope="module")
def logged(tiny_llama_dir):
    """Features and verification outcomes of a static fork over the tiny Llama (draft: its first layer)."""
    eng = fork_engine(tiny_llama_dir)
    log = log_outcomes(eng, "draft_model", prompts() * 2, max_tokens=24, temperature=0.0)
    assert len(log) > 300
    return eng, log.tensors()


@pytest.fixture(scope="module")
def decisions(logged, tmp_path_factory):
    """Checkpoint folders: type 2 on 'all rejected' / 'all accepted' labels, and types 1 and 2 on
    'accepted iff the draft's top-1 probability is above its median' (some chains continue, some stop)."""
    eng, rows = logged
    target_fp = _target_fingerprint(eng)
    draft = {"drafter": "draft_model", "fingerprint": eng.drafters["draft_model"].draft_fingerprint()}
    top1 = rows["topk"][:, 0]
    median = (top1 > top1.median()).float()
    root = tmp_path_factory.mktemp("decisions")
    out = {}
    for name, t, y in [("reject", 2, torch.zeros(len(top1))), ("accept", 2, torch.ones(len(top1))),
                       ("median2", 2, median), ("median1", 1, median)]:
        x = rows["hidden"] if t == 1 else rows["topk"]
        torch.manual_seed(0)
        model = DecisionModel(t, x.shape[1], 32)
        fit_decision(model, x, y, epochs=40, lr=3e-3, batch_size=256)
        out[name] = str(save_decision(root / name, model, target_name="tiny", target_fingerprint=target_fp,
                                      draft=draft))
    return out


def _target_fingerprint(eng):
    from specserve.drafters.nets.checkpoint import target_fingerprint

    return target_fingerprint(eng.model_config, eng.model)


# ---- options ------------------------------------------------------------------------------------------

def test_fork_k_configuration():
    assert parse_k_config("fork:4,5") == (4, 1, 1, 1, 1)
    assert parse_k_config("fork:1,3") == parse_k_config("chain:3")
    assert parse_k_config(" fork: 2 , 1") == (2,)
    for bad in ("fork:0,3", "fork:3,0", "fork:4", "fork:a,b", "fork:2,3,4"):
        with pytest.raises(ValueError, match="fork"):
            parse_k_config(bad)


def test_decision_options_are_validated(tiny_llama_dir, decisions):
    with pytest.raises(ValueError, match="decision_threshold needs"):
        fork_engine(tiny_llama_dir, decision_threshold=0.5)
    for bad in (1.5, -0.1, True):
        with pytest.raises(ValueError, match="decision_threshold must be"):
            fork_engine(tiny_llama_dir, decision=decisions["reject"], decision_threshold=bad)
    # a folder holding checkpoints is named in the error
    with pytest.raises(FileNotFoundError, match="reject"):
        fork_engine(tiny_llama_dir, decision=str(Path(decisions["reject"]).parent))
    # the shipped decision models are for the default target's student only
    with pytest.raises(ValueError, match="no type2 MCSD decision model ships"):
        fork_engine(tiny_llama_dir, decision="type2")
    # type 1 reads one draft model's hidden states: refused for another draft model of the target
    with pytest.raises(CheckpointMismatchError, match="another draft model"):
        fork_engine(tiny_llama_dir, decision=decisions["median1"], draft_layers=2)
    # type 2 reads distributions: it serves another draft model of the same target (the student)
    eng = fork_engine(tiny_llama_dir, "student", decision=decisions["median2"])
    assert eng.drafters["student"].decision.decision_type == 2


def test_decision_checkpoint_is_refused_for_another_target(tiny_model_factory, decisions, tmp_path):
    other = tiny_model_factory(tmp_path / "other", seed=5)
    with pytest.raises(CheckpointMismatchError, match="does not fit this target"):
        make_llm_engine(other, ["draft_model"], {"draft_model": {"k_config": FORK, "draft_layers": 1,
                                                                 "decision": decisions["median2"]}}, **ENGINE)


def test_checkpoint_round_trip(decisions, logged):
    _, rows = logged
    model = load_decision(decisions["median1"])
    again = load_decision(decisions["median1"])
    x = rows["hidden"][:50]
    assert model.decision_type == 1 and len(model.mlp) == 5          # three linear layers
    assert len(load_decision(decisions["median2"]).mlp) == 3          # two linear layers
    torch.testing.assert_close(model.accept_probability(x), again.accept_probability(x))


# ---- the sliced mask ------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", ["fork:4,5", "4,2,2,1", "forest 3 chain:3"])
def test_sliced_mask_equals_a_freshly_built_one(tiny_llama_dir, shape):
    """Every level-major cut's mask is the top-left square of the full-depth mask, and every level's
    rows are the slice of it, equal to what engine.tree derives from the cut tree itself."""
    if shape.startswith("forest"):
        eng = fork_engine(tiny_llama_dir, k_config="chain:3", target_init_width=3)
        template = eng.drafters["draft_model"].forests[3]
    else:
        eng = fork_engine(tiny_llama_dir, k_config=shape)
        template = eng.drafters["draft_model"].template
    drafter = eng.drafters["draft_model"]
    parents = list(template.parents)
    depths = tree_depths(parents)
    assert drafter.masks[template].shape == (len(parents), len(parents))
    for d in range(max(depths) + 1):
        end = max(i for i in range(len(parents)) if depths[i] <= d) + 1
        fresh = build_tree_buffers(parents[:end]).mask
        assert torch.equal(drafter.sliced_mask(template, 0, end), fresh)
        first = min(i for i in range(len(parents)) if depths[i] == d)
        rows = list(range(first, end))
        assert torch.equal(drafter.sliced_mask(template, first, end), ancestor_mask(parents[:end], rows))


def test_the_masks_used_while_stopping_early_equal_fresh_ones(tiny_llama_dir, decisions):
    """Capture the tree masks the draft forwards hand to the attention while a decision model stops
    some sequences early: each equals the rows of the freshly built mask of the tree it returned."""
    eng = fork_engine(tiny_llama_dir, decision=decisions["median2"])
    drafter = eng.drafters["draft_model"]
    captured = []
    metadata = drafter.kv.metadata

    def spy(seq_ids, starts, qlens, masks=None):
        if masks is not None:
            captured.append((list(seq_ids), [m.clone() for m in masks]))
        return metadata(seq_ids, starts, qlens, masks)

    drafter.kv.metadata = spy
    params = SamplingParams(temperature=0.0)
    seqs = [DraftRequest(700 + i, tuple(p), len(p), params) for i, p in enumerate(prompts())]
    for s in seqs:
        drafter.start(s)
    trees = drafter.propose(seqs, [12] * len(seqs))
    depth = {s.seq_id: max(tree_depths(t.parents)) for s, t in zip(seqs, trees)}
    by_id = {s.seq_id: t for s, t in zip(seqs, trees)}
    checked = 0
    for seq_ids, masks in captured:
        for sid, m in zip(seq_ids, masks):
            end, n = m.shape[1], m.shape[0]
            assert end <= by_id[sid].num_nodes    # a fed level is in the returned tree
            assert torch.equal(m, build_tree_buffers(by_id[sid].parents[:end]).mask[end - n:end])
            checked += 1
    assert checked > 0
    assert len({d for d in depth.values()}) > 1, depth     # some stopped early, some went on


# ---- early stopping ---------------------------------------------------------------------------------------

def _propose_depths(drafter, budget=12):
    params = SamplingParams(temperature=0.0)
    seqs = [DraftRequest(800 + i, tuple(p), len(p), params) for i, p in enumerate(prompts())]
    for s in seqs:
        drafter.start(s)
    trees = drafter.propose(seqs, [budget] * len(seqs))
    for s in seqs:
        drafter.finish(s)
    return [max(tree_depths(t.parents)) for t in trees], trees


def test_trained_decision_models_stop_as_their_labels_say(tiny_llama_dir, decisions):
    """'All rejected' stops every tree after its first level (the fork's W depth-1 tokens, the
    level-major prefix); 'all accepted' drafts every chain to full depth, as the static fork does."""
    static = fork_engine(tiny_llama_dir).drafters["draft_model"]
    full, static_trees = _propose_depths(static)
    assert full == [4] * 5
    reject = fork_engine(tiny_llama_dir, decision=decisions["reject"]).drafters["draft_model"]
    depths, trees = _propose_depths(reject)
    assert depths == [1] * 5
    for t, s in zip(trees, static_trees):                        # the same first level, then nothing
        assert t.num_nodes == 4 and t.tokens == s.tokens[:4] and t.parents == s.parents[:4]
    assert reject.mean_stop_depth == 1.0
    accept = fork_engine(tiny_llama_dir, decision=decisions["accept"]).drafters["draft_model"]
    depths, trees = _propose_depths(accept)
    assert depths == [4] * 5 and [t.tokens for t in trees] == [t.tokens for t in static_trees]
    # β = 1 stops whatever the model says; β = 0 never stops
    assert _propose_depths(fork_engine(tiny_llama_dir, decision=decisions["accept"],
                                       decision_threshold=1.0).drafters["draft_model"])[0] == [1] * 5
    assert _propose_depths(fork_engine(tiny_llama_dir, decision=decisions["reject"],
                                       decision_threshold=0.0).drafters["draft_model"])[0] == [4] * 5


# ---- losslessness through the engine -----------------------------------------------------------------

# type 1 is tied to the draft model it was trained on (draft_model's first layer): not for the student
@pytest.mark.parametrize("drafter,decision", [("draft_model", None), ("draft_model", "median1"),
                                              ("draft_model", "median2"), ("draft_model", "reject"),
                                              ("student", None), ("student", "median2"), ("student", "reject")])
def test_dynamic_mcsd_greedy_is_lossless(tiny_llama_dir, decisions, decision, drafter):
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    plain = run_requests(make_llm_engine(tiny_llama_dir, **ENGINE), prompts(), params)
    options = {} if decision is None else {"decision": decisions[decision]}
    eng = fork_engine(tiny_llama_dir, drafter, **options)
    assert run_requests(eng, prompts(), params) == plain
    d = eng.drafters[drafter]
    stats = eng.get_stats().drafters[drafter]
    assert stats.num_steps > 0 and stats.num_fallbacks == 0
    if decision == "reject":
        assert d.mean_stop_depth == 1.0
    elif decision is not None:
        assert 1.0 < d.mean_stop_depth < 4.0, d.mean_stop_depth   # stopped early on some steps only
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks
    assert d.blocks.num_free_blocks == d.blocks.num_blocks


def test_dynamic_forest_of_target_initialised_roots_runs(tiny_llama_dir, decisions):
    """W target-initialised roots each followed by a chain (the lossy opt-in, sampled requests) with
    early stopping: exact lengths, trees that are forests, some stopped early; greedy requests in
    the same batch stay plain decoding's."""
    eng = fork_engine(tiny_llama_dir, k_config="chain:4", target_init_width=3, decision=decisions["median2"])
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = run_requests(make_llm_engine(tiny_llama_dir, **ENGINE), prompts(2), greedy)
    got = run_requests(eng, prompts(2), greedy)
    assert got == plain
    sampled = run_requests(eng, prompts(3, seed=3), SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True),
                           prefix="s")   # unseeded: seeded requests never get target-initialised roots
    assert all(len(v) == 24 for v in sampled.values())
    assert 1.0 < eng.drafters["draft_model"].mean_stop_depth < 4.0


# ---- the embedded SmolLM2 with its shipped student -------------------------------------------------------

@pytest.mark.slow
def test_dynamic_mcsd_on_the_default_model_is_lossless(default_model, tmp_path):
    """SmolLM2-135M (fp32) with the shipped student drafting a fork of 4 chains of depth 4: decision
    models of both types trained (on features logged through the engine) on the rule 'accepted iff
    the draft's top-1 probability is above its median' stop some trees early and not others, the
    shipped decision models load by type, and greedy output is plain decoding's token for token."""
    from specserve.drafters.nets.checkpoint import target_fingerprint
    from specserve.engine.config import EngineConfig
    from specserve.engine.core import LLMEngine

    texts = ["What is the capital of France?", "Write a Python function that reverses a string.",
             "List three colours of the rainbow.", "Repeat after me: the quick brown fox jumps over the lazy dog."]

    def engine(drafter_options):
        return LLMEngine(EngineConfig(model="default", dtype="float32", device="cpu", max_num_seqs=4,
                                      max_model_len=512, drafters=("none", "student"), num_speculative_tokens=16,
                                      max_draft_tokens_per_step=64, draft_budget="fixed",
                                      drafter_options={"student": {"k_config": "fork:4,4", **drafter_options}}),
                         loaded=default_model)

    static = engine({})
    tok = static.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, return_dict=False) for t in texts]
    rows = log_outcomes(static, "student", prompts, max_tokens=24, temperature=0.0).tensors()
    top1 = rows["topk"][:, 0]
    rule = (top1 > top1.median()).float()
    paths = {}
    for t in (1, 2):
        x = rows["hidden"] if t == 1 else rows["topk"]
        torch.manual_seed(0)
        model = DecisionModel(t, x.shape[1], 32)
        fit_decision(model, x, rule, epochs=60, lr=3e-3, batch_size=128)
        paths[t] = str(save_decision(tmp_path / f"type{t}", model, target_name="SmolLM2",
                                     target_fingerprint=target_fingerprint(static.model_config, static.model),
                                     draft={"fingerprint": static.drafters["student"].draft_fingerprint()}))
    params = SamplingParams(temperature=0.0, max_tokens=32)

    def generate(eng, drafter):
        for i, p in enumerate(prompts):
            eng.add_request(f"{drafter}-{i}", p, params, drafter=drafter)
        got: dict[str, list[int]] = {}
        while eng.has_unfinished_requests():
            for out in eng.step():
                for d in out.outputs:
                    got.setdefault(out.request_id, []).extend(d.token_ids)
        return [got[f"{drafter}-{i}"] for i in range(len(prompts))]

    plain = generate(static, "none")
    assert all(len(t) > 5 for t in plain)
    for t in (1, 2, "type1", "type2"):          # typeN: the shipped decision models of the shipped student
        eng = engine({"decision": paths.get(t, t)})
        assert generate(eng, "student") == plain, t
        depth = eng.drafters["student"].mean_stop_depth
        assert (1.0 < depth < 4.0) if t in paths else (1.0 <= depth <= 4.0), (t, depth)
        assert eng.get_stats().drafters["student"].num_fallbacks == 0
