"""Reliability under load: an operator's check, against a live server, that nothing is lost.

    python -m specserve.bench.reliability [--url http://127.0.0.1:8000] [--num-requests 2000] [--concurrency 32]
        [--disconnects 200] [--out bench/results/reliability]
    (or: specserve bench reliability ...)

Without --url it starts its own server, ``python -m specserve.server serve --model default --drafter none
--drafter ngram --drafter mag --host 127.0.0.1 --port <free port> --log-level warning`` (plus --server-args),
waits for /health, and at the end stops it with SIGTERM and records its exit status (0 is expected).

Phases:
  warm-up  one short request per drafter (mag builds its bigram table on first use), then the idle
           values of /metrics: running and waiting requests, KV-cache usage.
  soak     --num-requests requests, --concurrency at a time: a shuffled full factorial of --drafters (the
           per-request `speculative` extension) x chat / completions x stream / non-stream x --temperatures,
           cycled through the request count (every cell equally often, up to one; the run warns when
           --num-requests is below the number of cells), max_tokens drawn from --max-tokens, a share with logprobs (one entry per token, so token counts
           are exact) and, for streams, a share with stream_options.include_usage. Every response is checked.
  storm    --disconnects streaming requests with long max_tokens (EOS ignored), --concurrency at a time,
           each closed by the client after a few content chunks; they cycle through every drafter x
           endpoint x temperature cell.
  constraints  --constraint-flood heavy structured-output constraints in flight at once (bench/constraint_flood.py):
           each must end as a success keeping its constraint, a clean 400 or an explicit constraint_failed;
           a small unconstrained and a small constrained chat timed alone and during the flood, /health
           during it, the server's RSS before and after.
After each phase /metrics is polled until running = waiting = 0 and KV usage is back at its idle value (up
to --idle-timeout); /health is sampled every --health-interval seconds from warm-up to the end.

Each soak request ends as
  ok        complete and consistent;
  rejected  HTTP 429 (queue full): not lost, reported apart;
  lost      a 5xx or any other unexpected status, a connection or transport error, a timeout, a stream
            without [DONE] or without finish_reason, an error event, finish_reason "abort", unparsable JSON/SSE;
  invalid   complete but inconsistent: usage missing or wrong (completion_tokens != logprobs entries,
            != total - prompt), more tokens than max_tokens, finish_reason "length" short of max_tokens, a
            response naming another drafter, ...

Writes PREFIX.json (every number and the setup) and PREFIX.md (the summary, also printed). Exit status 0
when nothing was lost or invalid, every phase returned to idle, /health answered 200 to every sample and
the server this script started exited 0; else 1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from datetime import datetime
from itertools import product
from pathlib import Path
from typing import Callable, Iterable

import httpx

from specserve.bench.common import ManagedServer, free_port, serve_command

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "reliability"
DEFAULT_DRAFTERS = ("none", "ngram", "mag")
ENDPOINTS = ("chat", "completions")
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
FINISH_REASONS = ("stop", "length")
IDLE_GAUGES = ("specserve_num_requests_running", "specserve_num_requests_waiting", "specserve_kv_cache_usage_ratio")
# server counters whose change over each phase is reported (label sets included)
COUNTER_PREFIXES = ("specserve_requests_total", "specserve_generation_tokens_total", "specserve_num_preemptions_total",
                    "specserve_engine_step_failures_total", "specserve_engine_failed_requests_total",
                    "specserve_spec_decode_drafter_fallbacks_total")
KV_TOLERANCE = 1e-9
BUILTIN_PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "List three uses of a paperclip.",
    "def quicksort(xs):\n    \"\"\"Sort a list with quicksort.\"\"\"\n",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "Translate 'good morning, how are you?' into Spanish and German.",
    "Summarise the plot of Romeo and Juliet in one paragraph.",
    "Give me a short recipe for pancakes.",
    "Why is the sky blue? Answer briefly.",
    "Write a SQL query that counts the rows of a table named orders per customer_id.",
)


# ---- arguments --------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m specserve.bench.reliability", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    s = ap.add_argument_group("server")
    s.add_argument("--url", default=None, metavar="URL",
                   help="a running server, e.g. http://127.0.0.1:8000 (default: start one on a free loopback port)")
    s.add_argument("--model", default="default", help="the started server's --model (default: %(default)s)")
    s.add_argument("--server-args", default="", metavar="ARGS",
                   help="more options of the started server, one shell-quoted string, e.g. "
                        "\"--max-num-seqs 32 --log-level info\" (later options win)")
    s.add_argument("--startup-timeout", type=float, default=600.0, metavar="S",
                   help="wait this long for the started server's /health (the first load of the default model "
                        "converts its GGUF) (default: %(default)s)")
    s.add_argument("--stop-timeout", type=float, default=60.0, metavar="S",
                   help="after SIGTERM, wait this long for the started server to exit before SIGKILL "
                        "(default: %(default)s)")
    s.add_argument("--api-key", default=os.environ.get("SPECSERVE_API_KEY") or None,
                   help="Bearer key for /v1/* (default: $SPECSERVE_API_KEY, else none)")
    m = ap.add_argument_group("request mix")
    m.add_argument("--drafters", nargs="+", default=list(DEFAULT_DRAFTERS), metavar="NAME",
                   help="drafters of the mix ('none' = plain decoding); a started server loads them in this order "
                        "(default: %(default)s)")
    m.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7, 1.0], metavar="T",
                   help="(default: %(default)s)")
    m.add_argument("--max-tokens", type=int, nargs=2, default=[8, 32], metavar=("MIN", "MAX"),
                   help="max_tokens of a soak request, drawn uniformly (default: %(default)s)")
    m.add_argument("--logprobs-fraction", type=float, default=0.5, metavar="F",
                   help="share of soak requests asking for logprobs, whose token counts are checked exactly "
                        "(default: %(default)s)")
    m.add_argument("--usage-fraction", type=float, default=0.75, metavar="F",
                   help="share of soak streams with stream_options.include_usage (default: %(default)s)")
    m.add_argument("--prompts", default="auto", metavar="SOURCE",
                   help="'builtin', 'data' (first turns of the benchmark datasets in $SPECSERVE_DATA or "
                        "../shared/data, read in place), a {turns} JSONL file, or 'auto' = data when present, "
                        "else builtin (default: %(default)s)")
    m.add_argument("--num-prompts", type=int, default=16, metavar="N",
                   help="prompts taken from each dataset (default: %(default)s)")
    m.add_argument("--max-prompt-chars", type=int, default=1200, metavar="N",
                   help="longer prompts are cut to this many characters (default: %(default)s)")
    m.add_argument("--seed", type=int, default=0, help="seed of the mix (default: %(default)s)")
    p = ap.add_argument_group("phases")
    p.add_argument("--num-requests", type=int, default=2000, metavar="N", help="soak requests (default: %(default)s)")
    p.add_argument("--concurrency", type=int, default=32, metavar="C",
                   help="requests in flight at once, soak and storm (default: %(default)s)")
    p.add_argument("--disconnects", type=int, default=200, metavar="D",
                   help="streams closed mid-way in the disconnect storm; 0 skips it (default: %(default)s)")
    p.add_argument("--disconnect-after", type=int, nargs=2, default=[1, 4], metavar=("MIN", "MAX"),
                   help="content chunks a storm stream reads before closing, drawn uniformly (default: %(default)s)")
    p.add_argument("--disconnect-max-tokens", type=int, default=512, metavar="N",
                   help="max_tokens of a storm request (EOS ignored) (default: %(default)s)")
    p.add_argument("--constraint-flood", type=int, default=20, metavar="N",
                   help="heavy constraints in flight in the constraint flood; 0 skips it (default: %(default)s)")
    p.add_argument("--request-timeout", type=float, default=300.0, metavar="S",
                   help="whole-request limit, queueing included; past it the request is lost (default: %(default)s)")
    p.add_argument("--max-phase-seconds", type=float, default=5400.0, metavar="S",
                   help="no new request of a phase starts after this long; the rest count as not sent "
                        "(default: %(default)s)")
    p.add_argument("--idle-timeout", type=float, default=60.0, metavar="S",
                   help="wait this long after a phase for running = waiting = 0 and idle KV usage "
                        "(default: %(default)s)")
    p.add_argument("--health-interval", type=float, default=0.5, metavar="S",
                   help="/health sampling period (default: %(default)s)")
    ap.add_argument("--out", default=str(DEFAULT_OUT), metavar="PREFIX",
                    help="writes PREFIX.json and PREFIX.md (default: bench/results/reliability)")
    ap.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return ap


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.num_requests < 0 or args.disconnects < 0:
        ap.error("--num-requests and --disconnects must be >= 0")
    if args.concurrency < 1:
        ap.error("--concurrency must be >= 1")
    lo, hi = args.max_tokens
    if not 1 <= lo <= hi:
        ap.error("--max-tokens MIN MAX needs 1 <= MIN <= MAX")
    lo, hi = args.disconnect_after
    if not 1 <= lo <= hi:
        ap.error("--disconnect-after MIN MAX needs 1 <= MIN <= MAX")
    if args.disconnect_max_tokens <= hi:
        ap.error("--disconnect-max-tokens must exceed the chunks read before disconnecting")
    for name in ("logprobs_fraction", "usage_fraction"):
        if not 0.0 <= getattr(args, name) <= 1.0:
            ap.error(f"--{name.replace('_', '-')} must be within 0..1")
    if args.url is not None:
        args.url = args.url.rstrip("/")
    return args


def server_command(args: argparse.Namespace, port: int) -> list[str]:
    """The command line of the server this script starts."""
    return serve_command(args.model, port, args.drafters, shlex.split(args.server_args))


# ---- prompts ----------------------------------------------------------------------------------


def load_prompt_set(source: str, per_dataset: int, max_chars: int) -> tuple[list[str], str]:
    """(prompts, where they came from); prompts longer than `max_chars` are cut."""
    from specserve.bench.datasets import DATASETS, data_dir, load_prompts

    if source == "auto":
        source = "data" if all((data_dir() / f).is_file() for f in DATASETS.values()) else "builtin"
    if source == "builtin":
        prompts, where = list(BUILTIN_PROMPTS), "builtin"
    elif source == "data":
        prompts = [p for name in DATASETS for p in load_prompts(name, per_dataset)]
        where = f"{data_dir()} ({', '.join(DATASETS)}; {per_dataset} each)"
    else:
        prompts, where = load_prompts(source, per_dataset), source
    prompts = [p[:max_chars] for p in prompts if p.strip()]
    if not prompts:
        raise SystemExit(f"reliability: no prompts in {where}")
    return prompts, where


# ---- the request mix --------------------------------------------------------------------------


@dataclass(frozen=True)
class Planned:
    """One soak request."""

    index: int
    endpoint: str            # chat | completions
    stream: bool
    temperature: float
    drafter: str
    max_tokens: int
    logprobs: bool
    include_usage: bool      # streams only
    prompt: int              # index into the prompt list

    @property
    def mode(self) -> str:
        return f"{self.endpoint} {'stream' if self.stream else 'full'}"


def plan_cells(drafters: Iterable[str], temperatures: Iterable[float],
               streams: Iterable[bool] = (False, True)) -> list[tuple[str, bool, float, str]]:
    """Every (endpoint, stream, temperature, drafter) cell once -- the full factorial -- ordered with
    endpoint x stream varying fastest, then the drafter, then the temperature (so a run of consecutive
    cells is balanced over the modes first)."""
    modes = list(product(ENDPOINTS, streams))
    return [(*mode, float(t), d) for t in temperatures for d in dict.fromkeys(drafters) for mode in modes]


def make_plan(num_requests: int, *, drafters: Iterable[str], temperatures: Iterable[float],
              max_tokens: tuple[int, int], num_prompts: int, logprobs_fraction: float, usage_fraction: float,
              seed: int = 0) -> list[Planned]:
    """A shuffled full factorial: request i takes cell i mod C of `plan_cells` (C = 4 modes x T
    temperatures x D drafters), so every drafter x endpoint x stream x temperature cell occurs
    floor(N/C) or ceil(N/C) times -- each at least once when N >= C -- whatever T and D are; then the
    order is shuffled. max_tokens, prompt, logprobs and include_usage are drawn per request."""
    rng = random.Random(seed)
    table = plan_cells(drafters, temperatures)
    cells = [table[i % len(table)] for i in range(num_requests)]
    rng.shuffle(cells)
    plan = []
    for i, (endpoint, stream, temperature, drafter) in enumerate(cells):
        plan.append(Planned(index=i, endpoint=endpoint, stream=stream, temperature=float(temperature),
                            drafter=drafter, max_tokens=rng.randint(*max_tokens),
                            logprobs=rng.random() < logprobs_fraction,
                            include_usage=stream and rng.random() < usage_fraction,
                            prompt=rng.randrange(num_prompts)))
    return plan


def cell_key(p) -> str:
    """A request's cell as "drafter | endpoint stream-mode | T=t" (a `Planned` or an `Outcome`)."""
    return f"{p.drafter} | {p.mode} | T={p.temperature:g}"


