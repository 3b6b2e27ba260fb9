"""The frequency-ranked draft vocabulary shared by eagle, medusa and parallelspec."""

import pytest
import torch

from specserve.drafters.draft_vocab import DEFAULT_SIZE, DraftVocab, check_rank

V, H = 300, 16


@pytest.fixture
def head():
    return torch.randn(V, H, generator=torch.Generator().manual_seed(0))


@pytest.fixture
def rank():
    return torch.randperm(V, generator=torch.Generator().manual_seed(1))


def test_logits_and_ids_are_those_of_the_first_n_ranked_tokens(head, rank):
    vocab = DraftVocab(head, rank, 40)
    assert vocab.size == 40 and torch.equal(vocab.ids, rank[:40])
    h = torch.randn(2, 3, H)
    logits = vocab.logits(h)
    assert logits.shape == (2, 3, 40) and logits.dtype == torch.float32
    full = h @ head.T
    torch.testing.assert_close(logits, full[..., rank[:40]])
    top = logits.topk(5, dim=-1).indices
    want = full[..., rank[:40]].topk(5, dim=-1).indices
    assert torch.equal(vocab.token_ids(top), rank[:40][want])


def test_whole_vocabulary_without_a_ranking_or_with_size_zero(head, rank):
    calls = []

    def full(h):
        calls.append(h.shape)
        return h @ head.T

    for vocab in (DraftVocab(head, None, None, full_logits=full), DraftVocab(head, rank, 0, full_logits=full),
                  DraftVocab(head, rank, V, full_logits=full)):
        h = torch.randn(4, H)
        assert vocab.size is None and vocab.weight is None
        torch.testing.assert_close(vocab.logits(h), h @ head.T)
        idx = torch.tensor([[3, 7]])
        assert vocab.token_ids(idx) is idx
    assert len(calls) == 3                                   # the target's own logits function is used


def test_default_size_applies_when_a_ranking_exists():
    big = torch.randn(DEFAULT_SIZE + 10, 4)
    vocab = DraftVocab(big, torch.arange(DEFAULT_SIZE + 10).flip(0))
    assert vocab.size == DEFAULT_SIZE and int(vocab.ids[0]) == DEFAULT_SIZE + 9


def test_bad_settings_are_refused(head, rank):
    with pytest.raises(ValueError, match="vocab_rank"):        # an explicit size needs a ranking
        DraftVocab(head, None, 40, drafter="medusa")
    with pytest.raises(ValueError, match=">= 0"):
        DraftVocab(head, rank, -1)
    with pytest.raises(ValueError, match="permutation"):
        DraftVocab(head, torch.zeros(V, dtype=torch.int64), 40)
    with pytest.raises(ValueError, match="permutation"):
        check_rank(rank[:-1], V)
    assert check_rank(rank.to(torch.int32), V).dtype == torch.int64
