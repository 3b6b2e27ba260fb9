"""Batched, sync-free logits processing and sampling.

Shared by plain decoding (`sample`) and speculative verification, which needs the distribution
plain sampling draws from (`processed_probs`). Every function works on a whole batch whose rows
have different settings; nothing here calls `.item()`, `.tolist()` or `torch.multinomial`, so a
step stays free of host syncs until the runner's single `.tolist()` at the end.

Order of processing for a random row (as in vLLM): temperature, then top-k, then top-p on the
top-k-renormalised distribution. Greedy rows (temperature 0, or top_k 1) take the argmax of the
raw logits.

**Keyed randomness (seeded requests).** A random row draws token v with the exponential race
argmax_v probs[v] / E[v]. For an unseeded row E comes from the global RNG. For a seeded row E is a
pure function of (the request's key, the output position of the token being drawn): the key is
`sample_key(seed, choice index)`, and `keyed_exponentials` hashes (key, position, vocabulary index)
into Exp(1) draws (counter-based, like Philox: no generator state, the same numbers on any device,
batch or step). So the token a seeded request gets at output position i depends only on the
processed distribution there and on (seed, i) — not on how many tokens an engine step produced,
which drafts were verified or what else ran in the batch. Verification uses the same draws
(`verify.verify_batched`): a drafted token is accepted exactly when it equals the target's own
keyed sample at its node, so speculative decoding of a seeded request reproduces plain decoding
with that seed token for token, whatever the drafter. Distinct positions get independent draws,
so every token is still an exact sample of the target's distribution.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from specserve.engine.sampling_params import SamplingParams

_TINY = torch.finfo(torch.float32).tiny  # floor for Exp(1) draws, so probs / E never meets 0 / 0
_MASK32 = 0xFFFFFFFF
_KEY_STRIDE = 1_000_003   # sample_key: choices of one request get keys this far apart


def argmax(x: Tensor) -> Tensor:
    """`x.argmax(dim=-1)`, the same index (the first of equal maxima; a NaN counts as the maximum).
    Every decoded token and every tree node pays it, and on the CPU torch's reductions are slow:
    over a 49k vocabulary on this project's 2-core AVX-512 machine, `max(dim=-1)` takes 65 µs for
    one row and 390 µs for 9 rows, numpy's argmax (the same rule, on the same memory) 5 and 42 µs.
    So a float32/float64 CPU tensor goes through numpy (a view of its memory, no transfer; never
    taken on a GPU, so it is no host sync there: `_numpy_view` is bound once, and the tests' host-sync
    detector, which patches `Tensor.numpy`, keeps watching every other conversion); anything else
    through `max`."""
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64) and x.dim() and not x.requires_grad:
        return torch.from_numpy(np.asarray(_numpy_view(x).argmax(axis=-1)))
    return x.max(dim=-1).indices


_numpy_view = torch.Tensor.numpy


def sample_key(seed: int, index: int = 0) -> int:
    """The 64-bit key (as a signed int64) of choice `index` of a request seeded with `seed`."""
    key = (int(seed) * _KEY_STRIDE + int(index)) % 2**64
    return key - 2**64 if key >= 2**63 else key


def _mix32(x: Tensor) -> Tensor:
    """A 32-bit integer hash, elementwise over int64 tensors holding values in [0, 2^32): rounds of
    xor-shift and multiplication by odd constants below 2^31 (so no product overflows int64),
    every step a bijection of the 32-bit values."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & _MASK32
    x = x ^ (x >> 16)
    x = (x * 0x297A2D39) & _MASK32
    return x ^ (x >> 15)


_VOCAB_HASH: dict[tuple[int, str], Tensor] = {}


def _vocab_hash(vocab: int, device: torch.device) -> Tensor:
    """[V] the hash of every vocabulary index (cached per size and device)."""
    cached = _VOCAB_HASH.get((vocab, str(device)))
    if cached is None:
        cached = _VOCAB_HASH[(vocab, str(device))] = _mix32(torch.arange(vocab, dtype=torch.int64, device=device)
                                                           + 0x9E3779B9)
    return cached


