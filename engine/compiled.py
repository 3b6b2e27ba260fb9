"""The target's forward compiled with `torch.compile` on the CPU: the lean step.

On the CPU a decode step of a small model is bound less by its matmuls than by the ~35 torch
operations each layer runs around them (norms, RoPE, casts to and from the quantized kernels'
bf16, residual adds, the SiLU gate), each a dispatch of a few microseconds: over 30 layers that is
a third to a half of a quantized step. Compiled, the operations between two matmuls become one
generated C++ loop, and the whole layer stack one call.

Attention stays outside the graph. Its batching depends on the step's ragged metadata (Python
lists: which rows decode, which verify a tree, how the padded batches split), so each layer calls
one opaque op, `specserve::attend(q, k, v, layer, scale)`, which writes the layer's new keys and
values to the paged cache and attends with the torch reference. The op reads the step's KV cache
and metadata from a forward context set around the call (the pattern of vLLM's
`unified_attention` and its forward context); the graph itself is a pure function of the tokens,
positions and weights, and is traced once for one-row inputs and once for any other row count
(dynamic shapes; torch specialises a size of 1), per set of captured layers.

The compiled forward replaces the eager one for every step of the engine (prefill, decode and
verification alike), so speculation stays lossless against the forward actually served.
Compiled and eager agree to float rounding (the generated loops may order a reduction
differently), not bit for bit. Weights are read as they are when traced: a weight changed in
place afterwards (training) needs a new `CompiledForward`.
"""

from __future__ import annotations

import logging
import os
import shutil
import time

import torch

from specserve.engine.attention import AttnMetadata
from specserve.engine.model import LlamaModel, write_and_attend

logger = logging.getLogger("specserve")

_context: list = [None]   # (kv_cache, attn_metadata) of the forward being run


@torch.library.custom_op("specserve::attend", mutates_args=())
def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, scale: float) -> torch.Tensor:
    """Layer `layer`'s cache write and attention (`engine.model.write_and_attend`) over the KV
    cache and metadata of the running compiled forward."""
    kv_cache, meta = _context[0]
    k_cache, v_cache = kv_cache.layer(layer)
    return write_and_attend(q, k, v, k_cache, v_cache, meta, scale)


@attend.register_fake
def _(q, k, v, layer, scale):
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


def compile_available() -> bool:
    """Whether torch.compile can build CPU code here: inductor needs a C++ compiler."""
    return shutil.which(os.environ.get("CXX", "g++")) is not None or shutil.which("c++") is not None


class CompiledForward:
    """`model`'s forward (same signature and results as `LlamaModel.forward`, to float rounding)
    with the layer stack compiled. The first call of each kind (one row, several rows; each set of
    captured layers) traces and compiles it: tens of seconds, cached on disk by torch afterwards."""

    def __init__(self, model: LlamaModel):
        self.model = model
        self._layers = torch.compile(self._run_layers, dynamic=True, fullgraph=True)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache, attn_metadata: AttnMetadata,
                 capture_layers: tuple[int, ...] = ()):
        if capture_layers:
            self.model.check_capture_layers(capture_layers)
        _context[0] = (kv_cache, attn_metadata)
        try:
            # fresh copies: the step's ids and positions are views into one staging buffer at varying
            # offsets, and a guard on their storage offset would recompile the graph mid-serving
            return self._layers(input_ids.clone(), positions.clone(), tuple(capture_layers))
        finally:
            _context[0] = None

    def _run_layers(self, input_ids, positions, capture_layers):
        return self.model.run_layers(input_ids, positions, capture_layers, _compiled_step)

    def warm_up(self, forward, capture_layers: tuple[int, ...] = ()) -> float:
        """Compile both graphs (one row, two rows) now, through `forward(num_tokens,
        capture_layers)` (the runner's `profile_forward`), rather than in a served step. Returns
        the seconds it took."""
        t0 = time.perf_counter()
        for captured in dict.fromkeys([(), tuple(capture_layers)]):
            for n in (1, 2):
                forward(n, captured)
        seconds = time.perf_counter() - t0
        logger.info("compiled the forward (torch.compile, CPU) in %.1f s", seconds)
        return seconds


def _compiled_step(i, layer, h, rope):
    return layer.forward_with(h, rope, lambda q, k, v: torch.ops.specserve.attend(q, k, v, i, layer.scale))


__all__ = ["CompiledForward", "attend", "compile_available"]
