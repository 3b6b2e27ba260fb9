"""The CPU step's native kernels (`cpu_kernels.c`), each beside its torch reference.

A one-row decode step of a small model on the CPU spends as much time around its matmuls as in
them: a decoder layer written in torch ops runs ~35 of them (norms, RoPE, casts to and from the
quantized kernels' bf16, the SiLU gate, the cache write), each a dispatch of a few microseconds,
and attention over the paged cache goes through SDPA's padding and views. These kernels do a
layer's element-wise parts and its attention in four calls, in fp32:

    rms_norm(x, w)              = w * (x * rsqrt(mean(x²) + eps))                    -> out_dtype
    add_rms_norm(x, r, w)       = (rms_norm(h, w), h)   with h = x + r (fp32)
    silu_mul(gu)                = silu(g) * u, gu = [g | u] along the last dimension -> out_dtype
    rope_and_cache(qkv, ...)    q, k rotated by `engine.model.apply_rope_rows`, q returned (fp32),
                                k and v written to the cache slots of their rows
    paged_attention(q, ...)     `engine.attention.paged_attention_reference`'s maths, -> out_dtype
    attend(qkv, ...)            rope_and_cache then paged_attention, in one call

`out_dtype` is what the next matmul takes (bf16 for the quantized kernels' activations), so the
cast is part of the kernel. Every row is computed alone by the same float operations whatever the
batch (`cpu_kernels.c`): a tree row verified among others equals the same token decoded alone bit
for bit, which is what keeps greedy speculation exact when activations are rounded to bf16 — with
an fp32 KV cache, where SDPA needed float64 for it.

The library is compiled at first use with the machine's C compiler (`cc`, or $CC) for this CPU
(-march=native) and cached under ~/.cache/specserve (or $SPECSERVE_CACHE_DIR), keyed by the source,
the compiler and the CPU's flags; ~1 s. Where no compiler is found or the build fails, `available()`
is False and the model runs its torch ops. SPECSERVE_CPU_KERNELS=0 turns the kernels off.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

logger = logging.getLogger("specserve")

SOURCE = Path(__file__).with_name("cpu_kernels.c")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-shared", "-Wno-psabi"]
ENABLED = os.environ.get("SPECSERVE_CPU_KERNELS") != "0"
# a build with phase timers (`phase_times`; `specserve bench step`), cached apart from the normal one
PHASE_TIMES = os.environ.get("SPECSERVE_CPU_PHASE_TIMES") == "1"
if PHASE_TIMES:
    FLAGS = [*FLAGS, "-DSPECSERVE_PHASE_TIMES"]

_lib = None          # the loaded library; False once a build failed
_p = ctypes.c_void_p
_i64 = ctypes.c_int64
_int = ctypes.c_int
_f = ctypes.c_float
_SIGNATURES = {
    "rms_norm": [_p, _int, _p, _p, _p, _p, _int, _i64, _i64, _f, _int],
    "silu_mul": [_p, _int, _p, _int, _i64, _i64, _int],
    "rope_cache": [_p, _int, _p, _p, _p, _p, _p, _p, _int, _i64, _i64, _i64, _i64, _int],
    "paged_attention": [_p, _p, _p, _int, _p, _int, _i64, _p, _p, _p, _i64, _i64, _p, _p, _p, _i64, _i64, _i64, _f,
                        _int],
    "quant_matmul": [_int, _p, _i64, _p, _p, _p, _i64, _i64, _i64, _i64, _int],   # returns int
    "phase_times": [_p],                                                              # returns int
    "decoder_layers": [_p, _i64, _p, _p, _int, _i64, _i64, _i64, _i64, _i64, _i64, _f, _f, _p, _p, _p, _i64, _p, _p, _p,
                       _i64, _i64, _p, _p, _p, _int, _int, _p, _p, _i64],   # returns int
    "rope_cache_attention": [_p, _int, _p, _p, _p, _p, _p, _int, _p, _int, _i64, _p, _p, _p, _i64, _i64, _p, _p, _p,
                             _i64, _i64, _i64, _f, _int],
    "verify_greedy": [_p, _p, _i64, _p, _p, _p, _i64, _i64, _i64, _i64, _p],
    "compact_tree_kv": [_p, _i64, _i64, _i64, _i64, _p, _int, _i64, _i64, _i64, _p, _p, _i64, _p, _i64, _i64],
}


def _compiler() -> str | None:
    cc = os.environ.get("CC")
    if cc:
        return shutil.which(cc)
    return next((shutil.which(c) for c in ("cc", "gcc", "clang") if shutil.which(c)), None)


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def library_path(cc: str) -> Path:
    """Where the library built by `cc` for this source and CPU is cached."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), " ".join(FLAGS), version, _cpu_flags()]).encode()).hexdigest()
    root = Path(os.environ.get("SPECSERVE_CACHE_DIR") or Path.home() / ".cache" / "specserve")
    return root / "kernels" / f"cpu_kernels-{key[:16]}.so"


