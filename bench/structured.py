"""Structured output under speculation: a JSON-extraction workload, constrained decoding's speed by
drafter, the grammar engine's cost.

    specserve bench structured [--num-prompts 6] [--max-tokens 160] [--drafters ngram eagle] [--streams 16]

GSM8K questions answered as `{"reasoning": str, "answer": int}` (a JSON schema, compact JSON),
greedy, on the served default model (`--quantization auto`, as `make serve`). Rows:

* `constrained, no drafter`: the schema alone, the grammar's forced tokens not drafted
  (`--no-grammar-drafts`);
* `grammar drafter`: the same with the forced tokens drafted (the default);
* `grammar + D`: with drafter D besides (drafting after the forced tokens, in the same tree, where
  D can: `Drafter.drafts_after_uncommitted`);
* `grammar + D, D not after forced tokens`: the same, the forced chain alone where the grammar forces
  tokens (what the engine did before trees held both; for such a D only);
* `unconstrained`: no schema, no drafter (what the constraint costs).

At batch 1 (prompts one at a time) and at `--streams` concurrent requests: tokens/s, τ (tokens
per target forward), the share of the output the grammar's drafts supplied, and how many outputs
parse and validate. Every constrained row must give the same tokens as the first (speculation is
lossless; the grammar drafter too). Then the grammar engine on this machine: compiling the schema
(a cold cache) and one mask per output token (llguidance's `compute_bitmask`, replayed over the
outputs).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from specserve.bench.common import chat_ids, machine_info
from specserve.bench.datasets import load_prompts
from specserve.engine.config import EngineConfig
from specserve.engine.core import LLMEngine
from specserve.engine.grammar import GRAMMAR_PART, Grammars
from specserve.engine.loader import load_model
from specserve.engine.quant import QUANTIZATIONS
from specserve.engine.sampling_params import SamplingParams

SCHEMA = {"type": "object", "properties": {"reasoning": {"type": "string", "maxLength": 300},
                                           "answer": {"type": "integer"}},
          "required": ["reasoning", "answer"], "additionalProperties": False}
INSTRUCTION = 'Answer with a JSON object {"reasoning": "<short reasoning>", "answer": <integer>}.\n\n'
UNCONSTRAINED = "unconstrained"
NO_DRAFTER = "constrained, no drafter"
GRAMMAR = "grammar drafter"


def valid(text: str) -> bool:
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return isinstance(value, dict) and set(value) == {"reasoning", "answer"} and isinstance(value["answer"], int) \
        and isinstance(value["reasoning"], str)


def decode(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, drafter: str, guided, tag: str):
    """`prompts` admitted together and decoded to the end: (outputs, seconds, target forwards, grammar tokens)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, guided=guided)
    before = engine.drafter_stats[GRAMMAR_PART].num_accepted_tokens
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", p, params, drafter=drafter)
    outs: dict[str, list[int]] = {}
    forwards = 0      # steps that gave a request tokens: one target forward each (prompts fit one chunk)
    while engine.has_unfinished_requests():
        for o in engine.step():
            new = [t for d in o.outputs for t in d.token_ids]
            outs.setdefault(o.request_id, []).extend(new)
            forwards += bool(new)
    seconds = time.perf_counter() - t0
    grammar = engine.drafter_stats[GRAMMAR_PART].num_accepted_tokens - before
    return [outs[f"{tag}-{i}"] for i in range(len(prompts))], seconds, forwards, grammar


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="specserve bench structured", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--num-prompts", type=int, default=6, help="GSM8K questions (default: %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--drafters", nargs="*", default=["ngram", "eagle"])
    ap.add_argument("--streams", type=int, default=16, help="concurrent requests of the second table (0: skip it)")
    ap.add_argument("--quantization", default="auto", choices=QUANTIZATIONS)
    ap.add_argument("--out", default="bench/results/structured_cpu.json")
    args = ap.parse_args(argv)
    loaded = load_model(args.model)
    engine = LLMEngine(EngineConfig(model=args.model, dtype="float32", device="cpu", max_model_len=1024,
                                    max_num_seqs=max(1, args.streams), max_num_batched_tokens=2048,
                                    drafters=("none", *args.drafters), quantization=args.quantization),
                       loaded=loaded)
    questions = load_prompts("gsm8k", max(args.num_prompts, args.streams))
    prompts = [chat_ids(loaded.tokenizer, INSTRUCTION + q) for q in questions]
    guided = ("json", json.dumps(SCHEMA))

    after = engine.scheduler.drafts_after   # the drafters that draft after the forced tokens, in one tree
    rows = {UNCONSTRAINED: ("none", None, True, True), NO_DRAFTER: ("none", guided, False, True),
            GRAMMAR: ("none", guided, True, True)}
    for d in args.drafters:
        rows[f"grammar + {d}"] = (d, guided, True, True)
        if d in after:   # the baseline: the forced chain alone where the grammar forces tokens
            rows[f"grammar + {d}, {d} not after forced tokens"] = (d, guided, True, False)

    def run(name: str, group: list[list[int]], tag: str):
        drafter, g, forced, merged = rows[name]
        engine.scheduler.grammar_drafts = forced
        engine.scheduler.drafts_after = after if merged else frozenset()
        return decode(engine, group, args.max_tokens, drafter, g, tag)

    for name in rows:                       # warm-up: first calls compile the schema, allocate, initialise
        run(name, prompts[:1], f"warm-{name}")
    tables = {}
    outputs_kept: list[list[int]] = []
    for label, groups in (("batch 1", [[p] for p in prompts[:args.num_prompts]]),
                          (f"{args.streams} streams", [prompts[:args.streams]] if args.streams else [])):
        if not groups:
            continue
        stats = {name: {"tokens": 0, "seconds": 0.0, "forwards": 0, "grammar": 0, "valid": 0, "outputs": []}
                 for name in rows}
        for k, group in enumerate(groups):       # every row on the same prompts, in turn
            for name in rows:
                outs, s, f, g = run(name, group, f"{label}-{k}-{name}")
                st = stats[name]
                st["tokens"] += sum(map(len, outs))
                st["seconds"] += s
                st["forwards"] += f
                st["grammar"] += g
                st["valid"] += sum(valid(loaded.tokenizer.decode(o, skip_special_tokens=True)) for o in outs)
                st["outputs"] += outs
        reference = stats[NO_DRAFTER]["outputs"]
        outputs_kept += reference
        tables[label] = {
            name: {"tok_s": st["tokens"] / st["seconds"], "tau": st["tokens"] / max(1, st["forwards"]),
                   "grammar_share": st["grammar"] / max(1, st["tokens"]),
                   "valid": f"{st['valid']}/{len(st['outputs'])}",
                   "same_as_constrained": None if name == UNCONSTRAINED else
                   f"{sum(a == b for a, b in zip(st['outputs'], reference))}/{len(reference)}"}
            for name, st in stats.items()}

    cost = grammar_cost(loaded, guided, outputs_kept)
    cmd = "specserve bench structured " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    result = {"benchmark": "structured", "command": cmd.strip(),
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine_info("cpu"),
              "model": loaded.name, "quantization": engine.quantization, "torch": torch.__version__,
              "num_prompts": args.num_prompts, "max_tokens": args.max_tokens, "schema": SCHEMA,
              "tables": tables, "grammar_cost": cost}
    print(markdown(result))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


def grammar_cost(loaded, guided, outputs: list[list[int]]) -> dict:
    """The schema's compile time (a cold cache) and one mask per token of `outputs`, replayed."""
    t0 = time.perf_counter()
    grammars = Grammars(loaded.tokenizer, loaded.hf_config.vocab_size, loaded.eos_token_ids)
    grammars.tokenizer
    tokenizer_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    grammars.compile(guided)
    compile_s = time.perf_counter() - t0
    masks = []
    for out in outputs:
        state = grammars.state(guided)
        for token in out:
            t0 = time.perf_counter()
            state.mask()
            masks.append(time.perf_counter() - t0)
            if token in loaded.eos_token_ids:
                break
            state.advance([token])
    masks.sort()
    return {"tokenizer_ms": tokenizer_s * 1e3, "compile_ms": compile_s * 1e3, "masks": len(masks),
            "mask_us_mean": statistics.fmean(masks) * 1e6 if masks else None,
            "mask_us_p50": masks[len(masks) // 2] * 1e6 if masks else None,
            "mask_us_p99": masks[min(len(masks) - 1, int(0.99 * len(masks)))] * 1e6 if masks else None}


def markdown(result: dict) -> str:
    lines = [f"Model {result['model']} ({result['quantization']} weights), GSM8K answered as JSON "
             f"(`reasoning`, `answer`), {result['num_prompts']} prompts at batch 1, greedy, up to "
             f"{result['max_tokens']} tokens.", ""]
    for label, table in result["tables"].items():
        base = table[NO_DRAFTER]["tok_s"]
        lines += [f"**{label}**", "",
                  "| method | tok/s | vs constrained, no drafter | τ | grammar's share | valid JSON | same tokens |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for name, r in table.items():
            lines.append(f"| {name} | {r['tok_s']:.1f} | {r['tok_s'] / base:.2f}× | {r['tau']:.2f} | "
                         f"{r['grammar_share']:.0%} | {r['valid']} | {r['same_as_constrained'] or '–'} |")
        lines.append("")
    c = result["grammar_cost"]
    if c.get("masks"):
        lines += [f"Grammar engine (llguidance) on this machine: the tokenizer wrapped in {c['tokenizer_ms']:.0f} ms "
                  f"once, the schema compiled in {c['compile_ms']:.1f} ms, one mask {c['mask_us_mean']:.0f} µs on "
                  f"average (p50 {c['mask_us_p50']:.0f} µs, p99 {c['mask_us_p99']:.0f} µs, {c['masks']} masks).", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
