"""y = x W^T (+ b) for a few rows of x on CUDA (Triton), beside its torch reference.

A batch-1 decode step multiplies one row by each projection: cuBLAS's kernels for that shape read
the weights at a small share of the memory's bandwidth (on an H100, ~3.7 µs for a 576 x 3072 bf16
projection that the bandwidth would read in ~1.2 µs), and a step has four such products per layer.
This kernel spreads the output columns over many programs, each streaming its [BLOCK_N, K] slice
of W once for all M <= 4 rows, and sums in fp32 (`skinny_linear_reference`: the same maths in
torch, fp32 sums over K, one rounding to the output's dtype).

Each (N, K, rows, dtype) picks its tile on its first call on CUDA: every config of `CONFIGS` timed
with CUDA events, the fastest kept (`tuned`); under Triton's interpreter the first config. The
engine's model uses it where `ENABLED` (SPECSERVE_SKINNY_GEMM=1; off by default until measured) for
2-D bf16/fp16 CUDA inputs of at most `MAX_ROWS` rows (`engine.model.linear`).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

ENABLED = os.environ.get("SPECSERVE_SKINNY_GEMM") == "1"
MAX_ROWS = 4
MAX_COLS = 16384     # wider outputs (an LM head) stay with cuBLAS, which reads them at full bandwidth
# (BLOCK_N, BLOCK_K, num_warps)
CONFIGS = [(16, 128, 4), (16, 256, 4), (32, 128, 4), (32, 64, 2), (8, 256, 2), (64, 64, 4), (16, 64, 2),
           (32, 256, 8)]
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

tuned: dict[tuple, tuple[int, int, int]] = {}   # (N, K, M_PAD, dtype) -> the config its first call chose
timings: dict[tuple, dict[tuple[int, int, int], float]] = {}   # ... -> µs per config, as measured then


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                   HAS_BIAS: tl.constexpr, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, M_PAD)
    ok_n = cols < N
    ok_m = rows < M
    acc = tl.zeros([M_PAD, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        ok_k = ks < K
        w = tl.load(w_ptr + cols[:, None] * stride_wn + ks[None, :], mask=ok_n[:, None] & ok_k[None, :], other=0.0)
        x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=ok_m[:, None] & ok_k[None, :], other=0.0)
        acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=ok_n, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=ok_m[:, None] & ok_n[None, :])


def usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `skinny_linear` takes this product (`engine.model.linear` asks, where `ENABLED`)."""
    return (x.is_cuda and x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and x.dtype in (torch.bfloat16, torch.float16)
            and weight.dtype == x.dtype and weight.dim() == 2 and weight.shape[0] <= MAX_COLS
            and weight.stride(1) == 1 and x.stride(1) == 1)


def _launch(x, weight, bias, out, config) -> None:
    M, K = x.shape
    N = weight.shape[0]
    block_n, block_k, warps = config
    _skinny_kernel[(triton.cdiv(N, block_n),)](
        x, weight, bias if bias is not None else weight, out, M, N, K, x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, M_PAD=triton.next_power_of_2(M), BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=warps)


def _tune(x, weight, bias, out, key) -> tuple[int, int, int]:
    """The fastest of `CONFIGS` for this shape, each timed over 20 launches after a warm-up."""
    results = {}
    for config in CONFIGS:
        try:
            _launch(x, weight, bias, out, config)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(20):
                _launch(x, weight, bias, out, config)
            end.record()
            end.synchronize()
            results[config] = start.elapsed_time(end) * 1e3 / 20
        except Exception:   # a config this device cannot run (registers, shared memory)
            continue
    timings[key] = results
    return min(results, key=results.get)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M <= MAX_ROWS, K] @ weight [N, K]^T (+ bias [N]) -> [M, N] in x's dtype."""
    M, K = x.shape
    N = weight.shape[0]
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    key = (N, K, triton.next_power_of_2(M), x.dtype)
    config = tuned.get(key)
    if config is None:
        capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
        config = CONFIGS[0] if _INTERPRETED or not x.is_cuda or capturing else _tune(x, weight, bias, out, key)
        tuned[key] = config
    _launch(x, weight, bias, out, config)
    return out


def skinny_linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    y = x.float() @ weight.float().t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
