"""Fixtures shared by every test folder.

* Every test session gets its own empty specserve cache (``$SPECSERVE_CACHE``), so converted models never leak
  between runs. The exception is `default_model`: it uses the user's real cache so that the ~16 s GGUF
  conversion of SmolLM2 happens once per machine, and the session cache links to the user cache's GGUF
  conversions (each a folder named by its file's content), so that commands the tests run on "default"
  read that conversion too instead of making their own.
* `tiny_llama_dir`: a saved, seeded, random 2-layer Llama with a working byte-level BPE tokenizer (320 tokens;
  ids 0/1/2 are ``<unk>``/``<s>``/``</s>``) and a chat template; `tiny_model_factory` saves variants
  (Mistral, Qwen2, tied embeddings, ...). `peaky_target` (one per test module) is a tiny Llama with large
  initial weights, whose peaked next-token laws the sampling-losslessness tests measure.
* `make test` runs the tests in worker processes (pytest-xdist, `-n auto --dist loadfile`: a file's tests stay on
  one worker, with its module fixtures): one worker per core, at most MAX_TEST_WORKERS, and each worker's torch,
  and every process a test starts, gets OMP_NUM_THREADS = its share of the cores. Most tests here are
  small-model steps whose Python holds one core; two workers on two cores halve the suite's time where one
  process with two torch threads did not (measured: docs/journal/2026-11-29-suite-workers.md).
* Plain helpers (building and running an LLMEngine, exact and empirical first-two-token laws) live in
  tests/helpers.py; test modules import them with ``from helpers import ...``.
* Live servers (tests/e2e, tests/deploy): `serve(engine, **create_app_kwargs)` runs a real uvicorn server on a
  free loopback port in a background thread of the test process (so tests can also look at the engine behind
  it); `make_tiny_engine(**EngineConfig overrides)` builds an AsyncEngine over the tiny Llama; `idle(engine)`
  waits until it runs nothing.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest

# the user's cache, read before the session fixture below replaces $SPECSERVE_CACHE
USER_SPECSERVE_CACHE = Path(os.environ.get("SPECSERVE_CACHE") or Path.home() / ".cache" / "specserve")

TINY_VOCAB_SIZE = 320
TINY_SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}<s>{{ message['role'] }}\n{{ message['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)
_TINY_CORPUS = [
    "The quick brown fox jumps over the lazy dog. Hello world! def fibonacci(n): return n",
    "What is the capital of France? Paris is the capital of France.",
] * 20


MAX_TEST_WORKERS = 4     # each worker loads its own models: SmolLM2's tests hold 2-4 GB per worker


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto` (make test): one worker per core this process may run on, at most MAX_TEST_WORKERS."""
    return max(1, min(_cores(), MAX_TEST_WORKERS))


def pytest_configure(config) -> None:
    workers = getattr(config.option, "numprocesses", None)
    if workers and "PYTEST_XDIST_WORKER" not in os.environ:
        # the controller, before it starts the workers (they and the processes tests start inherit it): each
        # worker's share of the cores, so that the workers' torch thread pools do not oversubscribe the CPU
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, _cores() // workers)))


def share_user_conversions(session_cache: Path) -> None:
    """Link each GGUF conversion of the user's cache (``gguf/<key>/``, keyed by the file's content,
    written once, then only read) into `session_cache` where that has none of its own."""
    user = USER_SPECSERVE_CACHE / "gguf"
    if not user.is_dir():
        return
    (session_cache / "gguf").mkdir(parents=True, exist_ok=True)
    for folder in user.iterdir():
        link = session_cache / "gguf" / folder.name
        if folder.is_dir() and not folder.name.startswith(".") and not link.exists():
            link.symlink_to(folder, target_is_directory=True)


@pytest.fixture(scope="session", autouse=True)
def _session_specserve_cache(tmp_path_factory):
    cache = tmp_path_factory.mktemp("specserve_cache")
    share_user_conversions(cache)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECSERVE_CACHE", str(cache))
        yield


