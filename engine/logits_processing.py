"""Logits processing that depends on the tokens generated so far, per row along its own path.

What a request can ask (OpenAI's and vLLM's names, `SamplingParams`): `logit_bias`, `min_tokens`
(its stop tokens banned until then), `repetition_penalty`, `frequency_penalty`,
`presence_penalty`. Each one makes the target's next-token law depend on the tokens generated so
far. A draft tree's node i continues the output with the tokens on its path, so node i is
processed with the counts of *its own* path, not with the committed prefix's:

    c_i[v] = #v in the output so far + #v on the path root -> i, root excluded

(the root is the last committed token: it is in the output already). A plain row is the path of
length 0. For the raw logits l of row i, in vLLM's order (bias and bans, then penalties):

    l[v] += bias[v]
    l[v]  = -inf                       v a stop token and len(output) + depth(i) < min_tokens
    l[v]  = l[v] / r if l[v] > 0 else l[v] * r      v in the prompt or c_i[v] > 0 (r: repetition)
    l[v] -= frequency * c_i[v] + presence * [c_i[v] > 0]

Greedy decoding takes the argmax of the result, sampling its softmax after temperature, min_p,
top-k and top-p (`sampler`), and verification compares drafts with that same processed law, so a
tree verified with these logits commits exactly what plain decoding with the same processing would:
greedy token for token, sampling in law. Logprobs are those of the processed logits.

Everything is batched on the device: the output counts of each sequence are scattered into a dense
[K, V] table from one upload, and the path counts of every node of every tree come from one
`scatter_add` over the packed trees' ancestor masks (`path_counts`): no Python loop per node.
Requests that ask for none of this skip the stage (`needs_processing`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.engine.sampling_params import SamplingParams


def needs_processing(params: SamplingParams, eos_token_ids) -> bool:
    """Whether a request's logits need this stage at all."""
    return bool(params.logit_bias or params.presence_penalty or params.frequency_penalty
                or params.repetition_penalty != 1.0 or (params.min_tokens and _stop_ids(params, eos_token_ids)))


def _stop_ids(params: SamplingParams, eos_token_ids) -> list[int]:
    return sorted({*params.stop_token_ids, *(() if params.ignore_eos else eos_token_ids)})


def path_counts(packed, vocab: int, trees: torch.Tensor) -> torch.Tensor:
    """[K, N, V] float32 for the packed trees `trees` ([K] indices): per node, how often each token
    occurs on its path from the root, the root itself excluded (it is committed: counted with the
    output). One scatter over the ancestor-or-self masks."""
    tokens, mask, depths = (t.index_select(0, trees) for t in (packed.tokens, packed.mask, packed.depths))
    K, N = tokens.shape
    on_path = mask & (depths[:, None, :] > 0)                                  # [K, i, j]: j on i's path
    return torch.zeros(K, N, vocab, dtype=torch.float32, device=tokens.device).scatter_add_(
        2, tokens[:, None, :].expand(K, N, N), on_path.to(torch.float32))


