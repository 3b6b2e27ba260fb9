"""Plain (non-speculative) decoding: our engine vs transformers `generate`, batch 1, same prompts,
same greedy settings, same number of new tokens. Prints a markdown table and writes JSON.

    python -m specserve.bench.plain_decode --num-prompts 8 --max-tokens 128 [--quantization none int8 int4]
        [--compile off|on|both] [--kv-cache-dtype auto float32 float64] [--cpu-kernels on|off|both]

With several `--quantization` kinds (and `--compile both`: each kind eager and compiled,
engine/compiled.py; several `--kv-cache-dtype`: each with its KV cache dtype; `--cpu-kernels
both`: each with the native CPU kernels, kernels/cpu.py, and with the torch ops), one engine per
variant from the same load, run prompt by prompt in turn (a slow stretch of the machine hits every
variant alike); each variant's greedy outputs are compared with the first unquantized variant's
(same tokens: prompts whose whole continuation is identical).
"""

from __future__ import annotations

import argparse
import json
from contextlib import contextmanager
import platform
import sys
import time
from datetime import date
from pathlib import Path

import torch

from specserve.bench.common import build_hf_model, chat_ids, run_hf
from specserve.bench.datasets import add_dataset_args, load_prompts
from specserve.engine.config import KV_CACHE_DTYPES, EngineConfig
from specserve.engine.core import LLMEngine
from specserve.engine.loader import load_model
from specserve.engine.quant import QUANTIZATIONS
from specserve.engine.sampling_params import SamplingParams
from specserve.kernels import cpu as native


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
    ap.add_argument("--dataset", default="mt_bench", metavar="NAME_OR_PATH")
    add_dataset_args(ap)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--quantization", nargs="+", default=["none"], choices=QUANTIZATIONS,
                    help="weight-only quantization of our engine, one engine per kind (default: none)")
    ap.add_argument("--compile", default="off", choices=("off", "on", "both"),
                    help="our engines with the compiled CPU forward (EngineConfig.compile), without, or both "
                         "(default: %(default)s)")
    ap.add_argument("--kv-cache-dtype", nargs="+", default=["auto"], choices=KV_CACHE_DTYPES,
                    help="our engines' KV cache dtype (EngineConfig.kv_cache_dtype), one engine per dtype "
                         "(default: auto)")
    ap.add_argument("--cpu-kernels", default="on", choices=("off", "on", "both"),
                    help="our engines with the native CPU kernels (kernels/cpu.py, where they build), with the "
                         "torch ops, or both (default: %(default)s)")
    ap.add_argument("--no-hf", dest="hf", action="store_false", help="skip transformers generate")
    ap.add_argument("--out", default="bench/results/plain_decode.json")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers

    loaded = load_model(args.model)
    modes = {"off": (False,), "on": (True,), "both": (False, True)}[args.compile]
    native_modes = {"on": (True,), "off": (False,), "both": (True, False)}[args.cpu_kernels]
    variants = {variant_name(kind, c, kv, nk): (kind, c, kv, nk) for kind in dict.fromkeys(args.quantization)
                for c in modes for kv in dict.fromkeys(args.kv_cache_dtype) for nk in native_modes}
    kinds = list(variants)
    engines = {}
    for name, (kind, c, kv, nk) in variants.items():
        with cpu_kernels(nk):   # the engine picks its KV dtype by them
            engines[name] = LLMEngine(EngineConfig(model=args.model, dtype="float32", device="cpu",
                                                   max_model_len=2048, max_num_seqs=1, quantization=kind,
                                                   compile=c, kv_cache_dtype=kv), loaded=loaded)
    kv_dtypes = {name: str(e.kv_dtype).removeprefix("torch.") for name, e in engines.items()}
    hf = build_hf_model(loaded) if args.hf else None
    prompts = [chat_ids(loaded.tokenizer, t) for t in load_prompts(args.dataset, args.num_prompts,
                                                                        prompt_field=args.prompt_field,
                                                                        messages_field=args.messages_field)]
    # warm-up on a short prompt
    for name, engine in engines.items():
        with cpu_kernels(variants[name][3]):
            run_ours(engine, prompts[:1], 8)
    if hf is not None:
        run_hf(hf, prompts[:1], 8)
    tally = {kind: [0, 0.0, []] for kind in kinds}
    for p in prompts:   # prompt by prompt, every kind in turn
        for kind, engine in engines.items():
            with cpu_kernels(variants[kind][3]):
                n, t, out = run_ours(engine, [p], args.max_tokens)
            tally[kind][0] += n
            tally[kind][1] += t
            tally[kind][2] += out
    ours = {kind: n / t for kind, (n, t, _) in tally.items()}
    base = unquantized(kinds)
    first = kinds[0]
    result = {
        "benchmark": "plain_decode",
        "command": "python -m specserve.bench.plain_decode " + " ".join(sys.argv[1:] if argv is None else argv),
        "date": date.today().isoformat(), "machine": f"{platform.machine()} {torch.get_num_threads()} threads, CPU",
        "model": loaded.name, "dataset": args.dataset, "num_prompts": len(prompts), "max_tokens": args.max_tokens,
        "ours_tok_s": ours[first], "quantization": ours, "kv_cache_dtype": kv_dtypes, "torch": torch.__version__,
        "native_kernels": native.available(),
        "transformers": transformers.__version__,
        "same_as_unquantized": {kind: f"{sum(a == b for a, b in zip(tally[kind][2], tally[base][2]))}/{len(prompts)}"
                                for kind in kinds if base is not None and kind != base},
    }
    if hf is not None:
        hf_n, hf_t, hf_out = run_hf(hf, prompts, args.max_tokens)
        result.update(hf_tok_s=hf_n / hf_t, speedup_vs_hf=ours[first] / (hf_n / hf_t),
                      identical_outputs=f"{sum(a == b for a, b in zip(tally[first][2], hf_out))}/{len(prompts)}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(markdown(result))


@contextmanager
def cpu_kernels(enabled: bool):
    """The native CPU kernels switched on or off (`kernels.cpu.ENABLED`) for the block."""
    before = native.ENABLED
    native.ENABLED = enabled
    try:
        yield
    finally:
        native.ENABLED = before


def unquantized(names) -> str | None:
    """The first variant with unquantized weights (the reference of the others), or None."""
    return next((n for n in names if n.split("+")[0] == "none"), None)


def variant_name(kind: str, compiled: bool, kv_cache_dtype: str = "auto", native: bool = True) -> str:
    """A variant's key in the results: the quantization kind, "+compile" when compiled, "+kv=DTYPE"
    when the KV cache dtype is named, "+torch-ops" without the native CPU kernels."""
    return (kind + ("+compile" if compiled else "") + ("" if kv_cache_dtype == "auto" else f"+kv={kv_cache_dtype}")
            + ("" if native else "+torch-ops"))


def _layer(flags: list[str], result: dict) -> str:
    """What ran a variant's layers: the native CPU kernels, the torch ops, or (compiled) inductor's
    code with the native attention or the torch reference's."""
    native = "torch-ops" not in flags and result.get("native_kernels", False)
    if "compile" in flags:
        return "inductor, native attention" if native else "inductor"
    return "native kernels" if native else "torch ops"


def markdown(result: dict) -> str:
    """The table of a run's JSON: batch-1 greedy tokens/s of our plain decoding (per quantization)
    and of transformers."""
    kinds = result.get("quantization") or {"none": result["ours_tok_s"]}
    base = kinds.get(unquantized(kinds))
    lines = [f"## Plain decoding: {result['model']} (batch 1, {result['num_prompts']} {result['dataset']} prompts "
             f"× {result['max_tokens']} tokens)", "",
             "| engine | weights | forward | layer | KV cache | tokens/s | vs unquantized | same greedy output |",
             "|---|---|---|---|---|---|---|---|"]
    same = result.get("same_as_unquantized", {})
    kv = result.get("kv_cache_dtype", {})
    for name, tok_s in kinds.items():
        kind, *flags = name.split("+")
        ratio = f"{tok_s / base:.2f}x" if base else "–"
        lines.append(f"| specserve plain decoding | {'fp32' if kind == 'none' else kind} | "
                     f"{'compiled' if 'compile' in flags else 'eager'} | "
                     f"{_layer(flags, result)} | "
                     f"{kv.get(name, '–')} | {tok_s:.1f} | {ratio} | {same.get(name, '–')} |")
    if result.get("hf_tok_s"):
        lines.append(f"| transformers generate | fp32 | eager | – | float32 | {result['hf_tok_s']:.1f} | – | – |")
    tail = [f"{result['machine']}, {result['date']}; torch {result['torch']}, transformers {result['transformers']}."]
    if result.get("speedup_vs_hf"):
        tail.insert(0, f"speed-up over transformers {result['speedup_vs_hf']:.2f}x, identical greedy outputs "
                       f"{result['identical_outputs']},")
    return "\n".join(lines + ["", " ".join(tail)]) + "\n"


if __name__ == "__main__":
    main()
