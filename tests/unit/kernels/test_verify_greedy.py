"""The Triton greedy-verification kernel (kernels/verify_greedy.py) and the native CPU walk
(kernels/cpu.py `verify_greedy_stacked`) against the torch reference
(`engine.verify.verify_greedy_batched_reference`): the same stacked rows, exactly, on random batches
of chains, bushy trees, forests and root-only trees with repeated sibling tokens and tied roots,
trees of up to 64 nodes, drafts that are the target's argmax (long walks) and next-root columns;
through `verify_batched`'s dispatch too. Triton on the CPU under its interpreter (this file runs
itself as a script in a child process) and `-m gpu` on CUDA; the native walk in this process."""

from __future__ import annotations

import importlib.util
import json
import random
import sys
from pathlib import Path

import pytest
import torch

from specserve.kernels import cpu as native_cpu

HAS_TRITON = importlib.util.find_spec("triton") is not None


def cases(device: str = "cpu"):
    """(name, packed trees, argmax) of random batches; a few with the drafts as the target's argmax."""
    from helpers import random_tree
    from specserve.engine.tree import TokenTree, pack_trees

    rng = random.Random(0)
    g = torch.Generator().manual_seed(0)
    out = []
    for n in range(60):
        vocab = rng.choice([2, 3, 5])
        trees = [random_tree(rng, vocab, max_nodes=64 if n % 10 == 0 else 14) for _ in range(rng.randint(1, 9))]
        if n % 7 == 0:       # a tree asking for next-root candidates: alternates columns
            trees.append(TokenTree([1, 2, 3], [-1, 0, 1], next_roots=3))
        packed = pack_trees(trees, device)
        argmax = torch.randint(0, vocab, packed.tokens.shape, generator=g).to(device)
        if n % 3 == 0:       # the drafts are exactly the target's argmax: long walks, many ties
            argmax = torch.where(packed.parents[:, :, None] == torch.arange(packed.max_nodes, device=device),
                                 packed.tokens[:, None, :], -1).amax(dim=2).clamp_min(0)
        out.append((f"batch{n}", packed, argmax))
    return out


def compare(packed, argmax) -> None:
    from specserve.engine import verify
    from specserve.kernels.verify_greedy import verify_greedy_stacked

    want = verify.verify_greedy_batched_reference(packed, argmax).stacked()
    got = verify_greedy_stacked(packed.tokens, packed.parents, packed.depths, packed.mask, packed.num_nodes,
                                packed.num_roots, argmax, packed.max_depth, packed.max_next_roots)
    assert got.shape == want.shape and torch.equal(got, want), (got, want)
    dispatched = verify.verify_greedy_batched(packed, argmax)          # SPECSERVE_VERIFY=triton here
    assert dispatched.packed_rows is not None and torch.equal(dispatched.stacked(), want)
    ref = verify.verify_greedy_batched_reference(packed, argmax)
    for name in ("path", "num_accepted", "tokens", "root", "alternates"):
        assert torch.equal(getattr(dispatched, name), getattr(ref, name)), name


def run_interpreted() -> dict[str, str | None]:
    from helpers import run_checks
    return run_checks({name: (lambda p=packed, a=argmax: compare(p, a)) for name, packed, argmax in cases()})


@pytest.fixture(scope="module")
def interpreted():
    from helpers import run_interpreted_child
    return run_interpreted_child(__file__, env={"SPECSERVE_VERIFY": "triton"})


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("name", [f"batch{n}" for n in range(60)])
def test_kernel_equals_the_reference_interpreted(interpreted, name):
    assert interpreted[name] is None, interpreted[name]


needs_native = pytest.mark.skipif(not native_cpu.available(), reason="the native CPU kernels do not build here")


@needs_native
@pytest.mark.parametrize("n", range(60))
def test_native_walk_equals_the_reference(n, monkeypatch):
    """The native walk's rows are the reference's, directly and through the CPU dispatch."""
    from specserve.engine import verify

    monkeypatch.delenv("SPECSERVE_VERIFY", raising=False)
    _, packed, argmax = cases()[n]
    want = verify.verify_greedy_batched_reference(packed, argmax).stacked()
    got = native_cpu.verify_greedy_stacked(packed.tokens, packed.parents, packed.num_nodes, packed.num_roots, argmax,
                                           packed.max_depth, packed.max_next_roots)
    assert got.shape == want.shape and torch.equal(got, want), (got, want)
    dispatched = verify.verify_greedy_batched(packed, argmax)
    assert dispatched.packed_rows is not None and torch.equal(dispatched.stacked(), want)
    assert torch.equal(dispatched.tokens, verify.verify_greedy_batched_reference(packed, argmax).tokens)


@needs_native
def test_native_walk_reads_a_strided_argmax():
    """A view of the argmax (as `verify_batched` may pass after merging keyed rows) gives the same rows."""
    from specserve.engine import verify

    _, packed, argmax = cases()[3]
    wide = torch.zeros(argmax.shape[0], argmax.shape[1] + 5, dtype=torch.int64)
    wide[:, 2:2 + argmax.shape[1]] = argmax
    view = wide[:, 2:2 + argmax.shape[1]]
    got = native_cpu.verify_greedy_stacked(packed.tokens, packed.parents, packed.num_nodes, packed.num_roots, view,
                                           packed.max_depth, packed.max_next_roots)
    assert torch.equal(got, verify.verify_greedy_batched_reference(packed, argmax).stacked())


def test_the_cpu_dispatch(monkeypatch):
    """Without SPECSERVE_VERIFY, CPU tensors take the native walk where it builds (a stacked buffer
    behind the fields), else the torch reference; SPECSERVE_VERIFY=reference forces the reference;
    a wrong value is refused."""
    from specserve.engine import verify

    monkeypatch.delenv("SPECSERVE_VERIFY", raising=False)
    _, packed, argmax = cases()[0]
    assert (verify.verify_greedy_batched(packed, argmax).packed_rows is not None) == native_cpu.available()
    monkeypatch.setenv("SPECSERVE_VERIFY", "reference")
    assert verify.verify_greedy_batched(packed, argmax).packed_rows is None
    monkeypatch.setenv("SPECSERVE_VERIFY", "fast")
    with pytest.raises(ValueError, match="SPECSERVE_VERIFY"):
        verify.verify_greedy_batched(packed, argmax)


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="needs a CUDA device and triton")
def test_kernel_equals_the_reference_on_cuda(monkeypatch):
    monkeypatch.delenv("SPECSERVE_VERIFY", raising=False)      # the dispatch's own choice on CUDA
    for _, packed, argmax in cases("cuda"):
        compare(packed, argmax)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # tests/, for helpers
    print(json.dumps(run_interpreted()))
