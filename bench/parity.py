"""Paper parity: every ordering the five papers claim, measured on one target with the shipped
checkpoints, as a table of claim / the paper's numbers / ours / holds.

    python -m specserve.bench.parity [--num-prompts 5] [--max-tokens 96] [--datasets NAME_OR_PATH ...]
        [--claims ID ...] [--falcon-nocsgd DIR] [--mcsd-decision DIR] [--out bench/results/parity] [--no-readme]
    (or: specserve bench parity ...)

The claims are data (`CLAIMS`): each names the configurations it compares (`CONFIGS`: a drafter,
its options, the temperature, the datasets, the draft-node budget) and how ours is read from their
rows. Configurations sharing a temperature and a budget run together as one `bench/spec_decode.py`
run (one engine, every configuration a drafter of it, plain decoding beside them, interleaved
batches, batch 1, `--draft-budget fixed` so every step drafts its full tree: τ, α and SWI are the
figures the papers compare). Sampled runs are unseeded (`--unseeded`), as the papers sample: a
seeded request drafts top-k tokens and gets no target-initialised roots, which would leave MCSD's
TI configuration the same as its static tree. A configuration that is the same drafter with other options runs
under an alias name (e.g. `falcon_topk` = `falcon` with `tree=topk`), registered for the run only.
When a run fails to start (a checkpoint that does not load), each of its configurations runs again
on its own, so that only the failing one is "not measured" (their speeds then come from separate
runs).
At temperature 0 every output is still checked against plain decoding token for token.

A claim holds when its ordering holds on every dataset measured ("partly (k/n)" when on some); it is
"not measured" when a configuration cannot run here: a checkpoint that is not shipped (the Falcon
checkpoint trained without CSGD, `--falcon-nocsgd`), or a drafter option this version does not have
(dynamic MCSD: the draft model's `decision` option; with it, the fork k_config=fork:16,5 runs,
early-stopped by the decision model given with `--mcsd-decision` (default: the shipped type-1 model),
with `--mcsd-decision none` to full depth, said in the row). Writes PREFIX.json, PREFIX.md and the claim table into README.md between
`<!-- parity:start -->` and `<!-- parity:end -->` (replaced on every run; `--no-readme` to skip).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Callable

from specserve.bench.datasets import dataset_label

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "parity"
README = Path(__file__).resolve().parent.parent / "README.md"
MARK_START, MARK_END = "<!-- parity:start -->", "<!-- parity:end -->"
GREEDY_DATASETS = ("mt_bench", "humaneval", "gsm8k")
GREEDY_BUDGET = 8        # draft nodes per step: the served default, the same for every greedy drafter
MCSD_BUDGET = 96         # fits MCSD's 4x2x2x1 (44 nodes), TI's 2 roots x 4x3x1x1 (82) and a 16x5 fork (80)
TAU_TOLERANCE = 0.10     # "about equal τ": within 10 % of the reference's τ
DATASET_LABELS = {"mt_bench": "MT-Bench", "humaneval": "HumanEval", "gsm8k": "GSM8K"}


# ---- configurations ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    """One method to run: `name` is its drafter name in the run (an alias of `drafter` where the
    options differ from another configuration of the same drafter)."""

    name: str
    drafter: str
    options: dict = field(default_factory=dict)
    temperature: float = 0.0
    datasets: tuple[str, ...] = GREEDY_DATASETS
    budget: int = GREEDY_BUDGET
    gamma: int | None = None           # max draft length, for MCSD's α (longest accepted / γ)
    needs: str | None = None           # an argument that must be given (its value fills options[needs_key])
    needs_key: str | None = None
    missing: str = ""                  # the "not measured" reason when `needs` is absent or an option is unknown
    requires: tuple[str, ...] = ()     # options the drafter must declare (a feature of this version) to run
    optional: dict = field(default_factory=dict)   # {argument: option} filled when the argument is given
    caveat_without: dict = field(default_factory=dict)   # {option: what ours means when it is not set}


# dynamic MCSD: MCSD+'s fork of W = 16 chains, D = 5 deep, early-stopped by a decision model (decision=DIR,
# from --mcsd-decision; `specserve train mcsd-decision` makes one); runs where the drafter has `decision`
DYNAMIC_MCSD_OPTIONS = {"k_config": "fork:16,5"}
# why the Falcon configurations trained without CSGD (not shipped) read "not measured"
NO_CSGD_CHECKPOINT = ("no csgd=false checkpoint; train with `specserve train falcon ... --option csgd=false` "
                      "and pass --falcon-nocsgd DIR")

CONFIGS = {c.name: c for c in [
    Config("ctc", "ctc"),
    Config("medusa", "medusa"),
    Config("falcon", "falcon"),                                   # the checkpoint's custom decoding tree
    Config("falcon_topk", "falcon", {"tree": "topk"}),
    Config("falcon_chain", "falcon", {"tree": "chain"}),
    Config("falcon_nocsgd", "falcon", needs="falcon_nocsgd", needs_key="checkpoint",
           missing=NO_CSGD_CHECKPOINT),
    Config("falcon_nocsgd_chain", "falcon", {"tree": "chain"}, needs="falcon_nocsgd", needs_key="checkpoint",
           missing=NO_CSGD_CHECKPOINT),
    Config("eagle", "eagle"),
    Config("parallelspec", "parallelspec"),
    Config("student", "student", {"k_config": "chain:4"}),        # SpS: the shipped student drafting chains of 4
    Config("mag", "mag"),
    Config("cascade", "cascade", {"levels": "student,mag"}),
    # MCSD at T = 0.7 (TI applies to sampling only), the shipped student as the draft model
    Config("mcsd_sps", "student", {"k_config": "chain:4"}, 0.7, ("mt_bench",), MCSD_BUDGET, gamma=4),
    Config("mcsd_static", "student", {"k_config": "4,2,2,1"}, 0.7, ("mt_bench",), MCSD_BUDGET, gamma=4),
    Config("mcsd_ti", "student", {"k_config": "4,3,1,1", "target_init_width": 2}, 0.7, ("mt_bench",),
           MCSD_BUDGET, gamma=4),
    Config("mcsd_dynamic", "student", DYNAMIC_MCSD_OPTIONS, 0.7, ("mt_bench",), MCSD_BUDGET, gamma=5,
           missing="dynamic MCSD not available", requires=("decision",), optional={"mcsd_decision": "decision"},
           caveat_without={"decision": "no decision model (--mcsd-decision): the fork always drafts D = 5"}),
]}


# ---- claims -----------------------------------------------------------------------------------


METRICS = {"tau": "τ", "tok_s": "tok/s", "swi": "SWI", "mcsd_alpha": "MCSD α"}


def metric(row: dict | None, config: Config, key: str) -> float | None:
    """A row's figure: τ, tok/s, SWI, or MCSD's α = mean longest accepted draft / γ (per step)."""
    if row is None or row.get("error"):
        return None
    if key == "mcsd_alpha":
        counts = row.get("accepted_length_counts") or []
        steps = sum(counts)
        if not steps or not config.gamma:
            return None
        return sum(k * n for k, n in enumerate(counts)) / steps / config.gamma
    return row.get(key)


@dataclass
class Outcome:
    ours: str
    holds: str                          # "yes", "no", "partly (k/n)" or "not measured (why)"
    per_dataset: dict = field(default_factory=dict)


def verdict(flags: list[bool]) -> str:
    if not flags:
        return "not measured (no rows)"
    if all(flags):
        return "yes"
    if not any(flags):
        return "no"
    return f"partly ({sum(flags)}/{len(flags)})"


def label(ds: str) -> str:
    return DATASET_LABELS.get(ds, ds)


def f2(x) -> str:
    return "–" if x is None else f"{x:.2f}"


def ordered(key: str, *names: str, speedup: bool = False) -> Callable:
    """The claim "names[0] > names[1] > ..." on `key`, per dataset; `speedup`: also show (not judge)
    each one's speedup over plain decoding, for claims whose paper gives one."""

    def evaluate(lookup, datasets) -> Outcome:
        parts, flags, per = [], [], {}
        for ds in datasets:
            vals = [lookup(n, ds, key) for n in names]
            if any(v is None for v in vals):
                continue
            ok = all(a > b for a, b in zip(vals, vals[1:]))
            flags.append(ok)
            per[ds] = {"values": dict(zip(names, vals)), "holds": ok}
            text = f"{label(ds)} {' / '.join(f2(v) for v in vals)}"
            if speedup:
                per[ds]["speedup"] = {n: lookup(n, ds, "speedup") for n in names}
                text += f" ({' / '.join('–' if v is None else f'{v:.2f}×' for v in per[ds]['speedup'].values())})"
            parts.append(text)
        head = f"{METRICS[key]} {' / '.join(names)}{' (speedup)' if speedup else ''}: " if parts else ""
        return Outcome(head + "; ".join(parts), verdict(flags), per)

    return evaluate


