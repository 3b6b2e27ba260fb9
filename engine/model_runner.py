"""Turns a scheduled batch into tensors, runs the target forward and samples.

The only place that builds `input_ids`, `positions` and `AttnMetadata`; policy lives in the
scheduler, stop handling in the engine core.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.engine.attention import build_attn_metadata
from specserve.engine.kv_cache import BlockManager, KVCache
from specserve.engine.model import LlamaModel
from specserve.engine.sampler import SamplingTensors, sample
from specserve.engine.scheduler import ScheduledBatch
from specserve.engine.sequence import Sequence


@dataclass
class StepResult:
    sampled: list[Sequence]                  # sequences that got a new token this step
    token_ids: list[int]                     # one per sampled sequence
    logprobs: list[float] | None             # chosen-token logprob per sampled sequence
    top: list[list[tuple[int, float]]] | None


class ModelRunner:
    def __init__(self, model: LlamaModel, cache: KVCache, blocks: BlockManager, device: torch.device):
        self.model = model
        self.cache = cache
        self.blocks = blocks
        self.device = device
        self.block_size = blocks.block_size

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> StepResult:
        seqs, query_lens = batch.seqs, batch.num_tokens
        starts = [seq.num_computed_tokens for seq in seqs]
        ids: list[int] = []
        sample_rows, sampled = [], []
        row = 0
        for seq, start, n in zip(seqs, starts, query_lens):
            ids.extend(seq.token_ids[start:start + n])
            row += n
            if start + n == len(seq.token_ids):   # this chunk reaches the end: the next token is due
                sample_rows.append(row - 1)
                sampled.append(seq)
        tables = [self.blocks.block_tables[seq.seq_id] for seq in seqs]
        positions, meta = build_attn_metadata(tables, self.block_size, starts, query_lens, None, self.device)
        input_ids = torch.tensor(ids, dtype=torch.int64).to(self.device)
        hidden = self.model(input_ids, positions, self.cache, meta)
        if not sampled:
            return StepResult([], [], None, None)
        logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=self.device)])
        params = [seq.params for seq in sampled]
        st = SamplingTensors.from_params(params, self.device)
        out = sample(logits, st, [seq.generator for seq in sampled])
        token_ids = out.token_ids.tolist()
        logprobs = top = None
        if out.logprobs is not None:
            logprobs = out.logprobs.tolist()
            top_ids, top_lps = out.top_ids.tolist(), out.top_logprobs.tolist()
            top = [list(zip(i, lp)) for i, lp in zip(top_ids, top_lps)]
        return StepResult(sampled, token_ids, logprobs, top)
