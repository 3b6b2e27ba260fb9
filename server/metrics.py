"""Prometheus metrics of one server (one registry per app, so several apps can share a process).

Request-level values are observed at the edge, from each request's `RequestOutput` (its ``metrics``
timestamps, ``time.monotonic()`` stamped by the engine, and its ``spec`` block, which names the drafter);
engine-level values (queue depth, KV usage, token counters, per-drafter speculation counters) are read
from ``engine.get_stats()`` at scrape time, so they are current even while long requests are still running.

Every series has HELP text; counters end in ``_total``, durations are in seconds (``_seconds``), ratios in
0..1 (``_ratio``). Labels are bounded: ``status`` takes the five values below, ``drafter`` the loaded
drafters' names plus ``none`` (plain decoding) and ``grammar`` (structured output's forced tokens),
``position`` 1 .. 16 (MAX_POSITION; a tree is never deeper than ``--num-speculative-tokens``), ``le`` a
fixed bucket list.

Serving series (all prefixed ``specserve_``):

=========================================  =========  =================================================
name                                       type       meaning
=========================================  =========  =================================================
requests_total{status}                     counter    finished requests; status is one of
                                                      stop | length | abort | rejected | error
prompt_tokens_total                        counter    prompt tokens prefilled (recomputation after a
                                                      preemption counts again)
generation_tokens_total                    counter    tokens generated, every choice included
request_generation_tokens_total{drafter}   counter    the same tokens, by the drafter of their request
                                                      (observed at the edge as outputs arrive)
num_preemptions_total                      counter    sequences preempted for lack of KV blocks
time_to_first_token_seconds{drafter}       histogram  arrival -> first generated token
inter_token_latency_seconds{drafter}       histogram  gap between a request's token deliveries divided
                                                      by the tokens delivered (one sample per token)
e2e_request_latency_seconds{drafter}       histogram  arrival -> finished
request_queue_time_seconds{drafter}        histogram  arrival -> first scheduled
num_requests_running                       gauge      sequences in the running batch
num_requests_waiting                       gauge      sequences waiting for admission
kv_cache_usage_ratio                       gauge      fraction of KV blocks in use (0..1)
model_info{model,max_model_len}            gauge      1, labels describe the served model
memory_bytes{component}                    gauge      bytes held since start-up: weights, prepacked,
                                                      quantized, kv_cache, drafters
=========================================  =========  =================================================

``status``: ``stop``/``length`` are the finish reason of a completed request (``length`` when any
choice hit the limit), ``abort`` a request whose client went away, ``rejected`` a 4xx answered
before generation (bad field, unknown model, prompt too long, queue full), ``error`` a 5xx.
``drafter`` of the request-level series: the drafter that decoded the request (``none`` for plain
decoding), so latency can be compared between drafters.

Speculative decoding, per drafter (from ``EngineStats.drafters``; prefix ``specserve_spec_decode_``):

=========================================  =========  =================================================
verification_steps_total{drafter}          counter    sequence steps verified with a draft
draft_tokens_total{drafter}                counter    draft tokens proposed (tree nodes, root excluded)
accepted_tokens_total{drafter}             counter    draft tokens accepted (bonus excluded)
emitted_tokens_total{drafter}              counter    tokens committed by those steps (accepted + bonus)
accepted_tokens_per_position_total         counter    accepted draft tokens at tree depth ``position``
  {drafter,position}                                  (1 = the first draft token), i.e. steps that
                                                      accepted at least ``position`` tokens
accepted_length{drafter}                   histogram  accepted draft tokens per step (le = 0, 1, .., 16)
drafter_fallbacks_total{drafter}           counter    sequence steps where the drafter failed (raised,
                                                      malformed tree) -> plain decoding; not steps
pruned_tokens_total{drafter}               counter    draft tokens the request's grammar forbade, cut
                                                      before verification (counted in draft_tokens)
draft_time_seconds_total{drafter}          counter    time spent proposing
verify_time_seconds_total{drafter}         counter    time spent verifying
draft_budget_tokens{drafter}               histogram  draft-tree nodes the scheduler allowed a decoding
                                                      sequence per step (0 = no draft); le = the budget
                                                      sizes (0, 1, 2, 4, 8, .. up to
                                                      ``--num-speculative-tokens``, which is one)
draft_part_tokens_total{drafter,part}      counter    draft tokens proposed by one part of a composite
                                                      drafter (e.g. a sub-drafter of a cascade), from
                                                      its trees' provenance
accepted_part_tokens_total{drafter,part}   counter    draft tokens accepted whose node that part
                                                      proposed; both only for drafters with parts, and
                                                      summing over ``part`` to the steps' totals
=========================================  =========  =================================================

``part`` takes the names a composite drafter gives its parts (a fixed set per drafter, e.g. the names of
its sub-drafters); a drafter without parts exports no ``part`` series.

The goodput draft budget's step cost model (``--draft-budget goodput``; absent under the others):

=========================================  =========  =================================================
specserve_step_cost_estimate_seconds       gauge      estimated seconds of one engine step (target
  {tokens}                                            forward + verification + commit) of ``tokens``
                                                      tokens, at the model's knots 1, 2, 4, ..
=========================================  =========  =================================================

The Grafana dashboard (``deploy/grafana/specserve.json``) shows, per panel, the PromQL below, where
``{D}`` stands for ``{drafter=~"$drafter"}`` (its drafter variable: multi-select, "All" = ``.*``) and
``[R]`` for ``[$__rate_interval]``; ``$__range`` is Grafana's too. ``deploy/prometheus/rules.yml``
records the per-drafter ones over 1m windows (``drafter:<metric>:<operation>``); docs/observability.md
has the whole stack.

    # Acceptance rate alpha = accepted / drafted  (the stat panel: increase(...[$__range]) instead of rate)
    sum by (drafter) (rate(specserve_spec_decode_accepted_tokens_total{D}[R]))
      / sum by (drafter) (rate(specserve_spec_decode_draft_tokens_total{D}[R]))
    # Mean accepted length tau = tokens committed per verification step, bonus included (1 + accepted/steps)
    sum by (drafter) (rate(specserve_spec_decode_emitted_tokens_total{D}[R]))
      / sum by (drafter) (rate(specserve_spec_decode_verification_steps_total{D}[R]))
    # Acceptance by depth: share of steps that accepted at least `position` draft tokens (bar gauge)
    sum by (drafter, position) (increase(specserve_spec_decode_accepted_tokens_per_position_total{D}[$__range]))
      / on (drafter) group_left
    sum by (drafter) (increase(specserve_spec_decode_verification_steps_total{D}[$__range]))
    # Draft vs accepted tokens/s
    sum by (drafter) (rate(specserve_spec_decode_draft_tokens_total{D}[R]))
    sum by (drafter) (rate(specserve_spec_decode_accepted_tokens_total{D}[R]))
    # Generation tokens/s, per drafter and for the whole server
    sum by (drafter) (rate(specserve_request_generation_tokens_total{D}[R]))
    sum(rate(specserve_generation_tokens_total[R]))
    # Draft and verify time per verification step
    sum by (drafter) (rate(specserve_spec_decode_draft_time_seconds_total{D}[R]))
      / sum by (drafter) (rate(specserve_spec_decode_verification_steps_total{D}[R]))
    sum by (drafter) (rate(specserve_spec_decode_verify_time_seconds_total{D}[R]))
      / sum by (drafter) (rate(specserve_spec_decode_verification_steps_total{D}[R]))
    # Time to first token p50 / p95 / p99 (0.5, 0.95, 0.99), and the same for ITL and e2e latency
    histogram_quantile(0.99, sum by (drafter, le) (rate(specserve_time_to_first_token_seconds_bucket{D}[R])))
    histogram_quantile(0.99, sum by (drafter, le) (rate(specserve_inter_token_latency_seconds_bucket{D}[R])))
    histogram_quantile(0.99, sum by (drafter, le) (rate(specserve_e2e_request_latency_seconds_bucket{D}[R])))
    # Running / waiting requests, KV-cache usage, preemptions
    sum by (instance) (specserve_num_requests_running)
    sum by (instance) (specserve_num_requests_waiting)
    max by (instance) (specserve_kv_cache_usage_ratio)
    sum by (instance) (rate(specserve_num_preemptions_total[R]))
    # Drafter fallbacks: failed drafter calls per sequence step that wanted a draft, and per second
    sum by (drafter) (rate(specserve_spec_decode_drafter_fallbacks_total{D}[R]))
      / (sum by (drafter) (rate(specserve_spec_decode_drafter_fallbacks_total{D}[R]))
         + sum by (drafter) (rate(specserve_spec_decode_verification_steps_total{D}[R])))
    sum by (drafter) (rate(specserve_spec_decode_drafter_fallbacks_total{D}[R]))
    # Requests by outcome (req/s) and error ratio
    sum by (status) (rate(specserve_requests_total[R]))
    sum(rate(specserve_requests_total{status=~"error|rejected"}[R])) / sum(rate(specserve_requests_total[R]))
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from specserve.engine.config import AUTO_DRAFTER
from specserve.engine.draft_policy import budget_sizes
from specserve.engine.outputs import RequestOutput

if TYPE_CHECKING:
    from specserve.engine.async_engine import AsyncEngine

# no `*_created` gauges beside every counter and histogram (as vLLM does): they double the series for nothing a
# dashboard uses (process-wide: prometheus_client has no per-registry switch)
disable_created_metrics()

REQUEST_STATUSES = ("stop", "length", "abort", "rejected", "error")
NO_DRAFTER = "none"              # the `drafter` label of plain decoding
MAX_POSITION = 16                # `position` label values: 1 .. MAX_POSITION (deeper acceptances are not split out)
ACCEPTED_LENGTH_BUCKETS = MAX_POSITION + 1     # le = 0, 1, ..., 16 accepted draft tokens per step, then +Inf

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
               0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0)


def _core_engine(engine):
    """The LLMEngine behind an AsyncEngine (None for engines without one, e.g. test doubles)."""
    return getattr(engine, "engine", None)


def _max_position(engine) -> int:
    """How many `position` series each drafter exports from the start: the tree-depth bound
    (``--num-speculative-tokens``, a tree never gets deeper than its node budget), capped at MAX_POSITION."""
    config = getattr(_core_engine(engine), "config", None)
    depth = getattr(config, "num_speculative_tokens", None)
    return max(1, min(MAX_POSITION, int(depth))) if isinstance(depth, int) else 1


def _budget_buckets(engine) -> list[int]:
    """`le` values of the draft budget histogram: the budget sizes up to ``--num-speculative-tokens``."""
    config = getattr(_core_engine(engine), "config", None)
    cap = getattr(config, "num_speculative_tokens", None)
    return budget_sizes(int(cap)) if isinstance(cap, int) else list(budget_sizes(8))


class _EngineStatsCollector(Collector):
    """Reads `engine.get_stats()` at scrape time."""

    def __init__(self, engine: "AsyncEngine"):
        self._engine = engine
        self._max_position = _max_position(engine)
        self._budget_buckets = _budget_buckets(engine)

    def _families(self, stats) -> list[Metric]:
        def value(name: str) -> float:
            return float(getattr(stats, name)) if stats is not None else 0.0

        return [
            GaugeMetricFamily("specserve_num_requests_running", "Sequences in the running batch.",
                              value=value("num_running")),
            GaugeMetricFamily("specserve_num_requests_waiting", "Sequences waiting to be admitted to the batch.",
                              value=value("num_waiting")),
            GaugeMetricFamily("specserve_kv_cache_usage_ratio", "Fraction of KV-cache blocks in use (0..1).",
                              value=value("kv_usage")),
            CounterMetricFamily("specserve_prompt_tokens", "Prompt tokens prefilled (recomputation included).",
                                value=value("num_prompt_tokens_total")),
            CounterMetricFamily("specserve_generation_tokens", "Tokens generated, all choices included.",
                                value=value("num_generation_tokens_total")),
            CounterMetricFamily("specserve_num_preemptions", "Sequences preempted for lack of KV-cache blocks.",
                                value=value("num_preemptions_total")),
            CounterMetricFamily("specserve_engine_step_failures", "Engine steps that raised and were retried "
                                "sequence by sequence to isolate the requests causing it.",
                                value=value("num_step_failures_total")),
            CounterMetricFamily("specserve_engine_async_steps", "Engine steps launched before the previous "
                                "step's tokens were read (async scheduling of plain decodes).",
                                value=value("num_async_steps_total")),
            CounterMetricFamily("specserve_engine_failed_requests", "Requests the engine failed because a step, "
                                "scheduling or token processing raised for them (the server stayed up).",
                                value=value("num_failed_requests_total")),
        ]

    def describe(self) -> Iterable[Metric]:
        return (self._families(None) + _drafter_families({}) + _part_families(None) + _cost_families(None)
                + _memory_families(None))

    def collect(self) -> Iterable[Metric]:
        stats = self._engine.get_stats()
        drafters = getattr(stats, "drafters", None) or {}
        return (self._families(stats)
                + _drafter_families(drafters, self._max_position, self._budget_buckets)
                + _part_families(drafters)
                + _cost_families(stats)
                + _memory_families(stats))


def _memory_families(stats) -> list[Metric]:
    memory = GaugeMetricFamily("specserve_memory_bytes", "Bytes the engine holds since start-up, by component: "
                               "weights (the target's), prepacked and quantized (their CPU copies, the drafters' "
                               "included), kv_cache, drafters (their own weights and draft KV caches).",
                               labels=["component"])
    for component, value in sorted((getattr(stats, "memory_bytes", None) or {}).items()):
        memory.add_metric([component], float(value))
    return [memory]


def _cost_families(stats) -> list[Metric]:
    """The goodput budget's step cost estimates (`EngineStats.step_cost_tokens/seconds`); no family without them."""
    tokens = list(getattr(stats, "step_cost_tokens", None) or [])
    seconds = list(getattr(stats, "step_cost_seconds", None) or [])
    if stats is not None and not tokens:
        return []
    gauge = GaugeMetricFamily("specserve_step_cost_estimate_seconds", "The goodput draft budget's current estimate "
                              "of one engine step's seconds (target forward, verification, commit) for `tokens` "
                              "tokens in the step.", labels=["tokens"])
    for n, s in zip(tokens, seconds):
        gauge.add_metric([str(n)], s)
    return [gauge]


