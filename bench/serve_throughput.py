"""Server throughput with concurrent streaming clients: starts a real uvicorn server on loopback,
then for each concurrency level runs that many streaming chat requests at once (each with the same
max_tokens, EOS ignored) and reports generated tokens/s over the wall-clock of the level.

    python -m specserve.bench.serve_throughput --concurrency 1 4 16 --max-tokens 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import threading
import time
from datetime import date
from pathlib import Path

import httpx
import torch
import uvicorn

from specserve.bench.common import free_port
from specserve.bench.datasets import add_dataset_args, load_prompts
from specserve.engine.async_engine import AsyncEngine
from specserve.engine.config import EngineConfig
from specserve.server.app import create_app


def start_server(engine: AsyncEngine) -> tuple[uvicorn.Server, str]:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(engine), host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    base = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(base + "/health").status_code == 200:
                return server, base
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError("server did not come up")


async def one_stream(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> tuple[int, float]:
    body = {"model": "default", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    t0, ttft, tokens = time.perf_counter(), None, 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif ttft is None and any(c["delta"].get("content") for c in chunk.get("choices", ())):
                ttft = time.perf_counter() - t0   # the first token's text (not the opening role chunk)
    return tokens, ttft or 0.0


async def run_level(base: str, prompts: list[str], concurrency: int, max_tokens: int) -> dict:
    async with httpx.AsyncClient(base_url=base, timeout=600) as client:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one_stream(client, prompts[i % len(prompts)], max_tokens)
                                         for i in range(concurrency)))
        wall = time.perf_counter() - t0
    tokens = sum(r[0] for r in results)
    return {"concurrency": concurrency, "tokens": tokens, "wall_s": wall, "tok_s": tokens / wall,
            "mean_ttft_s": sum(r[1] for r in results) / len(results)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--dataset", default="mt_bench", metavar="NAME_OR_PATH")
    add_dataset_args(ap)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", default="bench/results/serve_throughput.json")
    args = ap.parse_args(argv)
    engine = AsyncEngine.from_config(EngineConfig(model=args.model, dtype="float32", device="cpu",
                                                  max_num_seqs=max(args.concurrency), max_model_len=2048,
                                                  quantization="none"))
    server, base = start_server(engine)
    prompts = load_prompts(args.dataset, 32, prompt_field=args.prompt_field, messages_field=args.messages_field)
    asyncio.run(run_level(base, prompts, 1, 8))  # warm-up
    levels = [asyncio.run(run_level(base, prompts, c, args.max_tokens)) for c in args.concurrency]
    server.should_exit = True
    result = {"benchmark": "serve_throughput",
              "command": "python -m specserve.bench.serve_throughput " + " ".join(sys.argv[1:] if argv is None else argv),
              "date": date.today().isoformat(), "machine": f"{platform.machine()} {torch.get_num_threads()} threads, CPU",
              "model": engine.model_name, "max_tokens": args.max_tokens, "levels": levels}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(markdown(result))


def markdown(result: dict) -> str:
    """The table of a run's JSON: generated tokens/s by concurrent streams."""
    levels = result["levels"]
    single = levels[0]["tok_s"]
    lines = [f"## Server throughput: {result['model']} (cpu, fp32, {result['max_tokens']} tokens per stream)", "",
             "| concurrent streams | generated tokens/s | × single stream | mean TTFT (s) |", "|---|---|---|---|"]
    for lv in levels:
        lines.append(f"| {lv['concurrency']} | {lv['tok_s']:.1f} | {lv['tok_s'] / single:.2f} | {lv['mean_ttft_s']:.2f} |")
    lines += ["", f"{result['machine']}, {result['date']}"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
