"""Fixtures of the drafter-training tests: the tiny random Llama of tests/conftest.py as a training
target, and a small prompt pool in the shared data folder's format."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

POOL_SOURCES = {"big": 12, "mid": 6, "small": 2}   # rows per source in `pool_file`


@pytest.fixture(scope="session")
def tiny_loaded(tiny_llama_dir):
    from specserve.engine.loader import load_model

    return load_model(str(tiny_llama_dir))


@pytest.fixture(scope="session")
def tiny_target(tiny_loaded):
    """TrainTarget over the tiny Llama: fp32 on the CPU."""
    from specserve.drafters.train.pipeline import prepare_target

    return prepare_target(loaded=tiny_loaded, device="cpu", dtype="float32", max_positions=512)


def write_pool(path: Path, sources: dict[str, int] = POOL_SOURCES, *, with_output: bool = True) -> Path:
    words = ["fox", "dog", "Paris", "France", "world", "hello", "quick", "brown", "lazy", "capital"]
    with path.open("w", encoding="utf-8") as f:
        for source, n in sources.items():
            for i in range(n):
                row = {"id": f"{source}-{i}", "category": "test", "source": source,
                       "turns": [f"What is the {words[i % 10]} of {words[(i * 3) % 10]} number {i}?"]}
                if with_output:
                    row["output"] = " ".join(words[(i + k) % 10] for k in range(3 + i % 5)) + "."
                f.write(json.dumps(row) + "\n")
    return path


@pytest.fixture
def pool_file(tmp_path) -> Path:
    return write_pool(tmp_path / "train_prompts.jsonl")


@pytest.fixture(scope="session")
def pool_writer():
    """`write_pool(path, {source: rows}, with_output=True) -> path`."""
    return write_pool


@pytest.fixture(scope="session")
def tiny_distill(tiny_llama_dir, tmp_path_factory):
    """(TrainTarget, TrainData): self-distilled teacher shards of the tiny Llama (60 prompts, 48
    answer tokens each, top-4, 12 held back), shared by the trainers' tests."""
    import random
    from types import SimpleNamespace

    import torch

    from specserve.drafters.train import TrainData, TrainTarget
    from specserve.drafters.nets.checkpoint import target_fingerprint
    from specserve.drafters.train.data import Example, ShardDataset, build_teacher_shards, self_distill_examples
    from specserve.engine.config import EngineConfig
    from specserve.engine.core import LLMEngine

    rng = random.Random(0)
    words = "the quick brown fox jumps over lazy dog hello world capital of France Paris is what".split()
    prompts = [Example(id=f"p{i}", turns=[" ".join(rng.choice(words) for _ in range(rng.randint(3, 10)))],
                       source=f"s{i % 2}") for i in range(60)]
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", device="cpu", max_model_len=256,
                                    max_num_seqs=16))
    examples = self_distill_examples(engine, prompts, max_tokens=48, progress=False)
    shards = tmp_path_factory.mktemp("tiny_shards")
    manifest = build_teacher_shards(engine.model, engine.tokenizer, examples, shards, max_len=256, top_k=4,
                                    shard_size=32, progress=False)
    data = TrainData(shards, manifest, ShardDataset(shards, split="train", eval_examples=12),
                     ShardDataset(shards, split="eval", eval_examples=12), examples)
    target = TrainTarget(loaded=SimpleNamespace(name="tiny-llama", tokenizer=engine.tokenizer), model=engine.model,
                         model_config=engine.model_config,
                         fingerprint=target_fingerprint(engine.model_config, engine.model),
                         device=torch.device("cpu"), dtype=torch.float32)
    return target, data


@pytest.fixture(scope="session")
def tiny_live(tiny_distill):
    """(TrainTarget, TrainData): the examples of `tiny_distill` as token ids, the target's rows
    computed in the training loop (live.py), the same 12 prompts held back."""
    from specserve.drafters.train import TrainData
    from specserve.drafters.train.pipeline import live_data

    target, shards = tiny_distill
    options = dict(max_len=256, top_k=4, eval_examples=12, batch_tokens=512, feature_memory_gb=1.0, distilled=None)
    return target, live_data(target, shards.examples, options)
