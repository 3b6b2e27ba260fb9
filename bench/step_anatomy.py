"""Where a one-row decode step's time goes on the CPU: the layer stack's matmuls, the LM head, the
attention, the rest of the layer stack (norms, SiLU) and the host work around them (Python: the
scheduler, inputs, sampling, bookkeeping), against the sum of the matmuls.

    specserve bench step [--contexts 16 256 1024] [--max-tokens 128] [--threads 2]

Plain greedy decoding on the engine as served (native CPU kernels, the model's quantization and KV
cache dtype), batch 1. Each context is a prompt of that many tokens (chat prompts of `--dataset`,
concatenated and cut), decoded for `--max-tokens` tokens after a warm-up request; every step is
timed whole, and the kernels' phase timers (`kernels/cpu_kernels.c`, a build of their own with
-DSPECSERVE_PHASE_TIMES, selected by SPECSERVE_CPU_PHASE_TIMES=1, which this command sets for a
child process of itself) split the time the native code spends. `host` is the step less the
phases. Two ratios: the step over its matmuls (projections and LM head), and over the matmuls plus
attention (whose query-key and probability-value products grow with the context).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

PHASES = ("matmuls", "attention", "layers_rest", "lm_head")   # the order of `phase_times`


def markdown(result: dict) -> str:
    m = result["machine"]
    lines = [f"## One-row decode step, where the time goes: {result['model']} (cpu)", "",
             f"{result['date']}; {m['platform']}, {m['cpu_count']} CPUs, {result['threads']} threads; torch "
             f"{result['torch']}; quantization {result['quantization']}, KV cache {result['kv_cache_dtype']}; plain "
             f"greedy decoding at batch 1, {result['max_tokens']} tokens per context; ms per step, the mean over "
             f"the steps (median of {result['repeats']} runs).", ""]
    if result.get("command"):
        lines += [f"`{result['command']}`", ""]
    lines += ["| context | step | matmuls (layers) | LM head | attention | rest of layers | host | "
              "step / matmuls | step / (matmuls + attention) |",
              "|---|---|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        mm = row["matmuls"] + row["lm_head"]
        lines.append(f"| {row['context']} | {row['step']:.2f} | {row['matmuls']:.2f} | {row['lm_head']:.2f} | "
                     f"{row['attention']:.2f} | {row['layers_rest']:.2f} | {row['host']:.2f} | "
                     f"{row['step'] / mm:.2f}x | {row['step'] / (mm + row['attention']):.2f}x |")
    return "\n".join(lines) + "\n"


def _prompt(tokenizer, texts: list[str], length: int) -> list[int]:
    from specserve.bench.common import chat_ids

    ids: list[int] = []
    while len(ids) < length:
        for text in texts:
            ids += chat_ids(tokenizer, text)
    return ids[:length]


def _measure(args) -> dict:
    from specserve.bench.common import machine_info
    from specserve.bench.datasets import load_prompts
    from specserve.engine.config import EngineConfig
    from specserve.engine.core import LLMEngine
    from specserve.engine.sampling_params import SamplingParams
    from specserve.kernels import cpu as native

    if args.threads:
        torch.set_num_threads(args.threads)
    engine = LLMEngine(EngineConfig(model=args.model, drafters=(), max_model_len=max(args.contexts) + args.max_tokens + 8))
    lib = native.library()
    if not lib or not engine.model.runs_natively():
        raise SystemExit("bench step: the layer stack does not run in the native CPU kernels here (no C compiler, "
                         "or weights they do not take)")
    phases = (ctypes.c_double * len(PHASES))()
    if not lib.phase_times(phases):
        raise SystemExit("bench step: the native kernels were built without phase timers "
                         "(SPECSERVE_CPU_PHASE_TIMES=1 must be set before they load)")
    texts = load_prompts(args.dataset, 64)

    def decode(prompt: list[int], tag: str) -> dict[str, float]:
        engine.add_request(tag, prompt, SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True))
        while not any(out.num_generated_tokens for out in engine.step()):
            pass                             # the prompt's prefill (in chunks), not measured
        lib.phase_times(phases)
        steps, t0 = 0, time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        total = time.perf_counter() - t0
        lib.phase_times(phases)
        ms = {name: 1e3 * phases[i] / steps for i, name in enumerate(PHASES)}
        ms["step"] = 1e3 * total / steps
        ms["host"] = ms["step"] - sum(ms[p] for p in PHASES)
        return ms

    decode(_prompt(engine.tokenizer, texts, min(args.contexts)), "warm-up")
    rows = []
    for context in args.contexts:
        prompt = _prompt(engine.tokenizer, texts, context)
        runs = [decode(prompt, f"c{context}-{r}") for r in range(args.repeats)]
        row = {"context": context}
        row.update({k: round(statistics.median(run[k] for run in runs), 4) for k in runs[0]})
        rows.append(row)
    return {"benchmark": "step_anatomy", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "machine": machine_info("cpu"), "torch": torch.__version__, "model": engine.model_name,
            "threads": torch.get_num_threads(), "quantization": engine.quantization,
            "kv_cache_dtype": str(engine.cache.kv.dtype).removeprefix("torch."), "max_tokens": args.max_tokens,
            "repeats": args.repeats, "rows": rows}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="specserve bench step", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--dataset", default="mt_bench", metavar="NAME_OR_PATH", help="prompts (default: %(default)s)")
    ap.add_argument("--contexts", type=int, nargs="+", default=[16, 256, 1024],
                    help="prompt lengths in tokens (default: %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=128, help="tokens decoded per run (default: %(default)s)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per context; the median is kept (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--out", default="bench/results/step_anatomy_cpu",
                    help="writes OUT.json (default: %(default)s)")
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if min(args.contexts) < 1 or args.max_tokens < 2 or args.repeats < 1:
        raise SystemExit("bench step: --contexts, --max-tokens (>= 2) and --repeats must be positive")
    if os.environ.get("SPECSERVE_CPU_PHASE_TIMES") != "1":   # the timed build must be the one that loads
        env = dict(os.environ, SPECSERVE_CPU_PHASE_TIMES="1")
        return subprocess.call([sys.executable, "-m", "specserve.bench.step_anatomy", *argv], env=env)
    result = _measure(args)
    result["command"] = " ".join(["specserve bench step", *argv])
    print(markdown(result))
    out = Path(args.out).with_suffix(".json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
