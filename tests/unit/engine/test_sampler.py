"""Sampler: greedy = argmax, top-k/top-p masks on hand-worked rows, row independence in mixed
batches, seeded reproducibility across batch compositions, keyed draws (a pure function of key and
position, Exp(1), independent across positions, with a control sharing draws between positions
that the law test catches), logprobs, and a statistical test that the exponential race draws from
`processed_probs`."""

from __future__ import annotations

import math

import pytest
import torch

from specserve.engine.sampler import (SamplingTensors, apply_top_k_top_p, keyed_exponentials, processed_probs, sample,
                                     sample_key)
from specserve.engine.sampling_params import SamplingParams

CPU = torch.device("cpu")


def st_of(*params: SamplingParams) -> SamplingTensors:
    return SamplingTensors.from_params(list(params), CPU)


def reference_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """One row, written the slow obvious way: [V] logits -> [V] probabilities."""
    logits = logits.double()
    if p.greedy:
        out = torch.zeros_like(logits)
        out[logits.argmax()] = 1.0
        return out
    logits = logits / p.temperature
    keep = torch.ones_like(logits, dtype=torch.bool)
    if p.top_k > 0:
        kth = sorted(logits.tolist(), reverse=True)[min(p.top_k, len(logits)) - 1]
        keep &= logits >= kth
    if p.top_p < 1:
        probs = torch.where(keep, logits, torch.tensor(-math.inf, dtype=logits.dtype)).softmax(-1)
        order = sorted(range(len(logits)), key=lambda v: -probs[v].item())
        mass, kept = 0.0, set()
        for v in order:
            kept.add(v)
            mass += probs[v].item()
            if mass >= p.top_p:
                break
        keep &= torch.tensor([v in kept for v in range(len(logits))])
    return torch.where(keep, logits, torch.tensor(-math.inf, dtype=logits.dtype)).softmax(-1)


# ---- greedy ----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_is_argmax_of_raw_logits(dtype):
    torch.manual_seed(0)
    logits = torch.randn(6, 300).to(dtype)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_k=1)] * 3
    st = st_of(*params)
    assert st.all_greedy
    out = sample(logits, st, [None] * 6)
    assert out.token_ids.dtype == torch.int64
    assert torch.equal(out.token_ids, logits.float().argmax(-1))
    assert out.logprobs is None and out.top_ids is None
    probs = processed_probs(logits, st)
    assert probs.dtype == torch.float32
    assert torch.equal(probs, torch.nn.functional.one_hot(logits.float().argmax(-1), 300).float())


def test_greedy_rows_in_random_batch_are_argmax():
    torch.manual_seed(1)
    logits = torch.randn(64, 50)
    params = [SamplingParams(temperature=0.0) if i % 2 else SamplingParams(temperature=1.5) for i in range(64)]
    out = sample(logits, st_of(*params), [None] * 64)
    assert torch.equal(out.token_ids[1::2], logits[1::2].argmax(-1))
    assert not torch.equal(out.token_ids[0::2], logits[0::2].argmax(-1))  # 32 hot rows at T=1.5


# ---- masks on hand-worked rows ---------------------------------------------------------------

def masked(logits: list[float], **kw) -> list[bool]:
    """Which tokens survive top-k/top-p (temperature 1)."""
    out = apply_top_k_top_p(torch.tensor([logits]), st_of(SamplingParams(**kw)))
    return torch.isfinite(out[0]).tolist()


def test_top_k_mask():
    row = [0.5, 3.0, -1.0, 2.0, 1.0]
    assert masked(row, top_k=1, temperature=1.0) == [True] * 5  # top_k 1 is greedy: no mask applied
    assert masked(row, top_k=2) == [False, True, False, True, False]
    assert masked(row, top_k=3) == [False, True, False, True, True]
    assert masked(row, top_k=5) == [True] * 5
    assert masked(row, top_k=50) == [True] * 5                    # k > V keeps everything
    assert masked(row, top_k=0) == [True] * 5
    assert masked([1.0, 2.0, 2.0, 0.0], top_k=2) == [False, True, True, False]
    assert masked([2.0, 1.0, 1.0, 0.0], top_k=2) == [True, True, True, False]  # ties at the k-th value kept


