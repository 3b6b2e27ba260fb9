"""A/B of two trees' decoding speed on one machine, in one command: the engine of an older revision
against this working tree, on random weights of the default model's shape (speed does not depend on
the weights' values, so no model file travels: its config and tokenizer do, and the weights are drawn
there).

    python tools/gpu_ab.py pack --old REV        # here: .device/ab (both trees, the model's config, prompts)
    python tools/gpu_ab.py run --out DIR         # there, carrying .device/ab: old, new, old, new
    python tools/gpu_ab.py run --out DIR --dry-run   # the same on the CPU, a 2-layer model, 8 tokens
    python tools/gpu_ab.py profile --out DIR     # there: where the new tree's decode step goes

On the GPU machine the command runs in the working tree's root, so `--ab` keeps its default there.

Each variant runs in a child process with only its own tree on PYTHONPATH (`ab/<variant>/specserve`):
plain decoding at batch 1 (prompts one at a time) and at batch 32 (one closed batch), greedy, exactly
--max-tokens each, the n-gram drafter (the goodput policy) at both, and eagle with a random head (which
the policy learns to grant nothing) at batch 32. Interleaving the variants twice shows the
run-to-run noise beside the difference. Writes DIR/ab.json and prints a table.

`profile` runs the new tree alone, in a child likewise: plain decoding at batch 1, 8, 32 and 64 with
async scheduling off and on (alternately, twice), then torch.profiler over decode steps at batch 1 and
32, replayed as CUDA graphs and eagerly: each kernel's device time per step, the step's kernel count
and device time against its wall time. `--parts drafters` adds (or, alone, runs only) the draft steps
of ngram, eagle (a random head) and draft_model under the fixed budget at batch 1: the same per step,
the host's own time per op, and the milliseconds proposing and verifying. Writes DIR/profile.json and
DIR/profile.txt.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
AB = ROOT / ".device" / "ab"       # where `pack` writes and `run` reads (--ab)
PACKAGES = ("engine", "server", "drafters", "kernels", "bench")
MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "chat_template.jinja")


def pack(old: str, model_dir: Path | None) -> None:
    shutil.rmtree(AB, ignore_errors=True)
    for variant in ("old", "new"):
        (AB / variant / "specserve").mkdir(parents=True)
    archive = subprocess.run(["git", "archive", old, *PACKAGES], cwd=ROOT, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(AB / "old" / "specserve"), "--exclude=drafters/checkpoints"],
                   input=archive, check=True)
    for name in PACKAGES:
        shutil.copytree(ROOT / name, AB / "new" / "specserve" / name,
                        ignore=shutil.ignore_patterns("__pycache__", "checkpoints", "results"))
    cache = Path(os.environ.get("SPECSERVE_CACHE") or Path.home() / ".cache" / "specserve")
    # the default model as converted into the cache (`specserve serve` once), unless --model-dir
    src = model_dir or next(p.parent for p in sorted((cache / "gguf").glob("*/config.json")))
    (AB / "model").mkdir()
    for name in MODEL_FILES:
        if (src / name).is_file():
            shutil.copy(src / name, AB / "model" / name)
    data = Path(os.environ.get("SPECSERVE_DATA") or ROOT.parent / "shared" / "data")
    (AB / "data").mkdir()
    for name in ("mt_bench", "humaneval", "gsm8k"):
        lines = (data / f"{name}.jsonl").read_text().splitlines(keepends=True)[:32]
        (AB / "data" / f"{name}.jsonl").write_text("".join(lines))
    (AB / "old.txt").write_text(subprocess.run(["git", "rev-parse", old], cwd=ROOT, check=True,
                                               capture_output=True, text=True).stdout)
    print(f"packed {AB}: {sum(f.stat().st_size for f in AB.rglob('*') if f.is_file()) / 1e6:.1f} MB")


def draw_weights(model_dir: Path, dry: bool) -> None:
    import torch
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(model_dir)
    if dry:
        cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size = 2, 64, 128
        cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim = 4, 2, 16
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(torch.float32 if dry else torch.bfloat16)
    model.save_pretrained(model_dir)


def chat_prompts(model_dir: str, data_dir: str, per_set: int) -> list[list[int]]:
    """The first `per_set` prompts of each benchmark set, as chat token ids (at most 256)."""
    from transformers import AutoTokenizer

    from specserve.bench.common import chat_ids

    tok = AutoTokenizer.from_pretrained(model_dir)
    return [chat_ids(tok, json.loads(line)["turns"][0])[:256]
            for name in ("mt_bench", "humaneval", "gsm8k")
            for line in (Path(data_dir) / f"{name}.jsonl").read_text().splitlines()[:per_set]]


def drawn_model(out: Path, dry: bool) -> Path:
    """A copy of the packed model's folder with its weights drawn (seeded: the same each time)."""
    model_dir = out / "model" if dry else Path("/tmp/specserve-ab-model")
    shutil.rmtree(model_dir, ignore_errors=True)
    shutil.copytree(AB / "model", model_dir)
    draw_weights(model_dir, dry)
    return model_dir


