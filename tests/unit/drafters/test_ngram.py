"""The n-gram drafter's context (`NgramDrafter.context_of`): the length of the suffix its draft copies
from, 0 exactly when it drafts nothing."""

from __future__ import annotations

import random
from types import SimpleNamespace

from specserve.drafters.base import make_drafter


def view(token_ids: list[int]):
    return SimpleNamespace(seq_id=0, token_ids=token_ids, options={})


def longest_recurring_suffix(tokens: list[int], max_ngram: int, min_ngram: int) -> int:
    """By definition: the longest n in [min_ngram, max_ngram] whose suffix n-gram also occurs
    earlier with at least one token after it (0: none)."""
    for n in range(min(max_ngram, len(tokens) - 1), min_ngram - 1, -1):
        suffix = tokens[len(tokens) - n:]
        if any(tokens[s:s + n] == suffix for s in range(len(tokens) - n)):
            return n
    return 0


def test_context_is_the_matched_suffix_length():
    d = make_drafter("ngram")
    assert d.context_of(view([1, 2, 3, 4, 1, 2])) == 2
    assert d.context_of(view([5, 6, 7])) == 0
    assert d.context_of(view([1, 2, 3, 4, 9, 1, 2, 3, 4])) == 4           # max_ngram caps it
    assert make_drafter("ngram", min_ngram=3).context_of(view([1, 2, 3, 4, 1, 2])) == 0


def test_context_agrees_with_the_definition_and_with_propose():
    rng = random.Random(3)
    for max_ngram, min_ngram in ((4, 1), (3, 2)):
        d = make_drafter("ngram", max_ngram=max_ngram, min_ngram=min_ngram)
        for _ in range(300):
            tokens = [rng.randrange(6) for _ in range(rng.randrange(1, 40))]
            context = d.context_of(view(tokens))
            assert context == longest_recurring_suffix(tokens, max_ngram, min_ngram)
            (tree,) = d.propose([view(tokens)], [8])
            assert (tree is None) == (context == 0)
