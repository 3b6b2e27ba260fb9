"""Weight-only quantized matmuls on CUDA (Triton), each beside its torch reference.

`engine/quant.py` quantizes a CUDA model's projections to these layouts (`--quantization` on a GPU):

* **int4**, a scale and an offset per group of 32 inputs, w = q * s + lo (a GGUF Q4_1 block's
  d q + m), q in 0..15, s and lo fp16. Codes are packed two to a byte within each block of 64
  inputs: byte [n, 32 b + j] = q[n, 64 b + j] | q[n, 64 b + 32 + j] << 4, so the low nibbles of a
  block's 32 bytes are its first group and the high nibbles its second (`pack_int4`).
* **int8**, one scale per output row, w = q * s (`pack_int8`).

A program computes a [BLOCK_M, BLOCK_N] tile of y = x W^T: for each block of inputs it loads the
codes once, widens them to fp32 (`q * s + lo`, one rounding), casts to the activations' dtype and
multiplies with `tl.dot` (fp32 accumulation; fp32 activations multiply in IEEE fp32, not tf32).
So the weights are read as 4 or 8 bits, and a verification step of a few rows reads them once.
The references (`int4_reference`, `int8_reference`) dequantize, cast the same way and matmul in
fp32. Tested on the CPU under Triton's interpreter and on CUDA with `-m gpu`
(`tests/unit/kernels/test_quant_gemm.py`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.kernels.cpu import int4_weight

GROUP = 32      # inputs per int4 group
BLOCK_K = 64    # inputs per packed int4 block (two groups)


def pack_int4(codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """codes [N, K] in 0..15, scales and offsets [N, K / 32] -> (packed uint8 [N, K / 2], scales and
    offsets fp16 [N, K / 32, 2]); K a multiple of 64."""
    n, k = codes.shape
    q = codes.to(torch.uint8).reshape(n, k // BLOCK_K, 2, GROUP)
    packed = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, k // 2).contiguous()
    return packed, torch.stack([scales, offsets], dim=-1).to(torch.float16).contiguous()


def unpack_int4(packed: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
    """The fp32 weight [N, K] of `pack_int4`'s layout: q * s + lo, rounded once."""
    n, half = packed.shape
    blocks = packed.reshape(n, half // GROUP, 1, GROUP)
    q = torch.cat([blocks & 15, blocks >> 4], dim=2).reshape(n, half * 2)
    return int4_weight(q, *sz.unbind(-1))


def pack_int8(codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """codes int8 [N, K], scales [N] -> (codes, scales fp32 [N])."""
    return codes.to(torch.int8).contiguous(), scales.float().contiguous()


def int4_reference(x: torch.Tensor, packed: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ W^T for `pack_int4`'s W: dequantized in fp32, cast to x's dtype, fp32 products."""
    w = unpack_int4(packed.cpu(), sz.cpu()).to(x.device).to(x.dtype)
    return (x.float() @ w.float().T).to(x.dtype)


def int8_reference(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return ((x.float() @ codes.to(x.dtype).float().T) * scales.float()).to(x.dtype)


@triton.jit
def _int4_kernel(x_ptr, c_ptr, sz_ptr, y_ptr, M, N, K, stride_x, stride_c, stride_y,
                 IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    j = tl.arange(0, 32)
    m_ok, n_ok = rm < M, rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    groups = K // 32
    for b in range(0, K // 64):
        x_lo = tl.load(x_ptr + rm[:, None] * stride_x + b * 64 + j[None, :], mask=m_ok[:, None], other=0.0)
        x_hi = tl.load(x_ptr + rm[:, None] * stride_x + b * 64 + 32 + j[None, :], mask=m_ok[:, None], other=0.0)
        c = tl.load(c_ptr + rn[:, None] * stride_c + b * 32 + j[None, :], mask=n_ok[:, None], other=0).to(tl.int32)
        sz = sz_ptr + rn * (groups * 2) + b * 4
        s_lo = tl.load(sz, mask=n_ok, other=0.0).to(tl.float32)
        z_lo = tl.load(sz + 1, mask=n_ok, other=0.0).to(tl.float32)
        s_hi = tl.load(sz + 2, mask=n_ok, other=0.0).to(tl.float32)
        z_hi = tl.load(sz + 3, mask=n_ok, other=0.0).to(tl.float32)
        w_lo = tl.fma((c & 15).to(tl.float32), s_lo[:, None], z_lo[:, None]).to(x_lo.dtype)
        w_hi = tl.fma((c >> 4).to(tl.float32), s_hi[:, None], z_hi[:, None]).to(x_hi.dtype)
        if IEEE:
            acc += tl.dot(x_lo, tl.trans(w_lo), input_precision="ieee")
            acc += tl.dot(x_hi, tl.trans(w_hi), input_precision="ieee")
        else:
            acc += tl.dot(x_lo, tl.trans(w_lo))
            acc += tl.dot(x_hi, tl.trans(w_hi))
    tl.store(y_ptr + rm[:, None] * stride_y + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _int8_kernel(x_ptr, c_ptr, s_ptr, y_ptr, M, N, K, stride_x, stride_c, stride_y,
                 IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok, n_ok = rm < M, rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = k0 + rk < K
        x = tl.load(x_ptr + rm[:, None] * stride_x + k0 + rk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        c = tl.load(c_ptr + rn[:, None] * stride_c + k0 + rk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0)
        w = c.to(tl.float32).to(x.dtype)     # |q| <= 127: exact in bf16 and fp16
        if IEEE:
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    s = tl.load(s_ptr + rn, mask=n_ok, other=0.0)
    tl.store(y_ptr + rm[:, None] * stride_y + rn[None, :], (acc * s[None, :]).to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def _matmul(kernel, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, **meta) -> torch.Tensor:
    """Launch `kernel` for y [M, N] = x [M, K] @ W^T in x's dtype: tiles of (16, 32 or 64) x 64
    outputs (tl.dot needs 16 or more; a decode or verification step has few rows)."""
    x = x.contiguous()
    m, k = x.shape
    n = codes.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    bm, bn = (16 if m <= 16 else 32 if m <= 32 else 64), 64
    kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
        x, codes, scales, y, m, n, k, x.stride(0), codes.stride(0), y.stride(0),
        IEEE=x.dtype == torch.float32, BLOCK_M=bm, BLOCK_N=bn, **meta)
    return y


def int4_matmul(x: torch.Tensor, packed: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
    """x [M, K] (fp32, bf16 or fp16) @ W^T -> [M, N] in x's dtype, W in `pack_int4`'s layout."""
    return _matmul(_int4_kernel, x, packed, sz)


def int8_matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ W^T -> [M, N] in x's dtype, W = codes * scales[:, None] (`pack_int8`)."""
    return _matmul(_int8_kernel, x, codes, scales, BLOCK_K=64)


__all__ = ["BLOCK_K", "GROUP", "int4_matmul", "int4_reference", "int8_matmul", "int8_reference", "pack_int4",
           "pack_int8", "unpack_int4"]
