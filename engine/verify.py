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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.engine.tree import NO_PARENT


@dataclass
class VerifyResult:
    accepted_nodes: list[int]   # accepted draft nodes, root excluded, in path order
    accepted_tokens: list[int]  # their tokens
    bonus_token: int

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
    siblings carrying the same token the first one is taken."""
    children = _children(parents)
    cur, nodes = 0, []
    while True:
        want = target_argmax[cur]
        nxt = next((c for c in children[cur] if tokens[c] == want), None)
        if nxt is None:
            return VerifyResult(nodes, [tokens[c] for c in nodes], want)
        nodes.append(nxt)
        cur = nxt


def _sample(p: torch.Tensor, generator: torch.Generator | None) -> int:
    noise = torch.empty_like(p).exponential_(generator=generator)
    return int(torch.argmax(p / noise.clamp_min(1e-20)))


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
) -> VerifyResult:
    """Multi-candidate speculative sampling over a tree (see the module docstring)."""
    children = _children(parents)
    cur, nodes = 0, []
    p = target_probs[0].clone()
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
            return VerifyResult(nodes, [tokens[c] for c in nodes], _sample(p, generator))
        nodes.append(accepted)
        cur = accepted
        p = target_probs[cur].clone()