def plan_coverage(plan: list[Planned], drafters: Iterable[str], temperatures: Iterable[float]) -> dict:
    """{cells, cells_covered, requests_per_cell: [min, max], missing_cells}: how the plan covers the full
    factorial (missing ones listed, at most 20)."""
    counts = Counter(cell_key(p) for p in plan)
    table = [cell_key(Planned(0, e, st, t, d, 1, False, False, 0)) for e, st, t, d in plan_cells(drafters, temperatures)]
    missing = [c for c in table if not counts[c]]
    per_cell = [counts[c] for c in table]
    return {"cells": len(table), "cells_covered": len(table) - len(missing),
            "requests_per_cell": [min(per_cell), max(per_cell)] if per_cell else [0, 0],
            "missing_cells": missing[:20]}


def request_body(p: Planned, prompt: str) -> dict:
    body: dict = {"model": "default", "max_tokens": p.max_tokens, "temperature": p.temperature,
                  "speculative": {"drafter": p.drafter}}
    if p.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
        if p.logprobs:
            body["logprobs"] = True
    else:
        body["prompt"] = prompt
        if p.logprobs:
            body["logprobs"] = 0
    if p.stream:
        body["stream"] = True
        if p.include_usage:
            body["stream_options"] = {"include_usage": True}
    return body


