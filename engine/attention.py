"""Attention metadata and the torch reference attention over the paged KV cache.

One step's new tokens are a ragged, flattened batch: sequence b owns rows
`cu_query_lens[b] : cu_query_lens[b+1]` of the query. Its keys are its whole context: the
`context_lens[b] - query_lens[b]` committed tokens followed by its own new tokens. `masks[b]`
governs the last `masks[b].shape[1]` context positions (the new tokens, and for a drafter growing
a tree level by level also the earlier tree levels); every position before them is fully visible.
None = causal (prefill or decode); a tree's ancestor mask for speculative verification. New tokens are written to the cache before
attention, in the slots `slot_mapping` names, so the new-token part of the context is read back from
the cache like the prefix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttnMetadata:
    query_lens: list[int]             # new tokens per sequence
    context_lens: list[int]           # committed + new tokens per sequence (keys attended to)
    cu_query_lens: list[int]          # [B+1] offsets of each sequence's rows in the flat batch
    slot_mapping: torch.Tensor        # [num_tokens] int64 cache slot of each new token
    context_slots: torch.Tensor       # [B, max_context_len] int64 cache slot of each key position (padded with 0)
    block_tables: torch.Tensor        # [B, max_blocks] int32 (for paged kernels)
    masks: list[torch.Tensor | None]  # per sequence: [q, m >= q] bool over the last m keys, True = visible; None = causal
    block_size: int = 0               # slots per cache block (0: unknown, keys are gathered slot by slot)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    def __post_init__(self) -> None:
        # Decode rows (one new token, causal) are batched together; the rest go one by one.
        self.decode_idx = [b for b, q in enumerate(self.query_lens) if q == 1]
        self.other_idx = [b for b, q in enumerate(self.query_lens) if q != 1]
        self._decode_cache: tuple | None = None

    def decode_batch(self, device: torch.device):
        """Index tensors for the batched decode rows, built once per step and shared by all layers."""
        if self._decode_cache is None:
            idx = self.decode_idx
            rows = torch.tensor([self.cu_query_lens[b] for b in idx], device=device)
            lens = [self.context_lens[b] for b in idx]
            max_len = max(lens)
            if self.block_size:
                nblk = -(-max_len // self.block_size)
                blocks = self.block_tables[idx, :nblk] if len(idx) != self.num_seqs else self.block_tables[:, :nblk]
                slots = (blocks.contiguous(), max_len)
            else:
                slots = self.context_slots[idx, :max_len] if len(idx) != self.num_seqs else self.context_slots[:, :max_len]
            pad_mask = None
            if min(lens) != max_len:
                pad_mask = (torch.arange(max_len, device=device)[None, :]
                            < torch.tensor(lens, device=device)[:, None])[:, None, None, :]   # [Bd, 1, 1, L]
            self._decode_cache = (rows, slots, pad_mask)
        return self._decode_cache


def build_attn_metadata(
    block_tables: list[list[int]],
    block_size: int,
    starts: list[int],
    query_lens: list[int],
    masks: list[torch.Tensor | None] | None,
    device: torch.device,
) -> tuple[torch.Tensor, AttnMetadata]:
    """Metadata for sequences whose new tokens occupy cache positions
    starts[b] .. starts[b] + query_lens[b] - 1. Returns (positions [num_tokens], metadata); the
    positions are the chain positions (a tree caller replaces them with prefix + depth)."""
    num_seqs = len(block_tables)
    context_lens = [s + q for s, q in zip(starts, query_lens)]
    width = max(len(t) for t in block_tables)
    bt = torch.zeros(num_seqs, width, dtype=torch.int64)
    for b, t in enumerate(block_tables):
        bt[b, :len(t)] = torch.tensor(t, dtype=torch.int64)
    bt = bt.to(device)
    max_ctx = max(context_lens)
    context_slots = (bt[:, :, None] * block_size + torch.arange(block_size, device=device)).view(num_seqs, -1)
    context_slots = context_slots[:, :max_ctx]
    positions = torch.cat([torch.arange(s, s + q) for s, q in zip(starts, query_lens)]).to(device)
    seq_of_token = torch.repeat_interleave(torch.arange(num_seqs, device=device),
                                           torch.tensor(query_lens, device=device))
    slot_mapping = context_slots[seq_of_token, positions]
    cu = [0]
    for q in query_lens:
        cu.append(cu[-1] + q)
    meta = AttnMetadata(query_lens=list(query_lens), context_lens=context_lens, cu_query_lens=cu,
                        slot_mapping=slot_mapping, context_slots=context_slots,
                        block_tables=bt.to(torch.int32), masks=masks or [None] * num_seqs,
                        block_size=block_size)
    return positions, meta


def _full_mask(mask: torch.Tensor | None, q_len: int, ctx_len: int, device) -> torch.Tensor:
    """[q, ctx] visibility: keys before the masked tail are visible to all rows."""
    if mask is None:
        mask = torch.ones(q_len, q_len, dtype=torch.bool, device=device).tril_()
    prefix = ctx_len - mask.shape[1]
    full = torch.ones(q_len, ctx_len, dtype=torch.bool, device=device)
    full[:, prefix:] = mask
    return full


def gather_keys(cache: torch.Tensor, meta: AttnMetadata, slots) -> torch.Tensor:
    """Rows of `cache` [num_slots, Hkv, D] for a [B, L] slot grid, or for `(blocks [B, n], L)`: whole
    blocks copied at once (a few times faster on CPU than slot-by-slot indexing), cut to L."""
    if isinstance(slots, tuple):
        blocks, length = slots
        bs = meta.block_size
        grid = cache.view(-1, bs, *cache.shape[1:]).index_select(0, blocks.reshape(-1))
        return grid.view(blocks.shape[0], -1, *cache.shape[1:])[:, :length]
    return cache[slots]


def _row_slots(meta: AttnMetadata, b: int, ctx: int):
    if meta.block_size:
        return meta.block_tables[b:b + 1, :-(-ctx // meta.block_size)], ctx
    return meta.context_slots[b:b + 1, :ctx]


def paged_attention_reference(
    q: torch.Tensor,        # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    meta: AttnMetadata,
    scale: float,
) -> torch.Tensor:          # [num_tokens, num_heads * head_dim]
    """Exact attention with SDPA. Grouped-query heads are folded into the query-row dimension
    (head h uses kv head h // group) so keys and values are never repeated."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv = k_cache.shape[1]
    group = num_heads // num_kv
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)

    if meta.decode_idx:
        rows, slots, pad_mask = meta.decode_batch(q.device)
        bd = rows.shape[0]
        qd = q.index_select(0, rows).view(bd, num_kv, group, head_dim)            # [Bd, Hkv, G, D]
        kd = gather_keys(k_cache, meta, slots).transpose(1, 2)                   # [Bd, Hkv, L, D]
        vd = gather_keys(v_cache, meta, slots).transpose(1, 2)
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=pad_mask, scale=scale)
        out.index_copy_(0, rows, od.reshape(bd, num_heads, head_dim))

    for b in meta.other_idx:
        start, q_len, ctx = meta.cu_query_lens[b], meta.query_lens[b], meta.context_lens[b]
        qs = q[start:start + q_len].view(q_len, num_kv, group, head_dim).permute(1, 2, 0, 3)
        qs = qs.reshape(num_kv, group * q_len, head_dim)                         # [Hkv, G*q, D]
        slots = _row_slots(meta, b, ctx)
        ks = gather_keys(k_cache, meta, slots)[0].transpose(0, 1)                # [Hkv, ctx, D]
        vs = gather_keys(v_cache, meta, slots)[0].transpose(0, 1)
        mask = _full_mask(meta.masks[b], q_len, ctx, q.device)
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask.repeat(group, 1), scale=scale)
        out[start:start + q_len] = o.view(num_kv, group, q_len, head_dim).permute(2, 0, 1, 3).reshape(
            q_len, num_heads, head_dim)
    return out.view(num_tokens, num_heads * head_dim)
