"""What `specserve train DRAFTER` runs: load the target, build (or reuse) the distillation shards --
or, with `--features live` (the default for `--distilled` answers), keep token ids only and compute
the target's rows in the training loop (live.py) -- split them, call the drafter's registered trainer.

    run_training("medusa", {"model": "default", "data": None, "out": "ckpt/medusa", "epochs": 3, ...})

Shards and self-distilled answers are cached under `cache_dir` (default ``$SPECSERVE_CACHE/train``)
in folders named by the target's fingerprint and a hash of everything that shapes them, so a
second run with the same data settings reuses them, and an interrupted build resumes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from pathlib import Path
from typing import Any, Mapping

import torch

from specserve.drafters.base import parse_option_value
from specserve.drafters.nets.checkpoint import target_fingerprint
from specserve.drafters.train import TrainData, TrainTarget, get_trainer
from specserve.drafters.train.data import (Example, ShardDataset, balance_by_source, build_teacher_shards,
                                           load_prompt_pool, render_example, self_distill_examples,
                                           teacher_build_config)
from specserve.drafters.train.distill import read_folders
from specserve.drafters.train.live import LiveDataset, LiveFeatures
from specserve.engine.config import EngineConfig, ModelConfig
from specserve.engine.core import LLMEngine
from specserve.engine.loader import _cache_root as specserve_cache, load_model
from specserve.engine.model import LlamaModel

logger = logging.getLogger("specserve")

DEFAULTS: dict[str, Any] = dict(
    model="default", data=None, prompt_field=None, messages_field=None, out=None, epochs=None, lr=None,
    batch_tokens=8192, max_examples=4000, max_len=512,
    device="auto", dtype="auto", seed=0, self_distill=False, self_distill_max_tokens=256, temperature=0.0,
    eval_examples=64, cache_dir=None, top_k=8, shard_size=256, progress=True, distilled=None, features="auto",
    feature_memory_gb=8.0, resume=False,
)
TRAIN_STATE = "train-state.pt"
FEATURES = ("auto", "live", "shards")   # auto: live with --distilled, teacher shards otherwise
# `specserve train distill`'s own flags: not options of a drafter's training
DISTILL_FLAGS = ("temperatures", "max_tokens", "max_num_seqs", "time_limit", "max_prompts", "exclude_answered")


def parse_options(items) -> dict[str, Any]:
    """`["num_heads=4", "tree=eagle"]` -> `{"num_heads": 4, "tree": "eagle"}`."""
    out: dict[str, Any] = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--option expects KEY=VALUE, got {item!r}")
        out[key.strip()] = parse_option_value(value)
    return out


def resolve_device_dtype(device: str = "auto", dtype: str = "auto") -> tuple[torch.device, torch.dtype]:
    cfg = EngineConfig(device=device, dtype=dtype)
    resolved = cfg.resolve_device()
    return resolved, cfg.resolve_dtype(resolved)


def prepare_target(model: str = "default", *, device: str = "auto", dtype: str = "auto",
                   max_positions: int = 4096, loaded=None) -> TrainTarget:
    """Load the target (or use `loaded`) as our frozen LlamaModel on `device`/`dtype`."""
    loaded = loaded or load_model(model)
    dev, dt = resolve_device_dtype(device, dtype)
    cfg = ModelConfig.from_hf(loaded.hf_config)
    max_positions = min(max_positions, cfg.max_position_embeddings)
    net = LlamaModel.from_state_dict(cfg, loaded.state_dict, max_positions=max_positions, dtype=dt, device=dev)
    return TrainTarget(loaded=loaded, model=net, model_config=cfg, fingerprint=target_fingerprint(cfg, net),
                       device=dev, dtype=dt)


def _key(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:12]


def _cache_root(cache_dir) -> Path:
    if cache_dir:
        return Path(cache_dir).expanduser()
    return specserve_cache(None) / "train"


def prepare_data(target: TrainTarget, options: Mapping[str, Any], capture_layers: tuple[int, ...] = ()
                 ) -> TrainData:
    """The prompt pool (balanced), optionally answered by the target itself, turned into teacher
    shards (built or reused) or live rows, split into train and held-back by prompt.
    `capture_layers`: the target's intermediate layers the trainer reads too (live rows only)."""
    o = {**DEFAULTS, **{k: v for k, v in options.items() if v is not None}}
    features = o["features"] if o["features"] != "auto" else ("live" if o["distilled"] else "shards")
    if features not in FEATURES[1:]:
        raise ValueError(f"--features must be one of {', '.join(FEATURES)}, got {o['features']!r}")
    if capture_layers and features == "shards":
        raise ValueError(f"this drafter reads the target's layers {tuple(capture_layers)}, which teacher shards do not "
                         "hold: train it from --distilled answers or with --features live")
    data = o["data"] if o["data"] not in (None, "default") else None
    if o["distilled"]:   # the served target's own answers (`specserve train distill`)
        if o["self_distill"]:
            raise ValueError("--distilled and --self-distill both name the answers to train on: choose one")
        examples = balance_by_source(read_folders(o["distilled"], data), o["max_examples"], o["seed"])
    else:
        examples = load_prompt_pool(data, max_examples=o["max_examples"], seed=o["seed"],
                                    require_output=not o["self_distill"], prompt_field=o["prompt_field"],
                                    messages_field=o["messages_field"])
    if not examples:
        raise ValueError("the prompt pool is empty (no row with a reference answer; try --self-distill)")
    if features == "live":
        if o["self_distill"]:
            raise ValueError("--features live trains on --distilled answers or the pool's own; "
                             "--self-distill builds teacher shards (use --features shards)")
        return live_data(target, examples, o, capture_layers)
    safe_name = re.sub(r"[^\w.-]+", "_", target.name)
    root = _cache_root(o["cache_dir"]) / f"{safe_name}-{target.fingerprint}"
    self_distill = None
    if o["self_distill"]:
        self_distill = {"max_tokens": o["self_distill_max_tokens"], "temperature": o["temperature"],
                        "seed": o["seed"]}
        engine = LLMEngine(EngineConfig(model=str(o["model"]), device=str(target.device),
                                        dtype=str(target.dtype).removeprefix("torch."), max_model_len=o["max_len"],
                                        max_num_seqs=64, max_num_batched_tokens=2048, seed=o["seed"],
                                        quantization="none"),
                           loaded=target.loaded)
        cache = root / f"self-distill-{_key([self_distill, [ex.content_hash() for ex in examples]])}.jsonl"
        examples = self_distill_examples(engine, examples, max_tokens=o["self_distill_max_tokens"],
                                         temperature=o["temperature"], seed=o["seed"], cache_path=cache,
                                         progress=o["progress"])
        del engine
    shard_key = _key([[ex.content_hash() for ex in examples], o["max_len"], o["top_k"], o["shard_size"]])
    shard_dir = root / f"shards-{shard_key}"
    logger.info("teacher shards for %d examples in %s", len(examples), shard_dir)
    manifest = build_teacher_shards(target.model, target.tokenizer, examples, shard_dir, max_len=o["max_len"],
                                    shard_size=o["shard_size"], top_k=o["top_k"], device=target.device,
                                    batch_tokens=o["batch_tokens"], target_name=target.name, progress=o["progress"])
    if self_distill is not None:
        manifest["self_distill"] = self_distill
    train = ShardDataset(shard_dir, split="train", eval_examples=o["eval_examples"])
    held_back = ShardDataset(shard_dir, split="eval", eval_examples=o["eval_examples"])
    return _with_train_split(TrainData(shard_dir=shard_dir, manifest=manifest, train=train, held_back=held_back,
                                       examples=examples), o["eval_examples"])


