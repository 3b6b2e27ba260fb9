"""Our Llama-family forward equals transformers' on tiny random models (fp32), through the paged
KV cache: one-shot prefill, chunked prefill, and ragged batches of decode steps."""

from __future__ import annotations

import pytest
import torch
import transformers

from specserve.engine.attention import build_attn_metadata
from specserve.engine.config import ModelConfig
from specserve.engine.kv_cache import BlockManager, KVCache
from specserve.engine.model import LlamaModel

ATOL = 2e-4


def tiny_hf(kind: str):
    torch.manual_seed(0)
    common = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    if kind == "llama":
        cfg = transformers.LlamaConfig(**common, tie_word_embeddings=False)
        model = transformers.LlamaForCausalLM(cfg)
    elif kind == "llama_tied_mha":
        cfg = transformers.LlamaConfig(**{**common, "num_key_value_heads": 4}, tie_word_embeddings=True)
        model = transformers.LlamaForCausalLM(cfg)
    elif kind == "llama3_rope":
        cfg = transformers.LlamaConfig(**common, rope_theta=500000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64})
        model = transformers.LlamaForCausalLM(cfg)
    elif kind == "qwen2":
        cfg = transformers.Qwen2Config(**common, tie_word_embeddings=False)
        model = transformers.Qwen2ForCausalLM(cfg)
        with torch.no_grad():  # random init leaves biases at zero; make them matter
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    elif kind == "mistral":
        cfg = transformers.MistralConfig(**common, sliding_window=None)
        model = transformers.MistralForCausalLM(cfg)
    else:
        raise ValueError(kind)
    with torch.no_grad():  # norms at 1.0 hide weight-mapping mistakes
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
    return model.eval()


