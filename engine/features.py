"""The engine-owned feature store: the target's hidden states of every position in its KV cache,
per sequence, for the drafters that read them (Medusa, EAGLE-style, ParallelSpec, ...).

A feature is the target's last-layer hidden state after the final norm (the LM head's input). The
store follows the target's KV: every step that writes KV for a sequence (prefill chunk, plain
decode, verification) writes that step's features at the same positions, and a write at position
`start` drops every feature at or after `start` first. So after a verification (the root and the
accepted path enter the KV at `start..`; rejected tree nodes never do) the store holds exactly the
committed positions, and a preempted sequence, recomputed from position 0, starts over. The bonus
token has no feature until the next step computes its KV.

**Intermediate layers** (EAGLE-3 / HASS fuse low, mid and high features): a store made with
`capture_layers` (indices as `LlamaModel.forward` numbers them: k = the residual stream after k
decoder layers, 0 the embeddings) also keeps, for each position, the target's hidden states at
those layers, in one [capacity, len(capture_layers), hidden] buffer per sequence beside the
last-layer one. Every write then carries both (`write(seq_id, start, hidden, layers=...)`) and
they share one length, so truncation, rollback after verification, preemption and `free` treat
them alike. Read them with `view(seq_id, lo, hi, layer=k)` ([n, hidden], one captured layer) or
`layers_view(seq_id, lo, hi)` ([n, len(capture_layers), hidden]; `.flatten(1)` is EAGLE-3's
concatenated [n, len * hidden] input, still a view). The engine sets `capture_layers` once at
start-up to the union (sorted) of what its feature-reading drafters declare; a store without
capture layers keeps nothing extra.

Drafters get views (`view`, `last`, `layers_view`), not copies: a view is valid until the next
write for that sequence (a write may move the buffer when it grows).
"""

from __future__ import annotations

from typing import Iterable

import torch


