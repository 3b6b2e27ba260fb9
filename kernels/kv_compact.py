"""KV compaction: move the accepted rows of draft trees to the slots right after each prefix.

`compact_kv_reference` is the torch reference (and the CPU path); a GPU kernel lands beside it and
must agree with it.
"""

from __future__ import annotations

import torch


def compact_kv_reference(
    kv: torch.Tensor,         # [2, num_layers, num_slots, num_kv_heads, head_dim]
    src_slots: torch.Tensor,  # [N] int64 slots holding accepted entries
    dst_slots: torch.Tensor,  # [N] int64 slots they move to
) -> None:
    """kv[:, :, dst] = kv[:, :, src] for all layers at once.

    The gather copies before the scatter writes, so overlapping source and destination sets (a
    node moving onto a slot another accepted node is read from) are safe. Pairs with src == dst
    are no-ops and may be left in.
    """
    if src_slots.numel() == 0:
        return
    kv[:, :, dst_slots] = kv[:, :, src_slots]


def compact_kv(kv: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
    """Dispatch: the torch reference everywhere for now."""
    assert src_slots.shape == dst_slots.shape and src_slots.dim() == 1
    compact_kv_reference(kv, src_slots, dst_slots)
