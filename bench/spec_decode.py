"""Speculative decoding benchmark: every selected drafter against our own plain decoding and against
transformers `generate` (plain and prompt lookup), per dataset and temperature.

    python -m specserve.bench.spec_decode [--drafters ngram mag draft_model] [--datasets mt_bench humaneval gsm8k]
        [--num-prompts 10] [--max-tokens 128] [--temperature 0 0.7] [--batch-size 1] [--draft-budget goodput adaptive]
        [--out bench/results/spec_decode]
    (or: specserve bench spec ...)

One model load, one engine with every drafter loaded; each request names its drafter ("none" = plain
decoding). With several `--draft-budget` policies, one engine per policy from the same load (each
its own KV cache, drafter state and budget), every drafter once per policy ("eagle@goodput",
"eagle@adaptive"), and plain decoding once, so policies are compared against one anchor, batch by
batch, in one run. For each dataset x temperature the prompts run in batches of --batch-size requests, and
each batch runs once per method before the next batch starts, in an order that reverses from one
batch to the next (plain first, then last, ...: `method_order`), so a slow drift of the machine's
speed hits every method alike instead of favouring the methods run nearest to plain. With
`--pairing lockstep` each drafted method's batch runs beside plain decoding of the same batch on a
twin engine (built as the first policy's), one engine step of each in turn (`run_lockstep`), and
its speedup is that pair's: a shared machine's speed moves by several per cent within seconds,
which the pair sees alike (an A/A pair, plain beside plain, reads 0.99-1.00). With
`--anchor-every K` plain decoding runs again after every K drafted methods of a batch (and at both
ends), and each method's batch is compared with plain decoding at the same moment: linear in time
between the plain runs just before and after it (`anchored`), so a drift that is not linear over
a batch of many methods (a slow stretch of a shared machine) is not read as a drafter's loss. Every method
generates exactly --max-tokens tokens per prompt (EOS ignored; transformers gets `min_new_tokens`);
sampling is seeded per prompt (keyed draws; `--unseeded`: no seeds, rejection-sampling
verification). Time is wall-clock from adding a batch to its last token, prefill included. With `--admission continuous` a dataset's prompts are one batch: all submitted at once, the
engine keeping --batch-size of them in flight (a finished request's slot goes to the next prompt, as
in a server under load), and methods alternate per dataset. The transformers baselines run one prompt
at a time (its assisted generation supports batch 1 only).

Measures (DESIGN.md §8), per drafter x dataset x temperature:
  tok/s, speedup = tok/s / our plain tok/s (same run, same prompts; with --anchor-every, plain's at
  the same moment), and against HF `generate`;
  τ = generated tokens / target forwards that produced them (bonus included; plain = 1);
  accepted drafts per draft step (bonus excluded); α = accepted / drafted tokens;
  accepted by depth d = fraction of draft steps accepting ≥ d tokens; drafter fallbacks;
  SWI, Cascade Speculative Drafting's standardized walltime improvement = n / (target forwards +
  Σ_i runs of drafter network i × c_i), n = the generated tokens τ counts, runs counted once per
  sequence served and c_i = that network's parameters / the target's (the drafter's `model_runs`;
  ngram and mag run none: SWI = τ); plain decoding = 1, the HF baselines none.
At temperature 0 each drafter's output must equal plain decoding token for token: in float32 a
difference is a losslessness bug, printed loudly and the exit status is 1.

Writes PREFIX.json (all numbers and the setup), PREFIX.md (the table) and PREFIX.png (speedup and τ).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from datetime import datetime
from pathlib import Path

from specserve.bench.datasets import add_dataset_args   # light: no torch

PLAIN = "none"
DEFAULT_DRAFTERS = ("ngram", "mag", "draft_model")
DEFAULT_DATASETS = ("mt_bench", "humaneval", "gsm8k")
# used for a drafter unless --drafter-option sets that key; a truncated target of 4 layers drafts cheaply
DEFAULT_DRAFTER_OPTIONS = {"draft_model": {"draft_layers": 4}}
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "spec_decode"
DRAFT_BUDGETS = ("goodput", "adaptive", "fixed")   # engine.config's (this module loads without torch)
QUANTIZATIONS = ("auto", "none", "int8", "int4", "gguf")   # engine.quant's
HF_PROMPT_LOOKUP_TOKENS = 10
WARMUP_TOKENS = 8


# ---- arguments --------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default",
                    help="target model, as `specserve serve --model` (default: %(default)s)")
    ap.add_argument("--drafters", nargs="+", default=None, metavar="NAME",
                    help=f"drafters to compare (default: {' '.join(DEFAULT_DRAFTERS)}, those registered)")
    ap.add_argument("--drafter-option", action="append", default=[], metavar="DRAFTER.OPTION=VALUE",
                    help="a drafter's option, e.g. draft_model.draft_layers=4 or draft_model.k_config=4,2,2,1 "
                         f"(repeatable; default: {DEFAULT_DRAFTER_OPTIONS})")
    ap.add_argument("--datasets", nargs="+", default=list(DEFAULT_DATASETS), metavar="NAME_OR_PATH",
                    help="our benchmark names, local JSONL/JSON/CSV/Parquet files, or Hugging Face dataset ids in "
                         "the offline cache (bench/datasets.py; default: %(default)s)")
    add_dataset_args(ap)
    ap.add_argument("--num-prompts", type=int, default=10, metavar="N",
                    help="prompts per dataset (default: %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=128, metavar="N",
                    help="tokens generated per prompt by every method (default: %(default)s)")
    ap.add_argument("--temperature", type=float, nargs="+", default=[0.0, 0.7], metavar="T",
                    help="temperatures; 0 = greedy, checked token for token (default: 0 0.7)")
    ap.add_argument("--batch-size", type=int, default=1, metavar="B",
                    help="requests decoded together; 1 = one at a time (default: %(default)s)")
    ap.add_argument("--admission", default="closed", choices=("closed", "continuous"),
                    help="closed: prompts run in batches of --batch-size, each batch finishing before the next "
                         "starts; continuous: all of a dataset's prompts are submitted at once and the engine "
                         "keeps --batch-size in flight, a finished request's slot going to the next prompt, "
                         "as a server under load (default: %(default)s)")
    ap.add_argument("--anchor-every", type=int, default=0, metavar="K",
                    help="run plain decoding again after every K drafted methods of a batch (and at both ends) "
                         "and compare each method with plain decoding at the same moment, interpolated in time "
                         "between those runs; 0: plain once per batch (default: %(default)s)")
    ap.add_argument("--pairing", default="anchored", choices=("anchored", "lockstep"),
                    help="anchored: each method's batch runs alone, compared with plain decoding's runs of it "
                         "(--anchor-every); lockstep: each drafted method's batch runs in lockstep with plain "
                         "decoding of the same batch on a twin engine (one step of each in turn), and its speedup "
                         "is that pair's, the machine's drift hitting both alike (default: %(default)s)")
    ap.add_argument("--repeats", type=int, default=1, metavar="R",
                    help="run each batch's methods R times over (order reversed every other time); a cell's "
                         "speedup is then the median of its R repeats' speedups, each anchored as above "
                         "(default: %(default)s)")
    ap.add_argument("--num-speculative-tokens", type=int, default=8, metavar="N",
                    help="most draft-tree nodes per sequence per step (default: %(default)s)")
    ap.add_argument("--max-draft-tokens-per-step", type=int, default=64, metavar="N",
                    help="draft nodes of the whole batch per step (default: %(default)s)")
    ap.add_argument("--draft-budget", nargs="+", default=["goodput"], choices=DRAFT_BUDGETS, metavar="POLICY",
                    help="how draft budgets are chosen, as `specserve serve --draft-budget` (goodput, adaptive, "
                         "fixed); several run side by side in one invocation: one engine per policy from the "
                         "same model load, every drafter once per policy (methods 'eagle@adaptive', ...), "
                         "interleaved batch by batch with the one plain decoding (default: goodput)")
    ap.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto (default: %(default)s)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                    help="float32 makes the greedy check exact (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--quantization", default="none", choices=QUANTIZATIONS,
                    help="the target's weight-only quantization on the CPU (engine/quant.py; default: %(default)s)")
    ap.add_argument("--compile", action="store_true",
                    help="the target's forward compiled with torch.compile on the CPU (engine/compiled.py)")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed of prompt i is seed + i (default: %(default)s)")
    ap.add_argument("--unseeded", action="store_true",
                    help="sampled requests carry no seed (rejection-sampling verification; by default each is "
                         "seeded, so its draws are keyed and its text is plain decoding's whatever the drafter)")
    ap.add_argument("--no-hf", dest="hf", action="store_false", help="skip the transformers baselines")
    ap.add_argument("--out", default=str(DEFAULT_OUT), metavar="PREFIX",
                    help="writes PREFIX.json, PREFIX.md and PREFIX.png (default: bench/results/spec_decode)")
    return ap


class Method:
    """One column of a run: a drafter (or plain decoding) served by the engine of one budget policy.
    `label` names its rows: the drafter, or "drafter@policy" when several policies run."""

    def __init__(self, label: str, drafter: str, policy: str | None, engine):
        self.label, self.drafter, self.policy, self.engine = label, drafter, policy, engine


def plan_methods(drafters: list[str], engines: dict) -> list[Method]:
    """Plain decoding (on the first policy's engine: plain steps draft nothing, whatever the
    policy), then each drafter under each policy in `engines` ({policy: engine}, in order)."""
    policies = list(engines)
    first = policies[0]
    methods = [Method(PLAIN, PLAIN, None, engines[first])]
    for d in drafters:
        for p in policies:
            methods.append(Method(d if len(policies) == 1 else f"{d}@{p}", d, p, engines[p]))
    return methods


def select_drafters(requested: list[str] | None, available: list[str]) -> tuple[list[str], list[str]]:
    """(drafters to run, defaults skipped because they are not registered). Unknown names asked
    for explicitly are an error; "none" is dropped (plain decoding always runs)."""
    if requested is None:
        return [d for d in DEFAULT_DRAFTERS if d in available], [d for d in DEFAULT_DRAFTERS if d not in available]
    unknown = [d for d in requested if d not in available and d != PLAIN]
    if unknown:
        raise SystemExit(f"spec_decode: unknown drafter(s) {', '.join(unknown)}; registered: {', '.join(available)}")
    return list(dict.fromkeys(d for d in requested if d != PLAIN)), []


# ---- running ----------------------------------------------------------------------------------


class Tally:
    """One method's totals over a dataset x temperature cell."""

    def __init__(self):
        self.num_tokens = 0
        self.seconds = 0.0
        self.outputs: list[list[int]] = []
        self.num_target_forwards = 0
        self.num_spec_tokens = 0     # generated tokens of requests that report speculation figures
        self.batches: list[tuple[int, float]] = []   # (tokens, seconds) of each batch, in the order run
        # (batch, middle time, tokens/s, seconds, repeat) of each run
        self.runs: list[tuple[int, float, float, float, int]] = []
        self.error: str | None = None

    def add(self, num_tokens: int, seconds: float, outputs: list[list[int]], specs=(), batch: int | None = None,
            at: float | None = None, repeat: int = 0) -> None:
        """A run of a batch: `batch` its index in the cell and `at` the time of its middle (both
        default to the order of the calls), `repeat` which pass over the cell's batches it belongs
        to (--repeats). A batch run again (plain decoding's anchors, a repeat) adds its time and
        tokens to the totals; its outputs and speculation figures are kept from the first run."""
        batch = len(self.batches) if batch is None else batch
        at = float(len(self.runs)) if at is None else at
        if seconds > 0:
            self.runs.append((batch, at, num_tokens / seconds, seconds, repeat))
        self.num_tokens += num_tokens
        self.seconds += seconds
        if batch < len(self.batches):
            n, s = self.batches[batch]
            self.batches[batch] = (n + num_tokens, s + seconds)
            return
        self.batches.append((num_tokens, seconds))
        self.outputs.extend(outputs)
        for spec in specs:
            if spec is not None:
                self.num_target_forwards += spec.num_target_forwards
                self.num_spec_tokens += spec.num_generated_tokens

    @property
    def tok_s(self) -> float | None:
        return self.num_tokens / self.seconds if self.seconds > 0 and self.error is None else None


