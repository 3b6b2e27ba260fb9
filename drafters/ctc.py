"""CTC-drafter (Wen et al.): one decoder layer over the target's features emits T raw slots over
the draft vocabulary ∪ {blank}; per-slot top-k combinations are collapsed the CTC way (merge
adjacent repeats, drop blanks) and merged into one deduplicated token trie, verified as one tree.

The network is `specserve.drafters.nets.ctc.CTCDraftNet` (its docstring has the arithmetic), the
trainer `specserve.drafters.train.ctc` (`specserve train ctc`).

Decisions on what the paper leaves open (digest §1.8):

1. **How one layer emits T slots, and T.** ParallelSpec-style placeholder rows (option c): the
   drafter keeps, per sequence, the keys and values of one row per real position
   (fc([f_p ‖ e(x_{p+1})]), the target's post-norm feature and the next token's embedding) and
   appends T slot rows (the last row plus a learned slot embedding, at positions t+2 .. t+1+T)
   that attend to all real rows. This keeps what the paper describes -- a transformer layer over the
   hidden-state sequence, all slots in one parallel pass -- and lets each slot pick its own context
   (a Medusa-like projection of the last feature, option b, cannot). Rows cost two small
   projections each and are computed once; a step costs T rows through the layer plus the LM head.
   **T = 5, L = 4**: four distilled tokens per CTC target in five slots, one slot of slack for a
   blank or a repeat anywhere (alignment freedom, the point of CTC), at the depth of the Medusa
   heads it is compared with (4); deeper drafts are rarely accepted on a 135M target.
2. **The blank with a shared, frozen LM head**: one trained extra row and bias; the token logits
   are the target's LM head rows (by reference, never copied except for the draft vocabulary's
   rows, see drafters.draft_vocab). The softmax is over the draft vocabulary the checkpoint was
   trained with (the 4096 most frequent training labels, 90 % of held-back labels on SmolLM2) plus
   the blank: training and serving normalise over the same set, and the training softmax is exact
   and a fifth of the whole vocabulary's cost on a CPU.
3. **CTC label span per position**: after row t (root x_{t+1}), the target's greedy labels of the
   next L answer positions (the tokens at t+2 .. t+1+L), cut before the first token outside the
   draft vocabulary (the drafter could not propose it: it learns to stop there) and to what fits
   T slots (|Y| + adjacent repeats <= T). Positions whose span is cut by the end of the data
   without EOS are not trained (their true continuation is unknown); a span ending with EOS is.
   Collapsing does not merge slot 1 with the root (the CTC target does not contain the root).
4. **Top-k and candidate selection**: the k best tokens of each slot (blank included; k = 4) give
   k^T raw candidates of fixed length T scored by their log-probability (sum over slots); the
   `candidates` (64) best are collapsed. Each distinct collapsed prefix becomes one trie node whose
   weight is the probability mass of the raw candidates passing through it (an estimate of the CTC
   probability that the drafted continuation starts with it); the `budget` heaviest nodes form the
   tree (a node weighs at least as much as any descendant, so they are prefix-closed), level-major,
   children heaviest first. Empty collapses (all blank) only add weight to the root.
5. **Collapse -> deduplicated trie** rather than masked raw layouts: no duplicate verification, and
   positions are plain depths.
6. **Verification**: drafts are deterministic (`draft_probs=None`, one-hot q): greedy requests accept
   the child equal to the target's argmax, sampled ones the one-hot rule (accept x with p(x); on
   rejection p without x, renormalised), so the output is lossless for greedy and sampling alike.
7. **Collapse cost**: scoring all combinations, top candidates and the collapse mask are batched
   tensor ops for every sequence of the step; only the trie insertion (candidates x T) is Python.

Options (`--drafter-option ctc.KEY=VALUE`):
  checkpoint=PATH   a trained checkpoint folder; default: the shipped one whose target fingerprint matches
  top_k=K           tokens per slot (blank included) combined into raw candidates (default 4)
  candidates=M      raw candidates collapsed into the trie (default 64)
  draft_vocab=N     draft from the N most frequent training labels (default: what the checkpoint was
                    trained with; 0 = the whole vocabulary, off the training distribution)
  random_init=true  FOR TESTS: an untrained net (`num_slots`, `seed`); `net=` an in-memory CTCDraftNet

Standardized walltime (`model_runs`): one run per sequence drafted for (a propose's catch-up rows
and its slot forward, then the LM head over the T slots), at c = (the net's own parameters + the
LM-head rows it multiplies, the draft vocabulary's rows x hidden size) / the target's parameters.
"""

