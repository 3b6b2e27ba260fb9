"""Plain helpers shared by the engine and drafter tests (fixtures live in tests/conftest.py).

Test modules import them as ``from helpers import ...``: pytest puts this folder on ``sys.path``
when it loads tests/conftest.py (the default "prepend" import mode; the folder is no package).

* Running an `LLMEngine`: `make_llm_engine(model_dir, drafters, drafter_options, **EngineConfig overrides)`
  builds a small fp32 CPU engine; `run_requests(engine, prompts, params)` adds the prompts as requests
  ``r0``, ``r1``, ... (one every other step when staggered, else one per step), steps the engine until
  everything finished and returns request id -> generated token ids.
* Sampling losslessness: `exact_first_two_law` is the target's exact joint law of the first two
  generated tokens (computed with transformers), `empirical_first_two_law` the law observed over many
  requests through an engine with one drafter, `total_variation` the distance between two such laws.
* Servers: `sse_events(lines)` parses a streamed response's SSE lines; `slow_steps(async_engine, s)`
  makes every engine step take s seconds longer.
* Composite drafters: `two_part_drafter()` registers (once) and names a drafter whose trees carry
  provenance (`TokenTree.sources`) over two parts, `ngram` and `echo`.
* Triton's interpreter: `run_interpreted_child(script, ...)` runs a test module as a script in a child
  process with TRITON_INTERPRET=1; the script reports `run_checks({name: check})` (name -> None or a
  traceback).
* Devices: `DEVICES` parametrizes a test over ``"cpu"`` and ``"cuda"``; the CUDA case is marked
  ``gpu`` and skips without a CUDA device (`-m gpu` runs only those).
"""

from __future__ import annotations

from typing import Sequence

import pytest
import torch

# the engine of `empirical_first_two_law`: room for 500 requests of a short prompt at once, large trees
LAW_ENGINE = dict(max_num_seqs=64, max_num_batched_tokens=1024, num_kv_blocks=2400, max_model_len=64,
                  num_speculative_tokens=8, max_draft_tokens_per_step=512)