def anchored(plain: Tally, batch: int, at: float) -> float | None:
    """Plain decoding's tokens/s on `batch` at time `at`: linear in time between its runs of that
    batch just before and just after `at`, the nearest one's beyond them (one run: its figure)."""
    runs = sorted((t, r) for b, t, r, _, _ in plain.runs if b == batch)
    if not runs:
        return None
    if at <= runs[0][0]:
        return runs[0][1]
    for (t0, r0), (t1, r1) in zip(runs, runs[1:]):
        if at <= t1:
            return r0 + (r1 - r0) * (at - t0) / (t1 - t0) if t1 > t0 else r1
    return runs[-1][1]


def batch_speedups(tally: Tally, plain: Tally) -> list[float] | None:
    """The method's tokens/s over plain decoding's at the same moment (`anchored`), batch by batch
    (the same prompts, run within seconds of each other): their spread says how much of a cell's
    speedup the machine's drift can account for. None when a tally failed or batches differ."""
    if tally.error is not None or plain.error is not None or len(tally.batches) != len(plain.batches):
        return None
    out = []
    for batch, at, rate, _, _ in tally.runs:
        anchor = anchored(plain, batch, at)
        if anchor:
            out.append(rate / anchor)
    return out


def cell_speedup(tally: Tally, plain: Tally) -> float | None:
    """The cell's speedup: per repeat, the seconds plain decoding would have taken for the method's
    batches at the moments they ran (`anchored`) over the seconds they took, i.e. its batch
    speedups averaged weighted by the method's time per batch (so it lies between their extremes);
    then the median over repeats (one repeat: its figure). With one plain run per batch this is the
    ratio of the two tallies' tokens/s."""
    per_run = batch_speedups(tally, plain)
    if not per_run or len(per_run) != len(tally.runs):
        return None
    repeats: dict[int, list[float]] = {}
    for (_, _, _, seconds, repeat), x in zip(tally.runs, per_run):
        sums = repeats.setdefault(repeat, [0.0, 0.0])
        sums[0] += seconds * x
        sums[1] += seconds
    return statistics.median(x / s for x, s in repeats.values() if s > 0)


