"""`specserve train` end to end on the tiny Llama with a test-only trainer: the registry, shards
built then reused, self-distillation, the checkpoint written; and τ measured through the engine."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from specserve.drafters.train import (TrainData, TrainTarget, UnknownTrainerError, available_trainers, get_trainer,
                                      register_trainer, unregister_trainer)
from specserve.drafters.nets.checkpoint import (CheckpointMeta, CheckpointMismatchError, describe_device,
                                                 load_checkpoint, save_checkpoint)
from specserve.drafters.train import distill
from specserve.drafters.train.loop import TrainConfig, train
from specserve.drafters.train.pipeline import prepare_data
from specserve.server import cli

NAME = "dummy-test"


class NextNext(nn.Module):
    """Predicts the target's greedy token one further ahead (a one-head Medusa) through the frozen LM head."""

    def __init__(self, lm_head: torch.Tensor, rank: int):
        super().__init__()
        self.lm_head = lm_head                      # shared by reference, never trained
        h = lm_head.shape[1]
        self.down = nn.Linear(h, rank, bias=False)
        self.up = nn.Linear(rank, h, bias=False)
        nn.init.zeros_(self.up.weight)

    def forward(self, hidden):
        return (hidden + self.up(torch.nn.functional.silu(self.down(hidden)))) @ self.lm_head.T


def _loss(module, batch):
    logits = module(batch["hidden"][:, :-1])
    target = batch["labels"][:, 1:]
    mask = batch["loss_mask"][:, 1:] & batch["valid"][:, 1:]
    loss = nn.functional.cross_entropy(logits[mask], target[mask])
    return loss, {"acc": (logits[mask].argmax(-1) == target[mask]).float().mean()}


@pytest.fixture
def dummy_trainer():
    calls = []

    @register_trainer(NAME)
    def trainer(options: dict, target: TrainTarget, data: TrainData):
        calls.append((options, target, data))
        module = NextNext(target.model.lm_head_weight, int(options.get("rank", 8)))

        def eval_fn(m):
            accs = [_loss(m, b)[1]["acc"] for b in data.held_back.batches(512, shuffle=False)]
            return {"tau": 1.0 + float(torch.stack(accs).mean())}

        config = TrainConfig.from_options(options, device=str(target.device), progress=False)
        def epoch(e):
            return data.train.batches(options["batch_tokens"], epoch=e, seed=options["seed"])

        result = train(module, _loss, epoch, eval_fn=eval_fn, config=config)
        tensors = {k: v for k, v in module.state_dict().items() if k != "lm_head"}
        meta = CheckpointMeta(kind=NAME, target_name=target.name, target_fingerprint=target.fingerprint,
                              hyperparams={"rank": module.down.out_features}, data=data.summary(),
                              train_seconds=result.wall_seconds, device=describe_device(target.device),
                              tau=result.best_tau)
        return save_checkpoint(options["out"], tensors, meta)

    yield calls
    unregister_trainer(NAME)


def test_registry(dummy_trainer):
    assert NAME in available_trainers() and get_trainer(NAME).__name__ == "trainer"
    with pytest.raises(UnknownTrainerError, match=f"no trainer for drafter 'nope'; available trainers: .*{NAME}"):
        get_trainer("nope")