CUDA = pytest.param("cuda", marks=[pytest.mark.gpu,
                                   pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")])
DEVICES = ["cpu", CUDA]


# every built-in drafter on the tiny random target: the trained ones randomly initialised, mag without
# a corpus, cascade as a draft model reviewed by mag
_MAG = {"bigram": False, "max_tokens": 4}
TINY_DRAFTERS = {
    "ngram": {},
    "mag": _MAG,
    "draft_model": {"draft_layers": 1, "k_config": "3,2,1"},
    "student": {"random_init": True, "num_layers": 1, "k_config": "3,2,1"},
    "medusa": {"random_init": True, "init_std": 0.1},
    "eagle": {"random_init": True},
    "eagle3": {"random_init": True},
    "parallelspec": {"random_init": True},
    "ctc": {"random_init": True},
    "falcon": {"random_init": True},
    "cascade": {"levels": "draft_model,mag", "k": "3,5", "level_options": [{"draft_layers": 1}, _MAG]},
}


def make_llm_engine(model_dir, drafters: Sequence[str] = (), drafter_options: dict | None = None, *,
                    loaded=None, **config):
    """An fp32 CPU `LLMEngine` over `model_dir` (block size 4, 4 sequences, 200 KV blocks, context 160,
    up to 10 draft tokens per sequence and 40 per step, the fixed draft budget, unless `config` says
    otherwise)."""
    from specserve.engine.config import EngineConfig
    from specserve.engine.core import LLMEngine

    cfg = dict(model=str(model_dir), dtype="float32", device="cpu", max_num_seqs=4, block_size=4,
               max_num_batched_tokens=64, num_kv_blocks=200, max_model_len=160, drafters=tuple(drafters),
               drafter_options=drafter_options or {}, num_speculative_tokens=10, max_draft_tokens_per_step=40)
    # every draft is verified: these engines test drafters and verification, not the draft policy
    # (the goodput policy's own tests ask for draft_budget="goodput")
    cfg["draft_budget"] = "fixed"
    cfg.update(config)
    return LLMEngine(EngineConfig(**cfg), loaded)


def feature_drafter_engine(model_dir, drafters: Sequence[str] = (), drafter_options: dict | None = None, **config):
    """`make_llm_engine` as the feature drafters' tests size it: 6 sequences, 300 KV blocks, context
    128, up to 60 draft tokens a step (unless `config` says otherwise)."""
    sized = dict(max_num_seqs=6, num_kv_blocks=300, max_model_len=128, max_draft_tokens_per_step=60)
    return make_llm_engine(model_dir, drafters, drafter_options, **{**sized, **config})


def varied_prompts_and_plain(model_dir, params) -> tuple[list[list[int]], dict[str, list[int]]]:
    """Twelve random prompts of 3 to 33 tokens and their plain continuations under `params`, all
    added at once to a `feature_drafter_engine`."""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (6, 19, 11, 33, 4, 25, 9, 14, 3, 21, 16, 7)]
    return prompts, run_requests(feature_drafter_engine(model_dir), prompts, params, stagger=False)


def draft_view(seq_id: int, token_ids: Sequence[int], num_prompt_tokens: int = 1, **kw):
    """A drafter's view of a sequence (`DraftRequest`), greedy unless `params` is given, for
    drafters driven without an engine."""
    from specserve.engine.sampling_params import SamplingParams
    from specserve.engine.sequence import DraftRequest

    params = kw.pop("params", SamplingParams(temperature=0.0))
    return DraftRequest(seq_id, tuple(token_ids), num_prompt_tokens, params, **kw)


def step_and_collect(engine, got: dict[str, list[int]]) -> None:
    """One engine step; the token ids it produced are appended to `got[request id]`."""
    for out in engine.step():
        for d in out.outputs:
            got.setdefault(out.request_id, []).extend(d.token_ids)


def run_requests(engine, prompts, params, *, stagger: bool = True, prefix: str = "r", every: int = 2,
                 drafter: str | None = None, max_steps: int = 5000) -> dict[str, list[int]]:
    """Add `prompts` as requests f"{prefix}{i}" (drafted by `drafter`, when given; `params` one
    SamplingParams for all, or a list with one per prompt), one every `every` steps (`stagger`, so
    that prefills, plain decodes and trees share steps) or one per step, and step until all are
    finished (in fewer than `max_steps` steps); request id -> generated token ids."""
    got: dict[str, list[int]] = {}
    pending = list(enumerate(prompts))
    step = 0
    while pending or engine.has_unfinished_requests():
        if pending and (not stagger or step % every == 0):
            i, p = pending.pop(0)
            request_params = params[i] if isinstance(params, list) else params
            if drafter is None:
                engine.add_request(f"{prefix}{i}", p, request_params)
            else:
                engine.add_request(f"{prefix}{i}", p, request_params, drafter=drafter)
        step_and_collect(engine, got)
        step += 1
        assert step < max_steps
    return got


def exact_first_two_law(target_dir, prompt: list[int], params) -> dict[tuple[int, int], float]:
    """The exact joint law of the first two tokens the target (loaded with transformers) samples after
    `prompt` under `params` (temperature, top-k, ... as the engine's sampler processes them)."""
    import torch
    import transformers

    from specserve.engine.sampler import SamplingTensors, processed_probs

    hf = transformers.AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    st = SamplingTensors.from_params([params], "cpu")
    with torch.no_grad():
        return _first_two_law(lambda ids: processed_probs(hf(torch.tensor([ids])).logits[0, -1:], st)[0], prompt)


def _first_two_law(probs, prompt: list[int]) -> dict[tuple[int, int], float]:
    """The joint law of two tokens drawn one after the other from `probs(ids)` ([V], the next-token
    law after `ids`), starting after `prompt`."""
    law = {}
    p1 = probs(prompt)
    for t in p1.nonzero().flatten().tolist():
        p2 = probs(prompt + [t])
        for u in p2.nonzero().flatten().tolist():
            law[(t, u)] = float(p1[t] * p2[u])
    return law


def engine_first_two_law(engine, prompt: list[int], params) -> dict[tuple[int, int], float]:
    """The exact joint law of the first two tokens `engine`'s own target samples after `prompt` (as
    the engine computes it: quantized weights, its KV dtype), from its forwards over the prompt and
    over the prompt plus each possible first token."""
    import torch

    from specserve.engine.attention import build_attn_metadata
    from specserve.engine.kv_cache import KVCache
    from specserve.engine.sampler import SamplingTensors, processed_probs

    model, cfg = engine.model, engine.model_config
    st = SamplingTensors.from_params([params], "cpu")

    def probs(ids: list[int]) -> torch.Tensor:
        blocks = -(-len(ids) // 16)
        cache = KVCache(cfg.num_layers, blocks, 16, cfg.num_kv_heads, cfg.head_dim, engine.cache.kv.dtype,
                        torch.device("cpu"))
        positions, meta = build_attn_metadata([list(range(blocks))], 16, [0], [len(ids)], None, "cpu")
        return processed_probs(model.compute_logits(model(torch.tensor(ids), positions, cache, meta)[-1:]), st)[0]

    with torch.inference_mode():
        return _first_two_law(probs, prompt)


def empirical_first_two_law(target_dir, drafter: str, options: dict, prompt: list[int], params, trials: int, *,
                            batch: int = 500, seed: int = 0, seeded: bool = False, length: int = 2, **config):
    """The observed joint law of the first two tokens over `trials` requests of `prompt`, sent in groups
    of `batch` at once to a fresh `LAW_ENGINE` speculating with `drafter` (its `options`), after
    ``torch.manual_seed(seed)``; `seeded`: request i carries its own seed (1000 * seed + i), so its
    draws are the keyed ones; `length`: the law of the first `length` tokens instead of two;
    `config`: more engine settings. Returns (law, engine) so tests can read
    the drafter's statistics."""
    import dataclasses

    import torch

    torch.manual_seed(seed)
    engine = make_llm_engine(target_dir, (drafter,), {drafter: options}, **{**LAW_ENGINE, **config})
    counts: dict[tuple[int, int], int] = {}
    for start in range(0, trials, batch):
        for i in range(start, min(start + batch, trials)):
            engine.add_request(f"s{i}", prompt,
                               dataclasses.replace(params, seed=1000 * seed + i) if seeded else params)
        got: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            step_and_collect(engine, got)
        for toks in got.values():
            key = tuple(toks[:length])
            counts[key] = counts.get(key, 0) + 1
    return {k: v / trials for k, v in counts.items()}, engine


def total_variation(a: dict, b: dict) -> float:
    """Total variation distance between two laws given as outcome -> probability (missing: 0)."""
    return 0.5 * sum(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in set(a) | set(b))


def slow_steps(async_engine, seconds: float) -> None:
    """Make every engine step of `async_engine` take `seconds` longer (requests stay in flight)."""
    import time

    runner = async_engine.engine.runner
    execute = runner.execute

    def slow(*args, **kwargs):
        time.sleep(seconds)
        return execute(*args, **kwargs)

    runner.execute = slow


def sse_events(lines) -> list:
    """The JSON payloads of an SSE body (``[DONE]`` kept as a string)."""
    import json

    events = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def two_part_drafter() -> str:
    """Register (once) and return the name of `test_parts_composite`: two parts under one root, the
    registered `ngram` drafter (built with `make_drafter`) and `echo`, a chain repeating the last
    `echo` tokens (right when the output loops with that period), merged by `merge_trees` (a path
    both propose is ngram's). It records `proposed`: (prompt, committed length, tree) per tree."""
    from specserve.drafters.base import Drafter, DrafterContext, available_drafters, make_drafter, register
    from specserve.engine.tree import TokenTree, merge_trees

    name = "test_parts_composite"
    if name in available_drafters():
        return name

    @register(name)
    class TwoPartDrafter(Drafter):
        part_names = ("ngram", "echo")

        def __init__(self, ctx: DrafterContext, *, echo: int = 2):
            self.ngram = make_drafter("ngram", ctx, max_depth=4)
            self.echo = echo
            self.proposed: list = []

        def start(self, seq):
            self.ngram.start(seq)

        def finish(self, seq):
            self.ngram.finish(seq)

        def accept(self, seqs, results):
            self.ngram.accept(seqs, results)

        def propose(self, seqs, budgets):
            trees = []
            for seq, budget, sub in zip(seqs, budgets, self.ngram.propose(seqs, budgets)):
                root = seq.token_ids[-1]
                k = min(self.echo, len(seq.token_ids))
                echo = TokenTree.chain(root, list(seq.token_ids[-k:]))
                tree = merge_trees(root, [sub, echo], names=self.part_names, budget=budget)
                if tree is not None:
                    self.proposed.append((tuple(seq.token_ids[:seq.num_prompt_tokens]), len(seq.token_ids), tree))
                trees.append(tree)
            return trees

    TwoPartDrafter.name = name
    return name


def run_checks(checks: dict) -> dict[str, str | None]:
    """Each check called in turn: name -> None, or the traceback of what it raised (what a test module
    run as a script under Triton's interpreter reports back to `run_interpreted_child`)."""
    import traceback

    results = {}
    for name, check in checks.items():
        try:
            check()
            results[name] = None
        except Exception:
            results[name] = traceback.format_exc()
    return results


def run_interpreted_child(script: str, *args: str, env: dict[str, str], cwd=None) -> dict:
    """Run the test module `script` as a script in a child process with Triton's CPU interpreter on
    (TRITON_INTERPRET=1 must be set before triton is first imported) and `env` added; returns the
    JSON of the last line it prints."""
    import json
    import os
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, script, *args], env={**os.environ, "TRITON_INTERPRET": "1", **env},
                          capture_output=True, text=True, timeout=600, cwd=cwd)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def random_tree(rng, vocab: int, max_nodes: int = 14):
    """A random `TokenTree` for verification tests: chains, bushy trees, forests, root-only; small
    vocabularies so that sibling tokens repeat and roots tie."""
    from specserve.engine.tree import NO_PARENT, TokenTree

    kind = rng.choice(["tree", "tree", "chain", "forest", "root"])
    if kind == "root":
        return TokenTree.root_only(rng.randrange(vocab))
    num_roots = rng.randint(2, 4) if kind == "forest" else 1
    n = rng.randint(num_roots, max_nodes)
    if kind == "chain":
        parents = [NO_PARENT] + list(range(n - 1))
    else:
        parents = [NO_PARENT] * num_roots + [rng.randrange(0, i) for i in range(num_roots, n)]
    return TokenTree([rng.randrange(vocab) for _ in range(n)], parents)