def _drafter_families(drafters: dict, max_position: int = 1, budget_buckets: list[int] | None = None) -> list[Metric]:
    """Per-drafter speculation counters from `EngineStats.drafters` ({name: DrafterStats}).

    Label sets stay bounded: `drafter` takes the loaded drafters' names; `position` runs 1 .. MAX_POSITION
    (series 1 .. `max_position` exist from the start, at 0, so `rate()` sees their first increase);
    the `accepted_length` buckets are fixed (le = 0 .. MAX_POSITION, +Inf), the `draft_budget_tokens`
    ones are the budget sizes (`budget_buckets`, +Inf)."""
    budget_buckets = list(budget_buckets) if budget_buckets is not None else budget_sizes(8)
    p = "specserve_spec_decode_"
    steps = CounterMetricFamily(p + "verification_steps", "Verification steps that carried a draft.",
                                labels=["drafter"])
    draft = CounterMetricFamily(p + "draft_tokens", "Draft tokens proposed (tree nodes, root excluded).",
                                labels=["drafter"])
    accepted = CounterMetricFamily(p + "accepted_tokens", "Draft tokens accepted by verification (bonus excluded).",
                                   labels=["drafter"])
    emitted = CounterMetricFamily(p + "emitted_tokens", "Tokens committed by steps with a draft (accepted + bonus).",
                                  labels=["drafter"])
    by_position = CounterMetricFamily(p + "accepted_tokens_per_position",
                                      "Draft tokens accepted at each tree depth (position 1 = first draft token; "
                                      f"positions 1..{MAX_POSITION}), i.e. steps that accepted at least `position`.",
                                      labels=["drafter", "position"])
    length = HistogramMetricFamily(p + "accepted_length", "Draft tokens accepted per verification step "
                                   "(bonus token excluded).", labels=["drafter"])
    fallbacks = CounterMetricFamily(p + "drafter_fallbacks", "Sequence steps where the drafter failed (raised or "
                                    "returned a malformed tree) and plain decoding was used instead.",
                                    labels=["drafter"])
    pruned = CounterMetricFamily(p + "pruned_tokens", "Draft tokens a request's grammar forbade, cut from the tree "
                                 "before verification (counted in the drafted tokens, never accepted).",
                                 labels=["drafter"])
    draft_time = CounterMetricFamily(p + "draft_time_seconds", "Time spent proposing drafts.", labels=["drafter"])
    verify_time = CounterMetricFamily(p + "verify_time_seconds", "Time spent verifying drafts (a batched "
                                      "verification counts once per sequence it carried).", labels=["drafter"])
    budget = HistogramMetricFamily(p + "draft_budget_tokens", "Draft-tree nodes the scheduler allowed a decoding "
                                   "sequence in a step (0 = no draft), one observation per sequence step.",
                                   labels=["drafter"])
    for name, st in sorted(drafters.items()):
        steps.add_metric([name], st.num_steps)
        draft.add_metric([name], st.num_draft_tokens)
        accepted.add_metric([name], st.num_accepted_tokens)
        emitted.add_metric([name], st.num_emitted_tokens)
        by_depth = list(st.accepted_by_depth)[:MAX_POSITION]
        for depth in range(1, max(max_position, len(by_depth)) + 1):
            by_position.add_metric([name, str(depth)], by_depth[depth - 1] if depth <= len(by_depth) else 0)
        counts = list(st.accepted_length_counts)
        buckets, cumulative = [], 0
        for k in range(ACCEPTED_LENGTH_BUCKETS):   # a fixed set, so quantiles stay comparable and `le` bounded
            cumulative += counts[k] if k < len(counts) else 0
            buckets.append((f"{float(k)}", cumulative))
        buckets.append(("+Inf", sum(counts)))
        length.add_metric([name], buckets, sum_value=st.num_accepted_tokens)
        fallbacks.add_metric([name], st.num_fallbacks)
        pruned.add_metric([name], st.num_pruned_tokens)
        draft_time.add_metric([name], st.draft_time_s)
        verify_time.add_metric([name], st.verify_time_s)
        budget_counts = list(getattr(st, "budget_counts", []))
        buckets = [(f"{float(le)}", sum(budget_counts[:le + 1])) for le in budget_buckets]
        buckets.append(("+Inf", sum(budget_counts)))
        budget.add_metric([name], buckets, sum_value=sum(b * c for b, c in enumerate(budget_counts)))
    return [steps, draft, accepted, emitted, by_position, length, fallbacks, pruned, draft_time, verify_time, budget]


