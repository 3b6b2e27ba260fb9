"""A smaller model with the target's tokenizer drafts chains (SpS) or multi-candidate trees (MCSD).

The draft model keeps its own paged KV cache, pruned to the accepted path after every step like
the target's. Each step, per sequence:

1. catch up: feed the tokens committed since the last step (the bonus token, and an accepted leaf
   whose KV the draft never computed) -> the draft distribution after the root;
2. grow the tree level by level with a k-configuration (k1, k2, ...): every node of level d-1
   gets k_d children, drawn **without replacement** from the draft distribution q at that node
   (Gumbel-top-k, so the residual rule of verification stays exact) — or the top-k_d tokens for
   greedy and seeded requests and with `deterministic=True` (deterministic drafts: one-hot q,
   lossless under sampling too). A chain (SpS) is the k-configuration (1, 1, ..., 1). A request
   with penalties, logit_bias, min_tokens or a grammar has its draft logits at each node processed
   as the target's are at that node, along the node's path (`DraftRequest.processed`), so q is the
   processed law's counterpart and nothing the request bans is drafted. A pick outside the
   support (k above the tokens q, or the processed logits, allow) could never be accepted: it and
   its subtree are cut from the tree.
   All sequences of the batch advance one level per draft forward, each level attending to the
   prefix plus its own ancestors (tree mask over the tree so far);
3. after verification keep only the accepted path's KV.

Proposing from an extended prefix (`DraftRequest.hypothetical`, e.g. for a cascade): the catch-up
feeds the hypothetical tokens like committed ones, and after the proposal the drafter's cache is
cut back to the committed prefix (those entries are rewritten when the real tokens come).

The tree is cut to the scheduler's budget (level-major order keeps every prefix a valid tree).

`target_init_width` = W > 1 is MCSD's target-initialised roots, an explicitly LOSSY opt-in for
sampling requests (greedy and logprobs requests keep W = 1): every verification ends by drawing W
tokens from the target instead of one; the first is held back from the client, and the next tree
is a forest with those W tokens as roots, the k-configuration under each (MCSD+'s (2,4,3,1,1) is
`target_init_width=2, k_config=4,3,1,1`). Verification keeps the root whose subtree accepted most
(the first-drawn on ties), which biases the output towards easily drafted text.

**Dynamic MCSD** (MCSD+): a fork `k_config=fork:W,D` (W chains from the root that never branch
again; with `target_init_width=W` and `k_config=chain:D`, W target-initialised roots each followed
by a chain) drafted level by level as above, plus `decision=DIR`, an early-stop decision model
(drafters/nets/mcsd_decision.py, trained by `specserve train mcsd-decision`; `decision=type1` or
`type2` takes the shipped one for the target, if any). After each level the
decision model scores every newest token of every sequence in one batched call (from the draft
forward that produced it: no extra forward); a sequence whose newest tokens all score below β
(`decision_threshold`, default 0.4) stops growing, and its tree is the level-major prefix of the
levels drafted so far (at least one). Stopping only shortens drafts, so losslessness is untouched.
Without `decision` a fork drafts to full depth (static). Any k-configuration can stop early the
same way; the paper's dynamic mode is the fork. `mean_stop_depth` is the mean depth of the trees
proposed.

The draft forwards' tree masks are sliced, never rebuilt: each template's ancestor mask is built
once for its full depth (`engine.tree.tree_topology`, the one place masks are derived), and a
level fed at depth d attends through the top-left block of it up to that level's last node (MCSD+'s
sliced mask: level-major order makes the first d levels' mask the top-left square of the full one).

The draft model is either loaded from a source (`draft_model=` anything `--model` accepts) or is
the target's first `draft_layers` layers with its final norm and LM head, sharing the weights.

Standardized walltime (`model_runs`): one run per sequence served by each draft forward (the
catch-up forward, every tree level's forward, a cascade review), at the cost ratio c = the draft
model's parameters / the target's (`param_count`: embedding, the layers it runs, final norm and LM
head, each shared tensor once, counted in both the same way; a truncated target's c is then its
share of the target's parameters, the shared embedding and LM head included as in the target).
A draft vocabulary does not lower c (the paper's MS cost counts a model's parameters).
"""