def test_top_p_mask():
    probs = [0.05, 0.5, 0.15, 0.3]
    row = [math.log(p) for p in probs]
    assert masked(row, top_p=0.4) == [False, True, False, False]   # 0.5 >= 0.4 alone
    assert masked(row, top_p=0.75) == [False, True, False, True]   # 0.5 + 0.3
    assert masked(row, top_p=0.9) == [False, True, True, True]     # 0.5 + 0.3 + 0.15
    assert masked(row, top_p=0.99) == [True] * 4
    assert masked(row, top_p=1.0) == [True] * 4
    assert masked(row, top_p=1e-6) == [False, True, False, False]  # always at least one token


def test_top_k_then_top_p_on_renormalised_mass():
    # top_k=2 leaves {0.5, 0.3} -> renormalised {0.625, 0.375}; top_p=0.6 then keeps 0.625 only,
    # while top_p=0.7 needs both (on the unfiltered row 0.5 + 0.3 would be needed for 0.7 as well).
    row = [math.log(p) for p in [0.05, 0.5, 0.15, 0.3]]
    assert masked(row, top_k=2, top_p=0.6) == [False, True, False, False]
    assert masked(row, top_k=2, top_p=0.7) == [False, True, False, True]
    assert masked(row, top_k=3, top_p=0.9) == [False, True, True, True]


def test_temperature_applies_before_top_p():
    # At T=1 the top token has 0.5 of the mass; at T=0.5 it has 0.25/0.38 ~ 0.66, enough for p=0.6.
    row = torch.tensor([[math.log(p) for p in [0.5, 0.3, 0.2]]])
    hot = processed_probs(row, st_of(SamplingParams(temperature=1.0, top_p=0.6)))
    cold = processed_probs(row, st_of(SamplingParams(temperature=0.5, top_p=0.6)))
    assert (hot[0] > 0).tolist() == [True, True, False]
    assert (cold[0] > 0).tolist() == [True, False, False]
    torch.testing.assert_close(hot[0], torch.tensor([0.625, 0.375, 0.0]))


# ---- row independence ------------------------------------------------------------------------

MIXED = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.0, top_k=5),
    SamplingParams(temperature=1.0, top_p=0.8),
    SamplingParams(temperature=0.7, top_k=5, top_p=0.8),
    SamplingParams(temperature=1.3, top_k=40, top_p=0.95),
    SamplingParams(temperature=0.9, top_k=1),
]


def test_mixed_batch_rows_are_independent_and_match_reference():
    torch.manual_seed(2)
    logits = torch.randn(len(MIXED), 64) * 2
    batched = processed_probs(logits, st_of(*MIXED))
    for i, p in enumerate(MIXED):
        alone = processed_probs(logits[i:i + 1], st_of(p))[0]
        assert torch.equal(batched[i], alone), p
        torch.testing.assert_close(batched[i].double(), reference_probs(logits[i], p), atol=1e-6, rtol=1e-5)
    assert torch.allclose(batched.sum(-1), torch.ones(len(MIXED)))


def test_top_k_only_path_matches_sorted_path():
    # Without any top-p row the sampler takes a partial topk instead of a full sort.
    torch.manual_seed(3)
    logits = torch.randn(3, 100)
    ks = [SamplingParams(top_k=3), SamplingParams(top_k=17), SamplingParams()]
    fast = apply_top_k_top_p(logits, st_of(*ks))
    slow = apply_top_k_top_p(torch.cat([logits, logits[:1]]), st_of(*ks, SamplingParams(top_p=0.5)))[:3]
    assert torch.equal(fast, slow)
    assert [int(torch.isfinite(r).sum()) for r in fast] == [3, 17, 100]