class Runner:
    """Drives our model the way the engine does: block tables, chunked writes, ragged batches."""

    def __init__(self, hf_model, block_size=4, num_blocks=64):
        self.cfg = ModelConfig.from_hf(hf_model.config)
        self.model = LlamaModel.from_state_dict(self.cfg, hf_model.state_dict(), max_positions=256,
                                                dtype=torch.float32, device=torch.device("cpu"))
        self.blocks = BlockManager(num_blocks, block_size)
        self.cache = KVCache(self.cfg.num_layers, num_blocks, block_size, self.cfg.num_kv_heads,
                             self.cfg.head_dim, torch.float32, torch.device("cpu"))
        self.lens: dict[int, int] = {}

    def run(self, chunks: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        """chunks: seq id -> new tokens. Returns seq id -> logits [len(new), vocab]."""
        ids, starts, qlens, tables = [], [], [], []
        for sid, toks in chunks.items():
            start = self.lens.get(sid, 0)
            assert self.blocks.grow(sid, start + len(toks))
            ids += toks
            starts.append(start)
            qlens.append(len(toks))
            tables.append(self.blocks.block_tables[sid])
            self.lens[sid] = start + len(toks)
        positions, meta = build_attn_metadata(tables, self.blocks.block_size, starts, qlens, None,
                                              torch.device("cpu"))
        with torch.inference_mode():
            hidden = self.model(torch.tensor(ids), positions, self.cache, meta)
            logits = self.model.compute_logits(hidden)
        out, row = {}, 0
        for sid, q in zip(chunks, qlens):
            out[sid] = logits[row:row + q]
            row += q
        return out


def hf_logits(hf_model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([tokens])).logits[0].float()


@pytest.mark.parametrize("kind", ["llama", "llama_tied_mha", "llama3_rope", "qwen2", "mistral"])
def test_prefill_matches_transformers(kind):
    hf = tiny_hf(kind)
    runner = Runner(hf)
    tokens = torch.randint(0, 300, (37,), generator=torch.Generator().manual_seed(1)).tolist()
    ours = runner.run({0: tokens})[0]
    torch.testing.assert_close(ours, hf_logits(hf, tokens), atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_chunked_prefill_and_ragged_decode_match_transformers(kind):
    hf = tiny_hf(kind)
    runner = Runner(hf)
    g = torch.Generator().manual_seed(2)
    prompts = {sid: torch.randint(0, 300, (n,), generator=g).tolist() for sid, n in [(0, 23), (1, 9), (2, 14)]}
    full = {sid: list(p) for sid, p in prompts.items()}
    # seq 0 prefills in chunks of 10/13 while seq 1 prefills at once; seq 2 joins later
    got0 = runner.run({0: prompts[0][:10], 1: prompts[1]})
    got1 = runner.run({0: prompts[0][10:]})
    ours0 = torch.cat([got0[0], got1[0]])
    torch.testing.assert_close(ours0, hf_logits(hf, prompts[0]), atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(got0[1], hf_logits(hf, prompts[1]), atol=ATOL, rtol=1e-4)
    # ragged decode batch: seqs of different lengths, one still prefilling
    for step in range(6):
        chunk = {sid: [int(torch.randint(0, 300, (1,), generator=g))] for sid in (0, 1)}
        if step == 2:
            chunk[2] = prompts[2]
        elif step > 2:
            chunk[2] = [int(torch.randint(0, 300, (1,), generator=g))]
        got = runner.run(chunk)
        for sid, toks in chunk.items():
            full[sid] = full[sid] + toks if sid != 2 or step > 2 else list(toks)
            ref = hf_logits(hf, full[sid])[-len(toks):]
            torch.testing.assert_close(got[sid], ref, atol=ATOL, rtol=1e-4)


def test_custom_mask_rows_see_only_their_ancestors():
    """The new-token mask is honoured: with an identity mask (each new token sees the prefix and
    itself) every new token's logits equal those of prefix + that token alone."""
    hf = tiny_hf("llama")
    runner = Runner(hf)
    prefix = list(range(5, 17))
    runner.run({0: prefix})
    new = [40, 41, 42]
    start = runner.lens[0]
    runner.blocks.grow(0, start + len(new))
    positions, meta = build_attn_metadata([runner.blocks.block_tables[0]], 4, [start], [3],
                                          [torch.eye(3, dtype=torch.bool)], torch.device("cpu"))
    positions = torch.full((3,), start)  # all three sit at depth 1 of a tree
    with torch.inference_mode():
        logits = runner.model.compute_logits(runner.model(torch.tensor(new), positions, runner.cache, meta))
    for i, tok in enumerate(new):
        torch.testing.assert_close(logits[i], hf_logits(hf, prefix + [tok])[-1], atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 9, 33])
@pytest.mark.parametrize("with_bias", [False, True])
def test_cpu_linear_equals_f_linear(dtype, rows, with_bias):
    """The CPU linear (oneDNN where available) computes what F.linear computes, for every row count
    a decode step or a draft tree has; other dtypes and shapes fall back to F.linear."""
    from specserve.engine.model import linear

    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 64, generator=g).to(dtype)
    w = torch.randn(96, 64, generator=g).to(dtype)
    b = torch.randn(96, generator=g).to(dtype) if with_bias else None
    ref = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
    tol = 1e-5 if dtype == torch.float32 else 0.1
    torch.testing.assert_close(linear(x, w, b).float(), ref, atol=tol, rtol=tol)
    torch.testing.assert_close(linear(x[None], w, b)[0].float(), ref, atol=tol, rtol=tol)   # 3-D: fallback


def test_onednn_probe_drops_a_dtype_this_cpu_lacks():
    """On a CPU without a bf16 inner product (AVX2-only x86-64) oneDNN raises when first called; the
    load-time probe then keeps that dtype on F.linear instead of failing every bf16 step."""
    from specserve.engine.model import onednn_linear_dtypes

    def avx2_only(x, w, b, *args):
        if x.dtype == torch.bfloat16:
            raise RuntimeError("could not create a primitive descriptor for the inner product forward "
                               "propagation primitive")
        return torch.nn.functional.linear(x, w, b)

    def wrong(x, w, b, *args):
        return torch.nn.functional.linear(x, w, b) + 1

    assert onednn_linear_dtypes(avx2_only) == {torch.float32}
    assert onednn_linear_dtypes(wrong) == frozenset()
    assert onednn_linear_dtypes(None) == frozenset()
    assert onednn_linear_dtypes(lambda x, w, b, *a: torch.nn.functional.linear(x, w, b)) == {torch.float32,
                                                                                         torch.bfloat16}


# ---- prepacked weights (CPU) -------------------------------------------------------------------

def _packable(dtype: torch.dtype) -> None:
    from specserve.engine.model import _PACK_DTYPES

    if dtype not in _PACK_DTYPES:
        pytest.skip(f"oneDNN cannot prepack {dtype} weights with this torch on this CPU")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 9, 33])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_equals_the_unpacked_one(dtype, rows, with_bias):
    """A weight with a prepacked copy gives what it gives without one (the same GEMM on a reordered
    weight: equal up to float rounding) and F.linear's result, at every row count."""
    from specserve.engine.model import linear, pack_linear_weight

    _packable(dtype)
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 64, generator=g).to(dtype)
    w = torch.randn(96, 64, generator=g).to(dtype)
    b = torch.randn(96, generator=g).to(dtype) if with_bias else None
    unpacked = linear(x, w, b)
    assert pack_linear_weight(w)
    packed = linear(x, w, b)
    tol = 1e-5 if dtype == torch.float32 else 0.1
    torch.testing.assert_close(packed.float(), unpacked.float(), atol=tol, rtol=tol)
    ref = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
    torch.testing.assert_close(packed.float(), ref, atol=tol, rtol=tol)


