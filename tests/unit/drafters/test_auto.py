"""`--drafter auto`: which drafters it loads for a model and why, and what a request served by it
gets: the default model's output unchanged (greedy), each drafter's share in the request's stats."""

from __future__ import annotations

import json

import pytest

from specserve.drafters.auto import LOOKUP_DRAFTERS, MIN_TAU, auto_drafters
from specserve.drafters.nets.checkpoint import target_fingerprint
from specserve.engine.config import EngineConfig, ModelConfig
from specserve.engine.core import LLMEngine
from specserve.engine.errors import InvalidRequestError
from specserve.engine.loader import load_model
from specserve.engine.sampling_params import SamplingParams


def tiny_target(model_dir):
    """(ModelConfig, HF-named state dict) of the tiny model, what a fingerprint reads."""
    loaded = load_model(str(model_dir))
    return ModelConfig.from_hf(loaded.hf_config), loaded.state_dict


def write_meta(folder, kind: str, fingerprint: str, tau) -> None:
    folder.mkdir(parents=True)
    (folder / "meta.json").write_text(json.dumps({"kind": kind, "target_name": "t", "target_fingerprint": fingerprint,
                                                  "tau": tau}))


def test_a_model_without_a_fitting_checkpoint_gets_the_lookup_drafters(tiny_llama_dir, tmp_path):
    config, weights = tiny_target(tiny_llama_dir)
    write_meta(tmp_path / "eagle-other", "eagle", "0123456789abcdef", 3.0)   # another target's
    picked = auto_drafters(config, weights, root=tmp_path)
    assert [p.name for p in picked] == list(LOOKUP_DRAFTERS)
    assert all("lookup" in p.reason for p in picked)


def test_the_best_fitting_checkpoint_above_the_threshold_comes_first(tiny_llama_dir, tmp_path):
    config, weights = tiny_target(tiny_llama_dir)
    fp = target_fingerprint(config, weights)
    write_meta(tmp_path / "medusa", "medusa", fp, MIN_TAU + 0.1)
    write_meta(tmp_path / "eagle", "eagle", fp, MIN_TAU + 0.5)
    write_meta(tmp_path / "eagle-worse", "eagle", fp, MIN_TAU + 0.2)     # the kind's best one speaks for it
    write_meta(tmp_path / "falcon", "falcon", fp, MIN_TAU - 0.1)          # does not pay
    write_meta(tmp_path / "ctc", "ctc", fp, None)                         # never measured
    write_meta(tmp_path / "nope", "no-such-drafter", fp, 9.0)             # not a drafter of this build
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "meta.json").write_text("{")
    picked = auto_drafters(config, weights, root=tmp_path)
    assert [p.name for p in picked] == ["eagle", *LOOKUP_DRAFTERS]   # MAX_TRAINED = 1: eagle, not medusa
    assert "eagle/" in picked[0].reason and f"{MIN_TAU + 0.5:.2f}" in picked[0].reason


def test_auto_on_a_tiny_model_refuses_options_and_names_itself(tiny_llama_dir):
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", device="cpu", max_num_seqs=2,
                                    block_size=4, num_kv_blocks=64, max_model_len=64, drafters=("auto",),
                                    drafter_options={"mag": {"bigram": False}}))
    assert engine.auto_drafters == LOOKUP_DRAFTERS and engine.default_drafter == "auto"
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=2), drafter="auto",
                           drafter_options={"max_tokens": 3})
    assert err.value.param == "speculative.max_tokens"
    with pytest.raises(InvalidRequestError, match="loaded drafters: none, auto, ngram, mag"):
        engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=2), drafter="eagle")
    with pytest.raises(ValueError, match="drafter auto loads ngram, mag"):
        LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", device="cpu", max_num_seqs=2,
                               block_size=4, num_kv_blocks=64, max_model_len=64, drafters=("auto",),
                               drafter_options={"eagle": {"random_init": True}}))


PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number, then call it for n = 10.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "List three colours of the rainbow, then list them again in reverse order.",
    "Repeat after me three times: the quick brown fox jumps over the lazy dog.",
]


@pytest.mark.slow
def test_auto_on_the_default_model_loads_eagle3_and_the_lookups_and_changes_no_token(default_model):
    engine = LLMEngine(EngineConfig(model="default", dtype="float32", device="cpu", max_num_seqs=4,
                                    max_model_len=512, drafters=("auto",)), loaded=default_model)
    assert engine.auto_drafters == ("eagle3", "ngram", "mag")
    assert engine.default_drafter == "auto" and sorted(engine.drafters) == sorted(engine.auto_drafters)
    tok = engine.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                       return_dict=False) for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=48)
    outputs: dict[str, list[int]] = {}
    finals = {}
    for drafter in ("none", None):   # None: the server default, auto
        for i, p in enumerate(prompts):
            kwargs = {} if drafter is None else {"drafter": drafter}
            engine.add_request(f"{drafter}-{i}", p, params, **kwargs)
        while engine.has_unfinished_requests():
            for out in engine.step():
                outputs.setdefault(out.request_id, []).extend(t for d in out.outputs for t in d.token_ids)
                finals[out.request_id] = out
    for i in range(len(prompts)):
        assert outputs[f"None-{i}"] == outputs[f"none-{i}"]
    specs = [finals[f"None-{i}"].spec for i in range(len(prompts))]
    assert all(s.drafter == "auto" and set(s.parts) == set(engine.auto_drafters) for s in specs)
    # a request's tally by drafter adds up to its drafts, and the engine's per-drafter counters agree
    for s in specs:
        assert sum(p.num_draft_tokens for p in s.parts.values()) == s.num_draft_tokens
        assert sum(p.num_accepted_tokens for p in s.parts.values()) == s.num_accepted_tokens
    stats = engine.drafter_stats
    for name in engine.auto_drafters:
        assert stats[name].num_draft_tokens == sum(s.parts[name].num_draft_tokens for s in specs)
        assert stats[name].num_fallbacks == 0
    assert sum(s.num_accepted_tokens for s in specs) > 0
