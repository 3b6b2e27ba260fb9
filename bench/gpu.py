"""The GPU benchmark: everything the H100/H200 bring-up measures, in one run under a time budget.

    python -m specserve.bench.gpu [--out-dir bench/results] [--budget 360] [--drafters ...] [--dry-run]
    (or: specserve bench gpu ...)

In order, each step inside the budget (a step that fails is recorded in `errors` and the run goes
on; the JSON is rewritten after every step, so a run cut short keeps what it measured):

0. `fused_kernels`: the decoder layer's fused kernels (kernels/fused.py) against their references
   on this machine; beyond a bf16 rounding or two the model runs without them.
1. `floor_ms_per_token`: the target's weight bytes over the device's measured copy bandwidth
   (bytes read and written by one large device-to-device copy), the time one decode step needs
   just to read the weights once.
2. `kernel_us`: the Triton tree-attention kernel against the torch reference (the SDPA path the
   engine runs on the CPU) on verification shapes: B sequences of N tree nodes over a context of
   C keys, bf16 (the engine's dtype), CUDA-event timed, median of repeats. `verify_us`: greedy
   verification of T trees of N nodes, the Triton kernel against the torch reference, host wall
   time per call with its sync (what a tree step pays in launches).
3. `plain_tok_s`: plain decoding of B prompts together (closed batch, exactly --max-tokens new
   tokens each, EOS ignored) for B in --batch-sizes; with CUDA graphs, and without them
   (`plain_eager_tok_s`, an engine with enforce_eager from the same load).
4. `speedup`, `tau`, `greedy_mismatch_rate`: every drafter against plain decoding at batch 1 (the
   prompts one at a time) and at batch 32 (one closed batch), greedy, on MT-Bench, HumanEval and
   GSM8K prompts in turn; plain decoding runs before the first drafter and after every
   --anchor-every drafters, and each drafter is compared with the mean of the plain runs around
   it. τ = generated tokens / target forwards; the mismatch rate is the share of prompts whose
   output differs from plain decoding's (bf16: a near-tie may flip under a different batch shape;
   fp32 must give 0). Under the goodput draft policy (the served default), then again under the
   fixed budget, every sequence drafting its full tree every step (`speedup_fixed`, `tau_fixed`:
   what the drafters accept on this target, and what their trees cost here).
5. `host_profile`: batch-1 decodes (plain, ngram, eagle) under cProfile, the functions with the most
   host time per step (the listing in OUT/host_profile.txt).
6. `hf_tok_s`: transformers `generate` on the batch-1 prompts, eager, then with a static cache and
   `torch.compile` when the budget allows (`hf_mode` says which figure is reported).

Throughout, `triton_compiles` counts Triton's JIT compiles per step above ({step: {kernel: n}}, with
the cache keys of the first few): a compile after the engine's start-up warm-up is a served
step that waited for a compiler. The fixed-budget pass also records each drafter's host time per
draft step in proposing (`draft_ms_fixed`) and in verifying (`verify_ms_fixed`).

Writes OUT/gpu_<device>.md and OUT/gpu_summary.json. `--dry-run`: the same sequence on the CPU
with tiny sizes (fp32, two drafters, 8 tokens), so that the script is exercised where no GPU is;
under TRITON_INTERPRET=1 the decode steps replay through the graphs' eager stand-in.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import sys
import time
import traceback
from datetime import datetime
from pathlib import Path

DEFAULT_OUT_DIR = Path(__file__).resolve().parent / "results"
DATASETS = ("mt_bench", "humaneval", "gsm8k")
PLAIN = "none"
# a truncated target of 4 layers drafts cheaply (as `bench spec`)
DRAFTER_OPTIONS = {"draft_model": {"draft_layers": 4}}
# verification shapes of the kernel timings: (sequences, tree nodes each, context keys)
KERNEL_SHAPES = ((1, 8, 512), (32, 8, 512), (32, 1, 512), (64, 16, 1024))
FUSED_TOLERANCE = 0.1      # largest |fused - reference| on N(0, 1) inputs (a bf16 rounding step is 2^-8 relative)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="specserve bench gpu", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default", help="the target model (default: %(default)s)")
    ap.add_argument("--drafters", nargs="+", default=None, metavar="NAME",
                    help="drafters to measure (default: every registered drafter, and auto)")
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8, 32, 64], metavar="B",
                    help="plain decoding batch sizes (default: %(default)s)")
    ap.add_argument("--spec-batch-sizes", nargs="+", type=int, default=[1, 32], metavar="B",
                    help="batch sizes of the drafter runs (default: %(default)s)")
    ap.add_argument("--prompts-at-1", type=int, default=2, metavar="N",
                    help="prompts per dataset of the batch-1 drafter runs (default: %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=128, metavar="N", help="new tokens per prompt (default: %(default)s)")
    ap.add_argument("--anchor-every", type=int, default=3, metavar="K",
                    help="plain decoding again after every K drafters (default: %(default)s)")
    ap.add_argument("--budget", type=float, default=360.0, metavar="SECONDS",
                    help="wall-clock budget; steps that would start past it are skipped (default: %(default)s)")
    ap.add_argument("--device", default="auto", help="cuda, cuda:N, cpu or auto (default: %(default)s)")
    ap.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                    help="auto: bfloat16 on CUDA, float32 on the CPU (default: %(default)s)")
    ap.add_argument("--no-graphs", dest="graphs", action="store_false", help="measure without CUDA graphs only")
    ap.add_argument("--no-probe", dest="probe", action="store_false",
                    help="take the fastest configuration (graphs with trees, fused kernels) without probing it "
                         "in a child first (when the gpu tests of this tree passed on this machine)")
    ap.add_argument("--no-hf", dest="hf", action="store_false", help="skip the transformers baseline")
    ap.add_argument("--no-hf-compile", dest="hf_compile", action="store_false",
                    help="transformers eager only (no static cache + torch.compile)")
    ap.add_argument("--out-dir", default=str(DEFAULT_OUT_DIR), metavar="DIR",
                    help="where gpu_<device>.md and gpu_summary.json go (default: bench/results)")
    ap.add_argument("--dry-run", action="store_true",
                    help="the same steps on the CPU with tiny sizes (checks the script, measures nothing useful)")
    return ap


def device_slug(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'h100'; anything else -> its words joined by '-', lower case."""
    m = re.search(r"\b([A-Z]\d{2,4}[A-Z]?)\b", name)
    return m.group(1).lower() if m else re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "device"