def _part_families(drafters: dict | None) -> list[Metric]:
    """Per-part counters of composite drafters (`DrafterStats.parts`); no family when no drafter has
    parts (None: the families themselves, for `describe`)."""
    p = "specserve_spec_decode_"
    draft = CounterMetricFamily(p + "draft_part_tokens", "Draft tokens proposed by one part of a composite "
                                "drafter (e.g. a sub-drafter of a cascade).", labels=["drafter", "part"])
    accepted = CounterMetricFamily(p + "accepted_part_tokens", "Draft tokens accepted whose tree node one part "
                                   "of a composite drafter proposed.", labels=["drafter", "part"])
    if drafters is None:
        return [draft, accepted]
    any_parts = False
    for name, st in sorted(drafters.items()):
        for part, ps in sorted((getattr(st, "parts", None) or {}).items()):
            any_parts = True
            draft.add_metric([name, part], ps.num_draft_tokens)
            accepted.add_metric([name, part], ps.num_accepted_tokens)
    return [draft, accepted] if any_parts else []


class _VllmEngineCollector(Collector):
    """vLLM's names for the engine-level series (`vllm:` prefix, labels model_name and engine = "0"),
    read from `engine.get_stats()` at scrape time like ours; speculation summed over the drafters
    (the grammar's forced tokens included): a draft is a verification step with a draft tree,
    accepted tokens exclude the bonus token, and `position` is 0-based (accepted at tree depth
    position + 1), as vLLM counts them."""

    def __init__(self, engine: "AsyncEngine", model_name: str):
        self._engine = engine
        self._labels = [model_name, "0"]
        self._positions = _max_position(engine)

    def _families(self, stats) -> list[Metric]:
        labels, names = self._labels, ["model_name", "engine"]

        def family(cls, name: str, doc: str, value: float) -> Metric:
            f = cls(name, doc, labels=names)
            f.add_metric(labels, value)
            return f

        def value(attr: str) -> float:
            return float(getattr(stats, attr, 0) or 0) if stats is not None else 0.0

        drafters = list((getattr(stats, "drafters", None) or {}).values())
        by_pos = [0] * max(self._positions, *(len(d.accepted_by_depth) for d in drafters), 1)
        for d in drafters:
            for i, n in enumerate(d.accepted_by_depth):
                by_pos[i] += n
        per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                      "Accepted tokens per draft position.", labels=[*names, "position"])
        for i, n in enumerate(by_pos[:MAX_POSITION]):
            per_pos.add_metric([*labels, str(i)], n)
        return [
            family(GaugeMetricFamily, "vllm:num_requests_running", "Number of requests in model execution batches.",
                   value("num_running")),
            family(GaugeMetricFamily, "vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                   value("num_waiting")),
            family(GaugeMetricFamily, "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                   value("kv_usage")),
            family(CounterMetricFamily, "vllm:prompt_tokens", "Number of prefill tokens processed.",
                   value("num_prompt_tokens_total")),
            family(CounterMetricFamily, "vllm:generation_tokens", "Number of generation tokens processed.",
                   value("num_generation_tokens_total")),
            family(CounterMetricFamily, "vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                   value("num_preemptions_total")),
            family(CounterMetricFamily, "vllm:spec_decode_num_drafts", "Number of spec decoding drafts.",
                   sum(d.num_steps for d in drafters)),
            family(CounterMetricFamily, "vllm:spec_decode_num_draft_tokens", "Number of draft tokens.",
                   sum(d.num_draft_tokens for d in drafters)),
            family(CounterMetricFamily, "vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.",
                   sum(d.num_accepted_tokens for d in drafters)),
            per_pos,
        ]

    def describe(self) -> Iterable[Metric]:
        return self._families(None)

    def collect(self) -> Iterable[Metric]:
        return self._families(self._engine.get_stats())


class _VllmRequestSeries:
    """vLLM's names for the request-level series, observed at the edge beside ours."""

    FINISHED_REASONS = ("stop", "length", "abort")

    def __init__(self, registry: CollectorRegistry, model_name: str):
        names, labels = ["model_name", "engine"], [model_name, "0"]
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              names, buckets=TTFT_BUCKETS, registry=registry).labels(*labels)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             names, buckets=ITL_BUCKETS, registry=registry).labels(*labels)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             names, buckets=E2E_BUCKETS, registry=registry).labels(*labels)
        self.queue_time = Histogram("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase "
                                    "for request.", names, buckets=TTFT_BUCKETS, registry=registry).labels(*labels)
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          [*names, "finished_reason"], registry=registry)
        self.success = {reason: success.labels(*labels, reason) for reason in self.FINISHED_REASONS}