def anchored_order(order: list[str], every: int, plain: str) -> list[str]:
    """`order` (one batch's methods, plain among them) with plain decoding first, after every
    `every` drafted methods, and last; `every` 0: `order` as it is."""
    if every <= 0:
        return list(order)
    drafted = [m for m in order if m != plain]
    out = [plain]
    for i in range(0, len(drafted), every):
        out += drafted[i:i + every] + [plain]
    return out


def method_order(methods: list[str], batch_no: int) -> list[str]:
    """The order in which the `batch_no`-th batch (counted over the whole run) runs the methods:
    as given for even batches, reversed for odd ones. Over two batches every method's mean position
    is the middle, so a speed drift that is linear over them cancels in each ratio to plain (run
    first, its anchors would meet it before every drafter)."""
    return list(methods) if batch_no % 2 == 0 else list(reversed(methods))


def run_engine_batch(engine, prompts: list[list[int]], params: list, drafter: str, tag: str):
    """Decode `prompts` together with `drafter`; (tokens, seconds, outputs, spec figures) in prompt order."""
    return run_lockstep([(engine, prompts, params, drafter, tag)])[0]


def run_lockstep(runs: list[tuple]) -> list[tuple]:
    """Each run `(engine, prompts, params, drafter, tag)` on its own engine, one `step` of each
    engine in turn until all are done, so that the runs see the machine at the same moments;
    per run `run_engine_batch`'s (tokens, seconds, outputs, spec figures), its seconds those of its
    own engine's calls (adding its requests, its steps and reading their outputs). One run: its
    wall-clock time from adding its batch to its last token."""
    if len({id(r[0]) for r in runs}) != len(runs):
        raise ValueError("runs in lockstep need an engine each")
    tokens: list[dict[str, list[int]]] = []
    specs: list[dict[str, object]] = [{} for _ in runs]
    seconds = [0.0] * len(runs)
    for j, (engine, prompts, params, drafter, tag) in enumerate(runs):
        ids = [f"{tag}-{i}" for i in range(len(prompts))]
        tokens.append({rid: [] for rid in ids})
        t0 = time.perf_counter()
        for rid, prompt, p in zip(ids, prompts, params):
            engine.add_request(rid, prompt, p, drafter=drafter)
        seconds[j] += time.perf_counter() - t0
    live = list(range(len(runs)))
    while live:
        for j in list(live):
            engine = runs[j][0]
            t0 = time.perf_counter()
            for out in engine.step():
                for d in out.outputs:
                    tokens[j][out.request_id].extend(d.token_ids)
                if out.finished:
                    specs[j][out.request_id] = out.spec
            if not engine.has_unfinished_requests():
                live.remove(j)
            seconds[j] += time.perf_counter() - t0
    results = []
    for j in range(len(runs)):
        outs = list(tokens[j].values())
        results.append((sum(map(len, outs)), seconds[j], outs, [specs[j].get(rid) for rid in tokens[j]]))
    return results


