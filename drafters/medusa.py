"""Medusa-1 drafter: K residual heads over the frozen target's last hidden state.

Each step, per sequence: the heads read h_t, the target's last-layer hidden state of the last
token that has features (in the engine's feature store, engine/features.py: after a
verification that is the last accepted
node, or the root when nothing was accepted; after a prefill the last prompt token). The target's
own LM head at h_t predicted the token at t+1, which is the bonus token = the tree root; head k
(k = 1..K) predicts the token at t+1+k, i.e. tree depth k:

    logits_k = LMHead(h_t + SiLU(W_k h_t + b_k))      (the target's LM head, shared by reference)

The tree is Cartesian (Medusa's sparse tree): a node at depth d with rank r carries the r-th most
likely token of head d, whatever its parent. Trees are deterministic drafts (`draft_probs=None`,
one-hot q), lossless for greedy and sampling requests alike.

Tree shape: a list of rank paths in *preference order* (each prefix of the list is a tree), cut
to the scheduler's budget and laid out level-major by `TreeTemplate.from_choices`. The list is,
in order of precedence: the `tree` option; the tuned order a trained checkpoint carries (chosen
by greedy expected-accepted-length maximisation on held-back data, see nets/tree_tuning.py);
Medusa's `medusa_mc_sim_7b_63` from the shared trees.json; a built-in order from a generic
acceptance prior when that file is absent.

All sequences of a step go through one heads matmul and one LM-head matmul.

After hypothetical tokens (a grammar's forced ones, `Drafter.drafts_after_uncommitted`) there is
no feature for the new root: the heads still read h_t of the committed root's predecessor, and a
tree after k forced tokens takes its depth d from head k + d (the heads' own positions), cut where
the heads run out.

Options (`--drafter-option medusa.KEY=VALUE`):
  checkpoint=PATH   a trained checkpoint folder (`specserve train medusa ...`); default: the shipped
                    checkpoint in drafters/checkpoints/ whose target fingerprint matches
  tree=SPEC         "auto" (default), a trees.json name, "chain", or a JSON list of rank paths
  num_heads=K       use only the first K heads (default: all the checkpoint has)
  draft_vocab=N     draft from the N tokens the target chose most often in training (default 8192
                    when the checkpoint has that ranking; 0 = the whole vocabulary; drafters.draft_vocab)
  random_init=true  FOR TESTS: untrained heads (zero = the target's next-token prediction at every
                    depth; `init_std` > 0 draws random weights with `seed`)
  heads=MODULE      (Python API, alias `module`) an in-memory MedusaHeads, e.g. the one being trained

Standardized walltime (`model_runs`): one run per head read per sequence (a propose runs the
first `depth` heads for every live sequence: depth runs each), at c = (one head's parameters +
the LM-head rows it multiplies, the draft vocabulary's rows x hidden size) / the target's.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Sequence as Seq

import torch

from specserve.drafters.base import Drafter, DrafterContext, param_count, register
from specserve.drafters.draft_vocab import DraftVocab
from specserve.drafters.nets.checkpoint import load_checkpoint, resolve_checkpoint, target_fingerprint
from specserve.drafters.nets.medusa import DEFAULT_NUM_HEADS, MedusaHeads, load_template
from specserve.drafters.nets.tree_tuning import greedy_tree_order
from specserve.engine.features import FeatureStore
from specserve.engine.tree import TokenTree, TreeTemplate, cartesian_fill, preference_prefix, tree_depths

logger = logging.getLogger("specserve")

CHECKPOINTS_DIR = Path(__file__).resolve().parent / "checkpoints"


def _prior_order(num_heads: int, nodes: int = 64) -> list[list[int]]:
    """A fallback tree order from a generic prior: top-1 right 60 % of the time at depth 1, less
    deeper, rank r about half as likely as rank r-1."""
    acc = [[0.6 * 0.85 ** d * 0.45 ** r for r in range(10)] for d in range(num_heads)]
    return greedy_tree_order(acc, nodes)


def parse_tree_option(value, num_heads: int, drafter: str = "medusa") -> list[list[int]] | None:
    """The `tree` option as a path list, or None for "auto" (shared by the drafters whose trees
    are rank paths over per-depth distributions: medusa, parallelspec)."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "auto", "tuned")):
        return None
    if isinstance(value, (list, tuple)):
        return [list(map(int, p)) for p in value]
    text = str(value).strip()
    if text.lower() == "chain":
        return [[0] * d for d in range(1, num_heads + 1)]
    if text.startswith("["):
        return [list(map(int, p)) for p in json.loads(text)]
    path = Path(text).expanduser()
    if path.is_file():
        return [list(map(int, p)) for p in json.loads(path.read_text(encoding="utf-8"))]

    paths = load_template(text)
    if paths is None:
        raise ValueError(f"{drafter} tree {text!r}: not 'auto', 'chain', a JSON path list, a file, or a tree of "
                         f"trees.json (set SPECSERVE_DATA to the folder holding it)")
    return paths


