"""Speculative decoding through the whole engine: greedy output with any drafter equals plain
decoding token for token (fp32), trees of different shapes ride in one batched forward with plain
and prefilling sequences, KV pruning keeps the accepted path, failures fall back."""

from __future__ import annotations

import random
from functools import partial

import pytest
import torch
from helpers import make_llm_engine, run_requests

from specserve.drafters.base import Drafter, register
from specserve.engine.errors import InvalidRequestError
from specserve.engine.sampling_params import SamplingParams
from specserve.engine.tree import NO_PARENT, TokenTree

EXPECTED: dict[tuple[int, ...], list[int]] = {}   # prompt -> plain greedy continuation (oracle for drafters)


@register("test_oracle_tree")
class OracleTreeDrafter(Drafter):
    """Knows the plain greedy continuation; hides it at a random sibling position inside a random
    tree, sometimes with a wrong token, so accepted paths have non-contiguous node indices."""

    def __init__(self, ctx, *, vocab_size: int = 0):
        self.vocab = ctx.model_config.vocab_size
        self.rng = random.Random(0)

    def propose(self, seqs, budgets):
        trees = []
        for seq, budget in zip(seqs, budgets):
            truth = EXPECTED[tuple(seq.token_ids[:seq.num_prompt_tokens])][seq.num_output_tokens:]
            tokens, parents = [seq.token_ids[-1]], [NO_PARENT]
            cur = 0
            for depth, tok in enumerate(truth):
                width = self.rng.randint(1, 3)
                pos = self.rng.randrange(width)
                nxt = None
                for w in range(width):
                    if len(tokens) - 1 >= budget:
                        break
                    t = tok if w == pos and self.rng.random() > 0.15 else self.rng.randrange(self.vocab)
                    tokens.append(t)
                    parents.append(cur)
                    if w == pos:
                        nxt = len(tokens) - 1
                if nxt is None:
                    break
                cur = nxt
            trees.append(TokenTree(tokens, parents) if len(tokens) > 1 else None)
        return trees


@register("test_raises")
class RaisingDrafter(Drafter):
    def propose(self, seqs, budgets):
        raise RuntimeError("drafter bug")


@register("test_bad_root")
class BadRootDrafter(Drafter):
    def propose(self, seqs, budgets):
        return [TokenTree([seq.token_ids[-1] + 1, 5], [NO_PARENT, 0]) for seq in seqs]


# this file's engine: 160 KV blocks, context 128 (the rest as in helpers.make_llm_engine)
make_engine = partial(make_llm_engine, num_kv_blocks=160, max_model_len=128)


@pytest.fixture(scope="module")
def prompts_and_plain(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, [])
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, engine.model_config.vocab_size, (n,), generator=g).tolist()
               for n in (6, 19, 11, 33, 4, 25)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    plain = run_requests(engine, prompts, params)
    for i, p in enumerate(prompts):
        EXPECTED[tuple(p)] = plain[f"r{i}"]
    return prompts, plain