def stats_snapshot(engine, name: str) -> dict:
    st = engine.drafter_stats[name]
    out = {}
    for k, v in vars(st).items():
        if isinstance(v, list):
            v = list(v)
        elif isinstance(v, dict):   # per-part figures of composite drafters: {part: (drafted, accepted)}
            v = {part: (p.num_draft_tokens, p.num_accepted_tokens) for part, p in v.items()}
        out[k] = v
    return out


def runs_snapshot(engine, name: str) -> dict[str, tuple[int, float]]:
    """The drafter's cumulative `{network: (runs, cost ratio)}` (Drafter.model_runs)."""
    return dict(engine.drafters[name].model_runs())


def runs_delta(before: dict, after: dict) -> dict[str, dict]:
    """Per drafter network, its runs in a cell and its cost ratio: {net: {"runs": n, "cost": c}}."""
    return {net: {"runs": runs - before.get(net, (0, c))[0], "cost": c} for net, (runs, c) in after.items()}


def swi(num_tokens: int, num_target_forwards: int, model_runs: dict[str, dict]) -> float | None:
    """Standardized walltime improvement: tokens / (target forwards + Σ runs-in-the-cell × c)."""
    cost = num_target_forwards + sum(m["runs"] * m["cost"] for m in model_runs.values())
    return num_tokens / cost if cost else None


def stats_delta(before: dict, after: dict) -> dict:
    delta = {}
    for k, v in after.items():
        if isinstance(v, list):
            old = before[k] + [0] * (len(v) - len(before[k]))
            delta[k] = [a - b for a, b in zip(v, old)]
        elif isinstance(v, dict):
            delta[k] = {part: tuple(a - b for a, b in zip(x, before[k].get(part, (0,) * len(x))))
                        for part, x in v.items()}
        else:
            delta[k] = v - before[k]
    return delta


