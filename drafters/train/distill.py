"""`specserve train distill`: the served target answers the prompt pool, through the engine itself,
into compact shards that later runs continue and every trainer can read.

    specserve train distill --out data/distill [--temperatures 0 0.7] [--max-tokens 512]
                            [--max-num-seqs 32] [--time-limit 3600] [--max-prompts N]

* **The served target.** The answers come from `LLMEngine` as `specserve serve` runs the model
  (its quantization, its KV cache, the model's chat template), plain decoding with continuous
  batching of `--max-num-seqs` streams: the fastest path of the machine it runs on (CPU or GPU,
  the same command). A drafter is lossless against the target actually served, so it is trained on
  that target's own answers.
* **Greedy and sampled answers.** For each temperature T, every prompt is answered once: greedy at
  T = 0, else sampled with the prompt's own seed (`--seed` + its row index), so a run is
  reproducible whatever the batching.
* **Shards hold ids only**: per shard, the prompts' row indices in the pool file, and the answers'
  token ids (uint16, `np.savez_compressed`) with offsets. The prompts stay in the pool (the shared
  data folder); a reader renders them again with the same chat template. A few hundred thousand
  answer tokens take a few MB, so shards may be committed and reused on another machine.
* **Resumable.** `manifest.json` names the target (its fingerprint), the pool (path, row count and
  content hash) and the settings; a run with the same ones answers only the prompts no shard holds
  yet, in the same order (round-robin over the pool's sources, so any prefix is balanced), and
  writes a shard every `--shard-size` answers (atomically: a killed run loses at most the answers
  of the shard it was filling). A run with other settings is refused: choose another --out. A pool
  that only grew at its end (`specserve train prompts` run again) is the same pool: its new rows
  are answered too.
* **Time cap.** `--time-limit` stops taking new prompts after that many seconds; the answers in
  flight are finished and written.
* **Beside other folders.** `--exclude-answered DIR ...` skips the prompts those distill folders
  (the same pool) answered at a temperature already: a machine whose served target differs (a GPU
  serves the weights in bf16, a CPU the GGUF's int4 tensors, so the settings differ and the folder
  cannot be continued there) answers the rest of the pool into a folder of its own, and a trainer
  reads both (`--distilled A B`) without a prompt answered twice.

Every run appends its generation speed (answer tokens per second, device, streams) to the manifest.
`read_answers` gives the answers back as `Example`s (`output_ids` set) for `build_teacher_shards`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Sequence as Seq

import numpy as np

from specserve.drafters.train.data import (DEFAULT_POOL, Example, balance_by_source, default_pool_path,
                                           engine_answers, read_examples, render_prompt, write_json)

logger = logging.getLogger("specserve")

FORMAT = 1
MANIFEST = "manifest.json"
DEFAULT_TEMPERATURES = (0.0, 0.7)


@dataclass
class DistillOptions:
    out: str
    model: str = "default"
    data: str | None = None               # the pool: a file or a folder holding train_prompts.jsonl
    temperatures: tuple[float, ...] = DEFAULT_TEMPERATURES
    max_tokens: int = 512
    max_num_seqs: int = 32
    shard_size: int = 256
    time_limit: float | None = None        # seconds
    max_prompts: int | None = None         # per temperature, in the pool's balanced order
    exclude: tuple[str, ...] = ()          # distill folders whose answered prompts are skipped
    seed: int = 0
    device: str = "auto"
    progress: bool = True


def pool_path(data: str | None) -> Path:
    path = Path(data).expanduser() if data not in (None, "default") else default_pool_path()
    return path / DEFAULT_POOL if path.is_dir() else path


def own_pool(folder: Path) -> Path | None:
    """The prompt pool a distill folder holds itself (`specserve train prompts` wrote it there), if any."""
    path = folder / DEFAULT_POOL
    return path if path.is_file() else None


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def pool_identity(path: Path) -> dict[str, Any]:
    return {"file": path.name, "sha256": _digest(path.read_bytes())}


def _shard_name(temperature: float, index: int) -> str:
    return f"t{temperature:g}-{index:05d}.npz"


def _shards(out: Path, temperature: float) -> list[Path]:
    return sorted(out.glob(f"t{temperature:g}-*.npz"))


def read_shard(path: Path) -> dict[int, list[int]]:
    """{pool row index: answer token ids} of one shard."""
    with np.load(path) as z:
        rows, offsets, tokens = z["prompt_index"], z["offsets"], z["tokens"]
        return {int(r): tokens[offsets[i]:offsets[i + 1]].astype(np.int64).tolist() for i, r in enumerate(rows)}


def _shard_index(path: Path) -> tuple[list[int], int]:
    """(the pool rows a shard answers, its answer tokens), without decompressing the tokens."""
    with np.load(path) as z:
        return z["prompt_index"].tolist(), int(z["offsets"][-1])


def _write_shard(path: Path, answers: list[tuple[int, list[int]]], temperature: float) -> None:
    lengths = [len(ids) for _, ids in answers]
    tmp = path.with_suffix(".tmp.npz")
    np.savez_compressed(tmp, prompt_index=np.array([r for r, _ in answers], dtype=np.int32),
                        offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
                        tokens=np.array([t for _, ids in answers for t in ids], dtype=np.uint16),
                        temperature=np.float32(temperature))
    os.replace(tmp, path)


def read_answers(out: str | os.PathLike, data: str | None = None,
                 temperatures: Seq[float] | None = None) -> list[Example]:
    """The answers of a distill folder as `Example`s (the pool's turns, `output_ids` the answer), in
    shard order, for every temperature (or those given). The pool must be the one they answered: the
    folder's own `train_prompts.jsonl` when it holds one, else `data`."""
    out = Path(out)
    manifest = json.loads((out / MANIFEST).read_text())
    path = own_pool(out) or pool_path(data)
    if pool_identity(path) != manifest["pool"] and not _grown(path, manifest):
        raise ValueError(f"{out} answered another prompt pool than {path} (its content differs)")
    pool = read_examples(path)
    examples = []
    for t in (temperatures if temperatures is not None else manifest["temperatures"]):
        for shard in _shards(out, t):
            for row, ids in read_shard(shard).items():
                ex = pool[row]
                examples.append(Example(id=f"{ex.id}@t{t:g}", turns=list(ex.turns), source=ex.source,
                                        category=ex.category, output_ids=ids))
    return examples


def read_folders(folders: str | os.PathLike | Seq[str | os.PathLike], data: str | None = None) -> list[Example]:
    """`read_answers` of one distill folder or of several in turn; ValueError when two of them
    answered one prompt at one temperature (distill the later one with `--exclude-answered`)."""
    folders = [folders] if isinstance(folders, (str, os.PathLike)) else list(folders)
    examples, seen = [], {}
    for folder in folders:
        for ex in read_answers(folder, data):
            if ex.id in seen:
                raise ValueError(f"{seen[ex.id]} and {folder} both answered {ex.id!r}: distill the later folder "
                                 f"with --exclude-answered {seen[ex.id]}")
            seen[ex.id] = folder
            examples.append(ex)
    return examples


def _answered(folder: Path, temperature: float) -> set[int]:
    """The pool rows that `folder`'s shards answered at `temperature`."""
    return {row for shard in _shards(folder, temperature) for row in _shard_index(shard)[0]}


def answered_rows(folders: Seq[str | os.PathLike], pool: dict[str, Any], temperatures: Seq[float]
                  ) -> dict[float, set[int]]:
    """Per temperature, the pool rows that the distill `folders` answered; ValueError when one of
    them answered another pool (`pool`: `pool_identity` of this one) or is no distill folder."""
    rows: dict[float, set[int]] = {t: set() for t in temperatures}
    for folder in map(Path, folders):
        path = folder / MANIFEST
        if not path.is_file():
            raise ValueError(f"{folder} is not a `specserve train distill` folder (no {MANIFEST})")
        if json.loads(path.read_text())["pool"] != pool:
            raise ValueError(f"{folder} answered another prompt pool (its content differs)")
        for t in temperatures:
            rows[t] |= _answered(folder, t)
    return rows


def _grown(pool: Path, manifest: dict[str, Any]) -> bool:
    """Whether `pool` is the pool `manifest` answered with rows appended after it (as `specserve
    train prompts` grows a folder's own pool): its first `manifest["rows"]` lines hash as it did."""
    lines, rows = pool.read_bytes().splitlines(keepends=True), manifest.get("rows", 0)
    return len(lines) > rows and _digest(b"".join(lines[:rows])) == manifest["pool"]["sha256"]


def _check_manifest(out: Path, settings: dict[str, Any], pool: Path) -> dict[str, Any]:
    """The folder's manifest, made if new; ValueError when it was made with other settings (a pool
    that only grew at its end is the same one: its new rows are answered too)."""
    path = out / MANIFEST
    if path.is_file():
        manifest = json.loads(path.read_text())
        if manifest.get("pool") != settings["pool"] and _grown(pool, manifest):
            manifest["pool"], manifest["rows"] = settings["pool"], settings["rows"]
        differ = [k for k, v in settings.items() if k != "temperatures" and manifest.get(k) != v]
        if differ:
            raise ValueError(f"{out} holds answers made with other settings ({', '.join(differ)}): choose another "
                             f"--out, or the same settings to continue it")
        manifest["temperatures"] = sorted(set(manifest["temperatures"]) | set(settings["temperatures"]))
        return manifest
    return {"format": FORMAT, **settings, "runs": []}


def _past(deadline: float | None) -> bool:
    return deadline is not None and time.monotonic() >= deadline


def distill(options: DistillOptions) -> dict[str, Any]:
    """Answer the pool (see the module docstring); returns this run's report."""
    from tqdm.auto import tqdm

    from specserve.drafters.nets.checkpoint import target_fingerprint
    from specserve.engine.config import EngineConfig
    from specserve.engine.core import LLMEngine
    from specserve.engine.sampling_params import SamplingParams

    if options.max_tokens < 1 or options.max_num_seqs < 1 or options.shard_size < 1:
        raise ValueError("--max-tokens, --max-num-seqs and --shard-size must be positive")
    out = Path(options.out)
    path = pool_path(options.data)
    pool = read_examples(path)
    order = {ex.id: i for i, ex in enumerate(pool)}
    if len(order) != len(pool):
        raise ValueError(f"{path}: example ids repeat; rows could not be told apart")
    pool_id = pool_identity(path)
    excluded = answered_rows(options.exclude, pool_id, options.temperatures)   # checked before the model loads
    engine = LLMEngine(EngineConfig(model=options.model, drafters=(), device=options.device,
                                    max_num_seqs=options.max_num_seqs, seed=options.seed))
    if engine.model_config.vocab_size > 65536:
        raise ValueError("answers are stored as uint16: a vocabulary above 65536 tokens does not fit")
    settings = {"model": engine.model_name, "fingerprint": target_fingerprint(engine.model_config, engine.model),
                "pool": pool_id, "rows": len(pool), "max_tokens": options.max_tokens, "seed": options.seed,
                "quantization": engine.quantization, "temperatures": sorted(options.temperatures)}
    out.mkdir(parents=True, exist_ok=True)
    manifest = _check_manifest(out, settings, path)
    balanced = [order[ex.id] for ex in balance_by_source(pool, None, options.seed)]
    deadline = time.monotonic() + options.time_limit if options.time_limit is not None else None
    report = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "device": str(engine.device),
              "max_num_seqs": options.max_num_seqs, "answers": 0, "tokens": 0, "seconds": 0.0, "skipped": 0}
    if options.exclude:
        report["excluded"] = [str(f) for f in options.exclude]
    t_start = time.perf_counter()
    for temperature in sorted(options.temperatures):
        shards = _shards(out, temperature)
        done = _answered(out, temperature) | excluded[temperature]
        wanted = balanced[:options.max_prompts] if options.max_prompts else balanced
        todo = [row for row in wanted if row not in done]
        next_shard = len(shards)
        pending: list[tuple[int, list[int]]] = []
        bar = tqdm(total=len(wanted), initial=len(wanted) - len(todo), desc=f"distill T={temperature:g}",
                   unit="answer", disable=not options.progress)

        def requests(temperature=temperature, todo=todo):
            for row in todo:
                prompt = render_prompt(engine.tokenizer, pool[row].turns)
                room = engine.max_model_len - len(prompt)
                if room < 1:
                    report["skipped"] += 1
                    continue
                yield row, prompt, SamplingParams(temperature=temperature, max_tokens=min(options.max_tokens, room),
                                                  seed=options.seed + row if temperature > 0 else None)

        for row, ids in engine_answers(engine, requests(), max_in_flight=2 * options.max_num_seqs,
                                       stop=lambda: _past(deadline)):
            pending.append((row, ids))
            report["answers"] += 1
            report["tokens"] += len(ids)
            bar.update(1)
            if len(pending) >= options.shard_size:
                _write_shard(out / _shard_name(temperature, next_shard), pending, temperature)
                next_shard, pending = next_shard + 1, []
        if pending:
            _write_shard(out / _shard_name(temperature, next_shard), pending, temperature)
        bar.close()
        if _past(deadline):
            break
    seconds = time.perf_counter() - t_start
    report["seconds"] = round(seconds, 3)
    report["tok_s"] = round(report["tokens"] / seconds, 1) if seconds > 0 else 0.0
    manifest["runs"].append(report)
    index = {f"{t:g}": [_shard_index(s) for s in _shards(out, t)] for t in manifest["temperatures"]}
    manifest["answers"] = {t: sum(len(rows) for rows, _ in shards) for t, shards in index.items()}
    manifest["answer_tokens"] = {t: sum(n for _, n in shards) for t, shards in index.items()}
    write_json(out / MANIFEST, manifest)
    logger.info("distill: %d answers, %d tokens in %.0f s (%.1f tok/s on %s, %d streams); %s", report["answers"],
                report["tokens"], report["seconds"], report["tok_s"], report["device"], options.max_num_seqs,
                ", ".join(f"T={t}: {n} answers" for t, n in manifest["answers"].items()))
    return report