def test_tree_drafts_are_lossless_and_accepted(tiny_llama_dir, prompts_and_plain):
    prompts, plain = prompts_and_plain
    engine = make_engine(tiny_llama_dir, ["test_oracle_tree"])
    got = run_requests(engine, prompts, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    assert got == plain
    stats = engine.get_stats().drafters["test_oracle_tree"]
    assert stats.num_accepted_tokens > 0.5 * sum(len(v) for v in plain.values())  # speculation really happened
    assert stats.num_fallbacks == 0
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_ngram_drafter_is_lossless(tiny_llama_dir, prompts_and_plain):
    prompts, plain = prompts_and_plain
    engine = make_engine(tiny_llama_dir, ["ngram"])
    got = run_requests(engine, prompts, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    assert got == plain
    assert engine.get_stats().drafters["ngram"].num_steps > 0


def test_per_request_drafter_choice_and_unknown_name(tiny_llama_dir, prompts_and_plain):
    prompts, plain = prompts_and_plain
    engine = make_engine(tiny_llama_dir, ["ngram", "test_oracle_tree"])
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    engine.add_request("a", prompts[0], params, drafter="test_oracle_tree")
    engine.add_request("b", prompts[1], params, drafter="none")
    engine.add_request("c", prompts[2], params)   # the default: the first loaded
    outs: dict[str, list[int]] = {}
    specs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            for d in out.outputs:
                outs.setdefault(out.request_id, []).extend(d.token_ids)
            specs[out.request_id] = out.spec
    assert outs == {"a": plain["r0"], "b": plain["r1"], "c": plain["r2"]}
    assert specs["b"] is None and specs["a"].drafter == "test_oracle_tree" and specs["c"].drafter == "ngram"
    assert specs["a"].num_accepted_tokens > 0
    assert specs["a"].mean_accepted_length > 1.5
    with pytest.raises(InvalidRequestError, match="loaded drafters: none, ngram, test_oracle_tree"):
        engine.add_request("d", prompts[0], params, drafter="medusa")


@pytest.mark.parametrize("name", ["test_raises", "test_bad_root"])
def test_failing_drafter_falls_back_to_plain_decoding(tiny_llama_dir, prompts_and_plain, name):
    prompts, plain = prompts_and_plain
    engine = make_engine(tiny_llama_dir, [name])
    got = run_requests(engine, prompts[:3], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    assert got == {k: plain[k] for k in ("r0", "r1", "r2")}
    assert engine.get_stats().drafters[name].num_fallbacks > 0


def test_adaptive_budget_shrinks_trees_as_the_batch_grows(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, ["ngram"], max_num_seqs=8, num_speculative_tokens=10,
                         max_draft_tokens_per_step=16)
    sched = engine.scheduler
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    engine.add_request("solo", [5, 6, 7, 5, 6, 7, 5, 6], params)
    engine.step()  # prefill
    solo = sched.schedule()
    assert solo.draft_budgets == [10]
    for seq, n in zip(solo.seqs, solo.num_tokens):   # undo: nothing ran
        engine.blocks.shrink(seq.seq_id, seq.num_computed_tokens)
    for i in range(7):
        engine.add_request(f"x{i}", [5, 6, 7, 5, 6, 7, 5, 6], params)
    engine.step()  # admits and prefills the others
    crowded = sched.schedule()
    assert len(crowded.seqs) == 8 and max(crowded.draft_budgets) == 2 and sum(crowded.draft_budgets) <= 16


def test_stop_inside_accepted_tokens_truncates(tiny_llama_dir, prompts_and_plain):
    """max_tokens reached in the middle of an accepted path: exactly max_tokens come out."""
    prompts, plain = prompts_and_plain
    engine = make_engine(tiny_llama_dir, ["test_oracle_tree"])
    got = run_requests(engine, prompts, SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True))
    assert got == {k: v[:7] for k, v in plain.items()}


@register("test_always_wrong")
class AlwaysWrongDrafter(Drafter):
    """A chain of the full budget whose first token is never the greedy choice."""

    def __init__(self, ctx):
        self.vocab = ctx.model_config.vocab_size

    def propose(self, seqs, budgets):
        trees = []
        for seq, b in zip(seqs, budgets):
            truth = EXPECTED[tuple(seq.token_ids[:seq.num_prompt_tokens])][seq.num_output_tokens]
            trees.append(TokenTree.chain(seq.token_ids[-1], [(truth + 1) % self.vocab] * b) if b else None)
        return trees


@pytest.mark.parametrize("adaptive", [True, False])
def test_failing_drafts_shrink_then_pause(tiny_llama_dir, prompts_and_plain, adaptive):
    prompts, plain = prompts_and_plain
    engine = make_engine(tiny_llama_dir, ["test_always_wrong"], draft_budget="adaptive" if adaptive else "fixed")
    got = run_requests(engine, prompts, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    assert got == plain
    st = engine.get_stats().drafters["test_always_wrong"]
    assert st.num_accepted_tokens == 0
    if adaptive:
        # per sequence: drafts of 10, 9, ..., 1 nodes, then pauses of 2, 4, 8, 16 steps with a
        # one-node probe after each: at most 10 + 4 draft steps and 55 + 4 draft tokens
        assert st.num_steps <= 6 * 14 and st.num_draft_tokens <= 6 * 59
    else:
        assert st.num_draft_tokens / st.num_steps > 8


@register("test_feature_recorder")
class FeatureRecorder(OracleTreeDrafter):
    """The oracle tree drafter, reading target features: records every hidden state it is given."""

    needs_features = True
    seen: dict[tuple[int, ...], dict[int, torch.Tensor]] = {}

    def observe(self, seqs, features):
        for seq, (start, hidden) in zip(seqs, features):
            rec = self.seen.setdefault(tuple(seq.token_ids[:seq.num_prompt_tokens]), {})
            for j in range(hidden.shape[0]):
                rec[start + j] = hidden[j].clone()


def test_feature_drafters_get_the_targets_hidden_states_of_every_cached_token(tiny_llama_dir, prompts_and_plain):
    """Prefill chunks, plain steps and verified paths: the drafter sees, for every position that
    entered the KV cache, exactly the hidden state a fresh forward over the committed tokens gives."""
    import transformers

    prompts, plain = prompts_and_plain
    FeatureRecorder.seen.clear()
    engine = make_engine(tiny_llama_dir, ["test_feature_recorder"], max_num_batched_tokens=16)
    got = run_requests(engine, prompts, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    assert got == plain
    assert engine.get_stats().drafters["test_feature_recorder"].num_accepted_tokens > 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, torch_dtype=torch.float32).eval()
    for i, p in enumerate(prompts):
        tokens = p + plain[f"r{i}"]
        rec = FeatureRecorder.seen[tuple(p)]
        # every token but the last committed one (the bonus: no KV yet) has its features
        assert sorted(rec) == list(range(len(tokens) - 1))
        with torch.no_grad():
            want = hf(torch.tensor([tokens[:-1]]), output_hidden_states=True).hidden_states[-1][0]
        torch.testing.assert_close(torch.stack([rec[j] for j in range(len(tokens) - 1)]), want,
                                   atol=2e-5, rtol=1e-4)
