"""One engine step as tensors in, tensors out: prepare the flattened batch, run the target once,
compute the logits of every row that needs them in one GEMM, sample the plain rows and verify
every draft tree on the device, commit the accepted KV on the device, and bring everything back
to the host in **one** transfer.

    prepare()   host: ids, positions, logit rows, tree indices -> one int64 staging buffer
                (pinned on CUDA) -> one non-blocking copy; tree masks/depths from `pack_trees`
    forward     model(ids, positions, kv cache, attention metadata) -> hidden [tokens, H]
    logits      lm_head(hidden[plain rows ++ every tree node]) -> [P + nodes, V]   (one GEMM)
    sample      plain rows: `sampler.sample`                                         (device)
    verify      trees: `verify.verify_batched` over [T, N, V] padded logits          (device)
    commit KV   `kernels.kv_compact.compact_tree_kv`: accepted nodes move after the prefix (device)
    transfer    one int64 tensor: sampled tokens, committed tokens [T, D+1] (padded with
                PAD_TOKEN), paths, counts, roots, alternates, and logprobs bit-cast into it
    lengths     `StepResult.num_computed`: each entry's computed length after the step, which
                `Scheduler.postprocess` applies (the runner changes no sequence and no block table)

Sequences with a draft tree and sequences without (prefill chunks, plain decoding) ride in the
same forward: a tree's nodes are written to the cache positions after the sequence's committed
tokens, RoPE positions are committed length + depth, and the attention mask is the tree's
ancestor mask. Policy lives in the scheduler, stop handling in the engine core.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from specserve.engine.attention import AttnMetadata, build_attn_metadata
from specserve.engine.cuda_graphs import GraphPlan, StepGraphs, make_chain_plan, make_plan
from specserve.engine.grammar import apply_masks
from specserve.engine.kv_cache import BlockManager, KVCache
from specserve.engine import logits_processing
from specserve.engine.logits_processing import LogitsProcessing, needs_processing
from specserve.engine.model import LlamaModel
from specserve.engine.outputs import TokenLogprob
from specserve.engine.sampler import SamplingTensors, sample
from specserve.engine.scheduler import ScheduledBatch
from specserve.engine.sequence import Sequence
from specserve.engine.tree import PackedTrees, TokenTree, pack_trees, tree_depths, tree_topology
from specserve.engine.verify import BatchVerifyResult, VerifyResult, verify_batched, verify_results_from_stacked
from specserve.kernels.kv_compact import compact_tree_kv


@dataclass
class SeqResult:
    seq: Sequence
    tokens: list[int]                        # committed this step: 1 for plain decoding, accepted + bonus for a tree
    logprobs: list[TokenLogprob] | None = None
    tree: TokenTree | None = None
    verify: VerifyResult | None = None


@dataclass
class StepResult:
    results: list[SeqResult] = field(default_factory=list)   # only sequences that got tokens
    # batch index -> (first position, hidden [n, H]): the target's last-layer hidden states (after the
    # final norm) of the tokens whose KV entered the cache this step, in position order; only for
    # the batch indices asked for (drafters that read target features)
    features: dict[int, tuple[int, torch.Tensor]] = field(default_factory=dict)
    # batch index -> [n, len(capture_layers), H]: the runner's captured intermediate layers of the
    # same tokens (rows aligned with `features`); empty without capture layers
    layer_features: dict[int, torch.Tensor] = field(default_factory=dict)
    num_transfers: int = 0                   # device-to-host transfers this step made (1)
    num_computed: list[int] = field(default_factory=list)   # per batch entry: its computed length after the step


@dataclass
class StepInputs:
    """Everything one forward needs, on the device, plus the host-side bookkeeping of the batch."""

    input_ids: torch.Tensor          # [num_tokens] int64
    positions: torch.Tensor          # [num_tokens] int64
    meta: AttnMetadata
    logit_rows: torch.Tensor         # [P + nodes] rows of the hidden states that get logits
    starts: list[int]                # committed length of every batch entry before the step
    plain: list[int]                 # batch indices that sample one token (their chunk reaches the end)
    tree_idx: list[int]              # batch indices verifying a tree, in tree order t
    tree_rows: list[int]             # first row of tree t in the flat batch
    packed: PackedTrees | None = None
    tree_pad_index: torch.Tensor | None = None   # [T, N] row of the tree part of the logits (padding: a real node)
    tree_starts: torch.Tensor | None = None      # [T] int64 committed lengths of the tree sequences
    tree_block_tables: torch.Tensor | None = None   # [T, max_blocks] their block tables
    tree_positions: torch.Tensor | None = None      # [T] int64 output position of each tree's root token
    graph: GraphPlan | None = None   # the step's captured bucket and padding (`StepGraphs` replays it)
    graph_tensors: list[torch.Tensor] = field(default_factory=list)   # the plan's lists on the device


class LaunchedStep:
    """A step queued on the device (`ModelRunner.launch`). `sampled`: its sampled tokens on the
    device, in batch order, when every entry is a plain row (what a step launched ahead of this
    one's reading decodes from); `collect()` waits for the step and reads its `StepResult` (once)."""

    def __init__(self, sampled: torch.Tensor | None, read: Callable[[], StepResult]):
        self.sampled = sampled
        self._read = read

    def collect(self) -> StepResult:
        return self._read()


def _to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """Host ints as an int64 tensor on `device` without waiting for the stream: on CUDA through a
    fresh pinned buffer and a non-blocking copy (a pageable copy waits for all queued work, so one
    in a step's read would wait for the step launched ahead of it)."""
    host = torch.tensor(values, dtype=torch.int64)
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


class ModelRunner:
    """`capture_layers`: intermediate layers of the target (see `LlamaModel.forward`) returned with
    the last-layer features of the batch entries asked for; the forward captures them only in
    steps that have such entries."""

    def __init__(self, model: LlamaModel, cache: KVCache, blocks: BlockManager, device: torch.device,
                 capture_layers: tuple[int, ...] = (), eos_token_ids: tuple[int, ...] = ()):
        self.model = model
        self.eos_token_ids = eos_token_ids     # what min_tokens holds back (engine/logits_processing.py)
        self.cache = cache
        self.blocks = blocks
        self.device = device
        self.block_size = blocks.block_size
        self.capture_layers = tuple(capture_layers)
        if self.capture_layers:
            model.check_capture_layers(self.capture_layers)
        self.graphs: StepGraphs | None = None   # once captured (LLMEngine.capture_graphs)
        self._last_sampling: dict[str, tuple] = {}   # part -> (params, keys, SamplingTensors): `_sampling`
        # the target's forward: the model itself, or its compiled forward (engine/compiled.py)
        self.forward = model

    # ---- inputs ---------------------------------------------------------------------------

    def prepare(self, batch: ScheduledBatch, trees: dict[int, TokenTree], ahead: bool = False) -> StepInputs:
        """Flatten the batch: each entry's new tokens (a prefill chunk, one decode token, or a
        tree's nodes), their positions, the rows needing logits, and the packed trees. A step that
        a captured graph can run (`self.graphs`: decode rows and trees only) also
        gets its `GraphPlan`, the padding onto its bucket (engine/cuda_graphs.py).

        `ahead`: a step of plain decodes one token past each sequence's host state (`launch`): its
        input token is the one the step in flight samples, at position len(token_ids); its id here
        is a placeholder."""
        starts = [len(seq.token_ids) if ahead else seq.num_computed_tokens for seq in batch.seqs]
        lone_chunk = len(batch.seqs) == 1 and not trees and batch.num_tokens[0] > 1 and not ahead
        bucket = self._graph_bucket(batch, trees, starts, ahead, lone_chunk)
        tree_idx = [b for b in range(len(batch.seqs)) if b in trees]
        packed = pack_trees([trees[b] for b in tree_idx], self.device) if tree_idx else None
        ids: list[int] = []
        positions: list[int] = []
        qlens: list[int] = []
        masks: list[torch.Tensor | None] = []
        plain: list[int] = []
        plain_rows: list[int] = []
        tree_rows: list[int] = []
        for b, (seq, start, n) in enumerate(zip(batch.seqs, starts, batch.num_tokens)):
            tree = trees.get(b)
            if tree is not None:
                t = len(tree_rows)
                tree_rows.append(len(ids))
                ids.extend(tree.tokens)
                positions.extend(start + d for d in tree_depths(tree.parents))
                qlens.append(tree.num_nodes)
                masks.append(packed.mask[t, :tree.num_nodes, :tree.num_nodes])
                continue
            ids.extend(seq.token_ids[start:start + n] if not ahead else [0])
            positions.extend(range(start, start + n))
            qlens.append(n)
            masks.append(None)
            if start + n == len(seq.token_ids) + ahead:   # this chunk reaches the end: the next token is due
                plain.append(b)
                plain_rows.append(len(ids) - 1)
        logit_rows = plain_rows + [r0 + i for r0, b in zip(tree_rows, tree_idx) for i in range(trees[b].num_nodes)]
        pad_index: list[int] = []
        if packed is not None:   # [T, N] index into the tree logits; padding repeats the tree's last node
            width, offset = packed.tokens.shape[1], 0
            for size in packed.sizes:
                pad_index.extend(offset + min(i, size - 1) for i in range(width))
                offset += size
        tree_start_list = [starts[b] for b in tree_idx] + [batch.seqs[b].num_output_tokens for b in tree_idx]
        tables = [self.blocks.block_tables[seq.seq_id] for seq in batch.seqs]
        plan = None
        if bucket is not None and lone_chunk:
            plan = make_chain_plan(bucket[1], starts[0], qlens[0])
        elif bucket is not None:
            cu_rows = np.cumsum([0] + qlens[:-1]).tolist()
            host_masks = [tree_topology(trees[b].parents).mask if b in trees else None for b in range(len(qlens))]
            plan = make_plan(*bucket, cu_rows, starts, qlens, host_masks)
        extra = [v for part in (plan.gather, plan.seqs, plan.context_lens, plan.scatter, plan.mask) for v in part] \
            if plan is not None else []
        n_tok, n_logit = len(ids), len(logit_rows)
        # the step's own integers ride the metadata's one copy to the device; a graph step reads its
        # masks from the plan: the eager metadata's would be packed for nothing
        _, meta = build_attn_metadata(tables, self.block_size, starts, qlens,
                                      masks if plan is None else [None] * len(masks), self.device,
                                      stage=ids + positions + logit_rows + pad_index + tree_start_list + tree_idx
                                      + extra)
        input_ids, pos, rows, rest, graph = meta.staged.split(
            [n_tok, n_tok, n_logit, len(pad_index) + 3 * len(tree_idx), len(extra)])
        inputs = StepInputs(input_ids, pos, meta, rows, starts, plain, tree_idx, tree_rows, packed, graph=plan)
        if plan is not None:
            inputs.graph_tensors = list(graph.split(plan.sizes()))
        if packed is not None:
            pad, tree_starts, tree_positions, tree_batch_idx = rest.split([len(pad_index)] + [len(tree_idx)] * 3)
            inputs.tree_positions = tree_positions
            inputs.tree_pad_index = pad.view(len(tree_idx), -1)
            inputs.tree_starts = tree_starts
            inputs.tree_block_tables = meta.block_tables.index_select(0, tree_batch_idx)
        return inputs

    def _graph_bucket(self, batch: ScheduledBatch, trees: dict, starts: list[int], ahead: bool = False,
                      lone_chunk: bool = False) -> tuple[int, int] | None:
        """The captured (batch, nodes) bucket of a step made of decode rows (one new token per
        sequence, at its end; one past its host state when `ahead`) and draft trees, or of one
        sequence's prefill chunk alone (`lone_chunk`: a chain bucket), or None: the step runs
        eagerly."""
        if self.graphs is None:
            return None
        width = max(len(self.blocks.block_tables[seq.seq_id]) for seq in batch.seqs)
        if width > self.graphs.block_tables.shape[1]:
            return None
        if lone_chunk:
            return self.graphs.chain_bucket(batch.num_tokens[0])
        nodes = 1
        for b, (seq, start, n) in enumerate(zip(batch.seqs, starts, batch.num_tokens)):
            tree = trees.get(b)
            if tree is not None:
                nodes = max(nodes, tree.num_nodes)
            elif n != 1 or start + 1 != len(seq.token_ids) + ahead:
                return None
        return self.graphs.bucket(len(batch.seqs), nodes)

    # ---- the step -------------------------------------------------------------------------

    def execute(self, batch: ScheduledBatch, trees: dict[int, TokenTree] | None = None,
                feature_idx: set[int] | frozenset = frozenset(),
                grammar_masks: dict[int, np.ndarray] | None = None,
                on_launch: Callable[[LaunchedStep], None] | None = None) -> StepResult:
        """Run one step: `launch` it, call `on_launch` with it (while the device runs it: the engine
        launches the next step there, `LLMEngine` async scheduling), and read its result."""
        launched = self.launch(batch, trees, feature_idx, grammar_masks)
        if on_launch is not None:
            on_launch(launched)
        return launched.collect()

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch, trees: dict[int, TokenTree] | None = None,
               feature_idx: set[int] | frozenset = frozenset(),
               grammar_masks: dict[int, np.ndarray] | None = None,
               ahead: torch.Tensor | None = None) -> LaunchedStep:
        """Queue one step on the device; `LaunchedStep.collect` waits for it and reads its result.
        `trees` maps a batch index to the draft tree of that (decode) sequence; its KV blocks must
        already hold committed length + tree size tokens. For the batch indices in `feature_idx` the
        result carries the hidden states of the tokens that entered the KV cache (prefill chunk,
        decoded token, or the tree's root + accepted path).
        `grammar_masks`: per batch index of a constrained sequence, its allowed tokens (int32 words,
        engine/grammar.py): [words] for a plain row, [num_nodes, words] for a tree.

        `ahead`: the device tokens [len(batch)] that the step in flight samples for the same batch of
        plain decodes, in its order; this step decodes each sequence one token past its host state,
        from them (`prepare`). No host sync here: its one transfer is queued, and read by `collect`.

        Nothing a sequence or the block manager owns changes here: the result carries each entry's
        computed length after the step (`StepResult.num_computed`), which the scheduler applies."""
        trees = trees or {}
        want_layers = bool(self.capture_layers and feature_idx)
        inp = self.prepare(batch, trees, ahead is not None)
        if ahead is not None:
            inp.input_ids = ahead
        layers = None
        if inp.graph is not None:     # the graphs write the capture layers too (engine/cuda_graphs.py)
            hidden, layers = self.graphs.forward(inp.input_ids, inp.positions, inp.meta, inp.graph, inp.graph_tensors,
                                                 want_layers)
        elif want_layers:
            hidden, layers = self.forward(inp.input_ids, inp.positions, self.cache, inp.meta, self.capture_layers)
        else:
            hidden = self.forward(inp.input_ids, inp.positions, self.cache, inp.meta)
        logits = self.model.compute_logits(hidden.index_select(0, inp.logit_rows))   # [P + nodes, V]
        num_plain = len(inp.plain)
        device_out: list[torch.Tensor] = []

        plain_seqs = [batch.seqs[b] for b in inp.plain]
        plain_lp = None
        sampled = None
        if plain_seqs:
            st = self._sampling("plain", plain_seqs)
            plain_logits = self._masked(self._processed(logits[:num_plain], plain_seqs), inp.plain, grammar_masks)
            out = sample(plain_logits, st, [s.num_output_tokens + (ahead is not None) for s in plain_seqs])
            device_out.append(out.token_ids)
            sampled = out.token_ids
            if out.logprobs is not None:
                plain_lp = (out.logprobs, out.top_ids, out.top_logprobs)

        verified: BatchVerifyResult | None = None
        tree_lp = None
        tree_seqs = [batch.seqs[b] for b in inp.tree_idx]
        if inp.packed is not None:
            packed = inp.packed
            tree_logits = logits[num_plain:].index_select(0, inp.tree_pad_index.reshape(-1))
            tree_logits = tree_logits.view(*inp.tree_pad_index.shape, -1)                 # [T, N, V]
            tree_logits = self._masked(self._processed(tree_logits, tree_seqs, packed), inp.tree_idx, grammar_masks)
            st = self._sampling("trees", tree_seqs)
            verified = verify_batched(packed, tree_logits, st, any_greedy=any(s.params.greedy for s in tree_seqs),
                                      positions=inp.tree_positions)
            path_lens = verified.num_accepted + 1
            compact_tree_kv(self.cache.kv, inp.tree_block_tables, self.block_size, inp.tree_starts,
                            verified.path, path_lens)
            stacked = verified.stacked()
            device_out.append(stacked.reshape(-1))
            if st.max_logprobs is not None:
                tree_lp = _path_logprobs(tree_logits, verified, st.max_logprobs)

        for lp in (plain_lp, tree_lp):
            if lp is not None:
                chosen, top_ids, top_lps = lp
                device_out += [top_ids.reshape(-1), _float_bits(chosen), _float_bits(top_lps)]

        # the one device-to-host transfer, queued: into pinned memory on CUDA, read by `collect`
        flat = torch.cat(device_out) if device_out else None
        done = None
        if flat is not None and self.device.type == "cuda":
            flat = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True).copy_(flat, non_blocking=True)
            done = torch.cuda.Event()
            done.record()

        @torch.inference_mode()
        def read() -> StepResult:
            if done is not None:
                done.synchronize()
            host = flat.tolist() if flat is not None else []
            result = StepResult(num_transfers=1 if host else 0)
            reader = _Reader(host)
            tokens = reader.ints(num_plain)
            vrs: list[VerifyResult] = []
            if verified is not None:
                T, width = verified.tokens.shape
                values, cols = reader.ints(stacked.numel()), stacked.shape[1]
                vrs = verify_results_from_stacked([values[t * cols:(t + 1) * cols] for t in range(T)], width - 1)
            plain_lps = (_read_logprobs(reader, plain_seqs, [[t] for t in tokens], 1, plain_lp[1].shape[-1])
                         if plain_lp else None)
            tree_lps = (_read_logprobs(reader, tree_seqs, [v.tokens for v in vrs], width, tree_lp[1].shape[-1])
                        if tree_lp else None)
            for k, seq in enumerate(plain_seqs):
                result.results.append(SeqResult(seq, [tokens[k]], plain_lps[k] if plain_lps else None))
            for t, (b, seq, v) in enumerate(zip(inp.tree_idx, tree_seqs, vrs)):
                result.results.append(SeqResult(seq, v.tokens, tree_lps[t] if tree_lps else None, trees[b], v))
            self._collect_features(result, batch, inp, hidden, feature_idx, layers)
            self._computed_lengths(batch, inp, result)
            return result

        return LaunchedStep(sampled if num_plain == len(batch.seqs) and not trees else None, read)

    def _sampling(self, part: str, seqs: list[Sequence]) -> SamplingTensors:
        """The `SamplingTensors` of `seqs`' rows (`part`: the plain rows or the trees); the last
        step's again when the same requests come in the same order, as in most decode steps."""
        params, keys = [s.params for s in seqs], [s.sample_key for s in seqs]
        last = self._last_sampling.get(part)
        if last is not None and last[1] == keys and len(last[0]) == len(params) and all(
                a is b for a, b in zip(last[0], params)):
            return last[2]
        st = SamplingTensors.from_params(params, self.device, keys)
        self._last_sampling[part] = (params, keys, st)
        return st

    def _processed(self, logits: torch.Tensor, seqs: list[Sequence], packed: PackedTrees | None = None) -> torch.Tensor:
        """`logits` ([B, V] of plain rows, or [T, N, V] of `packed` trees' nodes) with the rows of the
        sequences that ask for penalties, logit_bias or min_tokens processed along their own paths
        (engine/logits_processing.py); unchanged when none does."""
        which = [k for k, s in enumerate(seqs) if needs_processing(s.params, self.eos_token_ids)]
        if not which:
            return logits
        V = logits.shape[-1]
        proc = LogitsProcessing.for_seqs([seqs[k] for k in which], self.eos_token_ids, V, self.device)
        ix = _to_device(which, self.device)
        if packed is None:
            done = proc.apply(logits.index_select(0, ix)[:, None, :]).squeeze(1)
        else:
            done = proc.apply(logits.index_select(0, ix), logits_processing.path_counts(packed, V, ix), packed.depths.index_select(0, ix))
        return logits.float().index_copy(0, ix, done)

    def _masked(self, logits: torch.Tensor, batch_idx: list[int], grammar_masks: dict[int, np.ndarray] | None
                ) -> torch.Tensor:
        """`logits` ([B, V] of plain rows, or [T, N, V] of trees' nodes; row k is batch entry
        batch_idx[k]) with the rows of constrained sequences masked (engine/grammar.py); a tree's
        mask rows are padded as its nodes are. Unchanged when none is constrained."""
        which = [k for k, b in enumerate(batch_idx) if b in (grammar_masks or {})]
        if not which:
            return logits
        rows = [grammar_masks[batch_idx[k]] for k in which]
        if logits.dim() == 3:
            rows = [_pad_rows(r, logits.shape[1]) for r in rows]
        ix = _to_device(which, self.device)
        return logits.float().index_copy(0, ix, apply_masks(logits.index_select(0, ix), np.stack(rows)))

    def _collect_features(self, result: StepResult, batch: ScheduledBatch, inp: StepInputs,
                          hidden: torch.Tensor, feature_idx, layers: torch.Tensor | None = None) -> None:
        """The rows of the tokens whose KV stays (a chunk's, or a tree's root and accepted path) of
        the last-layer features and, when captured, of the intermediate layers."""
        if not feature_idx:
            return
        row0 = inp.meta.cu_query_lens
        tree_of = {b: t for t, b in enumerate(inp.tree_idx)}
        verified = {id(r.seq): r.verify for r in result.results if r.tree is not None}
        rows: list[int] = []
        spans = []        # (batch index, first of its rows, how many)
        for b in sorted(feature_idx):
            if b in tree_of:
                v, first = verified[id(batch.seqs[b])], inp.tree_rows[tree_of[b]]
                mine = [first + i for i in (v.root, *v.accepted_nodes)]
            else:
                mine = range(row0[b], row0[b] + batch.num_tokens[b])
            spans.append((b, len(rows), len(mine)))
            rows.extend(mine)
        # one gather for every sequence (and one upload of its rows), not a few small ops each: it
        # is also a copy, so the graphs' static output may be overwritten by the next replay; every
        # row in order (all sequences read features, no tree): a plain copy, nothing uploaded
        if len(rows) == hidden.shape[0] and rows == list(range(len(rows))):
            gathered = hidden.clone()
            gathered_layers = layers.clone() if layers is not None else None
        else:
            index = _to_device(rows, self.device)
            gathered = hidden.index_select(0, index)
            gathered_layers = layers.index_select(0, index) if layers is not None else None
        for b, lo, n in spans:
            result.features[b] = (inp.starts[b], gathered[lo:lo + n])
            if gathered_layers is not None:
                result.layer_features[b] = gathered_layers[lo:lo + n]

    def _computed_lengths(self, batch: ScheduledBatch, inp: StepInputs, result: StepResult) -> None:
        """Each batch entry's computed length after the step: a plain entry has computed its chunk;
        a tree entry keeps its prefix plus the accepted path (root included). The scheduler applies
        them (`Scheduler.postprocess`)."""
        committed = {id(r.seq): r for r in result.results if r.tree is not None}
        result.num_computed = []
        for b, (seq, n) in enumerate(zip(batch.seqs, batch.num_tokens)):
            res = committed.get(id(seq))
            result.num_computed.append(inp.starts[b] + (n if res is None else len(res.verify.accepted_nodes) + 1))

    # ---- calibration ----------------------------------------------------------------------

    @torch.inference_mode()
    def profile_forward(self, num_tokens: int, capture_layers: tuple[int, ...] = (), repeats: int = 3) -> float:
        """Seconds of one forward of `num_tokens` new tokens (one sequence, causal) and the LM head
        over all of them, as a decode or verification step computes a distribution at each of its
        tokens; best of `repeats`, on a scratch KV cache of its own: the live cache is not touched.
        `capture_layers`: captured as a step of a feature-reading drafter would."""
        cfg = self.model.cfg
        blocks = -(-num_tokens // self.block_size)
        scratch = KVCache(cfg.num_layers, blocks, self.block_size, cfg.num_kv_heads, cfg.head_dim,
                          self.cache.kv.dtype, self.device)
        ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            positions, meta = build_attn_metadata([list(range(blocks))], self.block_size, [0], [num_tokens],
                                                  None, self.device)
            out = self.forward(ids, positions, scratch, meta, capture_layers)   # (hidden, layers) with captures
            self.model.compute_logits(out[0] if capture_layers else out)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            best = min(best, time.perf_counter() - t0)
        return best


def _pad_rows(rows: np.ndarray, n: int) -> np.ndarray:
    """rows [k, words] padded to [n, words] by repeating the last (as the trees' padding nodes)."""
    return rows if rows.shape[0] == n else np.concatenate([rows, np.repeat(rows[-1:], n - rows.shape[0], axis=0)])


def _float_bits(x: torch.Tensor) -> torch.Tensor:
    """float32 values carried in an int64 tensor (bit pattern), so they ride the same transfer."""
    return x.float().contiguous().view(torch.int32).reshape(-1).to(torch.int64)


class _Reader:
    """Consumes the host list of the step's single transfer, in the order it was packed."""

    def __init__(self, values: list[int]):
        self.values = values
        self.pos = 0

    def ints(self, n: int) -> list[int]:
        out = self.values[self.pos:self.pos + n]
        self.pos += n
        return out

    def floats(self, n: int) -> list[float]:
        return np.asarray(self.ints(n), dtype=np.int64).astype(np.int32).view(np.float32).tolist()


def _path_logprobs(tree_logits: torch.Tensor, v: BatchVerifyResult, k: int):
    """OpenAI-style logprobs (raw log_softmax) of the committed tokens of every tree: committed
    token i is drawn at path node i. Returns (chosen [T, D+1], top ids and logprobs [T, D+1, k])."""
    rows = v.path.clamp(min=0)                                                     # padding: node 0
    lp = tree_logits[torch.arange(rows.shape[0], device=rows.device)[:, None], rows].log_softmax(-1)
    chosen = lp.gather(2, v.tokens.clamp(min=0)[:, :, None]).squeeze(2)
    top = lp.topk(min(k, lp.shape[-1]), dim=-1)
    return chosen, top.indices, top.values


def _read_logprobs(reader: _Reader, seqs: list[Sequence], tokens: list[list[int]], width: int,
                   k: int) -> list[list[TokenLogprob] | None]:
    """Per sequence, the logprob entries of its committed tokens (None where it asked for none),
    read in the packed order: top ids [rows, width, k], chosen [rows, width], top logprobs
    [rows, width, k] (width 1 for plain rows, D+1 for trees)."""
    rows = len(seqs)
    top_ids = reader.ints(rows * width * k)
    chosen = reader.floats(rows * width)
    top_lps = reader.floats(rows * width * k)
    out: list[list[TokenLogprob] | None] = []
    for r, (seq, toks) in enumerate(zip(seqs, tokens)):
        n_top = seq.params.logprobs
        if n_top is None:
            out.append(None)
            continue
        entries = []
        for i, tok in enumerate(toks):
            base = (r * width + i) * k
            alts = list(zip(top_ids[base:base + n_top], top_lps[base:base + n_top]))
            entries.append(TokenLogprob(tok, chosen[r * width + i], alts))
        out.append(entries)
    return out