# ---- checking one response --------------------------------------------------------------------


@dataclass
class Outcome:
    """How one soak request ended. status: ok | lost | invalid | rejected | not_sent."""

    index: int
    mode: str
    drafter: str
    temperature: float
    status: str
    kind: str | None = None              # why it is lost / invalid
    http_status: int | None = None
    latency_s: float | None = None
    ttft_s: float | None = None          # streams: first content chunk
    completion_tokens: int | None = None  # usage.completion_tokens (None: not reported)
    counted_tokens: int | None = None    # logprobs entries (None: not asked)
    detail: str | None = None

    @property
    def tokens(self) -> int | None:
        return self.completion_tokens if self.completion_tokens is not None else self.counted_tokens


def _logprob_entries(endpoint: str, logprobs: dict | None) -> int:
    if not logprobs:
        return 0
    return len((logprobs.get("content") if endpoint == "chat" else logprobs.get("tokens")) or [])


def check_counts(p: Planned, finish_reason: str, usage: dict | None, counted: int | None,
                 content_chunks: int | None = None, *, usage_expected: bool) -> str | None:
    """The first inconsistency between what was asked, the finish reason, the usage block and the tokens
    counted by the client (logprobs entries), or None."""
    completion = None
    if usage is None:
        if usage_expected:
            return "missing_usage"
    else:
        completion, prompt, total = (usage.get(k) for k in ("completion_tokens", "prompt_tokens", "total_tokens"))
        if not all(isinstance(v, int) for v in (completion, prompt, total)):
            return "bad_usage"
        if prompt < 1 or total != prompt + completion:
            return "usage_total_mismatch"
    tokens = completion if completion is not None else counted
    if counted is not None and completion is not None and counted != completion:
        return "token_count_mismatch"
    if tokens is not None:
        if tokens > p.max_tokens:
            return "over_max_tokens"
        if finish_reason == "length" and tokens != p.max_tokens:
            return "length_short_of_max_tokens"
        if content_chunks is not None and content_chunks > tokens:
            return "more_chunks_than_tokens"
    return None


def check_full(p: Planned, data: dict) -> tuple[str | None, str | None, int | None, int | None]:
    """A non-streamed 200 body: (lost kind, invalid kind, usage.completion_tokens, logprobs entries)."""
    choices = data.get("choices")
    if not isinstance(choices, list) or len(choices) != 1:
        return "bad_choices", None, None, None
    c = choices[0]
    finish = c.get("finish_reason")
    if not finish:
        return "missing_finish_reason", None, None, None
    if finish not in FINISH_REASONS:
        return f"finish_{finish}", None, None, None
    if p.endpoint == "chat":
        text = (c.get("message") or {}).get("content")
    else:
        text = c.get("text")
    if not isinstance(text, str):
        return "missing_text", None, None, None
    usage = data.get("usage")
    counted = _logprob_entries(p.endpoint, c.get("logprobs")) if p.logprobs else None
    invalid = check_counts(p, finish, usage, counted, usage_expected=True)
    spec = data.get("speculative")
    if invalid is None and spec is not None and spec.get("drafter") != p.drafter:
        invalid = "wrong_drafter"
    completion = usage.get("completion_tokens") if isinstance(usage, dict) else None
    return None, invalid, completion, counted


class StreamCheck:
    """Feeds on a streamed response's lines and judges it: every `data:` line parses, no error event,
    exactly one finish_reason, `data: [DONE]` last, the usage chunk (when asked for) consistent."""

    def __init__(self, p: Planned, t0: float | None = None):
        self.p = p
        self.t0 = time.perf_counter() if t0 is None else t0
        self.done = False
        self.lost: str | None = None       # the first fatal problem
        self.detail: str | None = None
        self.finish_reasons: list[str] = []
        self.content_chunks = 0
        self.logprob_entries = 0
        self.usage: dict | None = None
        self.spec: dict | None = None
        self.ttft_s: float | None = None

    def _fail(self, kind: str, detail: str | None = None) -> None:
        if self.lost is None:
            self.lost, self.detail = kind, detail

    def feed(self, line: str) -> None:
        if not line or line.startswith(":"):      # event separator, SSE comment
            return
        if self.done:
            return self._fail("data_after_done", line[:200])
        if not line.startswith("data: "):
            return self._fail("bad_sse_line", line[:200])
        payload = line[len("data: "):]
        if payload == "[DONE]":
            self.done = True
            return
        try:
            obj = json.loads(payload)
        except json.JSONDecodeError:
            return self._fail("bad_json", payload[:200])
        if not isinstance(obj, dict):
            return self._fail("bad_json", payload[:200])
        if "error" in obj:
            err = obj["error"] if isinstance(obj["error"], dict) else {}
            return self._fail(f"error_event:{err.get('code') or err.get('type') or 'unknown'}",
                              str(err.get("message"))[:300])
        for c in obj.get("choices") or ():
            text = (c.get("delta") or {}).get("content") if self.p.endpoint == "chat" else c.get("text")
            if text:
                self.content_chunks += 1
                if self.ttft_s is None:
                    self.ttft_s = time.perf_counter() - self.t0
            self.logprob_entries += _logprob_entries(self.p.endpoint, c.get("logprobs"))
            if c.get("finish_reason"):
                self.finish_reasons.append(c["finish_reason"])
        if obj.get("usage"):
            self.usage = obj["usage"]
        if obj.get("speculative"):
            self.spec = obj["speculative"]

    def verdict(self) -> tuple[str | None, str | None]:
        """(lost kind, invalid kind) once the body has ended."""
        if self.lost is not None:
            return self.lost, None
        if not self.done:
            return "missing_done", None
        if not self.finish_reasons:
            return "missing_finish_reason", None
        if len(self.finish_reasons) > 1:
            return None, "several_finish_reasons"
        finish = self.finish_reasons[0]
        if finish not in FINISH_REASONS:
            return f"finish_{finish}", None
        counted = self.logprob_entries if self.p.logprobs else None
        invalid = check_counts(self.p, finish, self.usage, counted, self.content_chunks,
                               usage_expected=self.p.include_usage)
        if invalid is None and not self.p.include_usage and self.usage is not None:
            invalid = "unasked_usage"
        if invalid is None and self.spec is not None and self.spec.get("drafter") != self.p.drafter:
            invalid = "wrong_drafter"
        return None, invalid


