"""Draft-budget policies replayed offline on recorded greedy decoding, batch 1: seconds from this
machine's measured steps, the policies the engine's own code.

    specserve bench replay --drafters ngram mag --datasets mt_bench humaneval gsm8k \\
        --num-prompts 16 --max-tokens 64      (or python -m specserve.bench.budget_replay ...)

For a drafter whose proposal depends only on the tokens so far (ngram, mag: deterministic lookups)
and greedy decoding, the output does not depend on the budget (lossless), so a policy's whole run
follows from two recordings: the output tokens, and what a tree of each budget drafted at each
position would accept (computed by calling the drafter on the recorded prefix). Each drafter's run
is recorded once through the engine at the fixed budget (its outputs, and the wall time of every
decode step by its tokens: the step cost table); then each policy is replayed on it: "fixed" and
"adaptive" and "goodput" the engine's own policies (`engine/draft_policy/`), goodput calibrated on
the cost table, each fed every simulated step as the scheduler feeds it,
the drafter's context of each step included (`Drafter.context_of`), and "goodput-no-contexts" the
same budget not told them. Each policy's state carries from one dataset to the next, as a served
engine's does. A
replay takes seconds where a served run of the same prompts takes minutes and moves with the
machine's noise; the replayed fixed budget must match the recording tree for tree (checked).
Speedups are simulated seconds against the table's one-token step for every token.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace

REPLAYABLE = ("ngram", "mag")
POLICIES = ("fixed", "adaptive", "goodput", "goodput-no-contexts")   # the last: not told the drafter's contexts


def record(engine, drafter: str, prompts: list[list[int]], max_tokens: int) -> tuple[list[dict], dict[int, list[float]]]:
    """Run `prompts` one at a time through `engine` (fixed budget) with `drafter`, greedy. Returns per
    prompt its output and the (nodes, accepted) of each decode step, and step seconds by tokens."""
    from specserve.engine.sampling_params import SamplingParams

    runs, seconds = [], {}
    for i, prompt in enumerate(prompts):
        rid = f"{drafter}-{i}"
        engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                           drafter=drafter)
        spec = engine.requests[rid].spec
        out, steps = [], []
        while engine.has_unfinished_requests():
            decode = bool(out)   # the prompt's steps end with its first token
            d0, a0 = spec.num_draft_tokens, spec.num_accepted_tokens
            t0 = time.perf_counter()
            for o in engine.step():
                for delta in o.outputs:
                    out.extend(delta.token_ids)
            dt = time.perf_counter() - t0
            if decode:
                nodes, acc = spec.num_draft_tokens - d0, spec.num_accepted_tokens - a0
                steps.append((nodes, acc))
                seconds.setdefault(1 + nodes, []).append(dt)
        runs.append({"prompt": prompt, "output": out, "steps": steps})
    return runs, seconds


def _step_cost(costs: dict[int, float]):
    return lambda n: costs[n] if n in costs else costs[max(costs)] * n / max(costs)


def summarise(steps_of: list[list[tuple[int, int]]], costs: dict[int, float]) -> dict:
    """Speedup (simulated seconds against the one-token step for every token), trees and accepted
    tokens of replayed runs (each a list of (draft nodes, accepted tokens) per decode step)."""
    cost = _step_cost(costs)
    steps = [s for run in steps_of for s in run]
    tokens = sum(1 + acc for _, acc in steps)
    seconds = sum(cost(1 + nodes) for nodes, _ in steps)
    return {"speedup": tokens * cost(1) / seconds if seconds else 1.0, "trees": sum(n > 0 for n, _ in steps),
            "accepted": sum(acc for _, acc in steps)}


def cost_table(seconds: dict[int, list[float]], largest: int) -> dict[int, float]:
    """Median seconds of a step of n tokens for n = 1 .. largest: measured where seen, between and
    beyond them as the goodput policy reads its calibration points (`draft_policy.cost._interp`)."""
    from specserve.engine.draft_policy.cost import _interp

    seen = sorted((n, statistics.median(v)) for n, v in seconds.items() if v)
    if not seen:
        raise ValueError("no decode step was timed")
    return {n: _interp(seen, n) for n in range(1, largest + 1)}


class _Acceptance:
    """What `drafter`'s tree of a budget accepts after the first p output tokens of a recorded run
    (cached): (draft nodes, accepted tokens, depth); (0, 0, 0) when it proposes nothing."""

    def __init__(self, drafter, run: dict, seq_id: int):
        self.drafter, self.run, self.seq_id, self.cache, self.contexts = drafter, run, seq_id, {}, {}

    def __call__(self, p: int, budget: int) -> tuple[int, int, int]:
        from specserve.engine.tree import tree_depths
        from specserve.engine.verify import verify_greedy

        key = (p, budget)
        if key not in self.cache:
            out = self.run["output"]
            seq = SimpleNamespace(seq_id=self.seq_id, token_ids=self.run["prompt"] + out[:p], options={})
            (tree,) = self.drafter.propose([seq], [budget])
            if tree is None or len(tree.tokens) < 2:
                self.cache[key] = (0, 0, 0)
            else:
                # greedy decoding: the target's argmax at a node d deep on the output's path is the
                # output's token p + d (off that path it is never read); -1 past the recording
                depth = tree_depths(tree.parents)
                argmax = [out[p + d] if p + d < len(out) else -1 for d in depth]
                result = verify_greedy(list(tree.tokens), list(tree.parents), argmax)
                self.cache[key] = (len(tree.tokens) - 1, len(result.accepted_nodes), max(depth))
        return self.cache[key]

    def context(self, p: int) -> int | None:
        """The drafter's context (`Drafter.context_of`) after the first p output tokens."""
        if p not in self.contexts:
            seq = SimpleNamespace(seq_id=self.seq_id, token_ids=self.run["prompt"] + self.run["output"][:p], options={})
            self.contexts[p] = self.drafter.context_of(seq)
        return self.contexts[p]


