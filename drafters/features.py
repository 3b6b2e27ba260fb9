"""What the drafters reading the target's features (eagle, falcon, ctc, parallelspec) share.

Each keeps, per sequence, rows computed from the target's real features (its `kv_len`), reads
the features from the engine's feature store (engine/features.py) or, built outside an engine,
from a store of its own fed by `observe`, and (all but ctc) keeps the rows' keys and values in a
one-layer `PagedDraftKV` whose rows past the real ones are released after each verification.
What a drafter computes from the rows, and when it is ready to draft, stays in its own file.
"""

from __future__ import annotations

import copy
import logging
from abc import abstractmethod
from typing import Callable, Sequence as Seq

import torch

from specserve.drafters.base import Drafter, DrafterContext, param_count
from specserve.engine.features import FeatureStore
from specserve.engine.kv_cache import PagedDraftKV
from specserve.engine.model import rope_at
from specserve.engine.tree import TokenTree

logger = logging.getLogger("specserve")


class FeatureState:
    """Per-sequence state: rows 0..kv_len-1 (computed from real features) are the drafter's."""

    __slots__ = ("kv_len",)

    def __init__(self):
        self.kv_len = 0


class FeatureDrafter(Drafter):
    """The shared protocol of the feature-reading drafters. A subclass sets `State` (a
    `FeatureState` with its own fields), calls `super().__init__(ctx)` first, and, once its net
    and draft vocabulary are built, `count_cost(net)` and (with a paged KV) `paged_kv(...)`."""

    needs_features = True
    State: type[FeatureState] = FeatureState

    def __init__(self, ctx: DrafterContext) -> None:
        self.target = ctx.target                    # its embedding and LM head are used by reference
        self.device, self.dtype = torch.device(ctx.device), ctx.dtype
        self.hidden_size = ctx.model_config.hidden_size
        self.checkpoint_meta = None
        self.state: dict[int, FeatureState] = {}
        self.kv: PagedDraftKV | None = None
        self.num_runs = 0
        self.cost = 0.0
        # the target's features: the engine's store, or (built outside an engine) one fed by `observe`
        self._own_features = ctx.features is None
        self.features = ctx.features
        if self.features is None:
            self.features = FeatureStore(self.hidden_size, ctx.dtype, self.device)

    # ---- construction -----------------------------------------------------------------------------------------------

    def load_trained(self, checkpoint: str | None, model_config, shipped: Callable, load: Callable,
                     what: str = "head"):
        """The trained net of `checkpoint`, else of the shipped checkpoint for this target (`shipped`
        finds it, `load(path, model_config=, target=)` -> (net, meta)); its meta is kept."""
        path = checkpoint or shipped(model_config, self.target)
        if path is None:
            raise ValueError(f"{self.name}: no checkpoint for this target. Train one with `specserve train "
                             f"{self.name} --model MODEL --out DIR` and load it with --drafter-option "
                             f"{self.name}.checkpoint=DIR (or {self.name}.random_init=true for an untrained "
                             f"{what}, for tests only)")
        net, meta = load(path, model_config=model_config, target=self.target)
        self.checkpoint_meta = meta
        logger.info("%s: checkpoint %s (trained for %s, tau %s)", self.name, path, meta.target_name, meta.tau)
        return net

    def in_memory(self, net: torch.nn.Module) -> torch.nn.Module:
        """An in-memory net is read by reference (a trainer's evals see its latest weights) unless it
        must be converted to the drafter's device and dtype: then a copy, to convert."""
        p = next(net.parameters())
        return copy.deepcopy(net) if p.device != self.device or p.dtype != self.dtype else net

    def count_cost(self, net: torch.nn.Module) -> None:
        """c of `model_runs`: (the net's own parameters + the LM-head rows it multiplies, the draft
        vocabulary's rows x hidden size) / the target's parameters."""
        rows = self.vocab.size or self.vocab.vocab_size
        self.cost = (param_count(net) + rows * self.hidden_size) / param_count(self.target)

    def paged_kv(self, ctx: DrafterContext, extra_tokens: int, block_size: int, num_blocks: int | None) -> None:
        """The drafter's own one-layer paged KV: `max_model_len` rows per sequence plus
        `extra_tokens` (tree or mask rows past the real ones)."""
        cfg = ctx.model_config
        self.kv = PagedDraftKV(1, cfg.num_kv_heads, cfg.head_dim, self.dtype, self.device,
                               max_model_len=ctx.max_model_len, max_num_seqs=ctx.max_num_seqs,
                               extra_tokens=extra_tokens, block_size=block_size, num_blocks=num_blocks)
        self.blocks, self.cache = self.kv.blocks, self.kv.cache

    def model_runs(self) -> dict[str, tuple[int, float]]:
        return {self.name: (self.num_runs, self.cost)}

    # ---- protocol ---------------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def propose(self, seqs: Seq, budgets: Seq[int]) -> list[TokenTree | None]:
        trees: list[TokenTree | None] = [None] * len(seqs)
        live = [i for i, b in enumerate(budgets) if b > 0]
        if live:
            for i, tree in zip(live, self.draft([seqs[i] for i in live], [int(budgets[i]) for i in live])):
                trees[i] = tree
        return trees

    @abstractmethod
    def draft(self, seqs: Seq, budgets: Seq[int]) -> list[TokenTree | None]:
        """`propose` for the sequences with a budget (every budget >= 1): one tree or None each."""

    def start(self, seq) -> None:
        self.state[seq.seq_id] = self.State()

    def finish(self, seq) -> None:
        self.state.pop(seq.seq_id, None)
        if self.kv is not None:
            self.kv.free(seq.seq_id)
        if self._own_features:
            self.features.free(seq.seq_id)

    def observe(self, seqs: Seq, features: Seq[tuple[int, torch.Tensor]]) -> None:
        """The features themselves are read from the feature store (built outside an engine, the
        drafter's own, written here); here only: features again for rows already computed
        (preemption: recomputed from 0) mean those rows are redone (`rewind`)."""
        for seq, (start, hidden) in zip(seqs, features):
            st = self.state.setdefault(seq.seq_id, self.State())
            start = int(start)
            if self._own_features:
                try:
                    self.features.write(seq.seq_id, start, hidden.detach().to(self.dtype))
                except ValueError:   # a gap: the features in between never came; no draft until they do
                    logger.warning("%s: features of sequence %d jump from %d to %d", self.name, seq.seq_id,
                                   self.features.length(seq.seq_id), start)
            self.rewind(seq.seq_id, st, start)

    def rewind(self, seq_id: int, st: FeatureState, start: int) -> None:
        """New features from position `start` on: the rows from `start` on are computed again."""
        if start < st.kv_len:
            st.kv_len = start
            if self.kv is not None:
                self.kv.shrink(seq_id, start)

    def accept(self, seqs: Seq, results: Seq) -> None:
        """No tree row is kept: release the blocks past the real rows (the accepted path's real
        features came through `observe` and become rows at the next catch-up)."""
        if self.kv is None:
            return
        for seq in seqs:
            st = self.state.get(seq.seq_id)
            if st is not None:
                self.kv.shrink(seq.seq_id, self.kept_rows(st))

    def kept_rows(self, st: FeatureState) -> int:
        """The rows of the drafter's KV that outlive a verification."""
        return st.kv_len

    # ---- rows -------------------------------------------------------------------------------------------------------

    def grow(self, seq_id: int, rows: int) -> bool:
        """Room for `rows` rows of `seq_id` in the paged KV; False (no draft) when the pool is spent."""
        if self.kv.grow(seq_id, rows):
            return True
        logger.warning("%s: draft KV pool exhausted; no draft for sequence %d", self.name, seq_id)
        return False

    def head_rows(self, ids: torch.Tensor, feats: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        """For a one-layer `self.head` (fuse, layer, out; rope tables `self.rope_cos/sin`): rows
        (feature, token) at `positions` through the head, KV written per `meta` -> f̂."""
        h = self.head.fuse(feats, self.target.embed(ids))
        rope = rope_at(self.rope_cos, self.rope_sin, positions, h.dtype)
        k_cache, v_cache = self.cache.layer(0)
        return self.head.out(self.head.layer(h, rope, k_cache, v_cache, meta))


__all__ = ["FeatureDrafter", "FeatureState"]