def _error_code(r: httpx.Response) -> str:
    try:
        err = r.json().get("error") or {}
        return str(err.get("code") or err.get("type") or "")
    except (ValueError, AttributeError):
        return ""


async def run_one(client: httpx.AsyncClient, p: Planned, prompt: str, timeout: float) -> Outcome:
    out = Outcome(index=p.index, mode=p.mode, drafter=p.drafter, temperature=p.temperature, status="lost")
    t0 = time.perf_counter()

    async def go() -> None:
        body = request_body(p, prompt)
        if not p.stream:
            r = await client.post(PATHS[p.endpoint], json=body)
            out.http_status = r.status_code
            if r.status_code != 200:
                return _bad_status(out, r)
            lost, invalid, out.completion_tokens, out.counted_tokens = check_full(p, r.json())
            _judge(out, lost, invalid)
            return
        async with client.stream("POST", PATHS[p.endpoint], json=body) as r:
            out.http_status = r.status_code
            if r.status_code != 200:
                await r.aread()
                return _bad_status(out, r)
            check = StreamCheck(p, t0)
            async for line in r.aiter_lines():
                check.feed(line)
        lost, invalid = check.verdict()
        out.ttft_s, out.detail = check.ttft_s, check.detail
        out.completion_tokens = check.usage.get("completion_tokens") if check.usage else None
        out.counted_tokens = check.logprob_entries if p.logprobs else None
        _judge(out, lost, invalid)

    try:
        await asyncio.wait_for(go(), timeout)
    except asyncio.TimeoutError:
        out.status, out.kind = "lost", "timeout"
    except httpx.ConnectError as exc:
        out.status, out.kind, out.detail = "lost", "connect_error", str(exc)[:200]
    except httpx.RemoteProtocolError as exc:
        out.status, out.kind, out.detail = "lost", "connection_closed", str(exc)[:200]
    except httpx.HTTPError as exc:
        out.status, out.kind, out.detail = "lost", f"transport:{type(exc).__name__}", str(exc)[:200]
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        out.status, out.kind, out.detail = "lost", "bad_json", str(exc)[:200]
    out.latency_s = time.perf_counter() - t0
    return out


def _bad_status(out: Outcome, r: httpx.Response) -> None:
    code = _error_code(r)
    if r.status_code == 429:
        out.status, out.kind = "rejected", "http_429" + (f":{code}" if code else "")
    else:
        out.status, out.kind = "lost", f"http_{r.status_code}" + (f":{code}" if code else "")
        out.detail = r.text[:300]


def _judge(out: Outcome, lost: str | None, invalid: str | None) -> None:
    if lost is not None:
        out.status, out.kind = "lost", lost
    elif invalid is not None:
        out.status, out.kind = "invalid", invalid
    else:
        out.status = "ok"


# ---- the disconnect storm ---------------------------------------------------------------------


@dataclass
class Disconnect:
    """One storm stream. status: disconnected | finished_early | rejected | error | not_sent."""

    index: int
    status: str
    chunks: int = 0
    kind: str | None = None
    seconds: float | None = None


def storm_body(i: int, prompt: str, drafters: list[str], temperatures: list[float],
               max_tokens: int) -> tuple[str, dict]:
    """Storm request i: streamed, in cell i mod C of the endpoint x temperature x drafter factorial."""
    table = plan_cells(drafters, temperatures, streams=(True,))
    endpoint, _, temperature, drafter = table[i % len(table)]
    body: dict = {"model": "default", "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
                  "temperature": temperature, "speculative": {"drafter": drafter}}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return PATHS[endpoint], body


async def run_disconnect(client: httpx.AsyncClient, i: int, path: str, body: dict, after: int,
                         timeout: float) -> Disconnect:
    """Stream `body` and close the connection once `after` content chunks have arrived."""
    d = Disconnect(index=i, status="error")
    t0 = time.perf_counter()
    chat = path == PATHS["chat"]

    async def go() -> None:
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                await r.aread()
                code = _error_code(r)
                d.status = "rejected" if r.status_code == 429 else "error"
                d.kind = f"http_{r.status_code}" + (f":{code}" if code else "")
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                obj = json.loads(line[6:])
                if "error" in obj:
                    d.kind = "error_event"
                    return
                for c in obj.get("choices") or ():
                    if (c.get("delta") or {}).get("content") if chat else c.get("text"):
                        d.chunks += 1
                if d.chunks >= after:
                    d.status = "disconnected"
                    return            # leaving the `async with` closes the connection mid-stream
            d.status = "finished_early"

    try:
        await asyncio.wait_for(go(), timeout)
    except asyncio.TimeoutError:
        d.status, d.kind = "error", "timeout"
    except httpx.HTTPError as exc:
        d.status, d.kind = "error", f"transport:{type(exc).__name__}"
    except json.JSONDecodeError:
        d.status, d.kind = "error", "bad_json"
    d.seconds = time.perf_counter() - t0
    return d


# ---- running a phase --------------------------------------------------------------------------


async def run_pool(jobs: list[Callable], concurrency: int, *, deadline: float, alive: Callable[[], bool],
                   progress: Callable[[int], None] | None = None) -> list:
    """Run the coroutine factories `jobs` with at most `concurrency` at once, in order; a job not started
    by `deadline` (time.monotonic) or once `alive()` turns false is left out (its result is None)."""
    results: list = [None] * len(jobs)
    next_job = 0
    done = 0

    async def worker() -> None:
        nonlocal next_job, done
        while next_job < len(jobs) and time.monotonic() < deadline and alive():
            i = next_job
            next_job += 1
            results[i] = await jobs[i]()
            done += 1
            if progress is not None:
                progress(done)

    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(jobs)) or 1)))
    return results


