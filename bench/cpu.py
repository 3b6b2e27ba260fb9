"""specserve against llama.cpp's own server on the same GGUF, server against server over HTTP:

    specserve bench cpu [--llama-server PATH] [--kinds ...] [--per-kind 3] [--max-tokens 128]
        [--threads 2] [--drafters auto ngram eagle3] [--llama-spec ngram-simple ngram-mod]
        [--rounds 1] [--serve-arg=--quantized-activations=float ...] [--llama-python PATH]
        [--llama-bench PATH] [--streams 16] [--stream-rounds 3]

Batch 1, greedy, `--max-tokens` new tokens per request (EOS ignored), chat prompts of eight kinds
(`bench/datasets.py` `prompt_kinds`: writing, QA, coding, math, extraction, and summarization, RAG
and translation prompts built from the shared data), each sent as one non-streamed
/v1/chat/completions request and timed from send to the whole answer:

- `llama-server` (C++, `--llama-server PATH` or $SPECSERVE_LLAMA_SERVER; `-t THREADS -np 1`),
  plain and with each of its self-speculation types (`--llama-spec`, e.g. `ngram-simple`,
  `ngram-mod`), one server each, started here;
- `specserve serve` started here with the served defaults (plus `--serve-arg`s), plain decoding
  (`"speculative": {"drafter": "none"}`) and each of `--drafters` per request;
- our plain decoding without the server: the engine stepped in this process on the same prompts
  (what HTTP and the server cost a request).

Every server is up the whole run; prompt by prompt, every method in turn (a slow stretch of the
machine hits all alike), `--rounds` times. Reported per kind: tokens/s (completion tokens over wall
seconds), the mean over kinds against llama-server plain and against our plain, the mean over the
input-grounded kinds (extraction, summarization, RAG), and how many answers of each drafter are our
plain answer exactly (speculation is lossless; llama.cpp computes with other kernels and may part
at near-ties). Optional rows: llama.cpp through its Python binding in this process
(`--llama-python`), and `llama-bench`'s batch costs (`--llama-bench`: a forward of k prompt tokens
over one of 1 token). Then, unless `--streams 0`, specserve at `--streams` concurrent requests in
process (each drafter, all admitted at once, in lockstep with plain decoding of the same requests
on a twin engine: one step of each in turn), `--stream-rounds` rounds of every drafter in turn:
aggregate tokens/s and each drafter's ratio to its paired plain run (median over rounds, range).
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
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from specserve.bench.common import ManagedServer, chat_ids, free_port, machine_info, serve_command, write_result
from specserve.bench.datasets import GROUNDED_KINDS, KINDS, prompt_kinds
from specserve.bench.spec_decode import run_engine_batch, run_lockstep
from specserve.engine.config import EngineConfig
from specserve.engine.core import LLMEngine
from specserve.engine.loader import load_model, locate_default_gguf
from specserve.engine.sampling_params import SamplingParams

PLAIN = "specserve plain"
ALONE = "specserve plain, engine alone (no HTTP)"
LLAMA = "llama-server"
LLAMA_PY = "llama.cpp Python binding (in process)"
BATCHES = (2, 3, 4, 9, 17)      # llama-bench's prompt batches, against one of 1 token


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
    """The Python that runs llama.cpp's binding: `--llama-python`, $SPECSERVE_LLAMA_PYTHON, or this
    one when llama_cpp imports here; None when there is none."""
    if given or os.environ.get("SPECSERVE_LLAMA_PYTHON"):
        return given or os.environ["SPECSERVE_LLAMA_PYTHON"]
    return sys.executable if importlib.util.find_spec("llama_cpp") else None


class Chat:
    """One method: a server's /v1/chat/completions on one kept-alive connection, with the request
    fields that select the method (our per-request drafter)."""

    def __init__(self, base: str, model: str, extra: dict):
        import httpx

        self.client = httpx.Client(base_url=base, timeout=600)
        self.model, self.extra = model, extra

    def __call__(self, text: str, max_tokens: int) -> tuple[str, int, float]:
        """(the answer, its completion tokens, wall seconds from send to the whole answer)."""
        body = {"model": self.model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
                "temperature": 0.0, "ignore_eos": True, **self.extra}
        t0 = time.perf_counter()
        r = self.client.post("/v1/chat/completions", json=body)
        seconds = time.perf_counter() - t0
        r.raise_for_status()
        j = r.json()
        return j["choices"][0]["message"]["content"], j["usage"]["completion_tokens"], seconds

    def close(self) -> None:
        self.client.close()


class EngineAlone:
    """Our plain decoding without the server: the engine stepped in this process on the prompt the
    server would build (`chat_ids`), timed alike; the answer is its text deltas, as the server
    joins them."""

    def __init__(self, engine: LLMEngine, tokenizer):
        self.engine, self.tokenizer, self._n = engine, tokenizer, 0

    def __call__(self, text: str, max_tokens: int) -> tuple[str, int, float]:
        self._n += 1
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        t0 = time.perf_counter()
        self.engine.add_request(f"alone-{self._n}", chat_ids(self.tokenizer, text), params, drafter="none")
        parts, tokens = [], 0
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                for d in out.outputs:
                    parts.append(d.text)
                    tokens += len(d.token_ids)
        return "".join(parts), tokens, time.perf_counter() - t0

    def close(self) -> None:
        pass


def llama_server_command(binary: str, gguf: Path, threads: int, port: int, spec: str | None) -> list[str]:
    cmd = [binary, "-m", str(gguf), "-t", str(threads), "-np", "1", "--host", "127.0.0.1", "--port", str(port)]
    return cmd + (["--spec-type", spec] if spec else [])


def llama_bench_costs(binary: str, gguf: Path, threads: int, depth: int) -> dict[str, float]:
    """`llama-bench`'s forward of k prompt tokens (k in BATCHES) after `depth` tokens of context,
    over its forward of one: {k: ratio}."""
    ks = ",".join(str(k) for k in (1, *BATCHES))
    out = subprocess.run([binary, "-m", str(gguf), "-t", str(threads), "-p", ks, "-n", "0", "-d", str(depth),
                          "-r", "5", "-o", "json"], capture_output=True, text=True, timeout=900, check=True).stdout
    ns = {row["n_prompt"]: row["avg_ns"] for row in json.loads(out)}
    return {str(k): ns[k] / ns[1] for k in BATCHES}


def start_servers(args, gguf: Path, threads: int, logs: Path) -> tuple[dict[str, ManagedServer], dict[str, str]]:
    """Ours and each llama-server, started and ready: (servers, their base URLs), by name."""
    servers, bases = {}, {}
    ours = free_port()
    servers["specserve"] = ManagedServer(serve_command(args.model, ours, args.drafters, ["--disable-log-requests", *args.serve_arg]),
                                         logs / "specserve.log")
    bases["specserve"] = f"http://127.0.0.1:{ours}"
    if args.llama_server:
        for spec in [None, *args.llama_spec]:
            port = free_port()
            name = LLAMA if spec is None else f"{LLAMA} {spec}"
            servers[name] = ManagedServer(llama_server_command(args.llama_server, gguf, threads, port, spec),
                                          logs / f"{name.replace(' ', '_')}.log")
            bases[name] = f"http://127.0.0.1:{port}"
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    for name, server in servers.items():
        server.start(env=env)
        server.wait_ready(bases[name], args.ready_timeout)
    return servers, bases


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="specserve bench cpu", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default", help="a GGUF (llama.cpp needs one): 'default' or a .gguf path")
    ap.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS, metavar="KIND",
                    help=f"prompt kinds (default: all: {', '.join(KINDS)})")
    ap.add_argument("--per-kind", type=int, default=3, help="prompts per kind (default: %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=1, help="rounds over the prompts (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=None,
                    help="every server's threads (OMP_NUM_THREADS for ours, -t for llama.cpp; default: torch's)")
    ap.add_argument("--drafters", nargs="*", default=["auto", "ngram", "eagle3"],
                    help="our methods besides plain decoding, by request; auto: the server default "
                         "(default: %(default)s)")
    ap.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                    help="an extra argument of our server (repeat; e.g. --serve-arg=--quantized-activations=float)")
    ap.add_argument("--llama-server", default=os.environ.get("SPECSERVE_LLAMA_SERVER"), metavar="PATH",
                    help="llama.cpp's llama-server binary (default: $SPECSERVE_LLAMA_SERVER; without one its rows "
                         "are left out)")
    ap.add_argument("--llama-spec", nargs="*", default=["ngram-simple"], metavar="TYPE",
                    help="llama-server --spec-type values, one more server each (default: %(default)s)")
    ap.add_argument("--llama-bench", default=os.environ.get("SPECSERVE_LLAMA_BENCH"), metavar="PATH",
                    help="llama.cpp's llama-bench binary, for its batch costs (default: $SPECSERVE_LLAMA_BENCH)")
    ap.add_argument("--bench-depth", type=int, default=256, help="llama-bench's context before the batch")
    ap.add_argument("--llama-python", default=None, help="the Python of an environment with llama-cpp-python")
    ap.add_argument("--lookup-tokens", type=int, default=10, help="the Python binding's prompt lookup draft length")
    ap.add_argument("--streams", type=int, default=16, help="concurrent requests of the in-process table (0: skip)")
    ap.add_argument("--stream-rounds", type=int, default=3,
                    help="rounds of the concurrent table, every method in turn in each (default: %(default)s)")
    ap.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for a server's /health")
    ap.add_argument("--out", default="bench/results/cpu_compare.json")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    gguf = locate_default_gguf() if args.model == "default" else Path(args.model)
    if gguf.suffix.lower() != ".gguf":
        raise SystemExit("bench cpu: --model must be a GGUF ('default' or a .gguf file): llama.cpp reads the same file")
    prompts = prompt_kinds(args.per_kind, tuple(args.kinds))
    loaded = load_model(args.model)
    alone = LLMEngine(EngineConfig(model=args.model, dtype="float32", device="cpu", max_model_len=2048,
                                   max_num_batched_tokens=2048, drafters=()), loaded=loaded)
    logs = Path(tempfile.mkdtemp(prefix="specserve-bench-cpu-"))
    servers, bases = start_servers(args, gguf, threads, logs)
    try:
        model = json.loads(_get(bases["specserve"] + "/v1/models"))["data"][0]["id"]
        methods: dict = {}
        for name in servers:
            if name != "specserve":
                methods[name] = Chat(bases[name], model, {})
        methods[PLAIN] = Chat(bases["specserve"], model, {"speculative": {"drafter": "none"}})
        methods[ALONE] = EngineAlone(alone, loaded.tokenizer)
        for d in args.drafters:
            methods[f"specserve {d}"] = Chat(bases["specserve"], model, {} if d == "auto" else
                                             {"speculative": {"drafter": d}})
        batch1, answers = http_batch1(methods, prompts, args.max_tokens, max(1, args.rounds))
        for chat in methods.values():
            chat.close()
    finally:
        stopped = {name: server.stop(60)["exit_status"] for name, server in servers.items()}
    same = {m: f"{sum(a == b for a, b in zip(answers[m], answers[PLAIN]))}/{len(answers[PLAIN])}"
            for m in methods if m != PLAIN}

    del alone
    python = llama_python(args.llama_python)
    llama_py = None
    if python:
        batch1[LLAMA_PY], llama_py = binding_batch1(python, gguf, threads, args.lookup_tokens, loaded, prompts,
                                                    args.max_tokens)
    costs = llama_bench_costs(args.llama_bench, gguf, threads, args.bench_depth) if args.llama_bench else None

    streams, streams_ratio, streams_same = {}, {}, {}
    if args.streams:
        config = EngineConfig(model=args.model, dtype="float32", device="cpu", max_model_len=2048,
                              max_num_seqs=args.streams, max_num_batched_tokens=2048, drafters=("none", *args.drafters))
        engine, twin = LLMEngine(config, loaded=loaded), LLMEngine(config, loaded=loaded)
        pool = [chat_ids(loaded.tokenizer, t) for ps in prompts.values() for t in ps]
        batch = [pool[i % len(pool)] for i in range(args.streams)]
        streams, streams_ratio, streams_same = concurrent(engine, twin, batch, args.max_tokens, args.drafters,
                                                          max(1, args.stream_rounds))

    cmd = "specserve bench cpu " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    result = {
        "benchmark": "cpu_compare", "command": cmd.strip(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine_info("cpu"),
        "model": model, "gguf": gguf.name, "threads": threads, "torch": torch.__version__,
        "server_command": " ".join(serve_command(args.model, "PORT", args.drafters, ["--disable-log-requests", *args.serve_arg])[1:]),
        "llama_server": _version(args.llama_server) if args.llama_server else None,
        "llama_spec": args.llama_spec if args.llama_server else [], "llama_cpp_python": llama_py,
        "kinds": list(prompts), "grounded_kinds": [k for k in prompts if k in GROUNDED_KINDS],
        "per_kind": args.per_kind, "rounds": max(1, args.rounds), "max_tokens": args.max_tokens,
        "batch1_tok_s": batch1, "same_as_plain": same, "server_exit_status": stopped,
        "llama_bench_batch_cost": costs, "llama_bench_depth": args.bench_depth if costs else None,
        "streams": args.streams, "stream_rounds": max(1, args.stream_rounds) if args.streams else 0,
        "streams_tok_s": streams, "streams_ratio": streams_ratio, "streams_same_as_plain": streams_same,
    }
    write_result(args.out, result, markdown)
    return 0


def http_batch1(methods: dict, prompts: dict[str, list[str]], max_tokens: int,
                rounds: int) -> tuple[dict, dict]:
    """Every prompt through every method in turn, `rounds` times: ({method: {kind: tokens/s}},
    {method: answers in order})."""
    warm = next(iter(prompts.values()))[0]
    for chat in methods.values():      # warm-up: the first requests allocate, map the model, compile
        chat(warm, 8)
    tokens = {m: dict.fromkeys(prompts, 0) for m in methods}
    seconds = {m: dict.fromkeys(prompts, 0.0) for m in methods}
    answers: dict[str, list[str]] = {m: [] for m in methods}
    for _ in range(rounds):
        for kind, texts in prompts.items():
            for text in texts:
                for m, chat in methods.items():
                    answer, n, s = chat(text, max_tokens)
                    tokens[m][kind] += n
                    seconds[m][kind] += s
                    answers[m].append(answer)
    return {m: {k: tokens[m][k] / seconds[m][k] for k in prompts} for m in methods}, answers


def binding_batch1(python: str, gguf: Path, threads: int, lookup_tokens: int, loaded, prompts: dict[str, list[str]],
                   max_tokens: int) -> tuple[dict[str, float], str]:
    """llama.cpp through its Python binding, plain, in its own process: ({kind: tokens/s}, its version)."""
    llama = LlamaWorker(python, gguf, threads, lookup_tokens)
    try:
        ids = {k: [chat_ids(loaded.tokenizer, t) for t in ts] for k, ts in prompts.items()}
        llama.run("plain", next(iter(ids.values()))[0], 8)
        rate = {}
        for kind, ps in ids.items():
            runs = [llama.run("plain", p, max_tokens) for p in ps]
            rate[kind] = sum(len(t) for t, _ in runs) / sum(s for _, s in runs)
        return rate, llama.version
    finally:
        llama.close()


def _get(url: str) -> str:
    import httpx

    return httpx.get(url, timeout=30).text


def _version(binary: str) -> str:
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=60)
    return next((line.strip() for line in (out.stdout + out.stderr).splitlines() if line.startswith("version")), "?")


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


def markdown(result: dict) -> str:
    """The run's tables: batch-1 tokens/s per method and kind over HTTP (mean, against llama-server
    plain and our plain, the input-grounded kinds' mean), llama-bench's batch costs, then the
    concurrent streams."""
    kinds, grounded = result["kinds"], result["grounded_kinds"]
    b1 = result["batch1_tok_s"]
    mean = {m: statistics.mean(per.values()) for m, per in b1.items()}
    gmean = {m: statistics.mean(per[k] for k in grounded) for m, per in b1.items()} if grounded else {}
    anchor, plain = mean.get(LLAMA), mean.get(PLAIN)
    lines = [f"## CPU: specserve against llama-server over HTTP, {result['model']} ({result['gguf']}), batch 1, "
             f"{result['per_kind']} prompts per kind × {result['rounds']} round(s), {result['max_tokens']} greedy "
             f"tokens, {result['threads']} threads", "",
             "| method | " + " | ".join(kinds) + " | mean | vs llama-server | vs our plain | grounded kinds "
             "(vs our plain) | same answers as our plain |", "|---|" + "---|" * (len(kinds) + 5)]
    for m, per in b1.items():
        g = f"{gmean[m]:.1f} ({gmean[m] / gmean[PLAIN]:.2f}×)" if grounded and PLAIN in gmean else "–"
        lines.append(f"| {m} | " + " | ".join(f"{per[k]:.1f}" for k in kinds) + f" | {mean[m]:.1f} | "
                     + (f"{mean[m] / anchor:.2f}×" if anchor else "–") + " | "
                     + (f"{mean[m] / plain:.2f}×" if plain else "–") + f" | {g} | "
                     + f"{result['same_as_plain'].get(m, '–')} |")
    notes = [f"Ours: `{result['server_command']}`; drafters by request."]
    notes.append(f"llama.cpp: `llama-server` {result['llama_server']}, `-t {result['threads']} -np 1`, "
                 f"self-speculation rows with `--spec-type` {', '.join(result['llama_spec']) or 'none'}."
                 if result.get("llama_server") else "llama.cpp: not run (`--llama-server`).")
    if result.get("llama_cpp_python"):
        notes.append(f"The Python binding row: llama-cpp-python {result['llama_cpp_python']}, in its own process, "
                     "no HTTP.")
    notes.append(f"Grounded kinds: {', '.join(grounded) or 'none'}.")
    if result.get("llama_bench_batch_cost"):
        c = result["llama_bench_batch_cost"]
        lines += ["", f"`llama-bench` batch costs after {result['llama_bench_depth']} tokens of context (a forward "
                  "of k prompt tokens over one of 1 token):", "",
                  "| k | " + " | ".join(c) + " |", "|---|" + "---|" * len(c),
                  "| cost | " + " | ".join(f"{v:.2f}×" for v in c.values()) + " |"]
    if result.get("streams_tok_s"):
        lines += ["", f"{result['streams']} concurrent requests in process (all kinds' prompts), "
                  f"{result['stream_rounds']} round(s) of every drafter in turn, each run in lockstep with plain "
                  "decoding of the same requests on a twin engine (one step of each in turn): aggregate tokens/s, "
                  "and the median over rounds of the ratio to the paired plain run (range in brackets):", "",
                  "| method | tokens/s | vs plain | same tokens as plain |", "|---|---|---|---|"]
        base = result["streams_tok_s"].get(PLAIN)
        for m, v in result["streams_tok_s"].items():
            r = result.get("streams_ratio", {}).get(m)
            vs = f"{r['median']:.2f}× ({r['min']:.2f}–{r['max']:.2f})" if r else f"{v / base:.2f}×"
            lines.append(f"| {m} | {v:.1f} | {vs} | {result['streams_same_as_plain'].get(m, '–')} |")
    return "\n".join(lines + ["", " ".join(notes)]) + "\n"


if __name__ == "__main__":
    sys.exit(main())
