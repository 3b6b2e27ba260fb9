"""The compiled CPU forward (engine/compiled.py, `EngineConfig.compile`):

* it computes what the eager forward computes, and writes the same KV cache, for a prefill chunk,
  decode rows and a tree in one ragged batch, with captured layers too;
* an engine that compiles (int4 weights) serves the same greedy tokens as an eager one, its
  drafters (n-gram, a truncated target, EAGLE) stay lossless against it, and serving compiles
  nothing after start-up.
"""

from __future__ import annotations

import pytest
import torch

from specserve.engine.attention import build_attn_metadata
from specserve.engine.compiled import CompiledForward, compile_available
from specserve.engine.kv_cache import KVCache
from specserve.engine.sampling_params import SamplingParams
from specserve.kernels import cpu as cpu_kernels
from tests.helpers import make_llm_engine, run_requests

pytestmark = pytest.mark.skipif(not compile_available(), reason="torch.compile needs a C++ compiler")


def _step_inputs(cfg, starts, query_lens, masks):
    """A ragged step over three sequences with 6 blocks of 4 slots each."""
    tables = [list(range(6 * b, 6 * b + 6)) for b in range(len(starts))]
    positions, meta = build_attn_metadata(tables, 4, starts, query_lens, masks, "cpu")
    ids = torch.randint(3, cfg.vocab_size, (sum(query_lens),), generator=torch.Generator().manual_seed(sum(starts)))
    return ids, positions, meta


@torch.inference_mode()
def test_the_compiled_forward_computes_what_the_eager_one_does(tiny_llama_dir):
    engine = make_llm_engine(tiny_llama_dir)
    model, cfg = engine.model, engine.model_config
    compiled = CompiledForward(model)
    caches = [KVCache(cfg.num_layers, 18, 4, cfg.num_kv_heads, cfg.head_dim, torch.float32, torch.device("cpu"))
              for _ in range(2)]
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]])   # root, two children, a grandchild
    steps = [([0, 0, 0], [9, 5, 7], None),                    # three prefill chunks
             ([9, 5, 7], [1, 1, 1], None),                    # three decode rows
             ([10, 6, 8], [1, 4, 3], [None, tree, None])]     # decode row, tree, chunk
    for capture in ((), (0, 2)):
        for starts, lens, masks in steps:
            ids, positions, meta = _step_inputs(cfg, starts, lens, masks)
            want = model(ids, positions, caches[0], meta, capture)
            ids, positions, meta = _step_inputs(cfg, starts, lens, masks)
            got = compiled(ids, positions, caches[1], meta, capture)
            for w, g in zip(*((want, got) if capture else ((want,), (got,)))):
                assert g.shape == w.shape
                assert torch.allclose(g, w, atol=1e-5, rtol=1e-5)
        assert torch.allclose(caches[1].kv, caches[0].kv, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="capture layers"):
        compiled(ids, positions, caches[1], meta, (cfg.num_layers + 1,))


def test_with_the_native_kernels_an_int4_engine_has_nothing_to_compile(tiny_llama_dir):
    """Where every projection is a native quantized weight the layer stack is one native call:
    `compile` leaves the forward as it is, and the engine serves."""
    if not cpu_kernels.available():
        pytest.skip("the native CPU kernels do not build here")
    engine = make_llm_engine(tiny_llama_dir, ("none",), quantization="int4", compile=True)
    assert engine.runner.forward is engine.model and engine.model.runs_natively()
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    assert len(run_requests(engine, [[5, 6, 7]], params)["r0"]) == 5


def test_an_engine_that_compiles_serves_the_same_tokens_and_its_drafters_stay_lossless(tiny_llama_dir,
                                                                                       monkeypatch):
    """Greedy, int4 weights through torch's kernels (what compiling is for: the native kernels,
    switched off here, run the stack in one call; the fp32 forward is compared above), requests
    arriving at different steps (prefills, decodes and trees share steps): the compiled engine's
    plain decoding gives the eager engine's tokens, and each drafter gives the compiled engine's
    plain tokens."""
    monkeypatch.setattr(cpu_kernels, "ENABLED", False)
    quantization = "int4"
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (5, 17, 9)]
    prompts.append([7, 100, 42, 9, 250, 31, 7, 100, 42, 9, 250, 31, 7, 100])
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    drafters = ("none", "ngram", "draft_model", "eagle")
    options = {"draft_model": {"draft_layers": 1}, "eagle": {"random_init": True}}
    eager = make_llm_engine(tiny_llama_dir, ("none",), quantization=quantization)
    engine = make_llm_engine(tiny_llama_dir, drafters, options, quantization=quantization, compile=True)
    assert isinstance(engine.runner.forward, CompiledForward)
    compiled_before = dict(torch._dynamo.utils.counters["stats"])
    want = run_requests(eager, prompts, params, prefix="p", drafter="none")
    plain = run_requests(engine, prompts, params, prefix="p", drafter="none")
    assert plain == want
    for name in drafters[1:]:
        got = run_requests(engine, prompts, params, prefix=name, drafter=name)
        assert [got[f"{name}{i}"] for i in range(len(prompts))] == [plain[f"p{i}"] for i in range(len(prompts))], name
        assert engine.drafter_stats[name].num_draft_tokens > 0, name
    assert engine.drafter_stats["ngram"].num_accepted_tokens > 0
    # everything was compiled at start-up: serving traced nothing new (a recompile stalls a server)
    assert dict(torch._dynamo.utils.counters["stats"]) == compiled_before
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_enforce_eager_turns_compilation_off(tiny_llama_dir):
    engine = make_llm_engine(tiny_llama_dir, compile=True, enforce_eager=True)
    assert engine.runner.forward is engine.model
