"""Weight-only quantized linears on the CPU: int8 per output channel, int4 per group.

A decode step on the CPU is bound by reading the weights: the default model's projections and LM
head are ~540 MB in fp32, read once per step. Quantized, each weight is read as int8 (a quarter)
or int4 (an eighth) and widened inside torch's packed kernels:

* **int8**: symmetric, one scale per output row, w ~= s[n] * q[n, k], q in [-127, 127],
  s = max |w[n, :]| / 127.
* **int4**: asymmetric, one scale and offset per group of `group_size` (32) inputs of a row,
  w ~= q * s + lo, q in [0, 15], s = (max - min) / 15, lo = min. A GGUF Q4_1 block (32 weights,
  w = d q + m) is such a group with s = d and lo = m: where a block's codes reach both 0 and 15
  (the quantizer puts its min and max there), quantizing the dequantized block again recovers it.

Two kernels compute them, chosen when a weight is quantized:

* **native** (`kernels.cpu.quant_matmul`, where the CPU kernels build): fp32 activations, int4
  scales and offsets in fp16 (a Q4_1 block's d and m as the file stores them), each weight widened
  to fp32 once per step for all the rows of a call: verifying a 9-row tree costs ~1.5x one row
  where torch's kernels cost ~5x (`specserve bench kernels`). Each row's result is independent of
  the other rows in the call, bit for bit.
* **torch** (`torch._weight_int8pack_mm`, `torch._weight_int4pack_mm_for_cpu`, elsewhere): the
  activations go in as they are (fp32) or, with `act_dtype=bfloat16` where the CPU has native bf16
  (AVX-512 BF16 / AMX), as bf16; int4 in torch's packing with w = (q - 8) * s + (lo + 8 s).

* **Triton** (`kernels.quant_gemm`, on CUDA): int4 (fp16 scales and offsets, groups of 32) and
  int8 dequantized tile by tile in registers and multiplied with `tl.dot` in the model's dtype.

The output comes back in the input's dtype. The quantized copy is attached to the weight tensor (`quantize_weight`), so every
module that shares the weight (a truncated draft model, a head reading the target's LM head)
computes with the same numbers as the target: losslessness holds against the quantized target
actually served. `engine.model.linear` dispatches to it.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import torch
from torch import nn

from specserve.kernels import cpu as native_cpu

QUANTIZATIONS = ("auto", "none", "int8", "int4", "gguf")   # --quantization (auto: `auto_quantization`)
ACTIVATIONS = ("auto", "float", "int8")   # --quantized-activations (`int8_activations`)
# what a GGUF tensor type is served as under `--quantization gguf`: Q4_0 / Q4_1 blocks are int4
# groups of 32, Q8_0 (8 bits per weight, a scale per 32) is served as int8 with a scale per row,
# float tensors as they are; any other type (K-quants, Q5, IQ) is dequantized and served in fp32
GGUF_KINDS = {"Q4_0": "int4", "Q4_1": "int4", "Q8_0": "int8", "F32": "none", "F16": "none", "BF16": "none"}
_PRECISION = {"int4": 0, "int8": 1, "none": 2}
_GGUF_PARTS = {"qkv": ("attn_q", "attn_k", "attn_v"), "o": ("attn_output",), "gate_up": ("ffn_gate", "ffn_up"),
               "down": ("ffn_down",)}
INT4_GROUP = 32            # inputs per int4 group (a GGUF Q4_0 / Q4_1 block)
INT4_INNER_K_TILES = 2     # the int4 packing's tile (torch's CPU kernel takes 2, 4 or 8)
KERNELS = ("native", "triton", "torch")   # what computes a quantized weight (`QuantizedWeight.kernel`)


@dataclass(frozen=True)
class QuantizedWeight:
    """A weight's quantized copy: `kind` int8 or int4, in the layout of the `kernel` that computes
    with it (`KERNELS`): "native" (`kernels.cpu.pack_int4` / `pack_int4_a8` / `pack_int8`),
    "triton" (`kernels.quant_gemm.pack_int4` / `pack_int8`; int8 data [N, K], scales [N]) or "torch"
    (int8: data int8 [N, K], scales [N]; int4: data packed by torch [N, K / 2] uint8, scales
    [K / group, N, 2] scale and zero); `shape` the weight's [N, K]; `int8_act`: native int4 that
    multiplies int8-quantized activations; `version`: the weight's `_version` when quantized (a
    weight changed in place since is no longer represented)."""

    kind: str
    data: torch.Tensor
    scales: torch.Tensor
    group_size: int
    act_dtype: torch.dtype
    version: int
    kernel: str = "torch"
    shape: tuple[int, int] = (0, 0)
    int8_act: bool = False

    @property
    def native_kind(self) -> str:
        """The native kernel's name for this layout (`kernels.cpu.KINDS`)."""
        return "int4-a8" if self.int8_act else self.kind


