"""The eagle3 drafter (eagle's tree drafter whose real rows read the target's low/mid/high layers):
the engine keeps the layers it declares, greedy output equals plain decoding with drafts accepted,
its real rows are computed from the target's true intermediate layers, a checkpoint round-trips and
serves, sampled output follows the target's law."""

from __future__ import annotations

import pytest
import torch
from helpers import (empirical_first_two_law, exact_first_two_law, feature_drafter_engine, run_requests,
                     teacher_batch, total_variation, varied_prompts_and_plain)

from specserve.drafters.base import make_drafter
from specserve.drafters.nets.checkpoint import CheckpointMismatchError
from specserve.drafters.nets.eagle3 import Eagle3Head, default_layers, load_head, save_head
from specserve.drafters.train.data import label_ranking
from specserve.drafters.train.eagle3 import fit_eagle3
from specserve.drafters.train.loop import TrainConfig
from specserve.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)

make_engine = feature_drafter_engine


def tiny_model(model_dir):
    from specserve.drafters.train.pipeline import prepare_target

    return prepare_target(str(model_dir), device="cpu", dtype="float32", max_positions=256).model


@pytest.fixture(scope="module")
def prompts_and_plain(tiny_llama_dir):
    """Prompts of different lengths and their plain greedy continuations."""
    return varied_prompts_and_plain(tiny_llama_dir, GREEDY)


@pytest.fixture(scope="module")
def trained_head(tiny_llama_dir, prompts_and_plain) -> Eagle3Head:
    """A head trained with training-time test in a few seconds on the tiny target's own greedy
    continuations of the test prompts, over layers (0, 1): the embeddings and the first layer."""
    prompts, plain = prompts_and_plain
    model = tiny_model(tiny_llama_dir)
    seqs = [p + plain[f"r{i}"] for i, p in enumerate(prompts)]
    batch = teacher_batch(model, seqs, [len(p) for p in prompts], layers=(0, 1))
    config = TrainConfig(epochs=100, lr=1e-2, warmup_steps=5, patience=None, progress=False, device="cpu")
    head = Eagle3Head.from_target(model.cfg, model, layers=(0, 1))
    head = fit_eagle3(model, [batch], None, config=config, head=head, negatives=None, max_len=128).head
    head.set_vocab_rank(label_ranking([batch], model.cfg.vocab_size)[0])
    return head


def test_default_layers_are_eagle3s():
    assert default_layers(30) == (2, 15, 27) and default_layers(32) == (2, 16, 29)
    assert default_layers(2) == (0, 1, 2)


@pytest.mark.parametrize("shape", [{}, {"depth": 4, "top_k": 1, "width": 1}, {"draft_vocab": 100}],
                         ids=["default", "chain", "draft_vocab"])
def test_greedy_is_lossless_and_drafts_are_accepted(tiny_llama_dir, prompts_and_plain, trained_head, shape):
    prompts, plain = prompts_and_plain
    engine = make_engine(tiny_llama_dir, ["eagle3"], {"eagle3": {"head": trained_head, **shape}})
    assert engine.features.capture_layers == (0, 1)           # the engine keeps the layers the head reads
    assert run_requests(engine, prompts, GREEDY) == plain
    stats = engine.get_stats().drafters["eagle3"]
    assert stats.num_fallbacks == 0
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0.2 * sum(len(v) for v in plain.values())
    drafter = engine.drafters["eagle3"]
    assert drafter.blocks.num_free_blocks == drafter.blocks.num_blocks and not drafter.state
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_beside_other_feature_drafters_and_untrained(tiny_llama_dir, prompts_and_plain, trained_head):
    """Two feature readers at once: the store keeps the union of their layers; an untrained head over
    the default layers is lossless too."""
    prompts, plain = prompts_and_plain
    engine = make_engine(tiny_llama_dir, ["eagle3", "eagle"], {"eagle3": {"head": trained_head},
                                                                "eagle": {"random_init": True}})
    assert run_requests(engine, prompts, GREEDY) == plain
    engine = make_engine(tiny_llama_dir, ["eagle3"], {"eagle3": {"random_init": True}})
    assert engine.features.capture_layers == (0, 1, 2)
    assert run_requests(engine, prompts, GREEDY) == plain
    assert engine.get_stats().drafters["eagle3"].num_steps > 0


