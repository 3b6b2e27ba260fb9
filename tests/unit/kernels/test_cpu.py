"""kernels/cpu.py (the native CPU kernels) against their torch references: RMSNorm with and
without the residual add, SiLU-mul, RoPE with the cache write, each from and to fp32 and bf16; the fused RoPE + attention call;
paged attention against the per-sequence oracle over a ragged batch (decode rows, a draft tree, a
chain, a prefill chunk, scattered blocks, grouped-query heads); the int4 / int8 weight-only matmuls
against their unpacked weights, built for AVX-512, AVX2 and plain x86-64; every row computed alone,
bit for bit, whatever the batch; a decoder layer through the kernels against the layer in torch
ops; and the build falling back when no compiler works."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from specserve.engine.attention import _paged_attention_loop, build_attn_metadata
from specserve.engine.tree import NO_PARENT, build_tree_buffers
from specserve.kernels import cpu

pytestmark = pytest.mark.skipif(not cpu.available(), reason="the native CPU kernels do not build here")
BF16 = torch.bfloat16
DTYPES = [torch.float32, BF16]


def _rand(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def _close(got, want, dtype):
    """fp32: to fp32 rounding; bf16 output: within one bf16 step (the fp32 values before rounding
    may differ in their last bits)."""
    assert got.dtype == want.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("in_dtype", DTYPES)
@pytest.mark.parametrize("out_dtype", DTYPES)
def test_rms_norm_and_add_rms_norm(in_dtype, out_dtype):
    x, res, w = _rand(5, 96, seed=1).to(in_dtype), _rand(5, 96, seed=2), _rand(96, seed=3)
    _close(cpu.rms_norm(x, w, 1e-5, out_dtype), cpu.rms_norm_reference(x, w, 1e-5, out_dtype), out_dtype)
    out, h = cpu.add_rms_norm(x, res, w, 1e-5, out_dtype)
    want_out, want_h = cpu.add_rms_norm_reference(x, res, w, 1e-5, out_dtype)
    assert torch.equal(h, want_h)                      # one fp32 add per element
    _close(out, want_out, out_dtype)


@pytest.mark.parametrize("in_dtype", DTYPES)
@pytest.mark.parametrize("out_dtype", DTYPES)
def test_silu_mul(in_dtype, out_dtype):
    gu = _rand(3, 2 * 80, scale=6).to(in_dtype)        # wide enough to reach exp's clamped range
    _close(cpu.silu_mul(gu, out_dtype), cpu.silu_mul_reference(gu, out_dtype), out_dtype)


def test_silu_mul_of_a_row_is_the_same_alone_or_among_others():
    # 1,100 columns: three pieces of the kernel's split, the last with a tail under 16 lanes
    gu = _rand(9, 2 * 1100, scale=6, seed=4)
    together = cpu.silu_mul(gu)
    for r in range(9):
        assert torch.equal(together[r:r + 1], cpu.silu_mul(gu[r:r + 1].clone()))
    _close(together, cpu.silu_mul_reference(gu), torch.float32)


@pytest.mark.parametrize("in_dtype", DTYPES)
def test_rope_and_cache(in_dtype):
    T, H, Hkv, D, S = 6, 4, 2, 16, 40
    qkv = _rand(T, (H + 2 * Hkv) * D).to(in_dtype)
    angle = _rand(T, 1, D, seed=4) * 3
    cos, sin = angle.cos(), angle.sin()
    slots = torch.tensor([3, 7, 8, 20, 21, 39])
    caches, ref_caches = [_rand(S, Hkv, D, seed=5), _rand(S, Hkv, D, seed=6)], None
    ref_caches = [c.clone() for c in caches]
    q = cpu.rope_and_cache(qkv, cos, sin, slots, *caches, H, Hkv, D)
    want = cpu.rope_and_cache_reference(qkv, cos, sin, slots, *ref_caches, H, Hkv, D)
    assert torch.equal(q, want)                        # the same two products and one add per element
    assert torch.equal(caches[0], ref_caches[0]) and torch.equal(caches[1], ref_caches[1])


def _half_cases(qkv: torch.Tensor, v_start: int) -> torch.Tensor:
    """qkv [T, width] with values at the start of each row's v (copied to the cache as they are) that
    fp16 rounds specially: subnormal, halfway, overflowing, zero."""
    qkv = qkv.clone()
    qkv[:, v_start:v_start + 8] = torch.tensor([3e-6, -5.9604645e-08 * 1.5, 65519.0, 65520.0, -1e6, 0.0,
                                                1.0 + 2.0 ** -11, 1.0 + 3 * 2.0 ** -11])   # halfway: to the even one
    return qkv


@pytest.mark.parametrize("in_dtype", DTYPES)
def test_rope_and_cache_into_an_fp16_cache(in_dtype):
    T, H, Hkv, D, S = 6, 4, 2, 16, 40
    qkv = _half_cases(_rand(T, (H + 2 * Hkv) * D) * 3, (H + Hkv) * D).to(in_dtype)
    angle = _rand(T, 1, D, seed=4) * 3
    slots = torch.tensor([3, 7, 8, 20, 21, 39])
    caches = [torch.zeros(S, Hkv, D, dtype=torch.float16) for _ in range(2)]
    ref = [c.clone() for c in caches]
    q = cpu.rope_and_cache(qkv, angle.cos(), angle.sin(), slots, *caches, H, Hkv, D)
    want = cpu.rope_and_cache_reference(qkv, angle.cos(), angle.sin(), slots, *ref, H, Hkv, D)
    assert torch.equal(q, want)
    assert torch.equal(caches[0], ref[0]) and torch.equal(caches[1], ref[1])   # torch's rounding to fp16


def _ragged_batch(head_dim: int):
    """A decode row, a 6-node draft tree, a causal 4-token chain and a 20-token prefill chunk over
    scattered blocks of 16 slots: (q, k_cache, v_cache, metadata)."""
    H, Hkv, bs = 6, 2, 16
    tree = build_tree_buffers([NO_PARENT, 0, 0, 1, 2, 2])
    tables = [[5, 2, 9], [1, 3, 4, 7], [8, 0], [10, 11, 12, 13, 14]]
    starts, qlens = [40, 50, 17, 30], [1, 6, 4, 20]
    _, meta = build_attn_metadata(tables, bs, starts, qlens, [None, tree.mask, None, None], "cpu")
    k_cache, v_cache = _rand(16 * bs, Hkv, head_dim, seed=7), _rand(16 * bs, Hkv, head_dim, seed=8)
    return _rand(sum(qlens), H, head_dim, seed=9), k_cache, v_cache, meta


@pytest.mark.parametrize("head_dim", [16, 64, 128])
@pytest.mark.parametrize("out_dtype", DTYPES)
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_paged_attention_matches_the_per_sequence_oracle(head_dim, out_dtype, cache_dtype):
    q, k_cache, v_cache, meta = _ragged_batch(head_dim)
    k_cache, v_cache = k_cache.to(cache_dtype), v_cache.to(cache_dtype)
    want = _paged_attention_loop(q, k_cache, v_cache, meta, head_dim ** -0.5).to(out_dtype)
    got = cpu.paged_attention(q, k_cache, v_cache, meta, head_dim ** -0.5, out_dtype)
    tol = 2e-6 if out_dtype == torch.float32 else 8e-3
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("in_dtype", DTYPES)
def test_attend_is_rope_and_cache_then_paged_attention(in_dtype):
    from specserve.engine.model import rope_rows

    q, k_cache, v_cache, meta = _ragged_batch(64)
    T, H, Hkv, D = q.shape[0], 6, 2, 64
    qkv = _rand(T, (H + 2 * Hkv) * D, seed=14).to(in_dtype)
    angle = _rand(T, D, seed=15) * 3
    rope = rope_rows(angle.cos(), angle.sin())
    caches = [k_cache.clone(), v_cache.clone()]
    got = cpu.attend(qkv, rope, meta, *caches, H, Hkv, D, 0.125, BF16)
    q = cpu.rope_and_cache(qkv, rope.cos, rope.sin_signed, meta.slot_mapping, k_cache, v_cache, H, Hkv, D)
    assert torch.equal(got, cpu.paged_attention(q, k_cache, v_cache, meta, 0.125, BF16))
    assert torch.equal(caches[0], k_cache) and torch.equal(caches[1], v_cache)


@pytest.mark.parametrize("head_dim", [16, 64])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_a_tree_row_computes_what_the_same_token_decoded_alone_computes(head_dim, cache_dtype):
    """Row invariance, the property greedy speculation relies on under bf16 activations: a node of
    a draft tree, verified among its siblings and another sequence's rows, attends over the same
    keys as the decode row of the same token after its path was committed, and gets the same bits.
    (SDPA, the torch reference, does not: its blocking depends on the call's shape.)"""
    H, Hkv, bs, prefix = 6, 2, 16, 181
    k_cache = _rand(40 * bs, Hkv, head_dim, seed=10).to(cache_dtype)
    v_cache = _rand(40 * bs, Hkv, head_dim, seed=11).to(cache_dtype)
    # a 16-node tree after the prefix (blocks 0..12): the path 0 -> 2 -> 5 -> 9 -> 14, siblings hidden from it
    parents = [NO_PARENT, NO_PARENT, 0, 1, 2, 2, 3, 4, 4, 5, 6, 7, 8, 9, 9, 10]
    tree = build_tree_buffers(parents)
    tq = _rand(16, H, head_dim, seed=12)
    other_q = _rand(9, H, head_dim, seed=13)
    _, meta = build_attn_metadata([list(range(13)), [20, 21]], bs, [prefix, 20], [16, 9], [tree.mask, None], "cpu")
    in_tree = cpu.paged_attention(torch.cat([tq, other_q]), k_cache, v_cache, meta, 0.3)[:16]
    # the path committed: its keys and values at consecutive positions of a sequence on blocks 24..36
    path = [0, 2, 5, 9, 14]
    k2, v2 = k_cache.clone(), v_cache.clone()
    src = list(range(prefix)) + [prefix + n for n in path]
    dst = torch.arange(24 * bs, 24 * bs + len(src))
    k2[dst], v2[dst] = k_cache[src], v_cache[src]
    for i, node in enumerate(path):                   # each path token decoded alone
        _, m = build_attn_metadata([list(range(24, 37))], bs, [prefix + i], [1], None, "cpu")
        alone = cpu.paged_attention(tq[node:node + 1], k2, v2, m, 0.3)
        assert torch.equal(alone[0], in_tree[node])


def _tiny_llama(num_layers: int):
    """A random fp32 Llama: 64 hidden, 96 intermediate, 4 heads over 2 kv heads of 16."""
    import transformers

    from specserve.engine.config import ModelConfig
    from specserve.engine.model import LlamaModel

    hf_cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96,
                                      num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=64)
    torch.manual_seed(0)
    sd = transformers.LlamaForCausalLM(hf_cfg).state_dict()
    return LlamaModel.from_state_dict(ModelConfig.from_hf(hf_cfg), sd, max_positions=64, dtype=torch.float32,
                                      device=torch.device("cpu"))