def teacher_batch(model, seqs: list[list[int]], answer_from: list[int], k: int = 4,
                  layers: tuple[int, ...] = ()) -> dict:
    """A padded training batch over `seqs` from the target itself (teacher forcing), as the trainers
    read them: `input_ids`, `hidden`, the target's top-`k`, `loss_mask` (`loss_mask[t]`: the token at
    t+1 is an answer token, from `answer_from[r]` on), `valid`; with `layers`, also `layers` [B, T,
    len(layers), H] (the target's residual streams after those decoder layers)."""
    import torch

    from specserve.drafters.train.target import FeatureExtractor, target_topk

    hidden, captured = FeatureExtractor(model).extract(seqs, tuple(layers))
    b, width, h = len(seqs), max(len(s) for s in seqs), model.cfg.hidden_size
    batch = {"input_ids": torch.zeros(b, width, dtype=torch.int64),
             "hidden": torch.zeros(b, width, h),
             "topk_ids": torch.full((b, width, k), -100, dtype=torch.int64),
             "topk_logprobs": torch.zeros(b, width, k),
             "loss_mask": torch.zeros(b, width, dtype=torch.bool),
             "valid": torch.zeros(b, width, dtype=torch.bool)}
    if layers:
        batch["layers"] = torch.zeros(b, width, len(layers), h)
    for r, (s, f, a) in enumerate(zip(seqs, hidden, answer_from)):
        ids, lps = target_topk(model, f, k)
        n = len(s)
        batch["input_ids"][r, :n] = torch.tensor(s)
        batch["hidden"][r, :n] = f
        batch["topk_ids"][r, :n] = ids.long()
        batch["topk_logprobs"][r, :n] = lps
        batch["loss_mask"][r, max(0, a - 1):n - 1] = True
        batch["valid"][r, :n] = True
        if layers:
            batch["layers"][r, :n] = captured[r]
    return batch
