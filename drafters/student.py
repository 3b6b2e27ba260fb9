"""`student`: a distilled student draft model (network: drafters/nets/student.py, training:
drafters/train/student.py) served through the
draft-model machinery — SpS chains, MCSD k-configuration trees, target-initialised roots, its own
paged KV cache. It shares the target's embedding, LM head and RoPE tables by reference; only its
few decoder layers and final norm come from the checkpoint.

Options: `checkpoint=PATH` (default: the shipped checkpoint for this target, the largest or the
one with `num_layers=N`), `random_init=true` (the target's first `num_layers` layers, untrained:
for tests), `draft_vocab=N` (draft from the N tokens the target chose most often in training: default 8192
when the checkpoint has that ranking, 0 = the whole vocabulary; see drafters.draft_vocab), plus
every `draft_model` option (`k_config` including `fork:W,D`, `deterministic`, `target_init_width`,
and dynamic MCSD's `decision` / `decision_threshold`).

`model_runs` (standardized walltime) comes from `draft_model`: c = the student's layers and norm
plus the target's shared embedding and LM head, over the target's parameters.
"""

from __future__ import annotations

from specserve.drafters.base import DrafterContext, register
from specserve.drafters.draft_model import DraftModelDrafter
from specserve.drafters.nets.student import StudentModel, load_student, shipped_checkpoint


@register("student")
class StudentDrafter(DraftModelDrafter):
    name = "student"

    def __init__(self, ctx: DrafterContext, *, checkpoint: str | None = None, num_layers: int | None = None,
                 random_init: bool = False, k_config="chain:4", deterministic: bool = False, target_init_width: int = 1,
                 draft_vocab: int | None = None, block_size: int = 16, num_blocks: int | None = None,
                 decision: str | None = None, decision_threshold: float | None = None):
        target, model_config = ctx.target, ctx.model_config
        self.meta = None
        if random_init:
            student = StudentModel.from_target(target, int(num_layers or 1))
        else:
            path = checkpoint or shipped_checkpoint(model_config, target, num_layers)
            if path is None:
                raise ValueError("no student checkpoint ships for this target; train one with "
                                 "`specserve train student --model SOURCE --out DIR` and pass "
                                 "--drafter-option student.checkpoint=DIR")
            student, self.meta = load_student(path, model_config=model_config, target=target)
        model = student.as_draft_model(target, ctx.dtype, ctx.device)
        super().__init__(ctx, k_config=k_config, deterministic=deterministic, target_init_width=target_init_width,
                         draft_vocab=draft_vocab, block_size=block_size, num_blocks=num_blocks, prebuilt=model,
                         vocab_rank=getattr(student, "vocab_rank", None), decision=decision,
                         decision_threshold=decision_threshold)