# ---- /metrics and /health -----------------------------------------------------------------------


def parse_prometheus(text: str) -> dict[str, float]:
    """Prometheus text exposition -> {series (name plus its labels as written): value}."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if "}" in line:
            series, _, rest = line.rpartition("}")
            series += "}"
        else:
            series, _, rest = line.partition(" ")
        parts = rest.split()
        if not parts:
            continue
        try:
            values[series.strip()] = float(parts[0])
        except ValueError:
            continue
    return values


def counter_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The change of the COUNTER_PREFIXES series between two scrapes (zero changes left out)."""
    out = {}
    for key, value in after.items():
        if key.startswith(COUNTER_PREFIXES):
            delta = value - before.get(key, 0.0)
            if delta:
                out[key] = delta
    return dict(sorted(out.items()))


async def scrape(client: httpx.AsyncClient) -> dict[str, float] | None:
    try:
        r = await client.get("/metrics", timeout=10)
        return parse_prometheus(r.text) if r.status_code == 200 else None
    except httpx.HTTPError:
        return None


def idle_gauges(metrics: dict[str, float] | None) -> dict[str, float | None]:
    short = {"specserve_num_requests_running": "running", "specserve_num_requests_waiting": "waiting",
             "specserve_kv_cache_usage_ratio": "kv_usage"}
    return {short[k]: (metrics or {}).get(k) for k in IDLE_GAUGES}


async def wait_idle(client: httpx.AsyncClient, idle_kv: float | None, timeout: float, poll: float = 0.25) -> dict:
    """Poll /metrics until running = waiting = 0 and KV usage equals `idle_kv` (None: until it stops
    changing, for the baseline); how long it took and the last values."""
    t0 = time.monotonic()
    last_kv, polls, g = None, 0, idle_gauges(None)
    while True:
        polls += 1
        g = idle_gauges(await scrape(client))
        quiet = g["running"] == 0 and g["waiting"] == 0 and g["kv_usage"] is not None
        if quiet and idle_kv is not None and abs(g["kv_usage"] - idle_kv) <= KV_TOLERANCE:
            return {"returned": True, "seconds": time.monotonic() - t0, "polls": polls, **g}
        if quiet and idle_kv is None and last_kv is not None and abs(g["kv_usage"] - last_kv) <= KV_TOLERANCE:
            return {"returned": True, "seconds": time.monotonic() - t0, "polls": polls, **g}
        last_kv = g["kv_usage"] if quiet else None
        if time.monotonic() - t0 > timeout:
            return {"returned": False, "seconds": time.monotonic() - t0, "polls": polls, **g}
        await asyncio.sleep(poll)


class HealthSampler:
    """GET /health every `interval` seconds on its own connection, tagged with the current phase."""

    def __init__(self, client: httpx.AsyncClient, interval: float):
        self.client = client
        self.interval = interval
        self.phase = "warmup"
        self.samples: list[tuple[str, int | None, float]] = []   # (phase, status or None on error, seconds)
        self._stop = asyncio.Event()

    async def run(self) -> None:
        while not self._stop.is_set():
            t0 = time.perf_counter()
            try:
                r = await self.client.get("/health", timeout=10)
                status = r.status_code
            except httpx.HTTPError:
                status = None
            self.samples.append((self.phase, status, time.perf_counter() - t0))
            try:
                await asyncio.wait_for(self._stop.wait(), self.interval)
            except asyncio.TimeoutError:
                pass

    def stop(self) -> None:
        self._stop.set()

    def summary(self) -> dict:
        phases = list(dict.fromkeys(s[0] for s in self.samples))
        return {"interval_s": self.interval, "overall": health_stats(self.samples),
                "by_phase": {ph: health_stats([s for s in self.samples if s[0] == ph]) for ph in phases}}


def health_stats(samples: list[tuple[str, int | None, float]]) -> dict:
    lat = [s[2] for s in samples]
    return {"samples": len(samples), "ok": sum(s[1] == 200 for s in samples),
            "non_200": sum(s[1] is not None and s[1] != 200 for s in samples),
            "errors": sum(s[1] is None for s in samples),
            "p50_ms": _ms(percentile(lat, 50)), "p99_ms": _ms(percentile(lat, 99)),
            "max_ms": _ms(max(lat, default=None))}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