def faster_at_equal_tau(fast: str, ref: str, tolerance: float = TAU_TOLERANCE) -> Callable:
    """`fast` has more tok/s than `ref` and a τ within `tolerance` (relative) of ref's, per dataset."""

    def evaluate(lookup, datasets) -> Outcome:
        parts, flags, per = [], [], {}
        for ds in datasets:
            ts = [lookup(n, ds, "tok_s") for n in (fast, ref)]
            taus = [lookup(n, ds, "tau") for n in (fast, ref)]
            if None in ts or None in taus:
                continue
            faster = ts[0] > ts[1]
            equal = abs(taus[0] - taus[1]) <= tolerance * taus[1]
            flags.append(faster and equal)
            per[ds] = {"tok_s": dict(zip((fast, ref), ts)), "tau": dict(zip((fast, ref), taus)),
                       "faster": faster, "tau_within_tolerance": equal, "holds": faster and equal}
            parts.append(f"{label(ds)} {ts[0]:.1f} vs {ts[1]:.1f} tok/s, τ {taus[0]:.2f} vs {taus[1]:.2f}")
        return Outcome("; ".join(parts), verdict(flags), per)

    return evaluate


@dataclass(frozen=True)
class Claim:
    id: str
    text: str
    paper: str                          # the paper's numbers
    source: str                         # where they are (paper, table, setting)
    configs: tuple[str, ...]
    evaluate: Callable
    note: str = ""                      # what to know when reading ours


