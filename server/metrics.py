"""Prometheus metrics of one server (one registry per app, so several apps can share a process).

Request-level values are observed at the edge, from each request's `RequestOutput.metrics`
timestamps (``time.monotonic()``, stamped by the engine); engine-level values (queue depth, KV
usage, token counters) are read from ``engine.get_stats()`` at scrape time, so they are current
even while long requests are still running.

Series (all prefixed ``specserve_``):

=========================================  =========  =================================================
name                                       type       meaning
=========================================  =========  =================================================
requests_total{status}                     counter    finished requests; status is one of
                                                      stop | length | abort | rejected | error
prompt_tokens_total                        counter    prompt tokens prefilled (recomputation after a
                                                      preemption counts again)
generation_tokens_total                    counter    tokens generated, every choice included
num_preemptions_total                      counter    sequences preempted for lack of KV blocks
time_to_first_token_seconds                histogram  arrival -> first generated token
inter_token_latency_seconds                histogram  gap between a request's token deliveries divided
                                                      by the tokens delivered (one sample per token)
e2e_request_latency_seconds                histogram  arrival -> finished
request_queue_time_seconds                 histogram  arrival -> first scheduled
num_requests_running                       gauge      sequences in the running batch
num_requests_waiting                       gauge      sequences waiting for admission
kv_cache_usage_ratio                       gauge      fraction of KV blocks in use (0..1)
model_info{model,max_model_len}            gauge      1, labels describe the served model
=========================================  =========  =================================================

``status``: ``stop``/``length`` are the finish reason of a completed request (``length`` when any
choice hit the limit), ``abort`` a request whose client went away, ``rejected`` a 4xx answered
before generation (bad field, unknown model, prompt too long, queue full), ``error`` a 5xx.

PromQL for a dashboard::

    # throughput (tokens/s) and request rate by outcome
    rate(specserve_generation_tokens_total[1m])
    rate(specserve_prompt_tokens_total[1m])
    sum by (status) (rate(specserve_requests_total[5m]))
    # error ratio
    sum(rate(specserve_requests_total{status=~"error|rejected"}[5m])) / sum(rate(specserve_requests_total[5m]))
    # latency percentiles (p50 / p99 shown; swap the histogram for ITL / e2e / queue time)
    histogram_quantile(0.5,  sum by (le) (rate(specserve_time_to_first_token_seconds_bucket[5m])))
    histogram_quantile(0.99, sum by (le) (rate(specserve_time_to_first_token_seconds_bucket[5m])))
    histogram_quantile(0.99, sum by (le) (rate(specserve_inter_token_latency_seconds_bucket[5m])))
    # mean time per output token
    rate(specserve_inter_token_latency_seconds_sum[5m]) / rate(specserve_inter_token_latency_seconds_count[5m])
    # queue depth and memory pressure
    specserve_num_requests_running
    specserve_num_requests_waiting
    specserve_kv_cache_usage_ratio
    rate(specserve_num_preemptions_total[5m])

Speculative decoding, per drafter (from ``EngineStats.drafters``; prefix ``specserve_spec_decode_``):

=========================================  =========  =================================================
verification_steps_total{drafter}          counter    verification steps that carried a draft
draft_tokens_total{drafter}                counter    draft tokens proposed (tree nodes, root excluded)
accepted_tokens_total{drafter}             counter    draft tokens accepted (bonus excluded)
emitted_tokens_total{drafter}              counter    tokens committed by those steps (accepted + bonus)
accepted_tokens_per_position_total         counter    accepted draft tokens at tree depth ``position``
  {drafter,position}                                  (1 = the first draft token)
accepted_length{drafter}                   histogram  accepted draft tokens per step (le = 0, 1, 2, ...)
drafter_fallbacks_total{drafter}           counter    steps where the drafter failed -> plain decoding
draft_time_seconds_total{drafter}          counter    time spent proposing
verify_time_seconds_total{drafter}         counter    time spent verifying
=========================================  =========  =================================================

PromQL for speculation, per drafter::

    # acceptance rate alpha = accepted / drafted
    sum by (drafter) (rate(specserve_spec_decode_accepted_tokens_total[5m]))
      / sum by (drafter) (rate(specserve_spec_decode_draft_tokens_total[5m]))
    # mean accepted length tau (tokens per verification step, bonus included)
    sum by (drafter) (rate(specserve_spec_decode_emitted_tokens_total[5m]))
      / sum by (drafter) (rate(specserve_spec_decode_verification_steps_total[5m]))
    # per-position acceptance: share of steps that accepted at least `position` draft tokens
    sum by (drafter, position) (rate(specserve_spec_decode_accepted_tokens_per_position_total[5m]))
      / on (drafter) group_left sum by (drafter) (rate(specserve_spec_decode_verification_steps_total[5m]))
    # drafter failures per step, draft and verify time per step
    rate(specserve_spec_decode_drafter_fallbacks_total[5m]) / rate(specserve_spec_decode_verification_steps_total[5m])
    rate(specserve_spec_decode_draft_time_seconds_total[5m]) / rate(specserve_spec_decode_verification_steps_total[5m])
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from specserve.engine.outputs import RequestOutput

if TYPE_CHECKING:
    from specserve.engine.async_engine import AsyncEngine

REQUEST_STATUSES = ("stop", "length", "abort", "rejected", "error")
ACCEPTED_LENGTH_BUCKETS = 17     # le = 0, 1, ..., 16 accepted draft tokens per step

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
               0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0)


class _EngineStatsCollector(Collector):
    """Reads `engine.get_stats()` at scrape time."""

    def __init__(self, engine: "AsyncEngine"):
        self._engine = engine

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
        ]

    def describe(self) -> Iterable[Metric]:
        return self._families(None) + _drafter_families({})

    def collect(self) -> Iterable[Metric]:
        stats = self._engine.get_stats()
        return self._families(stats) + _drafter_families(getattr(stats, "drafters", None) or {})


def _drafter_families(drafters: dict) -> list[Metric]:
    """Per-drafter speculation counters from `EngineStats.drafters` ({name: DrafterStats})."""
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
                                      "Draft tokens accepted at each tree depth (position 1 = first draft token).",
                                      labels=["drafter", "position"])
    length = HistogramMetricFamily(p + "accepted_length", "Draft tokens accepted per verification step.",
                                   labels=["drafter"])
    fallbacks = CounterMetricFamily(p + "drafter_fallbacks", "Steps where the drafter failed and plain decoding "
                                    "was used instead.", labels=["drafter"])
    draft_time = CounterMetricFamily(p + "draft_time_seconds", "Time spent proposing drafts.", labels=["drafter"])
    verify_time = CounterMetricFamily(p + "verify_time_seconds", "Time spent verifying drafts.", labels=["drafter"])
    for name, st in sorted(drafters.items()):
        steps.add_metric([name], st.num_steps)
        draft.add_metric([name], st.num_draft_tokens)
        accepted.add_metric([name], st.num_accepted_tokens)
        emitted.add_metric([name], st.num_emitted_tokens)
        for depth, count in enumerate(st.accepted_by_depth, start=1):
            by_position.add_metric([name, str(depth)], count)
        counts = list(st.accepted_length_counts)
        buckets, cumulative = [], 0
        for k in range(max(ACCEPTED_LENGTH_BUCKETS, len(counts))):   # a fixed set, so quantiles stay comparable
            cumulative += counts[k] if k < len(counts) else 0
            buckets.append((f"{float(k)}", cumulative))
        buckets.append(("+Inf", sum(counts)))
        length.add_metric([name], buckets, sum_value=st.num_accepted_tokens)
        fallbacks.add_metric([name], st.num_fallbacks)
        draft_time.add_metric([name], st.draft_time_s)
        verify_time.add_metric([name], st.verify_time_s)
    return [steps, draft, accepted, emitted, by_position, length, fallbacks, draft_time, verify_time]


class ServerMetrics:
    """The Prometheus registry of one app and the request-level series observed at the edge."""

    def __init__(self, engine: "AsyncEngine", model_name: str):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("specserve_requests", "Finished requests by outcome "
                                "(stop | length | abort | rejected | error).", ["status"], registry=r)
        for status in REQUEST_STATUSES:
            self.requests.labels(status)   # export zeros so rate() works from the first scrape
        self.ttft = Histogram("specserve_time_to_first_token_seconds",
                              "Time from a request's arrival to its first generated token.",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("specserve_inter_token_latency_seconds",
                             "Time between a request's token deliveries per token delivered.",
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("specserve_e2e_request_latency_seconds",
                             "Time from a request's arrival to its end.", buckets=E2E_BUCKETS, registry=r)
        self.queue_time = Histogram("specserve_request_queue_time_seconds",
                                    "Time from a request's arrival to its first scheduling.",
                                    buckets=TTFT_BUCKETS, registry=r)
        info = Gauge("specserve_model_info", "The served model (value 1).", ["model", "max_model_len"], registry=r)
        info.labels(model_name, str(engine.max_model_len)).set(1)
        r.register(_EngineStatsCollector(engine))

    def track(self) -> "RequestTracker":
        return RequestTracker(self)

    def count(self, status: str) -> None:
        self.requests.labels(status).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class RequestTracker:
    """Observes one request's outputs as they pass the edge; `finish` records its outcome once."""

    def __init__(self, metrics: ServerMetrics):
        self._m = metrics
        self._last_token_time: float | None = None
        self._seen_first = False
        self._finish_reasons: set[str] = set()
        self._done = False
        self._last_output: RequestOutput | None = None
        self._start = time.monotonic()      # stands in for the arrival time until an output arrives

    def observe(self, out: RequestOutput) -> None:
        t = out.metrics
        num_new = max((len(d.token_ids) for d in out.outputs), default=0)
        if num_new and t.last_token_time is not None:
            if not self._seen_first and t.first_token_time is not None:
                self._seen_first = True
                self._m.ttft.observe(max(0.0, t.first_token_time - t.arrival_time))
                if t.first_scheduled_time is not None:
                    self._m.queue_time.observe(max(0.0, t.first_scheduled_time - t.arrival_time))
                num_new -= 1        # the first token has no gap before it
                self._last_token_time = t.first_token_time
            if num_new and self._last_token_time is not None:
                per_token = max(0.0, t.last_token_time - self._last_token_time) / num_new
                for _ in range(num_new):
                    self._m.itl.observe(per_token)
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
        self._m.e2e.observe(max(0.0, (end or time.monotonic()) - arrival))
