"""kernels/quant_gemm.py (the int4 / int8 weight-only matmuls of a quantized model on CUDA) against
its torch references, on the CPU under Triton's interpreter (it must be switched on before triton is
first imported, so this file runs itself as a script in a child process) and on CUDA (-m gpu); and
an engine whose weights take those kernels (SPECSERVE_QUANT_KERNEL=triton on the CPU, or a CUDA
device) serves its drafters losslessly."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
import torch

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
ROOT = Path(__file__).resolve().parents[3]
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def check_kernels(device: str, dtype: torch.dtype) -> None:
    """Every shape against its reference; the references against the dequantized fp32 weight."""
    from specserve.engine.quant import int4_codes, int8_codes
    from specserve.kernels import quant_gemm as qg

    g = torch.Generator().manual_seed(0)
    for n, k in ((64, 64), (80, 192)):
        w = torch.randn(n, k, generator=g) * 0.05
        codes, s, lo = int4_codes(w)
        packed, sz = (t.to(device) for t in qg.pack_int4(codes, s, lo))
        c8, s8 = (t.to(device) for t in qg.pack_int8(*int8_codes(w)))
        dequant = (codes.float().reshape(n, -1, 32) * s.half().float()[..., None]
                   + lo.half().float()[..., None]).reshape(n, k)
        torch.testing.assert_close(qg.unpack_int4(packed.cpu(), sz.cpu()), dequant, rtol=1e-6, atol=1e-7)
        for m in (1, 3, 17, 40):
            x = torch.randn(m, k, generator=g).to(device, dtype)
            tol = TOL[dtype] * 4
            for got, want in ((qg.int4_matmul(x, packed, sz), qg.int4_reference(x, packed, sz)),
                              (qg.int8_matmul(x, c8, s8), qg.int8_reference(x, c8, s8))):
                assert got.dtype == dtype and got.shape == (m, n)
                torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
            exact = x.float().cpu() @ w.T          # and the quantization is w's, closely
            approx = qg.int4_reference(x.float(), packed, sz).cpu()
            assert torch.nn.functional.cosine_similarity(approx.flatten(), exact.flatten(), dim=0) > 0.99


def check_engine(model_dir: str, device: str) -> None:
    """A tiny Llama quantized to int4 with every weight in the Triton layout: plain greedy decoding
    and n-gram / truncated-target speculation give the same tokens."""
    from specserve.engine.quant import quantized
    from specserve.engine.sampling_params import SamplingParams
    from helpers import make_llm_engine, run_requests

    engine = make_llm_engine(model_dir, ("none", "ngram", "draft_model"), {"draft_model": {"draft_layers": 1}},
                             quantization="int4", device=device)
    assert all(quantized(w).kernel == "triton" for w in (engine.model.layers[0].qkv.weight, engine.model.lm_head_weight))
    prompts = [[7, 100, 42, 9, 250, 31, 7, 100, 42, 9, 250, 31, 7, 100], [5, 17, 9, 3]]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    plain = run_requests(engine, prompts, params, prefix="p", drafter="none")
    for name in ("ngram", "draft_model"):
        got = run_requests(engine, prompts, params, prefix=name, drafter=name)
        assert [got[f"{name}{i}"] for i in range(2)] == [plain[f"p{i}"] for i in range(2)], name
    assert engine.drafter_stats["ngram"].num_accepted_tokens > 0


def run_interpreted(model_dir: str) -> dict[str, str | None]:
    checks = {"fp32": lambda: check_kernels("cpu", torch.float32), "fp16": lambda: check_kernels("cpu", torch.float16),
              "engine": lambda: check_engine(model_dir, "cpu")}
    from helpers import run_checks   # (here: this file also runs as a script, tests/ on the path then too)
    return run_checks(checks)


@pytest.fixture(scope="module")
def interpreted(tiny_llama_dir):
    from helpers import run_interpreted_child   # (not at the top: this file also runs as a script)
    return run_interpreted_child(__file__, str(tiny_llama_dir), cwd=ROOT, env={"SPECSERVE_QUANT_KERNEL": "triton"})


@needs_triton
@pytest.mark.parametrize("name", ["fp32", "fp16", "engine"])
def test_quantized_matmuls_equal_their_references_interpreted(interpreted, name):
    assert interpreted[name] is None, interpreted[name]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_matmuls_equal_their_references_on_cuda(dtype):
    check_kernels("cuda", dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_quantized_engine_on_cuda_serves_its_drafters_losslessly(tiny_llama_dir):
    check_engine(str(tiny_llama_dir), "cuda")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "tests"))   # for helpers
    os.environ.setdefault("SPECSERVE_QUANT_KERNEL", "triton")
    print(json.dumps(run_interpreted(sys.argv[1])))
