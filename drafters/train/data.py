"""Distillation data for trained drafters.

1. `load_prompt_pool`: prompts (+ reference answers) from ``train_prompts.jsonl`` of the shared
   data folder, balanced across their `source` (round-robin, so the small sources are not drowned
   by the two big ones).
2. `render_example`: chat template of the target's tokenizer for the user turn(s), then the
   answer as the assistant's tokens (followed by EOS); the answer mask marks the answer tokens.
3. `build_teacher_shards`: one teacher-forced pass of the target over prompt + answer, keeping per
   token its id, the target's last-layer hidden state, its greedy next token and its top-k next
   tokens with log-probabilities, and the answer mask; written as safetensors shards plus a
   manifest. Resumable: complete shards are kept, a missing, stale or half-written one is redone.
4. `self_distill_examples`: answers written by the target itself through our engine (the data a
   drafter sees at inference time), as examples `build_teacher_shards` consumes.
5. `ShardDataset`: reads the shards back as shuffled, padded batches of whole sequences or of
   fixed-length windows, with a held-back split chosen by prompt. Its base, `ExampleSet`, plans and
   pads batches wherever the rows live: `live.LiveDataset` computes them in the training loop
   from token ids alone.

Conventions of a shard, for example e with tokens at rows `offsets[e]:offsets[e+1]`, row t:
    input_ids[t]      the token at position t
    hidden[t]         the target's last-layer hidden state at position t (the LM head's input)
    labels[t]         the target's greedy next token after position t (= topk_ids[t, 0])
    topk_ids[t]       the target's k most likely next tokens after position t, most likely first
    topk_logprobs[t]  their log-probabilities (of the full softmax)
    answer_mask[t]    True when the token at position t belongs to the answer
So the prediction made at position t is trained where `answer_mask[t + 1]` holds (batches carry it
as `loss_mask`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence as Seq

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from specserve.drafters.nets.checkpoint import target_fingerprint
from specserve.drafters.train.target import FeatureExtractor, target_topk
from specserve.engine.data_dir import data_dir as shared_data_dir   # SPECSERVE_DATA, else ../shared/data
from specserve.engine.datasets import answer_of, dataset_rows, prompt_of
from specserve.engine.sampling_params import SamplingParams

logger = logging.getLogger("specserve")

DEFAULT_POOL = "train_prompts.jsonl"
SHARD_FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SHARD_GLOB = "shard-*.safetensors"
PAD_LABEL = -100              # labels / topk_ids of padding rows (torch's cross-entropy ignore_index)


# ---- examples and the prompt pool -----------------------------------------------------------------------------------

@dataclass
class Example:
    """One training conversation: user turn(s) and an answer (a reference one, or the target's own).
    `output_ids`, when set, is the answer as token ids (self-distillation: exactly what the target
    generated, EOS included when it stopped on it) and wins over `output`."""

    id: str
    turns: list[str]
    output: str | None = None
    source: str = "unknown"
    category: str = ""
    output_ids: list[int] | None = None

    @classmethod
    def from_row(cls, row: dict[str, Any], line: int | None = None) -> "Example":
        turns = row.get("turns")
        if isinstance(turns, str):
            turns = [turns]
        if not turns or not all(isinstance(t, str) for t in turns):
            raise ValueError(f"row {line}: 'turns' must be a non-empty list of strings")
        return cls(id=str(row.get("id", line)), turns=list(turns), output=row.get("output") or None,
                   source=str(row.get("source") or row.get("category") or "unknown"),
                   category=str(row.get("category") or ""), output_ids=row.get("output_ids"))

    def to_row(self) -> dict[str, Any]:
        row = asdict(self)
        if row["output_ids"] is None:
            del row["output_ids"]
        return row

    def content_hash(self) -> str:
        return hashlib.sha256(json.dumps(self.to_row(), sort_keys=True).encode()).hexdigest()[:16]


def default_pool_path(data_dir: str | os.PathLike | None = None) -> Path:
    """`train_prompts.jsonl` in `data_dir`, else in $SPECSERVE_DATA, else in ../shared/data beside the project."""
    if data_dir is not None:
        return Path(data_dir).expanduser() / DEFAULT_POOL
    return shared_data_dir() / DEFAULT_POOL


def read_examples(path: str | os.PathLike, *, prompt_field: str | None = None,
                  messages_field: str | None = None) -> list[Example]:
    """Our pool's `{id, category, turns[, source, output]}` rows as they are; the rows of any other
    dataset `engine/datasets.py` reads (a JSON, CSV or Parquet file, a Hugging Face id in the offline
    cache; or with `prompt_field` / `messages_field` named) one Example each: its first user turn,
    its reference answer when it has one, its source the dataset's name."""
    name = str(path)
    local = Path(name).expanduser()
    if local.is_file():
        name = str(local)
    try:
        rows = list(dataset_rows(name))
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"{exc}; pass --data PATH, or set SPECSERVE_DATA to the folder holding "
                                f"{DEFAULT_POOL}") from None
    label = local.stem if local.is_file() else name
    examples = []
    for n, row in enumerate(rows, 1):
        if isinstance(row, dict) and "turns" in row and not (prompt_field or messages_field):
            examples.append(Example.from_row(row, n))
        else:
            ident = row.get("id", n) if isinstance(row, dict) else n
            examples.append(Example(id=str(ident), turns=[prompt_of(row, prompt_field, messages_field, name)],
                                    output=answer_of(row, messages_field), source=label))
    return examples


