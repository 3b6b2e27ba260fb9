"""Paged KV cache: a pool of fixed-size blocks (`BlockManager`, pure Python) and the tensors
that hold them (`KVCache`, one [2, layers, slots, kv_heads, head_dim] tensor so that a move of
rows touches every layer in one op).

Token position p of a sequence lives in slot `block_table[p // block_size] * block_size +
p % block_size`.
"""

from __future__ import annotations

import numpy as np
import torch

from specserve.engine.attention import build_attn_metadata
from specserve.kernels.kv_compact import compact_kv


class BlockManager:
    """Block allocation per sequence. Query-then-mutate: `blocks_needed`/`can_grow` never change
    state; `grow` either allocates everything asked for or nothing."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self.block_tables: dict[int, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of the pool in use (0..1)."""
        return 1.0 - len(self._free) / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def blocks_needed(self, seq_id: int, num_tokens: int) -> int:
        """Extra blocks `seq_id` needs to hold `num_tokens` tokens."""
        have = len(self.block_tables.get(seq_id, ()))
        return max(0, self.blocks_for(num_tokens) - have)

    def can_grow(self, seq_id: int, num_tokens: int) -> bool:
        return self.blocks_needed(seq_id, num_tokens) <= len(self._free)

    def grow(self, seq_id: int, num_tokens: int) -> bool:
        """Make room for `num_tokens` tokens in total; False (and nothing allocated) if the pool is short."""
        need = self.blocks_needed(seq_id, num_tokens)
        if need > len(self._free):
            return False
        table = self.block_tables.setdefault(seq_id, [])
        for _ in range(need):
            table.append(self._free.pop())
        return True

    def shrink(self, seq_id: int, num_tokens: int) -> None:
        """Keep only the blocks covering the first `num_tokens` tokens; the rest return to the pool."""
        table = self.block_tables.get(seq_id)
        if table is None:
            return
        keep = self.blocks_for(num_tokens)
        while len(table) > keep:
            self._free.append(table.pop())

    def free(self, seq_id: int) -> None:
        for block in reversed(self.block_tables.pop(seq_id, [])):
            self._free.append(block)

    def slot(self, seq_id: int, position: int) -> int:
        table = self.block_tables[seq_id]
        return table[position // self.block_size] * self.block_size + position % self.block_size

    def slots(self, seq_id: int, start: int, end: int) -> list[int]:
        table, bs = self.block_tables[seq_id], self.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, end)]


class KVCache:
    """The key/value tensors of every layer, addressed by slot."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        self.block_size = block_size
        shape = (2, num_layers, num_blocks * block_size, num_kv_heads, head_dim)
        numpy_dtype = {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16}.get(dtype)
        if torch.device(device).type == "cpu" and numpy_dtype is not None:
            # calloc'd (numpy): the OS hands out zero pages as they are first written, so the pool
            # holds memory for the blocks in use, not for its whole size (torch.zeros writes it all)
            self.kv = torch.from_numpy(np.zeros(shape, dtype=numpy_dtype))
        else:
            self.kv = torch.zeros(shape, dtype=dtype, device=device)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_cache, v_cache) of layer i, each [num_slots, num_kv_heads, head_dim] (views)."""
        return self.kv[0, i], self.kv[1, i]

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8


def activation_reserve_bytes(num_tokens: int, hidden_size: int, intermediate_size: int, vocab_size: int) -> int:
    """A generous bound on the activations of a step of `num_tokens` tokens, in fp32: the logits,
    the MLP's gate/up/down intermediates and a few hidden-size buffers per token, doubled for the
    allocator's fragmentation and the sampler's copies of the logits."""
    per_token = vocab_size + 3 * intermediate_size + 8 * hidden_size
    return 2 * 4 * num_tokens * per_token


def kv_pool_bytes(total: int, utilization: float, used: int, reserve: int) -> int:
    """The KV pool's memory under vLLM's `--gpu-memory-utilization`: the share `utilization` of the
    device's `total` bytes, less what the engine already holds (`used`: weights, drafters) and the
    step's activations (`reserve`); a ValueError saying what to change when nothing is left."""
    budget = int(utilization * total)
    left = budget - used - reserve
    if left <= 0:
        raise ValueError(f"--gpu-memory-utilization {utilization} allows {budget / 2**30:.2f} GiB of "
                         f"{total / 2**30:.2f} GiB, but the weights and drafters hold {used / 2**30:.2f} GiB and a "
                         f"step's activations need up to {reserve / 2**30:.2f} GiB: nothing is left for the KV "
                         f"cache; raise it, or lower --max-num-batched-tokens")
    return left


