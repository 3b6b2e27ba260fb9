"""Engine configuration: small frozen dataclasses, each component gets only its part."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from specserve.engine.errors import InvalidRequestError, UnsupportedModelError
from specserve.engine.quant import ACTIVATIONS, QUANTIZATIONS

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
DRAFT_BUDGETS = ("goodput", "adaptive", "fixed")   # engine.draft_policy.POLICIES
KV_CACHE_DTYPES = ("auto", "float32", "float16", "float64")
AUTO_DRAFTER = "auto"   # --drafter auto: the drafters `drafters.auto` picks, one chosen per sequence every step


@dataclass(frozen=True)
class EngineConfig:
    """Everything `specserve serve` can set about the engine."""

    model: str = "default"
    dtype: str = "auto"                 # float32 | bfloat16 | float16 | auto (fp32 on CPU, bf16 on CUDA)
    device: str = "auto"                # cpu | cuda | auto
    max_num_seqs: int = 16              # running sequences per step
    max_model_len: int | None = None    # context length; default min(model limit, 8192)
    max_num_batched_tokens: int = 512   # tokens per step (prefill chunks + decode tokens)
    block_size: int = 16                # tokens per KV block
    num_kv_blocks: int | None = None    # KV pool size; default: enough for max_num_seqs full contexts, capped by memory
    kv_cache_memory_gib: float = 4.0    # cap for the default pool size
    # CUDA: the share of the device's memory the engine may hold (weights, drafters, activations, KV
    # pool), as vLLM's --gpu-memory-utilization; the pool's cap is what it leaves (replaces
    # kv_cache_memory_gib there). None: not used
    gpu_memory_utilization: float | None = None
    max_queue_len: int = 256            # waiting requests before new ones get 429
    seed: int = 0                       # seeds unseeded sampling
    drafters: tuple[str, ...] = ()      # drafters to load; the first is the default ("none" = plain decoding)
    num_speculative_tokens: int = 8     # max draft-tree nodes per sequence per step
    max_draft_tokens_per_step: int = 64 # all sequences' draft nodes together per step
    drafter_options: dict = field(default_factory=dict)  # drafter name -> its keyword options
    # how each decoding sequence's draft budget is chosen (within the two caps above):
    #   goodput  - per step, from measured acceptance and step/draft costs, to maximise the batch's
    #              committed tokens per second (0 where drafting does not pay); engine/draft_policy/
    #   adaptive - the per-step cap split evenly, each sequence's share following its acceptance (+2 / -1)
    #   fixed    - the per-step cap split evenly
    draft_budget: str = "goodput"
    grammar_drafts: bool = True   # structured output: draft the tokens a grammar forces (engine/grammar.py)
    grammar_compile_timeout: float = 10.0   # seconds a constraint may compile (engine/grammar_sandbox.py)
    step_cost_calibration: bool = True  # goodput: time a few forwards at start-up (off: learn from steps only)
    # CPU: keep a oneDNN-prepacked copy of the target's projection weights and LM head (and of the
    # drafters' own layers), so that a step of a few rows (draft trees, small batches) costs little
    # more than a 1-row decode; doubles those weights' memory
    prepack_weights: bool = True
    # CUDA: decode and verification steps replay CUDA graphs captured at start-up for (batch,
    # rows per sequence) buckets (engine/cuda_graphs.py); True runs every step eagerly (as vLLM's
    # --enforce-eager)
    enforce_eager: bool = False
    # async scheduling (as vLLM's --async-scheduling): a step of plain decodes launches the next one
    # before the host reads its tokens, so the host's work between steps overlaps the device's
    # forward (`LLMEngine`); None: on CUDA only (on the CPU the forward is the host's own work)
    async_scheduling: bool | None = None
    # CPU: the target's layer stack compiled with torch.compile (engine/compiled.py), compiled at
    # start-up (tens of seconds the first time, cached on disk by torch); not with enforce_eager
    compile: bool = False
    # run each drafter's drafting and verification once before serving (`LLMEngine.warm_up`), so
    # that kernels compile there and not in a served step or the draft policy's cost models;
    # None: on CUDA only (a CPU compiles nothing on first use)
    warm_up: bool | None = None
    # weight-only quantized projections (engine/quant.py; the CPU's kernels, Triton's on CUDA): none |
    # int8 (per row) | int4 (per group of 32) | gguf (each weight as the GGUF file stores it: Q4_0/Q4_1
    # int4, Q8_0 int8); auto: gguf for a quantized GGUF on a CPU where the native kernels build or
    # with native bf16, else none (on CUDA: none). The LM head too unless quantize_lm_head is False
    quantization: str = "auto"
    quantize_lm_head: bool = True
    # CPU: what int4 weights multiply (engine/quant.py `int8_activations`): auto (int8 where the native
    # kernels have a fast int8 path: AVX2, AVX-512 VNNI; else float) | float (fp32, or bf16 in torch's
    # kernels) | int8 (activations quantized per group of 32, as llama.cpp's Q4 x Q8 dot products;
    # native kernels only)
    quantized_activations: str = "auto"
    # CPU, with a quantized target: the drafters' own layers quantized like the target's (int4 with
    # int8 activations, or int8 under --quantization int8), their draft-vocabulary heads and fc/lift
    # maps int8 (engine.model `quantize_weights_in`); their drafting costs about half (EAGLE: 10.7 ->
    # 5.0 ms a step), and int8 activations took ~30 % more off EAGLE-3's
    quantize_drafters: bool = True
    # the KV cache's dtype, in which attention runs: auto | float32 | float64. auto is the model's
    # dtype, except float64 on the CPU when the quantized kernels take bf16 activations: there a
    # verification row's attention, computed in fp32 over a padded tree, differs from the decode
    # row's in the last bits, the bf16 casts of the next linears amplify that, and greedy
    # speculation stops reproducing plain decoding; in float64 the rows round to the same fp32
    # values (docs/architecture.md, "Quantized weights on the CPU")
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16, float16 or auto, got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be cpu, cuda or auto, got {self.device!r}")
        unloaded = sorted(set(self.drafter_options) - set(self.drafters))
        if unloaded and AUTO_DRAFTER not in self.drafters:   # auto's drafters are known once the model is (engine.core)
            raise ValueError(f"options given for drafters that are not loaded: {', '.join(unloaded)} "
                             f"(load them with --drafter NAME)")
        if self.gpu_memory_utilization is not None and not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "max_queue_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive")
        if self.quantized_activations not in ACTIVATIONS:
            raise ValueError(f"quantized_activations must be one of {', '.join(ACTIVATIONS)}, "
                             f"got {self.quantized_activations!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.draft_budget not in DRAFT_BUDGETS:
            raise ValueError(f"draft_budget must be one of {', '.join(DRAFT_BUDGETS)}, got {self.draft_budget!r}")

    def resolve_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError("--device cuda was asked for but no CUDA device is available")
        return torch.device(self.device)

    def resolve_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return getattr(torch, self.dtype)


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a Llama-family model, read from its HF config."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool                 # bias on q/k/v projections (Qwen2)
    hf_config: Any = None                # the transformers config (RoPE parameters live there)

    @classmethod
    def from_hf(cls, cfg: Any) -> "ModelConfig":
        model_type = getattr(cfg, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        act = getattr(cfg, "hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"activation {act!r} is not supported (only silu)")
        num_heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
        return cls(
            model_type=model_type,
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.rms_norm_eps,
            max_position_embeddings=getattr(cfg, "max_position_embeddings", 4096),
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            attention_bias=bool(getattr(cfg, "attention_bias", model_type == "qwen2")) or model_type == "qwen2",
            hf_config=cfg,
        )


def check_prompt_fits(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> None:
    """OpenAI's context check: prompt plus requested completion must fit the context."""
    if num_prompt_tokens == 0:
        raise InvalidRequestError("the prompt is empty", "prompt")
    requested = num_prompt_tokens + (max_tokens or 1)
    if num_prompt_tokens >= max_model_len or requested > max_model_len:
        raise InvalidRequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{requested} tokens ({num_prompt_tokens} in the prompt, {max_tokens or 1} for the completion). "
            "Please reduce the length of the prompt or of max_tokens.", "messages")