def balance_by_source(examples: Seq[Example], max_examples: int | None = None, seed: int = 0) -> list[Example]:
    """Round-robin over the sources (in name order), each source's examples in a seeded shuffled
    order, until `max_examples` are taken or every source is used up. Every prefix of the result is
    as balanced as the sources allow: a source smaller than its share gives all it has and the
    others fill the rest."""
    by_source: dict[str, list[Example]] = {}
    for ex in examples:
        by_source.setdefault(ex.source, []).append(ex)
    rng = random.Random(seed)
    queues = []
    for source in sorted(by_source):
        items = list(by_source[source])
        rng.shuffle(items)
        queues.append(items)
    limit = len(examples) if max_examples is None else min(max_examples, len(examples))
    out: list[Example] = []
    depth = 0
    while len(out) < limit:
        for items in queues:
            if depth < len(items):
                out.append(items[depth])
                if len(out) == limit:
                    break
        depth += 1
    return out


def load_prompt_pool(path: str | os.PathLike | None = None, *, max_examples: int | None = None, seed: int = 0,
                     data_dir: str | os.PathLike | None = None, sources: Iterable[str] | None = None,
                     require_output: bool = True, prompt_field: str | None = None,
                     messages_field: str | None = None) -> list[Example]:
    """The training prompt pool, balanced across sources (see `balance_by_source`).

    `path`: a dataset `read_examples` reads, or a folder holding train_prompts.jsonl; default: see
    `default_pool_path`. `sources`: keep only these sources. `require_output`: drop rows without a
    reference answer (teacher forcing needs one; self-distillation does not)."""
    if path is None:
        path = default_pool_path(data_dir)
    if Path(path).expanduser().is_dir():
        path = Path(path).expanduser() / DEFAULT_POOL
    examples = read_examples(path, prompt_field=prompt_field, messages_field=messages_field)
    if sources is not None:
        wanted = set(sources)
        unknown = wanted - {ex.source for ex in examples}
        if unknown:
            raise ValueError(f"{path} has no source {', '.join(sorted(unknown))}; it has "
                             f"{', '.join(sorted({ex.source for ex in examples}))}")
        examples = [ex for ex in examples if ex.source in wanted]
    if require_output:
        examples = [ex for ex in examples if ex.output or ex.output_ids]
    return balance_by_source(examples, max_examples, seed)


