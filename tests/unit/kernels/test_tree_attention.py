"""The Triton tree-attention kernel (kernels/tree_attention.py) against the torch reference on
random ragged batches mixing prefill chunks (with a prefix), decode rows, chains, trees, forests and
masks wider than q, over block sizes 1/4/16, GQA ratios 1/3/4, fp32/bf16/fp16 and padded head dims.

On the CPU the kernel runs under Triton's interpreter, which must be switched on
(TRITON_INTERPRET=1) before triton is first imported: this file runs itself as a script in a
subprocess with that variable set (once per session, every case in one process) and each test
reads its case's result, so nothing leaks into other test modules. `-m gpu` runs the same cases
on CUDA in the test process. Skipped when triton is not installed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path
import random

import pytest
import torch

from specserve.engine.attention import _paged_attention_loop, build_attn_metadata, paged_attention_reference

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (pip install -e '.[dev]')")

TOLERANCES = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2.5e-2}   # rtol = atol
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
KV_HEADS = {1: 2, 3: 3, 4: 1}          # GQA ratio -> kv heads (9 query heads over 3, as SmolLM2)


def ancestor_mask(parents: list[int]) -> torch.Tensor:
    """[n, n] ancestor-or-self mask of a forest given by parent indices (-1: a root)."""
    mask = torch.zeros(len(parents), len(parents), dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            mask[i] = mask[p]
        mask[i, i] = True
    return mask


def random_items(rng: random.Random, num_seqs: int = 6, max_start: int = 30):
    """(start, q, mask or None) per sequence: decode rows, prefill chunks, chains, trees, forests and
    masks wider than q (a tree grown level by level: only its last q of m nodes are new)."""
    kinds = ["decode", "decode", "prefill", "chain", "tree", "forest", "wide", "wide1"]
    items = []
    for kind in rng.sample(kinds, num_seqs):
        start = rng.randint(0, max_start)
        if kind == "decode":
            items.append((start, 1, None))
        elif kind == "prefill":
            items.append((start, rng.randint(2, 12), None))
        else:
            n = rng.randint(2, 10)
            parents = [i - 1 for i in range(n)] if kind == "chain" else \
                [-1] + [rng.randrange(-1 if kind == "forest" else 0, i) for i in range(1, n)]
            q = {"wide": rng.randint(1, n - 1), "wide1": 1}.get(kind, n)
            items.append((max(start, n - q), q, ancestor_mask(parents)[n - q:]))
    return items


def make_batch(items, block: int, kv_heads: int, group: int, dim: int, dtype, seed: int, device="cpu"):
    """q, k_cache, v_cache and metadata for `items`, blocks scattered at random in a shared pool."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-(s + q) // block) for s, q, _ in items) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, used = [], 0
    for s, q, _ in items:
        n = -(-(s + q) // block)
        tables.append(perm[used:used + n])
        used += n
    starts, qlens, masks = zip(*items)
    _, meta = build_attn_metadata(tables, block, list(starts), list(qlens), list(masks), torch.device(device))
    k_cache = torch.randn(num_blocks * block, kv_heads, dim, generator=g).to(device, dtype)
    v_cache = torch.randn(num_blocks * block, kv_heads, dim, generator=g).to(device, dtype)
    q = torch.randn(sum(qlens), kv_heads * group, dim, generator=g).to(device, dtype)
    return q, k_cache, v_cache, meta


def forest_with_late_root():
    """One 40-node forest from position 0 (m = ctx): rows under the second root (node 20) see no
    key of the first 16-key tile at all."""
    parents = [-1] + list(range(19)) + [-1] + list(range(20, 39))
    return [(0, 40, ancestor_mask(parents)), (7, 1, None)]


def cases() -> dict[str, dict]:
    """Every case by id: the batch's recipe and the kernel's key tile (16: several tiles per sequence)."""
    out = {}
    for block in (1, 4, 16):
        for group in (1, 3, 4):
            for name in DTYPES:
                seed = len(out)
                out[f"block{block}-gqa{group}-{name}"] = dict(
                    items=("random", seed), block=block, group=group, dim=16, dtype=name, block_n=16)
    out["head_dim64-default-tile"] = dict(items=("random", 100), block=16, group=3, dim=64, dtype="fp32",
                                          block_n=64, max_start=120)
    out["head_dim128-bf16"] = dict(items=("random", 101), block=4, group=4, dim=128, dtype="bf16", block_n=16)
    out["head_dim24-padded"] = dict(items=("random", 102), block=4, group=3, dim=24, dtype="fp16", block_n=16)
    out["forest-late-root"] = dict(items=("forest",), block=4, group=3, dim=16, dtype="fp32", block_n=16)
    out["decode-only"] = dict(items=("decode", 103), block=16, group=3, dim=64, dtype="fp32", block_n=16)
    out["one-prefill"] = dict(items=("prefill", 104), block=16, group=3, dim=64, dtype="bf16", block_n=16)
    return out


def case_inputs(case: dict, device="cpu"):
    kind, *seed = case["items"]
    if kind == "forest":
        items = forest_with_late_root()
    else:
        rng = random.Random(seed[0])
        if kind == "random":
            items = random_items(rng, max_start=case.get("max_start", 30))
        elif kind == "decode":
            items = [(rng.randint(0, 90), 1, None) for _ in range(5)]
        else:
            items = [(0, 37, None)]
    return make_batch(items, case["block"], KV_HEADS[case["group"]], case["group"], case["dim"],
                      DTYPES[case["dtype"]], seed=seed[0] if seed else 0, device=device)


def compare(case: dict, device="cpu") -> None:
    """Raise unless the kernel equals the torch reference (computed in fp32 on the same inputs,
    which itself equals the per-sequence loop) within the dtype's tolerance."""
    from specserve.kernels.tree_attention import tree_attention

    q, k_cache, v_cache, meta = case_inputs(case, device)
    got = tree_attention(q, k_cache, v_cache, meta, 0.3, block_n=case["block_n"])
    want = paged_attention_reference(q.float(), k_cache.float(), v_cache.float(), meta, 0.3)
    torch.testing.assert_close(want, _paged_attention_loop(q.float(), k_cache.float(), v_cache.float(), meta, 0.3),
                               rtol=1e-5, atol=1e-5)
    assert got.dtype == q.dtype and got.shape == want.shape
    assert torch.isfinite(got).all()
    tol = TOLERANCES[q.dtype]
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)


