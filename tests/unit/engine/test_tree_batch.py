"""Batched tree verification through the paged KV cache (fp32, tiny random Llama):

* one forward over several draft trees of different shapes, next to a plain decode row and a
  prefill chunk, gives every tree node the logits transformers gives prefix + that node's path,
  and the same logits as verifying each tree alone;
* after many speculative steps (random trees, accepted paths at scattered node indices, KV
  compaction every step), the KV cache of every sequence equals a fresh prefill of its committed
  tokens.
"""

from __future__ import annotations

import random

import pytest
import torch
import transformers
from helpers import DEVICES

from specserve.drafters.base import Drafter, register
from specserve.engine.attention import build_attn_metadata
from specserve.engine.config import EngineConfig, ModelConfig
from specserve.engine.core import LLMEngine
from specserve.engine.kv_cache import BlockManager, KVCache
from specserve.engine.model import LlamaModel
from specserve.engine.sampling_params import SamplingParams
from specserve.engine.tree import NO_PARENT, TokenTree, TreeTemplate, build_tree_buffers

ATOL = 2e-4
CPU = torch.device("cpu")


def random_parents(n: int, rng: random.Random) -> list[int]:
    return [NO_PARENT] + [rng.randrange(i) for i in range(1, n)]


class Paged:
    """Our model over a paged cache, with a forward for a mixed batch of items
    (seq id, tokens, parents or None for a causal chunk)."""

    def __init__(self, hf, num_blocks: int = 96, block_size: int = 4):
        cfg = ModelConfig.from_hf(hf.config)
        self.model = LlamaModel.from_state_dict(cfg, hf.state_dict(), max_positions=256, dtype=torch.float32,
                                                device=CPU)
        self.blocks = BlockManager(num_blocks, block_size)
        self.cache = KVCache(cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim,
                             torch.float32, CPU)
        self.lens: dict[int, int] = {}

    def forward(self, items: list[tuple[int, list[int], list[int] | None]], commit: bool) -> list[torch.Tensor]:
        ids, starts, qlens, masks, tables, pos = [], [], [], [], [], []
        for sid, toks, parents in items:
            start = self.lens.get(sid, 0)
            assert self.blocks.grow(sid, start + len(toks))
            ids += toks
            starts.append(start)
            qlens.append(len(toks))
            tables.append(self.blocks.block_tables[sid])
            if parents is None:
                masks.append(None)
                pos += range(start, start + len(toks))
            else:
                buf = build_tree_buffers(parents)
                masks.append(buf.mask)
                pos += (start + buf.depths).tolist()
            if commit:
                self.lens[sid] = start + len(toks)
        _, meta = build_attn_metadata(tables, self.blocks.block_size, starts, qlens, masks, CPU)
        with torch.inference_mode():
            logits = self.model.compute_logits(self.model(torch.tensor(ids), torch.tensor(pos), self.cache, meta))
        return list(logits.split(qlens))


@pytest.fixture(scope="module")
def hf():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
    return model


def hf_last_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0, -1].float()


def test_trees_of_different_shapes_in_one_forward(hf):
    rng = random.Random(5)
    g = torch.Generator().manual_seed(5)
    paged = Paged(hf)
    prefixes = {sid: torch.randint(0, 300, (n,), generator=g).tolist() for sid, n in enumerate((11, 4, 23, 7))}
    # the committed tokens but the last have KV; the last is each tree's root, computed with it
    paged.forward([(sid, p[:-1], None) for sid, p in prefixes.items()], commit=True)
    trees = {
        0: TreeTemplate.from_branching((3, 2, 1)).parents,      # MCSD-shaped, 3 + 6 + 6 nodes
        1: TreeTemplate.chain(5).parents,                        # SpS chain
        2: tuple(random_parents(9, rng)),                        # arbitrary shape
    }
    items = []
    for sid, parents in trees.items():
        tokens = [prefixes[sid][-1]] + [rng.randrange(300) for _ in parents[1:]]
        items.append((sid, tokens, list(parents)))
    items.append((3, [17], None))                              # a plain decode row rides along
    items.append((4, torch.randint(0, 300, (6,), generator=g).tolist(), None))   # and a prefill chunk

    together = paged.forward(items, commit=False)
    for (sid, tokens, parents), logits in zip(items, together):
        alone = paged.forward([(sid, tokens, parents)], commit=False)[0]
        torch.testing.assert_close(logits, alone, atol=1e-5, rtol=1e-5)
        if parents is None:
            continue
        context = prefixes[sid][:-1]
        for i in range(len(tokens)):
            path, a = [], i
            while a != NO_PARENT:
                path.append(tokens[a])
                a = parents[a]
            ref = hf_last_logits(hf, context + path[::-1])
            torch.testing.assert_close(logits[i], ref, atol=ATOL, rtol=1e-4)


