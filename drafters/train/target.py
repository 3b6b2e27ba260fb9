"""The target as a teacher: last-layer hidden states and next-token distributions over whole
token sequences (teacher forcing), with our own model and a scratch paged KV cache.

Several sequences go through one forward as a ragged causal prefill, exactly as the engine
prefills prompts; a sequence longer than the token budget of a forward is prefilled in chunks
(its earlier chunks stay in the cache). The hidden states are what the engine hands to
feature-reading drafters: after the final norm, the LM head's input.
"""

from __future__ import annotations

from collections import deque

import torch

from specserve.engine.attention import build_attn_metadata
from specserve.engine.kv_cache import BlockManager, KVCache

DEFAULT_BATCH_TOKENS = 4096
DEFAULT_MAX_SEQS = 64        # sequences in one forward
BLOCK_SIZE = 16


class FeatureExtractor:
    """Runs `model` over whole sequences and returns their hidden states; keeps its scratch KV
    cache between calls (it grows when a call needs more)."""

    def __init__(self, model, device: torch.device | str | None = None, *, batch_tokens: int = DEFAULT_BATCH_TOKENS,
                 max_seqs: int = DEFAULT_MAX_SEQS, block_size: int = BLOCK_SIZE):
        if batch_tokens < 1 or max_seqs < 1:
            raise ValueError("batch_tokens and max_seqs must be positive")
        self.model = model
        self.device = torch.device(device) if device is not None else model.embed.weight.device
        self.dtype = model.embed.weight.dtype
        self.batch_tokens, self.max_seqs, self.block_size = batch_tokens, max_seqs, block_size
        self._cache: KVCache | None = None
        self._num_blocks = 0

    def _blocks(self, longest: int) -> BlockManager:
        """A fresh block pool (and a cache big enough for it). In flight at once: the sequences of
        one forward (at most batch_tokens new tokens, each sequence rounding up one block) plus the
        cached prefix of a sequence chunked across forwards (at most `longest` tokens)."""
        bs = self.block_size
        need = -(-self.batch_tokens // bs) + self.max_seqs + -(-longest // bs) + 1
        if self._cache is None or need > self._num_blocks:
            cfg = self.model.cfg
            self._cache = None   # free the old pool first
            self._cache = KVCache(cfg.num_layers, need, bs, cfg.num_kv_heads, cfg.head_dim, self.dtype, self.device)
            self._num_blocks = need
        return BlockManager(self._num_blocks, bs)

    def __call__(self, sequences: list[list[int]]) -> list[torch.Tensor]:
        """Hidden states [len(seq), hidden_size] of every sequence (model dtype, on the model's device)."""
        return self.extract(sequences)[0]

    @torch.no_grad()
    def extract(self, sequences: list[list[int]], capture_layers: tuple[int, ...] = ()
                ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """(hidden states [len(seq), hidden_size] of every sequence, and with `capture_layers` the
        residual streams after those layers [len(seq), len(capture_layers), hidden_size] of every
        sequence (`LlamaModel.forward`'s numbering), else None)."""
        if not sequences:
            return [], ([] if capture_layers else None)
        limit = getattr(self.model, "max_positions", None)
        for i, seq in enumerate(sequences):
            if len(seq) == 0:
                raise ValueError(f"sequence {i} is empty")
            if limit is not None and len(seq) > limit:
                raise ValueError(f"sequence {i} has {len(seq)} tokens, more than the model's {limit} positions")
        blocks = self._blocks(max(len(s) for s in sequences))
        pieces: list[list[torch.Tensor]] = [[] for _ in sequences]
        layer_pieces: list[list[torch.Tensor]] = [[] for _ in sequences]
        done = [0] * len(sequences)            # tokens of each sequence already in the cache
        pending = deque(range(len(sequences)))
        while pending:
            ids, starts, qlens, tables, order = [], [], [], [], []
            budget = self.batch_tokens
            while pending and budget > 0 and len(order) < self.max_seqs:
                i = pending[0]
                n = min(len(sequences[i]) - done[i], budget)
                if not blocks.grow(i, done[i] + n):
                    raise RuntimeError("scratch KV pool too small (a bug in FeatureExtractor._blocks)")
                ids.extend(sequences[i][done[i]:done[i] + n])
                starts.append(done[i])
                qlens.append(n)
                tables.append(blocks.block_tables[i])
                order.append(i)
                budget -= n
                if done[i] + n == len(sequences[i]):
                    pending.popleft()
                else:
                    break                      # its next chunk opens the next forward
            positions, meta = build_attn_metadata(tables, self.block_size, starts, qlens, None, self.device)
            hidden = self.model(torch.tensor(ids, dtype=torch.int64, device=self.device), positions, self._cache, meta,
                                capture_layers)
            hidden, captured = hidden if capture_layers else (hidden, None)
            row = 0
            for i, n in zip(order, qlens):
                pieces[i].append(hidden[row:row + n])
                if captured is not None:
                    layer_pieces[i].append(captured[row:row + n])
                row += n
                done[i] += n
                if done[i] == len(sequences[i]):
                    blocks.free(i)
        join = lambda parts: [p[0] if len(p) == 1 else torch.cat(p) for p in parts]   # noqa: E731
        return join(pieces), (join(layer_pieces) if capture_layers else None)


def target_features(model, sequences: list[list[int]], device: torch.device | str | None = None, *,
                    batch_tokens: int = DEFAULT_BATCH_TOKENS, max_seqs: int = DEFAULT_MAX_SEQS) -> list[torch.Tensor]:
    """Last-layer hidden states (after the final norm) of `model` over each whole sequence:
    a list of [len(seq), hidden_size] tensors in the model's dtype, on `device` (default: the
    model's). Up to `batch_tokens` tokens of up to `max_seqs` sequences per forward; longer
    sequences are prefilled in chunks."""
    return FeatureExtractor(model, device, batch_tokens=batch_tokens, max_seqs=max_seqs)(sequences)


@torch.no_grad()
def target_topk(model, hidden: torch.Tensor, k: int, *, chunk_rows: int = 1024,
                logprob_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's next-token distribution at each row of `hidden` [T, H], as its `k` most likely
    tokens: (ids [T, k] int32, log-probabilities [T, k] in `logprob_dtype`), most likely first, so
    `ids[:, 0]` is the greedy (argmax) next token. Log-probabilities are of the full softmax (fp32),
    not renormalised over the k. Logits are computed `chunk_rows` rows at a time ([rows, vocab] fp32)."""
    rows = hidden.shape[0]
    ids = torch.empty(rows, k, dtype=torch.int32, device=hidden.device)
    logprobs = torch.empty(rows, k, dtype=logprob_dtype, device=hidden.device)
    if k == 0:
        return ids, logprobs
    for a in range(0, rows, chunk_rows):
        logp = torch.log_softmax(model.compute_logits(hidden[a:a + chunk_rows]), dim=-1)
        top = torch.topk(logp, k, dim=-1, sorted=True)
        ids[a:a + chunk_rows] = top.indices.to(torch.int32)
        logprobs[a:a + chunk_rows] = top.values.to(logprob_dtype)
    return ids, logprobs
