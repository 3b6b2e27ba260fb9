"""Regenerate docs/results.md from the benchmark results in bench/results/*.json.

    specserve bench report [--results bench/results] [--out docs/results.md] [--check]
    (or: python -m specserve.bench.report ...)

The page is generated, never edited by hand: one section per benchmark, and in it one table per result
file, newest first, each headed by the command that produced it, the machine and the date. The tables
are the benchmarks' own renderers (each bench module's `markdown(result)`, the same text it prints
when it runs), so a figure reads the same in a run's output and on the page.

Which benchmark a JSON belongs to comes from the JSON itself: its "benchmark" key (written by every
bench), else, for files written before that key existed, the command it records
(`python -m specserve.bench.NAME ...`, `specserve bench NAME ...`), else the keys only that bench writes.
A JSON that none of these place is left out with a warning. `--check` writes nothing and exits 1 when
the page is out of date (for CI).
"""

from __future__ import annotations

import argparse
import fnmatch
import importlib
import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

DEFAULT_RESULTS = Path("bench") / "results"
DEFAULT_OUT = Path("docs") / "results.md"


@dataclass(frozen=True)
class Benchmark:
    title: str
    module: str         # has markdown(result) -> str
    cli: str            # its `specserve bench` name
    about: str          # what its tables show, for the reader of the page


# in page order
BENCHMARKS: dict[str, Benchmark] = {
    "spec_decode": Benchmark(
        "Speculative decoding", "specserve.bench.spec_decode", "spec",
        "Each drafter against our own plain decoding (and transformers `generate` where run) on the same prompts, "
        "every method generating the same number of tokens per prompt (EOS ignored). speedup: tokens/s over plain "
        "decoding in the same run; τ: tokens per target forward (bonus included); SWI: standardized walltime "
        "improvement; α: accepted / drafted tokens. With several draft-budget policies a method reads "
        "`drafter@policy`. At temperature 0 every drafter must reproduce plain decoding token for token: the "
        "greedy mismatches column counts the prompts where it did not."),
    "gpu": Benchmark(
        "GPU bring-up", "specserve.bench.gpu", "gpu",
        "One run on a lent GPU machine (`tools/gpu-check`): the weight-read floor, plain decoding by batch size "
        "(with CUDA graphs of decode and verification steps where the run had them), every drafter against plain decoding at "
        "batch 1 and 32 under the goodput draft policy, transformers `generate` at batch 1, and the Triton tree "
        "attention against the torch reference on verification shapes."),
    "cpu_compare": Benchmark(
        "CPU comparison", "specserve.bench.cpu", "cpu",
        "specserve as served on the CPU against llama.cpp's own C++ server (`llama-server`, plain and with its "
        "n-gram self-speculation) on the same GGUF, server against server over HTTP: batch 1, greedy, the same chat "
        "prompts of eight kinds (three input-grounded: extraction, summarization, RAG), tokens and threads, every "
        "method prompt by prompt in turn; `llama-bench`'s batch costs where run; then specserve at 16 concurrent "
        "requests in process, in rounds of every method in turn."),
    "structured": Benchmark(
        "Structured output", "specserve.bench.structured", "structured",
        "A JSON-extraction workload (GSM8K answered as `{\"reasoning\", \"answer\"}` under a JSON schema) on the "
        "served default model: constrained decoding without drafts, with the grammar's forced tokens drafted, and "
        "with a drafter besides, at batch 1 and with concurrent requests; every constrained row must give the same "
        "tokens; then llguidance's compile time and per-token mask cost on this machine."),
    "plain_decode": Benchmark(
        "Plain decoding", "specserve.bench.plain_decode", "plain",
        "Our engine's plain (non-speculative) decoding against transformers `generate`: batch 1, greedy, the same "
        "prompts and number of new tokens; with `--quantization`, one row per weight quantization (`engine/quant.py`) "
        "and how many prompts it continues exactly as the unquantized model does."),
    "activation_quality": Benchmark(
        "Int8 activations", "specserve.bench.activation_quality", "activations",
        "What the default int8 activations (`--quantized-activations auto` on an AVX2 or AVX-512 VNNI CPU) cost in "
        "quality: the served default model with float and with int8 activations, and llama.cpp where its "
        "`llama-perplexity` was given, against transformers on the GGUF's dequantized fp32 weights, on windows of "
        "GSM8K and HumanEval solutions scored as `llama-perplexity` scores them."),
    "forward_cost": Benchmark(
        "Target forward cost", "specserve.bench.forward_cost", "forward",
        "The target's forward and LM head by the number of new tokens in the step (the size of a draft tree), per "
        "variant of the weights: fp32 with and without the oneDNN-prepacked copies (`--prepack-weights`, on by "
        "default on the CPU), weight-only int8 / int4 with fp32 or bf16 activations (`--quantization`): what a "
        "draft tree costs against a 1-token decode, the cost table behind the goodput draft budget."),
    "step_anatomy": Benchmark(
        "Decode step anatomy", "specserve.bench.step_anatomy", "step",
        "Where a one-row decode step's time goes on the CPU, by context length: the projections' and LM head's "
        "matmuls, the attention, the rest of the layer stack (norms, SiLU) from the native kernels' phase timers, "
        "and the host work around them (scheduler, inputs, sampling, bookkeeping), with the step over the sum of "
        "its matmuls."),
    "budget_replay": Benchmark(
        "Draft-budget policies replayed", "specserve.bench.budget_replay", "replay",
        "The draft-budget policies replayed offline on one recorded decoding (ngram, mag): the same acceptance "
        "outcomes, each policy's simulated speedup from the step costs measured in the recording, so policies "
        "are compared without the noise of separate runs."),
    "serve_throughput": Benchmark(
        "Server throughput", "specserve.bench.serve_throughput", "serve",
        "A real server on loopback; at each level that many streaming chat requests run at once (EOS ignored): "
        "generated tokens/s over the level's wall clock, and the mean time to first token."),
    "reliability": Benchmark(
        "Reliability", "specserve.bench.reliability", "reliability",
        "A live server under a soak of mixed requests (chat and completions, streamed or not, every drafter and "
        "temperature), a storm of clients that disconnect mid-stream, and checks that it returns to idle after "
        "each phase, answers /health throughout and exits cleanly on SIGTERM. PASS means no request lost, none "
        "invalid, no server error."),
    "aiperf": Benchmark(
        "AIPerf against the server", "specserve.bench.aiperf", "aiperf",
        "NVIDIA's AIPerf load generator (an external client, in its own environment) against `specserve serve` as "
        "started by default, plain (`--drafter none`) and with the default drafters (`auto`): streaming chat "
        "requests at several concurrencies; its latencies and throughput, and the acceptance it reads from our "
        "responses' `metrics.speculative_decoding` beside the `vllm:spec_decode_*` counters of /metrics."),
    "parity": Benchmark(
        "Paper parity", "specserve.bench.parity", "parity",
        "The orderings the drafters' papers report (claim, the paper's figure, ours, whether it holds), measured on "
        "the shipped drafters with `bench/spec_decode.py` runs at a fixed draft budget."),
}