def replay(policy: str, drafter_name: str, accept: list[_Acceptance], costs: dict[int, float],
           max_tokens: int, per_seq: int) -> dict:
    """One policy (of POLICIES) over the recorded runs in order (one policy state across them, as
    one engine), called as the scheduler calls it: `allocate` for the step, then one `StepReport`."""
    from specserve.engine.draft_policy import Candidate, DraftCall, StepCaps, StepReport, TreeOutcome, make_policy

    cost = _step_cost(costs)
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    told = policy == "goodput"
    engine_policy = make_policy(policy.removesuffix("-no-contexts"), per_seq, max(costs))
    if hasattr(engine_policy, "calibrate"):
        engine_policy.calibrate(lambda n: cost(n), max(costs), time_limit=math.inf)
    steps_of = []
    for acc_at in accept:
        seq = SimpleNamespace(seq_id=acc_at.seq_id, drafter=drafter_name)
        p, steps = 1, []
        while p < max_tokens:
            cap = min(per_seq, max_tokens - p - 1)
            context = acc_at.context(p) if told and cap > 0 else None
            (budget,) = engine_policy.allocate([Candidate(seq.seq_id, drafter_name, max(0, cap), context)],
                                               StepCaps(per_seq, 1, 1, 1))
            nodes, acc, depth = acc_at(p, budget) if budget else (0, 0, 0)
            step = cost(1 + nodes)
            report = StepReport(granted={seq.seq_id: budget}, num_tokens=1 + nodes, num_trees=1 if nodes else 0,
                                seconds=step)
            if budget:
                report.drafts.append(DraftCall(drafter_name, [seq.seq_id], [budget], [nodes], 0.0))
            if nodes:
                report.outcomes.append(TreeOutcome(seq, nodes, depth, acc))
            engine_policy.observe(report)
            steps.append((nodes, acc))
            p += 1 + acc
        engine_policy.observe(StepReport(finished=[seq.seq_id]))
        steps_of.append(steps)
    return {"policy": policy, **summarise(steps_of, costs), "steps": steps_of}