def keyed_exponentials(keys: Tensor, positions: Tensor, vocab: int) -> Tensor:
    """[R, V] Exp(1) draws; row r is a pure function of (keys[r], positions[r]) — int64 tensors [R]
    — and the same on every device.

    The row's (key, position) is hashed into a 32-bit state h_r; entry v is
    u = (mix(h_r xor hash(v)) + 1/2) / 2^32, a uniform draw in (0, 1), and E = -log u."""
    keys, positions = keys.to(torch.int64), positions.to(torch.int64)
    lo, hi = keys & _MASK32, (keys >> 32) & _MASK32
    row = _mix32(lo ^ _mix32(hi ^ _mix32(positions & _MASK32)))                 # [R]
    bits = _mix32(row[:, None] ^ _vocab_hash(vocab, keys.device)[None, :])      # [R, V]
    u = (bits.to(torch.float64) + 0.5) * (1.0 / 2**32)
    return (-torch.log(u)).to(torch.float32).clamp_min_(_TINY)


@dataclass
class SamplingTensors:
    """The per-row sampling settings of one step, as tensors. Built once per step."""

    temperature: Tensor  # [B] float32, 0 for greedy rows
    top_k: Tensor        # [B] int64, 0 = off (also 0 on greedy rows)
    top_p: Tensor        # [B] float32, 1 = off (also 1 on greedy rows)
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    max_logprobs: int | None  # max k over rows asking for logprobs, None if no row does
    max_top_k: int = 0        # max top_k over random rows (0 if none): bounds the top-k-only path
    # keyed rows: the random rows with a sample key (seeded requests), host indices, and their keys
    keyed_rows: tuple[int, ...] = ()
    keys: Tensor | None = None   # [len(keyed_rows)] int64
    keyed_index: Tensor | None = None   # keyed_rows on the device (int64), made with the rest, not mid-step
    all_matched: bool = False    # every row is greedy or keyed (verification needs no rejection walk)
    min_p: Tensor | None = None  # [B] float32, 0 = off; None when no row asks for it

    @classmethod
    def from_params(cls, params: list[SamplingParams], device: torch.device | str,
                    keys: list[int | None] | None = None) -> "SamplingTensors":
        """keys: one per row, the row's `sample_key` or None (unkeyed: the global RNG); greedy rows
        are never keyed."""
        temperature, top_k, top_p = [], [], []
        for p in params:
            if p.greedy:
                temperature.append(0.0)
                top_k.append(0)
                top_p.append(1.0)
            else:
                temperature.append(float(p.temperature))
                top_k.append(int(p.top_k))
                top_p.append(float(p.top_p))
        asked = [p.logprobs for p in params if p.logprobs is not None]
        min_p = [0.0 if p.greedy else float(p.min_p) for p in params]
        keyed = tuple(i for i, k in enumerate(keys or ()) if k is not None and temperature[i] != 0.0)
        return cls(
            temperature=torch.tensor(temperature, dtype=torch.float32, device=device),
            top_k=torch.tensor(top_k, dtype=torch.int64, device=device),
            top_p=torch.tensor(top_p, dtype=torch.float32, device=device),
            all_greedy=all(t == 0.0 for t in temperature),
            any_top_k=any(k > 0 for k in top_k),
            any_top_p=any(p < 1.0 for p in top_p),
            max_logprobs=max(asked) if asked else None,
            max_top_k=max(top_k, default=0),
            keyed_rows=keyed,
            keys=torch.tensor([keys[i] for i in keyed], dtype=torch.int64, device=device) if keyed else None,
            keyed_index=torch.tensor(keyed, dtype=torch.int64, device=device) if keyed else None,
            all_matched=sum(t == 0.0 for t in temperature) + len(keyed) == len(params),
            min_p=torch.tensor(min_p, dtype=torch.float32, device=device) if any(min_p) else None,
        )