def measure(model_dir: str, data_dir: str, max_tokens: int, dry: bool) -> dict:
    """In a child: this tree's engine, plain decoding and ngram at b1 and b32, eagle (a random head, so
    the goodput policy grants it nothing) at b32."""
    import torch

    import specserve.engine as engine_pkg
    from specserve.engine.config import EngineConfig
    from specserve.engine.core import LLMEngine
    from specserve.engine.sampling_params import SamplingParams

    prompts = chat_prompts(model_dir, data_dir, 16)
    device = "cpu" if dry else "cuda"
    batch = 2 if dry else 32
    eng = LLMEngine(EngineConfig(model=model_dir, device=device, dtype="float32" if dry else "bfloat16",
                                 max_num_seqs=batch, max_model_len=512, max_num_batched_tokens=2048,
                                 num_kv_blocks=batch * 32 + 64, drafters=("none", "ngram", "eagle"),
                                 drafter_options={"eagle": {"random_init": True}}, quantization="none"))
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def decode(group, drafter, tag):
        for i, p in enumerate(group):
            eng.add_request(f"{tag}-{i}", p, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                            drafter=drafter)
        steps, walls, t0 = 0, [], time.perf_counter()
        while eng.has_unfinished_requests():
            s0 = time.perf_counter()
            eng.step()
            walls.append(time.perf_counter() - s0)
            steps += 1
        sync()
        return len(group) * max_tokens, time.perf_counter() - t0, walls

    decode(prompts[:1], "none", "warm")
    decode(prompts[:batch], "none", "warm-b")
    decode(prompts[:1], "ngram", "warm-n")
    decode(prompts[:2], "eagle", "warm-e")
    out = {"tree": str(Path(engine_pkg.__file__).parents[1]),
           "env": {k: v for k, v in os.environ.items() if k.startswith("SPECSERVE_")}}
    for label, drafter, groups in (("plain_b1", "none", [[p] for p in prompts[:3]]),
                                   ("ngram_b1", "ngram", [[p] for p in prompts[:3]]),
                                   ("plain_b32", "none", [prompts[:batch]]),
                                   ("ngram_b32", "ngram", [prompts[:batch]]),
                                   ("eagle_b32", "eagle", [prompts[:batch]])):
        n = secs = 0.0
        walls = []
        for g in groups:
            a, b, w = decode(g, drafter, label)
            n, secs, walls = n + a, secs + b, walls + w
        out[label] = {"tok_s": n / secs, "median_step_ms": statistics.median(walls) * 1e3}
    return out


PROFILE_PARTS = ("sweep", "kernels", "drafters")
# drafters whose steps `profile --parts drafters` takes apart, with what they need on drawn weights
PROFILED_DRAFTERS = {"ngram": {}, "eagle": {"random_init": True}, "draft_model": {"draft_layers": 4}}


def _device_rows(prof, steps: int) -> list[dict]:
    """Kernels and copies on the device (not the ops launching them), by device time per step."""
    rows = []
    for e in prof.key_averages():
        dev = getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0) or 0
        if dev > 0 and not e.self_cpu_time_total:
            rows.append({"name": e.key[:120], "calls_per_step": e.count / steps, "us_per_step": dev / steps})
    return sorted(rows, key=lambda r: -r["us_per_step"])


