"""The target forward's cost by step size: seconds of one forward plus the LM head on every row,
for n new tokens (a decode row and the nodes of a draft tree) after a prefix, for each variant of
the weights: fp32 as they are (`unpacked`), fp32 with the CPU's prepacked copies
(`LlamaModel.pack_weights`, `prepacked`), and weight-only quantized (`engine/quant.py`: `int8`,
`int4` through the native kernels where they build, fp32 activations, `int4-a8` with int8 ones
(`--quantized-activations int8`); `int8-torch`, `int4-torch`
through torch's packed kernels with fp32 activations, `int8-bf16`, `int4-bf16` with bf16 ones). This is the curve the
goodput budget learns (what a draft tree of n - 1 nodes adds to a step) and what quantization buys.

    python -m specserve.bench.forward_cost --prefix 256 --tokens 1 2 3 5 9 17 33 [--variants unpacked prepacked int8 int4]

The variants run on the same model, interleaved (A B C A B C ...), and each figure is the median of
`--repeats` timings, so a machine that slows down during the run slows all alike. After each swap
one untimed forward reads the variant's weights into the caches, as a decode step finds them: the
first timed size had read them cold, which made a 2-token forward look almost free (1.04x a 1-token
one on the AVX2 VM, 1.30x warm).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from datetime import datetime, timezone

import torch


COPIES = ("_specserve_packed", "_specserve_quant")   # what `engine.model.linear` computes with, where present
VARIANTS = ("unpacked", "prepacked", "int8", "int8-torch", "int8-bf16", "int4", "int4-a8", "int4-torch", "int4-bf16")


def _take(model) -> dict:
    """Remove the prepacked and quantized copies from `model`'s weights; returns them ({(name,
    attribute): copy}) to put back."""
    out = {}
    for name, p in model.named_parameters():
        for attr in COPIES:
            if hasattr(p, attr):
                out[(name, attr)] = getattr(p, attr)
                delattr(p, attr)
    return out


def _put(model, copies: dict) -> None:
    for name, p in model.named_parameters():
        for attr in COPIES:
            if (name, attr) in copies:
                setattr(p, attr, copies[(name, attr)])


def _variant_copies(model, variant: str) -> tuple[dict, int]:
    """The weight copies `variant` computes with, made on a bare `model` and taken off it again."""
    from specserve.engine.quant import quantize_model

    if variant == "prepacked":
        done = model.pack_weights()
    elif variant != "unpacked":
        kind, _, how = variant.partition("-")
        done = quantize_model(model, kind, act_dtype=torch.bfloat16 if how == "bf16" else torch.float32,
                              native=None if how in ("", "a8") else False, int8_act=how == "a8")["weights"]
    else:
        done = 0
    return _take(model), done


def markdown(result: dict) -> str:
    """The table of a run's JSON: milliseconds per forward by new tokens, per variant of the weights,
    and each against the first variant and against its own 1-token forward."""
    m, ms = result["machine"], result["forward_ms"]
    variants = list(ms)
    first = variants[0]
    tokens = sorted(ms[first], key=int)
    lines = [f"## Target forward + LM head by new tokens: {result['model']} (cpu, {result['dtype']})", "",
             f"{result['date']}; {m['platform']}, {m['cpu_count']} CPUs, {m['torch_threads']} torch threads; torch "
             f"{result['torch']}; prefix {result['prefix']} tokens; median of {result['repeats']}, variants "
             "interleaved.", ""]
    if result.get("command"):
        lines += [f"`{result['command']}`", ""]
    lines += ["| new tokens | " + " | ".join(f"{v} ms" for v in variants) + " | "
              + " | ".join(f"{v} / {first}" for v in variants[1:]) + " | "
              + " | ".join(f"{v} vs 1 token" for v in variants) + " |",
              "|---" * (1 + 3 * len(variants) - 1) + "|"]
    base = {v: ms[v][tokens[0]] for v in variants}
    for n in tokens:
        lines.append(f"| {n} | " + " | ".join(f"{ms[v][n]:.1f}" for v in variants) + " | "
                     + " | ".join(f"{ms[v][n] / ms[first][n]:.2f}" for v in variants[1:]) + " | "
                     + " | ".join(f"{ms[v][n] / base[v]:.2f}" for v in variants) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--prefix", type=int, default=256, help="tokens already in the KV cache (default: %(default)s)")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 3, 5, 9, 17, 33],
                    help="new tokens per forward (default: %(default)s)")
    ap.add_argument("--repeats", type=int, default=15, help="timings per variant and size (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--variants", nargs="+", default=["unpacked", "prepacked"], choices=VARIANTS,
                    help="weights to time, the first the reference (default: %(default)s)")
    ap.add_argument("--out", default="bench/results/forward_cpu",
                    help="writes OUT.json and OUT.md (default: %(default)s)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if min(args.tokens) < 1 or args.prefix < 0 or args.repeats < 1:
        raise SystemExit("forward_cost: --tokens and --repeats must be positive, --prefix not negative")

    import transformers

    from specserve.bench.common import machine_info, write_result
    from specserve.engine.attention import build_attn_metadata
    from specserve.engine.config import ModelConfig
    from specserve.engine.kv_cache import KVCache
    from specserve.engine.loader import load_model
    from specserve.engine.model import LlamaModel

    loaded = load_model(args.model)
    cfg = ModelConfig.from_hf(loaded.hf_config)
    longest = args.prefix + max(args.tokens)
    model = LlamaModel.from_state_dict(cfg, loaded.state_dict, max_positions=longest, dtype=torch.float32,
                                       device=torch.device("cpu"))
    block_size = 16
    blocks = -(-longest // block_size)
    cache = KVCache(cfg.num_layers, blocks, block_size, cfg.num_kv_heads, cfg.head_dim, torch.float32,
                    torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():   # the prefix, once: every timed forward attends over it
        positions, meta = build_attn_metadata([list(range(blocks))], block_size, [0], [args.prefix], None, "cpu")
        if args.prefix:
            model(torch.randint(0, cfg.vocab_size, (args.prefix,), generator=g), positions, cache, meta)

    @torch.inference_mode()
    def forward(n: int) -> float:
        ids = torch.randint(0, cfg.vocab_size, (n,), generator=g)
        t0 = time.perf_counter()
        mask = None if n == 1 else torch.ones(n, n, dtype=torch.bool).tril()
        positions, meta = build_attn_metadata([list(range(blocks))], block_size, [args.prefix], [n], [mask], "cpu")
        model.compute_logits(model(ids, positions, cache, meta))
        return time.perf_counter() - t0

    variants = list(dict.fromkeys(args.variants))
    times: dict[str, dict[int, list[float]]] = {v: {n: [] for n in args.tokens} for v in variants}
    copies, done = {}, {}
    for v in variants:   # all kept alive throughout: every variant runs with the same memory in use
        copies[v], done[v] = _variant_copies(model, v)
    for r in range(args.repeats + 1):           # the first round warms up and is discarded
        for v in variants:
            _take(model)
            _put(model, copies[v])
            forward(args.tokens[0])   # untimed: the first forward after a swap reads its weights cold
            for n in args.tokens:
                s = forward(n)
                if r:
                    times[v][n].append(s)
    for v in variants:
        if v != "unpacked" and not done[v]:
            print(f"forward_cost: this torch/CPU cannot make the {v} weights; that column is unpacked", file=sys.stderr)
    ms = {v: {n: 1000 * statistics.median(times[v][n]) for n in args.tokens} for v in variants}
    stamp = datetime.now(timezone.utc).isoformat(timespec="seconds")
    cmd = "python -m specserve.bench.forward_cost " + " ".join(sys.argv[1:] if argv is None else argv)
    result = {"benchmark": "forward_cost", "command": cmd.strip(), "date": stamp, "machine": machine_info("cpu"),
              "torch": torch.__version__, "transformers": transformers.__version__, "model": loaded.name,
              "dtype": "float32", "prefix": args.prefix, "repeats": args.repeats, "weights_done": done,
              "forward_ms": {v: {str(n): round(t, 2) for n, t in ms[v].items()} for v in variants}}
    write_result(args.out, result, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