def markdown(result: dict) -> str:
    """The table of a run's JSON: each drafter x dataset, the simulated speedup of every policy."""
    meta, rows = result["meta"], result["results"]
    policies = [p for p in POLICIES if any(r["policy"] == p for r in rows)]
    drafters = list(dict.fromkeys(r["drafter"] for r in rows))
    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    recorded = meta.get("max_tokens") or re.search(r"--max-tokens (\d+)", meta["invocation"])   # older runs: the flag
    tokens = f", {recorded if isinstance(recorded, int) else recorded[1]} tokens per prompt" if recorded else ""
    lines = [f"## Draft-budget policies replayed (batch 1, cpu{tokens})", "",
             f"{meta['date']}; `{meta['invocation']}`", "",
             "| drafter | dataset | " + " | ".join(policies) + " |", "|---|---|" + "---|" * len(policies)]
    for name in drafters:
        for ds in datasets:
            cells = [next((r for r in rows if (r["drafter"], r["dataset"], r["policy"]) == (name, ds, p)), None)
                     for p in policies]
            if not any(cells):
                continue
            lines.append(f"| {name} | {ds} | " + " | ".join(
                f"{c['speedup']:.2f}× ({c['trees']} trees, {c['accepted']} accepted)" if c else "–"
                for c in cells) + " |")
    lines += ["", "Simulated seconds from the step cost table measured in the recording (seconds of a "
              "decode step by its tokens): " + "; ".join(
                  f"{name}: " + ", ".join(f"{n} {s * 1e3:.1f} ms" for n, s in t.items())
                  for name, t in meta["step_seconds"].items())]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="specserve bench replay", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--drafters", nargs="+", default=list(REPLAYABLE), choices=REPLAYABLE)
    ap.add_argument("--datasets", nargs="+", default=["mt_bench", "humaneval", "gsm8k"])
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--num-speculative-tokens", type=int, default=8)
    ap.add_argument("--out", default=None, help="write OUT.json and OUT.md")
    args = ap.parse_args(argv)

    from specserve.bench.common import chat_ids, machine_info
    from specserve.bench.datasets import load_prompts
    from specserve.engine.config import EngineConfig
    from specserve.engine.core import LLMEngine
    from specserve.engine.loader import load_model

    loaded = load_model(args.model)
    engine = LLMEngine(EngineConfig(model=args.model, dtype="float32", device="cpu", max_num_seqs=1, seed=0,
                                    quantization="none", drafters=tuple(args.drafters), draft_budget="fixed",
                                    num_speculative_tokens=args.num_speculative_tokens), loaded=loaded)
    prompts = {ds: [chat_ids(loaded.tokenizer, t) for t in load_prompts(ds, args.num_prompts)] for ds in args.datasets}
    rows, tables = [], {}
    for name in args.drafters:
        runs, seconds = {}, {}
        for ds in args.datasets:   # recorded in dataset order, so the table spans the whole run
            runs[ds], secs = record(engine, name, prompts[ds], args.max_tokens)
            for n, v in secs.items():
                seconds.setdefault(n, []).extend(v)
        costs = cost_table(seconds, args.num_speculative_tokens + 1)
        tables[name] = {n: round(s, 6) for n, s in costs.items()}
        accept = [_Acceptance(engine.drafters[name], run, 10_000 * k + i)
                  for k, ds in enumerate(args.datasets) for i, run in enumerate(runs[ds])]
        for policy in POLICIES:   # each policy's state carries from one dataset to the next
            steps_of = replay(policy, name, accept, costs, args.max_tokens, args.num_speculative_tokens)["steps"]
            start = 0
            for ds in args.datasets:
                steps, start = steps_of[start:start + len(runs[ds])], start + len(runs[ds])
                if policy == "fixed" and steps != [run["steps"] for run in runs[ds]]:
                    raise RuntimeError(f"{name} on {ds}: the replayed fixed budget differs from the recorded run")
                r = summarise(steps, costs)
                rows.append({"drafter": name, "dataset": ds, "policy": policy, "speedup": round(r["speedup"], 4),
                             "trees": r["trees"], "accepted": r["accepted"]})
                print(f"{name} {ds} {policy}: x{r['speedup']:.3f}, {r['trees']} trees, {r['accepted']} accepted",
                      file=sys.stderr)
    meta = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine_info("cpu"),
            "invocation": "python -m specserve.bench.budget_replay " + " ".join(argv if argv is not None else sys.argv[1:]),
            "max_tokens": args.max_tokens, "step_seconds": tables}
    if args.out:
        out = Path(args.out)
        result = {"benchmark": "budget_replay", "meta": meta, "results": rows}
        out.with_suffix(".json").write_text(json.dumps(result, indent=1))
        out.with_suffix(".md").write_text(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
