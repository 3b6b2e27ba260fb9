"""specserve against the CPU anchors on the same GGUF, in one invocation:

    specserve bench cpu [--datasets mt_bench humaneval gsm8k] [--num-prompts 4] [--max-tokens 128]
        [--threads 2] [--drafters auto ngram mag medusa eagle] [--quantization auto]
        [--quantized-activations float|int8] [--compile]
        [--llama-python PATH] [--streams 16] [--stream-rounds 3] [--no-hf]

Batch 1, greedy, `--max-tokens` new tokens per prompt (EOS ignored), the same chat prompts and the
same thread count for everyone: specserve plain decoding and with each drafter (the served
configuration: `--quantization auto` serves the GGUF's own int4 where the CPU has bf16),
transformers `generate` on the dequantized fp32 model, and llama.cpp (llama-cpp-python) on the same
GGUF, plain and with its prompt-lookup decoding. llama.cpp runs in the Python of its own environment
(`--llama-python`, or $SPECSERVE_LLAMA_PYTHON; it builds from source, ~8 minutes:
`python -m venv ENV && ENV/bin/pip install llama-cpp-python`) through `llama_worker.py`; without one
its rows are left out and the table says so. Every method runs prompt by prompt in turn, so a slow
stretch of the machine hits all alike. Then specserve at `--streams` concurrent requests (each
drafter, the prompts of all datasets, all admitted at once, in lockstep with plain decoding of the
same requests on a twin engine: one step of each in turn), `--stream-rounds` rounds of every
drafter in turn: aggregate tokens/s, and each drafter's ratio to plain decoding as the median over
rounds of the ratio to its paired plain run, with its range. Also reported:
the engine's memory at load, and how many prompts each method continues exactly as specserve plain
decoding does (a drafter must: speculation is lossless; llama.cpp and transformers compute with
other kernels and may part at near-ties).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch

from specserve.bench.common import build_hf_model, chat_ids, machine_info, run_hf
from specserve.bench.datasets import add_dataset_args, load_prompts
from specserve.bench.spec_decode import run_engine_batch, run_lockstep
from specserve.engine.config import EngineConfig
from specserve.engine.core import LLMEngine
from specserve.engine.loader import load_model, locate_default_gguf
from specserve.engine.quant import ACTIVATIONS, QUANTIZATIONS, int8_activations
from specserve.engine.sampling_params import SamplingParams
from specserve.kernels import cpu as native_kernels

PLAIN = "specserve plain"
HF = "transformers generate (fp32)"
LLAMA, LLAMA_LOOKUP = "llama.cpp", "llama.cpp prompt lookup"


class LlamaWorker:
    """llama.cpp in its own environment's Python (`llama_worker.py`), one JSON line per request."""

    def __init__(self, python: str, gguf: Path, threads: int, lookup_tokens: int):
        worker = Path(__file__).with_name("llama_worker.py")
        self.proc = subprocess.Popen([python, str(worker), "--model", str(gguf), "--threads", str(threads),
                                      "--lookup-tokens", str(lookup_tokens)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        hello = self.proc.stdout.readline()
        if not hello:
            raise RuntimeError(f"the llama.cpp worker ({python}) exited before it was ready")
        self.version = json.loads(hello)["version"]

    def run(self, mode: str, prompt: list[int], max_tokens: int) -> tuple[list[int], float]:
        self.proc.stdin.write(json.dumps({"mode": mode, "prompt": prompt, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            rc = self.proc.wait(timeout=60)
            hint = (" (illegal instruction: llama.cpp was built for instructions this CPU refuses; rebuild it "
                    "without them, docs/benchmarks.md)" if rc == -signal.SIGILL else "")
            raise RuntimeError(f"the llama.cpp worker exited mid-run with status {rc}{hint}")
        answer = json.loads(line)
        return answer["tokens"], answer["seconds"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def run_engine(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, drafter: str,
               tag: str) -> tuple[list[list[int]], float]:
    """`prompts` admitted together under `drafter` and decoded to the end, greedy, exactly
    `max_tokens` each (`spec_decode.run_engine_batch`): (tokens per prompt, wall seconds)."""
    _, seconds, outs, _ = run_engine_batch(engine, prompts, greedy(prompts, max_tokens), drafter, tag)
    return outs, seconds


def greedy(prompts: list[list[int]], max_tokens: int) -> list[SamplingParams]:
    """Greedy parameters for `prompts`, exactly `max_tokens` each (EOS ignored), a fresh set per run."""
    return [SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True) for _ in prompts]


def llama_python(given: str | None) -> str | None:
    """The Python that runs llama.cpp: `--llama-python`, $SPECSERVE_LLAMA_PYTHON, or this one when
    llama_cpp imports here; None when there is none."""
    if given or os.environ.get("SPECSERVE_LLAMA_PYTHON"):
        return given or os.environ["SPECSERVE_LLAMA_PYTHON"]
    return sys.executable if importlib.util.find_spec("llama_cpp") else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="specserve bench cpu", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default", help="a GGUF (llama.cpp needs one): 'default' or a .gguf path")
    ap.add_argument("--datasets", nargs="+", default=["mt_bench", "humaneval", "gsm8k"], metavar="NAME_OR_PATH",
                    help="our benchmark names, local JSONL/JSON/CSV/Parquet files, or Hugging Face dataset ids in "
                         "the offline cache (bench/datasets.py)")
    add_dataset_args(ap)
    ap.add_argument("--num-prompts", type=int, default=4, help="per dataset (default: %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None, help="torch's and llama.cpp's threads (default: torch's)")
    ap.add_argument("--drafters", nargs="*", default=["auto", "ngram", "mag", "medusa", "eagle", "eagle3"],
                    help="specserve methods besides plain decoding; auto: the server default (default: %(default)s)")
    ap.add_argument("--quantization", default="auto", choices=QUANTIZATIONS,
                    help="specserve's weights (default: %(default)s, as served)")
    ap.add_argument("--quantized-activations", default="auto", choices=ACTIVATIONS,
                    help="what specserve's int4 weights multiply (default: %(default)s)")
    ap.add_argument("--compile", action="store_true", help="specserve with its compiled CPU forward")
    ap.add_argument("--llama-python", default=None, help="the Python of an environment with llama-cpp-python")
    ap.add_argument("--lookup-tokens", type=int, default=10, help="llama.cpp prompt lookup's draft length")
    ap.add_argument("--streams", type=int, default=16, help="concurrent requests of the last table (0: skip it)")
    ap.add_argument("--stream-rounds", type=int, default=3,
                    help="rounds of the concurrent table, every method in turn in each (default: %(default)s)")
    ap.add_argument("--no-hf", dest="hf", action="store_false", help="skip transformers generate")
    ap.add_argument("--out", default="bench/results/cpu_compare.json")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    loaded = load_model(args.model)
    gguf = locate_default_gguf() if args.model == "default" else Path(args.model)
    if gguf.suffix.lower() != ".gguf":
        raise SystemExit("bench cpu: --model must be a GGUF ('default' or a .gguf file): llama.cpp reads the same file")
    engine = LLMEngine(EngineConfig(model=args.model, dtype="float32", device="cpu", max_model_len=2048,
                                    max_num_seqs=max(1, args.streams), max_num_batched_tokens=2048,
                                    drafters=("none", *args.drafters), quantization=args.quantization,
                                    quantized_activations=args.quantized_activations, compile=args.compile),
                       loaded=loaded)
    prompts = {ds: [chat_ids(loaded.tokenizer, t) for t in load_prompts(ds, args.num_prompts, prompt_field=args.prompt_field,
                                                                            messages_field=args.messages_field)]
               for ds in args.datasets}
    hf = build_hf_model(loaded) if args.hf else None
    python = llama_python(args.llama_python)
    llama = LlamaWorker(python, gguf, threads, args.lookup_tokens) if python else None

    methods: dict = {PLAIN: lambda p, n: _one(run_engine(engine, [p], n, "none", "plain"))}
    for d in args.drafters:
        methods[f"specserve {d}"] = lambda p, n, d=d: _one(run_engine(engine, [p], n, d, d))
    if hf is not None:
        methods[HF] = lambda p, n: _hf(hf, p, n)
    if llama is not None:
        methods[LLAMA] = lambda p, n: llama.run("plain", p, n)
        methods[LLAMA_LOOKUP] = lambda p, n: llama.run("lookup", p, n)
    warm = next(iter(prompts.values()))[0]
    for run in methods.values():   # warm-up: first calls allocate and (llama.cpp) map the model
        run(warm, 8)
    tokens = {m: {ds: 0 for ds in prompts} for m in methods}
    seconds = {m: {ds: 0.0 for ds in prompts} for m in methods}
    outputs: dict[str, list[list[int]]] = {m: [] for m in methods}
    for ds, ps in prompts.items():
        for p in ps:               # prompt by prompt, every method in turn
            for m, run in methods.items():
                out, s = run(p, args.max_tokens)
                tokens[m][ds] += len(out)
                seconds[m][ds] += s
                outputs[m].append(out)
    batch1 = {m: {ds: tokens[m][ds] / seconds[m][ds] for ds in prompts} for m in methods}
    same = {m: f"{sum(a == b for a, b in zip(outputs[m], outputs[PLAIN]))}/{len(outputs[PLAIN])}"
            for m in methods if m != PLAIN}

    streams, streams_ratio, streams_same = {}, {}, {}
    if args.streams:
        pool = [p for ps in prompts.values() for p in ps]
        twin = LLMEngine(engine.config, loaded=loaded)   # plain decoding's, beside each drafter's runs
        batch = [pool[i % len(pool)] for i in range(args.streams)]
        streams, streams_ratio, streams_same = concurrent(engine, twin, batch, args.max_tokens, args.drafters,
                                                          max(1, args.stream_rounds))
    if llama is not None:
        llama.close()

    cmd = "specserve bench cpu " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    result = {
        "benchmark": "cpu_compare", "command": cmd.strip(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine_info("cpu"),
        "model": loaded.name, "gguf": gguf.name, "threads": threads, "quantization": engine.quantization,
        "kv_cache_dtype": str(engine.kv_dtype).removeprefix("torch."), "compiled": args.compile,
        "quantized_activations": "int8" if int8_activations(args.quantized_activations) else "float",
        "native_kernels": native_kernels.available(),
        "torch": torch.__version__, "llama_cpp": llama.version if llama else None,
        "datasets": list(prompts), "num_prompts": args.num_prompts, "max_tokens": args.max_tokens,
        "memory_mib": {k: round(v / 2**20) for k, v in engine.stats.memory_bytes.items()},
        "batch1_tok_s": batch1, "same_as_plain": same, "streams": args.streams,
        "stream_rounds": max(1, args.stream_rounds) if args.streams else 0, "streams_tok_s": streams,
        "streams_ratio": streams_ratio, "streams_same_as_plain": streams_same,
    }
    text = markdown(result)
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


def concurrent(engine: LLMEngine, twin: LLMEngine, batch: list[list[int]], max_tokens: int, drafters: list[str],
               rounds: int) -> tuple[dict, dict, dict]:
    """`batch` admitted at once under each drafter on `engine`, each run in lockstep with plain
    decoding of the same batch on `twin` (an engine built alike; `spec_decode.run_lockstep`: one
    step of each in turn, so the machine's drift hits both), every drafter in turn in each of
    `rounds` rounds: (aggregate tokens/s per method over all rounds, each drafter's {median, min,
    max} over rounds of its tokens/s divided by its pair's plain tokens/s, prompts continued
    exactly as plain does). Without drafters, plain decoding alone on `twin`."""
    for e, d in [(twin, "none")] + [(engine, d) for d in drafters]:
        run_engine(e, batch[:2], 8, d, f"warm-{d}")
    methods = [PLAIN] + [f"specserve {d}" for d in drafters]
    tokens, seconds = dict.fromkeys(methods, 0), dict.fromkeys(methods, 0.0)
    ratios: dict[str, list[float]] = {m: [] for m in methods[1:]}
    same = dict.fromkeys(methods[1:], 0)
    for r in range(rounds):
        if not drafters:
            n, s, _, _ = run_engine_batch(twin, batch, greedy(batch, max_tokens), "none", f"streams-none-{r}")
            tokens[PLAIN] += n
            seconds[PLAIN] += s
        for d, m in zip(drafters, methods[1:]):
            plain, spec = run_lockstep([(twin, batch, greedy(batch, max_tokens), "none", f"streams-none-{d}-{r}"),
                                        (engine, batch, greedy(batch, max_tokens), d, f"streams-{d}-{r}")])
            for method, (n, s, _, _) in ((PLAIN, plain), (m, spec)):
                tokens[method] += n
                seconds[method] += s
            ratios[m].append((spec[0] / spec[1]) / (plain[0] / plain[1]))
            same[m] += sum(a == b for a, b in zip(spec[2], plain[2]))
    ratio = {m: {"median": statistics.median(v), "min": min(v), "max": max(v)} for m, v in ratios.items()}
    return ({m: tokens[m] / seconds[m] for m in methods}, ratio,
            {m: f"{k}/{len(batch) * rounds}" for m, k in same.items()})


def _one(run: tuple[list[list[int]], float]) -> tuple[list[int], float]:
    outs, s = run
    return outs[0], s


def _hf(hf, prompt: list[int], max_tokens: int) -> tuple[list[int], float]:
    _, s, outs = run_hf(hf, [prompt], max_tokens)
    return outs[0], s


def markdown(result: dict) -> str:
    """The run's tables: batch-1 tokens/s per method and dataset (with the mean and the ratio to
    llama.cpp plain), then the concurrent streams."""
    ds = result["datasets"]
    b1 = result["batch1_tok_s"]
    anchor = statistics.mean(b1[LLAMA].values()) if LLAMA in b1 else None
    quant = result["quantization"] if result["quantization"] != "none" else "fp32"
    lines = [f"## CPU comparison: {result['model']} ({result['gguf']}), batch 1, {result['num_prompts']} prompts × "
             f"{result['max_tokens']} greedy tokens per dataset, {result['threads']} threads", "",
             "| method | " + " | ".join(ds) + " | mean | vs llama.cpp | same tokens as specserve plain |",
             "|---|" + "---|" * (len(ds) + 3)]
    for m, per in b1.items():
        mean = statistics.mean(per.values())
        ratio = f"{mean / anchor:.2f}×" if anchor else "–"
        lines.append(f"| {m} | " + " | ".join(f"{per[d]:.1f}" for d in ds) + f" | {mean:.1f} | {ratio} | "
                     f"{result['same_as_plain'].get(m, '–')} |")
    layer = {True: ", native CPU kernels", False: ", torch ops (no native CPU kernels)"}.get(result.get("native_kernels"), "")
    acts = " with int8 activations" if result.get("quantized_activations") == "int8" else ""
    notes = [f"specserve: {quant} weights{acts}, KV cache {result['kv_cache_dtype']}{layer}"
             f"{', compiled forward' if result.get('compiled') else ''}; memory at load (MiB): "
             + ", ".join(f"{k} {v}" for k, v in result["memory_mib"].items()) + "."]
    notes.append(f"llama.cpp: llama-cpp-python {result['llama_cpp']}." if result.get("llama_cpp") else
                 "llama.cpp: not run (no environment with llama-cpp-python: `--llama-python`).")
    if result.get("streams_tok_s"):
        rounds = result.get("stream_rounds", 1)
        lines += ["", f"{result['streams']} concurrent requests (all datasets' prompts), {rounds} round(s) of every "
                  "drafter in turn, each run in lockstep with plain decoding of the same requests on a twin engine "
                  "(one step of each in turn): aggregate tokens/s, and the median over rounds of the ratio to "
                  "the paired plain run (range in brackets):", "",
                  "| method | tokens/s | vs plain | same tokens as plain |", "|---|---|---|---|"]
        base = result["streams_tok_s"].get(PLAIN)
        for m, v in result["streams_tok_s"].items():
            r = result.get("streams_ratio", {}).get(m)
            vs = f"{r['median']:.2f}× ({r['min']:.2f}–{r['max']:.2f})" if r else f"{v / base:.2f}×"
            lines.append(f"| {m} | {v:.1f} | {vs} | {result['streams_same_as_plain'].get(m, '–')} |")
    return "\n".join(lines + ["", " ".join(notes)]) + "\n"


if __name__ == "__main__":
    sys.exit(main())