def _build() -> ctypes.CDLL | None:
    cc = _compiler()
    if cc is None:
        logger.info("no C compiler found: the CPU step runs its torch ops (slower)")
        return None
    path = library_path(cc)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
        os.close(fd)
        t0 = time.perf_counter()
        res = subprocess.run([cc, *FLAGS, str(SOURCE), "-o", tmp, "-lm"], capture_output=True, text=True)
        if res.returncode != 0:
            os.unlink(tmp)
            logger.warning("building the CPU kernels failed, the CPU step runs its torch ops:\n%s", res.stderr[-2000:])
            return None
        os.replace(tmp, path)    # atomic: concurrent builders each write their own file
        logger.info("built the native CPU kernels with %s in %.1f s: %s", cc, time.perf_counter() - t0, path)
    lib = ctypes.CDLL(str(path))
    for name, args in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, (_int if name in ("quant_matmul", "decoder_layers", "phase_times") else None)
    return lib


def library():
    """The loaded kernels, built on first use; None where they cannot be (no compiler, a failed build)."""
    global _lib
    if _lib is None:
        try:
            _lib = _build() or False
        except OSError as e:
            logger.warning("loading the CPU kernels failed, the CPU step runs its torch ops: %s", e)
            _lib = False
    return _lib or None


def fast_int8_dot() -> bool:
    """Whether this CPU runs the int4 x int8-activation kernel (kind 5) on a fast path: AVX-512 VNNI
    (one instruction per 64 u8 x s8 products) or AVX2 without AVX-512 (`q4a8_block_avx2`); on
    AVX-512 without VNNI, and elsewhere, its products are widened lane by lane."""
    flags = set(_cpu_flags().split())
    if "avx512f" in flags:
        return "avx512_vnni" in flags
    return {"avx2", "fma", "f16c"} <= flags


def release_thread_team() -> bool:
    """Give back the calling thread's OpenMP team (libgomp's `omp_pause_resource_all`: its worker
    threads exit; a later parallel region on this thread starts a new one). Whether a team could be
    released (False where the OpenMP runtime is not libgomp, or is too old to pause).

    Why: libgomp spins a worker waiting for its next parallel region only while it manages no more
    threads than there are CPUs; beyond that it spins 100 times and sleeps, and each region then
    pays a futex wake-up per worker. A server loads its model on one thread (which leaves a team
    there) and steps it on another (which makes a second): with as many OpenMP threads as cores,
    every step's ~200 regions then wake their workers from sleep -- measured 12-16 % slower steps
    on 2 cores. The thread that hands the model to a step loop releases its team."""
    try:
        gomp = ctypes.CDLL("libgomp.so.1", mode=os.RTLD_NOLOAD)
        pause = gomp.omp_pause_resource_all
    except (OSError, AttributeError):
        return False
    pause.argtypes, pause.restype = [_int], _int
    return pause(1) == 0      # omp_pause_soft


def available() -> bool:
    """Whether the model's CPU step uses these kernels: ENABLED and the library builds here."""
    return ENABLED and library() is not None


_BF16 = {torch.float32: 0, torch.bfloat16: 1}


