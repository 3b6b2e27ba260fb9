"""Tree verification, greedy and lossless multi-candidate speculative sampling.

Tensors in, tensors out: no model calls, no KV work. Vocabulary (vLLM's): a draft token that
survives verification is **accepted**; the token the target adds where the walk stops is the
**bonus** token (after a rejection it is also called the recovered token). A step commits
`accepted + [bonus]`, between 1 and depth + 1 tokens.

Sampling walk (DESIGN §4), starting at the root with p = target distribution at the root:
at the current node try its children in order; child x with draft distribution q (one-hot for a
deterministic draft) is accepted with probability min(1, p(x) / q(x)). On rejection
p <- norm(max(0, p - q)) and x is removed from q for the following siblings (children drawn from
the same q without replacement). If a child is accepted, move into it with p = the target
distribution there. When no child is accepted, or at a leaf, the bonus token is drawn from the
current p. The committed tokens are then distributed exactly as sampling the target directly.

Target-initialised roots (MCSD, LOSSY opt-in): a forest's roots are the committed token's
alternatives, all sampled from the target at the previous step. Each root's subtree is walked as
above; the root whose walk accepts the most drafts wins (ties: the first-drawn root, so that with
one root, or when nothing is accepted anywhere, the result is the lossless one). Choosing the
longest walk biases the output towards easily drafted continuations — hence opt-in. With
`num_candidates = W > 1` the walk ends by drawing W distinct tokens from the final p (Gumbel
top-W, without replacement): the first is the bonus, exactly as lossless as the single draw; the
others are the next forest's extra roots.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specserve.engine.tree import NO_PARENT, num_roots


@dataclass
class VerifyResult:
    accepted_nodes: list[int]   # accepted draft nodes, root excluded, in path order
    accepted_tokens: list[int]  # their tokens
    bonus_token: int
    root: int = 0               # the root the path starts from (> 0 only for a forest)
    alternates: list[int] = field(default_factory=list)  # extra target samples for the bonus position

    @property
    def tokens(self) -> list[int]:
        """What the step commits."""
        return self.accepted_tokens + [self.bonus_token]


def _children(parents: list[int]) -> list[list[int]]:
    children: list[list[int]] = [[] for _ in parents]
    for i, p in enumerate(parents):
        if p != NO_PARENT:
            children[p].append(i)
    return children


def verify_greedy(
    tokens: list[int],          # [n] node tokens, tokens[0] = root
    parents: list[int],         # [n]
    target_argmax: list[int],   # [n] argmax of the target's logits at every node
) -> VerifyResult:
    """Longest path of argmax matches; the bonus is the argmax at the last accepted node. Among
    siblings carrying the same token the first one is taken (and for a forest, the first root
    among equally long walks)."""
    children = _children(parents)
    best = None
    for root in range(num_roots(parents)):
        cur, nodes = root, []
        while True:
            want = target_argmax[cur]
            nxt = next((c for c in children[cur] if tokens[c] == want), None)
            if nxt is None:
                break
            nodes.append(nxt)
            cur = nxt
        if best is None or len(nodes) > len(best.accepted_nodes):
            best = VerifyResult(nodes, [tokens[c] for c in nodes], want, root)
    return best


def _sample(p: torch.Tensor, generator: torch.Generator | None, k: int = 1) -> list[int]:
    """k distinct draws from p without replacement (Gumbel top-k with exponential noise; the
    first is an exact draw from p). Fewer when p has fewer than k tokens with mass."""
    noise = torch.empty_like(p).exponential_(generator=generator)
    keys = p / noise.clamp_min(1e-20)
    k = max(1, min(k, int((p > 0).sum())))
    return keys.topk(k).indices.tolist() if k > 1 else [int(torch.argmax(keys))]


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The target distribution left after a draft drawn from q was rejected: norm(max(0, p - q)).
    When p <= q everywhere (no mass left) p is kept; the walk then can only stop and sample."""
    r = (p - q).clamp_min_(0.0)
    mass = r.sum()
    return r / mass if mass > 0 else p


def verify_sampling(
    tokens: list[int],                     # [n]
    parents: list[int],                    # [n]
    target_probs: torch.Tensor,            # [n, vocab] float32, after the request's logits processing
    draft_probs: torch.Tensor | None,      # [n, vocab] distribution each node was drawn from, or None (one-hot)
    generator: torch.Generator | None = None,
    num_candidates: int = 1,
) -> VerifyResult:
    """Multi-candidate speculative sampling over a tree or forest (see the module docstring)."""
    children = _children(parents)
    best = None
    for root in range(num_roots(parents)):
        nodes, p = _walk(root, tokens, children, target_probs, draft_probs, generator)
        if best is None or len(nodes) > len(best[0]):
            best = (nodes, p, root)
    nodes, p, root = best
    drawn = _sample(p, generator, num_candidates)
    return VerifyResult(nodes, [tokens[c] for c in nodes], drawn[0], root, drawn[1:])


def _walk(root, tokens, children, target_probs, draft_probs, generator) -> tuple[list[int], torch.Tensor]:
    """One root's walk: the accepted nodes and the distribution the bonus is drawn from."""
    cur, nodes = root, []
    p = target_probs[root].clone()
    while True:
        accepted = None
        removed: list[int] = []
        for c in children[cur]:
            x = tokens[c]
            if draft_probs is None:
                q = torch.zeros_like(p)
                q[x] = 1.0
            else:
                q = draft_probs[c].clone()
                if removed:
                    q[removed] = 0.0
                total = q.sum()
                if total <= 0:
                    continue   # q has no mass left: this child cannot have been drawn from it
                q /= total
            qx, px = float(q[x]), float(p[x])
            u = float(torch.rand((), generator=generator, device=p.device))
            if qx > 0 and u * qx < px:        # accept with probability min(1, p(x)/q(x))
                accepted = c
                break
            p = residual(p, q)
            removed.append(x)
        if accepted is None:
            return nodes, p
        nodes.append(accepted)
        cur = accepted
        p = target_probs[cur].clone()
