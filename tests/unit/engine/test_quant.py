"""Weight-only quantized linears (engine/quant.py): each against dequantize-then-F.linear, the
GGUF Q4_1 block mapping, an engine serving a quantized tiny Llama losslessly, and, with bf16
activations, the quantized default model: verified rows compute the decoded rows' numbers (the
native CPU kernels over an fp32 KV cache, or SDPA over a float64 one; SDPA over float32, the broken
control, does not). That every drafter's greedy output is plain
decoding's on the quantized default model is `tests/unit/drafters/test_default_model_lossless.py`
(which runs the model as served)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import make_llm_engine, run_requests

from specserve.engine.attention import build_attn_metadata
from specserve.engine.kv_cache import KVCache
from specserve.engine.model import linear
from specserve.engine.quant import (auto_quantization, dequantize, exact_top_logits, gguf_weight_kinds, int4_codes,
                                    int8_codes, native_bf16, quantize_weight, quantized, quantized_linear)
from specserve.engine.sampling_params import SamplingParams
from specserve.engine.tree import NO_PARENT, build_tree_buffers
from specserve.kernels import cpu as cpu_kernels


def _weight(n=96, k=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * 0.05


KERNELS = [pytest.param(True, id="native", marks=pytest.mark.skipif(not cpu_kernels.available(),
                                                                   reason="the native CPU kernels do not build here")),
           pytest.param(False, id="torch")]


@pytest.mark.parametrize("native", KERNELS)
@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("rows", [1, 3, 17])
def test_quantized_linear_matches_its_dequantized_weight(kind, rows, native):
    w = _weight()
    codes = int8_codes(w) if kind == "int8" else int4_codes(w)
    assert quantize_weight(w, kind, native=native)
    q = quantized(w)
    assert q.kernel == ("native" if native else "torch")
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
    assert quantize_weight(w, kind, act_dtype=torch.bfloat16, native=False)
    x = torch.randn(4, w.shape[1], generator=torch.Generator().manual_seed(2))
    out = linear(x, w)
    assert out.dtype == torch.float32
    ref = F.linear(x, dequantize(quantized(w), codes))
    assert (out - ref).abs().max() < 0.02 * ref.abs().max()


@pytest.mark.parametrize("native", KERNELS)
def test_a_gguf_q4_1_block_maps_exactly_onto_an_int4_group(native):
    """Q4_1: w = d * q + m per block of 32, q in 0..15, d and m fp16. A block whose codes reach 0
    and 15 is recovered exactly: the same codes, s = d and lo = m; the native kernel (fp16 scales
    and offsets, one rounding) computes with exactly the file's weights."""
    g = torch.Generator().manual_seed(3)
    n, k = 16, 64
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32)
    q[:, ::32] = 0
    q[:, 1::32] = 15
    d = (torch.rand(n, k // 32, generator=g) * 0.01 + 1e-3).half().float()
    m = (-torch.rand(n, k // 32, generator=g) * 0.1).half().float()
    w = (d[..., None] * q.reshape(n, k // 32, 32).float() + m[..., None]).reshape(n, k)
    codes, s, lo = int4_codes(w)
    assert torch.equal(codes, q)
    assert torch.allclose(s, d, rtol=1e-5) and torch.equal(lo, m)
    assert quantize_weight(w, "int4", native=native)
    if native:
        assert torch.equal(dequantize(quantized(w)), w)
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


@pytest.mark.parametrize("kind,activations,kv", [("int8", "float", "auto"), ("int4", "float", "auto"),
                                                 ("int4", "float", "float32"), pytest.param(
    "int4", "int8", "auto", marks=pytest.mark.skipif(not cpu_kernels.available(), reason="needs the native CPU kernels"))])
def test_drafters_are_lossless_against_the_quantized_target(tiny_llama_dir, kind, activations, kv):
    """Greedy decoding of a quantized target, requests arriving at different steps: plain and
    speculative decoding (a truncated target as draft model, sharing the quantized weights; n-gram;
    EAGLE, whose own layer is quantized too) give the same tokens, with the activations as they are
    or quantized to int8, with the KV cache as `auto` picks it (fp16 under the native kernels) or fp32."""
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (5, 17, 9)]
    prompts.append([7, 100, 42, 9, 250, 31, 7, 100, 42, 9, 250, 31, 7, 100])
    engine = make_llm_engine(tiny_llama_dir, ("none", "ngram", "draft_model", "eagle"),
                             {"draft_model": {"draft_layers": 1}, "eagle": {"random_init": True}}, quantization=kind,
                             quantized_activations=activations, kv_cache_dtype=kv)
    assert engine.cache.kv.dtype == (torch.float32 if kv == "float32" or not cpu_kernels.available() else torch.float16)
    layer = engine.model.layers[0]
    head = engine.drafters["eagle"].head
    assert quantized(head.layer.qkv.weight).kind == kind     # the drafter's own layer ...
    # ... with int8 activations wherever the native kernels take int4, whatever the target's are
    assert quantized(head.layer.qkv.weight).int8_act == (kind == "int4" and cpu_kernels.available())
    assert quantized(head.fc.weight).kind == "int8" and not quantized(head.fc.weight).int8_act
    assert all(quantized(w).kind == kind for w in (layer.qkv.weight, layer.down.weight))
    assert quantized(layer.qkv.weight).int8_act == (activations == "int8")
    assert quantized(engine.model.lm_head_weight).kind == "int8"     # the LM head keeps 8 bits
    memory = engine.get_stats().memory_bytes
    assert 0 < memory["quantized"] < memory["weights"] / (2.5 if kind == "int8" else 4)   # the drafters' copies too
    assert memory["prepacked"] == 0      # a quantized weight keeps no fp32 oneDNN copy
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = run_requests(engine, prompts, params, prefix="p", drafter="none")
    for name in ("ngram", "draft_model", "eagle"):
        got = run_requests(engine, prompts, params, prefix=name, drafter=name)
        assert [got[f"{name}{i}"] for i in range(len(prompts))] == [plain[f"p{i}"] for i in range(len(prompts))], name
        assert engine.drafter_stats[name].num_draft_tokens > 0, name
    assert engine.drafter_stats["ngram"].num_accepted_tokens > 0 and engine.drafter_stats["draft_model"].num_accepted_tokens > 0
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_the_drafters_own_weights_stay_as_they_are_when_asked(tiny_llama_dir):
    engine = make_llm_engine(tiny_llama_dir, ("eagle",), {"eagle": {"random_init": True}}, quantization="int4",
                             quantize_drafters=False)
    assert quantized(engine.model.layers[0].qkv.weight) is not None
    assert quantized(engine.drafters["eagle"].head.layer.qkv.weight) is None


def test_gguf_tensor_types_say_what_each_weight_is_served_as():
    types = {"token_embd.weight": "Q8_0", "blk.0.attn_norm.weight": "F32"}
    for part in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"):
        types[f"blk.0.{part}.weight"] = "Q4_1"
        types[f"blk.1.{part}.weight"] = "Q4_0"
    types["blk.1.attn_v.weight"] = "Q8_0"       # a fused weight takes its most precise part
    types["blk.1.ffn_down.weight"] = "Q6_K"     # no packed kernel: dequantized
    kinds, dequantized = gguf_weight_kinds(types, 2)
    assert kinds == {"layers.0.qkv": "int4", "layers.0.o": "int4", "layers.0.gate_up": "int4", "layers.0.down": "int4",
                     "layers.1.qkv": "int8", "layers.1.o": "int4", "layers.1.gate_up": "int4", "layers.1.down": "none",
                     "lm_head": "int8"}                      # tied: the token embedding's type
    assert dequantized == ["Q6_K"]
    types["output.weight"] = "F16"                           # an untied head of its own
    assert gguf_weight_kinds(types, 2)[0]["lm_head"] == "none"
    cpu = torch.device("cpu")
    assert auto_quantization(types, cpu) == ("gguf" if cpu_kernels.available() or native_bf16() else "none")
    assert auto_quantization({"blk.0.attn_q.weight": "F16"}, cpu) == "none"     # a float GGUF
    assert auto_quantization({}, cpu) == "none"                                   # an HF folder


def test_a_gguf_model_is_served_quantized_by_default_and_an_hf_folder_is_not(default_model, tiny_llama_dir):
    engine = make_llm_engine("default", loaded=default_model, max_model_len=256, num_kv_blocks=32, block_size=16)
    layer = engine.model.layers[0]
    if cpu_kernels.available() or native_bf16():          # a fast int4 path: the native kernels (AVX2 or
        assert engine.quantization == "gguf"              # AVX-512) or torch's with native bf16
        assert quantized(layer.qkv.weight).kind == quantized(layer.down.weight).kind == "int4"    # Q4_1
        assert quantized(engine.model.lm_head_weight).kind == "int8"                               # Q8_0
        # fp16 where the native CPU kernels run the layer stack (fp32 maths, tree rows computed as
        # decode rows), float64 for SDPA
        assert engine.cache.kv.dtype == (torch.float16 if cpu_kernels.available() else torch.float64)
    else:
        assert engine.quantization == "none" and quantized(layer.qkv.weight) is None
    assert make_llm_engine(tiny_llama_dir).quantization == "none"
    with pytest.raises(ValueError, match="needs a GGUF"):
        make_llm_engine(tiny_llama_dir, quantization="gguf")


def test_int8_activations_are_the_default_where_the_native_kernels_have_a_fast_int8_path(default_model):
    """`--quantized-activations auto` (the default): the default GGUF's int4 weights multiply int8
    activations where the native kernels build and the CPU has AVX2 or AVX-512 VNNI; `float` and
    `int8` are what they say; the LM head (int8 weights) keeps fp32 activations."""
    from specserve.engine.config import EngineConfig
    from specserve.engine.quant import int8_activations

    fast = cpu_kernels.available() and cpu_kernels.fast_int8_dot()
    assert EngineConfig(model="default").quantized_activations == "auto"
    assert int8_activations("auto") == fast and int8_activations("float") is False
    assert int8_activations("int8") == cpu_kernels.available()
    with pytest.raises(ValueError, match="quantized activations"):
        int8_activations("int4")
    if not (cpu_kernels.available() or native_bf16()):
        pytest.skip("the default model is served unquantized here")
    engine = make_llm_engine("default", loaded=default_model, max_model_len=64, num_kv_blocks=8, block_size=16)
    layer = engine.model.layers[0]
    assert quantized(layer.qkv.weight).int8_act == quantized(layer.down.weight).int8_act == fast
    assert not quantized(engine.model.lm_head_weight).int8_act
    floats = make_llm_engine("default", loaded=default_model, max_model_len=64, num_kv_blocks=8, block_size=16,
                             quantized_activations="float")
    assert not quantized(floats.model.layers[0].qkv.weight).int8_act


@pytest.mark.parametrize("activations,kv", [("float", "auto"), ("float", "float32"), pytest.param(
    "int8", "auto", marks=pytest.mark.skipif(not cpu_kernels.available(),
                                             reason="int8 activations need the native CPU kernels"))])
def test_the_gguf_served_default_model_computes_the_dequantized_models_logits_closely(default_model, activations, kv):
    """The default model served as its GGUF stores it (int4 projections, int8 head; fp32 activations
    in the native kernels, else bf16 where the CPU has them) against transformers on the dequantized
    fp32 weights, every row of three chat prompts: cosine similarity >= 0.99, mean |difference| < 3 %
    of the logits' spread, the same top-1 token on >= 95 % of rows (measured 2026-11-27: native
    0.9998, 0.7 %, 100 %; torch's kernels with bf16 0.995, 1.7 %, 100 %, the top bin of the int8
    head's bf16 logits recomputed in fp32, without which 2 rows of 111 tied and took the lower token
    id). With int8 activations (the default where the CPU has a fast int8 path) the bounds are llama.cpp's on the same prompts (0.991,
    2.6 %, 94.6 %) loosened: cosine >= 0.96, mean < 5 %, top-1 >= 90 % (measured 0.973, 3.7 %,
    94.6 %). `auto` stores the KV cache in fp16 under the native kernels; an fp32 one gives the same
    figures (0.9998, 0.7 % against 0.8 %, 100 %)."""
    from specserve.bench.common import build_hf_model, chat_ids

    hf = build_hf_model(default_model)
    engine = make_llm_engine("default", loaded=default_model, quantization="gguf", max_model_len=256,
                             num_kv_blocks=32, block_size=16, quantized_activations=activations, kv_cache_dtype=kv)
    cos, mean, top1 = (0.99, 0.03, 0.95) if activations == "float" else (0.96, 0.05, 0.90)
    for text in ("What is the capital of France?", "Write a haiku about autumn.", "def quicksort(xs):"):
        ids = chat_ids(default_model.tokenizer, text)
        cache = KVCache(engine.model_config.num_layers, 16, 16, engine.model_config.num_kv_heads,
                        engine.model_config.head_dim, engine.cache.kv.dtype, torch.device("cpu"))
        positions, meta = build_attn_metadata([list(range(16))], 16, [0], [len(ids)], None, "cpu")
        with torch.inference_mode():
            want = hf(torch.tensor([ids])).logits[0]
            got = engine.model.compute_logits(engine.model(torch.tensor(ids), positions, cache, meta))
        assert F.cosine_similarity(got, want, dim=-1).min() >= cos
        assert (got - want).abs().mean() < mean * want.std()
        assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= top1


def test_an_unknown_quantization_is_refused():
    from specserve.engine.config import EngineConfig
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(quantization="int3")


bf16_only = pytest.mark.skipif(not native_bf16(), reason="the quantized kernels take bf16 activations only where "
                               "the CPU has native bf16; elsewhere they run in fp32")


@torch.inference_mode()
def _decoded_and_verified_hidden(engine, prompt: list[int], n: int, kv_dtype: torch.dtype):
    """Greedy-decode `n` tokens after `prompt` one row per forward, then verify them in one forward
    as a tree (each decoded token with a wrong sibling beside it, interleaved); the decoded rows'
    hidden states and the verified chain rows' hidden states."""
    model, cfg = engine.model, engine.model_config
    blocks, bs = [list(range(32))], 16

    def fresh_cache():
        cache = KVCache(cfg.num_layers, 32, bs, cfg.num_kv_heads, cfg.head_dim, kv_dtype, torch.device("cpu"))
        positions, meta = build_attn_metadata(blocks, bs, [0], [len(prompt)], None, "cpu")
        return cache, model(torch.tensor(prompt), positions, cache, meta)[-1:]

    cache, h = fresh_cache()
    tokens, decoded = [], []
    for i in range(n):
        tokens.append(int(model.compute_logits(h).argmax()))
        positions, meta = build_attn_metadata(blocks, bs, [len(prompt) + i], [1], None, "cpu")
        h = model(torch.tensor(tokens[-1:]), positions, cache, meta)
        decoded.append(h[0])
    ids, parents = [], []
    for i, t in enumerate(tokens):           # node 2i: the decoded token; node 2i + 1: its wrong sibling
        parent = NO_PARENT if i == 0 else 2 * i - 2
        ids += [t, (t + 7) % cfg.vocab_size]
        parents += [parent, parent]
    tree = build_tree_buffers(parents)
    cache, _ = fresh_cache()
    _, meta = build_attn_metadata(blocks, bs, [len(prompt)], [2 * n], [tree.mask], "cpu")
    verified = model(torch.tensor(ids), len(prompt) + tree.depths, cache, meta)
    return torch.stack(decoded), verified[0::2]


@bf16_only
@pytest.mark.parametrize("native", [True, False], ids=["native-kernels", "torch-ops"])
def test_verified_tree_rows_compute_the_decoded_rows_numbers_on_the_quantized_default_model(default_model, native,
                                                                                           monkeypatch):
    """bf16 activations amplify any difference in the last bits of attention into different
    tokens. With the engine's KV dtype a tree row's hidden state equals, bit for bit, the decode
    row's of the same token: fp32 maths over an fp16 cache through the native CPU kernels (every
    row computed alone), float64 through the torch ops (SDPA). SDPA in float32 (the broken control)
    does not."""
    if native and not cpu_kernels.available():
        pytest.skip("the native CPU kernels do not build here")
    monkeypatch.setattr(cpu_kernels, "ENABLED", native)
    engine = make_llm_engine("default", loaded=default_model, quantization="int4", max_model_len=512,
                             num_kv_blocks=64, block_size=16)
    assert engine.cache.kv.dtype == (torch.float16 if native else torch.float64)
    prompt = default_model.tokenizer.encode("The three laws of robotics are")
    decoded, verified = _decoded_and_verified_hidden(engine, prompt, 8, engine.cache.kv.dtype)
    assert torch.equal(verified, decoded)
    if not native:
        decoded, verified = _decoded_and_verified_hidden(engine, prompt, 8, torch.float32)
        assert not torch.equal(verified, decoded)


@bf16_only
def test_the_top_logits_of_an_int8_head_are_exact_so_bf16_ties_do_not_pick_the_token():
    """Two tokens whose logits differ by 0.008 round to the same bf16 value (the step at 50 is
    0.25); argmax of the rounded logits takes the lower id, the wrong one. `exact_top_logits`
    recomputes the top bin in fp32 and the higher token wins."""
    k = 64
    w = torch.full((3, k), 100 / 127)
    w[:, 0] = 1.0                       # every row's scale 1 / 127: codes 127, 100, 100, ...
    w[1, 1] = 101 / 127                 # token 1: one code higher than token 0
    w[2] *= 0.5                         # token 2: far below
    assert quantize_weight(w, "int8", torch.bfloat16)
    q = quantized(w)
    h = torch.ones(1, k)
    rounded = quantized_linear(h, q).float()
    assert rounded[0, 0] == rounded[0, 1] and rounded.argmax() == 0          # the tie the rounding made
    exact = exact_top_logits(rounded.clone(), h, q)
    assert exact.argmax() == 1 and exact[0, 1] - exact[0, 0] > 0
    assert exact[0, 2] == rounded[0, 2]                                        # outside the top bin: as it was
    torch.testing.assert_close(exact[0, :2], (h @ (q.data.float() * q.scales.float()[:, None]).t())[0, :2])
