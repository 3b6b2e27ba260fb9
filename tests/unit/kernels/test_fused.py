"""kernels/fused.py against its torch references: RMSNorm (with and without the residual add),
SiLU-mul, RoPE with the KV-cache write; on the CPU under the Triton interpreter (fp32, fp16: it
must be switched on before triton is first imported, so this file runs itself as a script in a
child process), on CUDA (-m gpu) in fp32 and bf16 too. And a decoder layer of the engine's model
with the fused kernels gives the unfused layer's output."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
import torch

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def check_kernels(device: str, dtype: torch.dtype) -> None:
    from specserve.kernels import fused

    errors = fused.max_errors(device, dtype)
    assert set(errors) == {"rms_norm", "add_rms_norm", "silu_mul", "rope_and_cache"}
    assert all(e <= 4 * TOL[dtype] for e in errors.values()), errors


def check_layer(device: str) -> None:
    """One step of a 2-layer Llama, fused (SPECSERVE_FUSED=1 or CUDA) against unfused, fp32: hidden states,
    KV cache and the captured residual stream of each layer (EAGLE-3's features)."""
    from specserve.engine import model as model_mod
    from specserve.engine.attention import build_attn_metadata
    from specserve.engine.config import ModelConfig
    from specserve.engine.kv_cache import KVCache
    from specserve.engine.model import LlamaModel
    from specserve.kernels import fused
    import transformers

    hf_cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    cfg = ModelConfig.from_hf(hf_cfg)
    torch.manual_seed(0)
    sd = {k: v for k, v in transformers.LlamaForCausalLM(hf_cfg).state_dict().items()}
    model = LlamaModel.from_state_dict(cfg, sd, max_positions=64, dtype=torch.float32, device=torch.device(device))
    outs = []
    for enabled in (True, False):
        fused.ENABLED = enabled
        cache = KVCache(2, 4, 4, 2, 16, torch.float32, torch.device(device))
        pos, meta = build_attn_metadata([[0, 1], [2, 3]], 4, [0, 0], [5, 3], None, torch.device(device))
        ids = torch.tensor([1, 5, 9, 2, 7, 3, 3, 8], device=device)
        hidden = model(ids, pos, cache, meta)
        kv = cache.kv.clone()
        # the residual stream after 1 and 2 layers, captured where the fused stack defers each layer's add
        again, captured = model(ids, pos, KVCache(2, 4, 4, 2, 16, torch.float32, torch.device(device)), meta, (1, 2))
        torch.testing.assert_close(again, hidden, rtol=0, atol=0)
        outs.append((hidden, kv, captured))
        assert (model_mod.fused_kernels(ids) is not None) == (enabled and (device == "cuda" or
                                                                           os.environ.get("SPECSERVE_FUSED") == "1"))
    fused.ENABLED = True
    torch.testing.assert_close(outs[0][0], outs[1][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs[0][1], outs[1][1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs[0][2], outs[1][2], rtol=1e-5, atol=1e-5)


def run_interpreted() -> dict[str, str | None]:
    checks = {"fp32": lambda: check_kernels("cpu", torch.float32), "fp16": lambda: check_kernels("cpu", torch.float16),
              "layer": lambda: check_layer("cpu")}
    from helpers import run_checks   # (here: this file also runs as a script, tests/ on the path then too)
    return run_checks(checks)


@pytest.fixture(scope="module")
def interpreted():
    from helpers import run_interpreted_child   # (not at the top: this file also runs as a script)
    # the native CPU kernels off: the layer runs the fused kernels, not the CPU's own
    return run_interpreted_child(__file__, env={"SPECSERVE_FUSED": "1", "SPECSERVE_ATTENTION": "triton",
                                                "SPECSERVE_CPU_KERNELS": "0"})


@needs_triton
@pytest.mark.parametrize("name", ["fp32", "fp16", "layer"])
def test_fused_kernels_equal_their_references_interpreted(interpreted, name):
    assert interpreted[name] is None, interpreted[name]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_fused_kernels_equal_their_references_on_cuda(dtype):
    check_kernels("cuda", DTYPES[dtype])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fused_layer_equals_unfused_on_cuda():
    check_layer("cuda")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # tests/, for helpers
    print(json.dumps(run_interpreted()))
