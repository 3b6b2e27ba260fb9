"""CUDA graphs of the target's decode forward: one graph per batch-size bucket, captured at start-up.

A decode step (every sequence feeds one token, causally; no tree, no prefill chunk) is the same
kernels every time; only the values of its few integer inputs change. Each bucket B owns a graph of
`LlamaModel.forward` over B rows whose inputs live in static buffers: token ids, positions, cache
slots, context lengths and block tables (the Triton attention kernel reads nothing else; its
grid depends on B alone and its key loop on the context lengths it loads). A step of b ≤ B rows is
padded to the next bucket by `ModelRunner.prepare`, which repeats the last row (same token, same
position, same cache slot: the repeated rows write the same key and value to the same slot and
attend like the row they copy), so padding needs no scratch memory; its inputs arrive on the
device in the step's one staging copy, are copied into the static buffers (five small copies), and
the graph replays. The hidden states come back as [B, hidden], of which the first b rows are real.

Steps with a draft tree, a prefill chunk, more rows than the largest bucket, or captured
intermediate layers (EAGLE-3-style features) run eagerly. `--enforce-eager` (EngineConfig) turns
graphs off, as in vLLM.

The capture itself is behind a small protocol (`GraphBackend.capture(fn) -> replay`), so the
bookkeeping (buckets, padding, static buffers) is tested on the CPU through `EagerReplay`, which
runs the function again at each replay, reading the same static buffers; only `torch.cuda.graph`
is left to the GPU. Graph capture needs the Triton attention backend (the torch reference reads
host-side lists).
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Protocol

import torch

from specserve.engine.attention import AttnMetadata, triton_available

logger = logging.getLogger("specserve")

# batch-size buckets (vLLM's shape: powers of two to 8, then every 8); the largest is max_num_seqs
SMALL_BUCKETS = (1, 2, 4, 8)
BUCKET_STEP = 8


def batch_buckets(max_batch: int) -> list[int]:
    """The captured batch sizes for at most `max_batch` rows: 1, 2, 4, 8, 16, 24, ..., max_batch."""
    sizes = [b for b in SMALL_BUCKETS if b < max_batch]
    sizes += list(range(2 * BUCKET_STEP, max_batch, BUCKET_STEP))
    return sorted(set(sizes + [max_batch]))


class GraphBackend(Protocol):
    def capture(self, fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        """Record `fn` (which reads only static buffers); the result replays it and returns its output."""


class CudaGraphBackend:
    """`torch.cuda.CUDAGraph`s sharing one memory pool (captured largest first, as vLLM does)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.pool = None

    def capture(self, fn):
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):      # warm-up outside the graph (Triton compiles, allocator settles)
            fn()
            fn()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()
        if self.pool is None:
            self.pool = graph.pool()

        def replay() -> torch.Tensor:
            graph.replay()
            return out
        # the graph reads whatever `fn` closes over (static buffers, the bucket's metadata) at the
        # addresses of capture time: they must live as long as the graph, not be freed and reused
        replay.captured = fn
        return replay


class EagerReplay:
    """The CPU stand-in: capture runs `fn` once, replay runs it again over the same buffers."""

    def capture(self, fn):
        fn()
        return fn


class DecodeGraphs:
    """The captured decode forwards of one model over one KV cache (see the module docstring)."""

    def __init__(self, model, cache, block_size: int, max_batch: int, max_blocks_per_seq: int,
                 device: torch.device, backend: GraphBackend):
        self.model, self.cache, self.block_size, self.device = model, cache, block_size, device
        self.backend = backend
        if not triton_available():
            raise RuntimeError("CUDA graphs capture the Triton attention kernel, and triton is not installed")
        self.buckets = batch_buckets(max_batch)
        n = self.buckets[-1]
        i32, i64 = dict(dtype=torch.int32, device=device), dict(dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(n, **i64)
        self.positions = torch.zeros(n, **i64)
        self.slots = torch.zeros(n, **i64)
        self.context_lens = torch.ones(n, **i32)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, **i32)
        self.cu_query_lens = torch.arange(n + 1, **i32)      # one row per sequence, always
        self.zeros = torch.zeros(n, **i32)                   # mask offsets and widths: no masks
        self.mask_data = torch.zeros(1, dtype=torch.uint8, device=device)
        self.replays: dict[int, Callable[[], torch.Tensor]] = {}
        self.num_replays = 0

    def bucket(self, num_rows: int) -> int | None:
        """The smallest captured batch size holding `num_rows` rows (None: more than the largest)."""
        return next((b for b in self.buckets if b >= num_rows), None)

    def _meta(self, b: int) -> AttnMetadata:
        meta = AttnMetadata(
            query_lens=[1] * b, context_lens=[1] * b, cu_query_lens=list(range(b + 1)),
            slot_mapping=self.slots[:b], context_slots=self.slots[:b, None], block_tables=self.block_tables[:b],
            masks=[None] * b, block_size=self.block_size, cu_query_lens_t=self.cu_query_lens[:b + 1],
            context_lens_t=self.context_lens[:b], mask_offsets=self.zeros[:b], mask_widths=self.zeros[:b],
            mask_data=self.mask_data)
        meta._backend = "triton"
        return meta

    @torch.inference_mode()
    def capture(self) -> float:
        """Capture every bucket, largest first; returns the seconds it took."""
        t0 = time.perf_counter()
        for b in reversed(self.buckets):
            meta = self._meta(b)
            self.replays[b] = self.backend.capture(
                lambda b=b, meta=meta: self.model(self.input_ids[:b], self.positions[:b], self.cache, meta))
        seconds = time.perf_counter() - t0
        logger.info("captured decode graphs for batch sizes %s in %.1f s",
                    ", ".join(map(str, self.buckets)), seconds)
        return seconds

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttnMetadata) -> torch.Tensor:
        """The hidden states [B, hidden] of a decode step padded to bucket B = meta.num_seqs."""
        b = meta.num_seqs
        self.input_ids[:b].copy_(input_ids)
        self.positions[:b].copy_(positions)
        self.slots[:b].copy_(meta.slot_mapping)
        self.context_lens[:b].copy_(meta.context_lens_t)
        self.block_tables[:b, :meta.block_tables.shape[1]].copy_(meta.block_tables)
        self.num_replays += 1
        return self.replays[b]()
