"""The `specserve` command line: parsing only (no model is loaded)."""

from __future__ import annotations

import dataclasses

import pytest

from specserve.server import cli


def test_engine_defaults_match_engine_config():
    from specserve.engine.config import EngineConfig

    defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    assert cli.ENGINE_DEFAULTS == {name: defaults[name] for name in cli.ENGINE_DEFAULTS}


def test_serve_args_build_the_engine_config():
    args = cli.build_parser().parse_args(
        ["serve", "--model", "/m", "--port", "9000", "--dtype", "float32", "--device", "cpu", "--max-num-seqs", "4",
         "--max-model-len", "256", "--num-kv-blocks", "64", "--served-model-name", "tiny", "--api-key", "k"])
    assert (args.port, args.served_model_name, args.api_key, args.host) == (9000, "tiny", "k", "127.0.0.1")
    config = cli._engine_config(args)
    assert (config.model, config.dtype, config.device, config.max_num_seqs, config.max_model_len,
            config.num_kv_blocks, config.max_num_batched_tokens) == ("/m", "float32", "cpu", 4, 256, 64, 512)
    assert config.drafters == ()


def test_drafter_args():
    args = cli.build_parser().parse_args(["serve", "--drafter", "ngram", "--drafter", "none",
                                          "--num-speculative-tokens", "4"])
    config = cli._engine_config(args)
    assert config.drafters == ("ngram", "none") and config.num_speculative_tokens == 4


@pytest.mark.parametrize("source, expected", [("target:4", {"draft_layers": 4}),
                                              ("/models/small", {"draft_model": "/models/small"})])
def test_draft_model_and_drafter_options(source, expected):
    args = cli.build_parser().parse_args(
        ["serve", "--drafter", "draft_model", "--drafter", "ngram", "--draft-model", source,
         "--drafter-option", "draft_model.k_config=4,2,2,1", "--drafter-option", "ngram.max_ngram=3",
         "--drafter-option", "draft_model.deterministic=true"])
    config = cli._engine_config(args)
    assert config.drafter_options == {"draft_model": {"k_config": "4,2,2,1", "deterministic": True, **expected},
                                      "ngram": {"max_ngram": 3}}


@pytest.mark.parametrize("argv, message", [
    (["--drafter-option", "ngram-max=3"], "DRAFTER.KEY=VALUE"),
    (["--drafter-option", "ngram.max_ngram=3"], "not loaded: ngram"),
    (["--drafter", "ngram", "--draft-model", "target:2"], "not loaded: draft_model"),
])
def test_bad_drafter_options_are_clear_errors(argv, message):
    args = cli.build_parser().parse_args(["serve", *argv])
    with pytest.raises(ValueError, match=message):
        cli._engine_config(args)


def test_generate_args():
    args = cli.build_parser().parse_args(["generate", "hi", "--no-chat", "--max-tokens", "5", "--stop", "a",
                                          "--stop", "b"])
    assert (args.prompt, args.chat, args.max_tokens, args.temperature, args.stop) == ("hi", False, 5, 0.0, ["a", "b"])
    assert cli.build_parser().parse_args(["generate", "hi"]).chat is None   # auto: chat when there is a template


@pytest.mark.parametrize("command", ["train"])
def test_placeholder_commands_answer_clearly(command, capsys):
    assert cli.main([command]) == 2
    assert "not available" in capsys.readouterr().err


def test_bench_names_its_benchmarks(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench"])
    assert exc.value.code == 2 and "BENCHMARK" in capsys.readouterr().err
    args = cli.build_parser().parse_args(["bench", "spec", "--num-prompts", "1", "--drafters", "ngram", "mag"])
    assert (args.benchmark, args.args) == ("spec", ["--num-prompts", "1", "--drafters", "ngram", "mag"])
    assert cli.build_parser().parse_args(["bench", "serve"]).args == []


def test_a_command_is_required(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main([])
    assert exc.value.code == 2