@dataclass
class SamplerOutput:
    token_ids: Tensor              # [B] int64
    logprobs: Tensor | None        # [B] float32, chosen token under log_softmax(raw logits); None if no row asked
    top_ids: Tensor | None         # [B, max_logprobs] int64, most likely first
    top_logprobs: Tensor | None    # [B, max_logprobs] float32


def apply_top_k_top_p(logits: Tensor, st: SamplingTensors) -> Tensor:
    """Mask (to -inf) the tokens that top-k and top-p remove, row by row.

    logits: [B, V] float32, already divided by the temperature. Returns a new [B, V] tensor.

    Both filters reduce to a per-row threshold on the logit value: keep token v iff
    logits[v] >= threshold. Top-k: the threshold is the k-th largest logit (ties with it are
    kept). Top-p: with the (top-k-filtered) row sorted in descending order and probabilities
    s_1 >= s_2 >= ..., keep the smallest prefix 1..m whose mass reaches p, i.e. every j with
    s_1 + ... + s_{j-1} < p (j = 1 always qualifies); the threshold is the m-th sorted logit.
    Rows with k = 0 and p = 1 get threshold -inf (untouched).

    Example: logits [2, 1, 0, -1], probabilities ~[.64, .24, .09, .03].
    top_k=2 keeps {2, 1}; top_p=0.8 keeps {2, 1} (0.64 < 0.8, 0.88 >= 0.8 stops);
    top_p=0.5 keeps {2} alone.
    """
    if not (st.any_top_k or st.any_top_p):
        return logits
    num_rows, vocab = logits.shape
    neg_inf = torch.full((), float("-inf"), device=logits.device)
    k = st.top_k.clamp(max=vocab)
    if not st.any_top_p:
        # Top-k only: a partial top-k with the batch's largest k instead of a full sort.
        top = logits.topk(min(st.max_top_k, vocab), dim=-1).values          # [B, max_k]
        kth = top.gather(1, (k - 1).clamp(min=0).unsqueeze(1)).squeeze(1)    # [B]
        threshold = torch.where(k > 0, kth, neg_inf)
        return logits.masked_fill(logits < threshold.unsqueeze(1), float("-inf"))

    sorted_logits = logits.sort(dim=-1, descending=True).values             # [B, V]
    if st.any_top_k:
        kth = sorted_logits.gather(1, (k - 1).clamp(min=0).unsqueeze(1))    # [B, 1]
        kth = torch.where(k.unsqueeze(1) > 0, kth, neg_inf)
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    else:
        kth = neg_inf.expand(num_rows, 1)
    sorted_probs = sorted_logits.softmax(dim=-1)                            # [B, V]
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs                # exclusive prefix sum
    num_keep = (mass_before < st.top_p.unsqueeze(1)).sum(dim=-1, keepdim=True).clamp(min=1)  # [B, 1]
    pth = sorted_logits.gather(1, num_keep - 1)                             # [B, 1]
    # max(): rounding may let mass_before stay below p inside the top-k-masked tail.
    pth = torch.where(st.top_p.unsqueeze(1) < 1.0, torch.maximum(pth, kth), kth)
    return logits.masked_fill(logits < pth, float("-inf"))


def processed_probs(logits: Tensor, st: SamplingTensors) -> Tensor:
    """The distribution plain sampling draws from, per row.

    logits: [B, V] (any float dtype). Returns [B, V] float32:
    softmax(top_p(top_k(min_p(logits / temperature)))) for random rows, and the one-hot of
    argmax(raw logits) for greedy rows. Rows are processed independently.
    """
    logits = logits.float()
    return _processed_probs(logits, st, argmax(logits))


