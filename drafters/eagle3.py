"""EAGLE-3-style drafter: the eagle drafter (drafters/eagle.py: own paged KV of real rows, catch-up,
dynamic trees grown level by level, the target's LM head over the draft vocabulary) whose real
rows read the target's low, mid and high layers, fused by the head (nets/eagle3.py), instead of
its last-layer feature. Tree rows read the head's own output, as in eagle.

The layers are the checkpoint's; the drafter declares them as `capture_layers`, so the engine's
feature store keeps them for every position of the target's KV, beside the last layer. It
therefore drafts only inside an engine (which writes those layers); built without one, it refuses.

Trained by drafters/train/eagle3.py with EAGLE-3's training-time test (several draft steps per
position, each reading the previous step's output), so deep tree levels are trained on what
serving feeds them. Drafts are deterministic top-k children, as eagle's: lossless for greedy and
sampled requests alike.
"""

from __future__ import annotations

import torch

from specserve.drafters.base import DrafterContext, register
from specserve.drafters.eagle import EagleDrafter
from specserve.drafters.nets.eagle import EagleHead
from specserve.drafters.nets.eagle3 import Eagle3Head, load_head, parse_layers, shipped_checkpoint


@register("eagle3")
class Eagle3Drafter(EagleDrafter):
    """Options as eagle's: `checkpoint=PATH` (an eagle3 checkpoint folder; default: the shipped one
    for this target), `depth` (6), `top_k` (4), `width` (4), `draft_vocab` (default 8192; 0 = the
    whole vocabulary), `block_size`/`num_blocks`, `device_tree`. For tests: `random_init=true` (an untrained head
    over `layers`, default EAGLE-3's (2, L // 2, L - 3); `init=last`: its decoder layer copied
    from the target's last one) or `head=` an in-memory Eagle3Head."""

    name = "eagle3"

    def __init__(self, ctx: DrafterContext, *, checkpoint: str | None = None, random_init: bool = False,
                 init: str = "random", layers: str | None = None, head: Eagle3Head | None = None, depth: int = 6,
                 top_k: int = 4, width: int = 4, draft_vocab: int | None = None, block_size: int = 16,
                 num_blocks: int | None = None, device_tree: bool | str = "auto"):
        if ctx.features is None:
            raise ValueError("eagle3 reads the target's intermediate layers from the engine's feature store: "
                             "it drafts inside an engine only")
        self._layers = layers
        super().__init__(ctx, checkpoint=checkpoint, random_init=random_init, init=init, head=head, depth=depth,
                         top_k=top_k, width=width, draft_vocab=draft_vocab, block_size=block_size,
                         num_blocks=num_blocks, device_tree=device_tree)
        self.capture_layers = self.head.layers       # what the engine's feature store keeps for this drafter

    def build_head(self, ctx: DrafterContext, checkpoint: str | None, random_init: bool, init: str) -> Eagle3Head:
        if random_init:
            layers = parse_layers(self._layers, ctx.model_config.num_layers)
            eagle = EagleHead.from_target(ctx.model_config, ctx.target, init=init)
            return Eagle3Head.from_target(ctx.model_config, ctx.target, init="eagle", eagle=eagle, layers=layers)
        if self._layers is not None:
            raise ValueError("eagle3: `layers` is for an untrained head; a checkpoint brings its own")
        return self.load_trained(checkpoint, ctx.model_config, shipped_checkpoint, load_head)

    def real_features(self, seq_id: int, lo: int, hi: int) -> torch.Tensor:
        """[n, len(layers), H]: the captured layers the head lifts (`Eagle3Head.lift_features`)."""
        return torch.stack([self.features.view(seq_id, lo, hi, layer=k) for k in self.head.layers], dim=1)
