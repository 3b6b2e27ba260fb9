"""The target as a teacher: hidden states and next-token top-k over whole sequences equal
transformers' in fp32, whether sequences share a forward or are chunked across several."""

from __future__ import annotations

import pytest
import torch

from specserve.drafters.train.target import FeatureExtractor, target_features, target_topk
from specserve.engine.config import ModelConfig
from specserve.engine.model import LlamaModel

ATOL = 2e-5


def tiny_hf(seed: int = 0):
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   rope_theta=10000.0, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():   # norms at 1.0 would hide a mapping mistake
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
    return model.eval()


def ours(hf) -> LlamaModel:
    return LlamaModel.from_state_dict(ModelConfig.from_hf(hf.config), hf.state_dict(), max_positions=256,
                                      dtype=torch.float32, device=torch.device("cpu"))


@pytest.fixture(scope="module")
def pair():
    hf = tiny_hf()
    return hf, ours(hf)


SEQS = [torch.randint(0, 300, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (37, 5, 1, 60, 23)]


@pytest.mark.parametrize("batch_tokens, max_seqs", [(4096, 64), (16, 64), (50, 2)])
def test_hidden_states_and_logits_match_transformers(pair, batch_tokens, max_seqs):
    """One forward for all; 16-token forwards (every long sequence chunked, several sequences per
    forward); 2 sequences per forward at most."""
    hf, model = pair
    feats = target_features(model, SEQS, batch_tokens=batch_tokens, max_seqs=max_seqs)
    assert [f.shape for f in feats] == [(len(s), 64) for s in SEQS]
    with torch.no_grad():
        for seq, f in zip(SEQS, feats):
            out = hf.model(torch.tensor([seq]))
            torch.testing.assert_close(f, out.last_hidden_state[0], atol=ATOL, rtol=1e-4)
            torch.testing.assert_close(model.compute_logits(f), hf(torch.tensor([seq])).logits[0].float(),
                                       atol=ATOL, rtol=1e-4)


def test_topk_is_the_targets_next_token_distribution(pair):
    hf, model = pair
    seq = SEQS[0]
    hidden = target_features(model, [seq])[0]
    ids, logprobs = target_topk(model, hidden, 5, chunk_rows=7)
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([seq])).logits[0].float(), dim=-1)
    assert ids.dtype == torch.int32 and ids.shape == (len(seq), 5) and logprobs.dtype == torch.float32
    assert torch.equal(ids[:, 0].long(), ref.argmax(-1))
    torch.testing.assert_close(logprobs, ref.gather(1, ids.long()), atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(logprobs, ref.topk(5, dim=-1).values, atol=ATOL, rtol=1e-4)
    assert bool((logprobs[:, :-1] >= logprobs[:, 1:]).all())
    ids0, lp0 = target_topk(model, hidden, 0)
    assert ids0.shape == (len(seq), 0) and lp0.shape == (len(seq), 0)


def test_extractor_reuses_its_cache_and_checks_lengths(pair):
    _, model = pair
    extractor = FeatureExtractor(model, batch_tokens=32)
    first = extractor(SEQS[:2])
    cache = extractor._cache
    again = extractor(SEQS[:2])
    assert extractor._cache is cache
    for a, b in zip(first, again):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="more than the model's 256 positions"):
        extractor([[1] * 257])
    with pytest.raises(ValueError, match="empty"):
        extractor([[1, 2], []])
    assert extractor([]) == []