# ---- seeded reproducibility ------------------------------------------------------------------

def seeded_run(seed: int, others: list[tuple[SamplingParams, int | None]], steps: int = 20) -> list[int]:
    """Tokens of a seeded request over several steps (output positions 0, 1, ...), sharing each
    step's batch with `others` (params, seed or None), at a different row each step. The logits of
    each step are fixed per step."""
    mine = SamplingParams(temperature=1.0, top_p=0.95, seed=seed)
    rows = [(mine, seed)] + others
    tokens = []
    for step in range(steps):
        step_logits = torch.randn(1000, generator=torch.Generator().manual_seed(100 + step))
        pos = step % len(rows)
        order = list(range(1, len(rows)))
        order.insert(pos, 0)
        logits = torch.randn(len(rows), 1000)
        logits[pos] = step_logits
        keys = [sample_key(rows[i][1]) if rows[i][1] is not None else None for i in order]
        st = SamplingTensors.from_params([rows[i][0] for i in order], CPU, keys)
        # the others are at other output positions than ours
        out = sample(logits, st, [step if i == 0 else 3 * step + i for i in order])
        tokens.append(int(out.token_ids[pos]))
    return tokens


def test_seeded_request_is_reproducible_across_batch_compositions():
    alone = seeded_run(7, [])
    crowd = seeded_run(7, [(SamplingParams(temperature=0.0), None), (SamplingParams(top_k=5), None),
                           (SamplingParams(temperature=0.5, top_p=0.5), 9), (SamplingParams(), None)])
    other = seeded_run(7, [(SamplingParams(temperature=2.0, seed=1), 1)])
    assert alone == crowd == other
    assert seeded_run(8, []) != alone
    assert len(set(alone)) > 5  # really sampled, not argmax


def test_keyed_draws_depend_on_key_and_position_only():
    keys = torch.tensor([sample_key(5), sample_key(5), sample_key(5, 1), sample_key(-(2**63))])
    pos = torch.tensor([0, 1, 0, 0])
    e = keyed_exponentials(keys, pos, 64)
    assert e.shape == (4, 64) and e.dtype == torch.float32 and bool((e > 0).all())
    again = keyed_exponentials(keys[[1, 0]], pos[[1, 0]], 64)
    assert torch.equal(again, e[[1, 0]])                         # a row's draws do not depend on the batch
    assert not torch.equal(e[0], e[1]) and not torch.equal(e[0], e[2])   # positions and choices differ
    # Exp(1): mean 1, P(E > 1) = 1/e, over many draws
    many = keyed_exponentials(torch.full((200,), sample_key(3)), torch.arange(200), 500)
    assert abs(float(many.mean()) - 1.0) < 0.01
    assert abs(float((many > 1).double().mean()) - math.exp(-1)) < 0.005


def keyed_pair_law(noise_fn, num_keys: int = 20_000) -> tuple[torch.Tensor, torch.Tensor]:
    """The observed joint law of the tokens a keyed request draws at output positions 0 and 1 from
    two fixed distributions, over `num_keys` seeds (noise by `noise_fn`), and the exact law."""
    g = torch.Generator().manual_seed(21)
    rows = torch.randn(2, 5, generator=g) * 1.2
    params = SamplingParams(temperature=1.0)
    st = SamplingTensors.from_params([params] * num_keys, CPU, [sample_key(s) for s in range(num_keys)])
    tokens = []
    for position in (0, 1):
        probs = processed_probs(rows[position:position + 1], st_of(params))
        noise = noise_fn(st.keys, torch.full((num_keys,), position), 5)
        tokens.append((probs / noise).argmax(-1))
    law = torch.bincount(tokens[0] * 5 + tokens[1], minlength=25).double() / num_keys
    p = rows.softmax(-1).double()
    return law, (p[0][:, None] * p[1][None, :]).reshape(-1)