def first_difference(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def find_mismatches(dataset: str, drafter: str, plain: list[list[int]], outputs: list[list[int]]) -> list[dict]:
    """Greedy outputs of `drafter` that differ from plain decoding's, each with where they part."""
    found = []
    for i, (a, b) in enumerate(zip(plain, outputs)):
        if a != b:
            k = first_difference(a, b)
            found.append({"dataset": dataset, "drafter": drafter, "prompt_index": i, "first_difference_at": k,
                          "plain": a[k:k + 8], "drafter_output": b[k:k + 8]})
    return found


def mismatch_alarm(mismatches: list[dict], dtype: str) -> str:
    what = ("LOSSLESSNESS BUG" if dtype == "float32"
            else f"greedy mismatch (in {dtype} outputs may diverge; check in float32)")
    bar = "!" * 100
    lines = [bar, f"!!! {what}: {len(mismatches)} greedy output(s) differ from plain decoding"]
    lines += [f"!!!   {m['drafter']} on {m['dataset']} prompt {m['prompt_index']}: first difference at token "
              f"{m['first_difference_at']}: plain {m['plain']} vs {m['drafter_output']}" for m in mismatches]
    return "\n".join([*lines, bar])


def drafter_row(tally: Tally, delta: dict) -> dict:
    steps, drafted, accepted = delta["num_steps"], delta["num_draft_tokens"], delta["num_accepted_tokens"]
    return {
        "tau": tally.num_spec_tokens / tally.num_target_forwards if tally.num_target_forwards else None,
        "num_target_forwards": tally.num_target_forwards,
        "num_draft_steps": steps,
        "num_draft_tokens": drafted,
        "num_accepted_tokens": accepted,
        "accepted_per_step": accepted / steps if steps else None,
        "emitted_per_draft_step": delta["num_emitted_tokens"] / steps if steps else None,
        "alpha": accepted / drafted if drafted else None,
        "accepted_by_depth": [n / steps for n in delta["accepted_by_depth"]] if steps else [],
        "accepted_length_counts": delta["accepted_length_counts"],
        "num_fallbacks": delta["num_fallbacks"],
        "draft_time_s": delta["draft_time_s"],
        "verify_time_s": delta["verify_time_s"],
        "budget_counts": delta.get("budget_counts", []),   # index b: decoding steps given b draft nodes
        # composite drafters: per part, draft nodes proposed and draft tokens accepted
        "parts": {part: {"draft_tokens": d, "accepted_tokens": a} for part, (d, a) in delta.get("parts", {}).items()},
    }


ROW_FIELDS = ("dataset", "temperature", "method", "kind", "num_prompts", "num_tokens", "seconds", "tok_s",
              "speedup", "speedup_by_batch", "speedup_vs_hf", "tau", "swi", "model_runs", "num_target_forwards",
              "num_draft_steps", "num_draft_tokens", "num_accepted_tokens", "accepted_per_step",
              "emitted_per_draft_step", "alpha", "accepted_by_depth", "accepted_length_counts", "num_fallbacks",
              "draft_time_s", "verify_time_s", "budget_counts", "parts", "greedy_mismatches", "identical_to_plain",
              "draft_budget", "error")


def make_row(**values) -> dict:
    row = dict.fromkeys(ROW_FIELDS)
    row.update(values)
    return row


def run(args: argparse.Namespace, argv: list[str]) -> int:
    import torch
    import transformers

    from specserve.bench.common import build_hf_model, chat_ids, machine_info, run_hf
    from specserve.bench.datasets import dataset_label, load_prompts
    from specserve.drafters.base import available_drafters, parse_drafter_options
    from specserve.engine.config import EngineConfig
    from specserve.engine.core import LLMEngine
    from specserve.engine.loader import load_model
    from specserve.engine.sampling_params import SamplingParams

    if args.threads:
        torch.set_num_threads(args.threads)
    drafters, skipped = select_drafters(args.drafters, available_drafters())
    for name in skipped:
        print(f"spec_decode: drafter {name!r} is not registered in this version; skipped", file=sys.stderr)
    options = {name: dict(opts) for name, opts in DEFAULT_DRAFTER_OPTIONS.items() if name in drafters}
    for name, opts in parse_drafter_options(args.drafter_option).items():
        if name not in drafters:
            print(f"spec_decode: options for {name!r} ignored: it is not among the drafters run", file=sys.stderr)
        options.setdefault(name, {}).update(opts)
    options = {name: opts for name, opts in options.items() if name in drafters}
    policies = list(dict.fromkeys(args.draft_budget))

    t_load = time.perf_counter()
    loaded = load_model(args.model)
    prompts = {}
    for ds in args.datasets:
        prompts[dataset_label(ds)] = [chat_ids(loaded.tokenizer, t) for t in load_prompts(
            ds, args.num_prompts, prompt_field=args.prompt_field, messages_field=args.messages_field)]
    longest = max(len(p) for ps in prompts.values() for p in ps)
    needed = longest + args.max_tokens + args.num_speculative_tokens + 1
    max_model_len = min(-(-needed // 256) * 256, getattr(loaded.hf_config, "max_position_embeddings", needed))
    engines = {}
    for policy in policies:   # each policy its own engine (its own KV cache, drafter state and budget)
        config = EngineConfig(model=args.model, dtype=args.dtype, device=args.device, max_num_seqs=args.batch_size,
                              max_model_len=max_model_len, seed=args.seed, drafters=(PLAIN, *drafters),
                              drafter_options=options, num_speculative_tokens=args.num_speculative_tokens,
                              max_draft_tokens_per_step=args.max_draft_tokens_per_step,
                              draft_budget=policy, quantization=args.quantization, compile=args.compile)
        engine = LLMEngine(config, loaded=loaded)
        engines[engine.config.draft_budget] = engine
    engine = next(iter(engines.values()))
    # lockstep: plain decoding on an engine of its own, built as the first policy's (`run_lockstep`)
    twin = LLMEngine(engine.config, loaded=loaded) if args.pairing == "lockstep" else None
    methods = plan_methods(drafters, engines)
    drafted = [m for m in methods if m.drafter != PLAIN]
    hf = build_hf_model(loaded, engine.device, engine.dtype) if args.hf else None
    pad_id = loaded.eos_token_ids[0] if loaded.eos_token_ids else 0
    load_s = time.perf_counter() - t_load
    print(f"spec_decode: {loaded.name} on {engine.device}/{args.dtype}, methods {', '.join(m.label for m in methods)}"
          f"{' + HF generate/prompt lookup' if hf is not None else ''}, loaded in {load_s:.1f} s", file=sys.stderr)

    def params_for(temperature: float, seeds: list[int], max_tokens: int) -> list:
        return [SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True,
                               seed=s if temperature > 0 and not args.unseeded else None) for s in seeds]

    # warm-up: every method on the first batch, short, at every temperature
    first = next(iter(prompts.values()))[:args.batch_size]
    notes = []
    hf_pl_sampling = True
    for t in args.temperature:
        for m in methods:
            run_engine_batch(m.engine, first, params_for(t, list(range(len(first))), WARMUP_TOKENS), m.drafter,
                             f"warm-{m.label}-{t}")
        if twin is not None:
            run_engine_batch(twin, first, params_for(t, list(range(len(first))), WARMUP_TOKENS), PLAIN,
                             f"warm-twin-{t}")
        if hf is not None:
            run_hf(hf, first[:1], WARMUP_TOKENS, temperature=t, seeds=[0], pad_token_id=pad_id)
            try:
                run_hf(hf, first[:1], WARMUP_TOKENS, temperature=t, seeds=[0], pad_token_id=pad_id,
                       prompt_lookup_num_tokens=HF_PROMPT_LOOKUP_TOKENS)
            except Exception as exc:   # an older transformers may refuse prompt lookup with sampling
                if t == 0:
                    raise
                hf_pl_sampling = False
                notes.append(f"transformers prompt lookup with sampling failed ({type(exc).__name__}: {exc}); "
                             "measured greedy only")
    if hf is not None:
        notes.append("transformers baselines run one prompt at a time (assisted generation supports batch 1 only)")
        if hf_pl_sampling and any(t > 0 for t in args.temperature):
            notes.append("transformers prompt lookup at T>0 samples from the target and keeps matching candidates")

    rows, mismatches = [], []
    exact = args.dtype == "float32"
    batch_no = 0
    for ds, ps in prompts.items():
        for t in args.temperature:
            greedy = t == 0
            tallies = {m.label: Tally() for m in methods}
            hf_tallies = {"hf_generate": Tally(), "hf_prompt_lookup": Tally()} if hf is not None else {}
            before = {m.label: stats_snapshot(m.engine, m.drafter) for m in drafted}
            runs_before = {m.label: runs_snapshot(m.engine, m.drafter) for m in drafted}
            group = len(ps) if args.admission == "continuous" else args.batch_size
            for start in range(0, len(ps), group):
                chunk = ps[start:start + group]
                seeds = [args.seed + start + i for i in range(len(chunk))]
                for rep in range(args.repeats):
                    if twin is not None:   # each drafted method beside plain decoding, step by step
                        for k, m in enumerate(method_order(drafted, batch_no)):
                            tag = f"{ds}-{t}-{m.label}-{start}-{rep}-{k}"
                            t0 = time.perf_counter()
                            pair = run_lockstep([(twin, chunk, params_for(t, seeds, args.max_tokens), PLAIN,
                                                  f"{tag}-plain"),
                                                 (m.engine, chunk, params_for(t, seeds, args.max_tokens),
                                                  m.drafter, tag)])
                            at = (t0 + time.perf_counter()) / 2   # shared: `anchored` reads the pair's plain run
                            for label, run in zip((PLAIN, m.label), pair):
                                tallies[label].add(*run, batch=start // group, at=at, repeat=rep)
                    else:
                        order = anchored_order(method_order(methods, batch_no), args.anchor_every, methods[0])
                        for k, m in enumerate(order):
                            t0 = time.perf_counter()
                            n, secs, outs, specs = run_engine_batch(
                                m.engine, chunk, params_for(t, seeds, args.max_tokens), m.drafter,
                                f"{ds}-{t}-{m.label}-{start}-{rep}-{k}")
                            tallies[m.label].add(n, secs, outs, specs, batch=start // group,
                                                 at=t0 + secs / 2, repeat=rep)
                    batch_no += 1
                if hf is not None:
                    hf_tallies["hf_generate"].add(*run_hf(hf, chunk, args.max_tokens, temperature=t, seeds=seeds,
                                                          pad_token_id=pad_id))
                    if greedy or hf_pl_sampling:
                        hf_tallies["hf_prompt_lookup"].add(*run_hf(
                            hf, chunk, args.max_tokens, temperature=t, seeds=seeds, pad_token_id=pad_id,
                            prompt_lookup_num_tokens=HF_PROMPT_LOOKUP_TOKENS))
                    else:
                        hf_tallies["hf_prompt_lookup"].error = "sampling unsupported by this transformers"
            plain = tallies[PLAIN]
            hf_tok_s = hf_tallies["hf_generate"].tok_s if hf_tallies else None

            def ratio(x, y):
                return x / y if x is not None and y else None

            base = dict(dataset=ds, temperature=t, num_prompts=len(ps))
            rows.append(make_row(**base, method=PLAIN, kind="ours_plain", num_tokens=plain.num_tokens,
                                 seconds=plain.seconds, tok_s=plain.tok_s, speedup=1.0,
                                 speedup_vs_hf=ratio(plain.tok_s, hf_tok_s), tau=1.0, swi=1.0))
            for m in drafted:
                tally = tallies[m.label]
                row = make_row(**base, method=m.label, kind="drafter", num_tokens=tally.num_tokens,
                               seconds=tally.seconds, tok_s=tally.tok_s, speedup=cell_speedup(tally, plain),
                               speedup_by_batch=batch_speedups(tally, plain),
                               speedup_vs_hf=ratio(tally.tok_s, hf_tok_s), draft_budget=m.policy,
                               **drafter_row(tally, stats_delta(before[m.label],
                                                                stats_snapshot(m.engine, m.drafter))))
                row["model_runs"] = runs_delta(runs_before[m.label], runs_snapshot(m.engine, m.drafter))
                row["swi"] = swi(tally.num_spec_tokens, tally.num_target_forwards, row["model_runs"])
                if greedy:
                    bad = find_mismatches(ds, m.label, plain.outputs, tally.outputs)
                    row["greedy_mismatches"] = len(bad)
                    mismatches += bad
                rows.append(row)
            for name, tally in hf_tallies.items():
                row = make_row(**base, method=name, kind=name, num_tokens=tally.num_tokens, seconds=tally.seconds,
                               tok_s=tally.tok_s, speedup=ratio(tally.tok_s, plain.tok_s),
                               speedup_vs_hf=ratio(tally.tok_s, hf_tok_s), error=tally.error)
                if greedy and tally.error is None:
                    row["identical_to_plain"] = sum(a == b for a, b in zip(plain.outputs, tally.outputs))
                rows.append(row)
            summary = ", ".join(
                f"{r['method']} {fmt(r['tok_s'], '.1f')} tok/s"
                + (f" (x{fmt(r['speedup'], '.2f')}, τ {fmt(r['tau'], '.2f')}, SWI {fmt(r['swi'], '.2f')})"
                   if r["kind"] == "drafter" else "")
                for r in rows if r["dataset"] == ds and r["temperature"] == t)
            print(f"[{ds} T={t:g}] {summary}", file=sys.stderr)

    if mismatches:
        alarm = mismatch_alarm(mismatches, args.dtype)
        print(alarm, file=sys.stderr)
        print(alarm)

    now = datetime.now().astimezone()
    result = {
        "benchmark": "spec_decode",
        "meta": {
            "date": now.date().isoformat(), "datetime": now.isoformat(timespec="seconds"),
            "machine": machine_info(engine.device),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "command_line": shlex.join(sys.argv),
            "invocation": shlex.join(["python", "-m", "specserve.bench.spec_decode", *argv]),
            "model": loaded.name, "model_source": loaded.source, "device": str(engine.device), "dtype": args.dtype,
            "quantization": args.quantization, "compiled": args.compile, "datasets": list(prompts), "num_prompts": {ds: len(ps) for ds, ps in prompts.items()},
            "mean_prompt_tokens": {ds: sum(map(len, ps)) / len(ps) for ds, ps in prompts.items()},
            "max_tokens": args.max_tokens, "temperatures": args.temperature, "batch_size": args.batch_size,
            "admission": args.admission, "method_order": "reversed every other batch",
            "pairing": args.pairing, "anchor_every": 0 if twin is not None else args.anchor_every,
            "repeats": args.repeats,
            "hf_batch_size": 1 if hf is not None else None, "seed": args.seed, "drafters": drafters,
            "skipped_drafters": skipped, "drafter_options": options,
            "num_speculative_tokens": args.num_speculative_tokens,
            "draft_budget": engine.config.draft_budget, "draft_budgets": list(engines),
            "max_draft_tokens_per_step": args.max_draft_tokens_per_step, "max_model_len": max_model_len,
            "hf_prompt_lookup_num_tokens": HF_PROMPT_LOOKUP_TOKENS if hf is not None else None,
            "load_seconds": load_s, "notes": notes,
        },
        "results": rows,
        "greedy_mismatches": mismatches,
        "num_greedy_mismatches": len(mismatches),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    json_path, md_path, png_path = (out.with_name(out.name + ext) for ext in (".json", ".md", ".png"))
    json_path.write_text(json.dumps(result, indent=2) + "\n")
    table = markdown(result)
    md_path.write_text(table)
    print(table)
    if write_chart(result, png_path):
        print(f"wrote {json_path}, {md_path}, {png_path}", file=sys.stderr)
    else:
        print(f"wrote {json_path}, {md_path} (no chart: matplotlib is not installed)", file=sys.stderr)
    return 1 if mismatches and exact else 0


# ---- reporting --------------------------------------------------------------------------------


def fmt(value, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def spread(values: list[float] | None) -> str:
    """'0.91–1.07' for per-batch speedups (one value alone as it is; '–' without any)."""
    if not values:
        return "–"
    lo, hi = min(values), max(values)
    return f"{lo:.2f}" if len(values) == 1 else f"{lo:.2f}–{hi:.2f}"


def markdown(result: dict) -> str:
    meta = result["meta"]
    m = meta["machine"]
    lines = [
        f"## Speculative decoding: {meta['model']} ({meta['device']}, {meta['dtype']}"
        f"{', ' + meta['quantization'] + ' weights' if meta.get('quantization', 'none') != 'none' else ''}"
        f"{', compiled forward' if meta.get('compiled') else ''}, batch {meta['batch_size']}"
        f"{', continuous admission' if meta.get('admission') == 'continuous' else ''})",
        "",
        f"{meta['datetime']}; {m['platform']}, {m['cpu_count']} CPUs, {m['torch_threads']} torch threads"
        f"{', ' + m['device_name'] if m.get('device_name') else ''}; torch {meta['torch']}, "
        f"transformers {meta['transformers']}; {meta['max_tokens']} tokens per prompt.",
        "",
        f"`{meta['invocation']}`",
        "",
        "| method | dataset | T | prompts | tok/s | speedup | per batch | vs HF generate | τ | SWI | α "
        "| accepted/step | fallbacks | greedy mismatches |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["results"]:
        method = r["method"] if r["kind"] != "ours_plain" else "plain (none)"
        if r["error"]:
            method += f" ({r['error']})"
        mism = r["greedy_mismatches"]
        mism = "–" if mism is None else (f"**{mism} ✗**" if mism else "0")
        lines.append(f"| {method} | {r['dataset']} | {r['temperature']:g} | {r['num_prompts']} "
                     f"| {fmt(r['tok_s'], '.1f')} "
                     f"| {fmt(r['speedup'], '.2f')} | {spread(r.get('speedup_by_batch'))} "
                     f"| {fmt(r['speedup_vs_hf'], '.2f')} | {fmt(r['tau'], '.2f')} "
                     f"| {fmt(r.get('swi'), '.2f')} | {fmt(r['alpha'], '.2f')} | {fmt(r['accepted_per_step'], '.2f')} "
                     f"| {fmt(r['num_fallbacks'], 'd')} | {mism} |")
    every = meta.get("anchor_every") or 0
    anchor = (f" at the same moment (plain decoding run again after every {every} drafted method(s) of a batch, "
              "interpolated in time between its runs)" if every else " in the same run")
    if meta.get("pairing") == "lockstep":
        anchor = (" on the same batch in lockstep (each run beside plain decoding on a twin engine, one step of "
                  "each in turn)")
    repeats = meta.get("repeats") or 1
    median = f", the median of {repeats} repeats of every batch" if repeats > 1 else ""
    lines += ["", f"speedup: tok/s over our plain decoding{anchor}{median}; per batch: the lowest and highest "
              "speedup of one run of a batch of prompts (each batch runs every method back to back); τ: tokens per "
              "target forward (bonus included); SWI: standardized walltime improvement, tokens / (target "
              "forwards + Σ drafter network runs × its parameters / the target's); α: accepted / drafted tokens; "
              "accepted/step: accepted drafts per draft step."]
    lines += [f"Note: {n}." for n in meta["notes"]]
    if result["num_greedy_mismatches"]:
        lines.append(f"**{result['num_greedy_mismatches']} greedy output(s) differ from plain decoding** "
                     "(see greedy_mismatches in the JSON).")
    return "\n".join(lines) + "\n"


def write_chart(result: dict, path: Path) -> bool:
    """Two panels, speedup and τ: one bar per drafter in each dataset x temperature group."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return False
    rows = [r for r in result["results"] if r["kind"] == "drafter"]
    drafters = list(dict.fromkeys(r["method"] for r in rows))
    groups = list(dict.fromkeys((r["dataset"], r["temperature"]) for r in rows))
    fig = Figure(figsize=(max(8.0, 2.0 + 1.6 * len(groups)), 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 2)
    width = 0.8 / max(1, len(drafters))
    for ax, key, title in ((axes[0], "speedup", "speedup over plain decoding"),
                           (axes[1], "tau", "τ (tokens per target forward)")):
        for j, d in enumerate(drafters):
            values = {(r["dataset"], r["temperature"]): r[key] for r in rows if r["method"] == d}
            xs = [g + (j - (len(drafters) - 1) / 2) * width for g in range(len(groups))]
            ax.bar(xs, [values.get(g) or 0.0 for g in groups], width, label=d)
        ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
        ax.set_xticks(range(len(groups)), [f"{ds}\nT={t:g}" for ds, t in groups])
        ax.set_title(title)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside lower center", ncols=max(1, len(drafters)))
    meta = result["meta"]
    fig.suptitle(f"{meta['model']}, {meta['device']} {meta['dtype']}, batch {meta['batch_size']}, "
                 f"{meta['max_tokens']} tokens, {meta['date']}")
    fig.savefig(path, dpi=120)
    return True


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.batch_size < 1 or args.num_prompts < 1 or args.max_tokens < 1:
        raise SystemExit("spec_decode: --batch-size, --num-prompts and --max-tokens must be positive")
    return run(args, argv)


if __name__ == "__main__":
    sys.exit(main())
