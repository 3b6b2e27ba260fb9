"""Turns a scheduled batch into tensors, runs the target forward, samples or verifies, and prunes
the KV cache of verified trees.

The only place that builds `input_ids`, `positions` and `AttnMetadata`. Sequences with a draft
tree and sequences without (prefill chunks, plain decoding) ride in the same forward: a tree's
nodes are written to the cache positions after the sequence's committed tokens, RoPE positions are
committed length + depth, and the attention mask is the tree's ancestor mask. Policy lives in the
scheduler, stop handling in the engine core.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specserve.engine.attention import build_attn_metadata
from specserve.engine.kv_cache import BlockManager, KVCache, commit_accepted
from specserve.engine.model import LlamaModel
from specserve.engine.outputs import TokenLogprob
from specserve.engine.sampler import SamplingTensors, processed_probs, sample
from specserve.engine.scheduler import ScheduledBatch
from specserve.engine.sequence import Sequence
from specserve.engine.tree import TokenTree, build_tree_buffers
from specserve.engine.verify import VerifyResult, verify_greedy, verify_sampling


@dataclass
class SeqResult:
    seq: Sequence
    tokens: list[int]                        # committed this step: 1 for plain decoding, accepted + bonus for a tree
    logprobs: list[TokenLogprob] | None = None
    num_computed: int = 0                    # the sequence's computed length after this step
    tree: TokenTree | None = None
    verify: VerifyResult | None = None


@dataclass
class StepResult:
    results: list[SeqResult] = field(default_factory=list)   # only sequences that got tokens
    # batch index -> (first position, hidden [n, H]): the target's last-layer hidden states (after the
    # final norm) of the tokens whose KV entered the cache this step, in position order; only for
    # the batch indices asked for (drafters that read target features)
    features: dict[int, tuple[int, torch.Tensor]] = field(default_factory=dict)


def _logprob_entries(logits: torch.Tensor, tokens: list[int], k: int) -> list[TokenLogprob]:
    """OpenAI-style logprobs (raw log_softmax) for `tokens[i]` under row i of `logits`."""
    lp = logits.float().log_softmax(dim=-1)
    chosen = lp.gather(1, torch.tensor(tokens, device=lp.device).unsqueeze(1)).squeeze(1).tolist()
    top = lp.topk(k, dim=-1) if k > 0 else None
    entries = []
    for i, tok in enumerate(tokens):
        alts = list(zip(top.indices[i].tolist(), top.values[i].tolist())) if top is not None else []
        entries.append(TokenLogprob(tok, chosen[i], alts))
    return entries


class ModelRunner:
    def __init__(self, model: LlamaModel, cache: KVCache, blocks: BlockManager, device: torch.device):
        self.model = model
        self.cache = cache
        self.blocks = blocks
        self.device = device
        self.block_size = blocks.block_size

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, trees: dict[int, TokenTree] | None = None,
                feature_idx: set[int] | frozenset = frozenset()) -> StepResult:
        """Run one forward. `trees` maps a batch index to the draft tree of that (decode)
        sequence; its KV blocks must already hold committed length + tree size tokens. For the
        batch indices in `feature_idx` the result carries the hidden states of the tokens that
        entered the KV cache (prefill chunk, decoded token, or the tree's root + accepted path)."""
        trees = trees or {}
        dev = self.device
        starts = [seq.num_computed_tokens for seq in batch.seqs]
        ids: list[int] = []
        qlens: list[int] = []
        masks: list[torch.Tensor | None] = []
        depth_segments: dict[int, torch.Tensor] = {}
        plain_rows: list[int] = []
        plain_seqs: list[Sequence] = []
        tree_rows: dict[int, tuple[int, int]] = {}
        row = 0
        for b, (seq, start, n) in enumerate(zip(batch.seqs, starts, batch.num_tokens)):
            tree = trees.get(b)
            if tree is not None:
                buf = build_tree_buffers(tree.parents)
                ids.extend(tree.tokens)
                qlens.append(tree.num_nodes)
                masks.append(buf.mask.to(dev))
                depth_segments[row] = start + buf.depths
                tree_rows[b] = (row, tree.num_nodes)
                row += tree.num_nodes
                continue
            ids.extend(seq.token_ids[start:start + n])
            qlens.append(n)
            masks.append(None)
            row += n
            if start + n == len(seq.token_ids):   # this chunk reaches the end: the next token is due
                plain_rows.append(row - 1)
                plain_seqs.append(seq)
        tables = [self.blocks.block_tables[seq.seq_id] for seq in batch.seqs]
        positions, meta = build_attn_metadata(tables, self.block_size, starts, qlens, masks, dev)
        for r0, seg in depth_segments.items():
            positions[r0:r0 + seg.numel()] = seg.to(dev)
        hidden = self.model(torch.tensor(ids, dtype=torch.int64).to(dev), positions, self.cache, meta)

        result = StepResult()
        for b in feature_idx:
            if b not in trees:
                r0 = meta.cu_query_lens[b]
                result.features[b] = (starts[b], hidden[r0:r0 + batch.num_tokens[b]].clone())
        if plain_seqs:
            logits = self.model.compute_logits(hidden[torch.tensor(plain_rows, device=dev)])
            params = [seq.params for seq in plain_seqs]
            out = sample(logits, SamplingTensors.from_params(params, dev), [s.generator for s in plain_seqs])
            token_ids = out.token_ids.tolist()
            chosen = out.logprobs.tolist() if out.logprobs is not None else None
            top_ids = out.top_ids.tolist() if out.top_ids is not None else None
            top_lps = out.top_logprobs.tolist() if out.top_logprobs is not None else None
            for k, seq in enumerate(plain_seqs):
                lps = None
                if chosen is not None and seq.params.logprobs is not None:
                    n_top = seq.params.logprobs
                    lps = [TokenLogprob(token_ids[k], chosen[k], list(zip(top_ids[k][:n_top], top_lps[k][:n_top])))]
                result.results.append(SeqResult(seq, [token_ids[k]], lps, seq.num_computed_tokens))

        if tree_rows:
            commits = []
            for b, (r0, n) in tree_rows.items():
                seq, tree = batch.seqs[b], trees[b]
                logits = self.model.compute_logits(hidden[r0:r0 + n])                  # [n, vocab]
                if seq.params.greedy:
                    v = verify_greedy(tree.tokens, tree.parents, logits.argmax(dim=-1).tolist())
                else:
                    st = SamplingTensors.from_params([seq.params] * n, dev)
                    v = verify_sampling(tree.tokens, tree.parents, processed_probs(logits, st),
                                        tree.draft_probs, seq.generator, tree.next_roots)
                path = [v.root] + v.accepted_nodes   # the nodes whose KV stays, in order
                lps = None
                if seq.params.logprobs is not None:
                    path_rows = path                     # committed token i is drawn at row path_rows[i]
                    lps = _logprob_entries(logits[path_rows], v.tokens, seq.params.logprobs)
                result.results.append(SeqResult(seq, v.tokens, lps, 0, tree, v))
                if b in feature_idx:
                    rows = torch.tensor([r0 + i for i in path], device=dev)
                    result.features[b] = (starts[b], hidden.index_select(0, rows))
                commits.append((seq, starts[b], path, result.results[-1]))
            new_lens = commit_accepted(self.blocks, self.cache, [c[0].seq_id for c in commits],
                                       [c[1] for c in commits], [c[2] for c in commits])
            for (_, _, _, res), n in zip(commits, new_lens):
                res.num_computed = n
        return result
