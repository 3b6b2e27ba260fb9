"""The synchronous engine: `add_request`, `abort_request`, `step()`.

`step()` = schedule -> run the batch -> append sampled tokens, detokenise, apply stop rules ->
return the deltas of every request that changed. No threads, no asyncio: `AsyncEngine` wraps it.
"""

from __future__ import annotations

import logging
import time

import torch

from specserve.engine.config import EngineConfig, ModelConfig, check_prompt_fits
from specserve.engine.detokenizer import IncrementalDetokenizer
from specserve.engine.errors import InvalidRequestError
from specserve.engine.kv_cache import BlockManager, KVCache
from specserve.engine.loader import LoadedModel, load_model
from specserve.engine.model import LlamaModel
from specserve.engine.model_runner import ModelRunner, StepResult
from specserve.engine.outputs import RequestMetrics, RequestOutput, SeqDelta, TokenLogprob
from specserve.engine.sampling_params import SamplingParams
from specserve.engine.scheduler import Scheduler
from specserve.engine.sequence import Request, Sequence, SeqStatus
from specserve.engine.stats import EngineStats

logger = logging.getLogger("specserve")

DEFAULT_MAX_MODEL_LEN = 8192


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None):
        self.config = config
        loaded = loaded or load_model(config.model)
        self.model_name = loaded.name
        self.tokenizer = loaded.tokenizer
        self.eos_token_ids = set(loaded.eos_token_ids)
        self.model_config = ModelConfig.from_hf(loaded.hf_config)
        self.device = config.resolve_device()
        self.dtype = config.resolve_dtype(self.device)
        mc = self.model_config
        self.max_model_len = config.max_model_len or min(mc.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)
        if self.max_model_len > mc.max_position_embeddings:
            logger.warning("max_model_len %d exceeds the model's %d positions", self.max_model_len,
                           mc.max_position_embeddings)
        torch.manual_seed(config.seed)
        self.model = LlamaModel.from_state_dict(mc, loaded.state_dict, max_positions=self.max_model_len,
                                                dtype=self.dtype, device=self.device)
        num_blocks = config.num_kv_blocks or self._default_num_blocks()
        min_blocks = -(-self.max_model_len // config.block_size)
        if num_blocks < min_blocks:
            raise ValueError(f"{num_blocks} KV blocks cannot hold one {self.max_model_len}-token context "
                             f"(need {min_blocks}); raise --num-kv-blocks or lower --max-model-len")
        self.blocks = BlockManager(num_blocks, config.block_size)
        self.cache = KVCache(mc.num_layers, num_blocks, config.block_size, mc.num_kv_heads, mc.head_dim,
                             self.dtype, self.device)
        self.scheduler = Scheduler(self.blocks, config.max_num_seqs, config.max_num_batched_tokens)
        self.runner = ModelRunner(self.model, self.cache, self.blocks, self.device)
        self.requests: dict[str, Request] = {}
        self._changed: dict[str, Request] = {}
        self.stats = EngineStats(num_total_blocks=num_blocks)
        logger.info("engine ready: %s on %s/%s, %d KV blocks of %d tokens, max_model_len %d",
                    self.model_name, self.device, str(self.dtype).removeprefix("torch."), num_blocks,
                    config.block_size, self.max_model_len)

    def _default_num_blocks(self) -> int:
        mc, cfg = self.model_config, self.config
        per_block = KVCache.bytes_per_block(mc.num_layers, cfg.block_size, mc.num_kv_heads, mc.head_dim, self.dtype)
        wanted = cfg.max_num_seqs * -(-self.max_model_len // cfg.block_size)
        cap = int(cfg.kv_cache_memory_gib * 2**30) // per_block
        return max(min(wanted, cap), -(-self.max_model_len // cfg.block_size))

    # ---- requests -------------------------------------------------------------------------

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        check_prompt_fits(len(prompt_token_ids), params.max_tokens, self.max_model_len)
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})", "prompt")

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    arrival_time: float | None = None) -> None:
        self.validate(prompt_token_ids, params)
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        req = Request(request_id, list(prompt_token_ids), params,
                      RequestMetrics(arrival_time=arrival_time or time.monotonic()))
        for i in range(params.n):
            generator = None
            if params.seed is not None:
                generator = torch.Generator(device=self.device)
                generator.manual_seed((params.seed * 1_000_003 + i) % (2**63))
            detok = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, params)
            seq = Sequence(req, i, req.prompt_token_ids, detok, generator)
            req.seqs.append(seq)
            self.scheduler.add(seq)
        self.requests[request_id] = req

    def abort_request(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is None:
            return
        for seq in req.seqs:
            if not seq.is_finished:
                self._finish(seq, "abort")
        self._changed[request_id] = req

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    # ---- the step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        if batch:
            first = [seq for seq in batch.seqs if seq.request.metrics.first_scheduled_time is None]
            now = time.monotonic()
            for seq in first:
                seq.request.metrics.first_scheduled_time = now
            result = self.runner.execute(batch)
            for seq, n in zip(batch.seqs, batch.num_tokens):
                if seq.num_computed_tokens < seq.num_prompt_tokens:
                    self.stats.num_prompt_tokens_total += min(n, seq.num_prompt_tokens - seq.num_computed_tokens)
                seq.num_computed_tokens += n
            self._process(result)
            self.stats.num_steps_total += 1
        return self._collect()

    def _process(self, result: StepResult) -> None:
        now = time.monotonic()
        for k, (seq, token) in enumerate(zip(result.sampled, result.token_ids)):
            logprob = None
            if result.logprobs is not None and seq.params.logprobs is not None:
                top = result.top[k][:seq.params.logprobs]
                logprob = TokenLogprob(token, result.logprobs[k], top)
            self._append_token(seq, token, logprob)
            metrics = seq.request.metrics
            if metrics.first_token_time is None:
                metrics.first_token_time = now
            metrics.last_token_time = now
        self.stats.num_generation_tokens_total += len(result.token_ids)

    def _append_token(self, seq: Sequence, token: int, logprob: TokenLogprob | None) -> None:
        """Append one generated token and apply the stop rules in order: EOS, stop token ids,
        stop strings (via the detokenizer), max_tokens, context length."""
        params = seq.params
        seq.token_ids.append(token)
        seq.pending_token_ids.append(token)
        if logprob is not None:
            seq.pending_logprobs.append(logprob)
        self._changed[seq.request.request_id] = seq.request
        may_stop = seq.num_output_tokens > params.min_tokens
        if may_stop and not params.ignore_eos and token in self.eos_token_ids:
            self._finish(seq, "stop")
            return
        if may_stop and token in params.stop_token_ids:
            self._finish(seq, "stop", token)
            return
        delta, stop_string = seq.detokenizer.add_tokens([token])
        seq.pending_text += delta
        if stop_string is not None:
            self._finish(seq, "stop", stop_string, flush=False)
        elif ((params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens)
              or len(seq.token_ids) >= self.max_model_len):
            self._finish(seq, "length")

    def _finish(self, seq: Sequence, reason: str, stop_reason: str | int | None = None, flush: bool = True) -> None:
        if flush:
            seq.pending_text += seq.detokenizer.flush()
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        self.scheduler.remove(seq)

    def _collect(self) -> list[RequestOutput]:
        outputs = []
        now = time.monotonic()
        for request_id, req in self._changed.items():
            deltas = []
            for seq in req.seqs:
                newly_finished = seq.is_finished and not seq.reported_finished
                if not (seq.pending_token_ids or seq.pending_text or newly_finished):
                    continue
                deltas.append(SeqDelta(
                    index=seq.index, text=seq.pending_text, token_ids=seq.pending_token_ids,
                    logprobs=seq.pending_logprobs if seq.params.logprobs is not None else None,
                    finish_reason=seq.finish_reason if newly_finished else None,
                    stop_reason=seq.stop_reason if newly_finished else None))
                seq.pending_token_ids, seq.pending_text, seq.pending_logprobs = [], "", []
                seq.reported_finished = seq.is_finished
            finished = req.finished
            if finished:
                req.metrics.finished_time = now
                del self.requests[request_id]
            outputs.append(RequestOutput(request_id, deltas, finished, len(req.prompt_token_ids),
                                         req.num_generated_tokens, req.metrics, req.prompt_token_ids))
        self._changed.clear()
        return outputs

    def get_stats(self) -> EngineStats:
        s = self.stats
        s.num_running = sum(1 for _ in self.scheduler.running)
        s.num_waiting = len(self.scheduler.waiting)
        s.kv_usage = self.blocks.usage
        s.num_free_blocks = self.blocks.num_free_blocks
        s.num_preemptions_total = self.scheduler.num_preemptions
        return EngineStats(**vars(s))