from __future__ import annotations

from functools import lru_cache
from itertools import product
from typing import Sequence as Seq

import torch

from specserve.drafters.base import DrafterContext, register
from specserve.drafters.draft_vocab import DraftVocab
from specserve.drafters.features import FeatureDrafter, FeatureState
from specserve.drafters.nets.ctc import DEFAULT_SLOTS, CTCDraftNet, load_net, shipped_checkpoint
from specserve.engine.model import rope_tables
from specserve.engine.tree import NO_PARENT, TokenTree

BLANK = -1                 # the blank in token tensors and lists
DEFAULT_TOP_K = 4
DEFAULT_CANDIDATES = 64
MAX_COMBINATIONS = 1 << 16


# ---- collapse and trie ----------------------------------------------------------------------------------------------

def ctc_collapse(tokens: Seq[int], blank: int = BLANK) -> list[int]:
    """CTC's many-to-one map: merge adjacent repeats, then drop blanks.

    >>> ctc_collapse([5, 5, -1, 5, 7, 7])
    [5, 5, 7]
    """
    out, prev = [], None
    for t in tokens:
        if t != prev and t != blank:
            out.append(t)
        prev = t
    return out


def collapse_keep(tokens: torch.Tensor, blank: int = BLANK) -> torch.Tensor:
    """[..., T] raw slots -> [..., T] bool: the slots that survive the collapse (not blank, not equal
    to the slot before), so `tokens[keep]` row by row is `ctc_collapse` of the row."""
    keep = tokens != blank
    keep[..., 1:] &= tokens[..., 1:] != tokens[..., :-1]
    return keep


@lru_cache(maxsize=32)
def slot_combinations(k: int, num_slots: int) -> torch.Tensor:
    """[k^T, T] int64: every choice of one rank (0..k-1) per slot, in lexicographic order."""
    if k ** num_slots > MAX_COMBINATIONS:
        raise ValueError(f"ctc: top_k ** num_slots = {k ** num_slots} raw combinations is too many "
                         f"(at most {MAX_COMBINATIONS})")
    return torch.tensor(list(product(range(k), repeat=num_slots)), dtype=torch.int64).view(-1, num_slots)