def source_counts(examples: Iterable[Example]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for ex in examples:
        counts[ex.source] = counts.get(ex.source, 0) + 1
    return dict(sorted(counts.items()))


# ---- rendering ------------------------------------------------------------------------------------------------------

def write_json(path: Path, obj: Any) -> None:
    """`obj` as indented JSON at `path`, atomically (a reader sees the old file or the new one)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def render_prompt(tokenizer, turns: Seq[str]) -> list[int]:
    """Token ids of the prompt as the server builds it: the user turn(s) in the chat template with
    the generation prompt (several turns, which the pool never has, are joined into one message).
    A tokenizer without a chat template gets the plain text with its special tokens."""
    text = "\n\n".join(turns)
    if getattr(tokenizer, "chat_template", None):
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                 tokenize=False)
        return tokenizer.encode(rendered, add_special_tokens=False)
    return tokenizer.encode(text + "\n", add_special_tokens=True)


@dataclass
class Rendered:
    input_ids: list[int]
    answer_mask: list[bool]      # True at the answer's tokens

    @property
    def num_answer_tokens(self) -> int:
        return sum(self.answer_mask)


def render_example(tokenizer, example: Example, *, max_len: int = 512,
                   eos_token_id: int | None = None) -> Rendered | None:
    """Prompt (see `render_prompt`) followed by the answer: `example.output_ids`, else the
    tokenised `output` plus EOS (`eos_token_id`, default the tokenizer's) -- the tokens the target
    generates after the generation prompt. Truncated to `max_len` tokens; None when no answer
    token is left (or there is no answer)."""
    prompt = render_prompt(tokenizer, example.turns)
    if example.output_ids is not None:
        answer = [int(t) for t in example.output_ids]
    elif example.output:
        answer = tokenizer.encode(example.output, add_special_tokens=False)
        eos = tokenizer.eos_token_id if eos_token_id is None else eos_token_id
        if eos is not None:
            answer.append(int(eos))
    else:
        return None
    ids = (prompt + answer)[:max_len]
    mask = ([False] * len(prompt) + [True] * len(answer))[:max_len]
    if not any(mask):
        return None
    return Rendered(ids, mask)


# ---- teacher shards -------------------------------------------------------------------------------------------------

def _hash(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _shard_is_complete(path: Path, shard_key: str) -> dict[str, str] | None:
    """The metadata of the shard at `path` when it is a whole safetensors file written for `shard_key`."""
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
    except Exception:   # noqa: BLE001 - a truncated or garbled file (safetensors raises its own error type)
        return None
    return meta if meta.get("shard_key") == shard_key else None


TEACHER_FIELDS = ("hidden", "labels", "topk_ids", "topk_logprobs")   # what the target adds to an example's tokens


def token_groups(lengths: Seq[int], batch_tokens: int) -> Iterator[tuple[int, int]]:
    """[i, j) ranges of consecutive sequences of about `batch_tokens` tokens in all (one sequence
    alone when it is longer): what one extractor call takes."""
    i = 0
    while i < len(lengths):
        j, tokens = i, 0
        while j < len(lengths) and (j == i or tokens + lengths[j] <= batch_tokens):
            tokens += lengths[j]
            j += 1
        yield i, j
        i = j


def teacher_rows(model, extractor: FeatureExtractor, sequences: list[list[int]], top_k: int,
                 hidden_dtype: torch.dtype, capture_layers: tuple[int, ...] = ()) -> list[dict[str, torch.Tensor]]:
    """The target's rows of each sequence (teacher forcing), on the CPU: `hidden` [n, H] in
    `hidden_dtype`, `labels` [n] and `topk_ids` [n, k] int32, `topk_logprobs` [n, k] fp32 (see the
    module docstring); with `capture_layers`, `layers` [n, len(capture_layers), H] in `hidden_dtype`
    (the residual streams after those decoder layers). One extractor call for all of them."""
    hidden, layers = extractor.extract(sequences, tuple(capture_layers))
    ids, logprobs = target_topk(model, torch.cat(hidden), max(top_k, 1))
    rows, a = [], 0
    for i, h in enumerate(hidden):
        b = a + h.shape[0]
        rows.append({"hidden": h.to(device="cpu", dtype=hidden_dtype), "labels": ids[a:b, 0].cpu(),
                     "topk_ids": ids[a:b, :top_k].cpu(), "topk_logprobs": logprobs[a:b, :top_k].float().cpu()})
        if layers is not None:
            rows[-1]["layers"] = layers[i].to(device="cpu", dtype=hidden_dtype)
        a = b
    return rows


def teacher_build_config(model, tokenizer, *, max_len: int, top_k: int, hidden_dtype: torch.dtype,
                         eos_token_id: int | None) -> dict[str, Any]:
    """What the content of teacher shards depends on besides the examples."""
    template = getattr(tokenizer, "chat_template", None) or ""
    return {"format_version": SHARD_FORMAT_VERSION, "target_fingerprint": target_fingerprint(model.cfg, model),
            "max_len": max_len, "top_k": top_k, "hidden_dtype": str(hidden_dtype).removeprefix("torch."),
            "eos_token_id": tokenizer.eos_token_id if eos_token_id is None else eos_token_id,
            "chat_template": hashlib.sha256(template.encode()).hexdigest()[:16],
            "vocab_size": model.cfg.vocab_size, "hidden_size": model.cfg.hidden_size}


def build_teacher_shards(model, tokenizer, examples: Seq[Example], out_dir: str | os.PathLike, *, max_len: int = 512,
                         shard_size: int = 256, top_k: int = 8, device: torch.device | str | None = None,
                         batch_tokens: int = 4096, hidden_dtype: torch.dtype = torch.float16,
                         eos_token_id: int | None = None, target_name: str | None = None,
                         progress: bool = True) -> dict[str, Any]:
    """Teacher-force `model` (a LlamaModel) over every example and write the shards to `out_dir`;
    returns the manifest (also written to `out_dir/manifest.json`).

    Examples are cut into shards of `shard_size` in the given order. A shard file that exists,
    reads as a whole safetensors file and was written for the same build config and the same
    examples is kept; any other (missing, half-written, stale) is rebuilt. Files are written under a
    temporary name and renamed, so a killed build leaves only whole shards. `batch_tokens` bounds the
    tokens of one target forward."""
    start_time = time.time()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*.tmp"):
        stale.unlink()
    config = teacher_build_config(model, tokenizer, max_len=max_len, top_k=top_k, hidden_dtype=hidden_dtype,
                                  eos_token_id=eos_token_id)
    build_key = _hash(config)
    groups = [list(examples[i:i + shard_size]) for i in range(0, len(examples), shard_size)]
    extractor = FeatureExtractor(model, device, batch_tokens=batch_tokens)
    shards, reused, sources = [], 0, {}
    bar = tqdm(total=len(examples), desc="teacher shards", unit="ex", disable=not progress)
    try:
        for index, group in enumerate(groups):
            name = f"shard-{index:05d}.safetensors"
            shard_key = _hash([build_key, [ex.content_hash() for ex in group]])
            meta = _shard_is_complete(out / name, shard_key)
            if meta is None:
                meta = _write_shard(out / name, group, shard_key, model, tokenizer, extractor, max_len=max_len,
                                    top_k=top_k, hidden_dtype=hidden_dtype, eos_token_id=eos_token_id,
                                    batch_tokens=batch_tokens, bar=bar)
            else:
                reused += 1
                bar.update(len(group))
            for source in json.loads(meta["sources"]):
                sources[source] = sources.get(source, 0) + 1
            shards.append({"file": name, "num_examples": int(meta["num_examples"]),
                           "num_tokens": int(meta["num_tokens"]), "num_answer_tokens": int(meta["num_answer_tokens"]),
                           "num_dropped": int(meta["num_dropped"])})
    finally:
        bar.close()
    for extra in out.glob(SHARD_GLOB):
        if extra.name not in {s["file"] for s in shards}:
            extra.unlink()   # left by an earlier build with more shards
    manifest = {
        "format_version": SHARD_FORMAT_VERSION,
        "build_key": build_key,
        "config": {**config, "shard_size": shard_size, "batch_tokens": batch_tokens},
        "target": {"name": target_name, "fingerprint": config["target_fingerprint"]},
        "num_examples": sum(s["num_examples"] for s in shards),
        "num_dropped": sum(s["num_dropped"] for s in shards),
        "num_tokens": sum(s["num_tokens"] for s in shards),
        "num_answer_tokens": sum(s["num_answer_tokens"] for s in shards),
        "sources": dict(sorted(sources.items())),
        "shards": shards,
        "shards_reused": reused,
        "build_seconds": round(time.time() - start_time, 2),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    write_json(out / MANIFEST, manifest)
    return manifest


def _write_shard(path: Path, group: list[Example], shard_key: str, model, tokenizer, extractor, *, max_len: int,
                 top_k: int, hidden_dtype: torch.dtype, eos_token_id: int | None, batch_tokens: int,
                 bar) -> dict[str, str]:
    """Teacher-force one shard's examples and write it (temporary name, then rename); returns its metadata."""
    rendered, kept = [], []
    for ex in group:
        r = render_example(tokenizer, ex, max_len=max_len, eos_token_id=eos_token_id)
        if r is not None:
            rendered.append(r)
            kept.append(ex)
    hidden_size = model.cfg.hidden_size
    parts: dict[str, list[torch.Tensor]] = {k: [] for k in TEACHER_FIELDS}
    for i, j in token_groups([len(r.input_ids) for r in rendered], batch_tokens):
        rows = teacher_rows(model, extractor, [r.input_ids for r in rendered[i:j]], top_k, hidden_dtype)
        for name in TEACHER_FIELDS:
            parts[name].extend(row[name] for row in rows)
        bar.update(j - i)
    bar.update(len(group) - len(rendered))
    lengths = [len(r.input_ids) for r in rendered]
    offsets = torch.zeros(len(rendered) + 1, dtype=torch.int64)
    if lengths:
        offsets[1:] = torch.tensor(lengths).cumsum(0)
    num_tokens = int(offsets[-1])

    def cat(name, empty):
        return torch.cat(parts[name]) if parts[name] else empty

    tensors = {
        "input_ids": torch.tensor([t for r in rendered for t in r.input_ids], dtype=torch.int32),
        "answer_mask": torch.tensor([m for r in rendered for m in r.answer_mask], dtype=torch.bool),
        "offsets": offsets,
        "hidden": cat("hidden", torch.zeros(0, hidden_size, dtype=hidden_dtype)).contiguous(),
        "labels": cat("labels", torch.zeros(0, dtype=torch.int32)).contiguous(),
        "topk_ids": cat("topk_ids", torch.zeros(0, top_k, dtype=torch.int32)).contiguous(),
        "topk_logprobs": cat("topk_logprobs", torch.zeros(0, top_k, dtype=torch.float32)).contiguous(),
    }
    meta = {"format": "pt", "shard_key": shard_key, "format_version": str(SHARD_FORMAT_VERSION),
            "example_ids": json.dumps([ex.id for ex in kept]), "sources": json.dumps([ex.source for ex in kept]),
            "num_examples": str(len(kept)), "num_dropped": str(len(group) - len(kept)),
            "num_tokens": str(num_tokens), "num_answer_tokens": str(int(tensors["answer_mask"].sum())),
            "top_k": str(top_k), "hidden_size": str(hidden_size)}
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata=meta)
    os.replace(tmp, path)
    return meta


# ---- self-distillation ----------------------------------------------------------------------------------------------

def engine_answers(engine, requests: Iterable[tuple[Any, list[int], SamplingParams]], *, max_in_flight: int,
                   stop=lambda: False) -> Iterator[tuple[Any, list[int]]]:
    """(key, generated token ids) of each request as it finishes, answered by `engine` (a specserve
    LLMEngine: continuous batching, plain decoding) with at most `max_in_flight` requests in it.
    `requests` yields (key, prompt ids, SamplingParams); none is taken once `stop()` is true (the
    requests in flight still finish)."""
    pending, in_flight = iter(requests), {}
    exhausted = False
    while True:
        while not exhausted and len(in_flight) < max_in_flight and not stop():
            item = next(pending, None)
            if item is None:
                exhausted = True
                break
            key, prompt_ids, params = item
            request_id = f"answer-{key}"
            engine.add_request(request_id, prompt_ids, params, drafter="none")
            in_flight[request_id] = (key, [])
        if not in_flight:
            return
        for out in engine.step():
            key, ids = in_flight[out.request_id]
            for delta in out.outputs:
                ids.extend(delta.token_ids)
            if out.finished:
                del in_flight[out.request_id]
                yield key, ids


def self_distill_examples(engine, prompts: Seq[Example], *, max_tokens: int = 256, temperature: float = 0.0,
                          seed: int = 0, max_in_flight: int | None = None, cache_path: str | os.PathLike | None = None,
                          progress: bool = True) -> list[Example]:
    """The target's own answers to `prompts`, generated by `engine` (a specserve LLMEngine) with plain
    decoding: greedy at temperature 0, else sampled with a per-prompt seed (`seed` + its index).
    Returns one Example per prompt that fits the context (same id, turns, source, category),
    with `output` (the text) and `output_ids` (the generated tokens, EOS included when it stopped
    on it).

    `cache_path`: a JSONL file the finished answers are appended to as they come; answers already
    there for the same prompt and settings are reused, so an interrupted run goes on where it stopped."""
    tokenizer = engine.tokenizer
    settings = {"max_tokens": max_tokens, "temperature": temperature, "seed": seed, "model": engine.model_name,
                "vocab": engine.model_config.vocab_size}
    done: dict[str, Example] = {}
    keys = {}
    for i, ex in enumerate(prompts):
        keys[ex.id] = _hash([settings, ex.turns, i if temperature > 0 else 0])
    cache = Path(cache_path) if cache_path is not None else None
    if cache is not None and cache.is_file():
        with cache.open(encoding="utf-8") as f:
            for line in f:
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue   # a line cut by a kill
                if keys.get(row.get("id")) == row.get("key"):
                    done[row["id"]] = Example.from_row(row)
    todo = [(i, ex) for i, ex in enumerate(prompts) if ex.id not in done]
    writer = None
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        writer = cache.open("a", encoding="utf-8")
    bar = tqdm(total=len(prompts), initial=len(prompts) - len(todo), desc="self-distill", unit="ex",
               disable=not progress)
    skipped = 0

    def requests():
        nonlocal skipped
        for i, ex in todo:
            prompt_ids = render_prompt(tokenizer, ex.turns)
            room = engine.max_model_len - len(prompt_ids)
            if room < 1:
                skipped += 1
                bar.update(1)
                continue
            yield i, prompt_ids, SamplingParams(temperature=temperature, max_tokens=min(max_tokens, room),
                                                seed=seed + i if temperature > 0 else None)

    try:
        in_flight = max_in_flight or engine.config.max_num_seqs * 2
        for i, ids in engine_answers(engine, requests(), max_in_flight=in_flight):
            ex = prompts[i]
            text = tokenizer.decode([t for t in ids if t not in engine.eos_token_ids], skip_special_tokens=True)
            result = Example(id=ex.id, turns=list(ex.turns), output=text, source=ex.source, category=ex.category,
                             output_ids=list(ids))
            done[ex.id] = result
            if writer is not None:
                writer.write(json.dumps({**result.to_row(), "key": keys[ex.id]}) + "\n")
                writer.flush()
            bar.update(1)
    finally:
        bar.close()
        if writer is not None:
            writer.close()
    if skipped:
        logger.warning("self-distillation: %d prompts do not fit the context (%d tokens) and were skipped",
                       skipped, engine.max_model_len)
    return [done[ex.id] for ex in prompts if ex.id in done]


# ---- reading examples back -------------------------------------------------------------------------------------------

@dataclass
class _Item:
    example_id: str
    source: str
    shard: int
    start: int          # row of the example's first token in its shard
    length: int


def prompt_key(example_id: str) -> str:
    """The prompt an example id answers: a distilled answer's id is `<prompt id>@t<T>`
    (drafters/train/distill.py), so the answers of one prompt at several temperatures share it."""
    return example_id.partition("@")[0]


def held_back_ids(ids: Iterable[str], num: int, split_seed: int = 0) -> set[str]:
    """The example ids held back for evaluation: those of the first `num` prompts (`prompt_key`)
    in an order given by a hash of (split_seed, prompt), so the choice does not depend on the order
    or number of the other ids, and no prompt is both trained on and held back."""
    ids = set(ids)
    ranked = sorted({prompt_key(i) for i in ids},
                    key=lambda k: hashlib.sha256(f"{split_seed}:{k}".encode()).hexdigest())
    keep = set(ranked[:num])
    return {i for i in ids if prompt_key(i) in keep}


class Batches:
    """An epoch's batches: iterable (more than once, same order) and sized; `skip(n)` leaves out
    the first n without reading them (a resumed epoch)."""

    def __init__(self, dataset: "ExampleSet", plan: list[list[tuple[int, int, int]]], **kwargs):
        self.dataset, self.plan, self.kwargs = dataset, plan, kwargs

    def __len__(self) -> int:
        return len(self.plan)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for items in self.plan:
            yield self.dataset.collate(items, **self.kwargs)

    def skip(self, n: int) -> "Batches":
        return Batches(self.dataset, self.plan[n:], **self.kwargs)


class ExampleSet:
    """Examples with the target's rows (see the module docstring for the fields), or one split of
    them, read as batches. Where the rows live is a subclass's: `ShardDataset` reads teacher shards,
    `live.LiveDataset` computes them in the training loop.

    A subclass sets `items` (an `_Item` per example; `shard` and `start` locate its rows for
    `_rows`), `top_k`, `hidden_size` and `manifest`, gives an example's answer mask (`answer_of`,
    1 byte a token) and may make the rows of a batch's examples readable at once (`_prepare`)."""

    FIELDS = ("input_ids", "hidden", "labels", "topk_ids", "topk_logprobs", "answer_mask")
    items: list[_Item]
    manifest: dict[str, Any]
    top_k: int
    hidden_size: int
    capture_layers: tuple[int, ...] = ()   # the target's intermediate layers of the `layers` field, if any

    def _split(self, items: list[_Item], split: str, eval_examples: int | None, eval_fraction: float | None,
               split_seed: int) -> None:
        """Keep the `split` ("all", "train" or "eval") of `items`: the eval (held-back) split is the
        examples of `eval_examples` prompts chosen by `held_back_ids` (or `eval_fraction` of them),
        the train split the rest."""
        if split not in ("all", "train", "eval"):
            raise ValueError(f"split must be all, train or eval, got {split!r}")
        all_ids = [it.example_id for it in items]
        if eval_examples is None:
            prompts = {prompt_key(i) for i in all_ids}
            eval_examples = round(len(prompts) * eval_fraction) if eval_fraction else 0
        self.held_back = held_back_ids(all_ids, eval_examples, split_seed)
        if split == "train":
            items = [it for it in items if it.example_id not in self.held_back]
        elif split == "eval":
            items = [it for it in items if it.example_id in self.held_back]
        self.split = split
        self.items = items

    def _rows(self, shard: int, name: str, a: int, b: int) -> torch.Tensor:
        raise NotImplementedError

    def answer_of(self, it: _Item) -> torch.Tensor:
        raise NotImplementedError

    def _prepare(self, items: list[_Item], fields: Iterable[str]) -> None:
        """Make the rows of `fields` of these examples readable (shards: nothing to do)."""

    def __len__(self) -> int:
        return len(self.items)

    @property
    def ids(self) -> list[str]:
        return [it.example_id for it in self.items]

    @property
    def num_tokens(self) -> int:
        return sum(it.length for it in self.items)

    def example(self, index: int, fields: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
        """The rows of one example, unpadded (shard dtypes)."""
        it, fields = self.items[index], tuple(fields or self.FIELDS)
        self._prepare([it], fields)
        return {name: self._rows(it.shard, name, it.start, it.start + it.length) for name in fields}

    def batches(self, batch_tokens: int, *, window: int | None = None, shuffle: bool = True, epoch: int = 0,
                seed: int = 0, fields: Iterable[str] | None = None, device: torch.device | str = "cpu",
                hidden_dtype: torch.dtype = torch.float32, min_loss_tokens: int = 1) -> Batches:
        """One epoch of padded batches of at most `batch_tokens` tokens (rows x padded length).

        Without `window` a batch row is a whole example; with it, examples are cut into windows of
        `window` tokens (the last one shorter) and a row is a window. Pieces with fewer than
        `min_loss_tokens` trained positions are skipped. With `shuffle` the order is seeded by
        (seed, epoch); pieces of similar length are batched together (within groups of about 32
        batches) to keep padding low, then the batches are shuffled.

        Each batch is a dict: `input_ids`, `labels` [B, L] int64; `hidden` [B, L, H] `hidden_dtype`;
        `topk_ids` [B, L, k] int64, `topk_logprobs` [B, L, k] fp32; `answer_mask`, `loss_mask`
        (answer_mask of the next position) and `valid` (False on padding) [B, L] bool; `positions`
        [B, L] int64 (position within the example, for windows); `lengths` [B]; `ids` (example ids).
        Padding rows hold token 0 and label `PAD_LABEL`."""
        if batch_tokens < 1:
            raise ValueError("batch_tokens must be positive")
        pieces: list[tuple[int, int, int]] = []     # (item, start within the example, length)
        for idx, it in enumerate(self.items):
            mask = self.answer_of(it)
            loss = torch.zeros(it.length, dtype=torch.bool)
            loss[:-1] = mask[1:]
            step = window or it.length
            for a in range(0, it.length, step):
                n = min(step, it.length - a)
                if int(loss[a:a + n].sum()) >= min_loss_tokens:
                    pieces.append((idx, a, n))
        rng = random.Random(seed * 1_000_003 + epoch)
        if shuffle:
            rng.shuffle(pieces)
        plan: list[list[tuple[int, int, int]]] = []
        group = max(1, 32 * max(1, batch_tokens // max(1, window or 256)))
        for g in range(0, len(pieces), group):
            chunk = pieces[g:g + group]
            if shuffle:
                chunk.sort(key=lambda p: p[2])
            batch: list[tuple[int, int, int]] = []
            longest = 0
            for piece in chunk:
                n = piece[2]
                if batch and max(longest, n) * (len(batch) + 1) > batch_tokens:
                    plan.append(batch)
                    batch, longest = [], 0
                batch.append(piece)
                longest = max(longest, n)
            if batch:
                plan.append(batch)
        if shuffle:
            rng.shuffle(plan)
        return Batches(self, plan, fields=tuple(fields or self.FIELDS), device=torch.device(device),
                       hidden_dtype=hidden_dtype)

    def collate(self, pieces: list[tuple[int, int, int]], *, fields: tuple[str, ...] = FIELDS,
                device: torch.device = torch.device("cpu"),
                hidden_dtype: torch.dtype = torch.float32) -> dict[str, Any]:
        """Pad `pieces` ((item, start, length) triples) into one batch (see `batches`)."""
        rows, width = len(pieces), max(p[2] for p in pieces)
        self._prepare([self.items[p[0]] for p in pieces], fields)
        out: dict[str, Any] = {
            "valid": torch.zeros(rows, width, dtype=torch.bool),
            "answer_mask": torch.zeros(rows, width, dtype=torch.bool),
            "loss_mask": torch.zeros(rows, width, dtype=torch.bool),
            "positions": torch.zeros(rows, width, dtype=torch.int64),
            "lengths": torch.tensor([p[2] for p in pieces], dtype=torch.int64),
            "ids": [self.items[p[0]].example_id for p in pieces],
        }
        if "input_ids" in fields:
            out["input_ids"] = torch.zeros(rows, width, dtype=torch.int64)
        if "labels" in fields:
            out["labels"] = torch.full((rows, width), PAD_LABEL, dtype=torch.int64)
        if "hidden" in fields:
            out["hidden"] = torch.zeros(rows, width, self.hidden_size, dtype=hidden_dtype)
        if "topk_ids" in fields:
            out["topk_ids"] = torch.full((rows, width, self.top_k), PAD_LABEL, dtype=torch.int64)
        if "topk_logprobs" in fields:
            out["topk_logprobs"] = torch.zeros(rows, width, self.top_k, dtype=torch.float32)
        if "layers" in fields:
            if not self.capture_layers:
                raise ValueError("these examples hold no intermediate layers of the target (teacher shards never "
                                 "do; live rows only when made with capture_layers)")
            out["layers"] = torch.zeros(rows, width, len(self.capture_layers), self.hidden_size, dtype=hidden_dtype)
        for r, (idx, a, n) in enumerate(pieces):
            it = self.items[idx]
            lo = it.start + a
            out["valid"][r, :n] = True
            out["positions"][r, :n] = torch.arange(a, a + n)
            end = min(it.length, a + n + 1)    # one more row for the next token's answer mask
            mask = self.answer_of(it)[a:end]
            out["answer_mask"][r, :n] = mask[:n]
            out["loss_mask"][r, :mask.shape[0] - 1] = mask[1:]
            for name in ("input_ids", "labels", "hidden", "topk_ids", "topk_logprobs", "layers"):
                if name in fields:
                    out[name][r, :n] = self._rows(it.shard, name, lo, lo + n).to(out[name].dtype)
        return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in out.items()}

    def data_summary(self) -> dict[str, Any]:
        """What checkpoint metadata records about the data (this split)."""
        counts: dict[str, int] = {}
        for it in self.items:
            counts[it.source] = counts.get(it.source, 0) + 1
        return {"split": self.split, "num_examples": len(self.items), "num_tokens": self.num_tokens,
                "sources": dict(sorted(counts.items())), "held_back": len(self.held_back),
                "shards_build_key": self.manifest.get("build_key")}


class ShardDataset(ExampleSet):
    """The examples of a teacher-shard folder (`build_teacher_shards`), or one split of them (see
    `ExampleSet._split`). Shards are read lazily (safetensors slices), never all at once."""

    def __init__(self, shard_dir: str | os.PathLike, *, split: str = "all", eval_examples: int | None = None,
                 eval_fraction: float | None = None, split_seed: int = 0):
        self.dir = Path(shard_dir)
        manifest = self.dir / MANIFEST
        if not manifest.is_file():
            raise FileNotFoundError(f"{self.dir} holds no complete shard build ({MANIFEST} missing); "
                                    "run build_teacher_shards first")
        self.manifest = json.loads(manifest.read_text(encoding="utf-8"))
        self._files = [self.dir / s["file"] for s in self.manifest["shards"]]
        self._handles: dict[int, Any] = {}
        items: list[_Item] = []
        self._answer: list[torch.Tensor] = []      # answer_mask of every shard (1 byte a token), for planning
        for shard, path in enumerate(self._files):
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata()
                offsets = f.get_tensor("offsets").tolist()
                self._answer.append(f.get_tensor("answer_mask"))
            for eid, source, a, b in zip(json.loads(meta["example_ids"]), json.loads(meta["sources"]),
                                         offsets, offsets[1:]):
                items.append(_Item(eid, source, shard, a, b - a))
        self.top_k = int(self.manifest["config"]["top_k"])
        self.hidden_size = int(self.manifest["config"]["hidden_size"])
        self._split(items, split, eval_examples, eval_fraction, split_seed)

    def _file(self, shard: int):
        handle = self._handles.get(shard)
        if handle is None:
            handle = self._handles[shard] = safe_open(str(self._files[shard]), framework="pt")
        return handle

    def _rows(self, shard: int, name: str, a: int, b: int) -> torch.Tensor:
        return self._file(shard).get_slice(name)[a:b]

    def answer_of(self, it: _Item) -> torch.Tensor:
        return self._answer[it.shard][it.start:it.start + it.length]


# ---- the target's label frequencies (the draft vocabulary of head-based drafters) ----------------------------------

def label_ranking(batches: Iterable[dict[str, torch.Tensor]], vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids by how often they are the target's greedy label at trained positions, most
    frequent first, ties by id; the counts in that order)."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for batch in batches:
        labels = batch["topk_ids"][..., 0][batch["loss_mask"].bool()].long().cpu()
        counts += torch.bincount(labels[labels >= 0], minlength=vocab_size)[:vocab_size]
    order = torch.argsort(-counts, stable=True)
    return order, counts[order]


def rank_coverage(rank: torch.Tensor, batches: Iterable[dict[str, torch.Tensor]],
                  sizes=(2048, 4096, 8192, 16384)) -> dict[int, float]:
    """Fraction of the (held-back) labels inside the first N ranked tokens, for each N."""
    pos = torch.empty_like(rank)
    pos[rank] = torch.arange(rank.numel())
    found = []
    for batch in batches:
        labels = batch["topk_ids"][..., 0][batch["loss_mask"].bool()].long().cpu()
        found.append(pos[labels[labels >= 0]])
    found = torch.cat(found) if found else torch.zeros(0, dtype=torch.long)
    return {n: float((found < n).float().mean()) if found.numel() else 0.0 for n in sizes if n < rank.numel()}


def draft_vocab_ranking(train: "ExampleSet", held_back: "ExampleSet | None", vocab_size: int, *,
                        batch_tokens: int = 8192, rank: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, dict[int, float]]:
    """(the train split's label ranking, the share of held-back labels each draft-vocabulary size
    covers): what head-based drafters save with their weights (see drafters.draft_vocab). With
    `rank` (a ranking kept from elsewhere), that ranking and its coverage."""
    if rank is None:
        rank, _ = label_ranking(train.batches(batch_tokens, shuffle=False, fields=("topk_ids",)), vocab_size)
    coverage = {}
    if held_back is not None and len(held_back):
        coverage = rank_coverage(rank, held_back.batches(batch_tokens, shuffle=False, fields=("topk_ids",)))
    return rank, coverage