def test_real_rows_read_the_targets_intermediate_layers(tiny_llama_dir, prompts_and_plain, trained_head):
    """After decoding, the drafter's KV rows equal those of the head run over the target's layers 0
    and 1 as transformers computes them (hidden_states[0] and [1]) -- the feature store kept the
    right layers at the right positions."""
    import transformers

    from specserve.engine.model import rope_tables

    engine = make_engine(tiny_llama_dir, ["eagle3"], {"eagle3": {"head": trained_head}})
    drafter = engine.drafters["eagle3"]
    prompts = prompts_and_plain[0][:3]
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True))
    for _ in range(20):
        engine.step()
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    cos, sin = rope_tables(engine.model_config, 256, torch.device("cpu"))
    checked = 0
    for seq in (s for r in engine.requests.values() for s in r.seqs):
        n = drafter.state[seq.seq_id].kv_len                 # rows 0..n-1: (layers at p, token p+1)
        assert n > 20
        with torch.no_grad():
            states = hf(torch.tensor([seq.token_ids[:n]]), output_hidden_states=True).hidden_states
            g = trained_head.lift_features(torch.stack([states[0][0], states[1][0]], dim=1))
            h = trained_head.fuse(g, engine.model.embed(torch.tensor(seq.token_ids[1:n + 1])))
            _, k, v = trained_head.layer.dense_qkv(h[None], cos[:n], sin[:n])
        ours = drafter.cache.kv[:, 0, drafter.blocks.slots(seq.seq_id, 0, n)]
        torch.testing.assert_close(ours[0].reshape(n, -1), k[0].reshape(n, -1), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(ours[1].reshape(n, -1), v[0].reshape(n, -1), atol=1e-4, rtol=1e-4)
        checked += 1
    assert checked == 3


def test_checkpoint_round_trip_and_refusals(tiny_llama_dir, prompts_and_plain, trained_head, tmp_path):
    prompts, plain = prompts_and_plain
    model = tiny_model(tiny_llama_dir)
    save_head(tmp_path / "e3", trained_head, model_config=model.cfg, target=model, tau=2.0)
    loaded, meta = load_head(tmp_path / "e3", model_config=model.cfg, target=model)
    assert loaded.layers == (0, 1) and meta.kind == "eagle3" and meta.hyperparams["layers"] == [0, 1]
    engine = make_engine(tiny_llama_dir, ["eagle3"], {"eagle3": {"checkpoint": str(tmp_path / "e3")}})
    assert engine.features.capture_layers == (0, 1)
    assert run_requests(engine, prompts, GREEDY) == plain
    with pytest.raises(CheckpointMismatchError, match="not a 'eagle' one"):
        from specserve.drafters.nets.eagle import load_head as load_eagle
        load_eagle(tmp_path / "e3", model_config=model.cfg, target=model)
    with pytest.raises(ValueError, match="specserve train eagle3"):
        make_engine(tiny_llama_dir, ["eagle3"])
    with pytest.raises(ValueError, match="inside an engine"):
        make_drafter("eagle3", target=model, model_config=model.cfg, device=torch.device("cpu"),
                     dtype=torch.float32, max_model_len=128, random_init=True)
    with pytest.raises(ValueError, match="layers"):
        make_engine(tiny_llama_dir, ["eagle3"], {"eagle3": {"random_init": True, "layers": "0,7"}})


PROMPT = [7, 100, 42, 9, 250, 31, 7, 100, 42, 9, 250, 31, 7, 100]
SAMPLING = SamplingParams(temperature=1.0, top_k=3, max_tokens=4, ignore_eos=True)
TRIALS = 1500
TV_BOUND = 0.06
SAMPLING_OPTIONS = {"random_init": True, "init": "last", "top_k": 2, "width": 2, "depth": 3}


def test_sampled_tokens_follow_the_target_law(peaky_target):
    emp, engine = empirical_first_two_law(peaky_target, "eagle3", SAMPLING_OPTIONS, PROMPT, SAMPLING, TRIALS)
    stats = engine.get_stats().drafters["eagle3"]
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert total_variation(emp, exact_first_two_law(peaky_target, PROMPT, SAMPLING)) < TV_BOUND


def test_the_law_test_sees_a_wrong_residual(peaky_target, monkeypatch):
    from specserve.engine import verify

    monkeypatch.setattr(verify, "residual_rows", lambda p, q: p)
    emp, _ = empirical_first_two_law(peaky_target, "eagle3", SAMPLING_OPTIONS, PROMPT, SAMPLING, TRIALS)
    assert total_variation(emp, exact_first_two_law(peaky_target, PROMPT, SAMPLING)) > TV_BOUND