def _host_rows(prof, steps: int) -> list[dict]:
    """Host ops by their own CPU time per step (what the Python side pays per launch)."""
    rows = [{"name": e.key[:120], "calls_per_step": e.count / steps, "us_per_step": e.self_cpu_time_total / steps}
            for e in prof.key_averages() if e.self_cpu_time_total > 0]
    return sorted(rows, key=lambda r: -r["us_per_step"])


def _step_row(prof, steps: int, wall: float, top: int) -> dict:
    """A profiled run's per-step summary: steps, wall and device ms per step, kernels per step, and
    the `top` kernels by device time."""
    rows = _device_rows(prof, steps)
    return {"steps": steps, "wall_ms_per_step": wall / steps * 1e3,
            "device_ms_per_step": sum(r["us_per_step"] for r in rows) / 1e3,
            "kernels_per_step": sum(r["calls_per_step"] for r in rows), "top": rows[:top]}


def _step_line(label: str, row: dict) -> str:
    return (f"==== {label}: {row['steps']} steps, wall {row['wall_ms_per_step']:.3f} ms/step, device "
            f"{row['device_ms_per_step']:.3f} ms/step, {row['kernels_per_step']:.0f} kernels/step")


def profile(model_dir: str, data_dir: str, max_tokens: int, dry: bool, text_path: str,
            parts: tuple[str, ...] = ("sweep", "kernels")) -> dict:
    """In a child: the new tree's decode step, timed and profiled (see the module's docstring)."""
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from specserve.engine.config import EngineConfig
    from specserve.engine.core import LLMEngine
    from specserve.engine.sampling_params import SamplingParams

    prompts = chat_prompts(model_dir, data_dir, 22)
    cuda = not dry
    sizes = [1, 2] if dry else [1, 8, 32, 64]

    def engine(**kw):
        return LLMEngine(EngineConfig(model=model_dir, device="cuda" if cuda else "cpu",
                                      dtype="bfloat16" if cuda else "float32", max_num_seqs=max(sizes),
                                      max_model_len=512, max_num_batched_tokens=4096,
                                      num_kv_blocks=max(sizes) * 32 + 64, quantization="none", **kw))

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    table_key = "self_device_time_total" if cuda else "self_cpu_time_total"
    out: dict = {"max_tokens": max_tokens, "device": torch.cuda.get_device_name(0) if cuda else "cpu"}
    lines = []
    eng = engine(drafters=("none",)) if {"sweep", "kernels"} & set(parts) else None

    def decode(group, tag, steps_hook=None):
        for i, p in enumerate(group):
            eng.add_request(f"{tag}-{i}", p, params)
        while eng.num_requests and any(s.num_computed_tokens < len(s.token_ids) - 1
                                       for r in eng.requests.values() for s in r.seqs):
            eng.step()                                   # the prefill, not timed
        sync()
        walls, t0 = [], time.perf_counter()
        while eng.has_unfinished_requests():
            s0 = time.perf_counter()
            eng.step()
            walls.append(time.perf_counter() - s0)
        sync()
        return len(walls), time.perf_counter() - t0, walls

    def profiled(e, max_steps: int = 32):
        """torch.profiler over up to `max_steps` steps of what `e` runs: (profile, steps, wall seconds)."""
        steps, t0 = 0, time.perf_counter()
        with torch_profile(activities=acts) as prof:
            while e.has_unfinished_requests() and steps < max_steps:
                e.step()
                steps += 1
            sync()
        return prof, steps, time.perf_counter() - t0

    if "sweep" in parts:
        decode(prompts[:1], "warm")
        decode(prompts[:max(sizes)], "warm-b")
        sweep: dict[str, dict] = {}
        for rnd in range(2):
            for b in sizes:
                for on in (False, True):
                    eng.async_scheduling = on
                    n, secs, walls = decode(prompts[:b], f"s{rnd}-{b}-{on}")
                    row = sweep.setdefault(f"b{b}_{'async' if on else 'sync'}", {"tok_s": [], "median_step_ms": []})
                    row["tok_s"].append(b * max_tokens / secs)
                    row["median_step_ms"].append(statistics.median(walls) * 1e3)
        eng.async_scheduling = eng.device.type == "cuda"
        out["sweep"] = sweep
    if "kernels" in parts:
        kernels: dict[str, dict] = {}
        graphs = eng.runner.graphs
        for label, b, graphed in (("b1_graphs", 1, True), ("b32_graphs", sizes[-2] if not dry else 2, True),
                                  ("b1_eager", 1, False)):
            eng.runner.graphs = graphs if graphed else None
            for i, p in enumerate(prompts[:b]):
                eng.add_request(f"p-{label}-{i}", p, params)
            for _ in range(4):                                # the prefill and a few steps, not profiled
                eng.step()
            sync()
            prof, steps, wall = profiled(eng)
            while eng.has_unfinished_requests():
                eng.step()
            kernels[label] = _step_row(prof, steps, wall, 30)
            lines.append(_step_line(label, kernels[label]))
            lines.append(prof.key_averages().table(sort_by=table_key, row_limit=40, max_name_column_width=90))
        eng.runner.graphs = graphs
        out["kernels"] = kernels
    if "drafters" in parts:
        # every sequence drafts its full tree each step (the fixed budget); per drafter at batch 1: the
        # step's wall, device time and kernel count, and the host's time proposing and verifying per step
        del eng
        names = list(PROFILED_DRAFTERS)
        options = {**PROFILED_DRAFTERS, **({"draft_model": {"draft_layers": 1}} if dry else {})}   # 2 layers there
        eng = engine(drafters=("none", *names), draft_budget="fixed", drafter_options=options)
        drafters: dict[str, dict] = {}
        for name in ("none", *names):
            eng.add_request(f"d-{name}", prompts[0], params, drafter=name)
            for _ in range(4):
                eng.step()
            sync()
            before = eng.drafter_stats[name].copy() if name != "none" else None
            prof, steps, wall = profiled(eng, 24)
            after = eng.drafter_stats[name] if name != "none" else None
            while eng.has_unfinished_requests():
                eng.step()
            row = {**_step_row(prof, steps, wall, 20), "host": _host_rows(prof, steps)[:20]}
            if after is not None and after.num_steps > before.num_steps:
                n = after.num_steps - before.num_steps
                row.update(draft_steps=n, draft_ms=(after.draft_time_s - before.draft_time_s) / n * 1e3,
                           verify_ms=(after.verify_time_s - before.verify_time_s) / n * 1e3)
            drafters[name] = row
            lines.append(_step_line(f"drafter {name} (fixed budget, b1)", row)
                         + f", draft {row.get('draft_ms', 0):.2f} ms, verify {row.get('verify_ms', 0):.2f} ms")
            lines.append(prof.key_averages().table(sort_by=table_key, row_limit=30, max_name_column_width=90))
            lines.append(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30,
                                                   max_name_column_width=90))
        out["drafters"] = drafters
    Path(text_path).write_text("\n".join(lines) + "\n")
    return out