def commit_accepted(
    blocks: BlockManager,
    cache: KVCache,
    seq_ids: list[int],
    prefix_lens: list[int],
    accepted: list[list[int]],
) -> list[int]:
    """Prune draft trees to their accepted paths, for a whole batch in one tensor op.

    Sequence b wrote its draft-tree nodes to positions `prefix_lens[b] + node` (node 0 = first
    node after the prefix). `accepted[b]` lists the accepted nodes in path order (increasing
    indices, since trees are topologically ordered). Their entries move to positions
    `prefix_lens[b] + 0, 1, ...`; the sequence keeps `prefix_lens[b] + len(accepted[b])` tokens
    and every block past that returns to the pool.

    Example: prefix 5, tree nodes at positions 5..9, accepted nodes [0, 2, 4]: positions 5, 7, 9
    move to 5, 6, 7 and the sequence length becomes 8.

    Returns the new lengths.
    """
    src: list[int] = []
    dst: list[int] = []
    new_lens = []
    for seq_id, prefix, path in zip(seq_ids, prefix_lens, accepted):
        for i, node in enumerate(path):
            if node != i:
                src.append(blocks.slot(seq_id, prefix + node))
                dst.append(blocks.slot(seq_id, prefix + i))
        new_lens.append(prefix + len(path))
    if src:
        device = cache.kv.device
        compact_kv(cache.kv, torch.tensor(src, device=device), torch.tensor(dst, device=device))
    for seq_id, n in zip(seq_ids, new_lens):
        blocks.shrink(seq_id, n)
    return new_lens


class PagedDraftKV:
    """A drafter's own paged KV pool (draft models, EAGLE-style heads, ParallelSpec): a
    `BlockManager` and a `KVCache` sized for `max_num_seqs` contexts of `max_model_len` tokens plus
    `extra_tokens` (tree rows a draft step writes past the context), with the per-sequence
    operations drafters need: grow before a forward, shrink to a kept length, commit an accepted
    path (`commit_accepted`), free on finish, and the attention metadata of a forward.

    `blocks` and `cache` are public: a drafter's model reads `cache` and tests inspect slots."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device,
                 *, max_model_len: int, max_num_seqs: int, extra_tokens: int = 0, block_size: int = 16,
                 num_blocks: int | None = None):
        self.device = torch.device(device)
        self.blocks_per_seq = -(-(max_model_len + extra_tokens) // block_size)   # a block table's most entries
        num_blocks = num_blocks or self.blocks_per_seq * max_num_seqs
        self.blocks = BlockManager(num_blocks, block_size)
        self.cache = KVCache(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, self.device)

    @property
    def block_size(self) -> int:
        return self.blocks.block_size

    def grow(self, seq_id: int, num_tokens: int) -> bool:
        """Room for `num_tokens` tokens of `seq_id`; False (nothing allocated) when the pool is short."""
        return self.blocks.grow(seq_id, num_tokens)

    def shrink(self, seq_id: int, num_tokens: int) -> None:
        self.blocks.shrink(seq_id, num_tokens)

    def free(self, seq_id: int) -> None:
        self.blocks.free(seq_id)

    def metadata(self, seq_ids: list[int], starts: list[int], query_lens: list[int],
                 masks: list[torch.Tensor | None] | None = None):
        """(positions, AttnMetadata) of a forward writing `query_lens[b]` tokens of `seq_ids[b]` at
        cache positions `starts[b]..`; `masks[b]` (see tree.ancestor_mask) for tree rows, None for
        a causal chunk."""
        tables = [self.blocks.block_tables[s] for s in seq_ids]
        return build_attn_metadata(tables, self.blocks.block_size, starts, query_lens,
                                   [None if m is None else m.to(self.device) for m in masks] if masks else None,
                                   self.device)

    def commit(self, seq_ids: list[int], prefix_lens: list[int], paths: list[list[int]]) -> list[int]:
        """Keep, per sequence, the nodes `paths[b]` written at `prefix_lens[b] + node`, moved right
        after the prefix; returns the new lengths (see `commit_accepted`)."""
        return commit_accepted(self.blocks, self.cache, seq_ids, prefix_lens, paths)
