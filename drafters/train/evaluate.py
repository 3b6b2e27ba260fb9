"""τ of a drafter, measured the way the server measures it: held-back prompts through our engine.

A trainer builds one engine with its drafter loaded around the module being trained (e.g.
``EngineConfig(drafters=("medusa",), drafter_options={"medusa": {"module": heads}})``, the drafter
reading the module by reference) and calls `measure_tau` from its `eval_fn`: the module's weights
change in place between evals, the engine stays. `served_tau` is the one-off figure a trainer
records in its checkpoint: an engine built for it, then `measure_tau`.
"""

from __future__ import annotations

from typing import Any, Sequence as Seq

import torch

from specserve.drafters.train.data import Example, render_prompt
from specserve.engine.config import EngineConfig
from specserve.engine.core import LLMEngine
from specserve.engine.sampling_params import SamplingParams


def option(options: dict, key: str, default):
    """`options[key]`, or `default` when it is absent or None."""
    value = options.get(key)
    return default if value is None else value


def as_saved(module: torch.nn.Module) -> torch.nn.Module:
    """Round `module`'s parameters to bf16 and back, in place: evaluate what the checkpoint holds."""
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return module


def served_tau(target, drafter: str, drafter_options: dict[str, Any], prompts: Seq[Example | list[int]], *,
               budget: int = 8, max_tokens: int = 64, max_len: int | None = None, **config) -> dict[str, Any]:
    """τ of `drafter` built with `drafter_options` (the trained module among them, e.g.
    `{"head": head}`) through our engine: greedy, `prompts` (held-back), a fixed draft budget of
    `budget` nodes; `measure_tau`'s figures.

    The engine: 1024 tokens of context and 16 sequences; or, with `max_len` (the longest prompt
    the trainer keeps), `max_len + max_tokens` tokens (at most the target's positions) and every
    prompt in one batch (2048 batched tokens, `budget` draft tokens a sequence). `config`: further
    `EngineConfig` fields (e.g. `seed`)."""
    if max_len is None:
        sizes = dict(max_model_len=1024, max_num_seqs=16)
    else:
        num_seqs = max(1, len(prompts))
        sizes = dict(max_model_len=min(max_len + max_tokens, target.model_config.max_position_embeddings),
                     max_num_seqs=num_seqs, max_num_batched_tokens=2048, max_draft_tokens_per_step=budget * num_seqs)
    engine = LLMEngine(EngineConfig(model=str(target.name), device=str(target.device),
                                    dtype=str(target.dtype).removeprefix("torch."), drafters=(drafter,),
                                    drafter_options={drafter: drafter_options}, num_speculative_tokens=budget,
                                    draft_budget="fixed", **sizes, **{"quantization": "none", **config}),
                       loaded=target.loaded)
    return measure_tau(engine, prompts, drafter=drafter, max_tokens=max_tokens)


def measure_tau(engine, prompts: Seq[Example | list[int]], *, drafter: str, max_tokens: int = 64,
                temperature: float = 0.0, seed: int = 0) -> dict[str, Any]:
    """Generate with `drafter` (loaded in `engine`, a specserve LLMEngine) for every prompt (an
    Example, rendered with the chat template, or prompt token ids) and return the speculation
    figures summed over the prompts:

    tau       committed tokens / target forwards (bonus included; the prefill's forward counts)
    alpha     accepted / drafted tokens
    accepted_per_step, num_prompts, num_tokens, num_forwards, num_draft_tokens, num_accepted_tokens
    """
    if engine.has_unfinished_requests():
        raise RuntimeError("measure_tau needs an idle engine")
    totals = dict(num_tokens=0, num_forwards=0, num_draft_tokens=0, num_accepted_tokens=0)
    num_prompts = 0
    for i, prompt in enumerate(prompts):
        ids = render_prompt(engine.tokenizer, prompt.turns) if isinstance(prompt, Example) else list(prompt)
        room = engine.max_model_len - len(ids)
        if room < 1:
            continue
        params = SamplingParams(temperature=temperature, max_tokens=min(max_tokens, room),
                                seed=seed + i if temperature > 0 else None)
        engine.add_request(f"tau-{i}", ids, params, drafter=drafter)
        num_prompts += 1
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished and out.spec is not None:
                totals["num_tokens"] += out.spec.num_generated_tokens
                totals["num_forwards"] += out.spec.num_target_forwards
                totals["num_draft_tokens"] += out.spec.num_draft_tokens
                totals["num_accepted_tokens"] += out.spec.num_accepted_tokens
    forwards = totals["num_forwards"]
    return {"tau": totals["num_tokens"] / forwards if forwards else 0.0,
            "alpha": totals["num_accepted_tokens"] / totals["num_draft_tokens"] if totals["num_draft_tokens"] else 0.0,
            "accepted_per_step": totals["num_accepted_tokens"] / forwards if forwards else 0.0,
            "num_prompts": num_prompts, **totals}