def _with_train_split(data: TrainData, eval_examples: int) -> TrainData:
    """`data`, unless holding back the examples of `eval_examples` prompts left nothing to train on."""
    if not len(data.train):
        raise ValueError(f"--eval-examples {eval_examples} leaves nothing to train on "
                         f"({data.manifest['num_examples']} examples)")
    return data


def live_data(target: TrainTarget, examples: list[Example], o: Mapping[str, Any],
              capture_layers: tuple[int, ...] = ()) -> TrainData:
    """`examples` rendered to token ids, their target rows computed in the training loop (live.py),
    split into train and held-back by prompt."""
    folders = _folder_list(o["distilled"])
    config = teacher_build_config(target.model, target.tokenizer, max_len=o["max_len"], top_k=o["top_k"],
                                  hidden_dtype=torch.float16, eos_token_id=None)
    if capture_layers:   # the rows hold these layers too
        config["capture_layers"] = list(capture_layers)
    kept, rendered, sources = [], [], {}
    for ex in examples:
        r = render_example(target.tokenizer, ex, max_len=o["max_len"])
        if r is not None:
            kept.append(ex)
            rendered.append(r)
            sources[ex.source] = sources.get(ex.source, 0) + 1
    manifest = {"format": "live", "build_key": _key([config, [ex.content_hash() for ex in kept]]),
                "config": config, "target": {"name": target.name, "fingerprint": target.fingerprint},
                "num_examples": len(kept), "num_dropped": len(examples) - len(kept),
                "num_tokens": sum(len(r.input_ids) for r in rendered),
                "num_answer_tokens": sum(r.num_answer_tokens for r in rendered),
                "sources": dict(sorted(sources.items())),
                "distilled": folders[0] if len(folders) == 1 else (folders or None)}
    features = LiveFeatures(target.model, [r.input_ids for r in rendered], top_k=o["top_k"], device=target.device,
                            batch_tokens=o["batch_tokens"], memory_bytes=int(o["feature_memory_gb"] * (1 << 30)),
                            capture_layers=capture_layers)
    split = dict(manifest=manifest, eval_examples=o["eval_examples"], split_seed=0)
    train = LiveDataset(features, kept, rendered, split="train", **split)
    held_back = LiveDataset(features, kept, rendered, split="eval", **split)
    logger.info("%d examples (%d tokens) as token ids; the target's rows are computed in the training loop",
                len(kept), manifest["num_tokens"])
    folder = Path(folders[0] if folders else ".").expanduser()   # the first answers' folder
    return _with_train_split(TrainData(shard_dir=folder, manifest=manifest, train=train, held_back=held_back,
                                       examples=kept), o["eval_examples"])