from __future__ import annotations

import math

from pathlib import Path
from typing import Sequence as Seq

import torch

from specserve.drafters.base import Drafter, DrafterContext, param_count, register
from specserve.drafters.draft_vocab import DraftVocab
from specserve.drafters.nets.checkpoint import target_fingerprint
from specserve.drafters.nets.mcsd_decision import load_decision, shipped_decision
from specserve.engine.config import ModelConfig
from specserve.engine.kv_cache import PagedDraftKV
from specserve.engine.loader import load_model
from specserve.engine.model import LlamaModel
from specserve.engine.sampler import SamplingTensors, processed_probs
from specserve.engine.tree import NO_PARENT, TokenTree, TreeTemplate, num_roots, tree_depths, tree_topology

DEFAULT_DECISION_THRESHOLD = 0.4   # MCSD+'s β


def parse_k_config(value) -> tuple[int, ...]:
    """"4,2,2,1" / (4, 2, 2, 1) -> (4, 2, 2, 1); "chain:5" -> (1, 1, 1, 1, 1); "fork:W,D" (MCSD+'s
    fork: W chains of depth D that never branch again) -> (W, 1, ..., 1), D entries."""
    if isinstance(value, str):
        value = value.replace(" ", "")
        if value.startswith("chain:"):
            return parse_k_config((1,) * int(value.split(":", 1)[1]))
        if value.startswith("fork:"):
            parts = value.split(":", 1)[1].split(",")
            if len(parts) != 2 or not all(x.lstrip("-").isdigit() for x in parts):
                raise ValueError(f"a fork k-configuration is fork:WIDTH,DEPTH, got {value!r}")
            width, depth = int(parts[0]), int(parts[1])
            if width < 1 or depth < 1:
                raise ValueError(f"a fork needs width >= 1 and depth >= 1, got {value!r}")
            return (width,) + (1,) * (depth - 1)
        value = [int(x) for x in value.split(",") if x]
    ks = tuple(int(k) for k in value)
    if not ks or any(k < 1 for k in ks):
        raise ValueError(f"a k-configuration needs positive branching factors, got {value!r}")
    return ks


def seq_params_exclude(params) -> bool:
    """Requests that never get target-initialised roots: greedy ones and seeded ones (lossless by
    contract: a seeded request reproduces plain decoding with its seed), and ones asking for logprobs."""
    return params.greedy or params.seed is not None or params.logprobs is not None


class _SeqState:
    __slots__ = ("draft_len", "fed")

    def __init__(self):
        self.draft_len = 0         # tokens of seq.token_ids whose KV is in the draft cache
        self.fed: list[bool] = []  # per node of the last proposed tree: its KV is in the draft cache


