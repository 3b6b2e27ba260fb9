"""Fused element-wise kernels of a decoder layer on CUDA, each beside its torch reference.

A decode step of a small model is bound by kernel launches, not by arithmetic: a layer written in
torch ops runs ~30 kernels (RMSNorm alone is seven: cast, square, mean, add, rsqrt, multiply,
cast and scale). These kernels do the same maths in one launch each, in fp32 registers, rounding
where the torch code rounds, so that a bf16 layer gives the reference's values up to the order of
fp32 sums:

    rms_norm(x, w)              = w * (x * rsqrt(mean(x²) + eps)).to(dtype)          (x in fp32)
    add_rms_norm(x, r, w)       = (rms_norm(h, w), h)   with h = (x + r).to(dtype)
    silu_mul(gu)                = silu(g).to(dtype) * u, gu = [g | u] along the last dimension
    rope_and_cache(qkv, ...)    q, k rotated by `engine.model.apply_rope_rows` (x*cos + roll(x)*sin',
                                each product rounded, then the sum), q returned, k and v written to
                                the cache slots of their rows

One program per row (RMSNorm, SiLU-mul) or per (row, head) (RoPE). `ENABLED` switches the model's
use of them (engine/model.py: CUDA tensors only; SPECSERVE_FUSED=0 turns them off); the references
are what the CPU runs.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

ENABLED = os.environ.get("SPECSERVE_FUSED") != "0"     # SPECSERVE_FUSED=0: the model runs the torch ops


# ---- RMSNorm, with the residual add before it ---------------------------------------------------


@triton.jit
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, h_ptr, n_cols, eps,
                     stride_x, stride_r, stride_o, stride_h,
                     HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RES:
        r = tl.load(r_ptr + row * stride_r + cols, mask=ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(h_ptr.dtype.element_ty)    # h, rounded as torch's add
        tl.store(h_ptr + row * stride_h + cols, x, mask=ok)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0)
    y = (xf * inv).to(x.dtype).to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """[T, H] -> [T, H]; `rms_norm_reference`'s values."""
    out = torch.empty_like(x)
    T, H = x.shape
    _rms_norm_kernel[(T,)](x, x, weight, out, out, H, eps, x.stride(0), 0, out.stride(0), 0,
                           HAS_RES=False, BLOCK=triton.next_power_of_2(H))
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual), [T, H] each; `add_rms_norm_reference`'s values."""
    out, h = torch.empty_like(x), torch.empty_like(x)
    T, H = x.shape
    _rms_norm_kernel[(T,)](x, residual, weight, out, h, H, eps, x.stride(0), residual.stride(0), out.stride(0),
                           h.stride(0), HAS_RES=True, BLOCK=triton.next_power_of_2(H))
    return out, h


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def add_rms_norm_reference(x, residual, weight, eps):
    h = residual + x
    return rms_norm_reference(h, weight, eps), h


# ---- SiLU(gate) * up ----------------------------------------------------------------------------


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, n_cols, stride_gu, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n_cols
    g = tl.load(gu_ptr + row * stride_gu + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * stride_gu + n_cols + cols, mask=ok, other=0.0).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (s * u).to(out_ptr.dtype.element_ty), mask=ok)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] -> [T, I]; `silu_mul_reference`'s values."""
    T, two_i = gate_up.shape
    n = two_i // 2
    out = torch.empty(T, n, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(n))
    _silu_mul_kernel[(T, triton.cdiv(n, block))](gate_up, out, n, gate_up.stride(0), out.stride(0), BLOCK=block)
    return out


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


# ---- RoPE of q and k, k and v into the cache ----------------------------------------------------