@register("medusa")
class MedusaDrafter(Drafter):
    name = "medusa"
    needs_features = True

    def __init__(self, ctx: DrafterContext, *, checkpoint: str | None = None, tree=None,
                 num_heads: int | None = None, random_init: bool = False, init_std: float = 0.0, seed: int = 0,
                 draft_vocab: int | None = None, heads=None, module=None):
        target, model_config, device, dtype = ctx.target, ctx.model_config, ctx.device, ctx.dtype

        self.target = target                     # its LM head is used by reference, never copied
        self.device, self.dtype = device, dtype
        tuned = None
        heads = heads if heads is not None else module
        if heads is not None:                    # an in-memory MedusaHeads (tests, the trainer), used as it is
            self.heads = heads.to(device=device, dtype=dtype)
        elif random_init:
            self.heads = MedusaHeads(num_heads or DEFAULT_NUM_HEADS, model_config.hidden_size)
            if init_std:
                self.heads.randomize_(float(init_std), int(seed))
            self.heads = self.heads.to(device=device, dtype=dtype)
        else:
            fingerprint = target_fingerprint(model_config, target)
            checkpoint = resolve_checkpoint("medusa", fingerprint, checkpoint, CHECKPOINTS_DIR)
            tensors, meta = load_checkpoint(checkpoint, kind="medusa", fingerprint=fingerprint)
            if tensors["weight"].shape[-1] != model_config.hidden_size:
                raise ValueError(f"{checkpoint}: heads of width {tensors['weight'].shape[-1]} for a target of "
                                 f"hidden size {model_config.hidden_size}")
            self.heads = MedusaHeads.from_tensors(tensors, dtype=dtype, device=device)
            tuned = (meta.tree or {}).get("choices")
        self.heads.eval().requires_grad_(False)
        self.vocab = DraftVocab(target.lm_head_weight, getattr(self.heads, "vocab_rank", None), draft_vocab,
                                drafter="medusa", full_logits=target.compute_logits)
        self.num_heads = self.heads.num_heads if num_heads is None else min(int(num_heads), self.heads.num_heads)
        order = parse_tree_option(tree, self.num_heads)
        if order is None:
            order = tuned or load_template() or _prior_order(self.num_heads)
        self.order = [list(p) for p in order if 0 < len(p) <= self.num_heads]
        if not self.order:
            raise ValueError("the medusa tree has no path within the heads' depth")
        self._templates: dict[int, tuple[TreeTemplate, list[int], int, int]] = {}
        self.num_runs = 0
        rows = self.vocab.size or self.vocab.vocab_size
        per_head = param_count(self.heads) / self.heads.num_heads
        self.cost = (per_head + rows * model_config.hidden_size) / param_count(target)
        # the target's features: the engine's store, or (built outside an engine) one fed by `observe`
        self._own_features = ctx.features is None
        self.features = ctx.features
        if self.features is None:
            self.features = FeatureStore(model_config.hidden_size, dtype, device)

    def model_runs(self) -> dict[str, tuple[int, float]]:
        return {self.name: (self.num_runs, self.cost)}

    drafts_after_uncommitted = True   # see Drafter and the module docstring; it keeps no per-draft state

    # ---- trees --------------------------------------------------------------------------------------------------

    def template(self, budget: int) -> tuple[TreeTemplate, list[int], int, int]:
        """(template, depth of each node, max depth, candidates needed per head) for a budget."""
        budget = min(budget, len(self.order))
        if budget not in self._templates:
            tpl = TreeTemplate.from_choices(preference_prefix(self.order, budget)).truncate(budget + 1)
            depths = tree_depths(tpl.parents)
            self._templates[budget] = (tpl, depths, max(depths), max(tpl.ranks) + 1)
        return self._templates[budget]

    # ---- protocol -----------------------------------------------------------------------------------------------

    def observe(self, seqs: Seq, features: Seq) -> None:
        """Features are read from the feature store; built outside an engine, `observe` fills its own."""
        if not self._own_features:
            return
        for seq, (start, hidden) in zip(seqs, features):
            try:
                self.features.write(seq.seq_id, int(start), hidden)
            except ValueError:   # a gap: the features in between never came; no draft until they do
                self.features.free(seq.seq_id)

    def finish(self, seq) -> None:
        if self._own_features:
            self.features.free(seq.seq_id)

    @torch.inference_mode()
    def propose(self, seqs: Seq, budgets: Seq[int]) -> list[TokenTree | None]:
        trees: list[TokenTree | None] = [None] * len(seqs)
        live, rows, tpls, skip = [], [], [], []
        for i, (seq, budget) in enumerate(zip(seqs, budgets)):
            st = self.features.last(seq.seq_id)
            # the features must be those of the committed token right before the committed root; after
            # k hypothetical tokens (a grammar's forced ones) the tree's depth d is head k + d's
            k = len(seq.hypothetical)
            if budget <= 0 or st is None or st[0] != seq.num_committed - 2 or k >= self.num_heads:
                continue
            live.append(i)
            rows.append(st[1])
            tpls.append(self.template(budget))
            skip.append(k)
        if not live:
            return trees
        depth = min(self.num_heads, max(t[2] + k for t, k in zip(tpls, skip)))
        width = max(t[3] for t in tpls)
        h = torch.stack(rows).to(self.heads.weight.dtype)                    # [N, H]
        out = self.heads(h, depth)                                           # [N, depth, H]
        self.num_runs += len(live) * depth
        logits = self.vocab.logits(out.reshape(-1, out.shape[-1]))           # [N * depth, draft vocab]
        top = self.vocab.token_ids(logits.topk(width, dim=-1).indices).view(len(live), depth, width).tolist()
        for j, i in enumerate(live):   # (cut where the heads run out: a topological prefix)
            trees[i] = cartesian_fill(tpls[j][0], seqs[i].token_ids[-1], top[j][skip[j]:])
        return trees