def make_tiny_tokenizer():
    """A deterministic byte-level BPE tokenizer of exactly TINY_VOCAB_SIZE tokens, as a PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TINY_VOCAB_SIZE, special_tokens=TINY_SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tk.train_from_iterator(_TINY_CORPUS, trainer)
    assert tk.get_vocab_size() == TINY_VOCAB_SIZE
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   chat_template=TINY_CHAT_TEMPLATE)


def save_tiny_model(path: Path, model_type: str = "llama", *, seed: int = 0, **config_overrides) -> Path:
    """Save a random tiny `model_type` ("llama", "mistral", "qwen2") model plus the tiny tokenizer to `path`."""
    import torch
    import transformers

    cls_config, cls_model = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[model_type]
    kwargs = dict(vocab_size=TINY_VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  bos_token_id=1, eos_token_id=2)
    kwargs.update(config_overrides)
    torch.manual_seed(seed)
    cls_model(cls_config(**kwargs)).save_pretrained(path)
    make_tiny_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model_factory():
    """`save_tiny_model(path, model_type="llama", **config_overrides) -> path`, for tests that need variants."""
    return save_tiny_model


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="module")
def peaky_target(tmp_path_factory) -> Path:
    """A tiny Llama with large initial weights (clearly non-uniform next-token laws), saved anew for each
    test module that asks for it (so each module's global torch RNG stream is as if it were alone)."""
    return save_tiny_model(tmp_path_factory.mktemp("peaky_target"), initializer_range=0.15, seed=3)


@pytest.fixture(scope="session")
def user_specserve_cache() -> Path:
    """The specserve cache outside the tests (where `default_model` keeps its conversion)."""
    return USER_SPECSERVE_CACHE


@pytest.fixture(scope="session")
def default_model():
    """load_model("default") (SmolLM2-135M-Instruct), converted once per machine into the user's cache."""
    from specserve.engine.errors import ModelNotFoundError
    from specserve.engine.loader import load_model, locate_default_gguf

    try:
        locate_default_gguf()
    except ModelNotFoundError as e:
        pytest.skip(f"default model unavailable: {e}")
    loaded = load_model("default", cache_dir=USER_SPECSERVE_CACHE)
    share_user_conversions(Path(os.environ["SPECSERVE_CACHE"]))   # converted just now on a fresh machine
    return loaded


# ---- live servers -------------------------------------------------------------------------------


@dataclass
class LiveServer:
    engine: object           # the AsyncEngine behind it
    app: object
    base_url: str            # http://127.0.0.1:PORT
    server: object = None    # the uvicorn server (server/launcher.py's SpecserveServer)
    exit_status: list = None  # [status] once `run_server` returned

    @property
    def v1(self) -> str:
        return self.base_url + "/v1"


@contextmanager
def live_server(engine, *, shutdown_timeout: float | None = 5.0, server_options: dict | None = None,
                **app_kwargs) -> Iterator[LiveServer]:
    """Serve `engine` through `create_app(engine, **app_kwargs)` with the launcher `specserve serve` uses
    (graceful shutdown bounded by `shutdown_timeout`; `server_options`: more `build_server` keywords, e.g.
    the connection timeouts) until the block ends."""
    from specserve.server.app import create_app
    from specserve.server.launcher import build_server, run_server

    app = create_app(engine, **app_kwargs)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = build_server(app, shutdown_timeout=shutdown_timeout, log_level="warning", **(server_options or {}))
    status: list = []
    thread = threading.Thread(target=lambda: status.append(run_server(server, engine, sockets=[sock])),
                              name=f"uvicorn-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield LiveServer(engine=engine, app=app, base_url=f"http://127.0.0.1:{port}", server=server,
                         exit_status=status)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


def build_tiny_engine(model_dir, **config):
    from specserve.engine.async_engine import AsyncEngine
    from specserve.engine.config import EngineConfig

    config = {"dtype": "float32", "device": "cpu", "max_model_len": 512, "max_num_seqs": 8, **config}
    return AsyncEngine.from_config(EngineConfig(model=str(model_dir), **config))


def wait_until_idle(engine, timeout: float = 10.0):
    """Poll the engine's stats until nothing runs or waits and every KV block is free; return them."""
    deadline = time.monotonic() + timeout
    while True:
        stats = engine.get_stats()
        if stats.num_running == 0 and stats.num_waiting == 0 and stats.num_free_blocks == stats.num_total_blocks:
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"engine not idle after {timeout} s: {stats}")
        time.sleep(0.02)


@pytest.fixture(scope="session")
def serve():
    """`with serve(engine, **create_app_kwargs) as server:` -- a LiveServer for one test."""
    return live_server


@pytest.fixture(scope="session")
def make_tiny_engine(tiny_llama_dir):
    """`make_tiny_engine(**EngineConfig overrides)` -- an AsyncEngine over the tiny random Llama (not started)."""
    return lambda **config: build_tiny_engine(tiny_llama_dir, **config)


@pytest.fixture(scope="session")
def idle():
    """`idle(engine)` waits until the engine runs nothing and every KV block is free; returns its stats."""
    return wait_until_idle