@triton.jit(do_not_specialize_on_alignment=["slot_ptr"])   # a view into the step's staging buffer
def _rope_cache_kernel(qkv_ptr, cos_ptr, sin_ptr, slot_ptr, q_ptr, k_ptr, v_ptr,
                       stride_qkv, stride_cos, stride_sin, stride_q, stride_qh, stride_kt, stride_kh,
                       stride_vt, stride_vh,
                       NUM_HEADS: tl.constexpr, NUM_KV: tl.constexpr, HEAD_DIM: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    d = tl.arange(0, HEAD_DIM)
    base = qkv_ptr + row * stride_qkv + head * HEAD_DIM
    x = tl.load(base + d)
    xr = tl.load(base + (d + HEAD_DIM // 2) % HEAD_DIM)                     # torch.roll by D/2
    c = tl.load(cos_ptr + row * stride_cos + d)
    s = tl.load(sin_ptr + row * stride_sin + d)
    a = (x.to(tl.float32) * c.to(tl.float32)).to(x.dtype).to(tl.float32)
    b = (xr.to(tl.float32) * s.to(tl.float32)).to(x.dtype).to(tl.float32)
    y = (a + b).to(x.dtype)
    if head < NUM_HEADS:
        tl.store(q_ptr + row * stride_q + head * stride_qh + d, y)
    else:
        kv = head - NUM_HEADS
        slot = tl.load(slot_ptr + row)
        tl.store(k_ptr + slot * stride_kt + kv * stride_kh + d, y)
        v = tl.load(qkv_ptr + row * stride_qkv + (NUM_HEADS + NUM_KV + kv) * HEAD_DIM + d)
        tl.store(v_ptr + slot * stride_vt + kv * stride_vh + d, v)


def rope_and_cache(qkv: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, slots: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int, num_kv_heads: int,
                   head_dim: int) -> torch.Tensor:
    """qkv [T, (H + 2 Hkv) * D] -> q [T, H, D] rotated; k rotated and v written to k_cache / v_cache
    [slots, Hkv, D] at `slots` [T]. cos / sin_signed: [T, 1, D] (`engine.model.RopeRows`)."""
    T = qkv.shape[0]
    q = torch.empty(T, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    cos2, sin2 = cos.reshape(T, head_dim), sin_signed.reshape(T, head_dim)
    _rope_cache_kernel[(T, num_heads + num_kv_heads)](
        qkv, cos2, sin2, slots, q, k_cache, v_cache,
        qkv.stride(0), cos2.stride(0), sin2.stride(0), q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), NUM_HEADS=num_heads, NUM_KV=num_kv_heads, HEAD_DIM=head_dim)
    return q


def rope_and_cache_reference(qkv, cos, sin_signed, slots, k_cache, v_cache, num_heads, num_kv_heads, head_dim):
    T = qkv.shape[0]
    heads = num_heads + num_kv_heads
    x = qkv[:, :heads * head_dim].view(T, heads, head_dim)
    qk = x * cos + torch.roll(x, head_dim // 2, -1) * sin_signed
    q, k = qk.split([num_heads, num_kv_heads], dim=1)
    k_cache[slots] = k
    v_cache[slots] = qkv[:, heads * head_dim:].view(T, num_kv_heads, head_dim)
    return q


def max_errors(device: str | torch.device, dtype: torch.dtype, seed: int = 0) -> dict[str, float]:
    """Largest absolute difference between each kernel and its reference on random inputs (RMSNorm
    and SiLU-mul rows of odd widths, RoPE over GQA heads with scattered cache slots): what the tests
    bound, and what `bench gpu` checks on the machine it measures before it lets the model use them."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    def diff(a, b):
        return (a.float() - b.float()).abs().max().item()

    out = {}
    x, r, w = rand(5, 96), rand(5, 96), rand(96)
    out["rms_norm"] = diff(rms_norm(x, w, 1e-5), rms_norm_reference(x, w, 1e-5))
    got, want = add_rms_norm(x, r, w, 1e-5), add_rms_norm_reference(x, r, w, 1e-5)
    out["add_rms_norm"] = max(diff(got[0], want[0]), diff(got[1], want[1]))
    gu = rand(3, 2 * 80)
    out["silu_mul"] = diff(silu_mul(gu), silu_mul_reference(gu))
    T, H, Hkv, D, S = 6, 4, 2, 16, 40
    qkv = rand(T, (H + 2 * Hkv) * D)
    angle = torch.rand(T, 1, D, generator=g) * 6
    cos, sin = angle.cos().to(device=device, dtype=dtype), angle.sin().to(device=device, dtype=dtype)
    slots = torch.tensor([3, 7, 8, 20, 21, 39], device=device)
    caches = [rand(S, Hkv, D), rand(S, Hkv, D)]
    ref_caches = [c.clone() for c in caches]
    q = rope_and_cache(qkv, cos, sin, slots, *caches, H, Hkv, D)
    q_ref = rope_and_cache_reference(qkv, cos, sin, slots, *ref_caches, H, Hkv, D)
    out["rope_and_cache"] = max(diff(q, q_ref), *(diff(a, b) for a, b in zip(caches, ref_caches)))
    return out
