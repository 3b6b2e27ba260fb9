"""A frequency-ranked draft vocabulary for the drafters that read the target's LM head.

eagle, medusa and parallelspec turn each of their hidden rows into draft tokens through the
target's LM head: for SmolLM2 that is 49152 x 576 (113 MB in fp32) read per tree level or per
head, as much as a third of the target's own forward. Following FR-Spec (Zhao et al., 2025),
such a drafter can instead choose its tokens among the N tokens the target emitted most often in
its training data (the checkpoint's `vocab_rank`, most frequent first), through those N rows of
the head only: a derived copy of N x H (19 MB for N = 8192 on SmolLM2), which covers about 90 %
of the target's next tokens there.

Lossless either way: the draft tokens are proposals; verification reads the target's full
distribution. A token outside the N can never be drafted, which costs acceptance only where the
target would have chosen it.

`draft_vocab` option of those drafters: None = DEFAULT_SIZE when the checkpoint has a ranking
(the whole vocabulary when it has none), 0 = the whole vocabulary, N = the N most frequent.
"""

from __future__ import annotations

from typing import Callable

import torch

from specserve.engine.model import linear, pack_linear_weight
from specserve.engine.quant import quantize_weight, quantized

DEFAULT_SIZE = 8192


def check_rank(rank: torch.Tensor | None, vocab_size: int) -> torch.Tensor | None:
    """`rank` as int64 after checking that it is a permutation of the vocabulary (None passes)."""
    if rank is None:
        return None
    rank = rank.reshape(-1).to(torch.int64)
    if rank.numel() != vocab_size or not torch.equal(torch.sort(rank.cpu()).values, torch.arange(vocab_size)):
        raise ValueError(f"vocab_rank must be a permutation of the {vocab_size}-token vocabulary")
    return rank


class DraftVocab:
    """The tokens a drafter may draft, and its logits over them.

    `lm_head_weight` [V, H] is the target's (read by reference when the whole vocabulary is used);
    `rank` the checkpoint's vocabulary ranking or None; `size` the `draft_vocab` option;
    `full_logits` computes whole-vocabulary logits (default: hidden @ lm_head_weight.T)."""

    def __init__(self, lm_head_weight: torch.Tensor, rank: torch.Tensor | None = None, size: int | None = None, *,
                 drafter: str = "drafter", full_logits: Callable[[torch.Tensor], torch.Tensor] | None = None):
        vocab = self.vocab_size = lm_head_weight.shape[0]
        explicit = size is not None
        size = DEFAULT_SIZE if size is None else int(size)
        if size < 0:
            raise ValueError(f"{drafter}: draft_vocab must be >= 0 (0 = the whole vocabulary), got {size}")
        self._full = full_logits or (lambda h: linear(h, lm_head_weight))
        self.ids: torch.Tensor | None = None       # [N] token id of each draft-vocabulary row
        self.weight: torch.Tensor | None = None    # [N, H] those rows of the LM head
        if 0 < size < vocab:
            if rank is None:
                if explicit:
                    raise ValueError(f"{drafter}: draft_vocab needs a checkpoint with a vocabulary ranking "
                                     "(vocab_rank); pass draft_vocab=0 for the whole vocabulary")
                return
            rank = check_rank(rank, vocab).to(lm_head_weight.device)
            self.ids = rank[:size].contiguous()
            self.weight = lm_head_weight.detach().index_select(0, self.ids).contiguous()

    def pack_weights(self) -> int:
        """Prepack the derived N x H head for oneDNN's CPU linear, for inputs of 2 rows or more
        (`engine.model.pack_linear_weight`; the whole-vocabulary case reads the target's head,
        which the target packs). Returns the weights packed."""
        return 0 if self.weight is None else int(pack_linear_weight(self.weight, min_rows=2))

    def quantize_weights(self, kind: str = "int8") -> int:
        """Quantize the derived N x H head (int8 by default, as the target's LM head: `engine/quant.py`;
        the whole-vocabulary case reads the target's head, quantized with the target). Returns the
        weights quantized."""
        if self.weight is None or quantized(self.weight) is not None:
            return 0
        return int(quantize_weight(self.weight, kind))

    @property
    def size(self) -> int | None:
        """Tokens drafted from, or None for the whole vocabulary."""
        return None if self.ids is None else self.ids.numel()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [..., N] over the draft vocabulary (the whole one: [..., V])."""
        flat = hidden.reshape(-1, hidden.shape[-1])
        out = self._full(flat) if self.weight is None else linear(flat.to(self.weight.dtype), self.weight)
        return out.float().view(*hidden.shape[:-1], -1)

    def expanded_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [..., V] over the whole vocabulary with -inf outside the draft vocabulary: for
        a drafter that samples its drafts (its q then is zero there, which speculative sampling
        allows: verification only needs the q the drafts were drawn from)."""
        logits = self.logits(hidden)
        if self.ids is None:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.vocab_size), float("-inf"))
        return full.index_copy_(-1, self.ids, logits)

    def token_ids(self, index: torch.Tensor) -> torch.Tensor:
        """Token ids of draft-vocabulary indices (e.g. a topk's indices)."""
        return index if self.ids is None else self.ids[index]


__all__ = ["DEFAULT_SIZE", "DraftVocab", "check_rank"]
