"""kernels/skinny_gemm.py (y = x W^T (+ b) for at most four rows) against its torch reference: every
tile config on odd shapes and 1-4 rows, on the CPU under Triton's interpreter (switched on before
triton is first imported, so this file runs itself as a script in a child process) and on CUDA
(-m gpu), where each shape also tunes its tile on its first call; and on CUDA, a bf16 engine with
the kernel switched on decodes what the reference products give."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def check_kernel(device: str, dtype: torch.dtype) -> None:
    from specserve.kernels import skinny_gemm as sg

    g = torch.Generator().manual_seed(0)
    for m, n, k, bias in ((1, 96, 576, False), (2, 40, 200, True), (3, 17, 64, False), (4, 130, 300, True)):
        x = torch.randn(m, k, generator=g).to(device=device, dtype=dtype)
        w = (torch.randn(n, k, generator=g) * 0.05).to(device=device, dtype=dtype)
        b = torch.randn(n, generator=g).to(device=device, dtype=dtype) if bias else None
        want = sg.skinny_linear_reference(x, w, b)
        for config in sg.CONFIGS:
            out = torch.empty(m, n, dtype=dtype, device=device)
            sg._launch(x, w, b, out, config)
            torch.testing.assert_close(out.float(), want.float(), rtol=TOL[dtype], atol=TOL[dtype])
        torch.testing.assert_close(sg.skinny_linear(x, w, b).float(), want.float(), rtol=TOL[dtype], atol=TOL[dtype])
        # the reference is the exact product, rounded once
        exact = (x.double() @ w.double().t() + (b.double() if bias else 0)).to(dtype)
        assert (want.float() - exact.float()).abs().max() <= 2 * TOL[dtype]
    if device == "cuda":
        assert sg.tuned and all(key in sg.timings for key in sg.tuned)


def run_interpreted() -> dict[str, str | None]:
    from helpers import run_checks   # (here: this file also runs as a script, tests/ on the path then too)
    return run_checks({"fp16": lambda: check_kernel("cpu", torch.float16),
                       "bf16": lambda: check_kernel("cpu", torch.bfloat16)})


@pytest.fixture(scope="module")
def interpreted():
    from helpers import run_interpreted_child   # (not at the top: this file also runs as a script)
    return run_interpreted_child(__file__, env={})


@needs_triton
@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_skinny_products_equal_their_reference_interpreted(interpreted, name):
    assert interpreted[name] is None, interpreted[name]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_skinny_products_equal_their_reference_on_cuda(dtype):
    check_kernel("cuda", DTYPES[dtype])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_model_takes_the_kernel_for_a_decode_row_on_cuda(tiny_llama_dir, monkeypatch):
    """A bf16 engine with the kernel on decodes greedily with every decode-row product through it (no
    graphs: each call is seen) and gives the tokens of an engine whose products are the reference's."""
    from helpers import make_llm_engine
    from specserve.engine.sampling_params import SamplingParams
    from specserve.kernels import skinny_gemm as sg

    def decode(engine):
        engine.add_request("r", [5, 17, 33, 8, 90, 41], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
        got = []
        while engine.has_unfinished_requests():
            for out in engine.step():
                got += out.outputs[0].token_ids
        return got

    calls = []
    launch = sg._launch
    monkeypatch.setattr(sg, "ENABLED", True)
    monkeypatch.setattr(sg, "_launch", lambda *a: (calls.append(a[0].shape[0]), launch(*a)))
    cfg = dict(device="cuda", dtype="bfloat16", num_kv_blocks=100, enforce_eager=True)
    got = decode(make_llm_engine(tiny_llama_dir, **cfg))
    assert calls and max(calls) <= sg.MAX_ROWS
    monkeypatch.setattr(sg, "skinny_linear", sg.skinny_linear_reference)
    assert got == decode(make_llm_engine(tiny_llama_dir, **cfg))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # tests/, for helpers
    print(json.dumps(run_interpreted()))