@register("test_random_trees")
class RandomTreeDrafter(Drafter):
    """Random trees in which the greedy continuation, where known, hides at a random sibling rank
    (so accepted paths have scattered node indices); otherwise random tokens."""

    truth: dict[tuple[int, ...], list[int]] = {}

    def __init__(self, ctx):
        self.vocab = ctx.model_config.vocab_size
        self.rng = random.Random(1)

    def propose(self, seqs, budgets):
        trees = []
        for seq, budget in zip(seqs, budgets):
            truth = self.truth.get(tuple(seq.token_ids[:seq.num_prompt_tokens]), [])[seq.num_output_tokens:]
            tokens, parents, cur = [seq.token_ids[-1]], [NO_PARENT], 0
            for tok in truth + [None] * 3:
                width = self.rng.randint(1, 3)
                hit = self.rng.randrange(width)
                nxt = None
                for w in range(width):
                    if len(tokens) - 1 >= budget:
                        break
                    good = tok is not None and w == hit and self.rng.random() > 0.2
                    tokens.append(tok if good else self.rng.randrange(self.vocab))
                    parents.append(cur)
                    nxt = len(tokens) - 1 if w == hit else nxt
                if nxt is None:
                    break
                cur = nxt
            trees.append(TokenTree(tokens, parents) if len(tokens) > 1 else None)
        return trees


@pytest.mark.parametrize("device", DEVICES)
def test_kv_after_many_speculative_steps_equals_a_fresh_prefill(tiny_llama_dir, device):
    """On CUDA the trees go through the Triton tree-attention kernel and the accepted KV through the
    Triton compaction kernel; the fresh prefill is the same engine's plain causal path."""
    def engine(drafters=()):
        return LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", device=device, max_num_seqs=4,
                                      block_size=4, max_num_batched_tokens=96, num_kv_blocks=200, max_model_len=160,
                                      drafters=tuple(drafters), num_speculative_tokens=10,
                                      max_draft_tokens_per_step=40, draft_budget="fixed"))

    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (9, 21, 5, 14)]
    params = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)
    plain = engine()
    for i, p in enumerate(prompts):
        plain.add_request(f"p{i}", p, params)
    outs: dict[str, list[int]] = {}
    while plain.has_unfinished_requests():
        for out in plain.step():
            for d in out.outputs:
                outs.setdefault(out.request_id, []).extend(d.token_ids)
    RandomTreeDrafter.truth = {tuple(p): outs[f"p{i}"] for i, p in enumerate(prompts)}

    spec = engine(["test_random_trees"])
    for i, p in enumerate(prompts):
        spec.add_request(f"s{i}", p, params)
    seqs = []
    while not seqs or min(s.num_output_tokens for s in seqs) < 40:
        spec.step()
        seqs = [s for r in spec.requests.values() for s in r.seqs]
    assert len(seqs) == 4 and not any(s.is_finished for s in seqs)   # all still running, well past their prompts
    stats = spec.drafter_stats["test_random_trees"]
    assert stats.num_steps > 30 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens

    fresh = engine()
    for seq in seqs:
        n = seq.num_computed_tokens
        assert n == len(seq.token_ids) - 1       # everything but the newest (bonus) token has KV
        assert seq.token_ids[seq.num_prompt_tokens:] == RandomTreeDrafter.truth[
            tuple(seq.token_ids[:seq.num_prompt_tokens])][:seq.num_output_tokens]
        fresh.blocks.grow(seq.seq_id, n)
        dev = torch.device(device)
        positions, meta = build_attn_metadata([fresh.blocks.block_tables[seq.seq_id]], 4, [0], [n], None, dev)
        with torch.inference_mode():
            fresh.model(torch.tensor(seq.token_ids[:n], device=dev), positions, fresh.cache, meta)
        ours = spec.cache.kv[:, :, spec.blocks.slots(seq.seq_id, 0, n)]
        ref = fresh.cache.kv[:, :, fresh.blocks.slots(seq.seq_id, 0, n)]
        torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
        # no block beyond what the committed tokens (and the next step's room) need is held
        assert len(spec.blocks.block_tables[seq.seq_id]) <= spec.blocks.blocks_for(n + 1)