def test_packed_copy_is_ignored_once_the_weight_changes_in_place():
    """A weight updated in place (a test perturbing the target, a trainer's step) is used as it is
    now, not as it was packed."""
    from specserve.engine.model import linear, pack_linear_weight

    _packable(torch.float32)
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(4, 64, generator=g), torch.randn(96, 64, generator=g)
    assert pack_linear_weight(w)
    with torch.no_grad():
        w.mul_(2.0)
    torch.testing.assert_close(linear(x, w), torch.nn.functional.linear(x, w), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("packed", [False, True])
def test_linear_keeps_gradients(packed):
    """Where a gradient is wanted, neither oneDNN's op (it has no backward) nor the prepacked copy
    (which autograd does not see) is used: weight and input get F.linear's gradients."""
    from specserve.engine.model import linear, pack_linear_weight

    g = torch.Generator().manual_seed(0)
    w = torch.nn.Parameter(torch.randn(96, 64, generator=g))
    x = torch.randn(3, 64, generator=g, requires_grad=True)
    if packed:
        _packable(torch.float32)
        assert pack_linear_weight(w)
    linear(x, w).square().sum().backward()
    wr, xr = w.detach().clone().requires_grad_(), x.detach().clone().requires_grad_()
    torch.nn.functional.linear(xr, wr).square().sum().backward()
    torch.testing.assert_close(w.grad, wr.grad)
    torch.testing.assert_close(x.grad, xr.grad)


@pytest.mark.parametrize("kind", ["llama", "llama_tied_mha", "qwen2"])
def test_prepacked_model_computes_the_same_logits(kind):
    """`LlamaModel.pack_weights` packs every projection and the LM head, and the model then gives
    the same logits: a prefill, decode steps and a tree step with a custom mask, against the same
    model unpacked and against transformers."""
    _packable(torch.float32)
    hf = tiny_hf(kind)
    plain, packed = Runner(hf), Runner(hf)
    assert packed.model.pack_weights() == 4 * packed.cfg.num_layers + 1
    prompt = list(range(3, 40))
    steps = [{0: prompt}, {0: [41]}, {0: [42]}]
    for chunk in steps:
        a, b = plain.run(chunk)[0], packed.run(chunk)[0]
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(b, hf_logits(hf, prompt + [41, 42])[-1:], atol=ATOL, rtol=1e-4)
    outs = []
    for r in (plain, packed):
        start = r.lens[0]
        r.blocks.grow(0, start + 3)
        positions, meta = build_attn_metadata([r.blocks.block_tables[0]], 4, [start], [3],
                                              [torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)],
                                              torch.device("cpu"))
        with torch.inference_mode():
            outs.append(r.model.compute_logits(r.model(torch.tensor([50, 51, 52]), positions, r.cache, meta)))
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)