def run_profile(out: Path, max_tokens: int, dry: bool, parts: str = "sweep,kernels") -> int:
    out.mkdir(parents=True, exist_ok=True)
    model_dir = drawn_model(out, dry)
    env = {**os.environ, "PYTHONPATH": str(AB / "new")}
    proc = subprocess.run([sys.executable, __file__, "profile-child", str(model_dir), str(AB / "data"), str(max_tokens),
                           str(out / "profile.txt"), "--parts", parts] + (["--dry-run"] if dry else []),
                          env=env, capture_output=True, text=True, cwd="/")
    if proc.returncode != 0:
        print(proc.stderr[-3000:], file=sys.stderr)
        return 1
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    (out / "profile.json").write_text(json.dumps(r, indent=2) + "\n")
    for k, v in r.get("sweep", {}).items():
        print(f"{k}: " + ", ".join(f"{t:.0f} tok/s ({m:.2f} ms/step)" for t, m in zip(v["tok_s"], v["median_step_ms"])))
    for k, v in {**r.get("kernels", {}), **r.get("drafters", {})}.items():
        print(f"{k}: wall {v['wall_ms_per_step']:.3f} ms/step, device {v['device_ms_per_step']:.3f} ms/step, "
              f"{v['kernels_per_step']:.0f} kernels/step; top: " + "; ".join(
                  f"{t['name'][:40]} {t['us_per_step']:.0f} us" for t in v["top"][:6])
              + (f"; draft {v['draft_ms']:.2f} ms, verify {v['verify_ms']:.2f} ms per step" if "draft_ms" in v else ""))
    return 0