CLAIMS = [
    Claim("ctc_vs_medusa", "CTC-drafter τ > Medusa τ (greedy, same node budget)",
          "β 3.56 vs 2.58 (MT-Bench), 3.53 vs 2.78 (GSM8K)", "CTC-drafter Table 1, Vicuna-7B",
          ("ctc", "medusa"), ordered("tau", "ctc", "medusa", speedup=True),
          "β is the paper's τ (bonus included). Each checkpoint's training data and steps are in its meta.json."),
    Claim("falcon_tree_vs_topk", "Falcon (CSGD): custom decoding tree τ > plain top-k tree",
          "τ 3.34 vs 2.13, 3.10× vs 2.27× (tree vs chain of equal height)", "Falcon Table 4, Vicuna-7B MT-Bench",
          ("falcon", "falcon_topk"), ordered("tau", "falcon", "falcon_topk", speedup=True),
          "The paper ablates the tree against a chain (next row); top-k is the plain tree of the same budget."),
    Claim("falcon_tree_vs_chain", "Falcon (CSGD): custom decoding tree τ > chain (no tree attention)",
          "τ 3.34 vs 2.13, 3.10× vs 2.27×", "Falcon Table 4, Vicuna-7B MT-Bench",
          ("falcon", "falcon_chain"), ordered("tau", "falcon", "falcon_chain", speedup=True),
          "Our chain is the top-1 path of depth 8 (4 forwards of k = 2)."),
    Claim("falcon_csgd", "Falcon (custom tree): CSGD training τ > without CSGD",
          "τ 3.34 vs 2.78, 3.10× vs 2.65×", "Falcon Table 4, Vicuna-7B MT-Bench",
          ("falcon", "falcon_nocsgd"), ordered("tau", "falcon", "falcon_nocsgd", speedup=True),
          "Needs a checkpoint trained on the same data with csgd=false."),
    Claim("falcon_csgd_tree_vs_neither", "Falcon: CSGD + custom tree τ > neither (no CSGD, chain)",
          "τ 3.34 vs 1.64, 3.10× vs 2.06×", "Falcon Table 4, Vicuna-7B MT-Bench",
          ("falcon", "falcon_nocsgd_chain"), ordered("tau", "falcon", "falcon_nocsgd_chain", speedup=True)),
    Claim("parallelspec_vs_eagle",
          f"ParallelSpec faster than EAGLE (tok/s) at about equal τ (within {TAU_TOLERANCE:.0%})",
          "2.55× vs 2.18×, τ 3.52 vs 3.58 (avg. of 6 tasks)", "ParallelSpec Table 1, Vicuna-7B, T = 0",
          ("parallelspec", "eagle"), faster_at_equal_tau("parallelspec", "eagle"),
          "The paper's row is EAGLE + ParallelSpec; ours is a standalone ParallelSpec layer beside EAGLE's head. "
          "tok/s on this CPU at a fixed 8-node budget."),
    Claim("cascade_vs_sps", "Cascade (student → Max-Gram) SWI > SpS with the student",
          "SWI 3.16 vs 3.06 (small), 3.62 vs 3.38 (base)", "CS Drafting Table 2, GSM8K, MS costs, T = 0",
          ("cascade", "student"), ordered("swi", "cascade", "student"),
          "SWI with c = parameters / the target's (MS). The shipped student has 1 layer."),
    Claim("cascade_vs_mag", "Cascade (student → Max-Gram) SWI > Max-Gram alone",
          "– (no Max-Gram-only row; the paper's claim is that the neural level adds to MaG)",
          "CS Drafting §5.6", ("cascade", "mag"), ordered("swi", "cascade", "mag"),
          "Max-Gram runs no network (its SWI = τ), so the cascade must beat it on τ by more than the "
          "student's runs cost."),
    Claim("mcsd_alpha", "MCSD α: target-initialised (2 × 4,3,1,1) > MCSD (4,2,2,1) > SpS (γ = 4)",
          "0.47 > 0.29 > 0.17", "MCSD+ Table 2, Llama-2-7B-Chat / Llama-68M, MT-Bench, T = 0.7",
          ("mcsd_ti", "mcsd_static", "mcsd_sps"), ordered("mcsd_alpha", "mcsd_ti", "mcsd_static", "mcsd_sps"),
          "MCSD α = longest accepted draft / γ per step (γ = 4), not our accepted/drafted α. Draft model: the "
          "shipped student (a truncated target is accepted almost never). TI is lossy."),
    Claim("mcsd_dynamic_vs_ti", "Dynamic MCSD (fork D = 5, W = 16) α > static TI α",
          "0.74 (dynamic, T = 1) vs 0.47 (static TI, T = 0.7)", "MCSD+ Tables 2 and 3, Llama-2-7B-Chat, MT-Bench",
          ("mcsd_dynamic", "mcsd_ti"), ordered("mcsd_alpha", "mcsd_dynamic", "mcsd_ti"),
          "Both at T = 0.7 here; dynamic MCSD's γ is its depth D = 5 (an early stop only shortens a draft, so "
          "without a decision model its α is an upper bound on the dynamic one's)."),
]
CLAIM_IDS = [c.id for c in CLAIMS]


