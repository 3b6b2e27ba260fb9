"""The `specserve` command line: parsing only (no model is loaded)."""

from __future__ import annotations

import dataclasses

import pytest

from specserve.server import cli


@pytest.fixture(autouse=True)
def _no_specserve_env(monkeypatch):
    """The defaults below are the built-in ones: the caller's SPECSERVE_* variables must not leak in."""
    for env in cli.ENV_VARS.values():
        monkeypatch.delenv(env, raising=False)


def test_engine_defaults_match_engine_config():
    from specserve.engine.config import EngineConfig

    defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    assert cli.ENGINE_DEFAULTS == {name: defaults[name] for name in cli.ENGINE_DEFAULTS}


def test_quantization_choices_match_the_engine():
    from specserve.engine.quant import ACTIVATIONS, QUANTIZATIONS

    assert cli.QUANTIZATIONS == QUANTIZATIONS and cli.ACTIVATIONS == ACTIVATIONS


def test_kv_cache_dtype_choices_match_the_engine():
    from specserve.engine.config import KV_CACHE_DTYPES

    assert cli.KV_CACHE_DTYPES == KV_CACHE_DTYPES


def test_serve_args_build_the_engine_config():
    args = cli.build_parser().parse_args(
        ["serve", "--model", "/m", "--port", "9000", "--dtype", "float32", "--device", "cpu", "--max-num-seqs", "4",
         "--max-model-len", "256", "--num-kv-blocks", "64", "--served-model-name", "tiny", "--api-key", "k"])
    assert (args.port, args.served_model_name, args.api_key, args.host) == (9000, "tiny", "k", "127.0.0.1")
    config = cli._engine_config(args)
    assert (config.model, config.dtype, config.device, config.max_num_seqs, config.max_model_len,
            config.num_kv_blocks, config.max_num_batched_tokens) == ("/m", "float32", "cpu", 4, 256, 64, 512)
    assert config.drafters == ("auto",)   # speculation by default


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
    (["--drafter", "none", "--drafter-option", "ngram.max_ngram=3"], "not loaded: ngram"),
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


def test_train_args_become_trainer_options():
    from specserve.drafters.train.pipeline import options_from_namespace

    args = cli.build_parser().parse_args(
        ["train", "medusa", "--out", "/ckpt", "--epochs", "5", "--lr", "3e-4", "--batch-tokens", "4096",
         "--max-examples", "100", "--max-len", "256", "--device", "cpu", "--dtype", "float32", "--seed", "7",
         "--self-distill", "--eval-examples", "16", "--cache-dir", "/tmp/c", "--option", "num_heads=4",
         "--option", "full_vocab=true", "--option", "tree=eagle"])
    assert (args.drafter, args.model, args.data, args.self_distill) == ("medusa", "default", "default", True)
    options = options_from_namespace(args)
    assert (options["out"], options["epochs"], options["lr"], options["batch_tokens"], options["max_examples"],
            options["max_len"], options["device"], options["dtype"], options["seed"], options["eval_examples"],
            options["cache_dir"]) == ("/ckpt", 5, 3e-4, 4096, 100, 256, "cpu", "float32", 7, 16, "/tmp/c")
    assert options["data"] is None                     # 'default': the shared data folder
    assert (options["num_heads"], options["full_vocab"], options["tree"]) == (4, True, "eagle")
    assert "func" not in options and "option" not in options


def test_train_option_errors():
    from specserve.drafters.train.pipeline import options_from_namespace

    for bad, message in ((["--option", "epochs=3"], "use the command's own flag"), (["--option", "x"], "KEY=VALUE")):
        args = cli.build_parser().parse_args(["train", "medusa", "--out", "/o", *bad])
        with pytest.raises(ValueError, match=message):
            options_from_namespace(args)


def test_train_needs_a_drafter_and_an_output(capsys):
    for argv in (["train"], ["train", "medusa"]):
        with pytest.raises(SystemExit) as exc:
            cli.main(argv)
        assert exc.value.code == 2
    assert "--out" in capsys.readouterr().err


def test_train_defaults_match_the_pipeline():
    from specserve.drafters.train.pipeline import DEFAULTS

    assert {k: v for k, v in cli.TRAIN_DEFAULTS.items() if k != "data"} == {
        k: DEFAULTS[k] for k in cli.TRAIN_DEFAULTS if k != "data"}
    assert cli.TRAIN_DEFAULTS["data"] == "default" and DEFAULTS["data"] is None