def int8_codes(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: (q int8 [N, K], s fp32 [N]) with w ~= s[:, None] * q."""
    w = weight.detach().float()
    s = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0
    q = torch.round(w / s[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, s


def int4_codes(weight: torch.Tensor, group_size: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric group-wise int4: (q int32 [N, K] in 0..15, s fp32 [N, K / g], lo fp32 [N, K / g])
    with w ~= q * s + lo per group (module docstring)."""
    n, k = weight.shape
    w = weight.detach().float().reshape(n, k // group_size, group_size)
    lo, hi = w.amin(dim=2), w.amax(dim=2)
    s = ((hi - lo) / 15.0).clamp_min(1e-12)
    q = torch.round((w - lo[..., None]) / s[..., None]).clamp_(0, 15).to(torch.int32)
    return q.reshape(n, k), s, lo


def dequantize(q: QuantizedWeight, codes: tuple | None = None) -> torch.Tensor:
    """The fp32 weight that `q` computes with (for tests and references; with `int8_act` the
    activations are quantized too); `codes`: the codes a torch-layout int4 weight was made from
    (`int4_codes`; torch's packing is opaque)."""
    if q.kernel == "native":
        if q.kind == "int8":
            return native_cpu.unpack_int8(q.data, q.scales)
        return (native_cpu.unpack_int4_a8 if q.int8_act else native_cpu.unpack_int4)(q.data, q.scales)
    if q.kind == "int8":                  # triton's and torch's: codes [N, K], a scale per row
        return q.data.float() * q.scales.float()[:, None]
    if q.kernel == "triton":
        from specserve.kernels import quant_gemm
        return quant_gemm.unpack_int4(q.data, q.scales)
    if codes is None:
        raise ValueError("int4 dequantization needs the codes the weight was packed from")
    codes_q, s, lo = codes
    n, k = codes_q.shape
    g = q.group_size
    s, z = s.to(q.act_dtype).float(), (lo + 8.0 * s).to(q.act_dtype).float()   # what torch's kernel holds
    w = (codes_q.float().reshape(n, k // g, g) - 8.0) * s[..., None] + z[..., None]
    return w.reshape(n, k)


def triton_kernels(weight: torch.Tensor) -> bool:
    """Whether `weight` is served by the Triton kernels (`kernels/quant_gemm.py`): on CUDA, or
    anywhere with SPECSERVE_QUANT_KERNEL=triton (the CPU under Triton's interpreter, for tests)."""
    if weight.device.type != "cuda" and os.environ.get("SPECSERVE_QUANT_KERNEL") != "triton":
        return False
    return importlib.util.find_spec("triton") is not None


def can_quantize(weight: torch.Tensor, kind: str, group_size: int = INT4_GROUP) -> bool:
    """Whether a kernel takes `weight` as `kind`: on the CPU int4 needs rows a multiple of 16 and
    inputs of the group size; the Triton kernels (CUDA) take int4 in groups of 32, inputs a
    multiple of 64."""
    if kind not in ("int8", "int4") or weight.dim() != 2:
        return False
    if triton_kernels(weight):
        return kind == "int8" or (group_size == 32 and weight.shape[1] % 64 == 0)
    return weight.device.type == "cpu" and (kind == "int8" or (weight.shape[0] % 16 == 0
                                                                and weight.shape[1] % group_size == 0))


def _native_fits(weight: torch.Tensor, kind: str, group_size: int) -> bool:
    """Whether the native kernel takes `weight` (rows a multiple of 16; int4 in groups of 32)."""
    return (native_cpu.available() and weight.shape[0] % 16 == 0
            and (kind == "int8" or (group_size == 32 and weight.shape[1] % 32 == 0)))


def quantize_weight(weight: torch.Tensor, kind: str, act_dtype: torch.dtype = torch.float32,
                    group_size: int = INT4_GROUP, native: bool | None = None, int8_act: bool = False) -> bool:
    """Attach a `kind` quantized copy to `weight` ([out, in]) that `engine.model.linear` computes
    with from now on: on CUDA in the Triton kernels' layout (activations in the weight's dtype); on
    the CPU in the native kernel's layout where it takes the weight (`native`: None where it fits,
    False never), with fp32 activations, or for int4 with `int8_act` int8 ones quantized per group
    of 32 (llama.cpp's Q4_1 x Q8_1 dot product); else in torch's with `act_dtype` activations.
    False (nothing done) for "none" or a weight no kernel takes."""
    if not can_quantize(weight, kind, group_size):
        return False
    if triton_kernels(weight):
        kernel, act_dtype = "triton", weight.dtype
    else:
        fits = _native_fits(weight, kind, group_size)
        if native and not fits:
            raise ValueError(f"the native CPU kernels do not take this {kind} weight {tuple(weight.shape)} here")
        kernel = "native" if (fits if native is None else native) else "torch"
    int8_act = int8_act and kernel == "native" and kind == "int4"
    old = getattr(weight, "_specserve_quant", None)
    if (old is not None and old.kind == kind and old.kernel == kernel and old.int8_act == int8_act
            and old.version == weight._version):
        return True   # shared with a model quantized already
    with torch.no_grad():
        data, scales, act_dtype = _pack(weight, kind, kernel, group_size, act_dtype, int8_act)
    weight._specserve_quant = QuantizedWeight(kind, data, scales, group_size, act_dtype, weight._version, kernel,
                                              tuple(weight.shape), int8_act)
    return True


def _pack(weight: torch.Tensor, kind: str, kernel: str, group_size: int, act_dtype: torch.dtype,
          int8_act: bool) -> tuple[torch.Tensor, torch.Tensor, torch.dtype]:
    """(data, scales, activations' dtype) of `weight` as `kind` in `kernel`'s layout."""
    if kernel == "triton":
        from specserve.kernels import quant_gemm
        if kind == "int8":
            return *quant_gemm.pack_int8(*int8_codes(weight)), act_dtype
        return *quant_gemm.pack_int4(*int4_codes(weight, group_size)), act_dtype
    if kind == "int8":
        q, s = int8_codes(weight)
        if kernel == "native":
            return *native_cpu.pack_int8(q, s), torch.float32
        return q.contiguous(), s.to(act_dtype), act_dtype
    q, s, lo = int4_codes(weight, group_size)
    if kernel == "native":
        return *(native_cpu.pack_int4_a8 if int8_act else native_cpu.pack_int4)(q, s, lo), torch.float32
    data = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), INT4_INNER_K_TILES)
    scales = torch.stack([s.t(), (lo + 8.0 * s).t()], dim=2).contiguous().to(act_dtype)   # [K / g, N, 2]
    return data, scales, act_dtype


def quantized(weight: torch.Tensor) -> QuantizedWeight | None:
    """The weight's quantized copy, if it has a current one."""
    q = getattr(weight, "_specserve_quant", None)
    if q is None or torch.compiler.is_compiling():   # a compiled forward is traced with its weights as they are
        return q
    return q if q.version == weight._version else None


def quantized_linear(x: torch.Tensor, q: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ W^T (+ bias) with W's quantized copy; the result in x's dtype."""
    a = x.to(q.act_dtype).contiguous()
    if q.kernel == "triton":
        from specserve.kernels import quant_gemm
        fn = quant_gemm.int4_matmul if q.kind == "int4" else quant_gemm.int8_matmul
        out = fn(a, q.data, q.scales)
    elif q.kernel == "native":
        out = native_cpu.quant_matmul(a, q.native_kind, q.data, q.scales, q.shape[0])
    elif q.kind == "int8":
        out = torch.ops.aten._weight_int8pack_mm(a, q.data, q.scales)
    else:
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(a, q.data, q.group_size, q.scales)
    out = out.to(x.dtype)
    return out + bias if bias is not None else out


def exact_top_logits(logits: torch.Tensor, hidden: torch.Tensor, q: QuantizedWeight) -> torch.Tensor:
    """`logits` [rows, vocab] from an int8 LM head with bf16 activations (`quantized_linear`: the
    kernel's fp32 sums come back rounded to bf16) with each row's top bin recomputed in fp32: the
    tokens whose rounded logit equals the row's maximum get their unrounded value,
    sum_k bf16(h_k) q[t, k] times the row scale. bf16's step at a logit of 16-32 is 0.125, so two
    tokens 0.08 apart often round to the same value, and argmax would then take the lower token id
    (the default model answered "L'Étoile" for "The" when asked for the capital of France). The
    largest true logit always rounds into the top bin, so greedy decoding picks the fp32 maximum;
    the rest of the row keeps its rounded values (each within half a bf16 step). Per row, so a
    row's result does not depend on the batch. In place; returns `logits`."""
    rows, cols = (logits == logits.max(-1, keepdim=True).values).nonzero(as_tuple=True)
    x = hidden.to(torch.bfloat16).float().index_select(0, rows)
    w = q.data.index_select(0, cols).float()
    logits[rows, cols] = (x * w).sum(-1) * q.scales.index_select(0, cols).float()
    return logits


def native_bf16() -> bool:
    """Whether this CPU computes bf16 natively (AVX-512 BF16 / AMX): then bf16 activations pay."""
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    try:
        return bool(check()) if check is not None else False
    except RuntimeError:
        return False


def gguf_weight_kinds(gguf_types: dict[str, str], num_layers: int) -> tuple[dict[str, str], list[str]]:
    """What `--quantization gguf` serves each weight of an `engine.model.LlamaModel` as
    ("layers.N.qkv", "layers.N.o", "layers.N.gate_up", "layers.N.down", "lm_head" -> int4 | int8 |
    none), from the GGUF's tensor types (`GGUF_KINDS`); a fused weight takes its most precise part,
    the LM head is the file's `output.weight`, or its token embedding when the two are tied. Also
    returns the GGUF types that were dequantized."""
    dequantized: set[str] = set()

    def kind_of(name: str) -> str:
        t = gguf_types.get(name)
        if t is not None and t not in GGUF_KINDS:
            dequantized.add(t)
        return GGUF_KINDS.get(t, "none")

    kinds = {f"layers.{i}.{ours}": max((kind_of(f"blk.{i}.{part}.weight") for part in theirs), key=_PRECISION.get)
             for i in range(num_layers) for ours, theirs in _GGUF_PARTS.items()}
    kinds["lm_head"] = kind_of("output.weight" if "output.weight" in gguf_types else "token_embd.weight")
    return kinds, sorted(dequantized)


def auto_quantization(gguf_types: dict[str, str], device: torch.device) -> str:
    """`--quantization auto`: "gguf" for a GGUF with Q4 / Q8 tensors served on a CPU where the
    native kernels build or torch's have native bf16 (elsewhere torch's packed kernels are slower
    than fp32 weights), else "none"."""
    quantized_file = any(GGUF_KINDS.get(t, "none") != "none" for t in gguf_types.values())
    fast = native_cpu.available() or native_bf16()
    return "gguf" if quantized_file and device.type == "cpu" and fast else "none"


def int8_activations(setting: str = "auto") -> bool:
    """`--quantized-activations`: whether int4 weights multiply int8-quantized activations, per group
    of 32 as llama.cpp's Q4 x Q8 dot products (`int8`; auto: where the native kernels have a fast
    int8 path, `kernels.cpu.fast_int8_dot`: AVX2, or AVX-512 with VNNI), or the activations as they
    are (`float`: fp32 in the native kernels, the file's weights computed exactly). The served
    target is what speculation is lossless against, whichever it is. On the 2-core AVX2 EPYC
    (2026-12-02) int8 took 7-26 % off a forward of 1-17 rows, two runs (`specserve bench forward --variants
    int4 int4-a8`) at the quality of llama.cpp's own numerics: on a held set of GSM8K and HumanEval
    solutions, perplexity and top-1 agreement with fp32 transformers within a fraction of a percent
    of float activations (`specserve bench activations`, the results page)."""
    if setting not in ACTIVATIONS:
        raise ValueError(f"quantized activations must be one of {', '.join(ACTIVATIONS)}, got {setting!r}")
    if setting == "float" or not native_cpu.available():
        return False
    return setting == "int8" or native_cpu.fast_int8_dot()


def quantize_model(model: nn.Module, kind: str, *, lm_head: bool = True, act_dtype: torch.dtype = torch.float32,
                   gguf_types: dict[str, str] | None = None, native: bool | None = None,
                   int8_act: bool = False) -> dict[str, int]:
    """Quantize the projections of every decoder layer of `model` (an `engine.model.LlamaModel`)
    and, with `lm_head`, its LM head (the embedding itself stays as it is: a lookup reads one row):
    every weight to `kind` (int8 | int4), or under "gguf" each as the GGUF file `gguf_types`
    stores it (`gguf_weight_kinds`); `native` and `int8_act` as `quantize_weight`'s. Under int4
    the LM head is int8: GGUF files keep it at 8 bits or more (the default model's is Q8_0), and an
    int4 head changes answers (the default model, asked for the capital of France, said "L'Étoile
    (The City of Lights)" instead of "Paris").
    Returns {"weights": how many, "bytes_before": their fp bytes, "bytes_after": the quantized,
    "dequantized": the GGUF types served dequantized (gguf only)}."""
    if kind not in QUANTIZATIONS or kind == "auto":
        raise ValueError(f"quantization must be one of none, int8, int4, gguf, got {kind!r}")
    dequantized: list[str] = []
    if kind == "none":
        return {"weights": 0, "bytes_before": 0, "bytes_after": 0, "dequantized": dequantized}
    if kind == "gguf":
        if not gguf_types:
            raise ValueError("--quantization gguf needs a GGUF model (its tensor types say how to serve each weight)")
        kinds, dequantized = gguf_weight_kinds(gguf_types, len(model.layers))
    else:
        kinds = {f"layers.{i}.{ours}": kind for i in range(len(model.layers)) for ours in _GGUF_PARTS}
        kinds["lm_head"] = "int8"
    weights = [(getattr(layer, ours).weight, kinds[f"layers.{i}.{ours}"])
               for i, layer in enumerate(model.layers) for ours in _GGUF_PARTS]
    if lm_head:
        weights.append((model.lm_head_weight, kinds["lm_head"]))
    done = before = after = 0
    for w, k in weights:
        if quantize_weight(w, k, act_dtype, native=native, int8_act=int8_act):
            q = quantized(w)
            done += 1
            before += w.numel() * w.element_size()
            after += q.data.numel() * q.data.element_size() + q.scales.numel() * q.scales.element_size()
    return {"weights": done, "bytes_before": before, "bytes_after": after, "dequantized": dequantized}


__all__ = ["ACTIVATIONS", "GGUF_KINDS", "INT4_GROUP", "KERNELS", "QUANTIZATIONS", "QuantizedWeight",
           "auto_quantization", "can_quantize", "dequantize", "exact_top_logits", "gguf_weight_kinds", "int4_codes",
           "int8_activations", "int8_codes", "native_bf16", "quantize_model", "quantize_weight", "quantized",
           "quantized_linear", "triton_kernels"]
