"""The synchronous engine: `add_request`, `abort_request`, `step()`.

`step()` = schedule -> run the batch -> append sampled tokens, detokenise, apply stop rules ->
return the deltas of every request that changed. No threads, no asyncio: `AsyncEngine` wraps it.
"""

from __future__ import annotations

import importlib.util
import logging
import time

import torch

from specserve.engine.config import AUTO_DRAFTER, EngineConfig, ModelConfig, check_prompt_fits
from specserve.engine.detokenizer import IncrementalDetokenizer
from specserve.engine.draft_policy import DraftCall, StepReport, TreeOutcome, budget_sizes
from specserve.engine.errors import ConstraintError, InvalidRequestError, is_unrecoverable
from specserve.engine.features import FeatureStore
from specserve.engine.kv_cache import BlockManager, KVCache, activation_reserve_bytes, kv_pool_bytes
from specserve.engine.loader import LoadedModel, load_model
from specserve.engine.grammar import GRAMMAR_PART, Grammars, forced_tree, is_forced_tree, split_forced
from specserve.engine.logits_processing import DraftLaw, needs_processing
from specserve.engine.model import LlamaModel, pack_weights_in, quantize_weights_in
from specserve.engine.model_runner import LaunchedStep, ModelRunner, StepResult
from specserve.engine.outputs import RequestMetrics, RequestOutput, SeqDelta, TokenLogprob
from specserve.engine.quant import auto_quantization, int8_activations, native_bf16, quantize_model
from specserve.engine.sampler import sample_key
from specserve.engine.sampling_params import SamplingParams
from specserve.engine.scheduler import ScheduledBatch, Scheduler
from specserve.engine.sequence import DraftRequest, Request, Sequence, SeqStatus
from specserve.engine.stats import DrafterStats, EngineStats, add_part_tally
from specserve.engine.tree import TokenTree, sources_problem, tree_depths
from specserve.kernels import cpu as native_cpu

_DEFAULT = object()
NO_DRAFTER = "none"

logger = logging.getLogger("specserve")


