"""The two CPU weight benchmarks on the default model, at their smallest: the forward's cost by step
size per weight variant (`specserve bench forward --variants ...`) and plain decoding per
quantization (`specserve bench plain --quantization ...`). Each writes its JSON and renders its
table, and the quantized variants did quantize the weights."""

from __future__ import annotations

import json

import pytest

from specserve.bench import forward_cost, plain_decode

pytestmark = pytest.mark.slow


def test_forward_cost_times_every_weight_variant(default_model, tmp_path):
    out = tmp_path / "fwd"
    assert forward_cost.main(["--prefix", "16", "--tokens", "1", "3", "--repeats", "1",
                              "--variants", "prepacked", "int8", "int4", "--out", str(out)]) == 0
    result = json.loads(out.with_suffix(".json").read_text())
    assert list(result["forward_ms"]) == ["prepacked", "int8", "int4"]
    assert all(result["weights_done"][v] > 0 for v in ("int8", "int4"))
    assert all(ms > 0 for v in result["forward_ms"].values() for ms in v.values())
    table = forward_cost.markdown(result)
    assert "int4 / prepacked" in table and "| 3 |" in table


def test_plain_decode_per_quantization(default_model, tmp_path):
    out = tmp_path / "plain.json"
    plain_decode.main(["--num-prompts", "2", "--max-tokens", "6", "--no-hf", "--quantization", "none", "int8",
                       "--kv-cache-dtype", "float32", "--cpu-kernels", "both", "--out", str(out)])
    result = json.loads(out.read_text())
    assert set(result["quantization"]) == {"none+kv=float32", "int8+kv=float32", "none+kv=float32+torch-ops",
                                           "int8+kv=float32+torch-ops"}
    assert all(v > 0 for v in result["quantization"].values())
    assert result["same_as_unquantized"]["int8+kv=float32"].endswith("/2")    # against the unquantized variant
    assert result["same_as_unquantized"]["none+kv=float32+torch-ops"] == "2/2"    # fp32: same tokens either way
    assert set(result["kv_cache_dtype"].values()) == {"float32"}
    table = plain_decode.markdown(result)
    layer = "native kernels" if result["native_kernels"] else "torch ops"
    assert f"| specserve plain decoding | int8 | eager | {layer} | float32 |" in table and "| 1.00x |" in table
    assert "| specserve plain decoding | int8 | eager | torch ops | float32 |" in table
    assert "transformers generate" not in table


def test_plain_decode_table_names_compiled_variants():
    result = {"model": "m", "num_prompts": 2, "dataset": "mt_bench", "max_tokens": 6, "machine": "x86_64 2 threads, CPU",
              "date": "2026-11-27", "torch": "2", "transformers": "4",
              "quantization": {"none": 20.0, "none+compile": 25.0, "int4": 40.0, "int4+compile": 60.0},
              "same_as_unquantized": {"none+compile": "2/2", "int4": "1/2", "int4+compile": "1/2"},
              "kv_cache_dtype": {"int4+compile": "float64"}}
    table = plain_decode.markdown(result)
    assert "| specserve plain decoding | int4 | compiled | inductor | float64 | 60.0 | 3.00x | 1/2 |" in table
    assert "| specserve plain decoding | fp32 | eager | torch ops | – | 20.0 | 1.00x | – |" in table
    assert plain_decode.variant_name("int4", True) == "int4+compile"
    assert plain_decode.variant_name("int4", False, "float32") == "int4+kv=float32"