def compare_dispatch() -> None:
    """SPECSERVE_ATTENTION=triton routes paged_attention to the kernel (set by the caller)."""
    from specserve.engine import attention

    assert attention.attention_backend(torch.device("cpu")) == "triton"
    q, k_cache, v_cache, meta = case_inputs(cases()["block4-gqa3-fp32"])
    torch.testing.assert_close(attention.paged_attention(q, k_cache, v_cache, meta, 0.3),
                               paged_attention_reference(q, k_cache, v_cache, meta, 0.3), rtol=1e-5, atol=1e-5)


def run_interpreted() -> dict[str, str | None]:
    """In this process (TRITON_INTERPRET=1 already set): every case -> None or its failure."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    checks = {name: (lambda c=c: compare(c)) for name, c in cases().items()}
    checks["dispatch"] = compare_dispatch
    from helpers import run_checks   # (here: this file also runs as a script, tests/ on the path then too)
    return run_checks(checks)


@pytest.fixture(scope="module")
def interpreted():
    from helpers import run_interpreted_child   # (not at the top: this file also runs as a script)
    return run_interpreted_child(__file__, env={"SPECSERVE_ATTENTION": "triton"})


@needs_triton
@pytest.mark.parametrize("name", [*cases(), "dispatch"])
def test_kernel_equals_reference_interpreted(interpreted, name):
    assert interpreted[name] is None, interpreted[name]


@needs_triton
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", list(cases()))
def test_kernel_equals_reference_on_cuda(name):
    compare(cases()[name], device="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("masks_on", ["cpu", "cuda"])
def test_metadata_on_cuda_equals_cpu(masks_on):
    """The one-copy staging (pinned buffer: ints then host mask bytes) gives the CPU build's fields."""
    items = random_items(random.Random(5))
    tables = [[3 * b, 3 * b + 1, 3 * b + 2, 30 + b, 40 + b, 50 + b, 60 + b, 70 + b, 80 + b, 90 + b, 99 + b]
              for b in range(len(items))]
    starts, qlens, masks = (list(x) for x in zip(*items))
    cpu_pos, cpu = build_attn_metadata(tables, 4, starts, qlens, masks, torch.device("cpu"))
    masks = [None if m is None else m.to(masks_on) for m in masks]
    cuda_pos, cuda = build_attn_metadata(tables, 4, starts, qlens, masks, torch.device("cuda"))
    assert torch.equal(cuda_pos.cpu(), cpu_pos)
    for name in ("slot_mapping", "block_tables", "cu_query_lens_t", "context_lens_t",
                 "mask_offsets", "mask_widths", "mask_data"):
        assert getattr(cuda, name).device.type == "cuda"
        assert torch.equal(getattr(cuda, name).cpu(), getattr(cpu, name)), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_other_batch_shapes_compile_nothing_on_cuda():
    """Compiled once for a (dtype, block configuration), the kernel serves decode batches of any
    number of sequences and any block-table width (1, a multiple of 16, neither) without compiling
    again: a compile mid-serving is a step that waits a second for the compiler."""
    from specserve.bench.gpu import TritonCompiles
    from specserve.kernels.tree_attention import tree_attention

    # (sequences, start): tables 3, 1, 16 and 44 blocks wide
    batches = [make_batch([(start, 1, None)] * n, 16, 3, 3, 64, torch.bfloat16, seed=i, device="cuda")
               for i, (n, start) in enumerate([(2, 40), (1, 10), (16, 255), (5, 700)])]
    tree_attention(*batches[0][:3], batches[0][3], 0.125)
    torch.cuda.synchronize()
    compiles = TritonCompiles().install()
    assert compiles.active
    try:
        for q, k_cache, v_cache, meta in batches[1:]:
            tree_attention(q, k_cache, v_cache, meta, 0.125)
        torch.cuda.synchronize()
    finally:
        compiles.uninstall()
    assert compiles.counts == {}, compiles.samples


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # tests/, for helpers
    print(json.dumps(run_interpreted()))
