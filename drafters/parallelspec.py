"""ParallelSpec drafter (Xiao et al.): one decoder layer with k learned [MASK] embeddings drafts
the next k+1 tokens in ONE forward (network: drafters/nets/parallelspec.py; training:
drafters/train/parallelspec.py).

Each step, per sequence whose root (the last committed token, no target feature yet) sits at
position n-1:

1. one drafter forward, batched over the sequences: the real positions not yet in the drafter's
   KV (the tokens committed since the last step, the root last), each as fc([f_{p-1} ‖ e(x_p)])
   with the target features of the engine's feature store (engine/features.py), followed by the k [MASK] embeddings at
   positions n .. n+k-1. The chunk is plain causal (the masks come last), so mask i sees the whole
   real sequence and masks 1..i, exactly the training layout's group;
2. the root's row and the k mask rows, through the target's frozen LM head (shared by reference),
   give k+1 distributions: depth d of the draft tree takes the top tokens of distribution d;
3. the drafter's paged KV keeps the real positions 0..n-2 only: the root is fed again next step
   (its KV is rewritten then, in case the root changed) and the masks' entries, written after it,
   are never part of the kept length (they are overwritten by the next real tokens). No tree node
   ever enters the drafter's KV, so after verification there is nothing to prune: `accept` only
   returns the blocks past the kept length.

Tree: a list of rank paths in preference order (each prefix a tree), cut to the scheduler's
budget: the `tree` option; else the order tuned on held-back data and stored in the checkpoint;
else Medusa's `medusa_mc_sim_7b_63` (the paper reuses its base framework's tree); else a chain.
A node at depth d with rank r carries the r-th most likely token of distribution d whatever its
parent (Medusa's Cartesian tree: all depths come from the same pass).

Verification, lossless: trees are deterministic drafts (`draft_probs=None`, one-hot q). Algorithm 1
of the paper maps onto engine/verify.py as follows: `Select(H)` = the children in rank order (most
likely first); the ratio p(x)/q(x) with q one-hot is p(x); on rejection p <- norm((p - onehot(x))_+)
= p with x removed, the exact residual for top-k (not i.i.d.) children, which is the correction the
digest (§4.8 item 5) asks for; greedy requests accept the child equal to the target's argmax. The
bonus is drawn from the final p. So greedy output equals plain greedy decoding and sampled output
follows the target's law.

Options (`--drafter-option parallelspec.KEY=VALUE`):
  checkpoint=PATH   a trained checkpoint (`specserve train parallelspec ...`); default: the shipped one in
                    drafters/checkpoints/ whose target fingerprint matches
  tree=SPEC         "auto" (default), a trees.json name, "chain", or a JSON list of rank paths
  draft_vocab=N     draft from the N tokens the target chose most often in training (default 8192
                    when the checkpoint has that ranking; 0 = the whole vocabulary; drafters.draft_vocab)
  random_init=true  FOR TESTS: an untrained module (`k`, `seed`); `module=` an in-memory module
  block_size, num_blocks   the drafter's own paged KV pool

Standardized walltime (`model_runs`): one run per sequence per drafter forward (one per propose:
the layer over the new real rows and the k masks, then the LM head over k+1 rows), at c = (the
module's own parameters + the LM-head rows it multiplies, the draft vocabulary's rows x hidden
size) / the target's parameters.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence as Seq

import torch

from specserve.drafters.base import DrafterContext, register
from specserve.drafters.draft_vocab import DraftVocab
from specserve.drafters.features import FeatureDrafter, FeatureState
from specserve.drafters.medusa import parse_tree_option
from specserve.drafters.nets.checkpoint import resolve_checkpoint, target_fingerprint
from specserve.drafters.nets.medusa import load_template
from specserve.drafters.nets.parallelspec import ParallelSpecModule, load_module
from specserve.engine.tree import TokenTree, TreeTemplate, cartesian_fill, preference_prefix


CHECKPOINTS_DIR = Path(__file__).resolve().parent / "checkpoints"
DEFAULT_TREE = "medusa_mc_sim_7b_63"
MAX_RANK = 10


def _trees_json_paths(name: str) -> list[list[int]] | None:
    return load_template(name)


def parse_tree(value, depth: int) -> list[list[int]] | None:
    """The `tree` option as rank paths in preference order, or None for "auto"."""
    return parse_tree_option(value, depth, "parallelspec")


prefix_tree = preference_prefix   # the first `budget` nodes of a preference order (engine.tree)


@register("parallelspec")
class ParallelSpecDrafter(FeatureDrafter):
    name = "parallelspec"
    # see Drafter: after h hypothetical tokens (a grammar's forced ones) the pass runs on the committed
    # prefix as always and the tree's depth d takes distribution h + d - 1, cut where they run out
    drafts_after_uncommitted = True

    def __init__(self, ctx: DrafterContext, *, checkpoint: str | None = None, tree=None, random_init: bool = False,
                 k: int = 4, seed: int = 0, module=None, draft_vocab: int | None = None, block_size: int = 16,
                 num_blocks: int | None = None):
        super().__init__(ctx)
        target, model_config, dtype = ctx.target, ctx.model_config, self.dtype
        max_positions = ctx.max_model_len + 64
        tuned = None
        if module is not None:                   # an in-memory module (tests, the trainer's evaluation)
            self.module = module
        elif random_init:
            self.module = ParallelSpecModule.random(target, model_config, k=int(k), max_positions=max_positions,
                                                    seed=int(seed))
        else:
            fingerprint = target_fingerprint(model_config, target)
            checkpoint = resolve_checkpoint("parallelspec", fingerprint, checkpoint, CHECKPOINTS_DIR)
            self.module, meta = load_module(checkpoint, target, model_config, fingerprint=fingerprint,
                                            max_positions=max_positions, device=self.device, dtype=dtype)
            tuned = (meta.tree or {}).get("choices")
        self.module.eval().requires_grad_(False)
        self.vocab = DraftVocab(self.module.lm_head_weight, getattr(self.module, "vocab_rank", None), draft_vocab,
                                drafter="parallelspec")
        self.k = self.module.k
        depth = self.k + 1
        order = parse_tree(tree, depth)
        if order is None:
            order = tuned or _trees_json_paths(DEFAULT_TREE) or [[0] * d for d in range(1, depth + 1)]
        order = [p for p in order if 1 <= len(p) <= depth and all(0 <= r < MAX_RANK for r in p)]
        if not order:
            raise ValueError("the parallelspec tree has no node within depth k+1 and rank < 10")
        self.order = order
        self._templates: dict[int, TreeTemplate] = {}
        self.count_cost(self.module)
        self.paged_kv(ctx, self.k + 1, block_size, num_blocks)

    # ---- tree shape ---------------------------------------------------------------------------

    def template(self, budget: int) -> TreeTemplate:
        t = self._templates.get(budget)
        if t is None:
            t = TreeTemplate.from_choices(preference_prefix(self.order, budget)).truncate(budget + 1)
            self._templates[budget] = t
        return t

    # ---- protocol -----------------------------------------------------------------------------

    def rewind(self, seq_id: int, st: FeatureState, start: int) -> None:
        """Features again for positions it has rows of (a preemption recomputes them) change
        nothing: the rows of the same tokens stay."""

    def kept_rows(self, st: FeatureState) -> int:
        """Nothing of a tree is in the drafter's KV; the blocks the masks borrowed past the root go."""
        return st.kv_len + 1

    @torch.inference_mode()
    def draft_logits(self, seqs: Seq) -> tuple[list[int], torch.Tensor | None]:
        """One drafter forward for the sequences that have the features it needs: (their indices
        in `seqs`, logits [len, k+1, draft vocabulary] fp32 (see `self.vocab`): row 0 at the root, row i at
        mask i)."""
        mod, k = self.module, self.k
        idx, starts, ids, prevs, qlens = [], [], [], [], []
        H = mod.cfg.hidden_size
        for i, seq in enumerate(seqs):
            st = self.state.setdefault(seq.seq_id, self.State())
            n = seq.num_committed                # hypothetical tokens have no features: not fed
            start = min(st.kv_len, n - 1)        # the root is always fed again
            lo = max(start - 1, 0)
            feats = self.features.view(seq.seq_id, lo, n - 1)       # f_{start-1} .. f_{n-2}
            if feats is None or n < 1:
                continue
            if start == 0:
                feats = torch.cat([torch.zeros(1, H, dtype=feats.dtype, device=feats.device), feats])
            if not self.kv.grow(seq.seq_id, n + k):
                continue
            idx.append(i)
            starts.append(start)
            ids.extend(seq.token_ids[start:n])
            prevs.append(feats)
            qlens.append(n - start + k)
        if not idx:
            return [], None
        dev = self.device
        real = mod.real_inputs(torch.tensor(ids, dtype=torch.int64, device=dev), torch.cat(prevs).to(dev))
        parts, off = [], 0
        masks = mod.mask_embed.to(real.dtype)
        for q in qlens:
            nr = q - k
            parts.append(real[off:off + nr])
            parts.append(masks)
            off += nr
        h = torch.cat(parts)
        positions, meta = self.kv.metadata([seqs[i].seq_id for i in idx], starts, qlens)
        k_cache, v_cache = self.cache.layer(0)
        out = mod.forward_paged(h, positions, k_cache, v_cache, meta)
        self.num_runs += len(idx)
        ends = torch.tensor(meta.cu_query_lens[1:], device=dev)
        rows = (ends[:, None] - (k + 1) + torch.arange(k + 1, device=dev)[None, :]).reshape(-1)
        logits = self.vocab.logits(out.index_select(0, rows)).view(len(idx), k + 1, -1)
        for i in idx:
            seq = seqs[i]
            st = self.state[seq.seq_id]
            st.kv_len = seq.num_committed - 1
        return idx, logits

    def draft(self, seqs: Seq, budgets: Seq[int]) -> list[TokenTree | None]:
        trees: list[TokenTree | None] = [None] * len(seqs)
        got, logits = self.draft_logits(seqs)
        if logits is None:
            return trees
        max_rank = min(MAX_RANK, logits.shape[-1])
        top = self.vocab.token_ids(logits.topk(max_rank, dim=-1).indices).tolist()   # [B, k+1, R]
        for j, i in enumerate(got):   # after h hypothetical tokens, depth d takes distribution h + d - 1
            tree = cartesian_fill(self.template(budgets[i]), seqs[i].token_ids[-1], top[j][len(seqs[i].hypothetical):])
            if tree.num_nodes > 1:
                trees[i] = tree
        return trees
