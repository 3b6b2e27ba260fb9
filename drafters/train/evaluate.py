"""τ of a drafter, measured the way the server measures it: held-back prompts through our engine.

A trainer builds one engine with its drafter loaded around the module being trained (e.g.
``EngineConfig(drafters=("medusa",), drafter_options={"medusa": {"module": heads}})``, the drafter
reading the module by reference) and calls `measure_tau` from its `eval_fn`: the module's weights
change in place between evals, the engine stays.
"""

from __future__ import annotations

from typing import Any, Sequence as Seq

from specserve.drafters.train.data import Example, render_prompt


def measure_tau(engine, prompts: Seq[Example | list[int]], *, drafter: str, max_tokens: int = 64,
                temperature: float = 0.0, seed: int = 0) -> dict[str, Any]:
    """Generate with `drafter` (loaded in `engine`, a specserve LLMEngine) for every prompt (an
    Example, rendered with the chat template, or prompt token ids) and return the speculation
    figures summed over the prompts:

    tau       committed tokens / target forwards (bonus included; the prefill's forward counts)
    alpha     accepted / drafted tokens
    accepted_per_step, num_prompts, num_tokens, num_forwards, num_draft_tokens, num_accepted_tokens
    """
    from specserve.engine.sampling_params import SamplingParams

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