# ---- summaries --------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation between order statistics; None if empty."""
    xs = sorted(values)
    if not xs:
        return None
    k = (len(xs) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize(outcomes: list[Outcome]) -> dict:
    """Counts by status and kind, latency percentiles and tokens of a group of soak outcomes."""
    by = Counter(o.status for o in outcomes)
    ok = [o for o in outcomes if o.status == "ok"]
    lat = [o.latency_s for o in ok if o.latency_s is not None]
    ttft = [o.ttft_s for o in ok if o.ttft_s is not None]
    sent = len(outcomes) - by["not_sent"]
    return {
        "sent": sent, "ok": by["ok"], "lost": by["lost"], "invalid": by["invalid"], "rejected": by["rejected"],
        "not_sent": by["not_sent"], "completed": by["ok"] + by["invalid"],
        "lost_by_kind": dict(Counter(o.kind for o in outcomes if o.status == "lost").most_common()),
        "invalid_by_kind": dict(Counter(o.kind for o in outcomes if o.status == "invalid").most_common()),
        "rejected_by_kind": dict(Counter(o.kind for o in outcomes if o.status == "rejected").most_common()),
        "latency_s": {"p50": percentile(lat, 50), "p95": percentile(lat, 95), "p99": percentile(lat, 99),
                      "max": max(lat, default=None)},
        "ttft_s": {"p50": percentile(ttft, 50), "p95": percentile(ttft, 95)},
        "tokens": sum(o.tokens or 0 for o in ok), "tokens_known": sum(o.tokens is not None for o in ok),
    }


def group(outcomes: list[Outcome], key: Callable[[Outcome], object]) -> dict[str, dict]:
    keys = list(dict.fromkeys(key(o) for o in outcomes))
    return {str(k): summarize([o for o in outcomes if key(o) == k]) for k in sorted(keys, key=str)}


def storm_summary(results: list[Disconnect]) -> dict:
    by = Counter(d.status for d in results)
    return {"sent": len(results) - by["not_sent"], "disconnected": by["disconnected"],
            "finished_early": by["finished_early"], "rejected": by["rejected"], "errors": by["error"],
            "not_sent": by["not_sent"],
            "errors_by_kind": dict(Counter(d.kind for d in results if d.status == "error").most_common()),
            "mean_chunks_before_close": (sum(d.chunks for d in results if d.status == "disconnected")
                                         / max(1, by["disconnected"])),
            "seconds_p50": percentile([d.seconds for d in results if d.seconds is not None], 50)}


# ---- the run ----------------------------------------------------------------------------------


def _progress(name: str, total: int, quiet: bool, counts: Callable[[], str]) -> Callable[[int], None] | None:
    if quiet or total == 0:
        return None
    t0 = time.monotonic()
    step = max(1, total // 10)

    def report(done: int) -> None:
        if done % step == 0 or done == total:
            el = time.monotonic() - t0
            print(f"[{name}] {done}/{total} in {el:.0f} s ({done / max(el, 1e-9):.2f}/s) {counts()}",
                  file=sys.stderr, flush=True)
    return report


async def run_phases(base: str, args: argparse.Namespace, prompts: list[str], alive: Callable[[], bool],
                     pid: int | None = None) -> dict:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    pool = httpx.Limits(max_connections=args.concurrency + 4, max_keepalive_connections=args.concurrency + 4)
    timeout = httpx.Timeout(args.request_timeout, connect=15.0)
    result: dict = {"phases": {}}
    async with httpx.AsyncClient(base_url=base, headers=headers, limits=pool, timeout=timeout) as client, \
            httpx.AsyncClient(base_url=base, headers=headers, timeout=15.0) as probe:
        health = HealthSampler(probe, args.health_interval)
        health_task = asyncio.create_task(health.run())
        try:
            # warm-up: one short request per drafter (a drafter the server lacks stops the run here)
            t0 = time.perf_counter()
            for d in args.drafters:
                r = await client.post(PATHS["chat"], json={"model": "default", "max_tokens": 4, "temperature": 0,
                                                           "messages": [{"role": "user", "content": prompts[0]}],
                                                           "speculative": {"drafter": d}})
                if r.status_code != 200:
                    raise RuntimeError(f"warm-up request with drafter {d!r} failed: "
                                       f"HTTP {r.status_code} {r.text[:300]}")
            result["warmup_s"] = time.perf_counter() - t0
            baseline = await wait_idle(probe, None, args.idle_timeout)
            idle_kv = baseline["kv_usage"]
            result["idle"] = baseline
            before = await scrape(probe) or {}

            # soak
            health.phase = "soak"
            plan = make_plan(args.num_requests, drafters=args.drafters, temperatures=args.temperatures,
                             max_tokens=tuple(args.max_tokens), num_prompts=len(prompts),
                             logprobs_fraction=args.logprobs_fraction, usage_fraction=args.usage_fraction,
                             seed=args.seed)
            tally: Counter = Counter()

            def soak_job(p: Planned):
                async def job() -> Outcome:
                    o = await run_one(client, p, prompts[p.prompt], args.request_timeout)
                    tally[o.status] += 1
                    if o.status in ("lost", "invalid") and not args.quiet:
                        print(f"[soak] request {p.index} ({p.mode}, {p.drafter}, T={p.temperature:g}) {o.status}: "
                              f"{o.kind} {o.detail or ''}".rstrip(), file=sys.stderr, flush=True)
                    return o
                return job

            t0 = time.perf_counter()
            got = await run_pool([soak_job(p) for p in plan], args.concurrency,
                                 deadline=time.monotonic() + args.max_phase_seconds, alive=alive,
                                 progress=_progress("soak", len(plan), args.quiet,
                                                    lambda: " ".join(f"{k} {v}" for k, v in sorted(tally.items()))))
            wall = time.perf_counter() - t0
            outcomes = [o if o is not None else Outcome(index=p.index, mode=p.mode, drafter=p.drafter,
                                                        temperature=p.temperature, status="not_sent")
                        for p, o in zip(plan, got)]
            health.phase = "after soak"
            idle_soak = await wait_idle(probe, idle_kv, args.idle_timeout)
            after = await scrape(probe) or {}
            total = summarize(outcomes)
            server_tokens = counter_deltas(before, after).get("specserve_generation_tokens_total")
            result["phases"]["soak"] = {
                "wall_s": wall, "summary": total,
                "requests_per_s": total["completed"] / wall if wall else None,
                "tokens_per_s": total["tokens"] / wall if wall else None,
                "server_generation_tokens": server_tokens,
                "server_tokens_per_s": server_tokens / wall if server_tokens and wall else None,
                "by_mode": group(outcomes, lambda o: o.mode),
                "by_drafter": group(outcomes, lambda o: o.drafter),
                "by_temperature": group(outcomes, lambda o: f"{o.temperature:g}"),
                "by_cell": group(outcomes, cell_key),
                "back_to_idle": idle_soak, "server_counters": counter_deltas(before, after),
                "problems": [asdict(o) for o in outcomes if o.status in ("lost", "invalid")][:200],
                "mix": {"num_prompts": len(prompts), "max_tokens": args.max_tokens, "drafters": args.drafters,
                        "temperatures": args.temperatures, "logprobs": sum(p.logprobs for p in plan),
                        "streams_with_usage": sum(p.include_usage for p in plan),
                        **plan_coverage(plan, args.drafters, args.temperatures)},
            }

            # disconnect storm
            if args.disconnects:
                health.phase = "storm"
                rng = random.Random(args.seed + 1)
                before = after
                storm_tally: Counter = Counter()

                def storm_job(i: int, path: str, body: dict, after_chunks: int):
                    async def job() -> Disconnect:
                        d = await run_disconnect(client, i, path, body, after_chunks, args.request_timeout)
                        storm_tally[d.status] += 1
                        return d
                    return job

                storm_jobs = []
                for i in range(args.disconnects):
                    path, body = storm_body(i, prompts[rng.randrange(len(prompts))], args.drafters,
                                            args.temperatures, args.disconnect_max_tokens)
                    storm_jobs.append(storm_job(i, path, body, rng.randint(*args.disconnect_after)))
                t0 = time.perf_counter()
                got = await run_pool(storm_jobs, args.concurrency, deadline=time.monotonic() + args.max_phase_seconds,
                                     alive=alive,
                                     progress=_progress("storm", len(storm_jobs), args.quiet,
                                                        lambda: " ".join(f"{k} {v}" for k, v in
                                                                         sorted(storm_tally.items()))))
                wall = time.perf_counter() - t0
                results = [d if d is not None else Disconnect(index=i, status="not_sent") for i, d in enumerate(got)]
                health.phase = "after storm"
                idle_storm = await wait_idle(probe, idle_kv, args.idle_timeout)
                after = await scrape(probe) or {}
                deltas = counter_deltas(before, after)
                result["phases"]["storm"] = {
                    "wall_s": wall, "summary": storm_summary(results), "max_tokens": args.disconnect_max_tokens,
                    "disconnect_after_chunks": args.disconnect_after,
                    "server_aborts": deltas.get('specserve_requests_total{status="abort"}', 0.0),
                    "back_to_idle": idle_storm, "server_counters": deltas,
                }
            if args.constraint_flood:
                from specserve.bench.constraint_flood import run_constraint_flood

                health.phase = "constraints"
                before = await scrape(probe) or {}
                flood = await run_constraint_flood(client, probe, args.constraint_flood, pid)
                health.phase = "after constraints"
                flood["back_to_idle"] = await wait_idle(probe, idle_kv, args.idle_timeout)
                flood["server_counters"] = counter_deltas(before, await scrape(probe) or {})
                result["phases"]["constraints"] = flood
            health.phase = "end"
        finally:
            health.stop()
            await asyncio.wait_for(health_task, 15)
        result["health"] = health.summary()
    return result


def verdict(result: dict) -> tuple[list[str], list[str]]:
    """(what failed, what is worth a look but loses nothing); the run passed when the first is empty.
    429s are warnings: the server shed load as designed (none are expected at --concurrency below
    --max-queue-len)."""
    problems, warnings = [], []
    soak = result["phases"].get("soak")
    if soak:
        s = soak["summary"]
        for name in ("lost", "invalid", "not_sent"):
            if s[name]:
                problems.append(f"{s[name]} soak request(s) {name.replace('_', ' ')}")
        if s["rejected"]:
            warnings.append(f"{s['rejected']} soak request(s) rejected with 429 (queue full)")
        mix = soak.get("mix", {})
        if mix.get("cells") and mix.get("cells_covered", mix["cells"]) < mix["cells"]:
            warnings.append(f"the soak covered {mix['cells_covered']} of the {mix['cells']} drafter x endpoint x "
                            "stream x temperature cells (--num-requests below the number of cells)")
        if not soak["back_to_idle"]["returned"]:
            problems.append("not back to idle after the soak")
    storm = result["phases"].get("storm")
    if storm:
        s = storm["summary"]
        if s["errors"] or s["not_sent"]:
            problems.append(f"storm: {s['errors']} error(s), {s['not_sent']} not sent")
        if s["rejected"] or s["finished_early"]:
            warnings.append(f"storm: {s['rejected']} rejected with 429, {s['finished_early']} finished before the "
                            "client closed them")
        if not storm["back_to_idle"]["returned"]:
            problems.append("not back to idle after the disconnect storm")
    flood = result["phases"].get("constraints")
    if flood:
        from specserve.bench.constraint_flood import flood_verdict

        more_problems, more_warnings = flood_verdict(flood)
        problems += more_problems
        warnings += more_warnings
        if not flood["back_to_idle"]["returned"]:
            problems.append("not back to idle after the constraint flood")
    h = result.get("health", {}).get("overall", {})
    if h.get("samples") and h["ok"] != h["samples"]:
        problems.append(f"/health: {h['samples'] - h['ok']} of {h['samples']} samples not 200")
    server = result.get("server")
    if server and server.get("exit_status") != 0:
        problems.append(f"server exit status {server.get('exit_status')}"
                        + (f" ({server['signal']})" if server.get("signal") else ""))
    if result.get("error"):
        problems.append(f"run aborted: {result['error']}")
    return problems, warnings


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from specserve.bench.common import machine_info

    num_cells = len(plan_cells(args.drafters, args.temperatures))
    if args.num_requests < num_cells and not args.quiet:
        print(f"reliability: warning: {args.num_requests} soak requests cannot cover the {num_cells} drafter x "
              "endpoint x stream x temperature cells", file=sys.stderr, flush=True)

    prompts, prompt_source = load_prompt_set(args.prompts, args.num_prompts, args.max_prompt_chars)
    started = datetime.now().astimezone()
    server: ManagedServer | None = None
    result: dict = {"phases": {}}
    if args.url is None:
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        log_path = Path(tempfile.mkdtemp(prefix="specserve-reliability-")) / "server.log"
        server = ManagedServer(server_command(args, port), log_path)
        if not args.quiet:
            print(f"[server] {shlex.join(server.cmd)}  (log: {log_path})", file=sys.stderr, flush=True)
        server.start()
    else:
        base = args.url
    try:
        if server is not None:
            server.wait_ready(base, args.startup_timeout)
            if not args.quiet:
                print(f"[server] ready after {server.ready_s:.1f} s", file=sys.stderr, flush=True)
        result.update(asyncio.run(run_phases(base, args, prompts, server.alive if server else (lambda: True),
                                             server.proc.pid if server else None)))
    except (RuntimeError, httpx.HTTPError, asyncio.TimeoutError) as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
        print(f"reliability: {result['error']}", file=sys.stderr)
    finally:
        if server is not None:
            died_before = not server.alive()
            stop = server.stop(args.stop_timeout)
            result["server"] = {"command": shlex.join(server.cmd), "ready_s": server.ready_s,
                                "log": str(server.log_path), "exited_before_sigterm": died_before, **stop}
            if stop.get("exit_status") != 0 or died_before:
                result["server"]["log_tail"] = server.log_tail()

    result["meta"] = {
        "date": started.date().isoformat(), "datetime": started.isoformat(timespec="seconds"),
        "duration_s": (datetime.now().astimezone() - started).total_seconds(),
        "machine": machine_info("cpu"), "command_line": shlex.join(sys.argv),
        "invocation": shlex.join(["python", "-m", "specserve.bench.reliability",
                                  *(argv if argv is not None else sys.argv[1:])]),
        "url": base, "started_server": server is not None, "model": args.model if server else None,
        "prompts": prompt_source, "num_prompts": len(prompts),
        "num_requests": args.num_requests, "concurrency": args.concurrency, "disconnects": args.disconnects,
        "request_timeout_s": args.request_timeout, "idle_timeout_s": args.idle_timeout, "seed": args.seed,
    }
    problems, warnings = verdict(result)
    result["passed"], result["problems"], result["warnings"] = not problems, problems, warnings
    if result["passed"] and server is not None and not server.log_tail().strip():
        shutil.rmtree(server.log_path.parent, ignore_errors=True)   # an empty log of a clean run
        result["server"]["log"] = None
    result = {"benchmark": "reliability", "meta": result.pop("meta"), **result}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    json_path, md_path = (out.with_name(out.name + ext) for ext in (".json", ".md"))
    json_path.write_text(json.dumps(result, indent=2) + "\n")
    table = markdown(result)
    md_path.write_text(table)
    print(table)
    print(f"wrote {json_path}, {md_path}", file=sys.stderr)
    return 0 if result["passed"] else 1


# ---- reporting --------------------------------------------------------------------------------


def fmt(value, spec: str = ".2f") -> str:
    return "–" if value is None else format(value, spec)


def _kinds(d: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in d.items()) or "none"


def markdown(result: dict) -> str:
    meta = result["meta"]
    m = meta["machine"]
    target = (f"started `{(result.get('server') or {}).get('command', '')}`" if meta["started_server"]
              else f"server {meta['url']}")
    lines = [f"## Reliability: {meta['num_requests']} requests at {meta['concurrency']} concurrent, "
             f"{meta['disconnects']} disconnects",
             "",
             f"{meta['datetime']}; {m['platform']}, {m['cpu_count']} CPUs; {target}; "
             f"prompts: {meta['prompts']} ({meta['num_prompts']}); {meta['duration_s']:.0f} s in all.",
             "",
             f"`{meta['invocation']}`",
             "",
             "**PASS**" if result["passed"] else "**FAIL**: " + "; ".join(result["problems"]),
             ""]
    if result["warnings"]:
        lines += ["Warnings: " + "; ".join(result["warnings"]) + ".", ""]
    soak = result["phases"].get("soak")
    if soak:
        s = soak["summary"]
        lines += [f"### Soak ({soak['wall_s']:.1f} s)", "",
                  "| group | sent | ok | lost | invalid | rejected (429) | p50 s | p95 s | p99 s | TTFT p50 s "
                  "| tokens |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        rows = [("**all**", s)] + [(k, v) for k, v in soak["by_mode"].items()] \
            + [(f"drafter {k}", v) for k, v in soak["by_drafter"].items()] \
            + [(f"T = {k}", v) for k, v in soak["by_temperature"].items()]
        for name, g in rows:
            lat = g["latency_s"]
            lines.append(f"| {name} | {g['sent']} | {g['ok']} | {g['lost']} | {g['invalid']} | {g['rejected']} | "
                         f"{fmt(lat['p50'])} | {fmt(lat['p95'])} | {fmt(lat['p99'])} | {fmt(g['ttft_s']['p50'])} | "
                         f"{g['tokens']} |")
        lines += ["",
                  f"Completed {s['completed']} of {s['sent']} sent ({s['not_sent']} not sent): "
                  f"{fmt(soak['requests_per_s'])} requests/s, {fmt(soak['tokens_per_s'], '.1f')} completion tokens/s "
                  f"counted by the client ({s['tokens_known']} requests with a known count), "
                  f"{fmt(soak['server_tokens_per_s'], '.1f')} generated tokens/s by the server's counter.",
                  f"Lost: {_kinds(s['lost_by_kind'])}. Invalid: {_kinds(s['invalid_by_kind'])}. "
                  f"Rejected: {_kinds(s['rejected_by_kind'])}.",
                  ""]
        mix = soak.get("mix", {})
        if mix.get("cells"):
            lo, hi = mix["requests_per_cell"]
            cells_ok = sum(1 for g in soak.get("by_cell", {}).values() if g["sent"] and g["ok"] == g["sent"])
            lines[-1:] = [f"Cells (drafter x endpoint x stream x temperature, `by_cell` in the JSON): "
                          f"{mix['cells_covered']} of {mix['cells']} covered, {lo}–{hi} requests each; "
                          f"{cells_ok} with every request ok.", ""]
    storm = result["phases"].get("storm")
    if storm:
        s = storm["summary"]
        lo, hi = storm["disconnect_after_chunks"]
        lines += [f"### Disconnect storm ({storm['wall_s']:.1f} s)", "",
                  f"{s['sent']} streams (max_tokens {storm['max_tokens']}, EOS ignored) closed after {lo}–{hi} "
                  f"content chunks: {s['disconnected']} disconnected mid-stream, {s['finished_early']} finished first, "
                  f"{s['rejected']} rejected, {s['errors']} errors ({_kinds(s['errors_by_kind'])}); "
                  f"the server counted {storm['server_aborts']:.0f} aborts.", ""]
    flood = result["phases"].get("constraints")
    if flood:
        from specserve.bench.constraint_flood import flood_lines

        lines += flood_lines(flood)
    idle_rows = [("warm-up (idle value)", result.get("idle"))] + [
        (name, ph.get("back_to_idle")) for name, ph in result["phases"].items()]
    idle_rows = [(name, g) for name, g in idle_rows if g]
    if idle_rows:
        lines += ["### Back to idle", "", "| after | returned | seconds | running | waiting | KV usage |",
                  "|---|---|---|---|---|---|"]
    for name, g in idle_rows:
        if g:
            lines.append(f"| {name} | {'yes' if g['returned'] else '**no**'} | {g['seconds']:.2f} "
                         f"| {fmt(g['running'], '.0f')} | {fmt(g['waiting'], '.0f')} | {fmt(g['kv_usage'], '.4f')} |")
    health = result.get("health")
    if health:
        lines += ["", f"### /health (every {health['interval_s']} s)", "",
                  "| phase | samples | 200 | other status | errors | p50 ms | p99 ms | max ms |",
                  "|---|---|---|---|---|---|---|---|"]
        for name, h in list(health["by_phase"].items()) + [("**all**", health["overall"])]:
            lines.append(f"| {name} | {h['samples']} | {h['ok']} | {h['non_200']} | {h['errors']} "
                         f"| {fmt(h['p50_ms'], '.1f')} | {fmt(h['p99_ms'], '.1f')} | {fmt(h['max_ms'], '.1f')} |")
    server = result.get("server")
    if server:
        lines += ["", "### Server", "",
                  f"Ready after {fmt(server.get('ready_s'), '.1f')} s; SIGTERM at the end: exit status "
                  f"**{server.get('exit_status')}**"
                  + (f" ({server['signal']})" if server.get("signal") else "")
                  + (" after SIGKILL" if server.get("killed_after_timeout") else "")
                  + (f" after {server['seconds_to_exit']:.1f} s" if server.get("seconds_to_exit") is not None else "")
                  + (" (it had exited before)" if server.get("exited_before_sigterm") else "") + "."]
    for name, ph in result["phases"].items():
        if ph.get("server_counters"):
            lines += ["", f"Server counters over the {name}: "
                      + ", ".join(f"`{k}` +{v:g}" for k, v in ph["server_counters"].items()) + "."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