def _tells_context(drafter) -> bool:
    """Whether `drafter` overrides `Drafter.context_of` (else it never tells one: not asked)."""
    from specserve.drafters.base import Drafter   # the protocol, no specific drafter

    return getattr(type(drafter), "context_of", Drafter.context_of) is not Drafter.context_of


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
        # what the process held on the device before this engine: --gpu-memory-utilization counts the
        # engine's own memory (another engine's in the same process is not this one's weights)
        self._device_bytes_before = torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0
        mc = self.model_config
        self.max_model_len = config.max_model_len or min(mc.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)
        if self.max_model_len > mc.max_position_embeddings:
            logger.warning("max_model_len %d exceeds the model's %d positions", self.max_model_len,
                           mc.max_position_embeddings)
        torch.manual_seed(config.seed)
        self.model = LlamaModel.from_state_dict(mc, loaded.state_dict, max_positions=self.max_model_len,
                                                dtype=self.dtype, device=self.device)
        act = self._quantize(config, loaded.gguf_types)
        self.kv_dtype = self._kv_cache_dtype(config, act)
        # the target's features of every KV position, for the sequences whose drafter reads them
        self.features = FeatureStore(mc.hidden_size, self.dtype, self.device)
        self.drafters = self._load_drafters(config.drafters)
        if self.quantization != "none" and config.quantize_drafters and self.drafters:
            done = quantize_weights_in(*self.drafters.values(), kind="int8" if self.quantization == "int8" else "int4")
            logger.info("quantized %d weight matrices of the drafters", done)
        if config.prepack_weights and self.device.type == "cpu":
            packed = self.model.pack_weights() + pack_weights_in(*self.drafters.values())
            logger.info("prepacked %d weight matrices for oneDNN", packed)
        # the KV pool last, so that a pool sized by --gpu-memory-utilization sees the drafters' memory
        num_blocks = config.num_kv_blocks or self._default_num_blocks()
        min_blocks = -(-self.max_model_len // config.block_size)
        if num_blocks < min_blocks:
            raise ValueError(f"{num_blocks} KV blocks cannot hold one {self.max_model_len}-token context "
                             f"(need {min_blocks}); raise --num-kv-blocks or lower --max-model-len")
        self.blocks = BlockManager(num_blocks, config.block_size)
        self.cache = KVCache(mc.num_layers, num_blocks, config.block_size, mc.num_kv_heads, mc.head_dim,
                             self.kv_dtype, self.device)
        self.scheduler = Scheduler(self.blocks, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.num_speculative_tokens, config.max_draft_tokens_per_step, self.max_model_len,
                                   draft_budget=config.draft_budget, grammar_drafts=config.grammar_drafts)
        self.default_drafter = config.drafters[0] if config.drafters and config.drafters[0] != NO_DRAFTER else None
        if self.default_drafter == AUTO_DRAFTER and not self.auto_drafters:
            self.default_drafter = None
        self.drafter_stats = self._new_drafter_stats()
        self.features.set_capture_layers(self._capture_layers())
        # the drafters that tell a context for each tree (`Drafter.context_of`), less those that failed to
        self._context_drafters = {name for name, d in self.drafters.items() if _tells_context(d)}
        if self._context_drafters:
            self.scheduler.context_of = self._draft_contexts
        self.scheduler.drafts_after = frozenset(name for name, d in self.drafters.items()
                                                if getattr(d, "drafts_after_uncommitted", False))
        self.grammars = Grammars(self.tokenizer, mc.vocab_size, self.eos_token_ids,   # structured output
                                 compile_timeout=config.grammar_compile_timeout)
        self.runner = ModelRunner(self.model, self.cache, self.blocks, self.device, self.features.capture_layers,
                                  eos_token_ids=tuple(self.eos_token_ids))
        self.requests: dict[str, Request] = {}
        self._changed: dict[str, Request] = {}
        self.async_scheduling = (config.async_scheduling if config.async_scheduling is not None
                                 else self.device.type == "cuda")
        self._ahead: tuple[ScheduledBatch, LaunchedStep] | None = None   # a step launched, not yet read
        self.stats = EngineStats(num_total_blocks=num_blocks, memory_bytes=self.memory_bytes())
        logger.info("memory: %s", ", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in self.stats.memory_bytes.items()))
        if config.compile and self.device.type == "cpu" and not config.enforce_eager:
            self._compile_forward()
        calibrate = getattr(self.scheduler.policy, "calibrate", None)   # the goodput policy's step cost curve
        if self.drafters and calibrate is not None and config.step_cost_calibration:
            t0 = time.perf_counter()
            points = calibrate(self.runner.profile_forward, self.scheduler.max_step_tokens)
            logger.info("step cost calibrated in %.2f s: %s", time.perf_counter() - t0,
                        ", ".join(f"{n} tokens {s * 1e3:.1f} ms" for n, s in points.items()))
        if self.device.type == "cuda" and not config.enforce_eager:
            from specserve.engine.attention import triton_available
            from specserve.engine.cuda_graphs import CudaGraphBackend
            if triton_available():
                self.capture_graphs(CudaGraphBackend(self.device))
            else:
                logger.warning("triton is not installed: no CUDA graphs, every step runs eagerly")
        if config.warm_up if config.warm_up is not None else self.device.type == "cuda":
            self.warm_up()
        logger.info("engine ready: %s on %s/%s, %d KV blocks of %d tokens (%s), max_model_len %d",
                    self.model_name, self.device, str(self.dtype).removeprefix("torch."), num_blocks,
                    config.block_size, str(self.kv_dtype).removeprefix("torch."), self.max_model_len)

    def _compile_forward(self) -> None:
        """The runner's forward becomes the compiled one (engine/compiled.py), compiled here for
        the shapes steps use, before the step cost is calibrated or a request served."""
        from specserve.engine.compiled import CompiledForward, compile_available

        if self.model.runs_natively():
            logger.info("--compile: the layer stack already runs as one call of the native CPU kernels; "
                        "nothing to compile")
            return
        if not compile_available():
            logger.warning("no C++ compiler found: the forward runs eagerly (install g++ for torch.compile)")
            return
        compiled = CompiledForward(self.model)
        self.runner.forward = compiled
        try:
            compiled.warm_up(self.runner.profile_forward, self.runner.capture_layers)
        except Exception as exc:   # a compiler or CPU torch cannot build for: serve eagerly rather than not at all
            logger.warning("torch.compile failed (%s: %s): the forward runs eagerly", type(exc).__name__,
                           str(exc).splitlines()[0] if str(exc) else "")
            self.runner.forward = self.model

    def warm_up(self, num_tokens: int = 6) -> float:
        """Each drafter's drafting and verification paths once before serving: two short greedy
        requests per drafter decoded together, every sequence drafting its full tree (the fixed
        budget), so that kernels compile and libraries initialise here rather than in a served step,
        where the draft policy would learn from a second-long compile that trees do not pay.
        The policy sees none of it, and the engine's and drafters' statistics start at zero after
        it. Returns the seconds it took."""
        from specserve.engine.draft_policy.fixed import FixedPolicy

        if not self.drafters:
            return 0.0
        t0 = time.perf_counter()
        vocab = self.model_config.vocab_size
        prompt = [(7 + 3 * i) % vocab for i in range(5)] * 4     # repeats: lookup drafters find matches
        params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
        policy, self.scheduler.policy = self.scheduler.policy, FixedPolicy(self.config.num_speculative_tokens)
        try:
            for name in self.drafters:
                for i in range(2):
                    self.add_request(f"warm-up-{name}-{i}", prompt[i:], params, drafter=name)
                while self.has_unfinished_requests():
                    self.step()
        finally:
            self.scheduler.policy = policy
            for rid in list(self.requests):
                self.abort_request(rid)
        self.stats = EngineStats(num_total_blocks=self.stats.num_total_blocks, memory_bytes=self.stats.memory_bytes)
        self.drafter_stats = self._new_drafter_stats()
        seconds = time.perf_counter() - t0
        logger.info("warmed up %d drafters in %.1f s", len(self.drafters), seconds)
        return seconds

    def _new_drafter_stats(self) -> dict[str, DrafterStats]:
        """Zeroed counters per served drafter. A composite drafter may name its parts up front
        (`part_names`), so that their counters exist at zero from the start; parts first seen in a
        tree's provenance are added then."""
        out = {}
        for name, drafter in self.drafters.items():
            out[name] = DrafterStats()
            out[name].observe_parts({str(part): (0, 0) for part in getattr(drafter, "part_names", ()) or ()})
        out[GRAMMAR_PART] = DrafterStats()    # the tokens structured output forces (engine/grammar.py)
        return out

    def capture_graphs(self, backend) -> None:
        """Capture the target's forward for every (batch, nodes) bucket: batch sizes up to
        max_num_seqs, rows per sequence 1 (decode) up to num_speculative_tokens + 1 (a tree and
        its root) (engine/cuda_graphs.py); decode and verification steps replay them from then on.
        `backend`: how to capture (`CudaGraphBackend` on CUDA; `EagerReplay`, the CPU stand-in)."""
        from specserve.engine.cuda_graphs import StepGraphs, chain_buckets

        cfg = self.config
        max_nodes = cfg.num_speculative_tokens + 1
        max_chunk = min(cfg.max_num_batched_tokens, self.max_model_len)
        # a padded row may read keys up to its bucket's last position: the tables cover that much
        max_rows = max([max_nodes, *chain_buckets(max_nodes, max_chunk)])
        max_blocks = -(-(self.max_model_len + max_rows) // cfg.block_size) + 1
        graphs = StepGraphs(self.model, self.cache, cfg.block_size, cfg.max_num_seqs, max_nodes, max_blocks,
                            self.device, backend, self.runner.capture_layers, max_chunk=max_chunk)
        logger.info("capturing %d step graphs (batch sizes %s; rows per sequence %s; prefill chunks at batch 1: %s)",
                    len(graphs.buckets), ", ".join(map(str, graphs.batch_sizes)),
                    ", ".join(map(str, graphs.node_sizes)), ", ".join(map(str, graphs.chain_sizes)) or "-")
        graphs.capture()
        self.runner.graphs = graphs
        # drafters that grow their trees on the device (eagle, eagle3: drafters/device_tree.py), for
        # the node budgets the draft policy grants
        budgets = budget_sizes(cfg.num_speculative_tokens)
        for name, drafter in self.drafters.items():
            capture = getattr(drafter, "capture_graphs", None)
            if capture is not None:
                t0 = time.perf_counter()
                n = capture(backend, budgets)
                if n:
                    logger.info("%s: captured %d draft graphs (budgets %s) in %.1f s", name, n,
                                ", ".join(map(str, budgets)), time.perf_counter() - t0)

    def _load_drafters(self, names: tuple[str, ...]) -> dict:
        """The drafters called `names`; "auto" stands for those `drafters.auto` picks for this model
        (kept in `auto_drafters`, in its order), loaded once each beside any named."""
        from specserve.drafters.auto import auto_drafters
        from specserve.drafters.base import DrafterContext, make_drafter   # the registry, no specific drafter

        ctx = DrafterContext(tokenizer=self.tokenizer, target=self.model, model_config=self.model_config,
                             device=self.device, dtype=self.dtype, max_model_len=self.max_model_len,
                             max_num_seqs=self.config.max_num_seqs, features=self.features)
        self.auto_drafters: tuple[str, ...] = ()
        expanded = []
        for name in names:
            if name == AUTO_DRAFTER:
                picked = auto_drafters(self.model_config, self.model)
                for choice in picked:
                    logger.info("drafter auto: %s (%s)", choice.name, choice.reason)
                self.auto_drafters = tuple(c.name for c in picked)
                expanded += self.auto_drafters
            else:
                expanded.append(name)
        unloaded = sorted(set(self.config.drafter_options) - set(expanded))
        if unloaded:
            raise ValueError(f"options given for drafters that are not loaded: {', '.join(unloaded)} "
                             f"(drafter auto loads {', '.join(self.auto_drafters) or 'none'} for this model; "
                             f"load others with --drafter NAME)")
        drafters = {}
        for name in expanded:
            if name != NO_DRAFTER and name not in drafters:
                options = dict(self.config.drafter_options.get(name, {}))
                drafters[name] = make_drafter(name, ctx, **options)
        return drafters

    def _draft_contexts(self, seq: Sequence, names) -> dict[str, int]:
        """The contexts drafters `names` tell for `seq`'s next tree (`Drafter.context_of`), for the
        goodput budget, one view of `seq` for all; a drafter is left out when it tells none, or
        raised (logged once per drafter; the budget then sizes the tree from the drafter's record
        alone, and the request goes on)."""
        out: dict[str, int] = {}
        view = None
        for name in names:
            if name not in self._context_drafters:
                continue
            view = view or DraftRequest.of(seq)
            t0 = time.perf_counter()
            try:
                context = self.drafters[name].context_of(view)
            except Exception:
                logger.exception("drafter %s failed to tell a context; its budgets come from its record alone", name)
                self._context_drafters.discard(name)
                continue
            finally:
                self.drafter_stats[name].draft_time_s += time.perf_counter() - t0
            if context is None:
                continue
            if isinstance(context, bool) or not isinstance(context, int):
                logger.warning("drafter %s told a context %r that is not an integer; ignored from now on", name,
                               context)
                self._context_drafters.discard(name)
                continue
            out[name] = context
        return out

    def _capture_layers(self) -> tuple[int, ...]:
        """The target's intermediate layers the feature store keeps: the union over the served
        drafters that read features (`needs_features`) of their `capture_layers` (a class or
        instance attribute; indices as `LlamaModel.forward` numbers them). A drafter without
        `needs_features` gets no features, so what it declares is ignored (with a warning)."""
        layers: set[int] = set()
        for name, drafter in self.drafters.items():
            wanted = tuple(getattr(drafter, "capture_layers", ()) or ())
            if not wanted:
                continue
            if not drafter.needs_features:
                logger.warning("drafter %s declares capture_layers %s but does not read features "
                               "(needs_features is False); ignored", name, wanted)
                continue
            try:
                self.model.check_capture_layers(tuple(sorted(set(wanted))))
            except ValueError as exc:
                raise ValueError(f"drafter {name!r}: {exc}") from exc
            layers.update(int(k) for k in wanted)
        if layers:
            logger.info("feature store keeps target layers %s beside the last one", sorted(layers))
        return tuple(sorted(layers))

    @property
    def drafter_names(self) -> list[str]:
        return list(self.drafters)

    def resolve_drafter(self, name) -> str | None:
        """A request's drafter: the server default when absent, None for "none", "auto" for a
        choice among `auto_drafters` renewed every step."""
        if name is _DEFAULT or name is None:
            return self.default_drafter
        if name == NO_DRAFTER:
            return None
        if name == AUTO_DRAFTER and self.auto_drafters:
            return AUTO_DRAFTER
        if name not in self.drafters:
            loaded = ", ".join([NO_DRAFTER, *([AUTO_DRAFTER] if self.auto_drafters else []), *self.drafters])
            raise InvalidRequestError(f"drafter {name!r} is not loaded; loaded drafters: {loaded}",
                                      "speculative.drafter")
        return name

    def check_drafter_options(self, drafter, options: dict | None) -> dict:
        """A request's per-request drafter options (its `speculative` block beyond `drafter`),
        validated by the drafter that will serve it; InvalidRequestError (param
        `speculative.<key>`) for an option it does not take per request."""
        if not options:
            return {}
        name = self.resolve_drafter(drafter)
        if name is None:
            key = next(iter(options))
            raise InvalidRequestError(f"plain decoding (drafter 'none') takes no options; got {key!r}",
                                      f"speculative.{key}")
        if name == AUTO_DRAFTER:
            key = next(iter(options))
            raise InvalidRequestError(f"drafter 'auto' takes no options (name one drafter to set its options); "
                                      f"got {key!r}", f"speculative.{key}")
        impl = self.drafters[name]
        for key in options:
            if key not in impl.request_options:
                from specserve.drafters.base import unknown_option_message

                raise InvalidRequestError(unknown_option_message(f"drafter {name!r} (per request)", key,
                                                                 impl.request_options), f"speculative.{key}")
        try:
            return impl.check_request_options(dict(options))
        except ValueError as exc:
            key = next((k for k in options if k in str(exc)), next(iter(options)))
            raise InvalidRequestError(str(exc), f"speculative.{key}") from exc

    def _default_num_blocks(self) -> int:
        """Enough blocks for --max-num-seqs full contexts (more would lie idle: no prefix cache),
        within --kv-cache-memory-gib, or on CUDA with --gpu-memory-utilization within what that
        share of the device's memory leaves after weights, drafters and a step's activations."""
        mc, cfg = self.model_config, self.config
        per_block = KVCache.bytes_per_block(mc.num_layers, cfg.block_size, mc.num_kv_heads, mc.head_dim, self.kv_dtype)
        wanted = cfg.max_num_seqs * -(-self.max_model_len // cfg.block_size)
        cap_bytes = int(cfg.kv_cache_memory_gib * 2**30)
        if cfg.gpu_memory_utilization is not None and self.device.type == "cuda":
            total = torch.cuda.get_device_properties(self.device).total_memory
            step_tokens = cfg.max_num_batched_tokens + cfg.max_draft_tokens_per_step
            reserve = activation_reserve_bytes(step_tokens, mc.hidden_size, mc.intermediate_size, mc.vocab_size)
            used = torch.cuda.memory_allocated(self.device) - self._device_bytes_before
            cap_bytes = kv_pool_bytes(total, cfg.gpu_memory_utilization, used, reserve)
            logger.info("--gpu-memory-utilization %.2f: %.2f GiB of %.2f GiB for the KV pool",
                        cfg.gpu_memory_utilization, cap_bytes / 2**30, total / 2**30)
        elif cfg.gpu_memory_utilization is not None:
            logger.warning("--gpu-memory-utilization applies on CUDA only; on %s the KV pool's cap is "
                           "--kv-cache-memory-gib", self.device.type)
        return max(min(wanted, cap_bytes // per_block), -(-self.max_model_len // cfg.block_size))

    # ---- requests -------------------------------------------------------------------------

    def validate(self, prompt_token_ids: list[int], params: SamplingParams, grammar=None) -> None:
        check_prompt_fits(len(prompt_token_ids), params.max_tokens, self.max_model_len)
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})", "prompt")
        if any(not 0 <= t < vocab for t in params.logit_bias or ()):
            raise InvalidRequestError(f"logit_bias token ids must be in [0, {vocab})", "logit_bias")
        if any(not 0 <= t < vocab for t in params.stop_token_ids):
            raise InvalidRequestError(f"stop_token_ids must be in [0, {vocab})", "stop_token_ids")
        if params.guided is not None and grammar is None:
            self.grammars.compile(params.guided)      # cached, or compiled here (the server hands its compile over)

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams, drafter=_DEFAULT,
                      drafter_options: dict | None = None, grammar=None) -> tuple[str | None, dict]:
        """Validate a request (InvalidRequestError naming the parameter at fault); returns its
        drafter (None: plain decoding) and its checked drafter options. `grammar`: the compiled
        matcher of `params.guided`, when the caller compiled it (`Grammars.submit`)."""
        self.validate(prompt_token_ids, params, grammar)
        options = self.check_drafter_options(drafter, drafter_options)
        return self.resolve_drafter(drafter), options

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    arrival_time: float | None = None, drafter=_DEFAULT, drafter_options: dict | None = None,
                    checked: bool = False, grammar=None) -> None:
        """`drafter`: a loaded drafter's name, "none" for plain decoding, or omitted for the default;
        `drafter_options`: the request's own options for it (those it declares per request).
        `checked`: the caller already ran `check_request` and passes what it returned.
        `grammar`: the compiled matcher of `params.guided` (else it is taken from the grammar cache,
        or compiled on this thread)."""
        if checked:
            options = drafter_options or {}
        else:
            drafter, options = self.check_request(prompt_token_ids, params, drafter, drafter_options, grammar)
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        req = Request(request_id, list(prompt_token_ids), params,
                      RequestMetrics(arrival_time=arrival_time or time.monotonic()), drafter=drafter)
        req.spec.drafter = drafter
        names = self.auto_drafters if drafter == AUTO_DRAFTER else (drafter,) if drafter is not None else ()
        # the parts reported per request, even if one never proposes: auto's drafters, a composite's parts
        parts = names if drafter == AUTO_DRAFTER else getattr(self.drafters[drafter], "part_names", ()) if names else ()
        add_part_tally(req.spec.parts, {str(p): (0, 0) for p in parts})
        for i in range(params.n):
            key = sample_key(params.seed, i) if params.seed is not None else None
            detok = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, params)
            seq = Sequence(req, i, req.prompt_token_ids, detok, key)
            seq.options = options
            if params.guided is not None:
                seq.grammar = self.grammars.state(params.guided, grammar)
            req.seqs.append(seq)
            started = []
            for name in names:
                try:
                    self.drafters[name].start(DraftRequest.of(seq))
                    started.append(name)
                except Exception:   # the drafter never hears of this sequence again (none left: plain decoding)
                    logger.exception("drafter %s failed in start(); it does not draft for %s", name, seq)
                    self.drafter_stats[name].num_fallbacks += 1
            seq.drafters = tuple(started)
            seq.drafter = started[0] if started else None
            self.scheduler.add(seq)
        self.requests[request_id] = req

    def abort_request(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is None:
            return
        for seq in req.seqs:
            self._end(seq, "abort")
        self._changed[request_id] = req

    def _end(self, seq: Sequence, reason: str) -> None:
        """Stop `seq` before its stop rules did ("abort", "error"), dropping a token held back from the client."""
        if seq.is_finished:
            return
        if seq.held_back:   # never promised to the client
            seq.token_ids.pop()
            seq.held_back, seq.alt_roots = False, []
        self._finish(seq, reason)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    # ---- the step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One engine step. A step that raises is retried sequence by sequence (`_isolate`), so an
        error fails only the requests that cause it; only an unrecoverable device error escapes.
        With async scheduling, a step of plain decodes may already have been launched by the last
        call (`_launch_ahead`): this one reads it (`_step_ahead`)."""
        if self._ahead is not None:
            return self._step_ahead()
        batch = self.scheduler.schedule()
        for seq, exc in batch.failed:
            self._fail_request(seq.request, exc, "scheduling")
        if batch:
            first = [seq for seq in batch.seqs if seq.request.metrics.first_scheduled_time is None]
            now = time.monotonic()
            for seq in first:
                seq.request.metrics.first_scheduled_time = now
            granted = {}   # what the draft policy granted: the budgets less the grammar's forced tokens
            for seq in batch.seqs:
                if seq.seq_id in batch.granted:
                    forced = batch.forced.get(seq.seq_id)
                    granted[seq.seq_id] = batch.granted[seq.seq_id] - (forced or 0)
                    if forced is not None:
                        self.drafter_stats[GRAMMAR_PART].observe_budget(forced)
                    if forced is None or (granted[seq.seq_id] and seq.drafter is not None):
                        self.drafter_stats[seq.drafter].observe_budget(granted[seq.seq_id])
            # the policy learns from the budgets it granted, not from the grammar's forced tokens
            report = StepReport(granted=granted)
            try:
                trees = self._propose(batch, report)
                t0 = time.perf_counter()
                self._run_batch(batch, trees, report, may_run_ahead=True)
                if batch.granted:
                    # timed only where the policy decided: its step cost fit is host work that a step
                    # of plain decoding (or of drafter sequences riding along) would pay for nothing
                    report.seconds = time.perf_counter() - t0 - report.ahead_seconds
                report.num_tokens = batch.total_tokens + sum(t.num_draft_tokens for t in trees.values())
                report.num_trees = len(trees)
            except Exception as exc:
                if is_unrecoverable(exc):
                    raise
                self._isolate(batch, exc, report)
            self.scheduler.observe(report)
            self.stats.num_steps_total += 1
        return self._collect()

    def _kv_cache_dtype(self, config: EngineConfig, act: torch.dtype) -> torch.dtype:
        """The KV cache's dtype (`EngineConfig.kv_cache_dtype`); attention runs in it
        (`engine.model.write_and_attend`; an fp16 cache's in fp32). auto: float16 where the layer
        stack runs in the native CPU kernels (half the memory; the same logits as fp32 on the default
        model: docs/architecture.md); else the model's, except float64 for bf16
        activations on a CPU without the native kernels (`kernels/cpu.py`). Where activations are
        rounded to bf16, a last-bit difference between a tree row's attention and the same token's
        decode row can change a token; the native kernel computes both alike in fp32, SDPA needs
        float64 for it."""
        if config.kv_cache_dtype == "auto":
            if self.device.type == "cpu" and self.model.runs_natively():
                return torch.float16
            bf16_cpu = act == torch.bfloat16 and self.device.type == "cpu"
            return torch.float64 if bf16_cpu and not native_cpu.available() else self.dtype
        dtype = getattr(torch, config.kv_cache_dtype)
        if dtype != self.dtype and self.device.type != "cpu":
            raise ValueError(f"--kv-cache-dtype {config.kv_cache_dtype} differs from the model's dtype: on "
                             f"{self.device.type} the attention kernels run in the model's dtype (CPU only)")
        return dtype

    def _quantize(self, config: EngineConfig, gguf_types: dict[str, str]) -> torch.dtype:
        """Weight-only quantized projections (`engine/quant.py`), before the drafters are built: a
        drafter sharing the target's weights computes with the same quantized copies. Sets
        `self.quantization` (auto resolved); returns the activations' dtype."""
        mode = config.quantization
        if mode == "auto":
            mode = auto_quantization(gguf_types, self.device)
            if mode != "none":
                logger.info("--quantization auto: serving the GGUF's quantized tensors as they are stored (gguf)")
        self.quantization = mode
        if mode == "none":
            return self.dtype
        if self.device.type != "cpu":
            if importlib.util.find_spec("triton") is None:
                raise ValueError(f"--quantization {mode} on {self.device.type} needs triton (kernels/quant_gemm.py)")
            act = self.dtype             # the Triton kernels multiply in the model's dtype
        elif native_cpu.available():     # the native kernels take fp32 activations (engine/quant.py)
            act = self.dtype
        else:
            act = torch.bfloat16 if self.dtype == torch.float32 and native_bf16() else self.dtype
        if act == torch.float32 and self.device.type == "cpu" and not native_cpu.available():
            logger.warning("this CPU has no native bf16: the quantized kernels take fp32 activations, which torch "
                           "runs about 2x slower than unquantized fp32 weights (measured on an AVX-512 CPU)")
        int8_act = int8_activations(config.quantized_activations)
        done = quantize_model(self.model, mode, lm_head=config.quantize_lm_head, act_dtype=act, gguf_types=gguf_types,
                              int8_act=int8_act)
        if done["dequantized"]:
            logger.warning("this GGUF's %s tensors have no packed kernel here: they are dequantized and served "
                           "in %s", ", ".join(done["dequantized"]), str(self.dtype).removeprefix("torch."))
        kernels = "triton" if self.device.type != "cpu" else "native" if native_cpu.available() else "torch"
        logger.info("quantized %d weight matrices to %s (%s kernels, %s activations): %.0f MB -> %.0f MB",
                    done["weights"], mode, kernels,
                    "int8 (int4 weights)" if int8_act else str(act).removeprefix("torch."), done["bytes_before"] / 1e6,
                    done["bytes_after"] / 1e6)
        return act

    def memory_bytes(self) -> dict[str, int]:
        """Bytes held by component: the target's weights, their oneDNN-prepacked and quantized copies
        (the drafters' own included), the KV cache, and the drafters' own tensors (parameters,
        buffers and draft KV caches not shared with the target). Each tensor counts once."""
        seen: set[int] = set()

        def nbytes(t) -> int:
            if not isinstance(t, torch.Tensor) or id(t) in seen:
                return 0
            seen.add(id(t))
            return t.numel() * t.element_size()

        def copies(params) -> tuple[int, int]:
            packed = quant = 0
            for p in params:
                pk = getattr(p, "_specserve_packed", None)
                packed += nbytes(pk[0]) if pk is not None else 0
                q = getattr(p, "_specserve_quant", None)
                quant += nbytes(q.data) + nbytes(q.scales) if q is not None else 0
            return packed, quant

        target = list(self.model.parameters()) + list(self.model.buffers())
        out = {"weights": sum(nbytes(t) for t in target)}
        out["prepacked"], out["quantized"] = copies(target)
        out["kv_cache"] = nbytes(self.cache.kv)
        own = []
        for drafter in self.drafters.values():
            for value in vars(drafter).values():
                if isinstance(value, torch.nn.Module):
                    own += list(value.parameters()) + list(value.buffers())
                elif isinstance(value, torch.Tensor):
                    own.append(value)
                kv = getattr(getattr(value, "cache", None), "kv", None)   # a draft KV cache
                if isinstance(kv, torch.Tensor):
                    own.append(kv)
        drafter_copies = copies(own)
        out["drafters"] = sum(nbytes(t) for t in own)
        out["prepacked"] += drafter_copies[0]
        out["quantized"] += drafter_copies[1]
        return out

    def _export_step_cost(self) -> None:
        """The goodput policy's step cost estimates, for the metrics (read when they are: a fit per
        step would be host work on every step)."""
        cost = getattr(self.scheduler.policy, "step_cost", None)
        if cost is not None:
            estimates = cost.estimates()
            self.stats.step_cost_tokens = [n for n, _ in estimates]
            self.stats.step_cost_seconds = [s for _, s in estimates]

    def _run_batch(self, batch: ScheduledBatch, trees: dict[int, TokenTree], report: StepReport,
                   may_run_ahead: bool = False) -> None:
        """Run `batch` (with the draft `trees` of some of its sequences) and commit its results;
        `may_run_ahead`: launch the next step before reading this one where it can (`_launch_ahead`).

        Until `runner.execute` returns, nothing a sequence owns has changed but KV slots past its
        committed length (rewritten by its next forward) and blocks reserved for this step, so a
        batch that raises here can be run again. After that, each sequence's tokens are processed
        on their own (`_process`): an error there fails that request alone."""
        feature_idx = self._feature_idx(batch)
        prompt_tokens = sum(min(n, seq.num_prompt_tokens - seq.num_computed_tokens)
                            for seq, n in zip(batch.seqs, batch.num_tokens)
                            if seq.num_computed_tokens < seq.num_prompt_tokens)
        masks, cut = self._grammar_masks(batch, trees)
        ahead: list[LaunchedStep] = []

        def launch_next(launched: LaunchedStep) -> None:
            t = time.perf_counter()
            nxt = self._launch_ahead(batch, launched)
            if nxt is not None:
                ahead.append(nxt)
            report.ahead_seconds = time.perf_counter() - t   # the next step's launch: not this step's cost

        t0 = time.perf_counter()
        result = self.runner.execute(batch, trees, feature_idx, masks,
                                     on_launch=launch_next if may_run_ahead and self.async_scheduling else None)
        verify_time = time.perf_counter() - t0
        for res in result.results:    # stats and drafters see the tree as drafted, its pruned nodes rejected
            if res.seq.seq_id in cut:
                res.tree, kept = cut[res.seq.seq_id]
                res.verify.accepted_nodes = [kept[i] for i in res.verify.accepted_nodes]
        self.scheduler.postprocess(batch, result)   # lengths and block tables
        self.stats.num_prompt_tokens_total += prompt_tokens
        if result.features:
            self._deliver_features(batch, result.features, result.layer_features)
        self._process(result, verify_time / max(1, len(trees)), report)
        if ahead and not all(seq.is_finished for seq in batch.seqs):
            self._ahead = (batch, ahead[0])

    def _feature_idx(self, batch: ScheduledBatch) -> set[int]:
        """The batch indices whose drafters read the target's features (`needs_features`)."""
        return {b for b, seq in enumerate(batch.seqs)
                if any(self.drafters[name].needs_features for name in seq.drafters)}

    # ---- async scheduling -----------------------------------------------------------------

    def _launch_ahead(self, batch: ScheduledBatch, launched: LaunchedStep) -> LaunchedStep | None:
        """Launch the step after `launched` (in flight, not read): the same batch of plain decodes,
        one token further, decoding from `launched`'s sampled tokens on the device. So the host
        reads and commits `launched`'s tokens while the device runs this one; the rows of sequences
        that `launched`'s token finished are dropped unread (`_step_ahead`).

        Only where nothing about the next step depends on `launched`'s tokens on the host: no
        request waiting (it is admitted first), no grammar, no logits processing (its counts include
        the last token), no sequence whose token in flight is its last (max_tokens, context), and
        room in the pool for every sequence's next KV slot without preempting. Sequences with a
        drafter ride along only while the scheduler lets them decode without asking the draft policy
        (`Scheduler.ride_along`: after decisions in a row that granted them nothing), each step
        ahead one of those steps; then a step is scheduled and the policy decides again. So a crowd
        that the policy keeps from drafting decodes nearly as plain sequences do (the drafters that
        read features get those of the steps ahead, `_step_ahead`). Returns None where it does not
        launch."""
        if launched.sampled is None or self.scheduler.waiting or batch.preempted:
            return None
        drafted = any(seq.drafters for seq in batch.seqs)
        need = 0
        for seq, n, budget in zip(batch.seqs, batch.num_tokens, batch.draft_budgets):
            last = ((seq.params.max_tokens is not None and seq.num_output_tokens + 1 >= seq.params.max_tokens)
                    or len(seq.token_ids) + 1 >= self.max_model_len)
            if (seq.is_finished or n != 1 or budget or seq.num_computed_tokens + 1 != len(seq.token_ids) or last
                    or seq.grammar is not None
                    or needs_processing(seq.params, self.eos_token_ids)):
                return None
            need += self.blocks.blocks_needed(seq.seq_id, len(seq.token_ids) + 1)
        if need > self.blocks.num_free_blocks or (drafted and not self.scheduler.ride_along()):
            return None
        for seq in batch.seqs:
            self.blocks.grow(seq.seq_id, len(seq.token_ids) + 1)
        feature_idx = self._feature_idx(batch)
        try:
            return self.runner.launch(batch, {}, feature_idx, ahead=launched.sampled)
        except Exception as exc:
            if is_unrecoverable(exc):
                raise
            logger.warning("launching a step ahead failed (%s: %s); the next step is scheduled as usual",
                           type(exc).__name__, exc)
            return None

    def _step_ahead(self) -> list[RequestOutput]:
        """Read the step `_launch_ahead` launched (after launching the one after it, where it can)
        and commit its tokens; the rows of sequences that ended since it was launched are dropped.
        A read that fails changes nothing: the next step schedules those sequences again."""
        batch, launched = self._ahead
        self._ahead = None
        report = StepReport(granted={})
        nxt = self._launch_ahead(batch, launched)
        t0 = time.perf_counter()
        try:
            result = launched.collect()
        except Exception as exc:
            if is_unrecoverable(exc):
                raise
            self.stats.num_step_failures_total += 1
            logger.error("a step launched ahead failed (%s: %s); its sequences are scheduled again",
                         type(exc).__name__, exc, exc_info=exc)
            return self._collect()
        verify_time = time.perf_counter() - t0
        features, layer_features = result.features, result.layer_features
        if any(seq.is_finished for seq in batch.seqs):   # ended by the last step's token, or aborted
            keep = [b for b, seq in enumerate(batch.seqs) if not seq.is_finished]
            batch = ScheduledBatch([batch.seqs[b] for b in keep], [batch.num_tokens[b] for b in keep],
                                   [batch.draft_budgets[b] for b in keep])
            result.num_computed = [result.num_computed[b] for b in keep]
            result.results = [r for r in result.results if not r.seq.is_finished]
            features = {k: features[b] for k, b in enumerate(keep) if b in features}
            layer_features = {k: layer_features[b] for k, b in enumerate(keep) if b in layer_features}
        self.scheduler.postprocess(batch, result)
        if features:
            self._deliver_features(batch, features, layer_features)
        self._process(result, verify_time, report)
        if nxt is not None and not all(seq.is_finished for seq in batch.seqs):
            self._ahead = (batch, nxt)
        self.scheduler.observe(report)
        self.stats.num_steps_total += 1
        self.stats.num_async_steps_total += 1
        return self._collect()

    def _grammar_masks(self, batch: ScheduledBatch, trees: dict[int, TokenTree]) -> tuple[dict, dict]:
        """The grammar masks of the constrained sequences (`engine.grammar.GrammarState.prune`): a
        tree's drafts that the grammar forbids are cut from `trees` where that changes no output.
        Returns (masks by batch index, {seq_id: (the tree as drafted, its kept nodes)} for cut trees)."""
        masks, cut = {}, {}
        for b, seq in enumerate(batch.seqs):
            if seq.grammar is None:
                continue
            if b not in trees:
                masks[b] = seq.grammar.mask()
                continue
            tree = trees[b]
            exact = tree.draft_probs is None or seq.params.greedy or seq.params.seed is not None
            trees[b], masks[b], kept = seq.grammar.prune(tree, exact)
            if kept is not None:
                cut[seq.seq_id] = (tree, kept)
                self.drafter_stats[GRAMMAR_PART if is_forced_tree(tree) else seq.drafter].num_pruned_tokens += \
                    tree.num_nodes - len(kept)
        return masks, cut

    def _isolate(self, batch: ScheduledBatch, exc: Exception, report: StepReport) -> None:
        """The batch raised `exc`: run each of its sequences alone, without a draft, and fail the
        requests whose sequence still raises. A fault that needs the whole batch (or a bad draft
        tree) costs one slower step; a request that breaks the forward is failed, the rest go on."""
        self.stats.num_step_failures_total += 1
        logger.error("a step of %d sequences failed (%s: %s); running them one by one to isolate the cause",
                     len(batch.seqs), type(exc).__name__, exc, exc_info=exc)
        failed: set[str] = set()
        for seq, n, budget in zip(batch.seqs, batch.num_tokens, batch.draft_budgets):
            if seq.is_finished or seq.request.request_id in failed:
                continue
            try:
                self._run_batch(ScheduledBatch([seq], [n], [budget]), {}, report)
            except Exception as alone:
                if is_unrecoverable(alone):
                    raise
                failed.add(seq.request.request_id)
                self._fail_request(seq.request, alone, "the forward")

    def _draft_law(self, seq: Sequence) -> DraftLaw | None:
        """The request's processing for its drafter (`DraftRequest.law`), None when it asks for none."""
        if seq.grammar is None and not needs_processing(seq.params, self.eos_token_ids):
            return None
        return DraftLaw(self.eos_token_ids, seq.grammar)

    def _fail_request(self, req: Request, exc: BaseException, where: str) -> None:
        """End every sequence of `req` with finish_reason "error"; its stream gets the error."""
        if req.error is not None or req.request_id not in self.requests:
            return
        if isinstance(exc, ConstraintError):   # the client's constraint, not the engine: no traceback
            logger.warning("request %s ended with an error: %s", req.request_id, exc)
            req.error, req.error_code = str(exc), "constraint_failed"
        else:
            logger.error("request %s failed in %s: %s: %s", req.request_id, where, type(exc).__name__, exc,
                         exc_info=exc)
            req.error = f"the engine failed while processing this request ({where}: {type(exc).__name__}: {exc})"
        for seq in req.seqs:
            self._end(seq, "error")
        self._changed[req.request_id] = req
        self.stats.num_failed_requests_total += 1

    def _propose(self, batch, report: StepReport) -> dict[int, TokenTree]:
        """Ask each drafter for the trees of its sequences; the sequences in `batch.forced` draft the
        tokens their grammar forces first, and their drafter (one that can: `drafts_after_uncommitted`)
        the rest of their budget after them, from the prefix the forced tokens extend; its tree is
        hung from the forced chain (`TokenTree.then`). A drafter that raises, or a tree that is
        malformed, means no tree of it for those sequences this step (counted as fallbacks)."""
        groups: dict[str, list[int]] = {}
        trees: dict[int, TokenTree] = {}
        after: dict[int, list[int]] = {}   # batch index -> the forced tokens its drafter's tree follows
        for b, (seq, budget) in enumerate(zip(batch.seqs, batch.draft_budgets)):
            k = batch.forced.get(seq.seq_id)
            if budget > 0 and k is not None:   # the grammar's own draft, then maybe the drafter's
                forced = seq.grammar.forced()[:k]
                if forced:
                    trees[b] = forced_tree(seq.token_ids[-1], forced)
                if budget > k and seq.drafter in self.scheduler.drafts_after:
                    after[b] = forced
                    groups.setdefault(seq.drafter, []).append(b)
            elif budget > 0 and seq.drafter is not None:
                groups.setdefault(seq.drafter, []).append(b)
        for name, idx in groups.items():
            stats = self.drafter_stats[name]
            seqs = [batch.seqs[b] for b in idx]
            budgets = [batch.draft_budgets[b] - len(after.get(b, ())) for b in idx]
            t0 = time.perf_counter()
            try:
                views = [DraftRequest.of(seq, after.get(b, ()), self._draft_law(seq)) for b, seq in zip(idx, seqs)]
                proposed = self.drafters[name].propose(views, budgets)
                if len(proposed) != len(idx):
                    raise ValueError(f"{len(proposed)} trees for {len(idx)} sequences")
            except Exception:
                logger.exception("drafter %s failed; plain decoding for %d sequences this step", name, len(idx))
                stats.num_fallbacks += len(idx)
                continue
            finally:
                draft_time = time.perf_counter() - t0
                stats.draft_time_s += draft_time
            nodes = []
            for b, seq, tree, budget, view in zip(idx, seqs, proposed, budgets, views):
                nodes.append(0)
                if tree is None:
                    continue
                problem = self._tree_problem(tree, seq, budget, view.token_ids[-1] if b in after else None)
                if problem:
                    logger.warning("drafter %s returned a malformed tree (%s); plain decoding this step", name, problem)
                    stats.num_fallbacks += 1
                    continue
                if tree.num_draft_tokens > 0:
                    nodes[-1] = tree.num_draft_tokens
                    trees[b] = trees[b].then(tree, name) if b in after and b in trees else tree
            report.drafts.append(DraftCall(name, [seq.seq_id for seq in seqs], budgets, nodes, draft_time))
        return trees

    def _deliver_features(self, batch, features: dict[int, tuple[int, torch.Tensor]],
                          layer_features: dict[int, torch.Tensor] | None = None) -> None:
        """Hand the target's hidden states of this step's new KV entries to the drafters that read
        them (before `accept`, so a drafter sees the features of the path it is told about); the
        store gets the captured intermediate layers of the same positions with them."""
        groups: dict[str, list[int]] = {}
        layer_features = layer_features or {}
        refused = self.features.write_many((batch.seqs[b].seq_id, start, hidden, layer_features.get(b))
                                           for b, (start, hidden) in features.items())
        for seq_id in refused:   # features never came for the positions in between (cannot happen in order)
            logger.error("feature store out of step for sequence %d", seq_id)
            self.features.free(seq_id)
        for b in features:
            seq = batch.seqs[b]
            for name in seq.drafters:
                if self.drafters[name].needs_features:
                    groups.setdefault(name, []).append(b)
        for name, idx in groups.items():
            try:
                self.drafters[name].observe([DraftRequest.of(batch.seqs[b]) for b in idx],
                                            [features[b] for b in idx])
            except Exception:
                logger.exception("drafter %s failed in observe()", name)
                self.drafter_stats[name].num_fallbacks += 1

    def _tree_problem(self, tree, seq: Sequence, budget: int, after: int | None = None) -> str | None:
        """What is wrong with `tree` as `seq`'s draft, or None; `after`: the last forced token, when
        the tree goes after a grammar's forced tokens (a one-root tree rooted there)."""
        if not isinstance(tree, TokenTree):
            return f"not a TokenTree: {type(tree).__name__}"
        if after is not None and (tree.tokens[0] != after or tree.num_roots > 1 or tree.next_roots > 1):
            return "a tree after forced tokens must be one tree rooted at the last of them"
        if after is None and tree.tokens[0] != seq.token_ids[-1]:
            return "root is not the last committed token"
        if tree.num_nodes - 1 > budget:
            return f"{tree.num_nodes - 1} nodes after the root, over the budget of {budget}"
        if tree.num_roots > 1:
            extra = tree.tokens[1:tree.num_roots]
            if not seq.held_back or extra != seq.alt_roots[:len(extra)]:
                return "extra roots are not the target's own samples for this position"
            if seq.params.logprobs is not None:
                return "target-initialised roots cannot report logprobs"
        if tree.next_roots > 1 and (seq.params.greedy or seq.params.seed is not None or seq.params.logprobs is not None
                                    or seq.grammar is not None or needs_processing(seq.params, self.eos_token_ids)):
            return "target-initialised roots are for unseeded sampling requests without logprobs or constraints"
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in tree.tokens):
            return "token id out of the vocabulary"
        if tree.draft_probs is not None and tuple(tree.draft_probs.shape) != (tree.num_nodes, vocab):
            return f"draft_probs shape {tuple(tree.draft_probs.shape)}"
        return sources_problem(tree.num_nodes, tree.sources, tree.source_names)   # changed since construction

    def _process(self, result: StepResult, verify_time: float, report: StepReport) -> None:
        """Commit each sequence's tokens of this step (stop rules, stats), and tell the drafters
        what their trees became (`accept`, from the step report's outcomes). An error while doing
        so for one sequence fails its request and nothing else."""
        now = time.monotonic()
        outcomes: list[TreeOutcome] = []
        for res in result.results:
            if res.seq.request.error is not None:
                continue
            try:
                self._process_one(res, verify_time, now)
            except Exception as exc:
                self._fail_request(res.seq.request, exc, "processing its tokens")
                continue
            if res.tree is not None and not is_forced_tree(res.tree):   # the policy and drafters learn from theirs
                # after a forced chain: the drafter's tree, tested from its root only if the chain was accepted
                num_acc = len(res.verify.accepted_nodes)
                k, drafted, accepted = split_forced(res.tree, num_acc)
                if num_acc >= k:
                    outcomes.append(TreeOutcome(res.seq, drafted, max(tree_depths(res.tree.parents)) - k, accepted,
                                                res.verify if k == 0 else None))
        report.outcomes += outcomes
        by_drafter: dict[str, list[TreeOutcome]] = {}
        for out in outcomes:   # a tree drafted after forced tokens left no state in its drafter to tell
            if not out.seq.is_finished and out.verify is not None:
                by_drafter.setdefault(out.seq.drafter, []).append(out)
        for name, live in by_drafter.items():
            try:
                self.drafters[name].accept([DraftRequest.of(out.seq) for out in live], [out.verify for out in live])
            except Exception:
                logger.exception("drafter %s failed in accept()", name)
                self.drafter_stats[name].num_fallbacks += 1

    def _process_one(self, res, verify_time: float, now: float) -> None:
        seq = res.seq
        spec = seq.request.spec
        if res.tree is not None:
            num_acc = len(res.verify.accepted_nodes)
            spec.observe(res.tree.num_draft_tokens, num_acc)
            forced = is_forced_tree(res.tree)
            if forced:   # the grammar's chain alone: the grammar's tree
                k, drafted, accepted = 0, res.tree.num_draft_tokens, num_acc
            else:        # a drafter's tree, maybe after a grammar's forced chain: each part counted as its own
                k, drafted, accepted = split_forced(res.tree, num_acc)
            grammar = {GRAMMAR_PART: (k, min(k, num_acc))} if k else {}
            if k:
                self.drafter_stats[GRAMMAR_PART].observe(*grammar[GRAMMAR_PART])
                self.drafter_stats[GRAMMAR_PART].verify_time_s += verify_time
            stats = self.drafter_stats[GRAMMAR_PART if forced else seq.drafter]
            stats.observe(drafted, accepted)
            tally = res.tree.part_tally(res.verify.accepted_nodes)   # {} without provenance
            parts = {p: t for p, t in tally.items() if p != GRAMMAR_PART}   # the drafter's own parts
            composite = bool(parts) and list(parts) != [seq.drafter]
            if composite and not forced:
                stats.observe_parts(parts)
            # the request's parts: the tree's own; by drafter for auto, and beside the grammar's
            if forced:
                mine = tally
            else:
                mine = {**grammar, **(parts if composite and spec.drafter != AUTO_DRAFTER
                                      else {seq.drafter: (drafted, accepted)})}
            if tally or spec.drafter == AUTO_DRAFTER or seq.grammar is not None:
                add_part_tally(spec.parts, mine)
            stats.verify_time_s += verify_time
        spec.num_target_forwards += 1
        before = seq.num_output_tokens - seq.held_back
        if seq.held_back:   # this step settles the held-back token: the chosen root, or as sampled
            if res.verify is not None and res.verify.root > 0:
                seq.token_ids[-1] = res.tree.tokens[res.verify.root]
            seq.held_back, seq.alt_roots = False, []
            self._check_token(seq, seq.token_ids[-1], None)
        tokens = res.tokens if not seq.is_finished else []
        for k, token in enumerate(tokens):
            if k == len(tokens) - 1 and res.verify is not None and res.verify.alternates and self._may_hold(seq):
                seq.token_ids.append(token)   # decided by the next verification, streamed then
                seq.held_back, seq.alt_roots = True, list(res.verify.alternates)
                break
            self._append_token(seq, token, res.logprobs[k] if res.logprobs else None)
            if seq.is_finished:
                break
        emitted = seq.num_output_tokens - seq.held_back - before
        spec.num_generated_tokens += emitted
        self.stats.num_generation_tokens_total += emitted
        metrics = seq.request.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        metrics.last_token_time = now

    def _may_hold(self, seq: Sequence) -> bool:
        """A token may be held back only when more tokens can follow it (not the last allowed)."""
        room = self.max_model_len - len(seq.token_ids) - 1
        if seq.params.max_tokens is not None:
            room = min(room, seq.params.max_tokens - seq.num_output_tokens - 1)
        return room > 0

    def _append_token(self, seq: Sequence, token: int, logprob: TokenLogprob | None) -> None:
        seq.token_ids.append(token)
        if seq.grammar is not None:
            seq.grammar.advance([token])
        self._check_token(seq, token, logprob)

    def _check_token(self, seq: Sequence, token: int, logprob: TokenLogprob | None) -> None:
        """Emit the generated token that is now last in `seq.token_ids` and apply the stop rules
        in order: EOS, stop token ids, stop strings (via the detokenizer), max_tokens, context length."""
        params = seq.params
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
        self.features.free(seq.seq_id)
        for name in seq.drafters:
            try:
                self.drafters[name].finish(DraftRequest.of(seq))
            except Exception:
                logger.exception("drafter %s failed in finish()", name)

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
                                         req.num_generated_tokens, req.metrics, req.prompt_token_ids,
                                         req.spec if req.drafter is not None else None, req.error,
                                         req.error_code))
        self._changed.clear()
        return outputs

    def get_stats(self) -> EngineStats:
        self._export_step_cost()
        s = self.stats
        s.num_running = sum(1 for _ in self.scheduler.running)
        s.num_waiting = len(self.scheduler.waiting)
        s.kv_usage = self.blocks.usage
        s.num_free_blocks = self.blocks.num_free_blocks
        s.num_preemptions_total = self.scheduler.num_preemptions
        snapshot = EngineStats(**vars(s))
        snapshot.drafters = {name: st.copy() for name, st in self.drafter_stats.items()}
        return snapshot
