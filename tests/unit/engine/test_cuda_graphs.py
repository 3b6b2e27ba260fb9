"""CUDA graphs of decode and verification steps (engine/cuda_graphs.py).

On the CPU the capture/replay bookkeeping (buckets, padding by repeating the last row, static
buffers) runs through the eager stand-in `EagerReplay` over the Triton kernel under the
interpreter, which must be switched on (TRITON_INTERPRET=1) before triton is first imported: the
comparison runs in a child process (this file as a script). On CUDA (-m gpu) the engine captures
real graphs by itself; greedy tokens in fp32 must equal those of an engine with enforce_eager.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from specserve.engine.cuda_graphs import batch_buckets, node_buckets

ROOT = Path(__file__).resolve().parents[3]
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


def test_buckets_cover_every_batch_size_up_to_the_largest():
    assert batch_buckets(1) == [1]
    assert batch_buckets(16) == [1, 2, 4, 8, 16]
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert node_buckets(1) == [1] and node_buckets(9) == [1, 2, 4, 8, 9] and node_buckets(4) == [1, 2, 4]


def compare_with_eager(model_dir: str, device: str, stand_in: bool) -> dict:
    """Greedy tokens of three prompts of different lengths, added one every two steps (prefill and
    decode steps interleave; a step of 3 sequences pads to the bucket of 4), plain and with the
    n-gram drafter (verification steps replay the tree graphs, trees padded to their node bucket),
    with graphs and without."""
    from specserve.engine.sampling_params import SamplingParams
    from tests.helpers import make_llm_engine, run_requests, step_and_collect

    common = dict(device=device, max_num_seqs=4)
    eager = make_llm_engine(model_dir, ["ngram"], enforce_eager=True, **common)
    graphed = make_llm_engine(model_dir, ["ngram"], **common)
    if stand_in:
        from specserve.engine.cuda_graphs import EagerReplay
        graphed.capture_graphs(EagerReplay())
    out = {"captured": graphed.runner.graphs is not None, "eager_has_graphs": eager.runner.graphs is not None}
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 200, (n,), generator=g).tolist() * 2 for n in (5, 11, 7)]
    prompts[0] = prompts[0] * 2     # 20 tokens: the first prompt's prefill, alone, replays the chain of 32
    for drafter in (None, "ngram"):
        got = [run_requests(e, prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
                            drafter=drafter, prefix=f"{drafter}-") for e in (eager, graphed)]
        out[f"equal_{drafter}"] = len(got[0]) == 3 and got[0] == got[1]
    mixed = []     # plain and drafted requests in the same steps: decode rows ride in the tree graphs
    for e in (eager, graphed):
        got: dict[str, list[int]] = {}
        for i, p in enumerate(prompts):
            e.add_request(f"m{i}", p, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
                          drafter="ngram" if i % 2 == 0 else None)
        while e.has_unfinished_requests():
            step_and_collect(e, got)
        mixed.append(got)
    out["equal_mixed"] = len(mixed[0]) == 3 and mixed[0] == mixed[1]
    replays = graphed.runner.graphs.num_replays if graphed.runner.graphs else {}
    out["decode_replays"] = sum(n for (b, rows), n in replays.items() if rows == 1)
    out["tree_replays"] = sum(n for (b, rows), n in replays.items() if rows > 1)
    out["chain_sizes"] = graphed.runner.graphs.chain_sizes if graphed.runner.graphs else []
    # a prompt alone in its step (the first one's prefill) replays a chain: batch 1, beyond the node buckets
    out["chain_replays"] = sum(n for (b, rows), n in replays.items() if rows in out["chain_sizes"])
    out["padded_batches"] = any(b == 4 for b, _ in replays)     # 3 sequences run in the bucket of 4
    return out


@pytest.fixture(scope="module")
def interpreted(tiny_llama_dir):
    from helpers import run_interpreted_child   # (not at the top: this file also runs as a script)
    # the layers' fused kernels too, as on CUDA
    return run_interpreted_child(__file__, str(tiny_llama_dir), cwd=ROOT,
                                 env={"SPECSERVE_ATTENTION": "triton", "SPECSERVE_FUSED": "1"})


@needs_triton
def test_replayed_decode_steps_give_the_eager_tokens(interpreted):
    assert interpreted["captured"] and not interpreted["eager_has_graphs"]
    assert interpreted["decode_replays"] > 0 and interpreted["tree_replays"] > 0 and interpreted["padded_batches"]
    assert interpreted["chain_sizes"] == [16, 32, 64] and interpreted["chain_replays"] > 0
    assert interpreted["equal_None"], "plain decoding differs with graphs"
    assert interpreted["equal_ngram"], "speculative decoding differs with graphs"
    assert interpreted["equal_mixed"], "plain and drafted requests together differ with graphs"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graphs_give_the_eager_tokens(tiny_llama_dir):
    got = compare_with_eager(str(tiny_llama_dir), "cuda", stand_in=False)
    assert got["captured"] and not got["eager_has_graphs"] and got["decode_replays"] > 0 and got["tree_replays"] > 0
    assert got["chain_replays"] > 0
    assert got["equal_None"] and got["equal_ngram"] and got["equal_mixed"], got


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    print(json.dumps(compare_with_eager(sys.argv[1], "cpu", stand_in=True)))
