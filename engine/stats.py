"""Plain statistics the engine keeps; the server turns them into Prometheus metrics."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0                 # fraction of KV blocks in use
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    num_preemptions_total: int = 0
    num_prompt_tokens_total: int = 0      # prompt tokens prefilled (recomputation included)
    num_generation_tokens_total: int = 0  # tokens generated
    num_steps_total: int = 0