# Explanations of a family of result files, shown in their benchmark's section when one of them is on the page.
NOTES: tuple[tuple[str, str], ...] = (
    ("seeded_acceptance_*",
     "The `seeded_acceptance_*` runs compare the shipped student's acceptance (τ) at temperature 0.7 with the "
     "fixed draft budget in three modes, for a chain (`k_config=chain:4`) and a tree (`3,2,1`): *unseeded* "
     "(sampled drafts, rejection sampling), *keyed_coupled* (a seeded request's drafts sampled with its keyed "
     "draws; the code of commits `a472bbf`–`95a9d0d`) and *keyed_topk* (top-k drafts, what ships for seeded "
     "requests). The two seeded modes of a k_config generate the very same text (plain decoding's with each "
     "prompt's seed), so their difference is the drafts' alone: top-k drafts accept as much or more, and need "
     "no keyed draws in the drafter, so they ship. Seeded and unseeded runs generate different texts, so their "
     "gap carries the texts' difference too (on the same text rejection sampling can only be ahead or level, in "
     "expectation). The deterministic drafters are unaffected: both modes accept their drafts with probability "
     "`p(x)`."),
)

# `specserve bench NAME` -> benchmark
_CLI_NAMES = {b.cli: name for name, b in BENCHMARKS.items()}
# keys that only one bench writes, for files that record neither a "benchmark" key nor a command
_SIGNATURES = (("claims", "parity"), ("phases", "reliability"), ("forward_ms", "forward_cost"),
               ("levels", "serve_throughput"), ("ours_tok_s", "plain_decode"))