def raw_candidates(top_logp: torch.Tensor, top_ids: torch.Tensor, num: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `num` most likely raw candidates of each sequence.

    top_logp, top_ids [N, T, k]: each slot's k best log-probabilities and tokens (BLANK for the
    blank). A raw candidate takes one of the k per slot; its score is the sum of its slots'
    log-probabilities (the slots are independent given the context). Returns (scores [N, M],
    tokens [N, M, T]), best first (ties: the lexicographically smaller rank tuple first),
    M = min(num, k^T)."""
    N, T, k = top_logp.shape
    combos = slot_combinations(k, T).to(top_logp.device)                         # [C, T]
    slot = torch.arange(T, device=top_logp.device)
    scores = top_logp[:, slot, combos].sum(-1)                                   # [N, C]
    m = min(int(num), combos.shape[0])
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :m]   # [N, M]
    chosen = combos[order]                                                       # [N, M, T] ranks
    tokens = top_ids.gather(2, chosen.transpose(1, 2)).transpose(1, 2)           # [N, M, T]
    return scores.gather(1, order), tokens


def build_trie(root: int, candidates: Seq[Seq[int]], weights: Seq[float], budget: int) -> TokenTree | None:
    """The deduplicated trie of collapsed candidates, cut to `budget` draft nodes.

    Every distinct prefix of a candidate is a node whose weight is the sum of the weights of the
    candidates through it. The `budget` heaviest nodes are kept (ties: shallower, then first
    seen), which is prefix-closed since a node weighs at least as much as any of its descendants;
    they are laid out level-major with each node's children heaviest first. None when no
    candidate has a token (or the budget is 0).

    Example: candidates [7, 8], [7, 9], [7, 8] with weights 0.5, 0.3, 0.1 and budget 2 give the
    nodes 7 (0.9) and 7->8 (0.6): tokens [root, 7, 8], parents [-1, 0, 1].

    Not `engine.tree.trie_from_candidates`: that helper scores a node by the *best* candidate
    through it, CTC by the *sum* (the probability mass of every raw candidate collapsing through
    the node), which is what decides the cut. The cut and the layout are otherwise the helper's
    (ties shallower then first seen; level-major, children best first), and the helper does give
    these very trees when handed one candidate per node of the summed trie (its path, scored by
    its weight, in the order first seen: an ancestor never weighs less, floating point included,
    since its sum has the same terms plus others, added in the same order). That route was
    checked tree for tree against this function, but costs a second walk of every path and is
    30-40 % slower per sequence (0.6 -> 0.8 ms for 64 candidates of 5 slots), which the trainer's
    offline evaluation pays at every held-back position; so the trie is built here in one pass."""
    if budget <= 0:
        return None
    tokens, parents, depth, weight = [root], [NO_PARENT], [0], [0.0]
    children: list[dict[int, int]] = [{}]
    for cand, w in zip(candidates, weights):
        node = 0
        for tok in cand:
            nxt = children[node].get(tok)
            if nxt is None:
                nxt = len(tokens)
                children[node][tok] = nxt
                tokens.append(int(tok))
                parents.append(node)
                depth.append(depth[node] + 1)
                weight.append(0.0)
                children.append({})
            weight[nxt] += float(w)
            node = nxt
    if len(tokens) == 1:
        return None
    best = sorted(range(1, len(tokens)), key=lambda i: (-weight[i], depth[i], i))[:budget]
    chosen = set(best)
    out_tokens, out_parents, index = [root], [NO_PARENT], {0: 0}
    frontier = [0]
    while frontier:                       # breadth first: level-major, children heaviest first
        nxt_frontier = []
        for node in frontier:
            kids = sorted((c for c in children[node].values() if c in chosen), key=lambda c: (-weight[c], c))
            for c in kids:
                index[c] = len(out_tokens)
                out_tokens.append(tokens[c])
                out_parents.append(index[node])
                nxt_frontier.append(c)
        frontier = nxt_frontier
    return TokenTree(out_tokens, out_parents)


def draft_trees(roots: Seq[int], top_logp: torch.Tensor, top_ids: torch.Tensor, budgets: Seq[int],
                num_candidates: int, after: Seq[Seq[int]] | None = None) -> list[TokenTree | None]:
    """Per sequence: raw candidates from the slots' top-k, CTC collapse, trie within its budget.
    `after`: per sequence, tokens drafted before the root (a grammar's forced ones, the root their
    last): only the candidates that begin with them count, with them cut off."""
    scores, raw = raw_candidates(top_logp, top_ids, num_candidates)
    keep = collapse_keep(raw)
    probs = scores.double().exp().tolist()
    raw_l, keep_l = raw.tolist(), keep.tolist()
    trees = []
    for n, root in enumerate(roots):
        cands = [[t for t, kept in zip(r, kp) if kept] for r, kp in zip(raw_l[n], keep_l[n])]
        weights = probs[n]
        lead = list(after[n]) if after is not None else []
        if lead:
            pairs = [(c[len(lead):], w) for c, w in zip(cands, weights) if c[:len(lead)] == lead]
            cands, weights = [c for c, _ in pairs], [w for _, w in pairs]
        trees.append(build_trie(int(root), cands, weights, int(budgets[n])))
    return trees


# ---- the drafter ----------------------------------------------------------------------------------------------------

class _SeqState(FeatureState):
    __slots__ = ("keys", "values", "last_row")

    def __init__(self):
        super().__init__()                            # rows 0..kv_len-1 have keys/values
        self.keys: torch.Tensor | None = None         # [capacity, kv_heads, D]
        self.values: torch.Tensor | None = None
        self.last_row: torch.Tensor | None = None     # r_{kv_len-1}: the slots' base when kv_len == N-1


@register("ctc")
class CTCDrafter(FeatureDrafter):
    """See the module docstring. The target's features are read from the engine's feature store
    (`ctx.features`, engine/features.py); built outside an engine, the drafter keeps its own store,
    fed by `observe`.

    The rows' keys and values stay in per-sequence growable tensors rather than a `PagedDraftKV`:
    only keys and values of real rows are ever stored (the T slot rows are never cached, so there
    is nothing to roll back after a verification), and the slots read them through
    `CTCDraftNet.slot_features`, a dense attention over each sequence's rows 0..t -- the arithmetic
    the trainer's `forward_dense` is checked against. A paged pool would need a paged slot
    attention (slots that see the rows but not each other) for no saving."""

    name = "ctc"
    State = _SeqState
    # see Drafter: after hypothetical tokens (a grammar's forced ones) its slots still start at the
    # committed root, and the candidates that begin with those tokens give the draft after them
    drafts_after_uncommitted = True

    def __init__(self, ctx: DrafterContext, *, checkpoint: str | None = None, top_k: int | None = None,
                 candidates: int | None = None, draft_vocab: int | None = None, random_init: bool = False,
                 num_slots: int = DEFAULT_SLOTS, seed: int = 0, net: CTCDraftNet | None = None):
        super().__init__(ctx)
        target, model_config = ctx.target, ctx.model_config
        trained_vocab, tuned = None, {}
        if net is None:
            if random_init:
                net = CTCDraftNet.from_target(model_config, target, num_slots=int(num_slots), seed=int(seed))
            else:
                net = self.load_trained(checkpoint, model_config, shipped_checkpoint, load_net, what="net")
                trained_vocab = self.checkpoint_meta.hyperparams.get("vocab")
                tuned = self.checkpoint_meta.hyperparams.get("selection") or {}
        else:
            net = self.in_memory(net)
        self.net = net.to(device=self.device, dtype=self.dtype).eval()
        self.num_slots = self.net.num_slots
        self.top_k = int(top_k if top_k is not None else tuned.get("top_k", DEFAULT_TOP_K))
        self.num_candidates = int(candidates if candidates is not None else tuned.get("candidates", DEFAULT_CANDIDATES))
        if self.top_k < 1 or self.num_candidates < 1:
            raise ValueError(f"ctc: top_k and candidates must be >= 1 (got {self.top_k}, {self.num_candidates})")
        slot_combinations(self.top_k, self.num_slots)          # refuses too many combinations now
        if draft_vocab is None and self.net.vocab_rank is not None and trained_vocab:
            draft_vocab = int(trained_vocab)
        self.vocab = DraftVocab(target.lm_head_weight, self.net.vocab_rank, draft_vocab, drafter="ctc",
                                full_logits=target.compute_logits)
        cos, sin = rope_tables(model_config, ctx.max_model_len + self.num_slots + 2, self.device)
        self.rope_cos, self.rope_sin = cos.to(self.dtype), sin.to(self.dtype)
        self.count_cost(self.net)

    # ---- protocol ---------------------------------------------------------------------------------------------------

    def rewind(self, seq_id: int, st: _SeqState, start: int) -> None:
        if start < st.kv_len:
            st.last_row = None
        super().rewind(seq_id, st, start)

    # ---- rows -------------------------------------------------------------------------------------------------------

    def _store(self, st: _SeqState, k: torch.Tensor, v: torch.Tensor) -> None:
        need = st.kv_len + k.shape[0]
        if st.keys is None or st.keys.shape[0] < need:
            cap = max(need, 64, 2 * (st.keys.shape[0] if st.keys is not None else 0))
            keys = k.new_empty(cap, *k.shape[1:])
            values = v.new_empty(cap, *v.shape[1:])
            if st.keys is not None and st.kv_len:
                keys[:st.kv_len] = st.keys[:st.kv_len]
                values[:st.kv_len] = st.values[:st.kv_len]
            st.keys, st.values = keys, values
        st.keys[st.kv_len:need] = k
        st.values[st.kv_len:need] = v
        st.kv_len = need

    def catch_up(self, seqs: Seq) -> list[bool]:
        """Turn the features of the positions without a row yet into rows up to row N-2 (its next
        token is the root) for every sequence, all in one batch; returns per sequence whether it can
        be drafted for (False while the features right before the root are missing)."""
        ready, todo = [], []
        for seq in seqs:
            st = self.state.setdefault(seq.seq_id, self.State())
            n = seq.num_committed                            # hypothetical tokens have no features
            missing = n - 1 - st.kv_len                      # rows kv_len .. n-2
            ok = n >= 2 and missing >= 0 and self.features.length(seq.seq_id) >= n - 1
            ok = ok and (missing > 0 or st.last_row is not None)
            ready.append(ok)
            if ok and missing > 0:
                todo.append((seq, st, missing))
        if not todo:
            return ready
        feats, ids, pos = [], [], []
        for seq, st, missing in todo:
            feats.append(self.features.view(seq.seq_id, st.kv_len, st.kv_len + missing))
            ids.extend(seq.token_ids[st.kv_len + 1:st.kv_len + 1 + missing])
            pos.extend(range(st.kv_len, st.kv_len + missing))
        positions = torch.tensor(pos, dtype=torch.int64, device=self.device)
        embeds = self.target.embed(torch.tensor(ids, dtype=torch.int64, device=self.device)).to(self.dtype)
        rows = self.net.rows(torch.cat(feats).to(device=self.device, dtype=self.dtype), embeds)
        k, v = self.net.row_kv(rows, self.rope_cos[positions], self.rope_sin[positions])
        a = 0
        for seq, st, missing in todo:
            self._store(st, k[a:a + missing], v[a:a + missing])
            st.last_row = rows[a + missing - 1].clone()
            a += missing
        return ready

    # ---- drafting ---------------------------------------------------------------------------------------------------

    def slot_log_probs(self, seqs: Seq) -> torch.Tensor:
        """fp32 log-probabilities [N, T, V' + 1] of the slots after each (caught-up) sequence's root
        over the draft vocabulary and the blank (last)."""
        states = [self.state[s.seq_id] for s in seqs]
        base = torch.stack([st.last_row for st in states])
        positions = torch.tensor([st.kv_len - 1 for st in states], dtype=torch.int64, device=self.device)
        out = self.net.slot_features(base, positions, self.rope_cos, self.rope_sin,
                                     [st.keys[:st.kv_len] for st in states], [st.values[:st.kv_len] for st in states])
        return self.net.log_probs_from_logits(out, self.vocab.logits(out))

    def draft(self, seqs: Seq, budgets: Seq[int]) -> list[TokenTree | None]:
        trees: list[TokenTree | None] = [None] * len(seqs)
        ready = self.catch_up(seqs)
        act = [i for i, ok in enumerate(ready) if ok]
        if not act:
            return trees
        logp = self.slot_log_probs([seqs[i] for i in act])               # [N, T, V' + 1]
        self.num_runs += len(act)
        top = logp.topk(min(self.top_k, logp.shape[-1]), dim=-1)
        blank = logp.shape[-1] - 1
        ids = torch.where(top.indices == blank, torch.full_like(top.indices, BLANK),
                          self.vocab.token_ids(top.indices.clamp(max=blank - 1)))
        drafted = draft_trees([seqs[i].token_ids[-1] for i in act], top.values, ids,
                              [budgets[i] for i in act], self.num_candidates, [seqs[i].hypothetical for i in act])
        for i, tree in zip(act, drafted):
            trees[i] = tree
        return trees


__all__ = ["BLANK", "CTCDrafter", "build_trie", "collapse_keep", "ctc_collapse", "draft_trees", "raw_candidates",
           "slot_combinations"]