# ---- availability -------------------------------------------------------------------------------


def resolve_configs(claims: list[Claim], args: argparse.Namespace, extra: dict[str, dict]) -> tuple[dict, dict]:
    """({name: Config ready to run}, {name: why it cannot run}) for the configurations of `claims`.
    `extra` ({drafter or config name: options}) is added to every matching configuration;
    --datasets replaces every configuration's datasets."""
    from dataclasses import replace

    from specserve.drafters.base import available_drafters, drafter_class, drafter_options

    registered = available_drafters()
    ready, missing = {}, {}
    for name in dict.fromkeys(n for c in claims for n in c.configs):
        cfg = CONFIGS[name]
        options = {**cfg.options, **extra.get(cfg.drafter, {}), **extra.get(name, {})}
        if cfg.needs:
            value = getattr(args, cfg.needs, None)
            if not value:
                missing[name] = cfg.missing
                continue
            options[cfg.needs_key] = value
        for arg, key in cfg.optional.items():
            if getattr(args, arg, None) not in (None, "", "none"):
                options[key] = getattr(args, arg)
        if cfg.drafter not in registered:
            missing[name] = f"drafter {cfg.drafter!r} is not registered"
            continue
        declared = drafter_options(drafter_class(cfg.drafter))
        unknown = [k for k in (*options, *cfg.requires) if k not in declared]
        if unknown:
            missing[name] = cfg.missing or f"{cfg.drafter} has no option {', '.join(unknown)}"
            continue
        if name != cfg.drafter and name in registered:
            raise SystemExit(f"parity: configuration name {name!r} is a registered drafter of its own")
        ready[name] = replace(cfg, options=options, datasets=tuple(args.datasets or cfg.datasets))
    return ready, missing


