"""The engine-owned feature store: the target's hidden states of every position in its KV cache,
per sequence, for the drafters that read them (Medusa, EAGLE-style, ParallelSpec, ...).

A feature is the target's last-layer hidden state after the final norm (the LM head's input). The
store follows the target's KV: every step that writes KV for a sequence (prefill chunk, plain
decode, verification) writes that step's features at the same positions, and a write at position
`start` drops every feature at or after `start` first. So after a verification (the root and the
accepted path enter the KV at `start..`; rejected tree nodes never do) the store holds exactly the
committed positions, and a preempted sequence, recomputed from position 0, starts over. The bonus
token has no feature until the next step computes its KV.

Drafters get views (`view`, `last`), not copies: a view is valid until the next write for that
sequence (a write may move the buffer when it grows).
"""

from __future__ import annotations

import torch


class FeatureStore:
    """Per-sequence growable [capacity, hidden] buffers of features (one dtype, one device)."""

    def __init__(self, hidden_size: int, dtype: torch.dtype, device: torch.device | str = "cpu"):
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.device = torch.device(device)
        self._buf: dict[int, torch.Tensor] = {}
        self._len: dict[int, int] = {}

    def __len__(self) -> int:
        """Sequences with features held."""
        return len(self._len)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._len

    def length(self, seq_id: int) -> int:
        """Positions 0..length-1 of `seq_id` have features (0 for an unknown sequence)."""
        return self._len.get(seq_id, 0)

    def write(self, seq_id: int, start: int, hidden: torch.Tensor) -> None:
        """Features of positions start..start+n-1 (`hidden` [n, hidden]); everything at or after
        `start` is dropped first. A `start` past the current length leaves a gap, which is refused
        (the features in between never came)."""
        have = self._len.get(seq_id, 0)
        if start > have:
            raise ValueError(f"features of sequence {seq_id} jump from {have} to {start}")
        n = hidden.shape[0]
        end = start + n
        buf = self._buf.get(seq_id)
        if buf is None or buf.shape[0] < end:
            grown = torch.empty(max(end, 2 * (0 if buf is None else buf.shape[0]), 64), self.hidden_size,
                                dtype=self.dtype, device=self.device)
            if buf is not None and start:
                grown[:start].copy_(buf[:start])
            buf = self._buf[seq_id] = grown
        buf[start:end].copy_(hidden.detach())
        self._len[seq_id] = end

    def view(self, seq_id: int, lo: int = 0, hi: int | None = None) -> torch.Tensor | None:
        """Features of positions lo..hi-1 (default: up to the length) as a view, or None when
        some are missing."""
        n = self._len.get(seq_id, 0)
        hi = n if hi is None else hi
        if lo < 0 or hi > n or lo > hi:
            return None
        return self._buf[seq_id][lo:hi]

    def last(self, seq_id: int) -> tuple[int, torch.Tensor] | None:
        """(position, feature) of the last position with a feature, or None."""
        n = self._len.get(seq_id, 0)
        return (n - 1, self._buf[seq_id][n - 1]) if n else None

    def truncate(self, seq_id: int, length: int) -> None:
        if seq_id in self._len:
            self._len[seq_id] = min(self._len[seq_id], max(0, length))

    def free(self, seq_id: int) -> None:
        self._buf.pop(seq_id, None)
        self._len.pop(seq_id, None)
