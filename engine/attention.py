"""Attention metadata, the torch reference attention over the paged KV cache, and the dispatch
between it and the Triton kernel (`kernels/tree_attention.py`).

One step's new tokens are a ragged, flattened batch: sequence b owns rows
`cu_query_lens[b] : cu_query_lens[b+1]` of the query. Its keys are its whole context: the
`context_lens[b] - query_lens[b]` committed tokens followed by its own new tokens. `masks[b]`
governs the last `masks[b].shape[1]` context positions (the new tokens, and for a drafter growing
a tree level by level also the earlier tree levels); every position before them is fully visible.
None = causal (prefill or decode); a tree's ancestor mask for speculative verification. New tokens are written to the cache before
attention, in the slots `slot_mapping` names, so the new-token part of the context is read back from
the cache like the prefix.

So with q = query_lens[b], ctx = context_lens[b] and m = masks[b].shape[1] (m >= q), row i of
sequence b (0 <= i < q, at context position ctx - q + i) sees key position j < ctx when

    causal:  j <= ctx - q + i
    masked:  j < ctx - m   or   masks[b][i, j - (ctx - m)]

The same metadata also comes packed as device tensors for kernels (`cu_query_lens_t`,
`context_lens_t`, `mask_offsets`, `mask_widths`, `mask_data`): `build_attn_metadata` stages every
integer of a step (block tables, offsets, lengths, positions, slots, and host-side masks as bytes)
in one host buffer and sends it to the device in one copy (pinned and non-blocking on CUDA).

The torch reference batches the step instead of looping over sequences. The decode rows (one new
token, causal) share one SDPA call with a [Bd, 1, 1, L] padding mask at most. All other sequences
(prefill chunks, chains, trees, forests) are padded to [B', Hkv, G * q_max, ctx_max] with a
[B', 1, G * q_max, ctx_max] visibility mask (the rule above; padding keys hidden) built once per
step and shared by every layer: one call for them all, unless their lengths are so ragged that
padding costs more than a second call (`AttnMetadata.other_groups`; on this CPU one call for 16
trees of 8-32 nodes over contexts of 100-400 keys was 2x slower than a few calls). Grouped-query
heads are folded into the query rows (head h uses kv head h // G), so keys and values are never
repeated. A step of one sequence whose blocks are consecutive in the pool (the usual case when one
stream is served: the pool hands out low block ids first and takes freed ones back on top) reads
its keys in place, as a view of the cache, instead of gathering them (`contiguous_starts`): the
gather and the index shuffles around the call were two thirds of a decode row's attention time at
a 300-token context on the development CPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F


# What one more SDPA call costs the CPU reference, in (query, key) pairs of padded attention:
# measured with SmolLM2-135M's shapes (9 heads over 3 kv heads, head_dim 64), one thread, torch
# 2.13, a call's fixed part (key gather, launch) is ~80 us and a pair ~60 ns. Past 8 sequences a
# call got slower per sequence (cache-bound) on the 2-core development machine.
SDPA_CALL_COST = 1500
SDPA_MAX_SEQS = 8


@dataclass
class AttnMetadata:
    query_lens: list[int]             # new tokens per sequence
    context_lens: list[int]           # committed + new tokens per sequence (keys attended to)
    cu_query_lens: list[int]          # [B+1] offsets of each sequence's rows in the flat batch
    slot_mapping: torch.Tensor        # [num_tokens] int64 cache slot of each new token
    # [B, max_context_len] int64 cache slot of each key position (padded with 0): only for metadata
    # without a block size (built by hand); paged metadata reads its block tables instead
    context_slots: torch.Tensor | None
    block_tables: torch.Tensor        # [B, max_blocks] int32 (for paged kernels)
    masks: list[torch.Tensor | None]  # per sequence: [q, m >= q] bool over the last m keys, True = visible; None = causal
    block_size: int = 0               # slots per cache block (0: unknown, keys are gathered slot by slot)
    # per sequence: the slot of its position 0 when its context lies in consecutive blocks (its keys
    # are then cache[start : start + context_len]), else None; None altogether when not known
    contiguous_starts: list[int | None] | None = None
    # the same, packed for kernels (device tensors; built by build_attn_metadata, else on first use)
    cu_query_lens_t: torch.Tensor | None = None   # [B+1] int32
    context_lens_t: torch.Tensor | None = None    # [B] int32
    mask_offsets: torch.Tensor | None = None      # [B] int32 start of masks[b] (row-major [q, m]) in mask_data
    mask_widths: torch.Tensor | None = None       # [B] int32 m, 0 = causal (no mask stored)
    mask_data: torch.Tensor | None = None         # [>= 1] uint8 every mask flattened and concatenated
    staged: torch.Tensor | None = None            # the caller's integers sent with it (`build_attn_metadata`)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    def __post_init__(self) -> None:
        # Decode rows (one new token, causal) are batched together; the rest are batched apart
        # (a one-token row with a mask too: its mask may hide earlier tree nodes).
        self.decode_idx = [b for b, q in enumerate(self.query_lens) if q == 1 and self.masks[b] is None]
        self.other_idx = [b for b, q in enumerate(self.query_lens) if q != 1 or self.masks[b] is not None]
        self.max_query_len = max(self.query_lens)
        self.max_context_len = max(self.context_lens)
        self._decode_cache: tuple | None = None
        self._backend: str | None = None   # `attention_backend`, looked up once per step, not per layer
        self._other_cache: dict[tuple, list[tuple]] = {}

    def decode_batch(self, device: torch.device):
        """Index tensors for the batched decode rows, built once per step and shared by all layers."""
        if self._decode_cache is None:
            idx = self.decode_idx
            rows = torch.tensor([self.cu_query_lens[b] for b in idx], device=device)
            lens = [self.context_lens[b] for b in idx]
            max_len = max(lens)
            slots = self._key_slots(idx, max_len)
            pad_mask = None
            if min(lens) != max_len:
                pad_mask = (torch.arange(max_len, device=device)[None, :]
                            < torch.tensor(lens, device=device)[:, None])[:, None, None, :]   # [Bd, 1, 1, L]
            self._decode_cache = (rows, slots, pad_mask)
        return self._decode_cache

    def other_groups(self) -> list[list[int]]:
        """The non-decode sequences split into padded batches, few and with little padding: taken
        longest context first, a sequence joins the current batch unless the padding it adds costs
        more than a call of its own (`SDPA_CALL_COST` query-key pairs). Usually one batch."""
        groups: list[list[int]] = []
        q_max = ctx_max = 0
        for b in sorted(self.other_idx, key=lambda b: (-self.context_lens[b], -self.query_lens[b])):
            q, ctx = self.query_lens[b], self.context_lens[b]
            if groups:
                n = len(groups[-1])
                merged = (n + 1) * max(q_max, q) * ctx_max
                apart = n * q_max * ctx_max + q * ctx + SDPA_CALL_COST
                if merged <= apart and n < SDPA_MAX_SEQS:
                    groups[-1].append(b)
                    q_max = max(q_max, q)
                    continue
            groups.append([b])
            q_max, ctx_max = q, ctx
        return groups

    def other_batch(self, group: int, device: torch.device, dtype: torch.dtype) -> list[tuple]:
        """Per batch of `other_groups`, built once per step (and group size and dtype) and shared
        by all layers: (query rows [B', q_max], key slots, visibility [B', 1, group * q_max, ctx_max]
        with rows ordered (head in group, token) as an additive mask of `dtype` (0 visible, -inf
        hidden: SDPA takes it as it is, where a bool mask is converted on every call, 3-18 % of a
        tree row's call on the development CPU), output rows [n_real] of the real padded rows
        `real` [n_real]). Rows and dest are None when one batch is the whole step in order with
        equal lengths (q is then [B', q_max] as it is); real is None when nothing is padded."""
        key = (group, dtype)
        if key not in self._other_cache:
            batches = []
            for idx in self.other_groups():
                rows, slots, vis, dest, real = self._padded_batch(idx, group, device)
                additive = torch.zeros(vis.shape, dtype=dtype, device=device).masked_fill_(~vis, float("-inf"))
                batches.append((rows, slots, additive, dest, real))
            self._other_cache[key] = batches
        return self._other_cache[key]

    def _padded_batch(self, idx: list[int], group: int, device: torch.device) -> tuple:
        """One entry of `other_batch`: sequences `idx` padded to their longest query and context."""
        qlens = [self.query_lens[b] for b in idx]
        ctxs = [self.context_lens[b] for b in idx]
        q_max, ctx_max = max(qlens), max(ctxs)
        n = len(idx)
        q_t, ctx_t = torch.tensor(qlens), torch.tensor(ctxs)
        i = torch.arange(q_max)
        rows = dest = real = None
        if idx != list(range(self.num_seqs)) or min(qlens) != q_max:
            # padding rows repeat the sequence's last row (their output is dropped)
            cu = torch.tensor([self.cu_query_lens[b] for b in idx])
            rows = cu[:, None] + torch.minimum(i[None, :], q_t[:, None] - 1)          # [B', q_max]
            dest = rows.reshape(-1)
            if min(qlens) != q_max:
                real = (i[None, :] < q_t[:, None]).reshape(-1).nonzero().squeeze(1)
                dest = dest[real]
            rows, dest, real = (None if t is None else t.to(device) for t in (rows, dest, real))
        # causal visibility j <= ctx - q + i, cut at ctx (padding rows then see all of [0, ctx))
        j = torch.arange(ctx_max, device=device)
        i, q_t, ctx_t = i.to(device), q_t.to(device), ctx_t.to(device)
        vis = j[None, None, :] <= (ctx_t - q_t)[:, None, None] + i[None, :, None]
        vis &= j[None, None, :] < ctx_t[:, None, None]                                   # [B', q_max, ctx_max]
        for r, b in enumerate(idx):
            m = self.masks[b]
            if m is not None:
                ctx = self.context_lens[b]
                vis[r, :m.shape[0], ctx - m.shape[1]:ctx] = m
        vis = vis[:, None].expand(n, group, q_max, ctx_max).reshape(n, 1, group * q_max, ctx_max)
        return rows, self._key_slots(idx, ctx_max), vis, dest, real

    def _key_slots(self, idx: list[int], length: int):
        """What `gather_keys` needs for the first `length` keys of sequences `idx`."""
        every = len(idx) == self.num_seqs and idx == list(range(self.num_seqs))
        if self.block_size:
            nblk = -(-length // self.block_size)
            blocks = self.block_tables[:, :nblk] if every else self.block_tables[idx, :nblk]
            return blocks.contiguous(), length
        return self.context_slots[:, :length] if every else self.context_slots[idx, :length]

    def packed(self) -> "AttnMetadata":
        """Fill the kernel fields from the lists when this metadata was built by hand."""
        if self.cu_query_lens_t is None:
            device = self.block_tables.device
            widths = [0 if m is None else m.shape[1] for m in self.masks]
            offsets = np.cumsum([0] + [q * w for q, w in zip(self.query_lens, widths)])[:-1].tolist()
            ints = torch.tensor(self.cu_query_lens + self.context_lens + offsets + widths, dtype=torch.int32)
            self.cu_query_lens_t, self.context_lens_t, self.mask_offsets, self.mask_widths = \
                ints.to(device).split([self.num_seqs + 1] + [self.num_seqs] * 3)
            self.mask_data = _flat_masks([m.to(device) for m in self.masks if m is not None], torch.device(device))
        return self


_NO_MASKS: dict[torch.device, torch.Tensor] = {}   # a one-byte mask_data per device, for batches without masks


def _flat_masks(masks: list[torch.Tensor], device, out: torch.Tensor | None = None) -> torch.Tensor:
    """The masks flattened row-major and concatenated as uint8 (at least one byte: kernels need a
    valid pointer)."""
    if not masks:
        if out is not None:
            return out
        if device not in _NO_MASKS:
            _NO_MASKS[device] = torch.zeros(1, dtype=torch.uint8, device=device)
        return _NO_MASKS[device]
    flat = [m.reshape(-1).to(torch.bool) for m in masks]
    if out is not None:
        return torch.cat(flat, out=out.view(torch.bool)).view(torch.uint8)
    return torch.cat(flat).view(torch.uint8)


def build_attn_metadata(
    block_tables: list[list[int]],
    block_size: int,
    starts: list[int],
    query_lens: list[int],
    masks: list[torch.Tensor | None] | None,
    device: torch.device,
    stage: list[int] | None = None,
) -> tuple[torch.Tensor, AttnMetadata]:
    """Metadata for sequences whose new tokens occupy cache positions
    starts[b] .. starts[b] + query_lens[b] - 1. Returns (positions [num_tokens], metadata); the
    positions are the chain positions (a tree caller replaces them with prefix + depth).

    Every integer goes through one host buffer, laid out as int64
    [block tables (B*W) | cu_query_lens (B+1) | context_lens | mask offsets | mask widths (B each)
     | positions | slot_mapping (T each) | `stage`] followed by the bytes of the masks that are on
    the host: one copy to the device (none on the CPU), then one int32 cast of the kernel-facing
    part. `stage`: the caller's own integers, sent in the same copy (`meta.staged`, int64)."""
    device = torch.device(device)
    num_seqs = len(block_tables)
    masks = list(masks) if masks else [None] * num_seqs
    width = max(len(t) for t in block_tables)
    ints = []
    for t in block_tables:
        ints += t
        if len(t) < width:
            ints += [0] * (width - len(t))
    cu = [0]
    for q in query_lens:
        cu.append(cu[-1] + q)
    context_lens = [s + q for s, q in zip(starts, query_lens)]
    contiguous = []
    for t, ctx in zip(block_tables, context_lens):
        n = -(-ctx // block_size)
        contiguous.append(t[0] * block_size if n and t[n - 1] - t[0] == n - 1 and t[:n] == list(range(t[0], t[0] + n))
                          else None)
    widths = [0 if m is None else m.shape[1] for m in masks]
    offsets = [0]
    for q, w in zip(query_lens, widths):
        offsets.append(offsets[-1] + q * w)
    ints += cu
    ints += context_lens
    ints += offsets[:-1]
    ints += widths
    head = len(ints)                                           # the part cast to int32
    for s, q in zip(starts, query_lens):                       # positions
        ints += range(s, s + q)
    for t, s, q in zip(block_tables, starts, query_lens):      # slots: table[p // bs] * bs + p % bs,
        p, end = s, s + q                                       # one run per block touched
        while p < end:
            blk, off = divmod(p, block_size)
            n = min(block_size - off, end - p)
            ints += range(t[blk] * block_size + off, t[blk] * block_size + off + n)
            p += n
    num_tokens = cu[-1]
    staged_from = len(ints)
    if stage:
        ints += stage

    host_masks = [m for m in masks if m is not None and m.device.type == "cpu"]
    on_device = any(m is not None and m.device.type != "cpu" for m in masks)
    staged_mask_bytes = offsets[-1] if host_masks and not on_device else 0
    if device.type == "cpu":
        dev_ints = torch.from_numpy(np.fromiter(ints, dtype=np.int64, count=len(ints)))   # 4x torch.tensor's speed
        dev = None
    else:   # one pinned buffer: the ints, then the mask bytes; one non-blocking copy
        raw = torch.empty(8 * len(ints) + staged_mask_bytes, dtype=torch.uint8, pin_memory=True)
        raw[:8 * len(ints)].view(torch.int64).numpy()[:] = ints
        if staged_mask_bytes:
            _flat_masks(host_masks, "cpu", out=raw[8 * len(ints):])
        dev = raw.to(device, non_blocking=True)
        dev_ints = dev[:8 * len(ints)].view(torch.int64)
    small = dev_ints[:head].to(torch.int32)
    cu_t, ctx_t, moff_t, mw_t = small[num_seqs * width:].split([num_seqs + 1, num_seqs, num_seqs, num_seqs])
    positions, slot_mapping = dev_ints[head:staged_from].split([num_tokens, num_tokens])
    if staged_mask_bytes and dev is not None:
        mask_data = dev[8 * len(ints):]
    else:
        mask_data = _flat_masks([m.to(device) for m in masks if m is not None], device)

    meta = AttnMetadata(query_lens=list(query_lens), context_lens=context_lens, cu_query_lens=cu,
                        slot_mapping=slot_mapping, context_slots=None,
                        block_tables=small[:num_seqs * width].view(num_seqs, width), masks=masks,
                        block_size=block_size, contiguous_starts=contiguous, cu_query_lens_t=cu_t, context_lens_t=ctx_t, mask_offsets=moff_t,
                        mask_widths=mw_t, mask_data=mask_data, staged=dev_ints[staged_from:])
    return positions, meta


def gather_keys(cache: torch.Tensor, meta: AttnMetadata, slots) -> torch.Tensor:
    """Rows of `cache` [num_slots, Hkv, D] for a [B, L] slot grid, or for `(blocks [B, n], L)`: whole
    blocks copied at once (a few times faster on CPU than slot-by-slot indexing), cut to L."""
    if isinstance(slots, tuple):
        blocks, length = slots
        bs = meta.block_size
        grid = cache.view(-1, bs, *cache.shape[1:]).index_select(0, blocks.reshape(-1))
        return grid.view(blocks.shape[0], -1, *cache.shape[1:])[:, :length]
    return cache[slots]


def paged_attention_reference(
    q: torch.Tensor,        # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    meta: AttnMetadata,
    scale: float,
) -> torch.Tensor:          # [num_tokens, num_heads * head_dim]
    """Exact attention with SDPA: one call for the decode rows, one (rarely a few) for everything
    else (see the module docstring). Grouped-query heads are folded into the query-row dimension."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv = k_cache.shape[1]
    group = num_heads // num_kv
    if meta.num_seqs == 1 and meta.contiguous_starts and meta.contiguous_starts[0] is not None:
        return _attend_in_place(q, k_cache, v_cache, meta, scale)
    batches = meta.other_batch(group, q.device, q.dtype) if meta.other_idx else []
    if len(batches) == 1 and batches[0][3] is None:   # the whole step, in order, nothing padded
        return _attend_padded(q, k_cache, v_cache, meta, scale, batches[0]).reshape(num_tokens, num_heads * head_dim)
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
    for batch in batches:
        o = _attend_padded(q, k_cache, v_cache, meta, scale, batch)
        dest, real = batch[3:]
        out.index_copy_(0, dest, o if real is None else o.index_select(0, real))

    if meta.decode_idx:
        rows, slots, pad_mask = meta.decode_batch(q.device)
        bd = rows.shape[0]
        qd = q.index_select(0, rows).view(bd, num_kv, group, head_dim)            # [Bd, Hkv, G, D]
        kd = gather_keys(k_cache, meta, slots).to(q.dtype).transpose(1, 2)       # [Bd, Hkv, L, D]
        vd = gather_keys(v_cache, meta, slots).to(q.dtype).transpose(1, 2)
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=pad_mask, scale=scale)
        out.index_copy_(0, rows, od.reshape(bd, num_heads, head_dim))
    return out.view(num_tokens, num_heads * head_dim)


def _attend_in_place(q, k_cache, v_cache, meta: AttnMetadata, scale: float) -> torch.Tensor:
    """One sequence whose context is the cache rows start .. start + ctx - 1: SDPA over views of
    the cache (no gather), its visibility the padded batches' (`other_batch`) when it has new
    tokens past a decode row's one."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv = k_cache.shape[1]
    group = num_heads // num_kv
    start, ctx = meta.contiguous_starts[0], meta.context_lens[0]
    k = k_cache[start:start + ctx].to(q.dtype).unsqueeze(0).transpose(1, 2)      # [1, Hkv, ctx, D]
    v = v_cache[start:start + ctx].to(q.dtype).unsqueeze(0).transpose(1, 2)
    vis = meta.other_batch(group, q.device, q.dtype)[0][2] if meta.other_idx else None   # [1, 1, G*T, ctx]
    qo = q.view(num_tokens, num_kv, group, head_dim).permute(1, 2, 0, 3).reshape(1, num_kv, group * num_tokens,
                                                                                  head_dim)
    o = F.scaled_dot_product_attention(qo, k, v, attn_mask=vis, scale=scale)    # [1, Hkv, G*T, D]
    return o.view(num_kv, group, num_tokens, head_dim).permute(2, 0, 1, 3).reshape(num_tokens, num_heads * head_dim)


def _attend_padded(q, k_cache, v_cache, meta: AttnMetadata, scale: float, batch: tuple) -> torch.Tensor:
    """One padded batch of `AttnMetadata.other_batch` in one SDPA -> its output [B' * q_max, H, D]."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv = k_cache.shape[1]
    group = num_heads // num_kv
    rows, slots, vis = batch[:3]
    n, q_max = vis.shape[0], vis.shape[2] // group
    qo = q.view(n, q_max, num_heads, head_dim) if rows is None else q[rows]        # [B', q_max, H, D]
    qo = qo.view(n, q_max, num_kv, group, head_dim).permute(0, 2, 3, 1, 4).reshape(n, num_kv, group * q_max, head_dim)
    ko = gather_keys(k_cache, meta, slots).to(q.dtype).transpose(1, 2)           # [B', Hkv, ctx_max, D]
    vo = gather_keys(v_cache, meta, slots).to(q.dtype).transpose(1, 2)
    o = F.scaled_dot_product_attention(qo, ko, vo, attn_mask=vis, scale=scale)   # [B', Hkv, G*q_max, D]
    o = o.view(n, num_kv, group, q_max, head_dim).permute(0, 3, 1, 2, 4)         # [B', q_max, Hkv, G, D]
    return o.reshape(n * q_max, num_heads, head_dim)


# ---- the per-sequence oracle (the reference before it was batched; tests compare against it) ----

def _full_mask(mask: torch.Tensor | None, q_len: int, ctx_len: int, device) -> torch.Tensor:
    """[q, ctx] visibility: keys before the masked tail are visible to all rows."""
    if mask is None:
        mask = torch.ones(q_len, q_len, dtype=torch.bool, device=device).tril_()
    prefix = ctx_len - mask.shape[1]
    full = torch.ones(q_len, ctx_len, dtype=torch.bool, device=device)
    full[:, prefix:] = mask
    return full


def _paged_attention_loop(q, k_cache, v_cache, meta: AttnMetadata, scale: float) -> torch.Tensor:
    """One SDPA per sequence over its own keys: slow, obviously right."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv = k_cache.shape[1]
    group = num_heads // num_kv
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
    for b in range(meta.num_seqs):
        start, q_len, ctx = meta.cu_query_lens[b], meta.query_lens[b], meta.context_lens[b]
        qs = q[start:start + q_len].view(q_len, num_kv, group, head_dim).permute(1, 2, 0, 3)
        qs = qs.reshape(num_kv, group * q_len, head_dim)                         # [Hkv, G*q, D]
        ks = gather_keys(k_cache, meta, meta._key_slots([b], ctx))[0].to(q.dtype).transpose(0, 1)   # [Hkv, ctx, D]
        vs = gather_keys(v_cache, meta, meta._key_slots([b], ctx))[0].to(q.dtype).transpose(0, 1)
        mask = _full_mask(meta.masks[b], q_len, ctx, q.device)
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask.repeat(group, 1), scale=scale)
        out[start:start + q_len] = o.view(num_kv, group, q_len, head_dim).permute(2, 0, 1, 3).reshape(
            q_len, num_heads, head_dim)
    return out.view(num_tokens, num_heads * head_dim)


# ---- dispatch ----

_BACKENDS = ("reference", "triton")
_triton_attention = None   # kernels.tree_attention.tree_attention once imported; False if triton is missing


def _load_triton():
    global _triton_attention
    if _triton_attention is None:
        try:
            from specserve.kernels.tree_attention import tree_attention
            _triton_attention = tree_attention
        except ImportError:
            _triton_attention = False
    return _triton_attention


def triton_available() -> bool:
    """Whether the Triton kernel imports (the backend CUDA graphs capture)."""
    return bool(_load_triton())


def attention_backend(device: torch.device) -> str:
    """"triton" on CUDA when triton imports, else "reference"; `SPECSERVE_ATTENTION=reference|triton`
    forces one (triton on CPU tensors needs TRITON_INTERPRET=1, set before triton is imported)."""
    forced = os.environ.get("SPECSERVE_ATTENTION")
    if forced:
        if forced not in _BACKENDS:
            raise ValueError(f"SPECSERVE_ATTENTION must be one of {_BACKENDS}, got {forced!r}")
        if forced == "triton" and not _load_triton():
            raise RuntimeError("SPECSERVE_ATTENTION=triton but triton is not installed")
        return forced
    return "triton" if device.type == "cuda" and _load_triton() else "reference"


def paged_attention(
    q: torch.Tensor,        # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    meta: AttnMetadata,
    scale: float,
) -> torch.Tensor:          # [num_tokens, num_heads * head_dim]
    """Attention of one step's ragged batch over the paged KV: the Triton kernel (one launch) or
    the torch reference, as `attention_backend` picks."""
    if meta._backend is None:
        meta._backend = attention_backend(q.device)
    if meta._backend == "triton":
        return _triton_attention(q, k_cache, v_cache, meta.packed(), scale)
    return paged_attention_reference(q, k_cache, v_cache, meta, scale)