def test_a_decoder_layer_through_the_kernels_gives_the_torch_layers_output(monkeypatch):
    """A 2-layer Llama, one prefill and one tree-verification step, native kernels against the
    layer in torch ops (fp32, fp32 KV cache)."""
    from specserve.engine import model as model_mod
    from specserve.engine.kv_cache import KVCache

    model = _tiny_llama(2)
    tree = build_tree_buffers([NO_PARENT, 0, 0, 1])
    outs = []
    for enabled in (True, False):
        monkeypatch.setattr(cpu, "ENABLED", enabled)
        assert (model_mod.cpu_kernels(torch.zeros(1)) is not None) == enabled
        cache = KVCache(2, 4, 4, 2, 16, torch.float32, torch.device("cpu"))
        pos, meta = build_attn_metadata([[0, 1], [2, 3]], 4, [0, 0], [5, 3], None, "cpu")
        first = model(torch.tensor([1, 5, 9, 2, 7, 3, 3, 8]), pos, cache, meta)
        pos, meta = build_attn_metadata([[0, 1, 2]], 4, [5], [4], [tree.mask], "cpu")
        second = model(torch.tensor([4, 6, 8, 10]), 5 + tree.depths, cache, meta)
        outs.append((first, second, cache.kv.clone()))
    for got, want in zip(outs[0], outs[1]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


KINDS = ["int4", "int8", "int4-a8"]


@pytest.mark.parametrize("activations", ["float", "int8"])
def test_quantized_layers_in_one_call_compute_what_they_compute_one_by_one(activations, monkeypatch):
    """A 3-layer Llama with every projection quantized to int4 (native): the forward runs its layers
    in one native call, with or without captured layers; each way gives, bit for bit, what the
    layers give called one by one (`DecoderLayer.forward_native`), captured states and the
    KV cache included."""
    from specserve.engine.kv_cache import KVCache
    from specserve.engine.model import rope_at
    from specserve.engine.quant import quantize_model

    model = _tiny_llama(3)
    assert quantize_model(model, "int4", int8_act=activations == "int8")["weights"] == 3 * 4 + 1
    tree = build_tree_buffers([NO_PARENT, 0, 0, 1])
    steps = [(torch.tensor([1, 5, 9, 2, 7, 3, 3, 8]), [[0, 1], [2, 3]], [0, 0], [5, 3], None),
             (torch.tensor([4, 6, 8, 10]), [[0, 1, 2]], [5], [4], [tree.mask])]

    def by_layer(cache):
        outs = []
        for ids, tables, starts, lens, masks in steps:
            pos, meta = build_attn_metadata(tables, 4, starts, lens, masks, "cpu")
            if masks:
                pos = starts[0] + tree.depths
            h, delta = model.embed(ids), None
            rope = rope_at(model.rope_cos, model.rope_sin, pos, h.dtype)
            states = [h]
            for i, layer in enumerate(model.layers):
                h, delta = layer.forward_native(cpu, h, delta, rope, *cache.layer(i), meta)
                states.append(h + delta)
            outs.append((cpu.add_rms_norm(delta, h, model.norm, model.cfg.rms_norm_eps)[0], torch.stack(states, 1)))
        return outs

    def stacked(cache, capture):
        outs = []
        for ids, tables, starts, lens, masks in steps:
            pos, meta = build_attn_metadata(tables, 4, starts, lens, masks, "cpu")
            if masks:
                pos = starts[0] + tree.depths
            outs.append(model(ids, pos, cache, meta, capture_layers=capture))
        return outs

    runs = []
    real = cpu.decoder_layers
    monkeypatch.setattr(cpu, "decoder_layers", lambda params, start, count, *a, **k: (
        runs.append((start, count)), real(params, start, count, *a, **k))[1])
    with torch.inference_mode():
        ref_cache = KVCache(3, 4, 4, 2, 16, torch.float32, torch.device("cpu"))
        want = by_layer(ref_cache)
        for capture in ((), (0, 1, 2, 3), (2,), (3, 1)):
            cache = KVCache(3, 4, 4, 2, 16, torch.float32, torch.device("cpu"))
            runs.clear()
            got = stacked(cache, capture)
            assert runs == [(0, 3)] * len(steps)
            for g, (out, states) in zip(got, want):
                if capture:
                    g, captured = g
                    assert torch.equal(captured, states[:, list(capture)])
                assert torch.equal(g, out)
            assert torch.equal(cache.kv, ref_cache.kv)


def _quantized(kind, n, k, seed=0):
    """(packed codes, scales, a function x -> the product in float64 by the kernel's maths) for a
    random [n, k] weight as `kind`."""
    from specserve.engine.quant import int4_codes, int8_codes

    w = _rand(n, k, seed=seed, scale=0.05)
    if kind == "int8":
        codes, scales = cpu.pack_int8(*int8_codes(w))
        unpacked = cpu.unpack_int8(codes, scales)
    elif kind == "int4":
        codes, scales = cpu.pack_int4(*int4_codes(w))
        unpacked = cpu.unpack_int4(codes, scales)
    else:
        q, s, lo = int4_codes(w)
        codes, scales = cpu.pack_int4_a8(q, s, lo)
        assert torch.equal(cpu.unpack_int4_a8(codes, scales), cpu.unpack_int4(*cpu.pack_int4(q, s, lo)))
        return codes, scales, lambda x: cpu.quant_matmul_a8_reference(x, q, s, lo)
    return codes, scales, lambda x: x.double() @ unpacked.double().T


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n,k", [(16, 32), (208, 96), (960, 576)])
def test_quant_matmul_computes_its_reference(kind, n, k):
    """int4 / int8 with fp32 activations: x @ W^T of the unpacked weight (fp32 rounding); int4 with
    int8 activations: the activations quantized per group of 32 as the reference quantizes them,
    then the weights' integer dot products scaled (the same codes to the bit, fp32 rounding)."""
    codes, scales, reference = _quantized(kind, n, k)
    for rows in (1, 2, 3, 5, 8, 9, 12, 13, 30):
        x = _rand(rows, k, seed=rows)
        want = reference(x).float()
        torch.testing.assert_close(cpu.quant_matmul(x, kind, codes, scales, n), want, rtol=1e-5, atol=1e-5)


def test_int8_activations_round_half_away_from_zero():
    qx, dx, sx = cpu.quantize_rows_q8_reference(torch.tensor([[127.0, -63.5, 0.49, -0.5] + [0.0] * 28]))
    assert qx[0, :4].tolist() == [127, -64, 0, -1] and dx.item() == 1.0 and sx.item() == 127 - 64 - 1


@pytest.mark.parametrize("kind", KINDS)
def test_a_quant_matmul_row_is_the_same_whatever_the_other_rows(kind):
    """Every row block size and tile step computes a row by the same chain of operations: a tree
    row verified among 1..30 others equals that row multiplied alone, bit for bit."""
    n, k = 16 * 21, 96          # 21 tiles: steps of 8, 4, 2 and 1 all occur
    codes, scales, _ = _quantized(kind, n, k)
    x = _rand(30, k, seed=7)
    alone = torch.cat([cpu.quant_matmul(x[i:i + 1], kind, codes, scales, n) for i in range(30)])
    for rows in (2, 3, 4, 7, 8, 9, 12, 13, 25, 30):
        assert torch.equal(cpu.quant_matmul(x[:rows], kind, codes, scales, n), alone[:rows]), rows


@pytest.mark.parametrize("march,exact", [("x86-64-v3", True), ("x86-64", False)])
def test_the_quant_matmul_builds_for_other_cpus(monkeypatch, tmp_path, march, exact):
    """Built for AVX2 + FMA (x86-64-v3: no AVX-512, no VNNI) the kernels compute this machine's
    numbers bit for bit; for plain x86-64 (no FMA: a product rounded before its add) to fp32
    rounding. Runs where this CPU executes the build."""
    x = _rand(13, 96, seed=3)
    weights = {kind: _quantized(kind, 208, 96)[:2] for kind in KINDS}
    here = {kind: cpu.quant_matmul(x, kind, *weights[kind], 208) for kind in KINDS}
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu, "FLAGS", [f"-march={march}" if f == "-march=native" else f for f in cpu.FLAGS])
    monkeypatch.setattr(cpu, "_lib", None)
    assert cpu.library() is not None
    for kind in KINDS:
        got = cpu.quant_matmul(x, kind, *weights[kind], 208)
        if exact:
            assert torch.equal(got, here[kind]), kind
        else:
            torch.testing.assert_close(got, here[kind], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64"])
def test_the_fp16_cache_builds_for_other_cpus(monkeypatch, tmp_path, march):
    """F16C (x86-64-v3) and the scalar conversions (plain x86-64) round to fp16 as torch does, and
    attention over an fp16 cache gives this machine's numbers to fp32 rounding."""
    T, H, Hkv, D, S = 6, 4, 2, 16, 40
    qkv = _half_cases(_rand(T, (H + 2 * Hkv) * D) * 3, (H + Hkv) * D)
    angle = _rand(T, 1, D, seed=4) * 3
    slots = torch.tensor([3, 7, 8, 20, 21, 39])
    q, k_cache, v_cache, meta = _ragged_batch(64)
    k_cache, v_cache = k_cache.half(), v_cache.half()
    here = cpu.paged_attention(q, k_cache, v_cache, meta, 0.125)
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu, "FLAGS", [f"-march={march}" if f == "-march=native" else f for f in cpu.FLAGS])
    monkeypatch.setattr(cpu, "_lib", None)
    assert cpu.library() is not None
    caches = [torch.zeros(S, Hkv, D, dtype=torch.float16) for _ in range(2)]
    ref = [c.clone() for c in caches]
    cpu.rope_and_cache(qkv, angle.cos(), angle.sin(), slots, *caches, H, Hkv, D)
    cpu.rope_and_cache_reference(qkv, angle.cos(), angle.sin(), slots, *ref, H, Hkv, D)
    assert torch.equal(caches[0], ref[0]) and torch.equal(caches[1], ref[1])
    torch.testing.assert_close(cpu.paged_attention(q, k_cache, v_cache, meta, 0.125), here, rtol=1e-5, atol=1e-5)