class Budget:
    def __init__(self, seconds: float):
        self.t0 = time.perf_counter()
        self.seconds = seconds

    def left(self) -> float:
        return self.seconds - (time.perf_counter() - self.t0)


# ---- measurements -------------------------------------------------------------------------------


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_us(fn, device, repeats: int = 20) -> float:
    """Median microseconds of `fn()` (CUDA events on a GPU, perf_counter on the CPU), after a warm-up."""
    import torch

    fn()
    sync(device)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


class TritonCompiles:
    """Triton's JIT compiles while installed, by phase: `counts` {phase: {kernel: n}} and `samples`
    {kernel: [cache keys of its first compiles]}, so that a compile in a served step can be
    traced to the argument whose value changed its specialisation. Records nothing where Triton has
    no runtime hook (the interpreter, versions without `triton.knobs`)."""

    MAX_SAMPLES = 4

    def __init__(self):
        self.phase = "start"
        self.counts: dict[str, dict[str, int]] = {}
        self.samples: dict[str, list[str]] = {}
        self._runtime = self._previous = None

    def install(self) -> "TritonCompiles":
        try:
            from triton import knobs
            runtime = knobs.runtime
            self._previous = runtime.jit_cache_hook
        except (ImportError, AttributeError):
            return self
        runtime.jit_cache_hook, self._runtime = self._hook, runtime
        return self

    @property
    def active(self) -> bool:
        """Whether Triton calls the hook (False: this Triton has no `knobs.runtime.jit_cache_hook`)."""
        return self._runtime is not None

    def uninstall(self) -> None:
        if self._runtime is not None:
            self._runtime.jit_cache_hook, self._runtime = self._previous, None

    def _hook(self, **kwargs):
        """Triton calls it before compiling a kernel for a key it has not seen; None lets it compile."""
        fn = kwargs.get("fn")
        name = getattr(fn, "name", None) or str(fn)
        by_kernel = self.counts.setdefault(self.phase, {})
        by_kernel[name] = by_kernel.get(name, 0) + 1
        seen = self.samples.setdefault(name, [])
        if len(seen) < self.MAX_SAMPLES:    # the cache key: each argument's type and specialisation
            seen.append(str((kwargs.get("compile") or {}).get("key", kwargs.get("repr", "")))[:2000])
        return self._previous(**kwargs) if self._previous else None

    def summary(self) -> dict:
        return {"counts": self.counts, "samples": self.samples}