@register("draft_model")
class DraftModelDrafter(Drafter):
    name = "draft_model"
    drafts_after_uncommitted = True   # see Drafter; its cache is cut back to the committed prefix

    def __init__(self, ctx: DrafterContext, *, draft_model: str | None = None, draft_layers: int | None = None,
                 k_config="chain:4", num_blocks: int | None = None, block_size: int = 16,
                 target_init_width: int = 1, deterministic: bool = False, prebuilt: LlamaModel | None = None,
                 draft_vocab: int | None = None, vocab_rank: torch.Tensor | None = None,
                 decision: str | None = None, decision_threshold: float | None = None):
        target, model_config, device, dtype = ctx.target, ctx.model_config, ctx.device, ctx.dtype
        max_model_len, max_num_seqs = ctx.max_model_len, ctx.max_num_seqs
        if int(target_init_width) < 1:
            raise ValueError(f"target_init_width must be >= 1, got {target_init_width}")
        if decision_threshold is not None:
            if decision is None:
                raise ValueError("decision_threshold needs a decision model (decision=DIR)")
            if isinstance(decision_threshold, bool) or not 0.0 <= float(decision_threshold) <= 1.0:
                raise ValueError(f"decision_threshold must be a probability in [0, 1], got {decision_threshold!r}")
        self.k_config = parse_k_config(k_config)
        self.deterministic = deterministic
        self.target_init_width = int(target_init_width)
        self.template = TreeTemplate.from_branching(self.k_config)
        self.forests = {w: TreeTemplate.forest(w, self.k_config) for w in range(2, self.target_init_width + 1)}
        # the sliced mask: each template's ancestor mask, built once for its full depth
        self.masks = {t: tree_topology(t.parents).mask for t in [self.template, *self.forests.values()]}
        self.device = device
        if prebuilt is not None:          # a subclass's own model (e.g. a distilled student)
            self.model, cfg = prebuilt, prebuilt.cfg
        elif draft_model:
            loaded = load_model(draft_model)
            if loaded.hf_config.vocab_size != model_config.vocab_size:
                raise ValueError(f"draft model {draft_model!r} has vocabulary {loaded.hf_config.vocab_size}, "
                                 f"the target {model_config.vocab_size}: they must share the tokenizer")
            cfg = ModelConfig.from_hf(loaded.hf_config)
            self.model = LlamaModel.from_state_dict(cfg, loaded.state_dict, max_positions=max_model_len,
                                                    dtype=dtype, device=device)
        else:
            layers = draft_layers or max(1, target.num_layers // 4)
            self.model = target.truncated(layers)
            cfg = model_config
        # a ranking (a trained student's) restricts drafts to its most frequent tokens (drafters.draft_vocab)
        self.vocab = DraftVocab(self.model.lm_head_weight, vocab_rank, draft_vocab, drafter=self.name,
                                full_logits=self.model.compute_logits)
        nodes = max(t.num_nodes for t in [self.template, *self.forests.values()])
        self.max_model_len = max_model_len
        self.kv = PagedDraftKV(self.model.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype, device,
                               max_model_len=max_model_len, max_num_seqs=max_num_seqs, extra_tokens=nodes,
                               block_size=block_size, num_blocks=num_blocks)
        self.blocks, self.cache = self.kv.blocks, self.kv.cache
        self.vocab_size = model_config.vocab_size
        self._vocab_index: torch.Tensor | None = None   # token id -> draft-vocabulary row (review)
        self.state: dict[int, _SeqState] = {}
        # standardized walltime: draft forward runs (one per sequence served) and their cost ratio
        self.num_runs = 0
        self.cost = param_count(self.model) / param_count(target) if target is not None else 1.0
        # dynamic MCSD: the early-stop decision model and β; depth statistics of the trees proposed
        self.decision, self.decision_threshold = None, DEFAULT_DECISION_THRESHOLD
        if decision is not None:
            self.decision = self._load_decision(decision, ctx)
            if decision_threshold is not None:
                self.decision_threshold = float(decision_threshold)
        self.num_trees, self.sum_depth = 0, 0
        # training the decision models (drafters/train/mcsd_decision.py): a DecisionLog, else None
        self.recorder = None

    def _load_decision(self, path: str, ctx: DrafterContext):
        """`decision=DIR` (a checkpoint folder), or `type1` / `type2`: the shipped one of that type
        for this target (and, type 1, this draft model) when no folder of that name exists."""
        fingerprint = target_fingerprint(ctx.model_config, ctx.target) if ctx.target is not None else None
        draft_fingerprint = self.draft_fingerprint()
        if str(path) in ("type1", "type2") and not Path(path).exists():
            found = shipped_decision(int(str(path)[-1]), fingerprint, draft_fingerprint) if fingerprint else None
            if found is None:
                raise ValueError(f"no {path} MCSD decision model ships for this target and draft model; train one "
                                 f"with `specserve train mcsd-decision --out DIR` and pass decision=DIR/{path}")
            path = str(found)
        return load_decision(path, target_fingerprint=fingerprint, draft_fingerprint=draft_fingerprint,
                             hidden_size=self.model.cfg.hidden_size, device=self.device)

    def draft_fingerprint(self) -> str:
        """The draft model's own fingerprint (type-1 decision models are tied to its hidden states)."""
        return target_fingerprint(self.model.cfg, self.model)

    @property
    def mean_stop_depth(self) -> float:
        """Mean depth (levels) of the trees proposed so far (0.0 before any)."""
        return self.sum_depth / self.num_trees if self.num_trees else 0.0

    def model_runs(self) -> dict[str, tuple[int, float]]:
        return {self.name: (self.num_runs, self.cost)}

    # ---- protocol ---------------------------------------------------------------------------

    def start(self, seq) -> None:
        self.state[seq.seq_id] = _SeqState()

    def finish(self, seq) -> None:
        self.state.pop(seq.seq_id, None)
        self.kv.free(seq.seq_id)

    @torch.inference_mode()
    def propose(self, seqs: Seq, budgets: Seq[int]) -> list[TokenTree | None]:
        live = [i for i, b in enumerate(budgets) if b > 0]
        trees: list[TokenTree | None] = [None] * len(seqs)
        if not live:
            return trees
        seqs = [seqs[i] for i in live]
        budgets = [budgets[i] for i in live]
        states = [self.state.setdefault(s.seq_id, _SeqState()) for s in seqs]
        # the template cut to each budget (level-major so a prefix is a valid tree); a forest over
        # the held-back token and its alternatives when the target initialised several roots
        templates = [self.forests.get(1 + len(s.extra_roots), self.template) if s.extra_roots else self.template
                     for s in seqs]
        parents = [list(t.parents[:b + 1]) for t, b in zip(templates, budgets)]
        depths = [tree_depths(p) for p in parents]
        roots = [num_roots(p) for p in parents]
        tokens = [[s.token_ids[-1], *s.extra_roots[:r - 1]] for s, r in zip(seqs, roots)]
        probs: list[list[torch.Tensor | None]] = [[None] * r for r in roots]
        # per node: whether it can be accepted at all (a pick beyond the support of q, or of the
        # processed logits, when k exceeds it, cannot: it and its subtree are cut at the end)
        drawable: list[list[bool]] = [[True] * r for r in roots]
        # top-k children, one-hot q (deterministic drafts) for greedy and seeded requests or when asked
        # for; otherwise children drawn from q without replacement (stochastic drafts). A seeded
        # request's verification accepts a draft x with probability p(x) whatever q: the most likely
        # tokens of q serve it best (measured against drafts coupled to its keyed draws: docs/sampling.md)
        top_k = [self.deterministic or s.params.greedy or s.sample_key is not None for s in seqs]

        # 1. catch up on committed tokens (the root last): logits at the root
        starts = [st.draft_len for st in states]
        chunks = [s.token_ids[st.draft_len:] for s, st in zip(seqs, states)]
        for b, (s, st) in enumerate(zip(seqs, states)):
            if not chunks[b]:             # nothing new since the last proposal: re-feed the root
                st.draft_len -= 1
                chunks[b] = s.token_ids[st.draft_len:]
                starts[b] = st.draft_len
            if not self.kv.grow(s.seq_id, st.draft_len + len(chunks[b]) + len(parents[b])):
                raise RuntimeError("draft KV pool exhausted")
        positions, meta = self.kv.metadata([s.seq_id for s in seqs], starts, [len(c) for c in chunks])
        ids = torch.tensor([t for c in chunks for t in c], dtype=torch.int64, device=self.device)
        hidden = self.model(ids, positions, self.cache, meta)
        self.num_runs += len(seqs)
        last_rows = torch.tensor(meta.cu_query_lens[1:], device=self.device) - 1
        for st, chunk in zip(states, chunks):
            st.draft_len += len(chunk)
            st.fed = [True]                       # the root is now in the draft cache
        root_hidden = hidden[last_rows]
        root_logits = self.vocab.expanded_logits(root_hidden)                     # [B, vocab]
        frontier = [list(range(r)) for r in roots]  # per sequence: nodes whose children come next
        # the other target-initialised roots: fed at the root's position, each seeing only the prefix
        forests = [b for b in range(len(seqs)) if roots[b] > 1]
        alt_logits, alt_hidden = self._feed(seqs, states, templates, depths, tokens,
                                            {b: list(range(1, roots[b])) for b in forests})
        rows, hrows, a = [], [], 0
        for b in range(len(seqs)):
            rows.append(root_logits[b:b + 1])
            hrows.append(root_hidden[b:b + 1])
            if roots[b] > 1:
                rows.append(alt_logits[a:a + roots[b] - 1])
                hrows.append(alt_hidden[a:a + roots[b] - 1])
                a += roots[b] - 1
        frontier_logits, frontier_hidden = torch.cat(rows), torch.cat(hrows)
        scoring = self.decision is not None or self.recorder is not None

        max_depth = max(max(d) for d in depths)
        for depth in range(1, max_depth + 1):
            # 2a. choose the children of every frontier node
            row = 0
            new_nodes: list[list[int]] = []
            scored: list[tuple[int, int, int]] = []   # (sequence, node, frontier row of its parent)
            parts: list[tuple[int, int, torch.Tensor]] = []   # (sequence, its first frontier row, its rows' logits)
            for b, seq in enumerate(seqs):
                level = [i for i in range(len(parents[b])) if depths[b][i] == depth] if frontier[b] else []
                new_nodes.append(level)
                n_front = len(frontier[b])
                logits_b = frontier_logits[row:row + n_front]
                row0, row = row, row + n_front
                if not level:
                    continue
                if seq.law is not None:   # drawn (or ranked) from the request's processed law at each node
                    logits_b = seq.processed(logits_b, [_path(tokens[b], parents[b], f) for f in frontier[b]])
                parts.append((b, row0, logits_b))
            if parts:
                picks, possible, q_rows = self._pick(seqs, parts, top_k, self.k_config[depth - 1])
                j = 0                     # each sequence's first row among the picks
                for b, row0, logits_b in parts:
                    for node in new_nodes[b]:
                        parent = parents[b][node]
                        f = frontier[b].index(parent)
                        rank = templates[b].ranks[node]
                        tokens[b].append(picks[j + f][rank])
                        probs[b].append(q_rows[j + f] if not top_k[b] else None)
                        drawable[b].append(drawable[b][parent] and possible[j + f][rank])
                        scored.append((b, node, row0 + f))
                    j += logits_b.shape[0]
            # 2b. dynamic MCSD: score the new level; a sequence whose new tokens all score below β stops
            stopped = self._score_level(seqs, depth, depths, scored, frontier_hidden, frontier_logits) \
                if scoring and scored else set()
            # 2c. feed the new level (unless it is the last) to get the next frontier's logits
            feed = {b: new_nodes[b] for b in range(len(seqs))
                    if new_nodes[b] and depth < max(depths[b]) and b not in stopped}
            if depth == max_depth or not feed:
                break
            frontier_logits, frontier_hidden = self._feed(seqs, states, templates, depths, tokens, feed)
            for b in range(len(seqs)):
                frontier[b] = new_nodes[b] if b in feed else []

        for s, st in zip(seqs, states):
            if s.is_extended:   # drafted after hypothetical tokens: keep only the committed prefix's KV
                st.draft_len, st.fed = min(st.draft_len, s.num_committed), []
                self.kv.shrink(s.seq_id, st.draft_len)
        for b, i in enumerate(live):
            if len(tokens[b]) > 1:
                dp = None
                if not top_k[b]:
                    rows = [p if p is not None else torch.zeros(self.vocab_size, device=self.device) for p in probs[b]]
                    dp = torch.stack(rows)
                next_roots = 1
                if self.target_init_width > 1 and not seq_params_exclude(seqs[b].params):
                    next_roots = self.target_init_width
                tree = TokenTree(tokens[b], parents[b][:len(tokens[b])], dp, next_roots)
                if not all(drawable[b]):   # verification would skip these (q(x) = 0) or never accept them
                    tree = tree.subtree([j for j, ok in enumerate(drawable[b]) if ok])
                    if tree.num_nodes == tree.num_roots:
                        continue
                trees[i] = tree
                self.num_trees += 1
                self.sum_depth += max(tree_depths(tree.parents))
        return trees

    def _score_level(self, seqs, depth: int, depths, scored, frontier_hidden, frontier_logits) -> set[int]:
        """The sequences (indices) that stop after this level: the decision model scores every new
        node from its parent's draft forward (final hidden state, logits), all sequences in one
        call; a sequence stops when each of its new nodes scores below β. A level that is some
        sequence's last is not scored for it (nothing to stop). Logs the features when recording."""
        parent_rows = torch.tensor([r for _, _, r in scored], device=frontier_hidden.device)
        hidden, logits = frontier_hidden[parent_rows], frontier_logits[parent_rows]
        if self.recorder is not None:
            self.recorder.record([seqs[b].seq_id for b, _, _ in scored], [n for _, n, _ in scored], depth,
                                 hidden, logits)
        if self.decision is None:
            return set()
        keep = [i for i, (b, _, _) in enumerate(scored) if depth < max(depths[b])]
        if not keep:
            return set()
        index = torch.tensor(keep, device=hidden.device)
        p = self.decision.accept_probability(self.decision.features(hidden[index], logits[index])).tolist()
        best: dict[int, float] = {}
        for i, pb in zip(keep, p):
            b = scored[i][0]
            best[b] = max(best.get(b, 0.0), pb)
        return {b for b, pb in best.items() if pb < self.decision_threshold}

    @torch.inference_mode()
    def review(self, seqs: Seq, proposals: Seq[Seq[int]], leniency: float = 1.0) -> list[tuple[int, int]]:
        """Review other drafters' chains in one forward (the vertical cascade of Cascade Speculative
        Drafting): `proposals[b]` continues `seqs[b].token_ids` (which may end in hypothetical
        tokens). Returns, per sequence, `(a, token)`: the first `a` proposed tokens are accepted and
        `token` is this model's own next token after them (the correction at the first rejection,
        or the bonus token after a chain accepted whole). An empty proposal gives `(0, argmax)`:
        one greedy token.

        The review is deterministic: with z the model's logits at a position, a proposed token x
        is accepted iff `z[x] >= max(z) - log(leniency)`, i.e. `leniency * q(x) >= max q` for the
        model's softmax q: `leniency = 1` accepts only the argmax, larger values also accept tokens
        within that factor of it. The token added is `argmax z`. With a draft vocabulary, z covers
        only its tokens: a proposed token outside it is rejected.

        One forward per call over `token_ids[draft_len:] + proposal` (the committed tokens new to
        the cache, any hypothetical ones, the proposal) as a causal chunk; afterwards the cache is
        cut back to the committed prefix, so hypothetical and proposed rows never outlive the call.
        No tree of this drafter's is left in the cache (`accept` then keeps nothing)."""
        out: list[tuple[int, int]] = []
        if not seqs:
            return out
        log_l = math.log(float(leniency))
        states = [self.state.setdefault(s.seq_id, _SeqState()) for s in seqs]
        starts, chunks = [], []
        for s, st, prop in zip(seqs, states, proposals):
            if st.draft_len >= len(s.token_ids):   # the root's row is needed: re-feed it
                st.draft_len = len(s.token_ids) - 1
            chunk = [*s.token_ids[st.draft_len:], *(int(t) for t in prop)]
            if not self.kv.grow(s.seq_id, st.draft_len + len(chunk)):
                raise RuntimeError("draft KV pool exhausted")
            starts.append(st.draft_len)
            chunks.append(chunk)
        positions, meta = self.kv.metadata([s.seq_id for s in seqs], starts, [len(c) for c in chunks])
        ids = torch.tensor([t for c in chunks for t in c], dtype=torch.int64, device=self.device)
        hidden = self.model(ids, positions, self.cache, meta)
        self.num_runs += len(seqs)
        # rows predicting proposal[0], ..., proposal[m-1] and the token after them: the last m + 1
        ends = meta.cu_query_lens[1:]
        rows = torch.tensor([e - len(p) - 1 + j for e, p in zip(ends, proposals) for j in range(len(p) + 1)],
                            device=self.device)
        logits = self.vocab.logits(hidden[rows])                    # [sum(m + 1), draft vocabulary]
        best, arg = logits.max(dim=-1)
        proposed = torch.tensor([int(t) for p in proposals for t in (*p, 0)], device=self.device)
        index = self._draft_index(proposed)                          # -1: outside the draft vocabulary
        ok = (logits.gather(1, index.clamp_min(0)[:, None])[:, 0] >= best - log_l) & (index >= 0)
        # one transfer; the last row of each: its ok unused
        ok, arg = torch.stack([ok.to(torch.int64), self.vocab.token_ids(arg).to(torch.int64)]).tolist()
        r = 0
        for s, st, prop in zip(seqs, states, proposals):
            m = len(prop)
            a = next((j for j in range(m) if not ok[r + j]), m)
            out.append((a, int(arg[r + a])))
            r += m + 1
            st.draft_len, st.fed = min(len(s.token_ids), s.num_committed), []
            self.kv.shrink(s.seq_id, st.draft_len)
        return out

    def _draft_index(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary rows of `token_ids` (-1 for a token outside it)."""
        if self.vocab.ids is None:
            return token_ids
        if self._vocab_index is None:
            inv = torch.full((self.vocab_size,), -1, dtype=torch.int64, device=self.vocab.ids.device)
            self._vocab_index = inv.index_copy_(0, self.vocab.ids, torch.arange(len(self.vocab.ids), device=inv.device))
        return self._vocab_index[token_ids.to(self._vocab_index.device)].to(token_ids.device)

    def _pick(self, seqs, parts, top_k: list[bool], k: int):
        """The k children of every frontier row of `parts` ((sequence, first row, logits [n, V])), all
        sequences at once with one host transfer: the top-k of the (processed) logits for a sequence
        drafting deterministically (`top_k`), else k draws without replacement from its q (the
        processed law). Returns (picks [rows][k] token ids, possible [rows][k]: the pick has
        support, q [rows, V] (rows of deterministic sequences: unused))."""
        logits = torch.cat([lb.float() for _, _, lb in parts])                      # [R, V]
        owner = [b for b, _, lb in parts for _ in range(lb.shape[0])]
        scores, q = logits, None
        sampled = [r for r, b in enumerate(owner) if not top_k[b]]
        if sampled:
            idx = torch.tensor(sampled, dtype=torch.int64, device=logits.device)
            q = torch.zeros_like(logits)
            q_s = processed_probs(logits.index_select(0, idx),
                                  SamplingTensors.from_params([seqs[owner[r]].params for r in sampled], self.device))
            q.index_copy_(0, idx, q_s)
            gumbel = torch.empty_like(q_s).exponential_().clamp_min_(1e-20)
            scores = logits.index_copy(0, idx, q_s / gumbel)      # k draws without replacement from q
        picks = scores.topk(k, dim=-1).indices
        if q is None:
            possible = logits.gather(1, picks) > float("-inf")
        else:
            is_sampled = torch.zeros(len(owner), 1, dtype=torch.bool, device=logits.device)
            is_sampled[idx] = True
            possible = torch.where(is_sampled, q.gather(1, picks) > 0, logits.gather(1, picks) > float("-inf"))
        both = torch.cat([picks, possible.to(picks.dtype)], dim=1).tolist()        # the one transfer
        return [r[:k] for r in both], [[bool(x) for x in r[k:]] for r in both], q

    def _feed(self, seqs, states, templates, depths, tokens,
              feed: dict[int, list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft forward over new tree nodes (`feed[b]`: consecutive node indices of sequence
        b), each attending to the prefix plus its own ancestors in the tree; node i sits at cache
        position draft_len - 1 + i and RoPE position draft_len - 1 + depth (`depths[b]`, of the
        tree `propose` cut from the template). The tree part of the mask is the top-left slice of
        the template's full-depth mask (rows `feed[b]`, columns up to the last of them: the nodes in
        the cache after the prefix). (logits, final hidden states), rows in order."""
        if not feed:
            return (torch.empty(0, self.vocab_size, device=self.device),
                    torch.empty(0, self.model.cfg.hidden_size, device=self.device))
        starts, qlens, masks, pos, ids = [], [], [], [], []
        for b, nodes in feed.items():
            st, template, depth = states[b], templates[b], depths[b]
            starts.append(st.draft_len - 1 + nodes[0])
            qlens.append(len(nodes))
            masks.append(self.sliced_mask(template, nodes[0], nodes[-1] + 1))
            pos.extend(st.draft_len - 1 + depth[n] for n in nodes)
            ids.extend(tokens[b][n] for n in nodes)
            st.fed.extend([False] * (nodes[0] - len(st.fed)))
            st.fed.extend([True] * len(nodes))
        _, meta = self.kv.metadata([seqs[b].seq_id for b in feed], starts, qlens, masks)
        hidden = self.model(torch.tensor(ids, dtype=torch.int64, device=self.device),
                            torch.tensor(pos, dtype=torch.int64, device=self.device), self.cache, meta)
        self.num_runs += len(feed)
        return self.vocab.expanded_logits(hidden), hidden

    def sliced_mask(self, template: TreeTemplate, first: int, end: int) -> torch.Tensor:
        """Rows `first..end-1`, columns `0..end-1` of `template`'s full-depth ancestor mask: the
        visibility of nodes first..end-1 over the tree nodes fed so far (MCSD+'s sliced mask; with
        first = 0 the top-left square, the mask of the tree cut to its first `end` nodes)."""
        return self.masks[template][first:end, :end]

    def accept(self, seqs: Seq, results: Seq) -> None:
        """Keep the draft KV of the chosen root and of the accepted nodes that were fed (a prefix
        of the path); node i sits at draft_len - 1 + i."""
        if self.recorder is not None:     # logging verification outcomes for the decision models
            self.recorder.label(seqs, results)
        ids, prefixes, paths = [], [], []
        for seq, res in zip(seqs, results):
            st = self.state.get(seq.seq_id)
            if st is None or not st.fed:   # no tree of this drafter in its cache (an extended-prefix draft)
                continue
            path = [res.root]
            for node in res.accepted_nodes:
                if node < len(st.fed) and st.fed[node]:
                    path.append(node)
                else:
                    break
            ids.append(seq.seq_id)
            prefixes.append(st.draft_len - 1)
            paths.append(path)
        new_lens = self.kv.commit(ids, prefixes, paths)
        for sid, n in zip(ids, new_lens):
            self.state[sid].draft_len = n


def _path(tokens: list[int], parents: list[int], node: int) -> list[int]:
    """The tokens on `node`'s path after its root (the root, a committed token, excluded)."""
    path = []
    while parents[node] != NO_PARENT:
        path.append(tokens[node])
        node = parents[node]
    return path[::-1]
