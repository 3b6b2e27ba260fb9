"""kernels/kv_compact.py: the tree commit (`compact_tree_kv`) and the flat one (`compact_kv`).

* The torch reference equals the old host-side slot computation of `commit_accepted` (the loop
  is kept below as the oracle) on random batches: block sizes 1, 4 and 16, chains, trees,
  forests (roots > 0), root-only paths, fp32/bf16/fp16, shuffled block tables padded with a
  block another sequence owns, strided paths and K/V; nothing outside the moved destinations
  changes, and nothing is read back to the host.
* The native CPU kernel (kernels/cpu.py `compact_tree_kv`, the CPU's default) equals the old loop
  on the same batches, in this process, directly and through the dispatch; a cache whose rows are
  not contiguous takes the reference.
* The Triton kernels equal the reference on the same batches: on CPU tensors under
  TRITON_INTERPRET=1 in a subprocess (triton reads that variable when kernels are defined, so it
  must not leak into this process), and on CUDA in the `gpu` tests.

Run `python test_kv_compact.py --interpret` (with TRITON_INTERPRET=1) to run the interpreter
checks by hand.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

from specserve.kernels import cpu as native_cpu
from specserve.kernels import kv_compact
from specserve.kernels.kv_compact import (
    compact_kv, compact_kv_reference, compact_tree_kv, compact_tree_kv_reference,
)

HAS_TRITON = importlib.util.find_spec("triton") is not None
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BLOCK_SIZES = (1, 4, 16)
KINDS = ("chain", "tree", "forest", "root_only", "forest_root_only")
PAD_BLOCK = 0   # block tables are padded with a block that some sequence owns


@dataclass
class Batch:
    kv: torch.Tensor             # [2, L, slots, H, D]
    block_tables: torch.Tensor   # [T, max_blocks]
    block_size: int
    prefix_lens: torch.Tensor    # [T]
    paths: torch.Tensor          # [T, P], -1 padded
    path_lens: torch.Tensor      # [T]
    tables: list[list[int]]      # host copies for the oracle
    prefixes: list[int]
    accepted: list[list[int]]

    def args(self, kv: torch.Tensor | None = None):
        return (self.kv if kv is None else kv, self.block_tables, self.block_size, self.prefix_lens, self.paths,
                self.path_lens)


def random_path(g: torch.Generator, kind: str, num_nodes: int) -> list[int]:
    """An accepted path (increasing node indices, root first) in a tree/forest of num_nodes nodes."""
    def subset(lo: int) -> list[int]:
        rest = torch.arange(lo, num_nodes)
        keep = rest[torch.rand(len(rest), generator=g) < 0.5]
        return keep.tolist()

    num_roots = min(num_nodes, 1 + int(torch.randint(1, 4, (), generator=g)))
    if kind == "chain":
        return list(range(int(torch.randint(1, num_nodes + 1, (), generator=g))))
    if kind == "tree":
        return [0] + subset(1)
    root = int(torch.randint(1, num_roots, (), generator=g)) if num_roots > 1 else 0
    if kind == "forest":
        return [root] + subset(num_roots)
    if kind == "forest_root_only":
        return [root]
    return [0]   # root_only


def make_batch(seed: int, block_size: int, dtype: torch.dtype, device: str = "cpu", *, num_layers: int = 2,
               num_kv_heads: int = 2, head_dim: int = 4, num_seqs: int = 6, max_nodes: int = 12,
               max_prefix: int = 30, int32_tables: bool = False, strided: bool = False) -> Batch:
    g = torch.Generator().manual_seed(seed)
    kinds = [KINDS[i % len(KINDS)] for i in range(num_seqs)]
    prefixes = torch.randint(0, max_prefix + 1, (num_seqs,), generator=g).tolist()
    nodes = torch.randint(1, max_nodes + 1, (num_seqs,), generator=g).tolist()
    accepted = [random_path(g, k, n) for k, n in zip(kinds, nodes)]
    need = [-(-(p + n) // block_size) for p, n in zip(prefixes, nodes)]
    pool = torch.randperm(sum(need) + 3, generator=g).tolist()   # shuffled, non-contiguous blocks
    tables = []
    for n in need:
        tables.append(pool[:n])
        pool = pool[n:]
    max_blocks = max(need) + 1
    num_slots = (sum(need) + 3) * block_size
    width = max(len(a) for a in accepted) + 2   # extra padding columns

    kv = torch.randn(2, num_layers, num_slots, num_kv_heads, head_dim + (3 if strided else 0), generator=g)
    kv = kv.to(dtype).to(device)
    if strided:   # K/V whose head rows are not contiguous
        kv = kv[..., :head_dim]
    paths = torch.full((num_seqs, width + (5 if strided else 0)), -1, dtype=torch.int64)
    for t, a in enumerate(accepted):
        paths[t, :len(a)] = torch.tensor(a)
    paths = paths.to(device)
    if strided:   # a view with row stride != width
        paths = paths[:, :width]
    block_tables = torch.full((num_seqs, max_blocks), PAD_BLOCK, dtype=torch.int32 if int32_tables else torch.int64)
    for t, table in enumerate(tables):
        block_tables[t, :len(table)] = torch.tensor(table)
    return Batch(kv, block_tables.to(device), block_size, torch.tensor(prefixes, device=device), paths,
                 torch.tensor([len(a) for a in accepted], device=device), tables, prefixes, accepted)


def old_loop_pairs(tables: list[list[int]], block_size: int, prefixes: list[int],
                   accepted: list[list[int]]) -> tuple[list[int], list[int]]:
    """The slot computation `commit_accepted` did on the host before the device commit: the oracle."""
    def slot(table: list[int], position: int) -> int:
        return table[position // block_size] * block_size + position % block_size

    src, dst = [], []
    for table, prefix, path in zip(tables, prefixes, accepted):
        for i, node in enumerate(path):
            if node != i:
                src.append(slot(table, prefix + node))
                dst.append(slot(table, prefix + i))
    return src, dst


def expected_kv(b: Batch) -> tuple[torch.Tensor, list[int]]:
    src, dst = old_loop_pairs(b.tables, b.block_size, b.prefixes, b.accepted)
    out = b.kv.clone()
    device = b.kv.device
    compact_kv_reference(out, torch.tensor(src, dtype=torch.int64, device=device),
                         torch.tensor(dst, dtype=torch.int64, device=device))
    return out, dst


def assert_untouched_elsewhere(before: torch.Tensor, after: torch.Tensor, dst: list[int]) -> None:
    keep = torch.ones(before.shape[2], dtype=torch.bool, device=before.device)
    keep[torch.tensor(dst, dtype=torch.int64, device=before.device)] = False
    assert torch.equal(before[:, :, keep], after[:, :, keep])


def check_tree_impl(impl, b: Batch) -> None:
    want, dst = expected_kv(b)
    got = b.kv.clone()
    impl(*b.args(got))
    assert torch.equal(got, want)
    assert_untouched_elsewhere(b.kv, got, dst)


def tree_cases(device: str = "cpu"):
    """pytest.param(Batch, id=...): every block size and dtype, int64 or int32 tables, strided or not."""
    seed = 0
    for block_size in BLOCK_SIZES:
        for dtype in DTYPES:
            for int32_tables, strided in ((False, False), (True, True)):
                seed += 1
                yield pytest.param(
                    make_batch(seed, block_size, dtype, device, int32_tables=int32_tables, strided=strided),
                    id=f"bs{block_size}-{str(dtype)[6:]}-{'i32-strided' if strided else 'i64'}")


def flat_cases(device: str = "cpu"):
    """pytest.param(kv, src, dst, id=...): overlapping pairs (a cycle of moves, a shift left)."""
    g = torch.Generator().manual_seed(7)
    for dtype in DTYPES:
        kv = torch.randn(2, 3, 40, 3, 5, generator=g).to(dtype).to(device)
        perm = torch.randperm(40, generator=g)
        src, dst = perm[:17], perm[:17].roll(1)   # every destination is also a source
        yield pytest.param(kv, src.to(device), dst.to(device), id=f"cycle-{str(dtype)[6:]}")
    kv = torch.randn(2, 1, 8, 1, 2, generator=g).to(device)
    yield pytest.param(kv, torch.arange(1, 8, device=device), torch.arange(0, 7, device=device), id="shift-left")


# ------------------------------------------------------------------------------------------------
# the torch reference (CPU)
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("batch", tree_cases())
def test_reference_equals_old_host_loop(batch):
    check_tree_impl(compact_tree_kv_reference, batch)


def test_example_from_commit_accepted_docstring():
    """Prefix 5, nodes at 5..9, accepted [0, 2, 4]: positions 7 and 9 move to 6 and 7."""
    kv = torch.arange(2 * 1 * 12, dtype=torch.float32).view(2, 1, 12, 1, 1)
    before = kv.clone()
    compact_tree_kv_reference(kv, torch.tensor([[0, 1, 2]]), 4, torch.tensor([5]), torch.tensor([[0, 2, 4]]),
                              torch.tensor([3]))
    want = before.clone()
    want[:, :, 6], want[:, :, 7] = before[:, :, 7], before[:, :, 9]
    assert torch.equal(kv, want)


def test_nothing_moves_for_root_only_or_empty_batches():
    b = make_batch(3, 4, torch.float32)
    roots = torch.full_like(b.paths, -1)
    roots[:, 0] = 0
    kv = b.kv.clone()
    compact_tree_kv_reference(kv, b.block_tables, 4, b.prefix_lens, roots, torch.ones_like(b.path_lens))
    compact_tree_kv_reference(kv, b.block_tables, 4, b.prefix_lens, b.paths, torch.zeros_like(b.path_lens))
    compact_tree_kv_reference(kv, b.block_tables[:0], 4, b.prefix_lens[:0], b.paths[:0], b.path_lens[:0])
    assert torch.equal(kv, b.kv)


def test_reference_reads_nothing_back_to_the_host(monkeypatch):
    def refuse(*_args, **_kwargs):
        raise AssertionError("host sync")

    b = make_batch(5, 4, torch.float32)
    want, _ = expected_kv(b)
    for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__index__", "nonzero"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    kv = b.kv.clone()
    compact_tree_kv_reference(*b.args(kv))
    monkeypatch.undo()
    assert torch.equal(kv, want)


@pytest.mark.parametrize("kv,src,dst", flat_cases())
def test_flat_reference_gathers_before_it_scatters(kv, src, dst):
    want = kv.clone()
    want[:, :, dst] = kv[:, :, src].clone()
    compact_kv_reference(kv, src, dst)
    assert torch.equal(kv, want)


def test_dispatch(monkeypatch):
    cpu = torch.zeros(2, 1, 4, 1, 1)
    monkeypatch.delenv(kv_compact.BACKEND_ENV, raising=False)
    assert kv_compact._backend(cpu) == ("native" if native_cpu.available() else "reference")
    assert kv_compact._backend(torch.zeros(2, 1, 4, 1, 3)[..., :1]) == "reference"   # rows not contiguous
    monkeypatch.setenv(kv_compact.BACKEND_ENV, "reference")
    assert kv_compact._backend(cpu) == "reference"
    if native_cpu.available():
        monkeypatch.setenv(kv_compact.BACKEND_ENV, "native")
        assert kv_compact._backend(cpu) == "native"
        assert kv_compact._backend(torch.zeros(2, 1, 4, 1, 3)[..., :1]) == "reference"   # a layout it cannot take
    monkeypatch.setenv(kv_compact.BACKEND_ENV, "tensor-cores")
    with pytest.raises(ValueError):
        kv_compact._backend(cpu)
    monkeypatch.setenv(kv_compact.BACKEND_ENV, "reference")
    b = make_batch(11, 16, torch.float32)
    check_tree_impl(compact_tree_kv, b)


# ------------------------------------------------------------------------------------------------
# the native CPU kernel
# ------------------------------------------------------------------------------------------------

needs_native = pytest.mark.skipif(not native_cpu.available(), reason="the native CPU kernels do not build here")


@needs_native
@pytest.mark.parametrize("batch", tree_cases())
def test_native_equals_old_host_loop(batch, monkeypatch):
    check_tree_impl(native_cpu.compact_tree_kv, batch)
    monkeypatch.delenv(kv_compact.BACKEND_ENV, raising=False)
    check_tree_impl(compact_tree_kv, batch)        # the CPU dispatch's own choice


@needs_native
def test_native_moves_nothing_for_identity_paths_and_reads_strided_paths():
    """A chain's prefix (every pair an identity) and root-only paths leave the cache as it was; a
    strided view of the paths (as `BatchVerifyResult.path` is, inside the stacked rows) is read right."""
    b = make_batch(3, 4, torch.float32)
    chain = torch.full_like(b.paths, -1)
    chain[:, :3] = torch.arange(3)
    kv = b.kv.clone()
    native_cpu.compact_tree_kv(kv, b.block_tables, 4, b.prefix_lens, chain, torch.full_like(b.path_lens, 3))
    native_cpu.compact_tree_kv(kv, b.block_tables, 4, b.prefix_lens, b.paths, torch.zeros_like(b.path_lens))
    assert torch.equal(kv, b.kv)
    wide = torch.full((b.paths.shape[0], b.paths.shape[1] + 4), -1, dtype=torch.int64)
    wide[:, 1:1 + b.paths.shape[1]] = b.paths
    strided = dataclasses.replace(b, paths=wide[:, 1:1 + b.paths.shape[1]])
    check_tree_impl(native_cpu.compact_tree_kv, strided)


# ------------------------------------------------------------------------------------------------
# the Triton kernels under the interpreter (CPU, subprocess)
# ------------------------------------------------------------------------------------------------

def run_interpreter_checks() -> None:
    """Every case through the Triton kernels (the first also through the dispatch, forced to triton);
    raises on a mismatch."""
    assert os.environ.get("TRITON_INTERPRET") == "1" and os.environ.get(kv_compact.BACKEND_ENV) == "triton"
    assert kv_compact._backend(torch.zeros(1)) == "triton"
    for n, case in enumerate(tree_cases()):
        (b,), case_id = case.values, case.id
        for impl in (kv_compact.compact_tree_kv_triton, compact_tree_kv)[:2 if n == 0 else 1]:
            try:
                check_tree_impl(impl, b)
            except AssertionError as e:
                raise AssertionError(f"tree case {case_id} ({impl.__name__})") from e
    for n, case in enumerate(flat_cases()):
        (kv, src, dst), case_id = case.values, case.id
        want = kv.clone()
        compact_kv_reference(want, src, dst)
        for impl in (kv_compact.compact_kv_triton, compact_kv)[:2 if n == 0 else 1]:
            got = kv.clone()
            impl(got, src, dst)
            assert torch.equal(got, want), f"flat case {case_id} ({impl.__name__})"


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_triton_kernels_equal_the_reference_under_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", **{kv_compact.BACKEND_ENV: "triton"})
    proc = subprocess.run([sys.executable, __file__, "--interpret"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    assert "interpreter checks passed" in proc.stdout


# ------------------------------------------------------------------------------------------------
# CUDA
# ------------------------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="needs a CUDA device and triton")


@functools.cache
def cuda_tree_cases() -> list:
    return list(tree_cases("cuda"))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("impl", ["reference", "triton", "dispatch"])
@pytest.mark.parametrize("case", range(len(BLOCK_SIZES) * len(DTYPES) * 2))
def test_tree_commit_on_cuda(case, impl, monkeypatch):
    monkeypatch.delenv(kv_compact.BACKEND_ENV, raising=False)
    (b,) = cuda_tree_cases()[case].values
    assert kv_compact._backend(b.kv) == "triton"
    check_tree_impl({"reference": compact_tree_kv_reference, "triton": kv_compact.compact_tree_kv_triton,
                     "dispatch": compact_tree_kv}[impl], b)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_tree_commit_on_cuda_at_model_size(dtype, monkeypatch):
    """SmolLM2-135M's cache shape (30 layers, 3 KV heads of 64), 16 sequences of up to 32 nodes."""
    monkeypatch.delenv(kv_compact.BACKEND_ENV, raising=False)
    b = make_batch(99, 16, dtype, "cuda", num_layers=30, num_kv_heads=3, head_dim=64, num_seqs=16, max_nodes=32,
                   max_prefix=500, int32_tables=True)
    check_tree_impl(compact_tree_kv, b)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", range(len(DTYPES) + 1))
