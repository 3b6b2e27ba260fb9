"""Weight-only quantized linears (engine/quant.py): each against dequantize-then-F.linear, the
GGUF Q4_1 block mapping, and an engine serving a quantized tiny Llama losslessly."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import make_llm_engine, run_requests

from specserve.engine.model import linear
from specserve.engine.quant import (dequantize, int4_codes, int8_codes, quantize_weight, quantized,
                                    quantized_linear)
from specserve.engine.sampling_params import SamplingParams


def _weight(n=96, k=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * 0.05


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("rows", [1, 3, 17])
def test_quantized_linear_matches_its_dequantized_weight(kind, rows):
    w = _weight()
    codes = int8_codes(w) if kind == "int8" else int4_codes(w)
    assert quantize_weight(w, kind)
    q = quantized(w)
    x = torch.randn(rows, w.shape[1], generator=torch.Generator().manual_seed(1))
    ref = F.linear(x, dequantize(q, codes))
    assert torch.allclose(quantized_linear(x, q), ref, atol=1e-5, rtol=1e-5)
    assert torch.allclose(linear(x, w), ref, atol=1e-5, rtol=1e-5)      # the model's dispatch takes it
    # and it is a quantization of w: close, not equal
    err = (dequantize(q, codes) - w).abs().max().item()
    assert 0 < err < (0.05 * 4 / 127 if kind == "int8" else 0.05 * 8 / 15)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_bf16_activations(kind):
    w = _weight()
    codes = int8_codes(w) if kind == "int8" else int4_codes(w)
    assert quantize_weight(w, kind, act_dtype=torch.bfloat16)
    x = torch.randn(4, w.shape[1], generator=torch.Generator().manual_seed(2))
    out = linear(x, w)
    assert out.dtype == torch.float32
    ref = F.linear(x, dequantize(quantized(w), codes))
    assert (out - ref).abs().max() < 0.02 * ref.abs().max()


def test_a_gguf_q4_1_block_maps_exactly_onto_an_int4_group():
    """Q4_1: w = d * q + m per block of 32, q in 0..15. A block whose codes reach 0 and 15 is
    recovered exactly: the same codes, s = d and z = m + 8 d."""
    g = torch.Generator().manual_seed(3)
    n, k = 16, 64
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32)
    q[:, ::32] = 0
    q[:, 1::32] = 15
    d = torch.rand(n, k // 32, generator=g) * 0.01 + 1e-3
    m = -torch.rand(n, k // 32, generator=g) * 0.1
    w = (d[..., None] * q.reshape(n, k // 32, 32).float() + m[..., None]).reshape(n, k)
    codes, s, z = int4_codes(w)
    assert torch.equal(codes, q)
    assert torch.allclose(s, d, rtol=1e-5) and torch.allclose(z, m + 8 * d, rtol=1e-5, atol=1e-7)
    assert quantize_weight(w, "int4")
    x = torch.randn(2, k, generator=g)
    assert torch.allclose(linear(x, w), F.linear(x, w), atol=1e-5, rtol=1e-4)


def test_a_weight_the_int4_kernel_cannot_take_stays_as_it_is():
    w = _weight(n=24)   # rows not a multiple of 16
    assert not quantize_weight(w, "int4") and quantized(w) is None
    assert quantize_weight(w, "int8")


def test_a_weight_changed_in_place_is_no_longer_quantized():
    w = _weight()
    assert quantize_weight(w, "int8")
    with torch.no_grad():
        w.mul_(2)
    assert quantized(w) is None
    x = torch.randn(2, w.shape[1])
    assert torch.allclose(linear(x, w), F.linear(x, w), atol=1e-5)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_drafters_are_lossless_against_the_quantized_target(tiny_llama_dir, kind):
    """Greedy decoding of a quantized target, requests arriving at different steps: plain and
    speculative decoding (a truncated target as draft model, sharing the quantized weights; n-gram)
    give the same tokens."""
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (5, 17, 9)]
    prompts.append([7, 100, 42, 9, 250, 31, 7, 100, 42, 9, 250, 31, 7, 100])
    engine = make_llm_engine(tiny_llama_dir, ("none", "ngram", "draft_model"),
                             {"draft_model": {"draft_layers": 1}}, quantization=kind)
    layer = engine.model.layers[0]
    assert all(quantized(w).kind == kind for w in (layer.qkv.weight, layer.down.weight))
    assert quantized(engine.model.lm_head_weight).kind == "int8"     # the LM head keeps 8 bits
    memory = engine.get_stats().memory_bytes
    assert 0 < memory["quantized"] < memory["weights"] / (3 if kind == "int8" else 6)
    assert memory["prepacked"] == 0      # a quantized weight keeps no fp32 oneDNN copy
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = run_requests(engine, prompts, params, prefix="p", drafter="none")
    for name in ("ngram", "draft_model"):
        got = run_requests(engine, prompts, params, prefix=name, drafter=name)
        assert [got[f"{name}{i}"] for i in range(len(prompts))] == [plain[f"p{i}"] for i in range(len(prompts))], name
        assert engine.drafter_stats[name].num_accepted_tokens > 0, name
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_an_unknown_quantization_is_refused():
    from specserve.engine.config import EngineConfig
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(quantization="int3")