def groups_of(configs: dict[str, Config]) -> dict[tuple[float, int], list[Config]]:
    """Configurations that run in one engine: same temperature and node budget."""
    out: dict[tuple[float, int], list[Config]] = {}
    for cfg in configs.values():
        out.setdefault((cfg.temperature, cfg.budget), []).append(cfg)
    return out


@contextmanager
def aliases(configs: list[Config]):
    """Register each configuration named other than its drafter as an alias, for the run only."""
    from specserve.drafters import base

    base.available_drafters()
    added = [c.name for c in configs if c.name != c.drafter and c.name not in base._REGISTRY]
    for c in configs:
        if c.name in added:
            base._REGISTRY[c.name] = base._REGISTRY[c.drafter]
    try:
        yield
    finally:
        for name in added:
            base._REGISTRY.pop(name, None)


def option_text(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "none"
    if isinstance(value, (dict, list)):
        return json.dumps(value)
    return str(value)


def spec_argv(args: argparse.Namespace, configs: list[Config], temperature: float, budget: int, out: Path) -> list[str]:
    datasets = list(dict.fromkeys(ds for c in configs for ds in c.datasets))
    argv = ["--model", args.model, "--datasets", *datasets, "--num-prompts", str(args.num_prompts),
            "--max-tokens", str(args.max_tokens), "--temperature", f"{temperature:g}",
            "--drafters", *[c.name for c in configs], "--num-speculative-tokens", str(budget),
            "--max-draft-tokens-per-step", str(max(64, budget)), "--draft-budget", "fixed", "--no-hf",
            "--device", args.device, "--dtype", args.dtype, "--seed", str(args.seed), "--out", str(out)]
    if temperature > 0:   # the papers' speculative sampling: drafts drawn from q, rejection-sampling verification
        argv.append("--unseeded")   # (a seeded request gets top-k drafts and no target-initialised roots)
    if args.threads:
        argv += ["--threads", str(args.threads)]
    for c in configs:
        for key, value in c.options.items():
            argv += ["--drafter-option", f"{c.name}.{key}={option_text(value)}"]
    return argv


def run_groups(args: argparse.Namespace, configs: dict[str, Config],
               workdir: Path) -> tuple[list[dict], list[dict], dict]:
    """Run every group through bench/spec_decode.py; (rows, one record per group, {config: error})."""
    from specserve.bench import spec_decode

    rows, runs, failed = [], [], {}
    queue = sorted(groups_of(configs).items())
    while queue:
        (temperature, budget), group = queue.pop(0)
        prefix = workdir / f"run{len(runs)}"
        argv = spec_argv(args, group, temperature, budget, prefix)
        print(f"parity: run {len(runs) + 1}: T={temperature:g}, {budget} nodes: {', '.join(c.name for c in group)}",
              file=sys.stderr)
        t0 = time.perf_counter()
        record = {"temperature": temperature, "budget": budget, "configs": [c.name for c in group],
                  "invocation": shlex.join(["python", "-m", "specserve.bench.spec_decode", *argv])}
        try:
            with aliases(group):
                record["exit_status"] = spec_decode.main(argv)
            result = json.loads(prefix.with_suffix(".json").read_text())
        except Exception as exc:   # e.g. a checkpoint that does not load: report it, go on
            record["error"] = f"{type(exc).__name__}: {exc}"
            print(f"parity: run {len(runs) + 1} failed: {record['error']}", file=sys.stderr)
            if len(group) > 1:      # one configuration must not sink the others: each again on its own
                record["retried_alone"] = True
                queue[:0] = [((temperature, budget), [c]) for c in group]
            else:
                failed[group[0].name] = record["error"]
        else:
            record["meta"] = result["meta"]
            record["num_greedy_mismatches"] = result["num_greedy_mismatches"]
            rows += result["results"]
        record["seconds"] = time.perf_counter() - t0
        runs.append(record)
    return rows, runs, failed


# ---- evaluation ---------------------------------------------------------------------------------


def evaluate(claims: list[Claim], rows: list[dict], configs: dict[str, Config],
             unavailable: dict[str, str]) -> list[dict]:
    """Each claim's record: its paper numbers, ours and whether it holds, from the rows."""
    index = {(r["method"], r["dataset"], r["temperature"]): r for r in rows}

    def lookup(name: str, ds: str, key: str):
        cfg = configs[name]
        return metric(index.get((name, ds, cfg.temperature)), cfg, key)

    out = []
    for claim in claims:
        rec = {"id": claim.id, "claim": claim.text, "paper": claim.paper, "source": claim.source,
               "configs": list(claim.configs), "note": claim.note, "ours": "", "holds": None, "per_dataset": {}}
        why = [unavailable[n] if unavailable[n] == CONFIGS[n].missing else f"{n}: {unavailable[n]}"
               for n in claim.configs if n in unavailable]
        if why:
            rec["holds"] = f"not measured ({'; '.join(dict.fromkeys(why))})"
        else:
            datasets = list(dict.fromkeys(ds for n in claim.configs for ds in configs[n].datasets))
            datasets = [dataset_label(ds) for ds in datasets]
            outcome = claim.evaluate(lookup, datasets)
            caveats = [f"{n}: {text}" for n in claim.configs
                       for key, text in configs[n].caveat_without.items() if key not in configs[n].options]
            ours = outcome.ours + "".join(f" [{c}]" for c in caveats) if outcome.ours else outcome.ours
            rec.update(ours=ours, holds=outcome.holds, per_dataset=outcome.per_dataset, caveats=caveats)
        out.append(rec)
    return out


# ---- reporting ----------------------------------------------------------------------------------


def claims_table(records: list[dict]) -> list[str]:
    lines = ["| claim | paper | ours | holds |", "|---|---|---|---|"]
    for r in records:
        holds = r["holds"]
        holds = f"**{holds}**" if holds in ("yes", "no") else holds
        lines.append(f"| {r['claim']} | {r['paper']} ({r['source']}) | {r['ours'] or '–'} | {holds} |")
    return lines


def markdown(result: dict) -> str:
    meta = result["meta"]
    m = meta.get("machine") or {}
    lines = [f"## Paper parity: {meta['model']} ({meta['device']}, {meta['dtype']}, batch 1)", "",
             f"{meta['datetime']}; {m.get('platform', '?')}, {m.get('cpu_count', '?')} CPUs, "
             f"{m.get('torch_threads', '?')} torch threads; torch {meta['torch']}; {meta['num_prompts']} prompts × "
             f"{meta['max_tokens']} tokens per dataset; fixed draft budget ({GREEDY_BUDGET} nodes greedy, "
             f"{MCSD_BUDGET} for MCSD); {meta['seconds'] / 60:.1f} min.", "",
             f"`{meta['command_line']}`", "", *claims_table(result["claims"]), "",
             "Notes:", ""]
    lines += [f"* {r['id']}: {r['note']}" for r in result["claims"] if r["note"]]
    lines += ["", "Configurations (one `bench/spec_decode.py` run per temperature and budget; τ = tokens per "
              "target forward, bonus included; SWI with c = parameters / the target's):", "",
              "| name | drafter | options | T | datasets | nodes |", "|---|---|---|---|---|---|"]
    for name, c in result["configs"].items():
        if name in result["unavailable"]:
            continue
        opts = " ".join(f"{k}={option_text(v)}" for k, v in c["options"].items()) or "(shipped defaults)"
        lines.append(f"| {name} | {c['drafter']} | {opts} | {c['temperature']:g} | {', '.join(c['datasets'])} "
                     f"| {c['budget']} |")
    for name, why in result["unavailable"].items():
        lines.append(f"| {name} | {CONFIGS[name].drafter} | not measured: {why} | | | |")
    if result["num_greedy_mismatches"]:
        lines += ["", f"**{result['num_greedy_mismatches']} greedy output(s) differ from plain decoding** "
                      "(see the runs' greedy_mismatches)."]
    return "\n".join(lines) + "\n"


def readme_block(result: dict) -> str:
    meta = result["meta"]
    return "\n".join([MARK_START, "", f"`{meta['command_line']}` ({meta['date']}, {meta['model']}, "
                      f"{meta['num_prompts']} prompts × {meta['max_tokens']} tokens per dataset; full table and "
                      "configurations in `docs/results.md`):", "", *claims_table(result["claims"]), "",
                      *[f"* {r['id']}: {r['note']}" for r in result["claims"] if r.get("note")], "", MARK_END])


def replace_block(text: str, block: str) -> str | None:
    """`text` with the part from MARK_START to MARK_END replaced by `block` (which carries the
    markers); None when the markers are missing."""
    start = text.find(MARK_START)
    end = text.find(MARK_END, start + len(MARK_START)) if start >= 0 else -1
    if start < 0 or end < 0:
        return None
    return text[:start] + block + text[end + len(MARK_END):]


def update_readme(path: Path, result: dict) -> bool:
    new = replace_block(path.read_text(encoding="utf-8"), readme_block(result))
    if new is None:
        print(f"parity: {path} has no {MARK_START} ... {MARK_END} markers; README not updated", file=sys.stderr)
        return False
    path.write_text(new, encoding="utf-8")
    return True


# ---- command ------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default", help="target model (default: %(default)s)")
    ap.add_argument("--num-prompts", type=int, default=5, metavar="N",
                    help="prompts per dataset (default: %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=96, metavar="N",
                    help="tokens generated per prompt (default: %(default)s)")
    ap.add_argument("--datasets", nargs="+", default=None, metavar="NAME_OR_PATH",
                    help="run every claim on these datasets (default: each claim's own: MT-Bench, HumanEval and "
                         "GSM8K greedy, MT-Bench for MCSD)")
    ap.add_argument("--claims", nargs="+", default=None, metavar="ID", choices=CLAIM_IDS,
                    help=f"a subset of the claims (default: all): {', '.join(CLAIM_IDS)}")
    ap.add_argument("--falcon-nocsgd", default=None, metavar="DIR",
                    help="a falcon checkpoint trained with csgd=false, for the CSGD half of the Falcon claim")
    ap.add_argument("--mcsd-decision", default="type1", metavar="PATH",
                    help="the decision model of dynamic MCSD: a checkpoint folder, type1/type2 (those shipped for "
                         "the default target's student), or none (the fork always drafts D deep) (default: %(default)s)")
    ap.add_argument("--drafter-option", action="append", default=[], metavar="NAME.OPTION=VALUE",
                    help="an option added to every configuration of drafter NAME (or to configuration NAME), "
                         "e.g. ctc.checkpoint=DIR (repeatable)")
    ap.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto (default: %(default)s)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                    help="float32 keeps the greedy check exact (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--seed", type=int, default=0,
                    help="the engines' sampling seed (sampled runs send unseeded requests; default: %(default)s)")
    ap.add_argument("--out", default=str(DEFAULT_OUT), metavar="PREFIX",
                    help="writes PREFIX.json and PREFIX.md (default: bench/results/parity)")
    ap.add_argument("--no-readme", dest="readme", action="store_false",
                    help="do not write the claim table into README.md")
    return ap