def _processed_probs(logits: Tensor, st: SamplingTensors, greedy_ids: Tensor) -> Tensor:
    """processed_probs for float32 logits [B, V] whose row argmaxes greedy_ids [B] are known."""
    onehot = torch.zeros_like(logits).scatter_(1, greedy_ids.unsqueeze(1), 1.0)
    if st.all_greedy:
        return onehot
    greedy = st.temperature == 0                                             # [B]
    temperature = torch.where(greedy, torch.ones_like(st.temperature), st.temperature)
    scaled = logits / temperature.unsqueeze(1)
    if st.min_p is not None:   # keep v with p(v) >= min_p * max p, p after temperature (as vLLM)
        probs = scaled.softmax(dim=-1)
        floor = st.min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
        scaled = scaled.masked_fill(probs < floor, float("-inf"))
    probs = apply_top_k_top_p(scaled, st).softmax(dim=-1)
    return torch.where(greedy.unsqueeze(1), onehot, probs)


def race_noise(st: SamplingTensors, vocab: int, positions, device: torch.device) -> Tensor:
    """[B, V] the Exp(1) draws of the exponential race of one step's rows: keyed rows' from
    `keyed_exponentials` at `positions` (per row, the output position of the token drawn; only
    read for keyed rows), the others' from the global RNG in one batched draw."""
    noise = torch.empty((st.temperature.shape[0], vocab), dtype=torch.float32, device=device).exponential_()
    if st.keyed_rows:
        # one non-blocking copy from pinned memory on CUDA: a pageable one waits for the stream, and this
        # may run while the step before is still on the device (async scheduling)
        host = torch.tensor([int(positions[i]) for i in st.keyed_rows] + list(st.keyed_rows), dtype=torch.int64)
        pos, rows = (host.pin_memory() if device.type == "cuda" else host).to(device, non_blocking=True).chunk(2)
        noise.index_copy_(0, rows, keyed_exponentials(st.keys, pos, vocab))
    return noise.clamp_min_(_TINY)


def exponential_noise(shape: tuple[int, int], generators: list[torch.Generator | None],
                      device: torch.device) -> Tensor:
    """[B, V] i.i.d. Exp(1) draws. Row i comes from generators[i] when it has one (so a seeded
    request draws the same numbers whatever else is in the batch), else from the global RNG in
    one batched draw."""
    noise = torch.empty(shape, dtype=torch.float32, device=device).exponential_()
    for i, g in enumerate(generators):
        if g is not None:
            noise[i].exponential_(generator=g)
    return noise.clamp_min_(_TINY)


def sample(logits: Tensor, st: SamplingTensors, positions=None) -> SamplerOutput:
    """Pick one token per row.

    logits: [B, V] (float32 or bf16/fp16, computed in float32). positions: per row the output
    position of the token drawn (a host sequence; needed when `st` has keyed rows).

    Greedy rows: argmax of the raw logits. Random rows: the exponential race
    argmax_v probs[v] / E[v] with E[v] ~ Exp(1) i.i.d.; since E[v] / probs[v] ~ Exp(probs[v]),
    the smallest of those (the winner) is v with probability probs[v] / sum(probs). No host sync.
    Logprobs (OpenAI-style) are taken from log_softmax of the raw, unscaled logits.
    """
    logits = logits.float()
    greedy_ids = argmax(logits)                                     # [B]
    if st.all_greedy:
        token_ids = greedy_ids
    else:
        probs = _processed_probs(logits, st, greedy_ids)
        race = probs / race_noise(st, probs.shape[1], positions, probs.device)
        token_ids = torch.where(st.temperature == 0, greedy_ids, argmax(race))

    if st.max_logprobs is None:
        return SamplerOutput(token_ids, None, None, None)
    logprobs = logits.log_softmax(dim=-1)                                    # [B, V]
    chosen = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)           # [B]
    top = logprobs.topk(min(st.max_logprobs, logprobs.shape[1]), dim=-1)
    return SamplerOutput(token_ids, chosen, top.indices, top.values)
