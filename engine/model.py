"""The Llama family (Llama, Mistral, Qwen2, SmolLM) as a pure function of its inputs.

`forward(input_ids, positions, kv_cache, attn_metadata) -> hidden` handles prefill chunks, decode
steps and (later) draft-tree verification for a whole ragged batch in one call; `compute_logits`
projects only the rows a caller needs. q/k/v and gate/up projections are fused at load time.
"""

from __future__ import annotations

import os

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from specserve.engine.attention import AttnMetadata, paged_attention
from specserve.engine.config import ModelConfig
from specserve.engine.quant import exact_top_logits, quantize_weight, quantized, quantized_linear
from specserve.kernels import cpu as native_cpu


def _onednn_linear():
    """oneDNN's linear (the op torch's own compiler emits for CPU linears), if this torch has it.
    For the few-row GEMMs of decoding and draft trees it is 2-5x faster than F.linear's BLAS
    path on the CPU (measured with torch 2.13, fp32: the 49152 x 576 LM head takes 12.6 ms for 1
    row and 37.6 ms for 3 through F.linear, 5.8 ms and 7.1 ms through oneDNN)."""
    op = getattr(getattr(torch.ops, "mkldnn", None), "_linear_pointwise", None)
    if op is None or not torch.backends.mkldnn.is_available():
        return None
    return op


def onednn_linear_dtypes(op) -> frozenset[torch.dtype]:
    """The dtypes among fp32 and bf16 for which `op` (oneDNN's linear) runs on this CPU and agrees
    with F.linear. Probed one by one: oneDNN has no bf16 inner product on CPUs without AVX-512
    bf16 / AMX support and says so only when first called ("could not create a primitive descriptor")."""
    if op is None:
        return frozenset()
    supported = set()
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 5e-2)):
        g = torch.Generator().manual_seed(0)
        x, w, b = (torch.randn(shape, generator=g).to(dtype) for shape in ((3, 8), (5, 8), (5,)))
        try:
            out = op(x, w, b, "none", [], "")
        except (RuntimeError, NotImplementedError):
            continue
        ref = F.linear(x.float(), w.float(), b.float())
        if out.dtype == dtype and torch.allclose(out.float(), ref, atol=tol, rtol=tol):
            supported.add(dtype)
    return frozenset(supported)


_ONEDNN_LINEAR = _onednn_linear()
_ONEDNN_DTYPES = onednn_linear_dtypes(_ONEDNN_LINEAR)


# oneDNN's reorder of a linear weight into its blocked GEMM layout, for a given number of input rows
_ONEDNN_REORDER = getattr(getattr(torch.ops, "mkldnn", None), "_reorder_linear_weight", None)
PACK_ROWS_HINT = 16     # the rows the packed layout is chosen for (decode batches and draft trees)


def onednn_pack_dtypes(op, reorder) -> frozenset[torch.dtype]:
    """The dtypes (among those `onednn_linear_dtypes` found) for which oneDNN's linear on a
    prepacked weight runs here and agrees with it on the plain weight."""
    if reorder is None:
        return frozenset()
    supported = set()
    for dtype in onednn_linear_dtypes(op):
        g = torch.Generator().manual_seed(0)
        x, w = (torch.randn(shape, generator=g).to(dtype) for shape in ((3, 8), (5, 8)))
        try:
            out = op(x, reorder(w, PACK_ROWS_HINT), None, "none", [], "")
        except (RuntimeError, NotImplementedError):
            continue
        tol = 1e-5 if dtype == torch.float32 else 5e-2
        if out.dtype == dtype and torch.allclose(out.float(), op(x, w, None, "none", [], "").float(), atol=tol, rtol=tol):
            supported.add(dtype)
    return frozenset(supported)


_PACK_DTYPES = onednn_pack_dtypes(_ONEDNN_LINEAR, _ONEDNN_REORDER)