def _flag(t: torch.Tensor) -> int:
    return _BF16[t.dtype]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """[T, H] (fp32 or bf16) -> [T, H] in `out_dtype` (x's by default); `rms_norm_reference`'s values."""
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=out_dtype or x.dtype)
    library().rms_norm(x.data_ptr(), _flag(x), None, None, weight.data_ptr(), out.data_ptr(), _flag(out),
                       x.shape[0], x.shape[1], eps, torch.get_num_threads())
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(h) in `out_dtype`, h) with h = x + residual in fp32 (x fp32 or bf16, residual fp32)."""
    x, residual = x.contiguous(), residual.contiguous()
    h = torch.empty(residual.shape, dtype=torch.float32)
    out = torch.empty(residual.shape, dtype=out_dtype or residual.dtype)
    library().rms_norm(x.data_ptr(), _flag(x), residual.data_ptr(), h.data_ptr(), weight.data_ptr(), out.data_ptr(),
                       _flag(out), x.shape[0], x.shape[1], eps, torch.get_num_threads())
    return out, h


def silu_mul(gate_up: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """[T, 2I] -> [T, I] in `out_dtype` (gate_up's by default); `silu_mul_reference`'s values."""
    gate_up = gate_up.contiguous()
    n = gate_up.shape[1] // 2
    out = torch.empty(gate_up.shape[0], n, dtype=out_dtype or gate_up.dtype)
    library().silu_mul(gate_up.data_ptr(), _flag(gate_up), out.data_ptr(), _flag(out), gate_up.shape[0], n,
                       torch.get_num_threads())
    return out


def rope_and_cache(qkv: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, slots: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int, num_kv_heads: int,
                   head_dim: int) -> torch.Tensor:
    """qkv [T, (H + 2 Hkv) * D] (fp32 or bf16) -> q [T, H, D] fp32 rotated; k rotated and v written to
    k_cache / v_cache [slots, Hkv, D] (fp32 or fp16, contiguous) at `slots` [T] int64. cos / sin_signed:
    [T, 1, D] fp32 (`engine.model.RopeRows`)."""
    qkv, slots = qkv.contiguous(), slots.contiguous()
    cos, sin_signed = cos.contiguous(), sin_signed.contiguous()
    T = qkv.shape[0]
    q = torch.empty(T, num_heads, head_dim, dtype=torch.float32)
    library().rope_cache(qkv.data_ptr(), _flag(qkv), cos.data_ptr(), sin_signed.data_ptr(), slots.data_ptr(),
                         q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), _half(k_cache), T, num_heads,
                         num_kv_heads, head_dim, torch.get_num_threads())
    return q


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta, scale: float,
                    out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """q [T, H, D] fp32, caches [slots, Hkv, D] fp32 or fp16 contiguous (the maths in fp32), `meta` an
    `engine.attention.AttnMetadata` with block tables -> [T, H * D] in `out_dtype` (fp32 by default)."""
    q = q.contiguous()
    T, H, D = q.shape
    out = torch.empty(T, H * D, dtype=out_dtype or torch.float32)
    library().paged_attention(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), _half(k_cache), out.data_ptr(),
                              _flag(out), *_metadata_args(meta), H, k_cache.shape[1], D, scale, torch.get_num_threads())
    return out


def attend(qkv: torch.Tensor, rope, meta, k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int,
           num_kv_heads: int, head_dim: int, scale: float, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """A layer's attention in one call: `rope_and_cache` then `paged_attention` (the same numbers)
    for qkv [T, (H + 2 Hkv) * D] with `rope` an `engine.model.RopeRows` of the rows and `meta`'s
    slot mapping -> [T, H * D] in `out_dtype` (fp32 by default)."""
    qkv, slots = qkv.contiguous(), meta.slot_mapping.contiguous()
    cos, sin_signed = rope.cos.contiguous(), rope.sin_signed.contiguous()
    out = torch.empty(qkv.shape[0], num_heads * head_dim, dtype=out_dtype or torch.float32)
    library().rope_cache_attention(
        qkv.data_ptr(), _flag(qkv), cos.data_ptr(), sin_signed.data_ptr(), slots.data_ptr(), k_cache.data_ptr(),
        v_cache.data_ptr(), _half(k_cache), out.data_ptr(), _flag(out), *_metadata_args(meta), num_heads, num_kv_heads,
        head_dim, scale, torch.get_num_threads())
    return out


def verify_greedy_stacked(tokens: torch.Tensor, parents: torch.Tensor, num_nodes: torch.Tensor,
                          num_roots: torch.Tensor, target_argmax: torch.Tensor, max_depth: int,
                          max_next_roots: int) -> torch.Tensor:
    """`engine.verify.verify_greedy_batched_reference`'s result for `tree.pack_trees` fields (int64
    CPU tensors: tokens / parents [T, N], num_nodes / num_roots [T]) and the target's argmax at every
    node [T, N], as `BatchVerifyResult.stacked()` lays it out: [T, 2 (D+1) + 2 + W-1] int64."""
    tokens, parents = tokens.contiguous(), parents.contiguous()
    num_nodes, num_roots = num_nodes.contiguous(), num_roots.contiguous()
    target_argmax = target_argmax.to(torch.int64)
    if target_argmax.stride(-1) != 1:
        target_argmax = target_argmax.contiguous()
    T, N = tokens.shape
    out = torch.empty(T, 2 * (max_depth + 1) + 2 + max_next_roots - 1, dtype=torch.int64)
    library().verify_greedy(tokens.data_ptr(), parents.data_ptr(), N, num_nodes.data_ptr(), num_roots.data_ptr(),
                            target_argmax.data_ptr(), target_argmax.stride(0), T, max_depth, max_next_roots,
                            out.data_ptr())
    return out


def compact_layout_ok(kv: torch.Tensor) -> bool:
    """Whether `compact_tree_kv` takes this cache: CPU, [2, layers, slots, heads, dim] with each slot's
    [heads, dim] row contiguous and the (K/V, layer) planes evenly strided."""
    return (kv.device.type == "cpu" and kv.dim() == 5 and kv.stride(4) == 1 and kv.stride(3) == kv.shape[4]
            and kv.stride(2) >= kv.shape[3] * kv.shape[4] and kv.stride(0) == kv.shape[1] * kv.stride(1))


def compact_tree_kv(kv: torch.Tensor, block_tables: torch.Tensor, block_size: int, prefix_lens: torch.Tensor,
                    paths: torch.Tensor, path_lens: torch.Tensor) -> None:
    """`kernels.kv_compact.compact_tree_kv` on a CPU cache [2, layers, slots, heads, dim] of any dtype
    laid out as `compact_layout_ok` says: the accepted rows moved in place with a copy per (pair,
    plane), identity pairs skipped. block_tables int32 or int64 [T, max_blocks]; prefix_lens, path_lens [T] and paths [T, P] int64."""
    T, P = paths.shape
    if T == 0 or P == 0:
        return
    assert compact_layout_ok(kv) and block_tables.dtype in (torch.int32, torch.int64)
    if block_tables.stride(-1) != 1:
        block_tables = block_tables.contiguous()
    prefix_lens, path_lens = prefix_lens.to(torch.int64).contiguous(), path_lens.to(torch.int64).contiguous()
    paths = paths.to(torch.int64)
    if paths.stride(-1) != 1:
        paths = paths.contiguous()
    es = kv.element_size()
    library().compact_tree_kv(kv.data_ptr(), kv.shape[0] * kv.shape[1], kv.stride(1) * es, kv.stride(2) * es,
                              kv.shape[3] * kv.shape[4] * es, block_tables.data_ptr(),
                              int(block_tables.dtype == torch.int32), block_tables.stride(0), block_tables.shape[1],
                              block_size, prefix_lens.data_ptr(), paths.data_ptr(), paths.stride(0),
                              path_lens.data_ptr(), T, P)


def pack_int4(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quant_matmul`'s int4 layout for w[n, k] = codes[n, k] * scales[n, g] + zeros[n, g], g = k / 32:
    codes [N, K] in 0..15, scales and zeros fp32 [N, K / 32]; N a multiple of 16 -> (packed codes
    uint8 [N / 16, K / 2, 16], scales and zeros fp16 [N / 16, K / 32, 2, 16]; `cpu_kernels.c`)."""
    n, k = codes.shape
    q = codes.to(torch.uint8).reshape(n // 16, 16, k // 2, 2)
    packed = (q[..., 0] | (q[..., 1] << 4)).permute(0, 2, 1).contiguous()
    sz = torch.stack([scales, zeros], dim=-1).to(torch.float16).reshape(n // 16, 16, k // 32, 2)
    return packed, sz.permute(0, 2, 3, 1).contiguous()


def pack_int4_a8(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`pack_int4`'s weights in the layout of the int4 x int8-activation kernel (`cpu_kernels.c`,
    kind 5): codes uint8 [N / 16, K / 32, 4, 16, 4], block j's lane i byte b holding
    codes[16t + i, 32g + 8j + b] | codes[16t + i, 32g + 8j + 4 + b] << 4; the same fp16 scales and
    zeros."""
    n, k = codes.shape
    q = codes.to(torch.uint8).reshape(n // 16, 16, k // 32, 4, 2, 4)
    packed = (q[..., 0, :] | (q[..., 1, :] << 4)).permute(0, 2, 3, 1, 4).contiguous()
    return packed, pack_int4(codes, scales, zeros)[1]


def pack_int8(codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quant_matmul`'s int8 layout for w[n, k] = codes[n, k] * scales[n]: codes int8 [N, K], N a
    multiple of 16 -> (codes [N / 16, K, 16], scales fp32 [N])."""
    n, k = codes.shape
    return codes.reshape(n // 16, 16, k).permute(0, 2, 1).contiguous(), scales.float().contiguous()


def int4_weight(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """codes q [N, K] in 0..15, scales and zeros [N, K / 32] -> q * s + z in fp32, rounded once (as
    the kernels' fused multiply-add; `kernels.quant_gemm` unpacks with it too)."""
    n, k = q.shape
    w = torch.addcmul(zeros.double()[..., None], q.double().reshape(n, k // 32, 32), scales.double()[..., None])
    return w.float().reshape(n, k)


def _int4_weight(q: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
    """`int4_weight` with `pack_int4`'s scales and zeros [N / 16, K / 32, 2, 16]."""
    n, k = q.shape
    return int4_weight(q, *sz.permute(0, 3, 1, 2).reshape(n, k // 32, 2).unbind(-1))


def unpack_int4(packed: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
    """The fp32 weight [N, K] that `pack_int4`'s layout computes with: q * s + z, rounded once."""
    tiles, half_k, _ = packed.shape
    q = torch.stack([packed & 15, packed >> 4], dim=2).permute(0, 3, 1, 2).reshape(tiles * 16, half_k * 2)
    return _int4_weight(q, sz)


def unpack_int4_a8(packed: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
    """The fp32 weight [N, K] of `pack_int4_a8`'s layout (q * s + z, rounded once)."""
    tiles, groups = packed.shape[:2]
    q = torch.stack([packed & 15, packed >> 4], dim=4)            # [T, G, 4, 16, 2, 4]
    return _int4_weight(q.permute(0, 3, 1, 2, 4, 5).reshape(tiles * 16, groups * 32), sz)


def quantize_rows_q8_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The int4 x int8 kernel's activations: per row and group of 32, (qx int8 [M, K], dx, sx fp32
    [M, K / 32]) with qx = sign(v) floor(|v| + 1/2), v = x / dx, dx = max |x| / 127, sx = dx sum(qx)."""
    m, k = x.shape
    xg = x.float().reshape(m, k // 32, 32)
    d = xg.abs().amax(-1) / 127.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    v = xg * inv[..., None]
    q = (torch.sign(v) * torch.floor(v.abs() + 0.5)).to(torch.int8)   # fp32, as the kernel
    return q.reshape(m, k), d, d * q.sum(-1, dtype=torch.int32).float()


def quant_matmul_a8_reference(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
                              zeros: torch.Tensor) -> torch.Tensor:
    """y = sum_g (s dx) sum_k q qx + z sx in float64 (the int4 x int8 kernel's maths), for
    codes `weight` [N, K], scales and zeros [N, K / 32]."""
    qx, dx, sx = quantize_rows_q8_reference(x)
    m, k = qx.shape
    n = weight.shape[0]
    isum = torch.einsum("mgk,ngk->mng", qx.double().reshape(m, k // 32, 32), weight.double().reshape(n, k // 32, 32))
    s, z = scales.half().double(), zeros.half().double()
    return (isum * s[None] * dx.double()[:, None] + z[None] * sx.double()[:, None]).sum(-1)


def unpack_int8(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The fp32 weight [N, K] of `pack_int8`'s layout (the row scale times the code)."""
    tiles, k, _ = codes.shape
    return codes.permute(0, 2, 1).reshape(tiles * 16, k).float() * scales[:, None]


KINDS = {"int4": 4, "int8": 8, "int4-a8": 5}


def quant_matmul(x: torch.Tensor, kind: str, codes: torch.Tensor, scales: torch.Tensor, n: int) -> torch.Tensor:
    """x [M, K] fp32 @ W^T -> [M, N] fp32 for W packed by `pack_int4` (kind "int4": each output the
    sum over k in order of x[m, k] * w[n, k], one fused multiply-add per term), `pack_int8` ("int8":
    the same with the row scale applied to the sum) or `pack_int4_a8` ("int4-a8": activations
    quantized to int8 per group of 32, `quant_matmul_a8_reference`'s maths)."""
    x = x.contiguous()
    out = torch.empty(x.shape[0], n, dtype=torch.float32)
    if library().quant_matmul(KINDS[kind], x.data_ptr(), x.shape[1], codes.data_ptr(), scales.data_ptr(),
                              out.data_ptr(), n, x.shape[0], n, x.shape[1], torch.get_num_threads()) != 0:
        raise MemoryError("quant_matmul: no scratch memory for the int8 activations")
    return out


class LayerParams(ctypes.Structure):
    """One decoder layer for `decoder_layers` (`cpu_kernels.c` layer_params): its two norm weights,
    its four quantized projections (qkv, o, gate_up, down: packed codes, scales, `KINDS` id, output
    width) and its KV cache."""
    _fields_ = [("input_norm", _p), ("post_norm", _p), ("codes", _p * 4), ("scales", _p * 4), ("kind", _i64 * 4),
                ("n", _i64 * 4), ("k_cache", _p), ("v_cache", _p)]


def layer_params(layers: list[tuple]) -> ctypes.Array:
    """An array of `LayerParams` from (input_norm, post_norm, [(kind, codes, scales, n) x 4], k_cache,
    v_cache) per layer. It holds raw pointers: the tensors must outlive it."""
    arr = (LayerParams * len(layers))()
    for p, (input_norm, post_norm, projections, k_cache, v_cache) in zip(arr, layers):
        p.input_norm, p.post_norm = input_norm.data_ptr(), post_norm.data_ptr()
        for j, (kind, codes, scales, n) in enumerate(projections):
            p.codes[j], p.scales[j], p.kind[j], p.n[j] = codes.data_ptr(), scales.data_ptr(), KINDS[kind], n
        p.k_cache, p.v_cache = k_cache.data_ptr(), v_cache.data_ptr()
    return arr


def decoder_layers(params: ctypes.Array, start: int, count: int, h: torch.Tensor, delta: torch.Tensor,
                   has_delta: bool, rope, meta, *, intermediate: int, num_heads: int, num_kv_heads: int,
                   head_dim: int, eps: float, scale: float, kv_f16: bool = False,
                   capture: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Layers `start` .. `start + count - 1` of `params` (`layer_params`) in one call, in place on the
    residual stream h + delta (h, delta [T, hidden] fp32 contiguous; `has_delta`: whether delta holds
    one on entry; delta holds the last layer's output after; `kv_f16`: the caches hold fp16): the calls of
    `engine.model.DecoderLayer.forward_native` one after the other, the same numbers. `capture`:
    (captured [T, S, hidden] fp32 contiguous, slot [count] int64): after the call's layer i with
    slot[i] >= 0, captured[:, slot[i]] = h + delta (the stream as the next layer's norm reads it)."""
    cos, sin_signed = rope.cos.contiguous(), rope.sin_signed.contiguous()
    slots = meta.slot_mapping.contiguous()
    rc = library().decoder_layers(
        ctypes.addressof(params) + start * ctypes.sizeof(LayerParams), count, h.data_ptr(), delta.data_ptr(),
        int(has_delta), h.shape[0], h.shape[1], intermediate, num_heads, num_kv_heads, head_dim, eps, scale,
        cos.data_ptr(), sin_signed.data_ptr(), slots.data_ptr(), *_metadata_args(meta), int(kv_f16),
        torch.get_num_threads(), *((capture[0].data_ptr(), capture[1].data_ptr(), capture[0].shape[1])
                                   if capture is not None else (None, None, 0)))
    if rc != 0:
        raise MemoryError("decoder_layers: no scratch memory")


def _metadata_args(meta) -> tuple:
    """The attention kernels' metadata arguments (`engine.attention.AttnMetadata`, packed): sequences,
    cu_query_lens, context_lens, block tables with their width and block size, mask offsets, widths
    and bytes."""
    meta = meta.packed()
    if not meta.block_tables.is_contiguous():   # kept on the metadata: the pointer must outlive the call
        meta.block_tables = meta.block_tables.contiguous()
    tables = meta.block_tables
    return (meta.num_seqs, meta.cu_query_lens_t.data_ptr(), meta.context_lens_t.data_ptr(), tables.data_ptr(),
            tables.shape[1], meta.block_size, meta.mask_offsets.data_ptr(), meta.mask_widths.data_ptr(),
            meta.mask_data.data_ptr())


def usable(q: torch.Tensor, k_cache: torch.Tensor, meta) -> bool:
    """Whether `paged_attention` takes this call: CPU fp32 queries, an fp32 or fp16 cache, paged metadata."""
    return (q.device.type == "cpu" and q.dtype == torch.float32 and k_cache.dtype in (torch.float32, torch.float16)
            and k_cache.is_contiguous() and meta.block_size > 0)


def _half(cache: torch.Tensor) -> int:
    return int(cache.dtype == torch.float16)


# ---- the torch references ----------------------------------------------------------------------


def rms_norm_reference(x, weight, eps, out_dtype=None):
    xf = x.float()
    return (weight.float() * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps))).to(out_dtype or x.dtype)


def add_rms_norm_reference(x, residual, weight, eps, out_dtype=None):
    h = x.float() + residual.float()
    return rms_norm_reference(h, weight, eps, out_dtype or residual.dtype), h


def silu_mul_reference(gate_up, out_dtype=None):
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(out_dtype or gate_up.dtype)


def rope_and_cache_reference(qkv, cos, sin_signed, slots, k_cache, v_cache, num_heads, num_kv_heads, head_dim):
    T = qkv.shape[0]
    heads = num_heads + num_kv_heads
    x = qkv.float()[:, :heads * head_dim].view(T, heads, head_dim)
    qk = x * cos + torch.roll(x, head_dim // 2, -1) * sin_signed
    q, k = qk.split([num_heads, num_kv_heads], dim=1)
    k_cache[slots] = k.to(k_cache.dtype)
    v_cache[slots] = qkv.float()[:, heads * head_dim:].view(T, num_kv_heads, head_dim).to(v_cache.dtype)
    return q


__all__ = ["LayerParams", "add_rms_norm", "attend", "available", "decoder_layers", "int4_weight", "layer_params",
           "library", "pack_int4", "pack_int4_a8", "pack_int8", "paged_attention", "quant_matmul", "rms_norm",
           "rope_and_cache", "silu_mul", "unpack_int4", "unpack_int4_a8", "unpack_int8", "usable"]
