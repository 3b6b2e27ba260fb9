"""Plain (non-speculative) decoding: our engine vs transformers `generate`, batch 1, same prompts,
same greedy settings, same number of new tokens. Prints a markdown table and writes JSON.

    python -m specserve.bench.plain_decode --num-prompts 8 --max-tokens 128
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from datetime import date
from pathlib import Path

import torch

from specserve.bench.common import build_hf_model, chat_ids, run_hf
from specserve.bench.datasets import load_prompts
from specserve.engine.config import EngineConfig
from specserve.engine.core import LLMEngine
from specserve.engine.loader import load_model
from specserve.engine.sampling_params import SamplingParams


def run_ours(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> tuple[int, float, list[list[int]]]:
    outs, total, elapsed = [], 0, 0.0
    for i, p in enumerate(prompts):
        t0 = time.perf_counter()
        engine.add_request(f"b{i}", p, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        toks: list[int] = []
        while engine.has_unfinished_requests():
            for out in engine.step():
                for d in out.outputs:
                    toks.extend(d.token_ids)
        elapsed += time.perf_counter() - t0
        total += len(toks)
        outs.append(toks)
    return total, elapsed, outs


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--dataset", default="mt_bench")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--out", default="bench/results/plain_decode.json")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers

    loaded = load_model(args.model)
    engine = LLMEngine(EngineConfig(model=args.model, dtype="float32", device="cpu", max_model_len=2048,
                                    max_num_seqs=1), loaded=loaded)
    hf = build_hf_model(loaded)
    prompts = [chat_ids(loaded.tokenizer, t) for t in load_prompts(args.dataset, args.num_prompts)]
    # warm-up both on a short prompt
    run_ours(engine, prompts[:1], 8)
    run_hf(hf, prompts[:1], 8)
    ours_n, ours_t, ours_out = run_ours(engine, prompts, args.max_tokens)
    hf_n, hf_t, hf_out = run_hf(hf, prompts, args.max_tokens)
    same = sum(a == b for a, b in zip(ours_out, hf_out))
    result = {
        "benchmark": "plain_decode",
        "command": "python -m specserve.bench.plain_decode " + " ".join(sys.argv[1:] if argv is None else argv),
        "date": date.today().isoformat(), "machine": f"{platform.machine()} {torch.get_num_threads()} threads, CPU",
        "model": loaded.name, "dataset": args.dataset, "num_prompts": len(prompts), "max_tokens": args.max_tokens,
        "ours_tok_s": ours_n / ours_t, "hf_tok_s": hf_n / hf_t, "speedup_vs_hf": (ours_n / ours_t) / (hf_n / hf_t),
        "identical_outputs": f"{same}/{len(prompts)}", "torch": torch.__version__, "transformers": transformers.__version__,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(markdown(result))


def markdown(result: dict) -> str:
    """The table of a run's JSON: batch-1 greedy tokens/s of our plain decoding and of transformers."""
    return "\n".join([
        f"## Plain decoding: {result['model']} (batch 1, fp32, {result['num_prompts']} {result['dataset']} prompts "
        f"× {result['max_tokens']} tokens)", "",
        "| engine | tokens/s (batch 1, fp32) |", "|---|---|",
        f"| specserve plain decoding | {result['ours_tok_s']:.1f} |",
        f"| transformers generate | {result['hf_tok_s']:.1f} |", "",
        f"speed-up {result['speedup_vs_hf']:.2f}x, identical greedy outputs {result['identical_outputs']}, "
        f"{result['machine']}, {result['date']}; torch {result['torch']}, transformers {result['transformers']}."]) + "\n"


if __name__ == "__main__":
    main()