def test_keyed_draws_follow_the_law_and_positions_are_independent():
    law, exact = keyed_pair_law(keyed_exponentials)
    assert 0.5 * float((law - exact).abs().sum()) < 0.02


def test_the_keyed_law_test_sees_noise_shared_between_positions():
    law, exact = keyed_pair_law(lambda keys, pos, vocab: keyed_exponentials(keys, pos * 0, vocab))
    assert 0.5 * float((law - exact).abs().sum()) > 0.05


def test_sample_uses_the_keyed_draws_of_the_given_positions():
    logits = torch.randn(3, 50)
    params = [SamplingParams(temperature=0.8), SamplingParams(temperature=0.0, seed=4), SamplingParams(seed=4)]
    st = SamplingTensors.from_params(params, CPU, [sample_key(4), sample_key(4), sample_key(4)])
    assert st.keyed_rows == (0, 2)                                # greedy rows are never keyed
    out = sample(logits, st, [6, 0, 2]).token_ids
    probs = processed_probs(logits, st)
    noise = keyed_exponentials(torch.tensor([sample_key(4)] * 2), torch.tensor([6, 2]), 50)
    assert out[0] == (probs[0] / noise[0]).argmax() and out[2] == (probs[2] / noise[1]).argmax()
    assert out[1] == logits[1].argmax()


def test_unseeded_rows_follow_global_rng():
    logits = torch.randn(4, 500)
    st = st_of(*[SamplingParams(temperature=1.0)] * 4)
    torch.manual_seed(5)
    a = sample(logits, st, [None] * 4).token_ids
    torch.manual_seed(5)
    b = sample(logits, st, [None] * 4).token_ids
    assert torch.equal(a, b)


# ---- statistical test ------------------------------------------------------------------------

@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.0, top_k=5),
    SamplingParams(temperature=1.0, top_p=0.8),
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=0.7, top_p=0.8),
    SamplingParams(temperature=0.7, top_k=5, top_p=0.8),
    SamplingParams(temperature=1.5, top_k=8, top_p=0.9),
])
def test_samples_follow_processed_probs(params):
    num_samples, vocab = 20_000, 12
    gen = torch.Generator().manual_seed(11)
    row = torch.randn(vocab, generator=gen) * 1.5
    st = st_of(*[params] * num_samples)
    target = processed_probs(row.unsqueeze(0), st_of(params))[0].double()
    torch.testing.assert_close(target, reference_probs(row, params), atol=1e-6, rtol=1e-5)

    torch.manual_seed(12)
    out = sample(row.expand(num_samples, vocab), st, [None] * num_samples)
    counts = torch.bincount(out.token_ids, minlength=vocab).double()
    assert counts[target == 0].sum() == 0, "sampled a token that top-k/top-p removed"
    support = target > 0
    expected = target[support] * num_samples
    chi2 = float(((counts[support] - expected) ** 2 / expected).sum())
    df = int(support.sum()) - 1
    # mean df, sd sqrt(2 df): 5 sd is a bound a correct sampler essentially never exceeds
    assert chi2 < df + 5 * math.sqrt(2 * max(df, 1)), (chi2, df)
    tv = 0.5 * float((counts / num_samples - target).abs().sum())
    assert tv < 0.02, tv


