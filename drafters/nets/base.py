"""What every trained drafter network with a draft vocabulary shares: the optional ranking of the
target's tokens (`vocab_rank`, see drafters.draft_vocab), the tensors a checkpoint holds, and
loading them back with a check that they fit this target."""

from __future__ import annotations

import torch
from torch import nn

from specserve.drafters.draft_vocab import check_rank


class RankedDraftNet(nn.Module):
    """An nn.Module with `self.cfg` (the target's ModelConfig) and a `vocab_rank` buffer
    (registered as None in the subclass's constructor)."""

    def set_vocab_rank(self, rank: torch.Tensor | None) -> None:
        """Token ids by how often the target chose them on the training data, most frequent first
        (all of the vocabulary): the serving drafter can restrict its LM head to the first N."""
        if rank is None:
            self.vocab_rank = None
            return

        self.vocab_rank = check_rank(rank.detach().cpu(), self.cfg.vocab_size)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The trainable tensors (and the vocabulary ranking when set), by name: what a checkpoint holds."""
        out = {k: v.detach() for k, v in self.state_dict().items()}
        if "vocab_rank" in out:
            out["vocab_rank"] = out["vocab_rank"].to(torch.int32)   # half the bytes on disk
        return out

    def load_tensors(self, tensors: dict[str, torch.Tensor], kind: str) -> None:
        """Load what `tensors()` gave (fp32), refusing a set of names or shapes that does not fit
        this network, with `kind` naming the checkpoint in the error."""
        tensors = dict(tensors)
        rank = tensors.pop("vocab_rank", None)
        expected = set(self.state_dict())
        missing, unexpected = expected - set(tensors), set(tensors) - expected
        if missing or unexpected:
            raise ValueError(f"{kind} checkpoint tensors do not fit this target: missing {sorted(missing)}, "
                             f"unexpected {sorted(unexpected)}")
        for name, t in self.state_dict().items():
            if tuple(tensors[name].shape) != tuple(t.shape):
                raise ValueError(f"{kind} checkpoint tensor {name} has shape {tuple(tensors[name].shape)}, "
                                 f"this target needs {tuple(t.shape)}")
        self.load_state_dict({k: v.float() for k, v in tensors.items()})
        self.set_vocab_rank(rank)