def _folder_list(distilled) -> list[str]:
    """The `--distilled` folder(s): one path or several, as a list (empty without)."""
    if not distilled:
        return []
    return [str(distilled)] if isinstance(distilled, (str, os.PathLike)) else [str(f) for f in distilled]


def run_training(drafter: str, options: Mapping[str, Any], *, target: TrainTarget | None = None) -> Path:
    """Train `drafter` end to end; returns its checkpoint folder. `options`: see DEFAULTS, plus the
    drafter's own options (passed through to its trainer)."""
    trainer = get_trainer(drafter)          # an unknown name fails before anything is loaded
    o = {**DEFAULTS, **{k: v for k, v in options.items() if v is not None}}
    if not o.get("out"):
        raise ValueError("an output folder is needed (--out DIR)")
    torch.manual_seed(o["seed"])
    target = target or prepare_target(str(o["model"]), device=o["device"], dtype=o["dtype"],
                                      max_positions=max(o["max_len"], 512))
    # a trainer that logs its own data (e.g. mcsd-decision) sets `needs_teacher_shards = False`; one
    # that reads intermediate layers (eagle3) sets `capture_layers(model_config, options) -> layers`
    layers = getattr(trainer, "capture_layers", None)
    layers = tuple(layers(target.model_config, o)) if layers is not None else ()
    data = prepare_data(target, o, layers) if getattr(trainer, "needs_teacher_shards", True) else None
    out = Path(o["out"]).expanduser()
    # trainers see concrete values: the folder, the target's device and dtype ("auto" resolved)
    o.update(out=out, device=str(target.device), dtype=str(target.dtype).removeprefix("torch."))
    # the loop saves its state here (every few minutes, and at max_seconds); --resume continues it
    o.setdefault("state_path", str(out / TRAIN_STATE))
    if data is not None:
        logger.info("training %s for %s (%d train / %d held-back examples) -> %s", drafter, target.name,
                    len(data.train), len(data.held_back), out)
    result = trainer(dict(o), target, data)
    return Path(result) if result is not None else out


def options_from_namespace(args) -> dict[str, Any]:
    """`specserve train` arguments as the options dict trainers get (``--option`` entries merged in)."""
    values = {k: v for k, v in vars(args).items()
              if k not in ("func", "option", "command", "drafter", "log_level", *DISTILL_FLAGS)}
    extra = parse_options(getattr(args, "option", None))
    clash = sorted(set(extra) & set(values))
    if clash:
        raise ValueError(f"--option {', '.join(clash)}: use the command's own flag instead")
    values.update(extra)
    if values.get("data") == "default":
        values["data"] = None
    return values


__all__ = ["DEFAULTS", "prepare_target", "prepare_data", "run_training", "options_from_namespace", "parse_options",
           "resolve_device_dtype"]
