"""The checkpoint format of trained drafters, and the fingerprint of the target they fit.

A checkpoint is a folder:

    model.safetensors   the drafter's own tensors (floating ones in bf16 by default: small)
    meta.json           what it is and what it fits (`CheckpointMeta`)

The frozen tensors a drafter shares with its target (embedding, LM head) are never saved: the
drafter takes them from the target by reference when it loads. A checkpoint only fits the target
it was trained on, so `load_checkpoint` refuses it for a target with another fingerprint
(`CheckpointMismatchError`), and refuses it for a drafter of another kind.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch
from safetensors.torch import load_file, save_file

from specserve.engine.model import hf_rope_parameters

FORMAT_VERSION = 1
WEIGHTS_FILE = "model.safetensors"
META_FILE = "meta.json"
FINGERPRINT_VERSION = 1
FINGERPRINT_ROWS = 16        # rows sampled from the embedding and the LM head


class CheckpointMismatchError(ValueError):
    """A checkpoint that does not fit: another target, another drafter kind or a newer format."""


@dataclass
class CheckpointMeta:
    """meta.json of a checkpoint. `hyperparams` is whatever the drafter needs to rebuild itself
    (sizes, number of heads, ...); `data` describes the training data (`sources`: examples per
    source, `num_examples`, `num_tokens`, ...); `tree` is an optional draft tree chosen by tree
    tuning, as `{"parents": [...]}` and/or `{"choices": [[0], [0, 1], ...]}`."""

    kind: str                                   # drafter kind: "medusa", "eagle", ...
    target_name: str                            # the target's served name, for people
    target_fingerprint: str                     # `target_fingerprint(...)`, for the check
    hyperparams: dict[str, Any] = field(default_factory=dict)
    data: dict[str, Any] = field(default_factory=dict)
    train_seconds: float | None = None
    created: str = ""                           # ISO-8601 UTC; filled in by save_checkpoint when empty
    device: str | None = None                   # where it was trained ("cuda: NVIDIA H100", "cpu")
    tau: float | None = None                    # measured mean accepted length on held-back prompts
    tau_details: dict[str, Any] = field(default_factory=dict)   # how τ was measured (prompts, tokens, ...)
    tree: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> "CheckpointMeta":
        known = {f for f in cls.__dataclass_fields__}
        missing = [k for k in ("kind", "target_name", "target_fingerprint") if k not in raw]
        if missing:
            raise ValueError(f"checkpoint metadata lacks {', '.join(missing)}")
        meta = cls(**{k: v for k, v in raw.items() if k in known})
        meta.extra = {**meta.extra, **{k: v for k, v in raw.items() if k not in known}}
        return meta


# ---- target fingerprint ---------------------------------------------------------------------------------------------

_ARCH_FIELDS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                "num_kv_heads", "head_dim", "rms_norm_eps", "tie_word_embeddings", "attention_bias")
_HF_FIELDS = ("rope_theta", "rope_scaling", "partial_rotary_factor", "sliding_window")


def _fingerprint_tensors(model) -> list[tuple[str, torch.Tensor]]:
    """The weights sampled for the fingerprint, from a LlamaModel or an HF-named state dict."""
    if isinstance(model, Mapping):
        sd = {k.removeprefix("model."): v for k, v in model.items()}
        embed = sd["embed_tokens.weight"]
        head = sd.get("lm_head.weight", embed)
        norm = sd["norm.weight"]
        last = max(int(k.split(".")[1]) for k in sd if k.startswith("layers."))
        down = sd[f"layers.{last}.mlp.down_proj.weight"]
    else:
        embed, head, norm = model.embed.weight, model.lm_head_weight, model.norm
        down = model.layers[len(model.layers) - 1].down.weight
    rows = torch.linspace(0, embed.shape[0] - 1, FINGERPRINT_ROWS).long()
    return [("embed", embed[rows.to(embed.device)]), ("lm_head", head[rows.to(head.device)]), ("norm", norm),
            ("last_down", down[:4])]


def target_fingerprint(model_config, model) -> str:
    """16 hex digits naming a target: its architecture (sizes, heads, vocabulary, norm eps, RoPE
    parameters) and a sample of its weights (16 evenly spaced rows of the embedding and of the LM
    head, the final norm, the first rows of the last layer's down projection). Two models with the
    same config but different weights (a fine-tune) get different fingerprints.

    The sampled weights are hashed after a cast to bf16, so the same weights loaded in fp32 or in
    bf16 (a bf16 load is a round-to-nearest cast of the fp32 weights) give the same fingerprint;
    an fp16 load may not (fp32 -> fp16 -> bf16 rounds twice).

    `model_config` is an engine ModelConfig; `model` a LlamaModel or an HF-named state dict.
    """
    arch = {name: getattr(model_config, name) for name in _ARCH_FIELDS}
    hf = getattr(model_config, "hf_config", None)
    # RoPE in transformers 4's form, under transformers 5 too (which keeps it in `rope_parameters`)
    rope = dict(zip(("rope_theta", "rope_scaling"), hf_rope_parameters(hf))) if hf is not None else {}
    for name in _HF_FIELDS:
        value = rope[name] if name in rope else getattr(hf, name, None) if hf is not None else None
        if value is not None:
            arch[name] = value
    h = hashlib.sha256(f"specserve-target-v{FINGERPRINT_VERSION}:".encode())
    h.update(json.dumps(arch, sort_keys=True, default=str).encode())
    for name, tensor in _fingerprint_tensors(model):
        sample = tensor.detach().to(device="cpu", dtype=torch.bfloat16).contiguous()
        h.update(f"{name}:{tuple(sample.shape)}:".encode())
        h.update(sample.view(torch.int16).numpy().tobytes())
    return h.hexdigest()[:16]


# ---- save / load ----------------------------------------------------------------------------------------------------

def save_checkpoint(directory: str | os.PathLike, tensors: Mapping[str, torch.Tensor],
                    meta: CheckpointMeta | Mapping[str, Any], *, dtype: torch.dtype | None = torch.bfloat16) -> Path:
    """Write `tensors` (floating ones cast to `dtype`; None keeps them as they are) and `meta` to
    `directory` (created if needed). Each file is written to a temporary name and renamed, so an
    interrupted save never leaves a half-written file under the final name. Returns the folder."""
    meta = meta if isinstance(meta, CheckpointMeta) else CheckpointMeta.from_dict(meta)
    if not meta.created:
        meta.created = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        t = t.detach()
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        out[name] = t.to("cpu").contiguous()
    tmp = directory / (WEIGHTS_FILE + ".tmp")
    save_file(out, str(tmp), metadata={"format": "pt", "kind": meta.kind,
                                       "target_fingerprint": meta.target_fingerprint})
    os.replace(tmp, directory / WEIGHTS_FILE)
    tmp = directory / (META_FILE + ".tmp")
    tmp.write_text(json.dumps(meta.to_dict(), indent=2, sort_keys=False, default=str) + "\n", encoding="utf-8")
    os.replace(tmp, directory / META_FILE)
    return directory


def read_meta(directory: str | os.PathLike) -> CheckpointMeta:
    """meta.json of a checkpoint folder (no weights read)."""
    path = Path(directory) / META_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{directory} is not a drafter checkpoint: {META_FILE} is missing")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON: {e}") from e
    return CheckpointMeta.from_dict(raw)


def load_checkpoint(directory: str | os.PathLike, *, kind: str | None = None, fingerprint: str | None = None,
                    device: str | torch.device = "cpu",
                    dtype: torch.dtype | None = None) -> tuple[dict[str, torch.Tensor], CheckpointMeta]:
    """(tensors, meta) of the checkpoint in `directory`.

    `kind` and `fingerprint` (of the target it is loaded for) are checked before any weight is read:
    a mismatch raises `CheckpointMismatchError` naming both sides. Floating tensors are cast to
    `dtype` when given."""
    meta = read_meta(directory)
    if meta.format_version > FORMAT_VERSION:
        raise CheckpointMismatchError(
            f"{directory}: checkpoint format {meta.format_version} is newer than this specserve reads "
            f"({FORMAT_VERSION}); upgrade specserve")
    if kind is not None and meta.kind != kind:
        raise CheckpointMismatchError(
            f"{directory} is a {meta.kind!r} checkpoint, not a {kind!r} one")
    if fingerprint is not None and meta.target_fingerprint != fingerprint:
        raise CheckpointMismatchError(
            f"{directory} was trained for the target {meta.target_name!r} (fingerprint {meta.target_fingerprint}) "
            f"and does not fit this target (fingerprint {fingerprint}); train one for it with "
            f"`specserve train {meta.kind} --model ...`")
    path = Path(directory) / WEIGHTS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{directory}: {WEIGHTS_FILE} is missing")
    tensors = load_file(str(path), device=str(device))
    if dtype is not None:
        tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
    return tensors, meta


SHIPPED_DIR = Path(__file__).resolve().parent.parent / "checkpoints"


def find_shipped(kind: str | None, fingerprint: str,
                 root: str | os.PathLike | None = None) -> list[tuple[CheckpointMeta, Path]]:
    """(meta, folder) of every `kind` checkpoint (any kind: None) made for the target with
    `fingerprint` among the sub-folders of `root` (default: the checkpoints shipped in
    drafters/checkpoints/), by folder name. Folders without a readable meta.json are passed over."""
    root = SHIPPED_DIR if root is None else Path(root)
    found = []
    for meta_file in sorted(root.glob("*/meta.json")) if root.is_dir() else ():
        try:
            meta = read_meta(meta_file.parent)
        except (OSError, ValueError):
            continue
        if kind in (None, meta.kind) and meta.target_fingerprint == fingerprint:
            found.append((meta, meta_file.parent))
    return found


def describe_device(device: str | torch.device) -> str:
    """'cuda: NVIDIA H100 80GB HBM3', 'cpu' ... for CheckpointMeta.device."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        return f"cuda: {torch.cuda.get_device_name(device)}"
    return device.type


def resolve_checkpoint(kind: str, fingerprint: str, checkpoint=None, root: str | os.PathLike | None = None) -> str:
    """`checkpoint` when one is given, else the shipped `kind` checkpoint made for the target with
    `fingerprint` (see `find_shipped`); with neither, a ValueError saying how to train one."""
    if checkpoint is not None:
        return str(checkpoint)
    found = find_shipped(kind, fingerprint, root)
    if not found:
        raise ValueError(
            f"the {kind} drafter has no checkpoint for this target (none shipped in drafters/checkpoints/ matches "
            f"its fingerprint {fingerprint}): train one with `specserve train {kind} --model MODEL --out DIR` and "
            f"load it with `--drafter-option {kind}.checkpoint=DIR`")
    return str(found[0][1])