def test_unknown_drafter_is_a_clear_error(dummy_trainer, tmp_path, capsys):
    assert cli.main(["train", "nope", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "no trainer for drafter 'nope'" in err and NAME in err
    assert not (tmp_path / "x").exists()


def _argv(tiny_llama_dir, pool_file, tmp_path, out, *extra):
    return ["train", NAME, "--model", str(tiny_llama_dir), "--data", str(pool_file), "--out", str(out),
            "--device", "cpu", "--dtype", "float32", "--max-examples", "10", "--eval-examples", "3",
            "--max-len", "64", "--batch-tokens", "512", "--shard-size", "4", "--top-k", "3", "--epochs", "2",
            "--lr", "0.01", "--cache-dir", str(tmp_path / "cache"), "--option", "rank=4", "--no-progress",
            "--log-level", "warning", *extra]


def test_train_end_to_end(dummy_trainer, tiny_llama_dir, tiny_target, pool_file, tmp_path, capsys):
    out = tmp_path / "ckpt"
    assert cli.main(_argv(tiny_llama_dir, pool_file, tmp_path, out)) == 0
    assert f"checkpoint written to {out}" in capsys.readouterr().out
    options, target, data = dummy_trainer[-1]
    assert (options["epochs"], options["lr"], options["rank"], options["max_len"], options["out"]) == (
        2, 0.01, 4, 64, out)
    assert (options["device"], options["dtype"]) == ("cpu", "float32")
    assert target.fingerprint == tiny_target.fingerprint and target.dtype == torch.float32
    assert (len(data.train), len(data.held_back)) == (7, 3)
    assert len(data.held_back_examples()) == 3
    assert data.manifest["sources"] == {"big": 4, "mid": 4, "small": 2}        # balanced
    assert data.manifest["shards_reused"] == 0 and len(data.manifest["shards"]) == 3
    tensors, meta = load_checkpoint(out, kind=NAME, fingerprint=tiny_target.fingerprint)
    assert set(tensors) == {"down.weight", "up.weight"} and tensors["up.weight"].dtype == torch.bfloat16
    assert meta.hyperparams == {"rank": 4} and meta.data["train_examples"] == 7 and meta.tau >= 1.0
    assert meta.data["sources"] == {"big": 4, "mid": 4, "small": 2} and meta.device == "cpu"
    with pytest.raises(CheckpointMismatchError):
        load_checkpoint(out, kind=NAME, fingerprint="0" * 16)

    # a second run reuses every shard
    assert cli.main(_argv(tiny_llama_dir, pool_file, tmp_path, tmp_path / "ckpt2")) == 0
    _, _, data2 = dummy_trainer[-1]
    assert data2.shard_dir == data.shard_dir and data2.manifest["shards_reused"] == 3


def test_train_with_self_distillation(dummy_trainer, tiny_llama_dir, pool_writer, tmp_path):
    pool = pool_writer(tmp_path / "prompts.jsonl", {"a": 6, "b": 4}, with_output=False)
    out = tmp_path / "ckpt"
    argv = _argv(tiny_llama_dir, pool, tmp_path, out, "--self-distill", "--self-distill-max-tokens", "5")
    assert cli.main(argv) == 0
    _, _, data = dummy_trainer[-1]
    assert data.manifest["self_distill"] == {"max_tokens": 5, "temperature": 0.0, "seed": 0}
    assert all(ex.output_ids and len(ex.output_ids) <= 5 for ex in data.examples)
    assert len(list((tmp_path / "cache").glob("*/self-distill-*.jsonl"))) == 1
    assert (out / "meta.json").is_file()


def test_training_on_distilled_answers(dummy_trainer, tiny_llama_dir, pool_writer, tmp_path):
    pool = pool_writer(tmp_path / "train_prompts.jsonl", {"a": 6, "b": 4}, with_output=False)
    answers = tmp_path / "distill"
    assert cli.main(["train", "distill", "--model", str(tiny_llama_dir), "--data", str(pool), "--out", str(answers),
                     "--device", "cpu", "--max-tokens", "6", "--temperatures", "0", "--no-progress"]) == 0
    out = tmp_path / "ckpt"
    assert cli.main(_argv(tiny_llama_dir, pool, tmp_path, out, "--distilled", str(answers))) == 0
    options, _, data = dummy_trainer[-1]
    assert options["distilled"] == [str(answers)] and "temperatures" not in options
    assert {ex.id for ex in data.examples} <= {f"{s}-{i}@t0" for s, n in (("a", 6), ("b", 4)) for i in range(n)}
    assert len(data.examples) == 10 and all(ex.output_ids for ex in data.examples)
    assert (out / "meta.json").is_file()
    # the target's rows came from the training loop: nothing was cached on disk
    assert data.manifest["format"] == "live" and not (tmp_path / "cache").exists()
    saved = load_checkpoint(out, kind=NAME)[1].data
    assert saved["features"] == "live" and saved["distilled"] == str(answers)
    assert saved["feature_stats"]["computed_tokens"] == data.manifest["num_tokens"]   # once: kept between epochs
    assert options["state_path"] == str(out / "train-state.pt") and options["resume"] is False
    assert not (out / "train-state.pt").exists()                     # a finished run leaves no state behind
    # the same answers through teacher shards, and --resume passed to the loop
    assert cli.main(_argv(tiny_llama_dir, pool, tmp_path, tmp_path / "ckpt2", "--distilled", str(answers),
                          "--features", "shards", "--resume")) == 0
    options, _, shards = dummy_trainer[-1]
    assert shards.manifest["shards"] and shards.train.ids == data.train.ids and options["resume"] is True
    # holding back every prompt leaves nothing to train on, whichever way the rows come
    for features in ("live", "shards"):
        with pytest.raises(ValueError, match="--eval-examples 10 leaves nothing to train on"):
            prepare_data(dummy_trainer[-1][1], {"data": str(pool), "distilled": str(answers), "features": features,
                                                "eval_examples": 10, "max_len": 64, "top_k": 3,
                                                "cache_dir": str(tmp_path / "cache"), "progress": False})
    with pytest.raises(ValueError, match="another prompt pool"):
        distill.read_answers(answers, str(pool_writer(tmp_path / "other.jsonl", {"a": 3}, with_output=False)))


def test_teacher_forcing_needs_reference_answers(dummy_trainer, tiny_llama_dir, pool_writer, tmp_path, capsys):
    pool = pool_writer(tmp_path / "prompts.jsonl", {"a": 3}, with_output=False)
    assert cli.main(_argv(tiny_llama_dir, pool, tmp_path, tmp_path / "ckpt")) == 1
    assert "--self-distill" in capsys.readouterr().err


def test_measure_tau_through_the_engine(tiny_loaded):
    from specserve.drafters.train.data import Example
    from specserve.drafters.train.evaluate import measure_tau
    from specserve.engine.config import EngineConfig
    from specserve.engine.core import LLMEngine

    engine = LLMEngine(EngineConfig(model="tiny", dtype="float32", device="cpu", max_model_len=128, num_kv_blocks=64,
                                    drafters=("ngram",)), loaded=tiny_loaded)
    prompts = [Example(id="a", turns=["the quick brown fox " * 4]), [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]]
    got = measure_tau(engine, prompts, drafter="ngram", max_tokens=16)
    assert got["num_prompts"] == 2 and 2 <= got["num_tokens"] <= 32
    assert got["tau"] == pytest.approx(got["num_tokens"] / got["num_forwards"]) and got["tau"] >= 1.0
    assert 0.0 <= got["alpha"] <= 1.0
    assert got["accepted_per_step"] == pytest.approx(got["num_accepted_tokens"] / got["num_forwards"])


def test_training_on_answers_of_two_folders(dummy_trainer, tiny_llama_dir, pool_writer, tmp_path, capsys):
    """`--distilled A B`: the answers of a folder and of one made beside it (`--exclude-answered`)
    train together; two folders answering one prompt at one temperature are refused."""
    pool = pool_writer(tmp_path / "train_prompts.jsonl", {"a": 6, "b": 4}, with_output=False)
    first, second = tmp_path / "cpu", tmp_path / "gpu"
    base = ["train", "distill", "--model", str(tiny_llama_dir), "--data", str(pool), "--device", "cpu",
            "--max-tokens", "6", "--temperatures", "0", "--no-progress"]
    assert cli.main([*base, "--out", str(first), "--max-prompts", "4"]) == 0
    assert cli.main([*base, "--out", str(second), "--exclude-answered", str(first)]) == 0
    out = tmp_path / "ckpt"
    assert cli.main(_argv(tiny_llama_dir, pool, tmp_path, out, "--distilled", str(first), str(second))) == 0
    options, _, data = dummy_trainer[-1]
    assert sorted(ex.id for ex in data.examples) == sorted(f"{s}-{i}@t0" for s, n in (("a", 6), ("b", 4))
                                                           for i in range(n))
    assert load_checkpoint(out, kind=NAME)[1].data["distilled"] == [str(first), str(second)]
    capsys.readouterr()
    assert cli.main(_argv(tiny_llama_dir, pool, tmp_path, tmp_path / "ckpt2", "--distilled", str(first),
                          str(first))) == 1
    assert "both answered" in capsys.readouterr().err and not (tmp_path / "ckpt2").exists()