class ServerMetrics:
    """The Prometheus registry of one app and the request-level series observed at the edge."""

    def __init__(self, engine: "AsyncEngine", model_name: str, vllm_metrics: bool = True):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("specserve_requests", "Finished requests by outcome "
                                "(stop | length | abort | rejected | error).", ["status"], registry=r)
        for status in REQUEST_STATUSES:
            self.requests.labels(status)   # export zeros so rate() works from the first scrape
        by = ["drafter"]
        self.ttft = Histogram("specserve_time_to_first_token_seconds",
                              "Time from a request's arrival to its first generated token, by the request's "
                              "drafter (none = plain decoding).", by, buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("specserve_inter_token_latency_seconds",
                             "Time between a request's token deliveries per token delivered (one sample per "
                             "token), by the request's drafter.", by, buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("specserve_e2e_request_latency_seconds",
                             "Time from a request's arrival to its end, by the request's drafter.", by,
                             buckets=E2E_BUCKETS, registry=r)
        self.queue_time = Histogram("specserve_request_queue_time_seconds",
                                    "Time from a request's arrival to its first scheduling, by the request's "
                                    "drafter.", by, buckets=TTFT_BUCKETS, registry=r)
        self.request_tokens = Counter("specserve_request_generation_tokens",
                                      "Tokens generated for requests, all choices included, by the request's "
                                      "drafter (none = plain decoding).", by, registry=r)
        core = _core_engine(engine)
        default = getattr(core, "default_drafter", None)
        self.default_drafter: str = default if isinstance(default, str) and default else NO_DRAFTER
        loaded = getattr(engine, "drafter_names", None)
        auto = [AUTO_DRAFTER] if getattr(core, "auto_drafters", None) else []   # a request's choice among them
        self.drafter_labels: list[str] = [NO_DRAFTER, *auto, *(loaded if isinstance(loaded, list) else [])]
        for name in self.drafter_labels:      # zeros for every label a request can take
            for family in (self.ttft, self.itl, self.e2e, self.queue_time, self.request_tokens):
                family.labels(name)
        info = Gauge("specserve_model_info", "The served model (value 1).", ["model", "max_model_len"], registry=r)
        info.labels(model_name, str(engine.max_model_len)).set(1)
        r.register(_EngineStatsCollector(engine))
        self.vllm: _VllmRequestSeries | None = None      # vLLM's names beside ours (--no-vllm-metrics: off)
        if vllm_metrics:
            self.vllm = _VllmRequestSeries(r, model_name)
            r.register(_VllmEngineCollector(engine, model_name))

    def track(self, drafter: str | None = None) -> "RequestTracker":
        """A tracker for one request; `drafter` is the one it asked for (None: the server default)."""
        return RequestTracker(self, drafter)

    def count(self, status: str) -> None:
        self.requests.labels(status).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class RequestTracker:
    """Observes one request's outputs as they pass the edge; `finish` records its outcome once.

    The `drafter` label is the drafter that decoded the request, read from its outputs (`out.spec`,
    None for plain decoding); before the first output it is the requested one, or the server default."""

    def __init__(self, metrics: ServerMetrics, drafter: str | None = None):
        self._m = metrics
        requested = drafter if drafter in metrics.drafter_labels else None
        self._drafter = requested or metrics.default_drafter
        self._last_token_time: float | None = None
        self._seen_first = False
        self._num_generated = 0
        self._finish_reasons: set[str] = set()
        self._done = False
        self._last_output: RequestOutput | None = None
        self._start = time.monotonic()      # stands in for the arrival time until an output arrives

    @property
    def drafter(self) -> str:
        return self._drafter

    def observe(self, out: RequestOutput) -> None:
        vllm = self._m.vllm
        spec = out.spec
        self._drafter = spec.drafter if spec is not None and spec.drafter else NO_DRAFTER
        label = self._drafter
        if out.num_generated_tokens > self._num_generated:
            self._m.request_tokens.labels(label).inc(out.num_generated_tokens - self._num_generated)
            self._num_generated = out.num_generated_tokens
        t = out.metrics
        num_new = max((len(d.token_ids) for d in out.outputs), default=0)
        if num_new and t.last_token_time is not None:
            if not self._seen_first and t.first_token_time is not None:
                self._seen_first = True
                ttft = max(0.0, t.first_token_time - t.arrival_time)
                self._m.ttft.labels(label).observe(ttft)
                if vllm:
                    vllm.ttft.observe(ttft)
                if t.first_scheduled_time is not None:
                    queued = max(0.0, t.first_scheduled_time - t.arrival_time)
                    self._m.queue_time.labels(label).observe(queued)
                    if vllm:
                        vllm.queue_time.observe(queued)
                num_new -= 1        # the first token has no gap before it
                self._last_token_time = t.first_token_time
            if num_new and self._last_token_time is not None:
                per_token = max(0.0, t.last_token_time - self._last_token_time) / num_new
                itl = self._m.itl.labels(label)
                for _ in range(num_new):
                    itl.observe(per_token)
                    if vllm:
                        vllm.itl.observe(per_token)
            self._last_token_time = max(self._last_token_time or 0.0, t.last_token_time)
        self._finish_reasons.update(d.finish_reason for d in out.outputs if d.finish_reason)
        self._last_output = out
        if out.finished:
            self.finish()

    def finish(self, status: str | None = None) -> None:
        """Record the outcome: `status` if given (abort, error), else from the finish reasons seen."""
        if self._done:
            return
        self._done = True
        if status is None:
            if "abort" in self._finish_reasons or not self._finish_reasons:
                status = "abort"
            elif "length" in self._finish_reasons:
                status = "length"
            else:
                status = "stop"
        self._m.count(status)
        out = self._last_output
        arrival = out.metrics.arrival_time if out is not None else self._start
        end = out.metrics.finished_time if out is not None and out.finished else None
        e2e = max(0.0, (end or time.monotonic()) - arrival)
        self._m.e2e.labels(self._drafter).observe(e2e)
        vllm = self._m.vllm
        if vllm and status in vllm.success:
            vllm.success[status].inc()
            vllm.e2e.observe(e2e)