class FeatureStore:
    """Per-sequence growable [capacity, hidden] buffers of features (one dtype, one device), plus
    [capacity, len(capture_layers), hidden] buffers of intermediate layers when asked for."""

    def __init__(self, hidden_size: int, dtype: torch.dtype, device: torch.device | str = "cpu",
                 capture_layers: Iterable[int] = ()):
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.device = torch.device(device)
        self._buf: dict[int, torch.Tensor] = {}
        self._layers: dict[int, torch.Tensor] = {}
        self._len: dict[int, int] = {}
        self.capture_layers: tuple[int, ...] = ()
        self.set_capture_layers(capture_layers)

    def set_capture_layers(self, layers: Iterable[int]) -> None:
        """The intermediate layers kept from now on (sorted, each once); only while no sequence
        has features (the engine sets them at start-up)."""
        layers = tuple(sorted({int(k) for k in layers}))
        if layers != self.capture_layers and self._len:
            raise RuntimeError("capture layers can only change while the store is empty")
        self.capture_layers = layers

    def __len__(self) -> int:
        """Sequences with features held."""
        return len(self._len)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._len

    def length(self, seq_id: int) -> int:
        """Positions 0..length-1 of `seq_id` have features (0 for an unknown sequence)."""
        return self._len.get(seq_id, 0)

    def write(self, seq_id: int, start: int, hidden: torch.Tensor, layers: torch.Tensor | None = None) -> None:
        """Features of positions start..start+n-1 (`hidden` [n, hidden]; with capture layers also
        `layers` [n, len(capture_layers), hidden], required then and refused otherwise); everything
        at or after `start` is dropped first. A `start` past the current length leaves a gap, which
        is refused (the features in between never came)."""
        dst, src = self._place(seq_id, start, hidden, layers)
        for d, x in zip(dst, src):
            d.copy_(x)
        self._len[seq_id] = start + hidden.shape[0]

    def write_many(self, items: Iterable[tuple[int, int, torch.Tensor, torch.Tensor | None]]) -> list[int]:
        """`write` of several sequences, (seq_id, start, hidden, layers) each, as one multi-tensor copy
        (one launch on CUDA, not one per sequence). Returns the sequences refused (a gap: see `write`),
        which are left as they were; the others are written."""
        dst: list[torch.Tensor] = []
        src: list[torch.Tensor] = []
        refused, ends = [], {}
        for seq_id, start, hidden, layers in items:
            try:
                d, x = self._place(seq_id, start, hidden, layers)
            except ValueError:
                refused.append(seq_id)
                continue
            dst += d
            src += x
            ends[seq_id] = start + hidden.shape[0]
        if dst:
            torch._foreach_copy_(dst, src)
        self._len.update(ends)
        return refused

    def _place(self, seq_id: int, start: int, hidden: torch.Tensor,
               layers: torch.Tensor | None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Check a write and make room for it: (destinations, sources) of its copies."""
        have = self._len.get(seq_id, 0)
        if start > have:
            raise ValueError(f"features of sequence {seq_id} jump from {have} to {start}")
        n = hidden.shape[0]
        k = len(self.capture_layers)
        if k:
            if layers is None or tuple(layers.shape) != (n, k, self.hidden_size):
                got = None if layers is None else tuple(layers.shape)
                raise ValueError(f"the store keeps layers {self.capture_layers}: a write needs them as "
                                 f"[{n}, {k}, {self.hidden_size}], got {got}")
        elif layers is not None:
            raise ValueError("this store keeps no intermediate layers")
        end = start + n
        buf = self._buf.get(seq_id)
        if buf is None or buf.shape[0] < end:
            size = max(end, 2 * (0 if buf is None else buf.shape[0]), 64)
            buf = self._buf[seq_id] = self._grow(buf, (size, self.hidden_size), start)
            if k:
                self._layers[seq_id] = self._grow(self._layers.get(seq_id), (size, k, self.hidden_size), start)
        if not k:
            return [buf[start:end]], [hidden.detach()]
        return [buf[start:end], self._layers[seq_id][start:end]], [hidden.detach(), layers.detach()]

    def _grow(self, old: torch.Tensor | None, shape: tuple[int, ...], keep: int) -> torch.Tensor:
        grown = torch.empty(shape, dtype=self.dtype, device=self.device)
        if old is not None and keep:
            grown[:keep].copy_(old[:keep])
        return grown

    def view(self, seq_id: int, lo: int = 0, hi: int | None = None, layer: int | None = None) -> torch.Tensor | None:
        """Features of positions lo..hi-1 (default: up to the length) as a view, or None when
        some are missing: the last-layer ones, or with `layer` those of that captured layer
        (KeyError for a layer the store does not keep)."""
        n = self._len.get(seq_id, 0)
        hi = n if hi is None else hi
        if layer is not None and layer not in self.capture_layers:
            raise KeyError(f"layer {layer} is not captured (capture layers: {self.capture_layers})")
        if lo < 0 or hi > n or lo > hi or seq_id not in self._buf:
            return None
        if layer is None:
            return self._buf[seq_id][lo:hi]
        return self._layers[seq_id][lo:hi, self.capture_layers.index(layer)]

    def layers_view(self, seq_id: int, lo: int = 0, hi: int | None = None) -> torch.Tensor | None:
        """All captured layers of positions lo..hi-1 as a [n, len(capture_layers), hidden] view
        (layers in `capture_layers` order), or None when some positions are missing or the store
        captures no layers."""
        n = self._len.get(seq_id, 0)
        hi = n if hi is None else hi
        if not self.capture_layers or lo < 0 or hi > n or lo > hi or seq_id not in self._layers:
            return None
        return self._layers[seq_id][lo:hi]

    def last(self, seq_id: int) -> tuple[int, torch.Tensor] | None:
        """(position, feature) of the last position with a feature, or None."""
        n = self._len.get(seq_id, 0)
        return (n - 1, self._buf[seq_id][n - 1]) if n else None

    def truncate(self, seq_id: int, length: int) -> None:
        if seq_id in self._len:
            self._len[seq_id] = min(self._len[seq_id], max(0, length))

    def free(self, seq_id: int) -> None:
        self._buf.pop(seq_id, None)
        self._layers.pop(seq_id, None)
        self._len.pop(seq_id, None)
