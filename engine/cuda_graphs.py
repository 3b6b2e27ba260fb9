"""CUDA graphs of the target's forward for decode and verification steps, captured at start-up.

A step whose every sequence feeds either one decode token or a draft tree (no prefill chunk) is the
same kernels every time for a given shape; only the values of a few integer inputs change. Each
bucket (B sequences, N rows per sequence) owns a graph of `LlamaModel.forward` over B * N rows
whose inputs live in static buffers: token ids, RoPE positions, cache slots, context lengths,
block tables and the tree masks (the Triton attention kernel reads nothing else; its grid depends
on (B, N) alone and its key loop on the context lengths it loads). N = 1 is plain decoding
(causal, no mask); N > 1 verifies trees of up to N nodes, every sequence with an [N, N] mask:

* a tree of s <= N nodes is padded by repeating its last node: same token, position and cache
  slot, and the same mask row, so the repeated rows write the same key and value to the same slot
  and attend exactly like the row they copy; mask columns s..N-1 are hidden from every row;
* a sequence without a tree this step is a 1-node tree (its decode token; mask column 0 only);
* the kernel sees context length = committed length + N, the mask covering the last N key
  positions (those past the tree's own nodes are hidden, whatever their slots hold);
* sequences b >= the step's count repeat its last sequence entirely.

So padding needs no scratch memory. A **prefill chunk of one sequence alone** (a request's prompt
when nothing else runs: batch 1) is a chain: it replays a (1, N) graph of the chain sizes
(CHAIN_BUCKETS, beyond the node buckets, up to the step's token budget), padded the same way, with
the causal mask of its n rows made on the device (row i sees rows 0..min(i, n-1)) instead of
shipped from the host. So a lone prompt's prefill is one replay, not hundreds of eager launches.

`ModelRunner.prepare` builds the step as usual (the ragged
layout every other part of the step reads) plus a `GraphPlan`: for each padded row its row in the
ragged layout (`gather`), for each padded sequence its batch entry, the context lengths, the mask
bytes and, for each ragged row, its padded row (`scatter`); all of it rides the step's one staged
upload. `forward` fills the static buffers with a few gathers, replays, and returns the hidden
states in the ragged layout. Steps with a prefill chunk, more sequences than the largest bucket,
or a tree larger than the largest node bucket run eagerly. The intermediate layers feature-reading
drafters need (EAGLE-3's) are written by every graph when any loaded drafter reads them, so such a
drafter's steps replay too. `--enforce-eager` (EngineConfig) turns graphs off, as in vLLM.

The capture itself is behind a small protocol (`GraphBackend.capture(fn) -> replay`), so the
bookkeeping (buckets, padding, static buffers) is tested on the CPU through `EagerReplay`, which
runs the function again at each replay over the same static buffers; only `torch.cuda.graph` is
left to the GPU. Graphs capture the Triton attention kernel (the torch reference reads host lists).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Callable, Protocol

import numpy as np
import torch

from specserve.engine.attention import AttnMetadata, triton_available

logger = logging.getLogger("specserve")

# batch-size buckets (vLLM's shape: powers of two to 8, then every 8); the largest is max_num_seqs
SMALL_BUCKETS = (1, 2, 4, 8)
BUCKET_STEP = 8
NODE_BUCKETS = (2, 4, 8)       # rows per sequence of verification graphs, then the largest tree
CHAIN_BUCKETS = (16, 32, 64, 128, 256, 512)   # rows of a lone prefill chunk (batch 1), up to the step budget
# SPECSERVE_GRAPH_TREES=0 captures the decode buckets only (N = 1); verification steps then run eagerly
TREES = os.environ.get("SPECSERVE_GRAPH_TREES") != "0"


def batch_buckets(max_batch: int) -> list[int]:
    """The captured batch sizes for at most `max_batch` sequences: 1, 2, 4, 8, 16, 24, ..., max_batch."""
    sizes = [b for b in SMALL_BUCKETS if b < max_batch]
    sizes += list(range(2 * BUCKET_STEP, max_batch, BUCKET_STEP))
    return sorted(set(sizes + [max_batch]))


def node_buckets(max_nodes: int) -> list[int]:
    """Rows per sequence: 1 (decode) and 2, 4, 8, ..., max_nodes (trees of up to that many nodes)."""
    return sorted({1, *(n for n in NODE_BUCKETS if n < max_nodes), max(1, max_nodes)})


def chain_buckets(max_nodes: int, max_chunk: int) -> list[int]:
    """Rows of the batch-1 chain graphs: CHAIN_BUCKETS above the largest node bucket, at most
    `max_chunk` (the step's token budget)."""
    return [n for n in CHAIN_BUCKETS if max_nodes < n <= max_chunk]


def chain_mask(N: int, n: int, device: torch.device, out: torch.Tensor) -> None:
    """`out[:N * N]` = the [N, N] mask of a chain of n rows padded to N: row i sees rows
    0..min(i, n-1) (the padding rows repeat the last row's), as 0/1 bytes, made on the device."""
    i = torch.arange(N, device=device)
    torch.le(i[None, :], i.clamp(max=n - 1)[:, None], out=out[:N * N].view(N, N).view(torch.bool))


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


@dataclass
class GraphPlan:
    """How one step maps onto the padded bucket (B, N) (see the module docstring): host lists,
    uploaded with the step's other integers, then device tensors (`ModelRunner.prepare`)."""

    B: int
    N: int
    gather: list[int]         # [B * N] ragged row of each padded row
    seqs: list[int]           # [B] batch entry of each padded sequence
    context_lens: list[int]   # [B] committed length + N (decode graphs, N = 1: committed length + 1)
    scatter: list[int]        # [num ragged rows] padded row of each ragged row
    mask: list[int]           # [B * N * N] 0/1 (empty for N = 1, and for a chain)
    chain: int = 0            # a lone prefill chunk of this many rows (B = 1): its mask is made on the device

    def sizes(self) -> list[int]:
        return [len(self.gather), len(self.seqs), len(self.context_lens), len(self.scatter), len(self.mask)]


class StepGraphs:
    """The captured forwards of one model over one KV cache, for every (batch, nodes) bucket."""

    def __init__(self, model, cache, block_size: int, max_batch: int, max_nodes: int, max_blocks_per_seq: int,
                 device: torch.device, backend: GraphBackend, capture_layers: tuple[int, ...] = (),
                 max_chunk: int = 0):
        self.model, self.cache, self.block_size, self.device = model, cache, block_size, device
        self.backend = backend
        # intermediate layers the drafters read (EAGLE-3's features): every graph writes them too,
        # so a step with a feature-reading drafter replays like any other
        self.capture_layers = tuple(capture_layers)
        if not triton_available():
            raise RuntimeError("CUDA graphs capture the Triton attention kernel, and triton is not installed")
        self.batch_sizes = batch_buckets(max_batch)
        self.node_sizes = node_buckets(max_nodes if TREES else 1)
        self.chain_sizes = chain_buckets(self.node_sizes[-1], max_chunk) if TREES else []   # batch 1 only
        B, N = self.batch_sizes[-1], self.node_sizes[-1]
        rows = max(B * N, *self.chain_sizes, 1)
        i32, i64 = dict(dtype=torch.int32, device=device), dict(dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(rows, **i64)
        self.positions = torch.zeros(rows, **i64)
        self.slots = torch.zeros(rows, **i64)
        self.context_lens = torch.full((B,), N, **i32)
        self.block_tables = torch.zeros(B, max_blocks_per_seq, **i32)
        self.mask_data = torch.zeros(max(1, B * N * N, *(n * n for n in self.chain_sizes)), dtype=torch.uint8,
                                     device=device)
        self.replays: dict[tuple[int, int], Callable[[], torch.Tensor]] = {}
        self.metas: dict[tuple[int, int], AttnMetadata] = {}   # each graph's metadata, alive as long as it
        self.num_replays: dict[tuple[int, int], int] = {}   # per bucket, replays so far

    @property
    def buckets(self) -> list[tuple[int, int]]:
        return [(b, n) for n in self.node_sizes for b in self.batch_sizes] + [(1, n) for n in self.chain_sizes]

    def bucket(self, num_seqs: int, max_nodes: int) -> tuple[int, int] | None:
        """The smallest captured (B, N) holding `num_seqs` sequences of at most `max_nodes` rows each."""
        b = next((x for x in self.batch_sizes if x >= num_seqs), None)
        n = next((x for x in self.node_sizes if x >= max_nodes), None)
        return None if b is None or n is None else (b, n)

    def chain_bucket(self, rows: int) -> tuple[int, int] | None:
        """The (1, N) bucket of a lone prefill chunk of `rows` rows (a tree bucket where one holds it)."""
        n = next((x for x in (*self.node_sizes[1:], *self.chain_sizes) if x >= rows), None)
        return None if n is None or rows < 2 else (1, n)

    def _meta(self, B: int, N: int) -> AttnMetadata:
        i32 = dict(dtype=torch.int32, device=self.device)
        widths = torch.full((B,), N if N > 1 else 0, **i32)
        placeholder = torch.ones(N, N, dtype=torch.bool) if N > 1 else None   # host lists: shapes only
        meta = AttnMetadata(
            query_lens=[N] * B, context_lens=[N] * B, cu_query_lens=list(range(0, B * N + 1, N)),
            slot_mapping=self.slots[:B * N], context_slots=self.slots[:B * N, None],
            block_tables=self.block_tables[:B], masks=[placeholder] * B, block_size=self.block_size,
            cu_query_lens_t=torch.arange(0, B * N + 1, N, **i32), context_lens_t=self.context_lens[:B],
            mask_offsets=torch.arange(0, B * N * N, N * N, **i32), mask_widths=widths,
            mask_data=self.mask_data)
        meta._backend = "triton"
        return meta

    @torch.inference_mode()
    def capture(self) -> float:
        """Capture every bucket, largest first; returns the seconds it took."""
        t0 = time.perf_counter()
        for B, N in sorted(self.buckets, key=lambda bn: -bn[0] * bn[1]):
            meta = self.metas[(B, N)] = self._meta(B, N)
            self.replays[(B, N)] = self.backend.capture(
                lambda B=B, N=N, meta=meta: self.model(self.input_ids[:B * N], self.positions[:B * N], self.cache, meta,
                                                       self.capture_layers))
        seconds = time.perf_counter() - t0
        logger.info("captured %d step graphs (batch sizes %s; rows per sequence %s) in %.1f s", len(self.replays),
                    ", ".join(map(str, self.batch_sizes)), ", ".join(map(str, self.node_sizes)), seconds)
        return seconds

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttnMetadata, plan: GraphPlan,
                tensors: list[torch.Tensor], want_layers: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(hidden states [num ragged rows, hidden], the captured layers [rows, len(capture_layers),
        hidden] when `want_layers`, else None) of a step, through the graph of its bucket.
        `tensors`: the plan's lists on the device (`GraphPlan.sizes` order)."""
        B, N = plan.B, plan.N
        gather, seqs, context_lens, scatter, mask = tensors
        rows = B * N
        torch.index_select(input_ids, 0, gather, out=self.input_ids[:rows])
        torch.index_select(positions, 0, gather, out=self.positions[:rows])
        torch.index_select(meta.slot_mapping, 0, gather, out=self.slots[:rows])
        self.context_lens[:B].copy_(context_lens)
        self.block_tables[:B, :meta.block_tables.shape[1]].copy_(meta.block_tables.index_select(0, seqs))
        if plan.chain:
            chain_mask(N, plan.chain, self.device, self.mask_data)
        elif N > 1:
            self.mask_data[:rows * N].copy_(mask)
        self.num_replays[(B, N)] = self.num_replays.get((B, N), 0) + 1
        out = self.replays[(B, N)]()
        if not self.capture_layers:
            return out.index_select(0, scatter), None
        hidden, layers = out
        return hidden.index_select(0, scatter), layers.index_select(0, scatter) if want_layers else None


def make_chain_plan(N: int, start: int, rows: int) -> GraphPlan:
    """The plan of a lone prefill chunk of `rows` rows from position `start`, padded to (1, N)."""
    return GraphPlan(1, N, [min(r, rows - 1) for r in range(N)], [0], [start + N], list(range(rows)), [], chain=rows)


def make_plan(B: int, N: int, cu_rows: list[int], starts: list[int], sizes: list[int],
              masks: list[torch.Tensor | None]) -> GraphPlan:
    """The plan of a step of len(starts) sequences padded to (B, N). Sequence b owns ragged rows
    cu_rows[b] .. cu_rows[b] + sizes[b] - 1 (a decode row: size 1, mask None; a tree: its
    ancestor-or-self mask [s, s] on the host)."""
    R = len(starts)
    seqs = list(range(R)) + [R - 1] * (B - R)
    gather: list[int] = []
    for b in seqs:
        gather += [cu_rows[b] + min(r, sizes[b] - 1) for r in range(N)]
    scatter: list[int] = []
    for b in range(R):
        scatter += range(b * N, b * N + sizes[b])
    mask: list[int] = []
    if N > 1:
        grid = np.zeros((B, N, N), dtype=np.int64)
        for i, b in enumerate(seqs):
            m, s = masks[b], sizes[b]
            if m is None:                                   # a decode row: sees its own column only
                grid[i, :, 0] = 1
            else:                                           # rows past the tree repeat its last row
                m = m.numpy()
                grid[i, :s, :s] = m
                grid[i, s:, :s] = m[s - 1]
        mask = grid.ravel().tolist()
    context_lens = [starts[b] + (N if N > 1 else 1) for b in seqs]
    return GraphPlan(B, N, gather, seqs, context_lens, scatter, mask)