@dataclass
class Result:
    path: Path
    data: dict
    benchmark: str

    @property
    def meta(self) -> dict:
        return self.data.get("meta") or {}

    @property
    def date(self) -> str:
        """ISO date or date-time of the run ('' when unrecorded)."""
        m, d = self.meta, self.data
        return str(m.get("datetime") or m.get("date") or d.get("datetime") or d.get("date") or "")

    @property
    def recorded_command(self) -> str | None:
        m, d = self.meta, self.data
        return d.get("command") or m.get("invocation") or m.get("command_line") or m.get("command") \
            or d.get("invocation") or d.get("command_line")

    @property
    def command(self) -> str | None:
        return self.recorded_command or _reconstructed_command(self.benchmark, self.data)

    @property
    def machine(self) -> str:
        return describe_machine(self.meta.get("machine") or self.data.get("machine"))


def _reconstructed_command(benchmark: str, d: dict) -> str | None:
    """The command of a run that recorded its settings but not its command line (older plain_decode and
    serve_throughput files), with those settings as flags."""
    if benchmark == "plain_decode" and {"dataset", "num_prompts", "max_tokens"} <= d.keys():
        return (f"python -m specserve.bench.plain_decode --dataset {d['dataset']} --num-prompts {d['num_prompts']} "
                f"--max-tokens {d['max_tokens']}")
    if benchmark == "serve_throughput" and {"levels", "max_tokens"} <= d.keys():
        levels = " ".join(str(lv["concurrency"]) for lv in d["levels"])
        return f"python -m specserve.bench.serve_throughput --concurrency {levels} --max-tokens {d['max_tokens']}"
    return None


def describe_machine(machine) -> str:
    """One line for the `machine` a bench records: common.machine_info's dict, or an older bench's string."""
    if not machine:
        return "not recorded"
    if isinstance(machine, str):
        return machine
    parts = [machine.get("platform") or machine.get("machine") or "?"]
    cpu = " ".join(filter(None, (machine.get("cpu_model"), machine.get("cpu_isa") and f"[{machine['cpu_isa']}]")))
    if cpu:
        parts.append(cpu)
    if machine.get("cpu_count"):
        parts.append(f"{machine['cpu_count']} CPUs")
    if machine.get("torch_threads"):
        parts.append(f"{machine['torch_threads']} torch threads")
    if machine.get("python"):
        parts.append(f"Python {machine['python']}")
    device = machine.get("device_name") or machine.get("device")
    if device:
        parts.append(f"device {device}")
    return ", ".join(parts)


def benchmark_of(data: dict) -> str | None:
    """The benchmark a result JSON belongs to (see the module's docstring), or None."""
    name = data.get("benchmark")
    if name:
        return name
    meta = data.get("meta") or {}
    for key in ("command", "invocation", "command_line"):
        command = data.get(key) or meta.get(key)
        if not isinstance(command, str):
            continue
        m = re.search(r"specserve\.bench\.(\w+)", command)
        if m and m.group(1) in BENCHMARKS:
            return m.group(1)
        m = re.search(r"specserve bench (\w+)", command)
        if m and m.group(1) in _CLI_NAMES:
            return _CLI_NAMES[m.group(1)]
    for key, name in _SIGNATURES:
        if key in data:
            return name
    return None


def load_results(results_dir: Path | str) -> tuple[list[Result], list[str]]:
    """Every *.json in `results_dir` that belongs to a known benchmark, and a warning for each one that does not."""
    results, warnings = [], []
    for path in sorted(Path(results_dir).glob("*.json")):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            warnings.append(f"{path.name}: not readable JSON ({exc})")
            continue
        name = benchmark_of(data) if isinstance(data, dict) else None
        if name not in BENCHMARKS:
            warnings.append(f"{path.name}: no known benchmark ({name or 'none recorded or inferred'}); left out")
            continue
        results.append(Result(path, data, name))
    return results, warnings


def _demote(markdown: str, levels: int) -> str:
    """`markdown` with every heading `levels` deeper (a renderer's `## Title` under the page's own headings)."""
    return re.sub(r"^(#+) ", lambda m: "#" * min(6, len(m.group(1)) + levels) + " ", markdown, flags=re.M)