def test_statistics_hold_per_row_in_a_mixed_batch():
    # Two different settings interleaved in one batch: each row draws from its own distribution.
    num, vocab = 20_000, 6
    row = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5])
    a, b = SamplingParams(temperature=1.0, top_k=2), SamplingParams(temperature=0.5, top_p=0.9)
    st = st_of(*[a, b] * (num // 2))
    torch.manual_seed(13)
    tokens = sample(row.expand(num, vocab), st, [None] * num).token_ids
    for sub, p in ((tokens[0::2], a), (tokens[1::2], b)):
        freq = torch.bincount(sub, minlength=vocab).double() / sub.numel()
        assert 0.5 * float((freq - reference_probs(row, p)).abs().sum()) < 0.02


# ---- logprobs --------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_match_log_softmax_of_raw_logits(dtype):
    torch.manual_seed(4)
    logits = (torch.randn(4, 200) * 3).to(dtype)
    params = [SamplingParams(temperature=0.0, logprobs=2), SamplingParams(temperature=0.5, logprobs=5),
              SamplingParams(temperature=1.0), SamplingParams(temperature=2.0, top_k=3, logprobs=0)]
    st = st_of(*params)
    assert st.max_logprobs == 5
    out = sample(logits, st, [None] * 4)
    ref = torch.log_softmax(logits.float(), dim=-1)
    assert out.logprobs.dtype == torch.float32 and out.top_logprobs.dtype == torch.float32
    torch.testing.assert_close(out.logprobs, ref.gather(1, out.token_ids[:, None])[:, 0])
    top = ref.topk(5, dim=-1)
    assert out.top_ids.shape == (4, 5) and out.top_ids.dtype == torch.int64
    assert torch.equal(out.top_ids, top.indices)
    torch.testing.assert_close(out.top_logprobs, top.values)


def test_logprobs_absent_or_zero_alternatives():
    logits = torch.randn(2, 10)
    assert st_of(SamplingParams(), SamplingParams()).max_logprobs is None
    assert sample(logits, st_of(SamplingParams(), SamplingParams()), [None, None]).logprobs is None
    out = sample(logits, st_of(SamplingParams(logprobs=0), SamplingParams()), [None, None])
    assert out.logprobs.shape == (2,) and out.top_ids.shape == (2, 0)


def test_sampling_tensors_from_params():
    st = st_of(SamplingParams(temperature=0.0, top_k=7, top_p=0.5), SamplingParams(temperature=0.9, top_k=1),
               SamplingParams(temperature=0.6, top_k=7), SamplingParams(top_p=0.3, logprobs=3))
    assert st.temperature.tolist() == pytest.approx([0.0, 0.0, 0.6, 1.0])
    assert st.top_k.tolist() == [0, 0, 7, 0] and st.top_k.dtype == torch.int64
    assert st.top_p.tolist() == pytest.approx([1.0, 1.0, 1.0, 0.3])
    assert (st.all_greedy, st.any_top_k, st.any_top_p, st.max_logprobs, st.max_top_k) == (False, True, True, 3, 7)
    g = st_of(SamplingParams(temperature=0.0, top_p=0.5))
    assert (g.all_greedy, g.any_top_k, g.any_top_p) == (True, False, False)


def test_argmax_is_torchs_argmax_ties_and_nan_included():
    from specserve.engine.sampler import argmax

    g = torch.Generator().manual_seed(0)
    cases = [torch.tensor([[1.0, 3.0, 3.0, 2.0]]), torch.tensor([[math.nan, 1.0, math.nan]]),
             torch.tensor([[1.0, math.nan]]), torch.full((2, 5), -math.inf),
             torch.randint(0, 3, (8, 49152), generator=g).float(),            # many ties over a vocabulary
             torch.randint(0, 3, (3, 7, 1000), generator=g).float().bfloat16(),
             torch.randint(0, 3, (6, 999), generator=g).double(), torch.tensor([2.0, math.nan, 5.0]),
             torch.randint(0, 3, (9, 400), generator=g).float()[1::2, 3:].t(),  # a strided view
             torch.randn(2, 3, 50, generator=g, requires_grad=True)]
    with torch.inference_mode():
        cases.append(torch.randint(0, 3, (4, 300), generator=g).float())
    for x in cases:
        got = argmax(x)
        assert got.dtype == torch.int64 and torch.equal(got, x.argmax(dim=-1)), x.shape