def test_flat_commit_on_cuda(case, monkeypatch):
    monkeypatch.delenv(kv_compact.BACKEND_ENV, raising=False)
    kv, src, dst = list(flat_cases("cuda"))[case].values
    want = kv.clone()
    compact_kv_reference(want, src, dst)
    for impl in (kv_compact.compact_kv_triton, compact_kv):
        got = kv.clone()
        impl(got, src, dst)
        assert torch.equal(got, want), impl.__name__


def with_path_width(b: Batch, width: int) -> Batch:
    """`b` with its paths padded (or cut) to `width` columns; width >= its longest path."""
    paths = torch.full((b.paths.shape[0], width), -1, dtype=b.paths.dtype, device=b.paths.device)
    keep = min(width, b.paths.shape[1])
    paths[:, :keep] = b.paths[:, :keep]
    return dataclasses.replace(b, paths=paths)


@pytest.mark.gpu
@needs_cuda
def test_other_batch_shapes_compile_nothing_on_cuda(monkeypatch):
    """Compiled once, the tree commit serves batches of any number of sequences, path width and
    block-table width (1, a multiple of 16, neither) without compiling again: the accepted paths
    change length every step, and a compile mid-serving is a step that waits for the compiler."""
    from specserve.bench.gpu import TritonCompiles

    monkeypatch.delenv(kv_compact.BACKEND_ENV, raising=False)
    model = dict(num_layers=30, num_kv_heads=3, head_dim=64, int32_tables=True)
    batches = [make_batch(40, 16, torch.bfloat16, "cuda", num_seqs=3, max_nodes=6, max_prefix=40, **model),
               with_path_width(make_batch(41, 16, torch.bfloat16, "cuda", num_seqs=1, max_nodes=1, max_prefix=0,
                                          **model), 1),
               with_path_width(make_batch(42, 16, torch.bfloat16, "cuda", num_seqs=16, max_nodes=12,
                                          max_prefix=230, **model), 16),
               make_batch(43, 16, torch.bfloat16, "cuda", num_seqs=5, max_nodes=31, max_prefix=700, **model)]
    check_tree_impl(compact_tree_kv, batches[0])
    compiles = TritonCompiles().install()
    assert compiles.active
    try:
        for b in batches[1:]:
            check_tree_impl(compact_tree_kv, b)
    finally:
        compiles.uninstall()
    assert compiles.counts == {}, compiles.samples


if __name__ == "__main__" and sys.argv[1:] == ["--interpret"]:
    run_interpreter_checks()
    print("interpreter checks passed")