def run(out: Path, max_tokens: int, dry: bool, rounds: int, variants: list[str] = ("old", "new")) -> int:
    out.mkdir(parents=True, exist_ok=True)
    model_dir = drawn_model(out, dry)
    results = []
    for variant in list(variants) * rounds:
        tree, *assignments = variant.split("+")   # "new+NAME=VALUE": the new tree with NAME=VALUE set
        env = {**os.environ, "PYTHONPATH": str(AB / tree), **dict(a.split("=", 1) for a in assignments)}
        proc = subprocess.run([sys.executable, __file__, "measure", str(model_dir), str(AB / "data"), str(max_tokens)]
                              + (["--dry-run"] if dry else []), env=env, capture_output=True, text=True, cwd="/")
        if proc.returncode != 0:
            print(proc.stderr[-3000:], file=sys.stderr)
            results.append({"variant": variant, "error": proc.stderr[-500:]})
            continue
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        r["variant"] = variant
        results.append(r)
        print(f"{variant}: " + "  ".join(f"{k} {v['tok_s']:.0f} tok/s ({v['median_step_ms']:.2f} ms/step)"
                                          for k, v in r.items() if isinstance(v, dict) and "tok_s" in v), flush=True)
    old_rev = (AB / "old.txt").read_text().strip() if (AB / "old.txt").is_file() else None
    (out / "ab.json").write_text(json.dumps({"old": old_rev, "max_tokens": max_tokens, "dry_run": dry,
                                             "results": results}, indent=2) + "\n")
    return 0 if all("error" not in r for r in results) else 1


def main() -> int:
    global AB
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack")
    p.add_argument("--old", required=True, help="the revision to compare this working tree with")
    p.add_argument("--model-dir", type=Path, help="a model folder whose config and tokenizer to use "
                                                 "(default: the default model, converted)")
    r = sub.add_parser("run")
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--max-tokens", type=int, default=128)
    r.add_argument("--rounds", type=int, default=2, help="the variants repeated this many times (default: 2)")
    r.add_argument("--variants", default="old,new", help="comma-separated: old, new, or either with environment "
                   "settings of its own, as new+NAME=VALUE[+NAME=VALUE] (default: %(default)s)")
    r.add_argument("--dry-run", action="store_true")
    for parser in (p, r):
        parser.add_argument("--ab", type=Path, default=AB, help=f"the packed folder (default: {AB})")
    f = sub.add_parser("profile")
    f.add_argument("--out", type=Path, required=True)
    f.add_argument("--max-tokens", type=int, default=128)
    f.add_argument("--dry-run", action="store_true")
    f.add_argument("--ab", type=Path, default=AB, help=f"the packed folder (default: {AB})")
    f.add_argument("--parts", default="sweep,kernels", help=f"comma-separated, of {', '.join(PROFILE_PARTS)} "
                   "(drafters: ngram, eagle and draft_model under the fixed budget at batch 1; default: %(default)s)")
    c = sub.add_parser("profile-child")
    for name in ("model_dir", "data_dir"):
        c.add_argument(name)
    c.add_argument("max_tokens", type=int)
    c.add_argument("text_path")
    c.add_argument("--parts", default="sweep,kernels")
    c.add_argument("--dry-run", action="store_true")
    m = sub.add_parser("measure")
    m.add_argument("model_dir")
    m.add_argument("data_dir")
    m.add_argument("max_tokens", type=int)
    m.add_argument("--dry-run", action="store_true")
    args = ap.parse_args()
    AB = getattr(args, "ab", AB).resolve()
    if args.cmd == "pack":
        pack(args.old, args.model_dir)
        return 0
    if args.cmd == "run":
        return run(args.out, 8 if args.dry_run else args.max_tokens, args.dry_run, args.rounds,
                   args.variants.split(","))
    if args.cmd == "profile":
        return run_profile(args.out, 8 if args.dry_run else args.max_tokens, args.dry_run, args.parts)
    if args.cmd == "profile-child":
        print(json.dumps(profile(args.model_dir, args.data_dir, args.max_tokens, args.dry_run, args.text_path,
                                 tuple(args.parts.split(",")))))
        return 0
    print(json.dumps(measure(args.model_dir, args.data_dir, args.max_tokens, args.dry_run)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
