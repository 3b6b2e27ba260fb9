"""`specserve train prompts`: the served target writes a prompt pool of its own, for the chat it
will be asked to do (Magpie, Xu et al. 2024: an aligned model given only its chat template up to
the user turn writes a user's message).

    specserve train prompts --out DIR [--num-prompts 1000] [--prompt-temperature 1.0]
    specserve train distill --data DIR --out DIR          # then answer them, as any pool

* **Why.** A drafter learns the text it is trained on. The shared pool is mostly T0 tasks and GSM8K
  problems, with almost no open writing, advice or role play, which are most of what a chat server
  is asked (half of MT-Bench). The target's own user turns cover that, and need no third-party
  data: the prompts are the served model's output.
* **How.** Request i is the chat template rendered up to the user's content (the model's default
  system prompt included, as `render_prompt` renders a pool prompt), sampled at
  `--prompt-temperature` with seed `--seed` + i, through `LLMEngine` with continuous batching (as
  distill). A message is kept when the model ended it itself (the end-of-turn token) within
  `--prompt-max-tokens`, has at least `MIN_TOKENS` tokens and was not written before (case and
  spacing ignored).
* **Pool format.** `DIR/train_prompts.jsonl` holds `{id, category, source, turns}` rows (source
  `self-chat`, id `self-chat-<i>`), so distill and every trainer read it as they read the shared
  pool; a distill folder that holds its own `train_prompts.jsonl` is read against it.
* **Resumable.** `DIR/prompts.json` names the target and the settings and counts the requests
  made; a run with the same ones continues after them (rows are written in request order, a block
  of `--max-num-seqs` x 8 requests at a time; those after the last prompt wanted count as not made,
  so a later run with a larger `--num-prompts` uses them), a run with others is refused. `--num-prompts` is
  the number of kept prompts wanted in all; a block that keeps none stops the run.
"""

from __future__ import annotations

import json
import logging
import re
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from specserve.drafters.train.data import DEFAULT_POOL, engine_answers, write_json

logger = logging.getLogger("specserve")

POOL = DEFAULT_POOL
MANIFEST = "prompts.json"
SOURCE = "self-chat"
MIN_TOKENS = 4
_PLACEHOLDER = "\u0001USER\u0001"


@dataclass
class PromptOptions:
    out: str
    model: str = "default"
    num_prompts: int = 1000
    temperature: float = 1.0
    max_tokens: int = 128
    max_num_seqs: int = 32
    seed: int = 0
    time_limit: float | None = None
    device: str = "auto"
    progress: bool = True


def user_turn_prefix(tokenizer) -> list[int]:
    """Token ids of the chat template up to where a user's message starts (the default system
    prompt included); ValueError for a tokenizer without a chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the model's tokenizer has no chat template: it has no user turn to write")
    text = tokenizer.apply_chat_template([{"role": "user", "content": _PLACEHOLDER}], add_generation_prompt=False,
                                         tokenize=False)
    return tokenizer.encode(text[:text.index(_PLACEHOLDER)], add_special_tokens=False)


def _key(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().lower()


def _read_pool(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def _save(path: Path, manifest: dict[str, Any], prompts: int) -> None:
    manifest["prompts"] = prompts
    write_json(path, manifest)


def self_prompts(options: PromptOptions) -> dict[str, Any]:
    """Write (or continue) the target's own prompt pool in `options.out`; returns this run's report."""
    from tqdm.auto import tqdm

    from specserve.drafters.nets.checkpoint import target_fingerprint
    from specserve.engine.config import EngineConfig
    from specserve.engine.core import LLMEngine
    from specserve.engine.sampling_params import SamplingParams

    if options.num_prompts < 1 or options.max_tokens < 1 or options.max_num_seqs < 1:
        raise ValueError("--num-prompts, --prompt-max-tokens and --max-num-seqs must be positive")
    if options.temperature <= 0:
        raise ValueError("--prompt-temperature must be above 0: greedy decoding writes one prompt only")
    out = Path(options.out)
    engine = LLMEngine(EngineConfig(model=options.model, drafters=(), device=options.device,
                                    max_num_seqs=options.max_num_seqs, seed=options.seed))
    prefix = user_turn_prefix(engine.tokenizer)
    ends = engine.eos_token_ids
    settings = {"model": engine.model_name, "fingerprint": target_fingerprint(engine.model_config, engine.model),
                "quantization": engine.quantization, "temperature": options.temperature,
                "max_tokens": options.max_tokens, "seed": options.seed}
    out.mkdir(parents=True, exist_ok=True)
    path = out / MANIFEST
    manifest = json.loads(path.read_text()) if path.is_file() else {**settings, "requests": 0, "runs": []}
    differ = [k for k, v in settings.items() if manifest.get(k) != v]
    if differ:
        raise ValueError(f"{out} holds prompts written with other settings ({', '.join(differ)}): choose another "
                         f"--out, or the same settings to continue it")
    rows = _read_pool(out / POOL)
    seen = {_key(r["turns"][0]) for r in rows}
    deadline = time.monotonic() + options.time_limit if options.time_limit is not None else None
    report = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "device": str(engine.device),
              "requests": 0, "kept": 0, "unfinished": 0, "short": 0, "repeated": 0, "tokens": 0}
    block = 8 * options.max_num_seqs
    bar = tqdm(total=options.num_prompts, initial=min(len(rows), options.num_prompts), desc="prompts",
               unit="prompt", disable=not options.progress)
    t_start = time.perf_counter()
    while len(rows) < options.num_prompts and not (deadline is not None and time.monotonic() >= deadline):
        first = manifest["requests"]
        requests = ((i, list(prefix), SamplingParams(temperature=options.temperature, max_tokens=options.max_tokens,
                                                     seed=options.seed + i)) for i in range(first, first + block))
        written = dict(engine_answers(engine, requests, max_in_flight=2 * options.max_num_seqs))
        report["tokens"] += sum(len(ids) for ids in written.values())
        new, used = [], first + block
        for i in range(first, first + block):
            if len(rows) + len(new) == options.num_prompts:   # enough: the rest count as not made
                used = i
                break
            ids = written[i]
            if not ids or ids[-1] not in ends:
                report["unfinished"] += 1
                continue
            text = engine.tokenizer.decode(ids[:-1], skip_special_tokens=True).strip()
            if len(ids) - 1 < MIN_TOKENS or not text:
                report["short"] += 1
            elif _key(text) in seen:
                report["repeated"] += 1
            else:
                seen.add(_key(text))
                new.append({"id": f"{SOURCE}-{i}", "category": "chat", "source": SOURCE, "turns": [text]})
        with open(out / POOL, "a") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in new)
        rows += new
        manifest["requests"] = used
        report["requests"] += used - first
        report["kept"] += len(new)
        bar.update(len(new))
        _save(path, manifest, len(rows))
        if not new:
            logger.warning("prompts: none of %d requests gave a usable message; stopping (a model that does not end "
                           "its user turn within --prompt-max-tokens cannot write a pool)", block)
            break
    bar.close()
    report["seconds"] = round(time.perf_counter() - t_start, 3)
    report["tok_s"] = round(report["tokens"] / report["seconds"], 1) if report["seconds"] > 0 else 0.0
    manifest["runs"].append(report)
    _save(path, manifest, len(rows))
    logger.info("prompts: %d kept of %d requests (%d unfinished, %d short, %d repeated) in %.0f s, %.1f tok/s; "
                "%d in %s", report["kept"], report["requests"], report["unfinished"], report["short"],
                report["repeated"], report["seconds"], report["tok_s"], len(rows), out / POOL)
    return report
