"""The step as tensors in, tensors out (engine/model_runner.py), fp32 on the tiny random Llama:

* a step makes one device-to-host transfer whatever the batch and tree sizes: every way a tensor
  reaches the host (`tolist`, `item`, `cpu`, `numpy`, truth and number conversions) is counted
  while the runner executes mixed batches of prefill chunks, plain decodes and draft trees of
  random shapes, greedy and sampled, with and without logprobs;
* logprobs reported for tokens committed through a tree equal those of plain decoding;
* the runner alone advances sequence lengths and block tables, for plain and tree rows alike;
* `profile_forward` times a forward without touching the live KV cache.
"""

from __future__ import annotations

import os
import random
import traceback

import pytest
import torch
from helpers import DEVICES, make_llm_engine, step_and_collect

from specserve.drafters.base import Drafter, register
from specserve.engine.model_runner import ModelRunner
from specserve.engine.sampling_params import SamplingParams
from specserve.engine.tree import NO_PARENT, TokenTree


@register("test_runner_trees")
class RandomShapeDrafter(Drafter):
    """Trees of random shapes and sizes up to the budget; the plain greedy continuation (when the
    test provides it) sits at a random sibling rank so that some drafts are accepted."""

    truth: dict[tuple[int, ...], list[int]] = {}

    def __init__(self, ctx):
        self.vocab = ctx.model_config.vocab_size
        self.rng = random.Random(7)

    def propose(self, seqs, budgets):
        trees = []
        for seq, budget in zip(seqs, budgets):
            truth = self.truth.get(tuple(seq.token_ids[:seq.num_prompt_tokens]), [])[seq.num_output_tokens:]
            tokens, parents, cur = [seq.token_ids[-1]], [NO_PARENT], 0
            for tok in truth + [None] * 4:
                width, hit, nxt = self.rng.randint(1, 3), 0, None
                hit = self.rng.randrange(width)
                for w in range(width):
                    if len(tokens) - 1 >= budget:
                        break
                    tokens.append(tok if tok is not None and w == hit else self.rng.randrange(self.vocab))
                    parents.append(cur)
                    nxt = len(tokens) - 1 if w == hit else nxt
                if nxt is None:
                    break
                cur = nxt
            trees.append(TokenTree(tokens, parents) if len(tokens) > 1 else None)
        return trees


class TransferCounter:
    """Counts the ways a tensor's data reaches the host while active. (`numpy()` is left out: it
    raises on a device tensor, so it can only be host staging work, such as filling the pinned
    buffer of the attention metadata.)"""

    METHODS = ("tolist", "item", "cpu", "__bool__", "__int__", "__float__", "__index__")

    def __init__(self, monkeypatch):
        self.count = 0
        self.active = False
        for name in self.METHODS:
            original = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._wrap(original))

    def _wrap(self, original):
        def counted(tensor, *args, **kwargs):
            if self.active:
                self.count += 1
                if os.environ.get("SPECSERVE_DEBUG_TRANSFERS"):
                    traceback.print_stack(limit=6)
                self.active = False   # nested calls (cpu inside tolist, ...) count once
                try:
                    return original(tensor, *args, **kwargs)
                finally:
                    self.active = True
            return original(tensor, *args, **kwargs)
        return counted


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_requests", [1, 4])
def test_a_step_makes_one_host_transfer_whatever_the_batch(tiny_llama_dir, monkeypatch, num_requests, device):
    engine = make_llm_engine(tiny_llama_dir, ["test_runner_trees"], max_num_seqs=4, max_num_batched_tokens=24,
                             device=device)
    counter = TransferCounter(monkeypatch)
    counts: list[int] = []
    execute = ModelRunner.execute

    def counted_execute(self, batch, trees=None, *args, **kwargs):
        counter.count, counter.active = 0, True
        try:
            return execute(self, batch, trees, *args, **kwargs)
        finally:
            counter.active = False
            counts.append((counter.count, len(batch.seqs), sum(t.num_nodes for t in (trees or {}).values())))

    monkeypatch.setattr(ModelRunner, "execute", counted_execute)
    g = torch.Generator().manual_seed(2)
    settings = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
                SamplingParams(temperature=0.8, top_p=0.9, max_tokens=24, ignore_eos=True, seed=3),
                SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2),
                SamplingParams(temperature=1.0, top_k=20, max_tokens=24, ignore_eos=True, logprobs=1)]
    for i in range(num_requests):
        prompt = torch.randint(3, 320, (5 + 9 * i,), generator=g).tolist()   # long ones prefill in chunks
        engine.add_request(f"r{i}", prompt, settings[i % len(settings)])
    got: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        step_and_collect(engine, got)
    assert all(len(v) == 24 for v in got.values())
    assert max(c for c, _, _ in counts) == 1                       # never more than one transfer
    assert any(nodes > 0 for _, _, nodes in counts)                # trees were verified
    if num_requests > 1:
        assert any(b == num_requests and nodes > 4 for _, b, nodes in counts)   # with a full batch


def test_logprobs_through_trees_equal_plain_decoding(tiny_llama_dir):
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (7, 15)]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=3)

    def run(drafters):
        engine = make_llm_engine(tiny_llama_dir, drafters)
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, params)
        out: dict[str, list] = {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                for d in o.outputs:
                    out.setdefault(o.request_id, []).extend(d.logprobs or [])
        return out, engine

    plain, _ = run([])
    RandomShapeDrafter.truth = {tuple(p): [e.token_id for e in plain[f"r{i}"]] for i, p in enumerate(prompts)}
    spec, engine = run(["test_runner_trees"])
    assert engine.get_stats().drafters["test_runner_trees"].num_accepted_tokens > 10
    for rid, entries in plain.items():
        assert [e.token_id for e in spec[rid]] == [e.token_id for e in entries]
        for a, b in zip(spec[rid], entries):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
            assert [lp for _, lp in a.top] == pytest.approx([lp for _, lp in b.top], abs=1e-4)
    RandomShapeDrafter.truth = {}


def test_the_runner_advances_lengths_and_blocks(tiny_llama_dir):
    engine = make_llm_engine(tiny_llama_dir, ["test_runner_trees"])
    engine.add_request("a", list(range(3, 14)), SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    engine.add_request("b", list(range(20, 25)), SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
                       drafter="none")
    for _ in range(12):
        engine.step()
        for req in engine.requests.values():
            for seq in req.seqs:
                # everything but the newest token has KV; the blocks cover that (and at most the
                # newest token's slot, reserved for a draft that did not come)
                n = seq.num_computed_tokens
                assert n == len(seq.token_ids) - 1
                blocks = len(engine.blocks.block_tables[seq.seq_id])
                assert engine.blocks.blocks_for(n) <= blocks <= engine.blocks.blocks_for(n + 1)


def test_profile_forward_leaves_the_cache_alone(tiny_llama_dir):
    engine = make_llm_engine(tiny_llama_dir, [])
    engine.add_request("a", list(range(3, 20)), SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    engine.step()
    before = engine.cache.kv.clone()
    free = engine.blocks.num_free_blocks
    seconds = [engine.runner.profile_forward(n) for n in (1, 16, 64)]
    assert all(s > 0 for s in seconds)
    assert torch.equal(engine.cache.kv, before) and engine.blocks.num_free_blocks == free
