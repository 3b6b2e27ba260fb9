"""What int8 activations cost in quality: the served default model with float and with int8
activations (`--quantized-activations`), and llama.cpp on the same GGUF, against transformers on the
GGUF's dequantized fp32 weights, on a held set of text.

    specserve bench activations [--num-texts 24] [--ctx 256] [--llama-perplexity PATH] [--out PREFIX]
    (or: python -m specserve.bench.activation_quality ...)

The held set: GSM8K questions with their worked solutions and HumanEval prompts with their canonical
solutions (`../shared/data`, none of it in any training set of this project), joined into one text
and cut into windows of `--ctx` tokens, scored as llama.cpp's `llama-perplexity` scores them: every
window evaluated from an empty cache, the next-token loss counted on its second half only (each
scored token has at least ctx / 2 tokens of context). Per variant: the perplexity, the share of
scored positions whose top-1 token is the reference's (transformers fp32) and the float variant's,
and the mean KL divergence from the reference. `--llama-perplexity` (or $SPECSERVE_LLAMA_PERPLEXITY):
llama.cpp's `llama-perplexity` binary, run on the same text file with `-c ctx` for its perplexity
(its own tokenizer; no top-1 figures, which it does not print); without it that row is left out.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F

REFERENCE = "transformers fp32 (dequantized)"
FLOAT, INT8 = "specserve, float activations", "specserve, int8 activations"
LLAMA = "llama.cpp (llama-perplexity)"


def held_text(num_texts: int) -> str:
    """GSM8K question + solution and HumanEval prompt + canonical solution, alternating."""
    from specserve.engine.data_dir import data_dir

    rows = []
    for name, fields in (("gsm8k.jsonl", ("turns", "solution")), ("humaneval.jsonl", ("prompt", "canonical_solution"))):
        path = Path(data_dir()) / name
        with open(path) as f:
            rows.append([json.loads(line) for line in f if line.strip()])
    texts = []
    for i in range(num_texts):
        row = rows[i % 2][i // 2]
        if i % 2 == 0:
            texts.append(f"Question: {row['turns'][0]}\nAnswer: {row['solution']}")
        else:
            texts.append(row["prompt"] + row.get("canonical_solution", ""))
    return "\n\n".join(texts) + "\n"


def windows(ids: list[int], ctx: int) -> list[list[int]]:
    return [ids[i:i + ctx] for i in range(0, len(ids) - ctx + 1, ctx)]


def engine_logits(engine, window: list[int]) -> torch.Tensor:
    """The served target's logits on every position of `window`, from an empty cache."""
    from specserve.engine.attention import build_attn_metadata
    from specserve.engine.kv_cache import KVCache

    block = 16
    blocks = -(-len(window) // block)
    mc = engine.model_config
    cache = KVCache(mc.num_layers, blocks, block, mc.num_kv_heads, mc.head_dim, engine.cache.kv.dtype,
                    torch.device("cpu"))
    positions, meta = build_attn_metadata([list(range(blocks))], block, [0], [len(window)], None, "cpu")
    with torch.inference_mode():
        return engine.model.compute_logits(engine.model(torch.tensor(window), positions, cache, meta)).float()


def scores(logits: torch.Tensor, ref: torch.Tensor, base: torch.Tensor | None, window: list[int]) -> dict:
    """Sums over the scored positions (the second half, each predicting the next token)."""
    first = len(window) // 2
    rows = slice(first, len(window) - 1)
    target = torch.tensor(window[first + 1:])
    logp = F.log_softmax(logits[rows].double(), -1)
    ref_logp = F.log_softmax(ref[rows].double(), -1)
    out = {"n": len(target), "nll": float(-logp.gather(1, target[:, None]).sum()),
           "top1_ref": int((logits[rows].argmax(-1) == ref[rows].argmax(-1)).sum()),
           "kl_ref": float((ref_logp.exp() * (ref_logp - logp)).sum())}
    if base is not None:
        out["top1_float"] = int((logits[rows].argmax(-1) == base[rows].argmax(-1)).sum())
    return out


def llama_perplexity(binary: str, gguf: Path, text: str, ctx: int, threads: int) -> dict | None:
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(text)
    try:
        res = subprocess.run([binary, "-m", str(gguf), "-f", f.name, "-c", str(ctx), "-b", str(ctx), "-t", str(threads)],
                             capture_output=True, text=True, timeout=1800)
    finally:
        os.unlink(f.name)
    found = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", res.stdout + res.stderr)
    if not found:
        print(f"activation_quality: llama-perplexity gave no estimate:\n{(res.stdout + res.stderr)[-1500:]}",
              file=sys.stderr)
        return None
    chunks = re.search(r"calculating perplexity over (\d+) chunks", res.stdout + res.stderr)
    return {"ppl": float(found.group(1)), "ppl_err": float(found.group(2)),
            "chunks": int(chunks.group(1)) if chunks else None}


def markdown(result: dict) -> str:
    lines = [f"## Int8 activations: quality on a held set ({result['model']})", "",
             f"{result['date']}; {result['machine']['cpu_model']} [{result['machine']['cpu_isa']}], "
             f"{result['machine']['cpu_count']} CPUs; {result['num_windows']} windows of {result['ctx']} tokens "
             f"({result['scored_tokens']} scored), {result['num_texts']} texts (GSM8K solutions, HumanEval "
             "solutions).", "", f"`{result['command']}`", "",
             "| variant | perplexity | top-1 = reference | top-1 = float activations | KL from reference |",
             "|---|---|---|---|---|"]
    for name, v in result["variants"].items():
        def pct(key):
            return f"{100 * v[key]:.1f} %" if v.get(key) is not None else "–"
        kl = f"{v['kl_ref']:.4f}" if v.get("kl_ref") is not None else "–"
        ppl = f"{v['ppl']:.3f}" + (f" ± {v['ppl_err']:.3f}" if v.get("ppl_err") else "")
        lines.append(f"| {name} | {ppl} | {pct('top1_ref')} | {pct('top1_float')} | {kl} |")
    if LLAMA not in result["variants"]:
        lines += ["", "llama.cpp's row is left out: no `llama-perplexity` given (`--llama-perplexity`)."]
    else:
        lines += ["", "llama.cpp tokenizes the text itself and prints only its perplexity."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="specserve bench activations", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-texts", type=int, default=24, help="texts of the held set (default: %(default)s)")
    ap.add_argument("--ctx", type=int, default=256, help="tokens per window (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--llama-perplexity", default=os.environ.get("SPECSERVE_LLAMA_PERPLEXITY"), metavar="PATH",
                    help="llama.cpp's llama-perplexity binary, for its row (default: $SPECSERVE_LLAMA_PERPLEXITY)")
    ap.add_argument("--out", default="bench/results/activation_quality_cpu", metavar="PREFIX",
                    help="writes PREFIX.json and PREFIX.md (default: %(default)s)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.ctx < 8 or args.num_texts < 1:
        raise SystemExit("activation_quality: --ctx must be at least 8 and --num-texts positive")

    from specserve.bench.common import build_hf_model, machine_info, write_result
    from specserve.engine.config import EngineConfig
    from specserve.engine.core import LLMEngine
    from specserve.engine.loader import load_model, locate_default_gguf
    from specserve.kernels import cpu as native_cpu

    if not native_cpu.available():
        raise SystemExit("activation_quality: int8 activations need the native CPU kernels (a C compiler)")
    t0 = time.perf_counter()
    loaded = load_model("default")
    text = held_text(args.num_texts)
    ids = loaded.tokenizer.encode(text, add_special_tokens=True)
    wins = windows(ids, args.ctx)
    if not wins:
        raise SystemExit(f"activation_quality: the held set has {len(ids)} tokens, fewer than one window")
    hf = build_hf_model(loaded)
    engines = {name: LLMEngine(EngineConfig(model="default", dtype="float32", device="cpu", quantization="gguf",
                                            quantized_activations=acts, max_model_len=args.ctx + 16,
                                            num_kv_blocks=-(-args.ctx // 16) + 4, block_size=16, max_num_seqs=1),
                               loaded)
               for name, acts in ((FLOAT, "float"), (INT8, "int8"))}
    sums: dict[str, dict[str, float]] = {REFERENCE: {}, FLOAT: {}, INT8: {}}
    for window in wins:
        with torch.inference_mode():
            ref = hf(torch.tensor([window])).logits[0].float()
        base = engine_logits(engines[FLOAT], window)
        for name, logits in ((REFERENCE, ref), (FLOAT, base), (INT8, engine_logits(engines[INT8], window))):
            for k, v in scores(logits, ref, base if name != FLOAT else None, window).items():
                sums[name][k] = sums[name].get(k, 0.0) + v
    variants = {}
    for name, s in sums.items():
        n = s["n"]
        variants[name] = {"ppl": math.exp(s["nll"] / n), "top1_ref": s["top1_ref"] / n, "kl_ref": s["kl_ref"] / n,
                          "top1_float": s["top1_float"] / n if "top1_float" in s else None}
    variants[REFERENCE].update(top1_ref=None, kl_ref=None, top1_float=None)
    if args.llama_perplexity:
        got = llama_perplexity(args.llama_perplexity, locate_default_gguf(), text, args.ctx, torch.get_num_threads())
        if got:
            variants[LLAMA] = {"ppl": got["ppl"], "ppl_err": got["ppl_err"], "chunks": got["chunks"]}
    cmd = "python -m specserve.bench.activation_quality " + " ".join(sys.argv[1:] if argv is None else argv)
    result = {"benchmark": "activation_quality", "command": cmd.strip(),
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine_info("cpu"),
              "torch": torch.__version__, "model": loaded.name, "ctx": args.ctx, "num_texts": args.num_texts,
              "num_windows": len(wins), "scored_tokens": int(sums[REFERENCE]["n"]), "variants": variants,
              "duration_s": round(time.perf_counter() - t0, 1)}
    write_result(args.out, result, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