def test_bench_names_its_benchmarks(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench"])
    assert exc.value.code == 2 and "BENCHMARK" in capsys.readouterr().err
    args = cli.build_parser().parse_args(["bench", "spec", "--num-prompts", "1", "--drafters", "ngram", "mag"])
    assert (args.benchmark, args.args) == ("spec", ["--num-prompts", "1", "--drafters", "ngram", "mag"])
    assert cli.build_parser().parse_args(["bench", "serve"]).args == []


@pytest.mark.parametrize("benchmark, option, title", [("spec", "--drafter-option", "Speculative decoding benchmark"),
                                                       ("parity", "--falcon-nocsgd", "Paper parity")])
def test_bench_routes_to_each_benchmark(capsys, benchmark, option, title):
    """`specserve bench NAME --help` reaches that benchmark's own parser."""
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", benchmark, "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert option in out and title in out


def test_a_command_is_required(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main([])
    assert exc.value.code == 2


# ---- environment variables (what the container image and the Kubernetes manifests set) ----------------------------


def test_env_defaults_build_the_engine_config(monkeypatch):
    env = {"SPECSERVE_MODEL": "/models/m", "SPECSERVE_DTYPE": "bfloat16", "SPECSERVE_DEVICE": "cuda:1",
           "SPECSERVE_HOST": "0.0.0.0", "SPECSERVE_PORT": "9001", "SPECSERVE_MAX_NUM_SEQS": "32",
           "SPECSERVE_MAX_MODEL_LEN": "2048", "SPECSERVE_KV_CACHE_MEMORY_GIB": "12.5",
           "SPECSERVE_DRAFTERS": "none, ngram,draft_model", "SPECSERVE_NUM_SPECULATIVE_TOKENS": "6",
           "SPECSERVE_DRAFT_BUDGET": "fixed", "SPECSERVE_DRAFT_MODEL": "target:3",
           "SPECSERVE_DRAFTER_OPTIONS": "draft_model.k_config=4,2,2,1  ngram.max_ngram=3",
           "SPECSERVE_SERVED_MODEL_NAME": "smol", "SPECSERVE_LOG_LEVEL": "warning"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    args = cli.build_parser().parse_args(["serve"])
    assert (args.host, args.port, args.served_model_name, args.log_level) == ("0.0.0.0", 9001, "smol", "warning")
    config = cli._engine_config(args)
    assert (config.model, config.dtype, config.device, config.max_num_seqs, config.max_model_len,
            config.kv_cache_memory_gib, config.num_speculative_tokens, config.draft_budget) == (
        "/models/m", "bfloat16", "cuda:1", 32, 2048, 12.5, 6, "fixed")
    assert config.drafters == ("none", "ngram", "draft_model")
    assert config.drafter_options == {"draft_model": {"k_config": "4,2,2,1", "draft_layers": 3},
                                      "ngram": {"max_ngram": 3}}


def test_flags_override_env(monkeypatch):
    monkeypatch.setenv("SPECSERVE_PORT", "9001")
    monkeypatch.setenv("SPECSERVE_MODEL", "/models/env")
    monkeypatch.setenv("SPECSERVE_DRAFTERS", "ngram,mag")
    monkeypatch.setenv("SPECSERVE_DRAFTER_OPTIONS", "mag.max_tokens=4")
    monkeypatch.setenv("SPECSERVE_DRAFT_BUDGET", "fixed")
    args = cli.build_parser().parse_args(["serve", "--port", "8080", "--model", "/models/flag", "--drafter", "none",
                                          "--drafter", "ngram", "--drafter-option", "ngram.max_ngram=2",
                                          "--draft-budget", "adaptive"])
    config = cli._engine_config(args)
    assert (args.port, config.model, config.draft_budget) == (8080, "/models/flag", "adaptive")
    # a repeated flag replaces the variable's list, it does not extend it
    assert config.drafters == ("none", "ngram") and config.drafter_options == {"ngram": {"max_ngram": 2}}


def test_empty_env_counts_as_unset(monkeypatch):
    for env in ("SPECSERVE_PORT", "SPECSERVE_MAX_MODEL_LEN", "SPECSERVE_DRAFTERS", "SPECSERVE_HOST"):
        monkeypatch.setenv(env, "")
    args = cli.build_parser().parse_args(["serve"])
    assert (args.port, args.host, args.max_model_len, args.drafters) == (8000, "127.0.0.1", None, None)


def test_engine_env_applies_to_generate(monkeypatch):
    monkeypatch.setenv("SPECSERVE_MODEL", "/models/m")
    monkeypatch.setenv("SPECSERVE_DRAFTERS", "ngram")
    config = cli._engine_config(cli.build_parser().parse_args(["generate", "hi"]))
    assert (config.model, config.drafters) == ("/models/m", ("ngram",))


@pytest.mark.parametrize("env, value, message", [
    ("SPECSERVE_PORT", "eighty", "SPECSERVE_PORT='eighty': invalid value for --port"),
    ("SPECSERVE_DTYPE", "fp8", "SPECSERVE_DTYPE='fp8': invalid value for --dtype: expected one of auto"),
    ("SPECSERVE_PREPACK_WEIGHTS", "maybe", "SPECSERVE_PREPACK_WEIGHTS='maybe'"),
])
def test_bad_env_values_are_clear_errors(monkeypatch, capsys, env, value, message):
    monkeypatch.setenv(env, value)
    with pytest.raises(SystemExit) as exc:
        cli.build_parser()
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_help_names_the_variables(capsys):
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for env in ("SPECSERVE_MODEL", "SPECSERVE_DRAFTERS", "SPECSERVE_PORT", "SPECSERVE_HOST", "SPECSERVE_DTYPE"):
        assert f"[env: {env}]" in out


@pytest.mark.parametrize("argv, env, expected", [([], None, True), (["--no-prepack-weights"], None, False),
                                                 ([], "0", False), (["--prepack-weights"], "off", True)])
def test_prepack_weights_flag(monkeypatch, argv, env, expected):
    if env is not None:
        monkeypatch.setenv("SPECSERVE_PREPACK_WEIGHTS", env)
    args = cli.build_parser().parse_args(["serve", *argv])
    assert cli._engine_config(args).prepack_weights is expected


@pytest.mark.parametrize("argv, env, expected", [([], None, False), (["--enforce-eager"], None, True),
                                                 ([], "1", True), (["--no-enforce-eager"], "on", False)])
def test_enforce_eager_flag(monkeypatch, argv, env, expected):
    if env is not None:
        monkeypatch.setenv("SPECSERVE_ENFORCE_EAGER", env)
    args = cli.build_parser().parse_args(["serve", *argv])
    assert cli._engine_config(args).enforce_eager is expected