def measure_floor(model, device) -> dict:
    """Weight bytes, copy bandwidth (bytes read + written per second) and their ratio in ms."""
    import torch

    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    n = (1 << 28) if device.type == "cuda" else (1 << 22)      # 512 MiB (bf16 elements x 2 bytes) / 8 MiB
    src = torch.empty(n, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    us = time_us(lambda: dst.copy_(src), device, repeats=10)
    bandwidth = 2 * src.numel() * src.element_size() / (us * 1e-6)
    del src, dst
    return {"weight_bytes": weight_bytes, "copy_bytes_per_s": bandwidth,
            "floor_ms_per_token": weight_bytes / bandwidth * 1e3}


def measure_kernels(cfg, dtype, device, shapes, block_size: int = 16) -> dict:
    """Per shape "B{seqs}xN{nodes}xC{ctx}": {"triton_us", "reference_us"} of one layer's attention."""
    import torch

    from specserve.engine.attention import build_attn_metadata, paged_attention_reference
    from specserve.engine.tree import ancestor_mask
    from specserve.kernels.tree_attention import tree_attention

    out = {}
    g = torch.Generator().manual_seed(0)
    for seqs, nodes, ctx in shapes:
        blocks_per = -(-ctx // block_size)
        slots = seqs * blocks_per * block_size
        k_cache = torch.randn(slots, cfg.num_kv_heads, cfg.head_dim, generator=g).to(device=device, dtype=dtype)
        v_cache = torch.randn(slots, cfg.num_kv_heads, cfg.head_dim, generator=g).to(device=device, dtype=dtype)
        q = torch.randn(seqs * nodes, cfg.num_heads, cfg.head_dim, generator=g).to(device=device, dtype=dtype)
        # a binary tree of `nodes` nodes (node i hangs under (i - 1) // 2), the same for every sequence
        parents = [-1] + [(i - 1) // 2 for i in range(1, nodes)]
        masks = [ancestor_mask(parents, list(range(nodes))) if nodes > 1 else None] * seqs
        tables = [list(range(b * blocks_per, (b + 1) * blocks_per)) for b in range(seqs)]
        _, meta = build_attn_metadata(tables, block_size, [ctx - nodes] * seqs, [nodes] * seqs, masks, device)
        packed = meta.packed()
        scale = cfg.head_dim ** -0.5
        tri = time_us(lambda: tree_attention(q, k_cache, v_cache, packed, scale), device)
        ref = time_us(lambda: paged_attention_reference(q, k_cache, v_cache, meta, scale), device, repeats=5)
        out[f"B{seqs}xN{nodes}xC{ctx}"] = {"triton_us": tri, "reference_us": ref}
    return out


def measure_verify(device, shapes=((1, 8), (32, 8))) -> dict:
    """Per shape "T{trees}xN{nodes}": {"triton_us", "reference_us"}, the host's wall time of one
    greedy verification (launches included, then a sync: what a tree step pays), the Triton kernel
    against the torch reference, on binary trees whose drafts are half right."""
    import torch

    from specserve.engine import verify
    from specserve.engine.tree import TokenTree, pack_trees
    from specserve.kernels.verify_greedy import verify_greedy_stacked

    def wall(fn, repeats: int = 50) -> float:
        fn()
        sync(device)
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        sync(device)
        return (time.perf_counter() - t0) / repeats * 1e6

    out = {}
    for trees, nodes in shapes:
        parents = [-1] + [(i - 1) // 2 for i in range(1, nodes)]
        packed = pack_trees([TokenTree([i % 5 for i in range(nodes)], parents)] * trees, device)
        argmax = (packed.tokens + (torch.arange(nodes, device=device) % 2)) % 5
        kernel = wall(lambda: verify_greedy_stacked(packed.tokens, packed.parents, packed.depths, packed.mask,
                                                    packed.num_nodes, packed.num_roots, argmax, packed.max_depth,
                                                    packed.max_next_roots))
        ref = wall(lambda: verify.verify_greedy_batched_reference(packed, argmax).stacked())
        out[f"T{trees}xN{nodes}"] = {"triton_us": kernel, "reference_us": ref}
    return out


def decode(engine, prompts, max_tokens: int, drafter: str, tag: str):
    """`prompts` decoded together, greedy, exactly `max_tokens` each: (tokens, seconds, outputs, τ)."""
    from specserve.bench.spec_decode import run_engine_batch
    from specserve.engine.sampling_params import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True) for _ in prompts]
    n, secs, outs, specs = run_engine_batch(engine, prompts, params, drafter, tag)
    sync(engine.device)
    forwards = sum(s.num_target_forwards for s in specs if s is not None)
    generated = sum(s.num_generated_tokens for s in specs if s is not None)
    return n, secs, outs, (generated / forwards if forwards else None)


# configurations the engine can run on CUDA, fastest first: (label, CUDA graphs, tree graphs, fused kernels)
CONFIGS = (("graphs+fused", True, True, True), ("decode graphs+fused", True, False, True),
           ("decode graphs", True, False, False), ("fused", False, False, True))


def probe(model: str, device: str, graphs: bool, trees: bool, fused_on: bool, prompts: list[list[int]]) -> dict:
    """In this process: greedy tokens of an engine with this configuration against an eager engine
    without fused kernels, fp32, plain decoding and two drafters (trees through the graphs)."""
    from specserve.engine import cuda_graphs
    from specserve.engine.config import EngineConfig
    from specserve.engine.core import LLMEngine
    from specserve.engine.loader import load_model
    from specserve.kernels import fused

    cuda_graphs.TREES = trees
    loaded = load_model(model)
    layers = max(1, min(4, loaded.hf_config.num_hidden_layers // 2))
    outputs = {}
    for label, eager, enabled in (("reference", True, False), ("probe", not graphs, fused_on)):
        fused.ENABLED = enabled
        e = LLMEngine(EngineConfig(model=model, device=device, dtype="float32", max_num_seqs=4, max_model_len=1024,
                                   drafters=(PLAIN, "ngram", "draft_model"), draft_budget="fixed", quantization="none",
                                   drafter_options={"draft_model": {"draft_layers": layers}}, enforce_eager=eager),
                      loaded=loaded)
        outputs[label] = {d: decode(e, prompts, 32, d, f"probe-{d}")[2] for d in (PLAIN, "ngram", "draft_model")}
        del e
    ref, got = outputs["reference"], outputs["probe"]
    return {"ok": got == ref, "equal": {d: got[d] == ref[d] for d in ref}}


def probe_configs(args, prompts) -> dict:
    """Each of `CONFIGS` in a child process of its own (a fault on the device ends only the child):
    {label: {"ok", "equal"} or {"ok": False, "error"}}."""
    import subprocess

    out = {}
    for label, graphs, trees, fused_on in CONFIGS:
        cmd = [sys.executable, "-m", "specserve.bench.gpu", "--probe", json.dumps(
            {"model": args.model, "device": args.device if args.device != "auto" else "cuda", "graphs": graphs,
             "trees": trees, "fused": fused_on, "prompts": prompts})]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
            lines = proc.stdout.strip().splitlines()
            out[label] = json.loads(lines[-1]) if proc.returncode == 0 and lines else \
                {"ok": False, "error": f"exit {proc.returncode}: {proc.stderr.strip()[-600:]}"}
        except subprocess.TimeoutExpired:
            out[label] = {"ok": False, "error": "timed out"}
        print(f"bench gpu: probe {label}: {out[label].get('ok')}", file=sys.stderr, flush=True)
        if out[label].get("ok"):
            break
    return out


def check_fused(device, dtype) -> dict:
    """The layers' fused kernels against their references on this machine (`kernels.fused.max_errors`);
    above FUSED_TOLERANCE the model runs without them (and the summary says so)."""
    from specserve.kernels import fused

    errors = fused.max_errors(device, dtype)
    fused.ENABLED = max(errors.values()) <= FUSED_TOLERANCE
    return {"enabled": fused.ENABLED, "max_errors": errors}


def measure_anatomy(engine, prompt, max_tokens: int = 64) -> dict:
    """Where a batch-1 decode step's time goes: the whole engine step (wall, median over a decode
    of `max_tokens` tokens), the captured forward's replay and the same forward run eagerly (GPU time);
    and the prompt's prefill step alone (wall; a chain graph where its length has one)."""
    import torch

    from specserve.engine.sampling_params import SamplingParams

    engine.add_request("anatomy", prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    walls = []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        sync(engine.device)
        walls.append(time.perf_counter() - t0)
    graphs = engine.runner.graphs
    meta = graphs.metas[(1, 1)]
    with torch.inference_mode():
        repeats = 20 if engine.device.type == "cuda" else 2
        replay = time_us(graphs.replays[(1, 1)], engine.device, repeats)
        eager = time_us(lambda: engine.model(graphs.input_ids[:1], graphs.positions[:1], engine.cache, meta),
                        engine.device, repeats)
    return {"step_ms": statistics.median(walls[2:] or walls) * 1e3, "graph_replay_ms": replay / 1e3,
            "eager_forward_ms": eager / 1e3, "prefill_step_ms": walls[0] * 1e3, "prefill_tokens": len(prompt)}


def profile_host(engine, prompt, drafters, max_tokens: int, text_path: Path | None = None) -> dict:
    """Where the host's time goes in batch-1 steps: `prompt` decoded greedily under cProfile, once
    plainly and once with each of `drafters`; per run the wall time per step and the functions with
    the most time of their own (ms per step). The full listing goes to `text_path`."""
    import cProfile
    import io
    import pstats

    from specserve.engine.sampling_params import SamplingParams

    out, text = {}, io.StringIO()
    for drafter in (PLAIN, *drafters):
        engine.add_request(f"profile-{drafter}", prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                       ignore_eos=True), drafter=drafter)
        prof, steps, t0 = cProfile.Profile(), 0, time.perf_counter()
        prof.enable()
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        prof.disable()
        wall = time.perf_counter() - t0
        stats = pstats.Stats(prof, stream=text)
        text.write(f"\n==== {drafter}: {steps} steps, {wall / steps * 1e3:.3f} ms per step (profiled)\n")
        stats.sort_stats("tottime").print_stats(40)
        stats.sort_stats("cumtime").print_stats(40)
        rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:15]
        out[drafter] = {"steps": steps, "ms_per_step": wall / steps * 1e3,
                        "top_tottime_ms_per_step": [[f"{Path(f).name}:{line}({fn})", tt / steps * 1e3, ct / steps * 1e3]
                                                    for (f, line, fn), (_, _, tt, ct, _) in rows]}
    if text_path is not None:
        text_path.write_text(text.getvalue())
    return out


def measure_plain(engine, pool, batch_sizes, max_tokens: int, budget: Budget, min_left: float) -> dict:
    """{B: tok/s} of plain decoding, B prompts in one closed batch, after a short warm-up at B."""
    out = {}
    for b in batch_sizes:
        if budget.left() < min_left:
            break
        prompts = [pool[i % len(pool)] for i in range(b)]
        decode(engine, prompts, 4, PLAIN, f"warm-{b}")
        n, secs, _, _ = decode(engine, prompts, max_tokens, PLAIN, f"plain-{b}")
        out[str(b)] = n / secs
    return out


def _draft_counts(engine, drafter: str) -> dict[str, int]:
    """Draft steps, drafted and accepted tokens, and the host seconds spent proposing and verifying
    so far of `drafter` (for auto: of the drafters it chooses among, each counting the trees it
    proposed)."""
    names = engine.auto_drafters if drafter == "auto" else (drafter,)
    stats = [engine.drafter_stats[n] for n in names]
    return {"draft_steps": sum(s.num_steps for s in stats), "draft_tokens": sum(s.num_draft_tokens for s in stats),
            "accepted_tokens": sum(s.num_accepted_tokens for s in stats),
            "draft_s": sum(s.draft_time_s for s in stats), "verify_s": sum(s.verify_time_s for s in stats)}


def measure_drafters(engine, drafters, batches, max_tokens: int, anchor_every: int, budget: Budget,
                     min_left: float) -> dict:
    """Per drafter: {"tok_s", "speedup", "tau", "mismatch_rate"} over `batches` (lists of prompts,
    each decoded together), against the mean of the plain runs just before and after it."""
    def run(drafter: str, tag: str):
        n = secs = 0.0
        outs, taus = [], []
        for k, batch in enumerate(batches):
            tokens, s, o, tau = decode(engine, batch, max_tokens, drafter, f"{tag}-{k}")
            n, secs = n + tokens, secs + s
            outs += o
            taus.append((tau or 1.0) * tokens)
        return n / secs, outs, sum(taus) / n

    for d in drafters:                                   # warm-up: each method once, a few tokens
        decode(engine, batches[0], 4, d, f"warm-{d}")
    decode(engine, batches[0], 4, PLAIN, "warm-plain")
    plain_rate, plain_outs, _ = run(PLAIN, "plain-0")
    anchors = [plain_rate]
    pending: list[tuple[str, float, list, float]] = []
    results = {}
    drafted: dict[str, dict] = {}     # per drafter: draft steps, drafted and accepted tokens in its runs

    def settle():
        ref = statistics.mean(anchors[-2:])
        for name, rate, outs, tau in pending:
            bad = sum(a != b for a, b in zip(outs, plain_outs))
            results[name] = {"tok_s": rate, "speedup": rate / ref, "tau": tau, "mismatch_rate": bad / len(outs),
                             **drafted.get(name, {})}
        pending.clear()

    for i, d in enumerate(drafters):
        if budget.left() < min_left:
            results[d] = {"error": "skipped: out of time budget"}
            continue
        try:
            before = _draft_counts(engine, d)
            pending.append((d, *run(d, f"{d}")))
            drafted[d] = {k: v - before[k] for k, v in _draft_counts(engine, d).items()}
        except Exception as exc:   # a drafter that fails is reported, the others still run
            results[d] = {"error": f"{type(exc).__name__}: {exc}"}
        if len(pending) >= anchor_every or i == len(drafters) - 1:
            anchors.append(run(PLAIN, f"plain-{i}")[0])
            settle()
    if pending:
        settle()
    results[PLAIN] = {"tok_s": statistics.mean(anchors), "anchors": anchors}
    return results


def _per_step_ms(result: dict, key: str) -> float | None:
    """Milliseconds of `key` (seconds summed over the run) per draft step; None without draft steps."""
    steps = result.get("draft_steps")
    return result[key] / steps * 1e3 if steps and key in result else None


def measure_hf(loaded, prompts, max_tokens: int, device, dtype, compile_ok: bool, budget: Budget) -> dict:
    """transformers `generate` on `prompts` one at a time: eager, then static cache + torch.compile."""
    from specserve.bench.common import build_hf_model, run_hf

    pad = loaded.eos_token_ids[0] if loaded.eos_token_ids else 0
    hf = build_hf_model(loaded, device, dtype)
    run_hf(hf, prompts[:1], 4, pad_token_id=pad)
    n, secs, _ = run_hf(hf, prompts, max_tokens, pad_token_id=pad)
    out = {"eager_tok_s": n / secs}
    if compile_ok and device.type == "cuda" and budget.left() > 150:
        import torch

        try:   # generate compiles the forward itself for a static cache on CUDA (transformers >= 4.48)
            torch.compiler.reset()
            hf.generation_config.cache_implementation = "static"
            run_hf(hf, prompts[:1], 8, pad_token_id=pad)     # compiles
            n, secs, _ = run_hf(hf, prompts, max_tokens, pad_token_id=pad)
            out["compiled_tok_s"] = n / secs
        except Exception as exc:
            out["compile_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    return out


# ---- the run ------------------------------------------------------------------------------------


def run(args: argparse.Namespace, argv: list[str]) -> int:
    import torch
    import transformers

    from specserve.bench.common import chat_ids, machine_info
    from specserve.bench.datasets import load_prompts
    from specserve.drafters.base import available_drafters
    from specserve.engine.config import EngineConfig
    from specserve.engine.core import LLMEngine
    from specserve.engine.loader import load_model

    budget = Budget(args.budget)
    if args.dry_run:
        args.device, args.dtype = "cpu", "float32"
        args.batch_sizes, args.spec_batch_sizes = [1, 2], [1, 2]
        args.prompts_at_1, args.max_tokens, args.hf_compile = 1, 6, False
        args.drafters = args.drafters or ["ngram", "eagle", "auto"]
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    dtype_name = args.dtype if args.dtype != "auto" else ("bfloat16" if device.type == "cuda" else "float32")
    dtype = getattr(torch, dtype_name)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    slug = "dry-run" if args.dry_run else device_slug(name)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / "gpu_summary.json", out_dir / f"gpu_{slug}.md"
    now = datetime.now().astimezone()
    summary: dict = {
        "benchmark": "gpu", "device": name, "date": now.date().isoformat(), "datetime": now.isoformat(timespec="seconds"),
        "dtype": dtype_name, "dry_run": args.dry_run,
        "plain_tok_s": {}, "plain_eager_tok_s": {}, "hf_tok_s": {}, "hf_mode": None,
        "speedup": {}, "tau": {}, "greedy_mismatch_rate": {}, "drafter_tok_s": {},
        "kernel_us": {}, "floor_ms_per_token": None,
        "meta": {"machine": machine_info(device), "torch": torch.__version__, "transformers": transformers.__version__,
                 "invocation": shlex.join(["specserve", "bench", "gpu", *argv]), "max_tokens": args.max_tokens,
                 "budget_s": args.budget},
        "errors": [], "seconds": {}, "triton_compiles": {},
    }
    compiles = TritonCompiles().install()

    def save():
        summary["triton_compiles"] = compiles.summary()
        summary["meta"]["elapsed_s"] = round(time.perf_counter() - budget.t0, 1)
        json_path.write_text(json.dumps(summary, indent=2) + "\n")
        md_path.write_text(markdown(summary))

    def step(label: str, fn, min_left: float = 0.0):
        if budget.left() < min_left:
            summary["errors"].append(f"{label}: skipped, {budget.left():.0f} s of the budget left")
            save()
            return None
        t0 = time.perf_counter()
        compiles.phase = label
        print(f"bench gpu: {label} ...", file=sys.stderr, flush=True)
        try:
            return fn()
        except Exception as exc:
            summary["errors"].append(f"{label}: {type(exc).__name__}: {exc}")
            traceback.print_exc()
            return None
        finally:
            summary["seconds"][label] = round(time.perf_counter() - t0, 1)
            save()

    loaded = load_model(args.model)
    drafters = args.drafters or [*available_drafters(), "auto"]   # auto: the server's default choice among them
    options = {d: o for d, o in DRAFTER_OPTIONS.items() if d in drafters}
    if "draft_model" in options:          # a truncated target: fewer layers than the target has
        layers = loaded.hf_config.num_hidden_layers
        options["draft_model"] = {"draft_layers": min(options["draft_model"]["draft_layers"], max(1, layers - 1))}
    pools = {ds: [chat_ids(loaded.tokenizer, t) for t in load_prompts(ds, 32)] for ds in DATASETS}
    mixed = [p for group in zip(*pools.values()) for p in group]      # mt_bench, humaneval, gsm8k, ...
    at_1 = [p for ps in pools.values() for p in ps[:args.prompts_at_1]]
    if args.dry_run:          # one prompt: the steps are what is checked, not the figures
        at_1 = at_1[:1]
    longest = max(len(p) for p in mixed)
    max_len = -(-(longest + args.max_tokens + 64) // 256) * 256
    max_seqs = max(args.batch_sizes + args.spec_batch_sizes)

    def engine(drafter_names, eager: bool, policy: str = "goodput"):
        return LLMEngine(EngineConfig(
            model=args.model, device=str(device), dtype=dtype_name, max_num_seqs=max_seqs,
            max_model_len=max_len, max_num_batched_tokens=max(2048, max_seqs * 16),
            num_kv_blocks=max_seqs * (max_len // 16) + 64, drafters=(PLAIN, *drafter_names),
            drafter_options={d: o for d, o in options.items() if d in drafter_names},
            max_draft_tokens_per_step=max(64, 8 * max_seqs), enforce_eager=eager, draft_budget=policy,
            quantization="none"),
            loaded=loaded)

    if device.type == "cuda" or os.environ.get("SPECSERVE_FUSED") == "1":
        summary["fused_kernels"] = step("fused kernels", lambda: check_fused(device, dtype)) or {"enabled": False}
    if device.type == "cuda" and args.graphs:
        # graphs and fused kernels are used only in a configuration whose greedy tokens were the eager,
        # unfused engine's in a child process (a device fault there does not end this run)
        if args.probe:
            probes = step("probe configurations", lambda: probe_configs(args, [p[:48] for p in mixed[:3]])) or {}
        else:
            probes = {CONFIGS[0][0]: {"ok": True, "equal": "not probed (--no-probe)"}}
        summary["probes"] = probes
        passed = next((c for c in CONFIGS if probes.get(c[0], {}).get("ok")), ("eager", False, False, False))
        from specserve.engine import cuda_graphs
        from specserve.kernels import fused
        args.graphs, cuda_graphs.TREES = passed[1], passed[2]
        fused.ENABLED = fused.ENABLED and passed[3]
        summary.setdefault("fused_kernels", {})["enabled"] = fused.ENABLED
        summary["meta"]["configuration"] = passed[0]
    main_engine = step("load engine", lambda: engine(drafters, eager=not args.graphs))
    if main_engine is None and args.graphs:        # the graphs' capture failed? measure eagerly then
        main_engine = step("load engine, eager", lambda: engine(drafters, eager=True))
    if main_engine is None:                        # a drafter that does not load: find the ones that do
        drafters = [d for d in drafters if step(f"load {d} alone", lambda d=d: engine([d], eager=True)) is not None]
        main_engine = step("load engine, loadable drafters", lambda: engine(drafters, eager=True))
    if main_engine is None:
        compiles.uninstall()
        return 1
    if args.dry_run and os.environ.get("TRITON_INTERPRET") == "1":   # the graph path, through the CPU stand-in
        from specserve.engine.cuda_graphs import EagerReplay
        step("capture graphs (stand-in)", lambda: main_engine.capture_graphs(EagerReplay()))
    summary["meta"]["drafters"] = list(drafters)
    summary["meta"]["graphs"] = main_engine.runner.graphs is not None
    if summary["meta"]["graphs"]:
        summary["step_anatomy"] = step("step anatomy", lambda: measure_anatomy(main_engine, mixed[0], min(64, args.max_tokens))) or {}
    summary["host_profile"] = step("host profile", lambda: profile_host(
        main_engine, mixed[0], [d for d in ("ngram", "eagle") if d in drafters], min(64, args.max_tokens),
        out_dir / "host_profile.txt")) or {}

    floor = step("floor", lambda: measure_floor(main_engine.model, device))
    if floor:
        summary["floor_ms_per_token"] = floor.pop("floor_ms_per_token")
        summary["meta"].update(floor)
    kernels = step("kernels", lambda: measure_kernels(main_engine.model_config, dtype, device,
                                                      KERNEL_SHAPES[:1] if args.dry_run else KERNEL_SHAPES))
    summary["kernel_us"] = kernels or {}
    if device.type == "cuda" or os.environ.get("SPECSERVE_VERIFY") == "triton":
        summary["verify_us"] = step("verify kernel", lambda: measure_verify(device)) or {}
    summary["plain_tok_s"] = step("plain decoding", lambda: measure_plain(
        main_engine, mixed, args.batch_sizes, args.max_tokens, budget, 20)) or {}
    if summary["meta"]["graphs"]:
        eager = step("plain decoding, eager", lambda: engine((), eager=True), min_left=60)
        if eager is not None:
            summary["plain_eager_tok_s"] = step("plain decoding, eager", lambda: measure_plain(
                eager, mixed, args.batch_sizes, args.max_tokens, budget, 20)) or {}
            del eager
    fixed_engine = None
    for policy in ("goodput", "fixed"):     # the served default, then every tree verified (what drafters accept)
        suffix = "" if policy == "goodput" else "_fixed"
        if policy == "fixed":
            fixed_engine = step("load engine, fixed draft budget",
                                lambda: engine(drafters, eager=not summary["meta"]["graphs"], policy="fixed"),
                                min_left=90)
            if fixed_engine is None:
                break
        served = main_engine if policy == "goodput" else fixed_engine
        for b in args.spec_batch_sizes:
            batches = [[p] for p in at_1] if b == 1 else [mixed[:b]]
            res = step(f"drafters at batch {b}, {policy}", lambda: measure_drafters(
                served, drafters, batches, args.max_tokens, args.anchor_every, budget, 15), min_left=30) or {}
            for d, r in res.items():
                if d == PLAIN:
                    summary.setdefault("plain_anchor_tok_s" + suffix, {})[str(b)] = r["tok_s"]
                elif "error" in r:
                    summary["errors"].append(f"{d} at batch {b}, {policy}: {r['error']}")
                else:
                    for key, value in (("speedup", r["speedup"]), ("drafter_tok_s", r["tok_s"]), ("tau", r["tau"]),
                                       ("greedy_mismatch_rate", r["mismatch_rate"]),
                                       ("draft_steps", r.get("draft_steps")),
                                       ("draft_ms", _per_step_ms(r, "draft_s")),
                                       ("verify_ms", _per_step_ms(r, "verify_s"))):
                        summary.setdefault(key + suffix, {}).setdefault(d, {})[str(b)] = value
            save()
    del fixed_engine
    if args.hf:
        hf = step("transformers generate", lambda: measure_hf(loaded, at_1, args.max_tokens, device, dtype,
                                                              args.hf_compile, budget), min_left=30)
        if hf:
            summary["meta"]["hf"] = hf
            best = hf.get("compiled_tok_s")
            summary["hf_mode"] = "static cache + torch.compile" if best else "eager"
            summary["hf_tok_s"] = {"1": best or hf["eager_tok_s"]}
    save()
    compiles.uninstall()
    print(markdown(summary))
    print(f"wrote {json_path} and {md_path}", file=sys.stderr)
    return 0


# ---- reporting ----------------------------------------------------------------------------------


def _f(value, spec: str = ".1f") -> str:
    return "–" if value is None else format(value, spec)


def markdown(s: dict) -> str:
    m = s["meta"]
    lines = [f"## GPU bring-up: {s['device']}, {s['dtype']}, {s['date']}", "",
             f"`{m['invocation']}` — torch {m['torch']}, transformers {m['transformers']}, "
             f"{m['max_tokens']} new tokens per prompt, greedy; CUDA graphs: {m.get('graphs', '–')}"
             f"{' (dry run on the CPU: sizes are tiny, figures mean nothing)' if s.get('dry_run') else ''}.", ""]
    floor = s.get("floor_ms_per_token")
    plain1 = s["plain_tok_s"].get("1")
    if floor:
        gap = f"; plain decoding at batch 1 takes {1e3 / plain1:.2f} ms, {1e3 / plain1 / floor:.0f}× the floor" \
            if plain1 else ""
        lines += [f"Weight-read floor: {floor:.3f} ms per token ({m.get('weight_bytes', 0) / 1e6:.0f} MB of weights "
                  f"at {m.get('copy_bytes_per_s', 0) / 1e12:.2f} TB/s measured){gap}.", ""]
    fk = s.get("fused_kernels")
    if fk:
        lines += [f"Fused layer kernels: {'on' if fk.get('enabled') else 'off'}"
                  + (f" (largest difference from the torch references {max(fk['max_errors'].values()):.2g})"
                     if fk.get("max_errors") else "") + ".", ""]
    a = s.get("step_anatomy")
    if a:
        lines += [f"A batch-1 decode step: {a['step_ms']:.2f} ms in all (engine step, wall), of which the target's "
                  f"forward is {a['graph_replay_ms']:.2f} ms as a CUDA graph ({a['eager_forward_ms']:.2f} ms eagerly)."
                  + (f" The prompt's prefill ({a['prefill_tokens']} tokens, alone): {a['prefill_step_ms']:.2f} ms."
                     if "prefill_step_ms" in a else ""), ""]
    for d, p in (s.get("host_profile") or {}).items():
        top = ", ".join(f"{name} {own:.3f}" for name, own, _ in p["top_tottime_ms_per_step"][:5])
        lines += [f"Host profile, {d} at batch 1: {p['ms_per_step']:.2f} ms per step under cProfile; most own time "
                  f"(ms per step): {top}.", ""]
    sizes = sorted({*s["plain_tok_s"], *s["plain_eager_tok_s"]}, key=int)
    if sizes:
        lines += ["| plain decoding | " + " | ".join(f"batch {b}" for b in sizes) + " |",
                  "|---|" + "---:|" * len(sizes)]
        for label, key in (("tok/s", "plain_tok_s"), ("tok/s, eager (no graphs)", "plain_eager_tok_s")):
            if s[key]:
                lines.append(f"| {label} | " + " | ".join(_f(s[key].get(b), ".0f") for b in sizes) + " |")
        if s["hf_tok_s"]:
            lines.append(f"| transformers generate ({s['hf_mode']}) | {_f(s['hf_tok_s'].get('1'), '.0f')} |"
                         + " – |" * (len(sizes) - 1))
        lines.append("")
    spec_sizes = sorted({b for v in s["speedup"].values() for b in v}, key=int)
    if spec_sizes:
        head = " | ".join(f"speedup b{b} | τ b{b} | tok/s b{b} | mismatch b{b}" for b in spec_sizes)
        lines += [f"| drafter | {head} |", "|---|" + "---:|" * (4 * len(spec_sizes))]
        for d in sorted(s["speedup"], key=lambda d: -max(s["speedup"][d].values())):
            cells = []
            for b in spec_sizes:
                # drafted nothing (runs that record draft steps), or accepted nothing: the anchors' noise
                idle = s.get("draft_steps", {}).get(d, {}).get(b, 1) == 0 or s["tau"][d].get(b) == 1.0
                cells += [_f(s["speedup"][d].get(b), ".2f") + ("×†" if idle else "×") if b in s["speedup"][d] else "–",
                          _f(s["tau"][d].get(b), ".2f"), _f(s["drafter_tok_s"][d].get(b), ".0f"),
                          _f(s["greedy_mismatch_rate"][d].get(b), ".2f")]
            lines.append(f"| {d} | " + " | ".join(cells) + " |")
        anchors = s.get("plain_anchor_tok_s", {})
        lines += ["", "Plain decoding in those runs (mean of the anchors): "
                  + ", ".join(f"batch {b} {_f(v, '.0f')} tok/s" for b, v in anchors.items()) + "."]
        if any(v == 1.0 for t in s["tau"].values() for v in t.values()):
            lines += ["† τ 1.00: no draft token was accepted (the draft policy drafted nothing, or nothing it drafted "
                      "was accepted), so the speedup only shows how far the plain runs around it moved and what the "
                      "drafter's per-step work costs."]
        lines.append("")
    fixed = s.get("speedup_fixed") or {}
    if fixed:
        sizes_f = sorted({b for v in fixed.values() for b in v}, key=int)
        lines += ["With the fixed draft budget (every sequence drafts its full tree every step; host ms per draft "
                  "step proposing and verifying):", "",
                  "| drafter | " + " | ".join(f"speedup b{b} | τ b{b} | draft ms b{b} | verify ms b{b}"
                                             for b in sizes_f) + " |",
                  "|---|" + "---:|" * (4 * len(sizes_f))]
        for d in sorted(fixed, key=lambda d: -max(fixed[d].values())):
            cells = []
            for b in sizes_f:
                cells += [_f(fixed[d].get(b), ".2f") + "×" if b in fixed[d] else "–",
                          _f(s["tau_fixed"][d].get(b), ".2f"),
                          _f(s.get("draft_ms_fixed", {}).get(d, {}).get(b), ".2f"),
                          _f(s.get("verify_ms_fixed", {}).get(d, {}).get(b), ".2f")]
            lines.append(f"| {d} | " + " | ".join(cells) + " |")
        lines.append("")
    if s["kernel_us"]:
        lines += ["| attention, one layer (B seqs × N nodes × C keys) | Triton µs | torch reference µs |",
                  "|---|---:|---:|"]
        for shape, v in s["kernel_us"].items():
            lines.append(f"| {shape} | {_f(v['triton_us'])} | {_f(v['reference_us'])} |")
        lines.append("")
    if s.get("verify_us"):
        lines += ["| greedy verification (T trees × N nodes), host µs per call with its sync | Triton | "
                  "torch reference |", "|---|---:|---:|"]
        for shape, v in s["verify_us"].items():
            lines.append(f"| {shape} | {_f(v['triton_us'])} | {_f(v['reference_us'])} |")
        lines.append("")
    counts = (s.get("triton_compiles") or {}).get("counts") or {}
    if counts:
        per_phase = (f"{phase}: " + ", ".join(f"{k} {n}" for k, n in sorted(by.items()))
                     for phase, by in counts.items())
        lines += ["Triton compiles per step of this run: " + "; ".join(per_phase) + ".", ""]
    if s["errors"]:
        lines += ["Errors and skipped steps:", ""] + [f"- {e}" for e in s["errors"]] + [""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--probe"]:          # a child of `probe_configs`
        spec = json.loads(argv[1])
        print(json.dumps(probe(spec["model"], spec["device"], spec["graphs"], spec["trees"], spec["fused"],
                                spec["prompts"])))
        return 0
    return run(build_parser().parse_args(argv), argv)


if __name__ == "__main__":
    sys.exit(main())