def _anchor(text: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def render_page(results_dir: Path | str = DEFAULT_RESULTS, out: Path | str = DEFAULT_OUT) -> tuple[str, list[str]]:
    """The page for the JSON files in `results_dir`, with links relative to `out`, and the warnings."""
    results_dir, out = Path(results_dir), Path(out)
    results, warnings = load_results(results_dir)
    link_dir = Path(os.path.relpath(results_dir.resolve(), out.resolve().parent)).as_posix()
    by_bench: dict[str, list[Result]] = {}
    for r in results:
        by_bench.setdefault(r.benchmark, []).append(r)
    lines = [
        "<!-- Generated by `specserve bench report` (bench/report.py) from bench/results/*.json: "
        "do not edit by hand, rerun it. -->",
        "# Results",
        "",
        f"Generated by `specserve bench report` from the result files in `{results_dir.as_posix()}/`: one section "
        "per benchmark, one table per result file (newest first), each with the command that produced it, the "
        "machine and the date. A benchmark writes its JSON there (`specserve bench NAME --out ...`); rerun "
        "`specserve bench report` to regenerate this page. Superseded runs are in git history; the dated "
        "measurement logs of 2026-11-23 to 25 are in "
        "[journal/2026-11-23-to-25-measurements.md](journal/2026-11-23-to-25-measurements.md).",
        "",
    ]
    if not results:
        lines += ["No result files.", ""]
    toc = []
    for name, bench in BENCHMARKS.items():
        if name in by_bench:
            heading = f"{bench.title} (`specserve bench {bench.cli}`)"
            files = ", ".join(f"`{r.path.name}`" for r in by_bench[name])
            toc.append(f"* [{bench.title}](#{_anchor(heading)}): {files}")
    if len(toc) > 1:
        lines += toc + [""]
    for name, bench in BENCHMARKS.items():
        group = sorted(by_bench.get(name, ()), key=lambda r: (r.date, r.path.name), reverse=True)
        if not group:
            continue
        lines += [f"## {bench.title} (`specserve bench {bench.cli}`)", "", bench.about, ""]
        for pattern, note in NOTES:
            if any(fnmatch.fnmatch(r.path.name, pattern) for r in group):
                lines += [note, ""]
        renderer = importlib.import_module(bench.module).markdown
        for r in group:
            date = r.date or "date not recorded"
            lines += [f"### `{r.path.name}` ({date[:10] or date})", ""]
            command = r.command
            lines += ["```bash", command, "```", ""] if command else ["Command: not recorded.", ""]
            if command and not r.recorded_command:
                lines += ["(The file records the run's settings but not its command line: the command above is "
                          "rebuilt from them.)", ""]
            lines += [f"* **Machine:** {r.machine}", f"* **Date:** {date}",
                      f"* **File:** [`{r.path.name}`]({link_dir}/{r.path.name})", ""]
            png = r.path.with_suffix(".png")
            if png.is_file():
                lines += [f"![{r.path.stem}]({link_dir}/{png.name})", ""]
            try:
                table = renderer(r.data)
            except (KeyError, TypeError, ValueError, IndexError, ZeroDivisionError) as exc:
                warnings.append(f"{r.path.name}: its renderer failed ({type(exc).__name__}: {exc})")
                table = f"The table could not be rendered from this file ({type(exc).__name__}: {exc}).\n"
            lines += [_demote(table, 2).rstrip("\n"), ""]
    return "\n".join(lines).rstrip("\n") + "\n", warnings


def write_report(results_dir: Path | str = DEFAULT_RESULTS, out: Path | str = DEFAULT_OUT) -> tuple[bool, list[str]]:
    """Write the page to `out`; returns (whether it changed, warnings)."""
    page, warnings = render_page(results_dir, out)
    out = Path(out)
    old = out.read_text(encoding="utf-8") if out.is_file() else None
    if old != page:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(page, encoding="utf-8")
    return old != page, warnings


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="specserve bench report", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default=str(DEFAULT_RESULTS), metavar="DIR",
                    help="folder of the result JSON files (default: %(default)s)")
    ap.add_argument("--out", default=str(DEFAULT_OUT), metavar="PATH",
                    help="the page to write (default: %(default)s)")
    ap.add_argument("--check", action="store_true",
                    help="write nothing; exit 1 when the page differs from what would be generated")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not Path(args.results).is_dir():
        print(f"specserve bench report: {args.results} is not a folder", file=sys.stderr)
        return 2
    if args.check:
        page, warnings = render_page(args.results, args.out)
        out = Path(args.out)
        stale = not out.is_file() or out.read_text(encoding="utf-8") != page
    else:
        stale, warnings = write_report(args.results, args.out)
    for w in warnings:
        print(f"specserve bench report: warning: {w}", file=sys.stderr)
    if args.check:
        print(f"{args.out} is {'out of date: run specserve bench report' if stale else 'up to date'}", file=sys.stderr)
        return 1 if stale else 0
    print(f"{'wrote' if stale else 'unchanged:'} {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