def run(args: argparse.Namespace, argv: list[str]) -> int:
    import torch

    from specserve.drafters.base import parse_drafter_options

    claims = [c for c in CLAIMS if args.claims is None or c.id in args.claims]
    configs, unavailable = resolve_configs(claims, args, parse_drafter_options(args.drafter_option))
    for name, why in unavailable.items():
        print(f"parity: {name} not run: {why}", file=sys.stderr)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="specserve-parity-") as tmp:
        rows, runs, failed = run_groups(args, configs, Path(tmp))
    unavailable.update({n: f"failed: {e}" for n, e in failed.items()})
    records = evaluate(claims, rows, configs, unavailable)
    metas = [r["meta"] for r in runs if "meta" in r]
    now = datetime.now().astimezone()
    result = {
        "benchmark": "parity",
        "meta": {"date": now.date().isoformat(), "datetime": now.isoformat(timespec="seconds"),
                 "command_line": shlex.join(["specserve", "bench", "parity", *argv]),
                 "machine": metas[0]["machine"] if metas else None, "torch": torch.__version__,
                 "model": metas[0]["model"] if metas else args.model, "device": args.device, "dtype": args.dtype,
                 "num_prompts": args.num_prompts, "max_tokens": args.max_tokens, "seed": args.seed,
                 "tau_tolerance": TAU_TOLERANCE, "seconds": time.perf_counter() - t0},
        "claims": records,
        "configs": {n: {"drafter": c.drafter, "options": c.options, "temperature": c.temperature,
                        "datasets": list(c.datasets), "budget": c.budget, "gamma": c.gamma}
                    for n, c in configs.items()},
        "unavailable": unavailable,
        "runs": runs,
        "results": rows,
        "num_greedy_mismatches": sum(r.get("num_greedy_mismatches", 0) for r in runs),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out.with_name(out.name + ".json"), out.with_name(out.name + ".md")
    json_path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    table = markdown(result)
    md_path.write_text(table)
    print(table)
    wrote = [str(json_path), str(md_path)]
    if args.readme and update_readme(README, result):
        wrote.append(str(README))
    print(f"parity: wrote {', '.join(wrote)}", file=sys.stderr)
    bad = result["num_greedy_mismatches"] and args.dtype == "float32"
    return 1 if bad or any(r.get("exit_status") for r in runs) else 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.num_prompts < 1 or args.max_tokens < 1:
        raise SystemExit("parity: --num-prompts and --max-tokens must be positive")
    return run(args, argv)


if __name__ == "__main__":
    sys.exit(main())