def test_pack_probe_drops_a_dtype_this_cpu_cannot_pack():
    """The load-time probe keeps a dtype unpacked where oneDNN's reorder fails (or disagrees)."""
    from specserve.engine.model import _ONEDNN_LINEAR, _ONEDNN_REORDER, onednn_pack_dtypes

    _packable(torch.float32)

    def no_bf16(w, rows):
        if w.dtype == torch.bfloat16:
            raise RuntimeError("could not create a primitive descriptor for a reorder primitive")
        return _ONEDNN_REORDER(w, rows)

    assert torch.bfloat16 not in onednn_pack_dtypes(_ONEDNN_LINEAR, no_bf16)
    assert torch.float32 in onednn_pack_dtypes(_ONEDNN_LINEAR, no_bf16)
    assert onednn_pack_dtypes(_ONEDNN_LINEAR, lambda w, rows: w * 2) == frozenset()
    assert onednn_pack_dtypes(_ONEDNN_LINEAR, None) == frozenset()
    assert onednn_pack_dtypes(None, _ONEDNN_REORDER) == frozenset()


def test_pack_weights_in_finds_layers_in_drafters_and_packs_shared_ones_once():
    """A drafter's own layers are found through its attributes; layers it shares with the target
    (a truncated draft model) keep the one copy the target's packing made."""
    from types import SimpleNamespace

    from specserve.engine.model import pack_weights_in

    _packable(torch.float32)
    runner = Runner(tiny_hf("llama"))
    model = runner.model
    first = model.layers[0].qkv.weight
    assert model.pack_weights() == 4 * runner.cfg.num_layers + 1
    copy = first._specserve_packed[0]
    own = Runner(tiny_hf("qwen2")).model.layers[0]
    from specserve.drafters.draft_vocab import DraftVocab

    vocab = DraftVocab(model.lm_head_weight, torch.randperm(300, generator=torch.Generator().manual_seed(0)), 64)
    drafter = SimpleNamespace(model=model.truncated(2), head=own, vocab=vocab, name="x")
    assert pack_weights_in(drafter) == (4 * 2 + 1) + 4 + 1   # the view's layers and head, own layer, vocab
    assert first._specserve_packed[0] is copy
    assert hasattr(own.gate_up.weight, "_specserve_packed") and hasattr(vocab.weight, "_specserve_packed")
    hidden = torch.randn(5, model.cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(vocab.logits(hidden), hidden @ vocab.weight.T, atol=1e-5, rtol=1e-5)


# ---- the per-layer small ops: RoPE in roll form, fused RMSNorm ----

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["llama", "llama3_rope"])
def test_rope_rows_rotate_as_apply_rope_bit_for_bit(kind, dtype):
    """The layer's roll form of RoPE (`rope_rows` + `apply_rope_rows`) gives the same floats as the
    rotate-half reference, on the real tables of a config, q and k heads rotated together."""
    from specserve.engine.model import apply_rope, apply_rope_rows, rope_rows, rope_tables

    cfg = ModelConfig.from_hf(tiny_hf(kind).config)
    cos_t, sin_t = rope_tables(cfg, 256, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    positions = torch.randint(0, 256, (7,), generator=g)
    cos, sin = cos_t[positions].to(dtype), sin_t[positions].to(dtype)
    x = (torch.randn(7, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim, generator=g) * 3).to(dtype)
    got = apply_rope_rows(x, rope_rows(cos, sin))
    assert torch.equal(got, apply_rope(x, cos, sin))
    # on a strided view (the q and k columns of a fused qkv output), as the layer calls it
    qkv = torch.randn(7, (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim, generator=g).to(dtype)
    view = qkv[:, :(cfg.num_heads + cfg.num_kv_heads) * cfg.head_dim].view(7, -1, cfg.head_dim)
    assert torch.equal(apply_rope_rows(view, rope_rows(cos, sin)), apply_rope(view.contiguous(), cos, sin))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_the_fp32_formula_and_keeps_gradients(dtype):
    from specserve.engine.model import rms_norm

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(5, 64, generator=g) * 4).to(dtype).requires_grad_()
    w = (torch.rand(64, generator=g) + 0.5).to(dtype).requires_grad_()
    xf = x.detach().float()
    want = w.detach() * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    got = rms_norm(x, w, 1e-5)
    tol = 1e-6 if dtype == torch.float32 else 0
    torch.testing.assert_close(got.detach(), want, rtol=tol, atol=tol)
    got.sum().backward()
    assert x.grad is not None and w.grad is not None and w.grad.abs().sum() > 0