def pack_linear_weight(weight: torch.Tensor, min_rows: int = 1) -> bool:
    """Give `weight` ([out, in], on the CPU) a oneDNN-prepacked copy that `linear` uses for inputs
    of at least `min_rows` rows. False (nothing done) where this torch or CPU cannot.

    Why: unpacked, oneDNN reorders the weight into its GEMM layout on every call once an input
    has 2 rows or more, so a 2-row GEMM streams the weight about twice and costs about twice
    a 1-row one; a draft tree of a few nodes then costs the target forward half a plain step
    more. Prepacked once, a forward of 2-9 rows costs little more than one of 1 row (measured:
    `specserve bench forward --variants unpacked prepacked`). The copy doubles the weight's memory; it is dropped
    with the weight, and ignored once the weight is changed in place (its version moves)."""
    if (weight.device.type != "cpu" or weight.dim() != 2 or weight.dtype not in _PACK_DTYPES
            or weight.is_inference() or quantized(weight) is not None):
        return False
    old = getattr(weight, "_specserve_packed", None)
    if old is not None and old[1] == weight._version:   # shared by two models (a truncated draft model)
        weight._specserve_packed = (old[0], old[1], min(old[2], max(1, min_rows)))
        return True
    with torch.no_grad():
        packed = _ONEDNN_REORDER(weight.detach(), PACK_ROWS_HINT)
    weight._specserve_packed = (packed, weight._version, max(1, min_rows))
    return True


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, through oneDNN for 2-D inputs on the CPU in the dtypes it supports here (see
    `_onednn_linear`, `onednn_linear_dtypes`), on the weight's prepacked copy when it has one
    (`pack_linear_weight`), or with its quantized copy when it has one (`engine/quant.py`; CPU
    kernels, or Triton's on CUDA).
    Neither has a backward: where a gradient is wanted, F.linear on the weight itself."""
    grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                        or (bias is not None and bias.requires_grad))
    q = quantized(weight) if x.dim() == 2 and not grad else None
    if q is not None:
        return quantized_linear(x, q, bias)
    if (x.dtype in _ONEDNN_DTYPES and x.device.type == "cpu" and x.dim() == 2 and weight.dtype == x.dtype
            and not grad):
        packed = getattr(weight, "_specserve_packed", None)
        compiling = torch.compiler.is_compiling()
        use = weight
        if packed is not None and x.shape[0] >= packed[2] and (compiling or packed[1] == weight._version):
            use = packed[0]
        if compiling:   # opaque to torch.compile, which cannot lower a prepacked weight it did not pack
            return torch.ops.specserve.onednn_linear(x, use, bias, weight.shape[0])
        return _ONEDNN_LINEAR(x, use, bias, "none", [], "")
    return F.linear(x, weight, bias)


if _ONEDNN_LINEAR is not None:
    @torch.library.custom_op("specserve::onednn_linear", mutates_args=())
    def _onednn_linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                          out_features: int) -> torch.Tensor:
        """oneDNN's linear as one opaque op for a compiled forward (`engine/compiled.py`)."""
        return _ONEDNN_LINEAR(x, weight, bias, "none", [], "")

    @_onednn_linear_op.register_fake
    def _(x, weight, bias, out_features):
        return x.new_empty(x.shape[0], out_features)


def _parts_in(objects):
    """Each distinct part of `objects` (modules, or objects such as drafters whose attributes hold
    modules): an attribute that is not a module, or a module inside one (its own sub-modules
    after it), each once."""
    seen: set[int] = set()
    for obj in objects:
        for value in [obj] if isinstance(obj, nn.Module) else list(vars(obj).values()):
            for part in value.modules() if isinstance(value, nn.Module) else (value,):
                if id(part) not in seen:
                    seen.add(id(part))
                    yield part


def pack_weights_in(*objects) -> int:
    """Prepack every decoder layer inside `objects` (modules, or objects such as drafters whose
    attributes hold modules) with `DecoderLayer.pack_weights`, and call `pack_weights()` of the
    attributes that have one (a drafter's draft vocabulary head), and `LlamaModel.pack_weights` of
    a draft model: a drafter's own layers (EAGLE's, a student's) run on a few rows per call, where
    packing pays as it does for the target. Weights already packed (shared with the target) keep
    their one copy and count as packed. Returns the weights packed."""
    packed_whole: set[int] = set()     # the layers of a draft model packed with it
    packed = 0
    for part in _parts_in(objects):
        if isinstance(part, LlamaModel):     # a draft model: its layers and its LM head
            packed_whole.update(id(layer) for layer in part.layers)
            packed += part.pack_weights()
        elif isinstance(part, DecoderLayer) and id(part) not in packed_whole:
            packed += part.pack_weights()
        elif not isinstance(part, nn.Module) and callable(getattr(part, "pack_weights", None)):
            packed += part.pack_weights()
    return packed


def quantize_weights_in(*objects, kind: str) -> int:
    """Quantize the weights a drafter owns (`engine/quant.py`), as `pack_weights_in` prepacks them:
    every decoder layer inside `objects` (its four projections to `kind`; int4 ones multiply int8
    activations where the native kernels serve them, whatever the target's activations: a
    drafter's numbers never reach the output), a draft model's LM head (int8), every `nn.Linear` (a
    feature head's fc or lift: int8, whose fp32 activations keep EAGLE-3's τ, where int4 x int8 lost
    0.1 on GSM8K; one that `engine.model.linear` does not compute, as a decision MLP's, keeps an
    unused copy), and whatever has a `quantize_weights(kind)` method (a drafter's draft-vocabulary
    head: int8, as int4 x int8 lost 1-4 % of EAGLE's τ at 8 nodes). A drafter's proposals then come
    from the quantized weights; verification against the target is unchanged, so speculation stays
    lossless. A weight that has a quantized copy already (shared with the target, quantized with it)
    keeps it. Returns the weights quantized."""
    def own(weight: torch.Tensor, k: str) -> int:
        return 0 if quantized(weight) is not None else int(quantize_weight(weight, k, int8_act=True))

    done = 0
    for part in _parts_in(objects):
        if isinstance(part, LlamaModel):
            done += own(part.lm_head_weight, "int8")
        elif isinstance(part, DecoderLayer):
            done += sum(own(getattr(part, name).weight, kind) for name in ("qkv", "o", "gate_up", "down"))
        elif isinstance(part, nn.Linear):
            done += own(part.weight, "int8")
        elif not isinstance(part, nn.Module) and callable(getattr(part, "quantize_weights", None)):
            done += part.quantize_weights("int8")
    return done


def _quantized_and_act(weight: torch.Tensor, dtype: torch.dtype):
    """(the weight's quantized copy or None, the dtype its linear takes: the quantized kernel's
    activation dtype, bf16 where the CPU has native bf16, else `dtype`, the model's)."""
    q = quantized(weight)
    return q, dtype if q is None else q.act_dtype


def _project(x: torch.Tensor, weight: torch.Tensor, q, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`linear(x, weight, bias)` with the quantized copy `q` already looked up (the native layer's
    inner loop)."""
    return quantized_linear(x, q, bias) if q is not None else linear(x, weight, bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in fp32 and cast back, as the reference implementation does. In fp32,
    torch's fused `F.rms_norm` (the same maths in one kernel instead of six ops; a third faster on a
    one-row input on the development CPU)."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def hf_rope_parameters(hf) -> tuple[float | None, dict | None]:
    """(rope_theta, rope_scaling) of a transformers config, in transformers 4's form (rope_scaling None
    for plain RoPE, rope_theta None where the config has none). transformers 5 keeps both in one dict,
    `rope_parameters` (`rope_scaling` is an alias of it; there is no `rope_theta`), where plain RoPE is
    {"rope_theta": ..., "rope_type": "default"}."""
    params = getattr(hf, "rope_parameters", None)
    if not isinstance(params, dict):    # transformers 4
        return getattr(hf, "rope_theta", None), getattr(hf, "rope_scaling", None)
    scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    return params.get("rope_theta", getattr(hf, "rope_theta", None)), scaling


def rope_tables(cfg: ModelConfig, max_positions: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [max_positions, head_dim] for every RoPE variant transformers knows
    (default, linear, dynamic at its base length, yarn, longrope, llama3) via its own init functions."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = cfg.hf_config
    base, scaling = hf_rope_parameters(hf)
    scaling = scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        base = 10000.0 if base is None else base
        partial = getattr(hf, "partial_rotary_factor", 1.0)
        dim = int(cfg.head_dim * partial)
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        attention_scaling = 1.0
    else:
        if rope_type not in ROPE_INIT_FUNCTIONS:
            raise ValueError(f"unsupported RoPE scaling type {rope_type!r}")
        inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](hf, torch.device("cpu"))
    t = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq.float())
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * attention_scaling).to(device), (emb.sin() * attention_scaling).to(device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., T, heads, D], cos/sin [..., T, D] (broadcast over the heads, and over leading
    dimensions they lack): rotate-half RoPE (the HF weight layout)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.unsqueeze(-2) + rotated * sin.unsqueeze(-2)


class RopeRows(NamedTuple):
    """The rotation of one forward's rows in the form `DecoderLayer.forward` applies per layer
    (`rope_rows`): cos [T, 1, D], and sin [T, 1, D] with its first half negated."""
    cos: torch.Tensor
    sin_signed: torch.Tensor


def rope_rows(cos: torch.Tensor, sin: torch.Tensor) -> RopeRows:
    """cos/sin [T, D] of a forward's rows -> `RopeRows`, made once per forward. With them the
    rotate-half of `apply_rope` is a roll: rotate_half(x) * sin = roll(x, D/2) * sin_signed, where
    the sign moves from x's second half onto sin (exact: the products are the same floats), so a
    layer rotates q and k in three ops instead of nine (`apply_rope_rows`)."""
    half = sin.shape[-1] // 2
    return RopeRows(cos.unsqueeze(-2), torch.cat((-sin[..., :half], sin[..., half:]), dim=-1).unsqueeze(-2))


def rope_at(cos_table: torch.Tensor, sin_table: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> RopeRows:
    """`rope_rows` of the rows at `positions`, from a model's cos/sin tables, in `dtype`."""
    return rope_rows(cos_table[positions].to(dtype), sin_table[positions].to(dtype))


def apply_rope_rows(x: torch.Tensor, rope: RopeRows) -> torch.Tensor:
    """x [T, heads, D] -> `apply_rope(x, cos, sin)` for rope = rope_rows(cos, sin), bit for bit."""
    return x * rope.cos + torch.roll(x, x.shape[-1] // 2, -1) * rope.sin_signed


_FUSED = None   # kernels.fused once imported; False where triton is missing
_FUSED_ON_CPU = os.environ.get("SPECSERVE_FUSED") == "1"   # tests under TRITON_INTERPRET=1


def fused_kernels(x: torch.Tensor):
    """`kernels.fused` when the layer of `x` runs them: a CUDA tensor (or SPECSERVE_FUSED=1, for
    tests under TRITON_INTERPRET=1 on the CPU), triton importable and `fused.ENABLED`; else None."""
    global _FUSED
    if not x.is_cuda and not _FUSED_ON_CPU:
        return None
    if _FUSED is None:
        try:
            from specserve.kernels import fused
            _FUSED = fused
        except ImportError:
            _FUSED = False
    return _FUSED if _FUSED and _FUSED.ENABLED else None


def cpu_kernels(x: torch.Tensor):
    """`kernels.cpu` when the layer of `x` runs them: an fp32 CPU tensor that needs no gradient (the
    kernels have no backward) and the kernels available here (`kernels.cpu.available`: built, and
    not turned off by SPECSERVE_CPU_KERNELS=0); else None."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or (x.requires_grad and torch.is_grad_enabled()):
        return None
    return native_cpu if native_cpu.available() else None


def write_and_attend(q, k, v, k_cache, v_cache, meta: AttnMetadata, scale: float) -> torch.Tensor:
    """Write a layer's new keys and values to the cache slots `meta` names, then attend over the
    paged cache: q [T, heads, D], k/v [T, kv_heads, D] -> [T, heads * D]. Attention runs in the
    cache's dtype (`EngineConfig.kv_cache_dtype`; an fp16 cache's in fp32), the output comes back in
    q's; over an fp32 or fp16 cache on the CPU through the native kernel (`kernels/cpu.py`, row by row)."""
    dtype = k_cache.dtype   # `.to` of a tensor already in it is the tensor itself: no copy
    k_cache[meta.slot_mapping] = k.to(dtype)
    v_cache[meta.slot_mapping] = v.to(dtype)
    native = cpu_kernels(q)
    if native is not None and native.usable(q, k_cache, meta):
        return native.paged_attention(q, k_cache, v_cache, meta, scale)
    compute = torch.float32 if dtype == torch.float16 else dtype    # an fp16 cache is storage: fp32 maths
    return paged_attention(q.to(compute), k_cache, v_cache, meta, scale).to(q.dtype)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.q_size, self.kv_size = q_size, kv_size
        self.eps = cfg.rms_norm_eps
        self.input_norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.post_attn_norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.qkv = nn.Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=cfg.attention_bias)
        self.o = nn.Linear(q_size, cfg.hidden_size, bias=False)
        self.gate_up = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.scale = cfg.head_dim ** -0.5
        self.fusable = cfg.head_dim & (cfg.head_dim - 1) == 0   # the fused RoPE kernel tiles a power of two

    def forward(self, h, rope: RopeRows, k_cache, v_cache, meta: AttnMetadata):
        """h [T, hidden] -> [T, hidden]; the new keys and values go to the cache slots `meta`
        names before attention. `rope`: `rope_rows` of the rows' positions. On CUDA the element-wise
        parts run as fused kernels (`kernels/fused.py`: the same maths, one launch each)."""
        native = cpu_kernels(h)
        if native is not None and native.usable(h, k_cache, meta):
            h, delta = self.forward_native(native, h, None, rope, k_cache, v_cache, meta)
            return h + delta
        fused = fused_kernels(h) if self.fusable else None
        if fused is not None:
            h, delta = self.forward_fused(fused, h, None, rope, k_cache, v_cache, meta)
            return h + delta
        return self.forward_with(h, rope, lambda q, k, v: write_and_attend(q, k, v, k_cache, v_cache, meta,
                                                                          self.scale))

    def forward_native(self, native, h, delta, rope: RopeRows, k_cache, v_cache, meta: AttnMetadata):
        """The layer through the CPU's native kernels (`kernels/cpu.py`): (h, delta) -> (h, delta),
        the residual stream before and after the layer being h + delta (delta None: h alone), so the
        residual add of one layer's output joins the next layer's input norm in one call. Each kernel
        produces what the next matmul takes (bf16 for quantized weights with bf16 activations), so
        no cast runs between them: three element-wise calls and one attention call per layer."""
        (qkv_q, qkv_act), (o_q, o_act), (gu_q, gu_act), (down_q, down_act) = (
            _quantized_and_act(w, h.dtype) for w in (self.qkv.weight, self.o.weight, self.gate_up.weight,
                                                     self.down.weight))
        if delta is None:
            x = native.rms_norm(h, self.input_norm, self.eps, qkv_act)
        else:
            x, h = native.add_rms_norm(delta, h, self.input_norm, self.eps, qkv_act)
        qkv = _project(x, self.qkv.weight, qkv_q, self.qkv.bias)
        attn = native.attend(qkv, rope, meta, k_cache, v_cache, self.num_heads, self.num_kv_heads, self.head_dim,
                             self.scale, o_act)
        x, h = native.add_rms_norm(_project(attn, self.o.weight, o_q), h, self.post_attn_norm, self.eps, gu_act)
        gate_up = _project(x, self.gate_up.weight, gu_q)
        return h, _project(native.silu_mul(gate_up, down_act), self.down.weight, down_q)

    def forward_fused(self, fused, h, delta, rope: RopeRows, k_cache, v_cache, meta: AttnMetadata):
        """`forward` through the fused kernels (`kernels/fused.py`) with the residual stream before and
        after the layer being h + delta (delta None: h alone), as `forward_native`: the residual add
        of one layer's output joins the next layer's input norm in one kernel. Returns (h, delta)."""
        if delta is None:
            x = fused.rms_norm(h, self.input_norm, self.eps)
        else:
            x, h = fused.add_rms_norm(delta, h, self.input_norm, self.eps)
        qkv = linear(x, self.qkv.weight, self.qkv.bias)
        q = fused.rope_and_cache(qkv, rope.cos, rope.sin_signed, meta.slot_mapping, k_cache, v_cache,
                                 self.num_heads, self.num_kv_heads, self.head_dim)
        attn = linear(paged_attention(q, k_cache, v_cache, meta, self.scale), self.o.weight)
        x, h = fused.add_rms_norm(attn, h, self.post_attn_norm, self.eps)
        return h, linear(fused.silu_mul(linear(x, self.gate_up.weight)), self.down.weight)

    def forward_with(self, h, rope: RopeRows, attend):
        """The layer with its attention given: `attend(q [T, heads, D], k, v [T, kv_heads, D])` ->
        [T, heads * D] writes the new keys and values to the cache and attends (`write_and_attend`
        eagerly; one opaque op per layer in the compiled forward, `engine/compiled.py`)."""
        x = rms_norm(h, self.input_norm, self.eps)
        qkv = linear(x, self.qkv.weight, self.qkv.bias)
        n = h.shape[0]
        heads = self.num_heads + self.num_kv_heads   # q and k rotated together, in one call
        qk = apply_rope_rows(qkv[:, :self.q_size + self.kv_size].view(n, heads, self.head_dim), rope)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.q_size + self.kv_size:].view(n, self.num_kv_heads, self.head_dim)
        h = h + linear(attend(q, k, v), self.o.weight)
        gate, up = linear(rms_norm(h, self.post_attn_norm, self.eps), self.gate_up.weight).chunk(2, dim=-1)
        return h + linear(F.silu(gate) * up, self.down.weight)

    def pack_weights(self) -> int:
        """Prepack the four projections for oneDNN's CPU linear (`pack_linear_weight`); returns how
        many were packed (0 off the CPU, or where this torch cannot)."""
        return sum(pack_linear_weight(w) for w in (self.qkv.weight, self.o.weight, self.gate_up.weight,
                                                    self.down.weight))

    # -- the same maths, differentiable, for drafters trained over dense batches (each brings its
    #    own attention: causal, a custom mask, a group-wise layout) --

    def dense_qkv(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """h [..., H] (the layer's input) -> q [..., heads, D], k and v [..., kv_heads, D], RoPE
        applied (cos/sin [..., D], see apply_rope)."""
        x = rms_norm(h, self.input_norm, self.eps)
        q, k, v = F.linear(x, self.qkv.weight, self.qkv.bias).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        lead = h.shape[:-1]
        q = apply_rope(q.reshape(*lead, self.num_heads, self.head_dim), cos, sin)
        k = apply_rope(k.reshape(*lead, self.num_kv_heads, self.head_dim), cos, sin)
        return q, k, v.reshape(*lead, self.num_kv_heads, self.head_dim)

    def dense_finish(self, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """After attention: h [..., H] (the layer's input), attn [..., heads * D] -> the layer's
        output (output projection, residual, MLP, residual)."""
        h = h + F.linear(attn, self.o.weight)
        gate, up = F.linear(rms_norm(h, self.post_attn_norm, self.eps), self.gate_up.weight).chunk(2, dim=-1)
        return h + F.linear(F.silu(gate) * up, self.down.weight)


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm and LM head (tied or not)."""

    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.max_positions = max_positions
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    def forward(
        self,
        input_ids: torch.Tensor,   # [num_tokens] int64
        positions: torch.Tensor,   # [num_tokens] int64 RoPE positions
        kv_cache,                  # KVCache: .layer(i) -> (k_cache, v_cache)
        attn_metadata: AttnMetadata,
        capture_layers: tuple[int, ...] = (),
    ):
        """-> hidden [num_tokens, hidden_size] after the final norm; with `capture_layers`,
        (hidden, captured) where captured [num_tokens, len(capture_layers), hidden_size] holds the
        residual stream after `k` decoder layers for each k of `capture_layers`, in that order.

        Index k follows transformers' `output_hidden_states` numbering: 0 = the embeddings, k =
        the output of decoder layer k-1 (0-based), up to num_layers = the last layer's output
        *before* the final norm (transformers' last entry is after it). EAGLE-3's low/mid/high
        features (2, L//2, L-3) are these indices: its code records the input of those decoder
        layers. An empty `capture_layers` costs nothing."""
        native = cpu_kernels(self.norm)
        if native is not None and native.usable(self.norm, kv_cache.layer(0)[0], attn_metadata):
            return self._forward_deferred(native, input_ids, positions, kv_cache, attn_metadata, capture_layers)
        fused = fused_kernels(self.norm) if self.layers[0].fusable else None
        if fused is not None:
            return self._forward_deferred(fused, input_ids, positions, kv_cache, attn_metadata, capture_layers)
        return self.run_layers(input_ids, positions, capture_layers,
                               lambda i, layer, h, rope: layer(h, rope, *kv_cache.layer(i), attn_metadata))

    def _forward_deferred(self, kernels, input_ids, positions, kv_cache, meta: AttnMetadata, capture_layers):
        """`forward` through the CPU's native kernels (`DecoderLayer.forward_native`) or CUDA's fused
        ones (`DecoderLayer.forward_fused`): each layer's output residual add joins the next layer's
        input norm, the last one the final norm (one kernel fewer per layer)."""
        native = kernels if kernels is native_cpu else None
        h = self.embed(input_ids)
        rope = rope_at(self.rope_cos, self.rope_sin, positions, h.dtype)
        if capture_layers:
            self.check_capture_layers(capture_layers)
        slots = {k: j for j, k in enumerate(capture_layers)}
        captured = h.new_empty(h.shape[0], len(capture_layers), h.shape[1]) if capture_layers else None
        if 0 in slots:
            captured[:, slots[0]] = h
        delta = None
        stack = self._native_stack(native, kv_cache) if native is not None else None
        if stack is not None:       # every layer's projections native: the whole stack in one call
            first = self.layers[0]
            h, delta = h.contiguous(), torch.empty_like(h)
            native.decoder_layers(stack, 0, len(self.layers), h, delta, False, rope, meta,
                                  intermediate=self.cfg.intermediate_size, num_heads=first.num_heads,
                                  num_kv_heads=first.num_kv_heads, head_dim=first.head_dim, eps=first.eps,
                                  scale=first.scale, kv_f16=kv_cache.kv.dtype == torch.float16,
                                  capture=(captured, self._capture_slots(capture_layers)) if capture_layers else None)
        else:
            run = DecoderLayer.forward_native if native is not None else DecoderLayer.forward_fused
            for i, layer in enumerate(self.layers):
                h, delta = run(layer, kernels, h, delta, rope, *kv_cache.layer(i), meta)
                if i + 1 in slots:
                    captured[:, slots[i + 1]] = h + delta     # the add the next norm makes, rounded alike
        out = kernels.rms_norm(h, self.norm, self.cfg.rms_norm_eps) if delta is None else \
            kernels.add_rms_norm(delta, h, self.norm, self.cfg.rms_norm_eps)[0]
        return out if not capture_layers else (out, captured)

    def _capture_slots(self, capture_layers: tuple[int, ...]) -> torch.Tensor:
        """For `decoder_layers`' capture: per layer i, the slot in `capture_layers` of its output
        (index i + 1), else -1; kept per tuple of capture layers."""
        cache = self.__dict__.setdefault("_capture_slot_cache", {})
        key = tuple(capture_layers)
        if key not in cache:
            slot = torch.full((len(self.layers),), -1, dtype=torch.int64)
            for j, k in enumerate(key):
                if k > 0:
                    slot[k - 1] = j
            cache[key] = slot
        return cache[key]

    def runs_natively(self) -> bool:
        """Whether `forward` hands the whole layer stack to the native CPU kernels (every projection
        a native quantized weight without bias, `kernels/cpu.py` `decoder_layers`)."""
        return cpu_kernels(self.norm) is not None and self._native_weights() is not None

    def _native_weights(self):
        """(the projections' weights, their quantized copies) when every one is a native quantized
        weight without bias, else None."""
        weights = [getattr(layer, name).weight for layer in self.layers for name in ("qkv", "o", "gate_up", "down")]
        qs = [quantized(w) for w in weights]
        if (any(q is None or q.kernel != "native" for q in qs)
                or any(layer.qkv.bias is not None for layer in self.layers)):
            return None
        return weights, qs

    def _native_stack(self, native, kv_cache):
        """The layers as `kernels.cpu.layer_params` for `decoder_layers` when every projection is a
        native quantized weight without bias (else None), kept while the weights' quantized copies
        (each still current) and the cache stay the same."""
        cached = self.__dict__.get("_stack")
        if cached is not None and cached[0] == kv_cache.kv.data_ptr() and all(
                getattr(w, "_specserve_quant", None) is q and q.version == w._version for w, q in cached[2]):
            return cached[1]
        found = self._native_weights()
        if found is None:
            return None
        weights, qs = found
        params = native.layer_params([
            (layer.input_norm, layer.post_attn_norm,
             [(q.native_kind, q.data, q.scales, q.shape[0]) for q in qs[4 * i:4 * i + 4]],
             *kv_cache.layer(i)) for i, layer in enumerate(self.layers)])
        self.__dict__["_stack"] = (kv_cache.kv.data_ptr(), params, list(zip(weights, qs)))   # keeps the tensors alive
        return params

    def run_layers(self, input_ids: torch.Tensor, positions: torch.Tensor, capture_layers: tuple[int, ...], step):
        """`forward` with each decoder layer run by `step(i, layer, h, rope) -> h` (the eager layer
        over the paged cache in `forward`; `DecoderLayer.forward_with` and an opaque attention op in
        the compiled forward, `engine/compiled.py`)."""
        h = self.embed(input_ids)
        rope = rope_at(self.rope_cos, self.rope_sin, positions, h.dtype)
        if not capture_layers:
            for i, layer in enumerate(self.layers):
                h = step(i, layer, h, rope)
            return rms_norm(h, self.norm, self.cfg.rms_norm_eps)
        self.check_capture_layers(capture_layers)
        slots = {k: j for j, k in enumerate(capture_layers)}
        captured = h.new_empty(h.shape[0], len(capture_layers), h.shape[1])
        if 0 in slots:
            captured[:, slots[0]] = h
        for i, layer in enumerate(self.layers):
            h = step(i, layer, h, rope)
            if i + 1 in slots:
                captured[:, slots[i + 1]] = h
        return rms_norm(h, self.norm, self.cfg.rms_norm_eps), captured

    def check_capture_layers(self, capture_layers) -> None:
        """ValueError unless every index is in 0..num_layers (see `forward`) and none repeats."""
        n = len(self.layers)
        bad = [k for k in capture_layers if not (isinstance(k, int) and 0 <= k <= n)]
        if bad:
            raise ValueError(f"capture layers must be in 0..{n} (0 = embeddings, {n} = the last layer's output), "
                             f"got {bad}")
        if len(set(capture_layers)) != len(capture_layers):
            raise ValueError(f"capture layers repeat: {tuple(capture_layers)}")

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[rows, hidden] -> [rows, vocab] logits (fp32). From an int8 head with bf16 activations
        the logits come back rounded to bf16, and each row's top bin is recomputed in fp32
        (`engine.quant.exact_top_logits`) so that bf16 ties do not decide greedy tokens."""
        weight = self.lm_head_weight
        logits = linear(hidden, weight).float()
        q = quantized(weight) if hidden.device.type == "cpu" else None
        if q is not None and q.kind == "int8" and q.act_dtype == torch.bfloat16 and hidden.dim() == 2 \
                and not torch.is_grad_enabled():
            exact_top_logits(logits, hidden, q)
        return logits

    def truncated(self, num_layers: int) -> "LlamaModel":
        """A model made of this one's first `num_layers` layers plus its final norm and LM head,
        sharing every weight by reference (a free draft model: nothing is copied)."""
        if not 1 <= num_layers <= len(self.layers):
            raise ValueError(f"num_layers must be in [1, {len(self.layers)}], got {num_layers}")
        view = LlamaModel.__new__(LlamaModel)
        nn.Module.__init__(view)
        view.cfg = self.cfg
        view.embed = self.embed
        view.layers = nn.ModuleList(list(self.layers[:num_layers]))
        view.norm = self.norm
        view.lm_head = self.lm_head
        view.max_positions = self.max_positions
        view.rope_cos, view.rope_sin = self.rope_cos, self.rope_sin
        return view

    def pack_weights(self, head_min_rows: int = 2) -> int:
        """Prepack the decoder layers' projections for oneDNN (`pack_linear_weight`), and the LM
        head for inputs of `head_min_rows` rows or more (a 1-row LM head is as fast unpacked).
        Returns the weights packed (0 off the CPU, or where this torch cannot)."""
        packed = sum(layer.pack_weights() for layer in self.layers)
        return packed + pack_linear_weight(self.lm_head_weight, head_min_rows)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @classmethod
    def from_state_dict(cls, cfg: ModelConfig, state_dict: dict[str, torch.Tensor], *, max_positions: int,
                        dtype: torch.dtype, device: torch.device) -> "LlamaModel":
        """Build from an HF-named state dict (fusing q/k/v and gate/up)."""
        with torch.device("meta"):
            model = cls(cfg, max_positions)
        sd = {k.removeprefix("model."): v for k, v in state_dict.items()}

        def take(name: str) -> torch.Tensor:
            if name not in sd:
                raise KeyError(f"weight {name!r} missing from the checkpoint")
            return sd[name]

        params: dict[str, torch.Tensor] = {"embed.weight": take("embed_tokens.weight"), "norm": take("norm.weight")}
        if model.lm_head is not None:
            params["lm_head.weight"] = sd.get("lm_head.weight", take("embed_tokens.weight"))
        for i in range(cfg.num_layers):
            p = f"layers.{i}."
            params[p + "input_norm"] = take(p + "input_layernorm.weight")
            params[p + "post_attn_norm"] = take(p + "post_attention_layernorm.weight")
            params[p + "qkv.weight"] = torch.cat([take(p + f"self_attn.{x}_proj.weight") for x in "qkv"])
            if cfg.attention_bias:
                params[p + "qkv.bias"] = torch.cat([take(p + f"self_attn.{x}_proj.bias") for x in "qkv"])
            params[p + "o.weight"] = take(p + "self_attn.o_proj.weight")
            params[p + "gate_up.weight"] = torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")])
            params[p + "down.weight"] = take(p + "mlp.down_proj.weight")
        params = {k: v.to(device=device, dtype=dtype) for k, v in params.items()}
        model.load_state_dict(params, strict=True, assign=True)
        cos, sin = rope_tables(cfg, max_positions, device)
        model.rope_cos, model.rope_sin = cos, sin
        return model.eval().requires_grad_(False)