@dataclass
class LogitsProcessing:
    """The processing of K sequences' rows (`for_seqs`); `apply` to [K, M, V] logits (M rows each)."""

    counts: torch.Tensor        # [K, V] float32: output token counts
    prompt: torch.Tensor | None # [K, V] bool: tokens of the prompt (only with a repetition penalty)
    bias: torch.Tensor | None   # [K, V] float32
    stops: torch.Tensor | None  # [K, V] bool: stop tokens banned while the output is short
    left: torch.Tensor          # [K] int64: min_tokens - len(output)
    presence: torch.Tensor      # [K] float32
    frequency: torch.Tensor     # [K] float32
    repetition: torch.Tensor    # [K] float32

    @classmethod
    def for_seqs(cls, seqs, eos_token_ids, vocab: int, device) -> "LogitsProcessing":
        K = len(seqs)
        # per table, each sequence's token ids: the output, the prompt (with a repetition penalty),
        # the biased tokens, the stop tokens (while the output is short of min_tokens)
        tables = ([s.output_token_ids for s in seqs],
                  [s.token_ids[:s.num_prompt_tokens] if s.params.repetition_penalty != 1.0 else () for s in seqs],
                  [list(s.params.logit_bias or ()) for s in seqs],
                  [_stop_ids(s.params, eos_token_ids) if s.params.min_tokens > s.num_output_tokens else ()
                   for s in seqs])
        ints: list[int] = []      # per table [its rows | its tokens], then min_tokens - len(output) per sequence
        for ids in tables:
            ints += [k for k, row in enumerate(ids) for _ in row]
            ints += [t for row in ids for t in row]
        ints += [s.params.min_tokens - s.num_output_tokens for s in seqs]
        flat = torch.tensor(ints, dtype=torch.int64, device=device)
        bias_vals = [float(b) for s in seqs for b in (s.params.logit_bias or {}).values()]
        floats = torch.tensor([[s.params.presence_penalty, s.params.frequency_penalty, s.params.repetition_penalty]
                               for s in seqs] + [[b, 0.0, 0.0] for b in bias_vals],
                              dtype=torch.float32, device=device)
        groups = [sum(map(len, ids)) for ids in tables]
        pairs, at = [], 0
        for n in groups:
            pairs.append((flat[at:at + n], flat[at + n:at + 2 * n]))
            at += 2 * n
        left = flat[at:at + K]

        def dense(pair, dtype, values=None):
            rows, toks = pair
            out = torch.zeros(K, vocab, dtype=dtype, device=device)
            if rows.numel() == 0:
                return out
            vals = values if values is not None else torch.ones(rows.numel(), dtype=dtype, device=device)
            return out.index_put_((rows, toks), vals, accumulate=dtype != torch.bool)

        return cls(
            counts=dense(pairs[0], torch.float32),
            prompt=dense(pairs[1], torch.bool) if groups[1] else None,
            bias=dense(pairs[2], torch.float32, floats[K:, 0]) if groups[2] else None,
            stops=dense(pairs[3], torch.bool) if groups[3] else None,
            left=left, presence=floats[:K, 0], frequency=floats[:K, 1], repetition=floats[:K, 2])

    def apply(self, logits: torch.Tensor, extra_counts: torch.Tensor | None = None,
              depths: torch.Tensor | None = None) -> torch.Tensor:
        """logits [K, M, V] (any float dtype) -> processed float32 [K, M, V]. extra_counts [K, M, V]:
        the tokens of each row's path (`path_counts`); depths [K, M]: each row's depth (0 if None)."""
        K, M, V = logits.shape
        out = logits.float()
        if self.bias is not None:
            out = out + self.bias[:, None, :]
        if self.stops is not None:
            depth = depths if depths is not None else torch.zeros(K, M, dtype=torch.int64, device=logits.device)
            short = depth < self.left[:, None]                                          # [K, M]
            out = out.masked_fill(self.stops[:, None, :] & short[..., None], float("-inf"))
        counts = self.counts[:, None, :].expand(K, M, V)
        if extra_counts is not None:
            counts = counts + extra_counts
        seen = counts > 0
        rep = self.repetition[:, None, None]
        hit = seen if self.prompt is None else seen | self.prompt[:, None, :]
        out = torch.where(hit & (rep != 1.0), torch.where(out > 0, out / rep, out * rep), out)
        out = out - self.frequency[:, None, None] * counts - self.presence[:, None, None] * seen.to(out.dtype)
        return out


class DraftLaw:
    """A request's processing for its drafter (`DraftRequest.law`, `DraftRequest.processed`): the
    penalties, bias and min_tokens above and its grammar's mask, applied to a drafter's own logits
    at a draft node as verification applies them to the target's at that node, along the node's
    path after the view's tokens (hypothetical ones included).

    A drafter that draws its drafts from q (the draft model's stochastic trees) then draws from the
    processed counterpart of the target's law, and one that ranks them (top-k) ranks what the
    request allows: a token the request bans, or its grammar forbids, is never drafted. Lossless
    either way (verification accepts x with min(1, p(x) / q(x)) whatever q is); what it buys is
    acceptance."""

    def __init__(self, eos_token_ids, grammar=None):
        self.eos_token_ids = tuple(eos_token_ids)
        self.grammar = grammar     # the sequence's `GrammarState`, at its committed state
        self._processing: tuple | None = None   # (token ids, vocab, LogitsProcessing) of the last view

    def _processing_of(self, view, vocab: int, device) -> LogitsProcessing:
        """The view's `LogitsProcessing`, built once for all the nodes a drafter expands after it."""
        last = self._processing
        if last is None or last[0] != view.token_ids or last[1] != vocab:
            last = self._processing = (view.token_ids, vocab,
                                       LogitsProcessing.for_seqs([view], self.eos_token_ids, vocab, device))
        return last[2]

    def apply(self, view, logits: torch.Tensor, paths) -> torch.Tensor:
        """logits [n, V] -> float32 [n, V]: row i processed after view.token_ids + paths[i]."""
        out = logits.float()
        n, V = out.shape
        if needs_processing(view.params, self.eos_token_ids):
            proc = self._processing_of(view, V, out.device)
            rows = [i for i, path in enumerate(paths) for _ in path]
            extra = torch.zeros(1, n, V, dtype=torch.float32, device=out.device)
            if rows:
                toks = torch.tensor([t for path in paths for t in path], dtype=torch.int64, device=out.device)
                extra[0].index_put_((torch.tensor(rows, device=out.device), toks),
                                    torch.ones(len(rows), device=out.device), accumulate=True)
            depths = torch.tensor([[len(path) for path in paths]], dtype=torch.int64, device=out.device)
            out = proc.apply(out[None], extra, depths)[0]
        if self.grammar is not None:
            from specserve.engine.grammar import apply_masks

            out = apply_masks(out, self.grammar.masks_after(list(view.hypothetical), [list(p) for p in paths]))
        dead = torch.isneginf(out).all(dim=-1)   # e.g. a grammar allowing only tokens outside a draft vocabulary
        return torch.where(dead[:, None], logits.float(), out) if bool(dead.any()) else out
