"""The target's features computed in the training loop, from token ids alone.

Teacher shards (data.build_teacher_shards) store the target's rows beside the tokens: about
1.2 KB a token, so a few hundred thousand answer tokens make a cache of a few hundred MB that has
to be built before training and cannot travel to another machine. Here a dataset holds only the
rendered token ids (what `specserve train distill` commits: a few MB), and the rows of a batch are
computed when the batch is made:

    features = LiveFeatures(model, [r.input_ids for r in rendered], top_k=8, batch_tokens=4096)
    train = LiveDataset(features, examples, rendered, split="train", eval_examples=64)
    for batch in train.batches(2048, epoch=0):      # the same batches a ShardDataset gives
        ...

* **The same rows.** A batch's examples go through the target in one `FeatureExtractor` call (a
  ragged causal prefill, as the engine prefills prompts), then `data.teacher_rows` takes the
  hidden states, greedy labels and top-k log-probabilities exactly as a shard build does.
* **Kept in memory, not on disk.** Each example's rows are kept (hidden states in fp16) while
  their total stays under `memory_bytes`, least recently used first out; so on a machine with the
  memory, epochs after the first cost no target forward, and otherwise every epoch recomputes.
  A killed run loses them; a resumed one (loop.TrainConfig.state_path) computes them again.
* **Both splits share one `LiveFeatures`**, so the held-back rows are computed once too.
* **Intermediate layers** on request (`capture_layers`, for EAGLE-3's fused features): each
  example's rows then also hold `layers` [n, len(capture_layers), H], the target's residual
  streams after those decoder layers, computed in the same forward.

`stats()` says how many tokens were computed, in how many seconds, and how many rows are held.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any, Iterable, Sequence as Seq

import torch

from specserve.drafters.train.data import (TEACHER_FIELDS, ExampleSet, Example, Rendered, _Item, teacher_rows,
                                           token_groups)
from specserve.drafters.train.target import DEFAULT_BATCH_TOKENS, FeatureExtractor

DEFAULT_MEMORY_BYTES = 8 << 30


class LiveFeatures:
    """The target's rows of `sequences[i]`, computed on demand and kept while they fit."""

    def __init__(self, model, sequences: Seq[Seq[int]], *, top_k: int, device: torch.device | str | None = None,
                 batch_tokens: int = DEFAULT_BATCH_TOKENS, hidden_dtype: torch.dtype = torch.float16,
                 memory_bytes: int = DEFAULT_MEMORY_BYTES, capture_layers: Seq[int] = ()):
        self.model, self.sequences, self.top_k = model, [list(s) for s in sequences], top_k
        self.capture_layers = tuple(capture_layers)   # also kept: the target's layers there (`layers`)
        self.hidden_dtype, self.memory_bytes, self.batch_tokens = hidden_dtype, memory_bytes, batch_tokens
        self.extractor = FeatureExtractor(model, device, batch_tokens=batch_tokens)
        self._held: OrderedDict[int, dict[str, torch.Tensor]] = OrderedDict()
        self._held_bytes = 0
        self._current: dict[int, dict[str, torch.Tensor]] = {}
        self.computed_tokens = 0
        self.seconds = 0.0

    @staticmethod
    def _bytes(rows: dict[str, torch.Tensor]) -> int:
        return sum(t.numel() * t.element_size() for t in rows.values())

    def ensure(self, indices: Iterable[int]) -> None:
        """Compute the rows of every index not held, in extractor calls of about `batch_tokens`
        tokens; mark them all as just used."""
        wanted = list(dict.fromkeys(indices))
        missing = [i for i in wanted if i not in self._held]
        start = time.perf_counter()
        fresh: dict[int, dict[str, torch.Tensor]] = {}
        for a, b in token_groups([len(self.sequences[i]) for i in missing], self.batch_tokens):
            group = missing[a:b]
            rows = teacher_rows(self.model, self.extractor, [self.sequences[i] for i in group], self.top_k,
                                self.hidden_dtype, self.capture_layers)
            fresh.update(zip(group, rows))
            self.computed_tokens += sum(len(self.sequences[i]) for i in group)
        if missing:
            self.seconds += time.perf_counter() - start
        for i in wanted:
            if i in fresh:
                self._held[i] = fresh[i]
                self._held_bytes += self._bytes(fresh[i])
            else:
                self._held.move_to_end(i)
        self._current = {i: self._held[i] for i in wanted}   # readable until the next call, held or not
        while self._held_bytes > self.memory_bytes and self._held:
            _, rows = self._held.popitem(last=False)
            self._held_bytes -= self._bytes(rows)

    def rows(self, index: int) -> dict[str, torch.Tensor]:
        """The rows of `index` (after `ensure` of it)."""
        rows = self._current.get(index)
        if rows is None:
            self.ensure([index])
            rows = self._current[index]
        return rows

    def stats(self) -> dict[str, Any]:
        return {"computed_tokens": self.computed_tokens, "seconds": round(self.seconds, 1),
                "tokens_per_second": round(self.computed_tokens / self.seconds, 1) if self.seconds else None,
                "held_examples": len(self._held), "held_bytes": self._held_bytes}


class LiveDataset(ExampleSet):
    """`rendered[i]` (the tokens of `examples[i]`) with the rows of `features` (its sequences are
    the same tokens), or one split of them (`ExampleSet._split`): a drop-in for a ShardDataset."""

    def __init__(self, features: LiveFeatures, examples: Seq[Example], rendered: Seq[Rendered], *,
                 manifest: dict[str, Any], split: str = "all", eval_examples: int | None = None,
                 eval_fraction: float | None = None, split_seed: int = 0, read_ahead_tokens: int | None = None):
        if len(examples) != len(rendered) or len(rendered) != len(features.sequences):
            raise ValueError("examples, rendered and the features' sequences must correspond one to one")
        self.features, self.manifest = features, manifest
        self._ids = [torch.tensor(r.input_ids, dtype=torch.int32) for r in rendered]
        self._answer = [torch.tensor(r.answer_mask, dtype=torch.bool) for r in rendered]
        self.top_k, self.capture_layers = features.top_k, features.capture_layers
        self.hidden_size = int(features.model.cfg.hidden_size)
        self.read_ahead_tokens = read_ahead_tokens or features.batch_tokens
        items = [_Item(ex.id, ex.source, i, 0, len(r.input_ids)) for i, (ex, r) in enumerate(zip(examples, rendered))]
        self._split(items, split, eval_examples, eval_fraction, split_seed)
        self._position = {it.shard: k for k, it in enumerate(self.items)}

    def answer_of(self, it: _Item) -> torch.Tensor:
        return self._answer[it.shard]

    def _prepare(self, items: list[_Item], fields: Iterable[str]) -> None:
        if not set(fields) & {*TEACHER_FIELDS, "layers"}:
            return
        wanted = [it.shard for it in items]
        if len(items) == 1:   # one example at a time (`example`): compute the ones after it too
            k, tokens = self._position[items[0].shard] + 1, items[0].length
            while k < len(self.items) and tokens + self.items[k].length <= self.read_ahead_tokens:
                wanted.append(self.items[k].shard)
                tokens += self.items[k].length
                k += 1
        self.features.ensure(wanted)

    def _rows(self, shard: int, name: str, a: int, b: int) -> torch.Tensor:
        if name == "input_ids":
            return self._ids[shard][a:b]
        if name == "answer_mask":
            return self._answer[shard][a:b]
        return self.features.rows(shard)[name][a:b]