def test_a_tensor_that_needs_gradients_is_left_to_the_torch_ops():
    """The kernels have no backward: a layer whose input wants a gradient runs its torch ops."""
    from specserve.engine.model import cpu_kernels

    x = torch.zeros(2, 8, requires_grad=True)
    assert cpu_kernels(x) is None
    with torch.no_grad():
        assert cpu_kernels(x) is cpu
    assert cpu_kernels(x.detach()) is cpu


def test_without_a_working_compiler_the_model_runs_its_torch_ops(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu, "_lib", None)
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "false")                  # a "compiler" that fails every build
    assert cpu.library() is None and not cpu.available()
    assert not list(tmp_path.rglob("*.so"))


def test_the_library_is_cached_per_source_and_compiler(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path))
    cc = cpu._compiler()
    path = cpu.library_path(cc)
    assert path.parent == tmp_path / "kernels" and path.suffix == ".so"
    monkeypatch.setattr(cpu, "FLAGS", [*cpu.FLAGS, "-DVARIANT"])
    assert cpu.library_path(cc) != path


def test_a_thread_gives_back_its_openmp_team(tmp_path):
    """`release_thread_team`: the calling thread's OpenMP worker exits (two OpenMP threads: a
    parallel region adds one thread, the release removes it)."""
    script = tmp_path / "child.py"
    script.write_text(
        "import json, os, time\n"
        "import torch\n"
        "from specserve.kernels import cpu\n"
        "threads = lambda: len(os.listdir('/proc/self/task'))\n"
        "before = threads()\n"
        "torch.ones(1 << 22).sum()\n"
        "during = threads()\n"
        "released = cpu.release_thread_team()\n"
        "for _ in range(300):\n"
        "    if threads() == before: break\n"
        "    time.sleep(0.01)\n"
        "print(json.dumps({'added': during - before, 'released': released, 'left': threads() - before}))\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    if not got["released"]:
        pytest.skip("the OpenMP runtime here is not libgomp")
    assert got == {"added": 1, "released": True, "left": 0}
