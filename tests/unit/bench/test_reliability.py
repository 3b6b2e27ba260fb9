"""The reliability script's pure parts: options, the request mix and its bodies (accepted by the server's
own schemas), the response checks (on made-up bodies and SSE lines, and through httpx's mock transport),
/metrics parsing, the summary arithmetic and the verdict. No server runs here."""

from __future__ import annotations

import ast
import asyncio
import importlib.metadata
import json
import re
import subprocess
import sys
from collections import Counter
from itertools import product
from pathlib import Path

import httpx
import pytest

from specserve.bench import reliability as rel
from specserve.server import cli
from specserve.server.protocol import ChatCompletionRequest, CompletionRequest


def planned(**kw) -> rel.Planned:
    base = dict(index=0, endpoint="chat", stream=False, temperature=0.0, drafter="ngram", max_tokens=8,
                logprobs=False, include_usage=False, prompt=0)
    base.update(kw)
    return rel.Planned(**base)


def usage(completion: int, prompt: int = 5) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def chunk(text: str | None = None, finish: str | None = None, *, n_logprobs: int = 0, completions: bool = False) -> str:
    lp = {"content": [{"token": "x", "logprob": -1.0}] * n_logprobs} if n_logprobs else None
    if completions:
        lp = {"tokens": ["x"] * n_logprobs} if n_logprobs else None
        choice = {"index": 0, "text": text or "", "logprobs": lp, "finish_reason": finish}
    else:
        choice = {"index": 0, "delta": {"content": text} if text is not None else {}, "logprobs": lp,
                  "finish_reason": finish}
    return "data: " + json.dumps({"id": "x", "choices": [choice]})


def usage_chunk(completion: int, drafter: str | None = None) -> str:
    body = {"id": "x", "choices": [], "usage": usage(completion)}
    if drafter:
        body["speculative"] = {"drafter": drafter}
    return "data: " + json.dumps(body)


# ---- options ----------------------------------------------------------------------------------


def test_defaults_and_server_command():
    args = rel.parse_args([])
    assert (args.num_requests, args.concurrency, args.disconnects) == (2000, 32, 200)
    assert args.drafters == ["none", "ngram", "mag"] and args.temperatures == [0.0, 0.7, 1.0]
    assert args.url is None and args.max_tokens == [8, 32]
    cmd = rel.server_command(rel.parse_args(["--model", "m", "--server-args", "--max-num-seqs 32 --log-level info"]),
                             1234)
    assert cmd[1:] == ["-m", "specserve.server", "serve", "--model", "m", "--drafter", "none", "--drafter", "ngram",
                       "--drafter", "mag", "--host", "127.0.0.1", "--port", "1234", "--log-level", "warning",
                       "--max-num-seqs", "32", "--log-level", "info"]
    assert rel.parse_args(["--url", "http://127.0.0.1:8000/"]).url == "http://127.0.0.1:8000"


@pytest.mark.parametrize("bad", [["--concurrency", "0"], ["--max-tokens", "9", "8"], ["--logprobs-fraction", "2"],
                                 ["--disconnect-after", "1", "600"], ["--num-requests", "-1"]])
def test_bad_options_exit(bad):
    with pytest.raises(SystemExit):
        rel.parse_args(bad)


def test_listed_as_a_benchmark():
    assert cli.BENCHMARKS["reliability"][0] == "specserve.bench.reliability"


# ---- the mix ----------------------------------------------------------------------------------


def test_plan_covers_every_combination_and_is_reproducible():
    kw = dict(drafters=["none", "ngram", "mag"], temperatures=[0.0, 0.7, 1.0], max_tokens=(8, 32), num_prompts=5,
              logprobs_fraction=0.5, usage_fraction=0.75, seed=3)
    plan = rel.make_plan(72, **kw)
    combos = Counter((p.endpoint, p.stream, p.temperature, p.drafter) for p in plan)
    assert len(combos) == 36 and set(combos.values()) == {2}
    assert all(8 <= p.max_tokens <= 32 and 0 <= p.prompt < 5 for p in plan)
    assert not any(p.include_usage and not p.stream for p in plan)
    assert [p.index for p in plan] == list(range(72))
    assert plan == rel.make_plan(72, **kw)
    small = rel.make_plan(8, **kw)
    assert set(Counter(p.mode for p in small).values()) == {2}


FOUR = ["none", "ngram", "mag", "eagle"]


def test_plan_covers_every_cell_with_four_drafters():
    """Four drafters x 2 endpoints x 2 stream modes x 3 temperatures = 48 cells: 48 requests hold each
    once, 1,000 hold each 20 or 21 times -- where the old mix (mode i mod 4, pair i mod 12) tied each
    drafter to one endpoint x stream mode and covered only 12 of them."""
    kw = dict(drafters=FOUR, temperatures=[0.0, 0.7, 1.0], max_tokens=(8, 32), num_prompts=5,
              logprobs_fraction=0.5, usage_fraction=0.75, seed=0)
    every = set(product(rel.ENDPOINTS, (False, True), (0.0, 0.7, 1.0), FOUR))
    assert set(rel.plan_cells(FOUR, [0.0, 0.7, 1.0])) == every and len(rel.plan_cells(FOUR, [0.0, 0.7, 1.0])) == 48
    for n, counts in ((48, {1}), (96, {2}), (1000, {20, 21})):
        plan = rel.make_plan(n, **kw)
        cells = Counter((p.endpoint, p.stream, p.temperature, p.drafter) for p in plan)
        assert set(cells) == every and set(cells.values()) == counts, (n, cells)
        cover = rel.plan_coverage(plan, FOUR, [0.0, 0.7, 1.0])
        assert cover == {"cells": 48, "cells_covered": 48, "requests_per_cell": [min(counts), max(counts)],
                         "missing_cells": []}
        for d in FOUR:   # each drafter meets every endpoint x stream mode, not one
            assert {(p.endpoint, p.stream) for p in plan if p.drafter == d} == set(product(rel.ENDPOINTS, (False, True)))
    # the control: the old mix, judged by the same check, misses 36 cells
    modes, pairs = list(product(rel.ENDPOINTS, (False, True))), list(product([0.0, 0.7, 1.0], FOUR))
    old = [(*modes[i % 4], *pairs[i % 12]) for i in range(1000)]
    assert len(set(old)) == 12 and len(every - set(old)) == 36
    # too few requests to cover them all: reported, and the verdict warns
    short = rel.make_plan(40, **kw)
    cover = rel.plan_coverage(short, FOUR, [0.0, 0.7, 1.0])
    assert cover["cells_covered"] == 40 and cover["requests_per_cell"] == [0, 1] and len(cover["missing_cells"]) == 8
    soak = {"wall_s": 1.0, "summary": rel.summarize([]), "back_to_idle": {"returned": True}, "mix": cover}
    _, warnings = rel.verdict({"phases": {"soak": soak}})
    assert warnings == ["the soak covered 40 of the 48 drafter x endpoint x stream x temperature cells "
                        "(--num-requests below the number of cells)"]


def test_storm_covers_every_cell():
    bodies = [rel.storm_body(i, "hello", FOUR, [0.0, 1.0], 512) for i in range(16)]
    cells = {(path, b["temperature"], b["speculative"]["drafter"]) for path, b in bodies}
    assert cells == set(product(rel.PATHS.values(), (0.0, 1.0), FOUR))
    assert all(b["stream"] and b["ignore_eos"] for _, b in bodies)


# ---- a plain install --------------------------------------------------------------------------


def _requirement_name(spec: str) -> str:
    return re.split(r"[<>=!~;\[ ]", spec, maxsplit=1)[0].strip().lower().replace("_", "-")


def test_imports_are_main_or_bench_dependencies():
    """Every third-party module the reliability bench imports at module level comes from a distribution in
    [project].dependencies or the [bench] extra, and the `specserve` command's from the main dependencies only
    (so that a plain install runs `specserve serve`; `specserve bench` names the extra it lacks)."""
    tomllib = pytest.importorskip("tomllib")   # Python 3.11+
    root = Path(__file__).resolve().parents[3]
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    main_deps = {_requirement_name(d) for d in project["dependencies"]}
    extras = project["optional-dependencies"]
    bench_deps = {_requirement_name(d) for d in extras["bench"]}
    dists = importlib.metadata.packages_distributions()
    for source, allowed in ((root / "bench" / "reliability.py", main_deps | bench_deps),
                            (root / "server" / "cli.py", main_deps)):
        tree = ast.parse(source.read_text())
        modules = {a.name.split(".")[0] for n in tree.body if isinstance(n, ast.Import) for a in n.names}
        modules |= {n.module.split(".")[0] for n in tree.body
                    if isinstance(n, ast.ImportFrom) and n.module and not n.level}
        third_party = modules - set(sys.stdlib_module_names) - {"specserve", "__future__"}
        for module in sorted(third_party):
            names = {_requirement_name(d) for d in dists.get(module, [module])}
            assert names & allowed, f"{source.name} imports {module} ({names}), not an allowed dependency"
    assert "httpx" in bench_deps and "httpx" not in main_deps
    assert any(d.replace(" ", "").startswith("specserve[") and "bench" in d for d in extras["dev"])

BLOCK = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, Block())
from specserve.server.cli import main
raise SystemExit(main(["bench", "reliability", "--help"]))
"""


@pytest.mark.parametrize("blocked, rc", [({"openai", "pytest", "matplotlib", "schemathesis"}, 0),
                                         ({"httpx"}, 2)])
def test_help_without_the_dev_extra(blocked, rc):
    """`specserve bench reliability --help` with the dev extra's packages unimportable prints the
    help; the control without httpx exits 2 naming the package and the extra (not a traceback)."""
    r = subprocess.run([sys.executable, "-c", BLOCK.format(blocked=sorted(blocked))], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == rc, r.stderr
    if rc == 0:
        assert "--drafters" in r.stdout and "--disconnects" in r.stdout
    else:
        assert "'httpx'" in r.stderr and "specserve[bench]" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("endpoint, stream, logprobs, include_usage",
                         [("chat", False, True, False), ("chat", True, False, True),
                          ("completions", False, False, False), ("completions", True, True, True)])
def test_bodies_pass_the_servers_schemas(endpoint, stream, logprobs, include_usage):
    p = planned(endpoint=endpoint, stream=stream, logprobs=logprobs, include_usage=include_usage, temperature=0.7)
    body = rel.request_body(p, "hello")
    model = (ChatCompletionRequest if endpoint == "chat" else CompletionRequest).model_validate(body)
    assert model.speculative.drafter == "ngram" and model.max_tokens == 8 and bool(model.stream) == stream
    assert model.include_usage == include_usage
    assert (model.num_logprobs if endpoint == "chat" else model.logprobs) == (0 if logprobs else None)
    for i in range(4):
        path, body = rel.storm_body(i, "hello", ["none", "mag"], [0.0, 1.0], 512)
        schema = ChatCompletionRequest if path == rel.PATHS["chat"] else CompletionRequest
        assert schema.model_validate(body).ignore_eos


# ---- checks -----------------------------------------------------------------------------------


def test_check_counts():
    p = planned(max_tokens=8)
    assert rel.check_counts(p, "length", usage(8), 8, 3, usage_expected=True) is None
    assert rel.check_counts(p, "stop", usage(3), None, 3, usage_expected=True) is None
    assert rel.check_counts(p, "stop", None, None, usage_expected=True) == "missing_usage"
    assert rel.check_counts(p, "stop", None, 4, usage_expected=False) is None
    assert rel.check_counts(p, "length", usage(7), None, usage_expected=True) == "length_short_of_max_tokens"
    assert rel.check_counts(p, "stop", usage(9), None, usage_expected=True) == "over_max_tokens"
    assert rel.check_counts(p, "stop", usage(5), 4, usage_expected=True) == "token_count_mismatch"
    assert rel.check_counts(p, "stop", usage(2), None, 3, usage_expected=True) == "more_chunks_than_tokens"
    bad_total = dict(usage(3), total_tokens=7)
    assert rel.check_counts(p, "stop", bad_total, None, usage_expected=True) == "usage_total_mismatch"
    assert rel.check_counts(p, "length", None, 7, usage_expected=False) == "length_short_of_max_tokens"


def test_check_full():
    p = planned(logprobs=True, max_tokens=4)
    body = {"choices": [{"message": {"content": "abc"}, "finish_reason": "length",
                         "logprobs": {"content": [{}] * 4}}], "usage": usage(4), "speculative": {"drafter": "ngram"}}
    assert rel.check_full(p, body) == (None, None, 4, 4)
    body["choices"][0]["logprobs"]["content"] = [{}] * 3
    assert rel.check_full(p, body)[1] == "token_count_mismatch"
    body["speculative"]["drafter"] = "mag"
    body["choices"][0]["logprobs"]["content"] = [{}] * 4
    assert rel.check_full(p, body)[1] == "wrong_drafter"
    assert rel.check_full(p, {"choices": [{"message": {"content": ""}, "finish_reason": None}]})[0] == \
        "missing_finish_reason"
    assert rel.check_full(p, {"choices": [{"message": {"content": ""}, "finish_reason": "abort"}]})[0] == "finish_abort"
    assert rel.check_full(p, {"choices": []})[0] == "bad_choices"
    c = planned(endpoint="completions", max_tokens=4)
    assert rel.check_full(c, {"choices": [{"text": "a", "finish_reason": "stop"}], "usage": usage(1)}) == \
        (None, None, 1, None)


def feed(p: rel.Planned, lines: list[str]) -> rel.StreamCheck:
    check = rel.StreamCheck(p)
    for line in lines:
        check.feed(line)
        check.feed("")
    return check


def test_stream_check_complete_streams():
    p = planned(stream=True, include_usage=True, logprobs=True, max_tokens=4)
    ok = [chunk(""), chunk("a", n_logprobs=2), chunk("b", n_logprobs=2), chunk(None, "length"),
          usage_chunk(4, "ngram"), "data: [DONE]"]
    check = feed(p, ok)
    assert check.verdict() == (None, None) and check.content_chunks == 2 and check.logprob_entries == 4
    assert check.ttft_s is not None
    c = planned(endpoint="completions", stream=True, max_tokens=4)
    assert feed(c, [chunk("a", completions=True), chunk("", "stop", completions=True), "data: [DONE]"]).verdict() \
        == (None, None)


@pytest.mark.parametrize("lines, expected", [
    ([chunk("a"), chunk(None, "stop"), usage_chunk(1)], ("missing_done", None)),
    ([chunk("a"), usage_chunk(1), "data: [DONE]"], ("missing_finish_reason", None)),
    ([chunk("a"), 'data: {"error": {"message": "boom", "code": "request_failed"}}', "data: [DONE]"],
     ("error_event:request_failed", None)),
    ([chunk("a"), "data: {not json", "data: [DONE]"], ("bad_json", None)),
    ([chunk("a"), chunk(None, "stop"), usage_chunk(1), "data: [DONE]", chunk("late")], ("data_after_done", None)),
    ([chunk("a"), "event: weird", chunk(None, "stop"), usage_chunk(1), "data: [DONE]"], ("bad_sse_line", None)),
    ([chunk("a"), chunk(None, "abort"), usage_chunk(1), "data: [DONE]"], ("finish_abort", None)),
    ([chunk("a"), chunk(None, "stop"), "data: [DONE]"], (None, "missing_usage")),
    ([chunk("a", n_logprobs=1), chunk(None, "stop"), usage_chunk(2), "data: [DONE]"], (None, "token_count_mismatch")),
    ([chunk("a", "stop"), chunk(None, "stop"), usage_chunk(1), "data: [DONE]"], (None, "several_finish_reasons")),
    ([chunk("a", n_logprobs=1), chunk(None, "stop"), usage_chunk(1, "mag"), "data: [DONE]"], (None, "wrong_drafter")),
])
def test_stream_check_failures(lines, expected):
    p = planned(stream=True, include_usage=True, logprobs=True, max_tokens=8)
    assert feed(p, lines).verdict() == expected


def test_run_one_through_a_mock_transport():
    """The real client path (httpx, SSE lines, statuses, transport errors) against canned responses."""
    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        prompt = body.get("prompt") or body["messages"][0]["content"]
        if prompt == "full":
            return httpx.Response(429, json={"error": {"message": "queue full", "code": "queue_full"}})
        if prompt == "crash":
            return httpx.Response(500, json={"error": {"message": "x", "code": "request_failed"}})
        if prompt == "refuse":
            raise httpx.ConnectError("refused")
        lines = [chunk("hi"), chunk(None, "stop"), usage_chunk(1)]
        if prompt != "truncated":
            lines.append("data: [DONE]")
        return httpx.Response(200, text="".join(line + "\n\n" for line in lines),
                              headers={"content-type": "text/event-stream"})

    async def go(prompt: str) -> rel.Outcome:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://test") as client:
            return await rel.run_one(client, planned(stream=True, include_usage=True), prompt, 5)

    got = {p: asyncio.run(go(p)) for p in ("ok", "full", "crash", "refuse", "truncated")}
    assert (got["ok"].status, got["ok"].completion_tokens, got["ok"].http_status) == ("ok", 1, 200)
    assert got["ok"].latency_s is not None
    assert (got["full"].status, got["full"].kind) == ("rejected", "http_429:queue_full")
    assert (got["crash"].status, got["crash"].kind) == ("lost", "http_500:request_failed")
    assert (got["refuse"].status, got["refuse"].kind) == ("lost", "connect_error")
    assert (got["truncated"].status, got["truncated"].kind) == ("lost", "missing_done")


def test_run_pool_bounds_concurrency_and_stops():
    running, peak = 0, 0

    def job(i):
        async def run():
            nonlocal running, peak
            running += 1
            peak = max(peak, running)
            await asyncio.sleep(0.001)
            running -= 1
            return i
        return run

    got = asyncio.run(rel.run_pool([job(i) for i in range(20)], 3, deadline=float("inf"), alive=lambda: True))
    assert got == list(range(20)) and peak == 3
    assert asyncio.run(rel.run_pool([job(i) for i in range(5)], 2, deadline=0.0, alive=lambda: True)) == [None] * 5


# ---- metrics and summaries --------------------------------------------------------------------


METRICS = """\
# HELP specserve_num_requests_running Sequences in the running batch.
# TYPE specserve_num_requests_running gauge
specserve_num_requests_running 0.0
specserve_num_requests_waiting 2.0
specserve_kv_cache_usage_ratio 0.125
specserve_requests_total{status="stop"} 10.0
specserve_requests_total{status="abort"} 3.0
specserve_model_info{max_model_len="8192",model="SmolLM2 {x}"} 1.0
"""


def test_parse_prometheus_and_deltas():
    m = rel.parse_prometheus(METRICS)
    assert rel.idle_gauges(m) == {"running": 0.0, "waiting": 2.0, "kv_usage": 0.125}
    assert m['specserve_requests_total{status="abort"}'] == 3.0
    assert m['specserve_model_info{max_model_len="8192",model="SmolLM2 {x}"}'] == 1.0
    later = dict(m, **{'specserve_requests_total{status="abort"}': 5.0, "specserve_generation_tokens_total": 7.0})
    assert rel.counter_deltas(m, later) == {"specserve_generation_tokens_total": 7.0,
                                            'specserve_requests_total{status="abort"}': 2.0}


def test_percentile():
    assert rel.percentile([], 50) is None
    assert rel.percentile([3.0], 99) == 3.0
    assert rel.percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert rel.percentile(list(map(float, range(101))), 95) == 95.0
    assert rel.percentile([1.0, 2.0], 100) == 2.0


def outcome(status: str, kind: str | None = None, latency: float = 1.0, tokens: int | None = 4, **kw) -> rel.Outcome:
    return rel.Outcome(index=0, mode=kw.get("mode", "chat full"), drafter=kw.get("drafter", "none"), temperature=0.0,
                       status=status, kind=kind, latency_s=latency, completion_tokens=tokens)


def test_summarize_and_group():
    outs = [outcome("ok", latency=1.0), outcome("ok", latency=3.0, tokens=None), outcome("lost", "timeout"),
            outcome("invalid", "missing_usage", mode="chat stream"), outcome("rejected", "http_429:queue_full"),
            outcome("not_sent")]
    s = rel.summarize(outs)
    assert (s["sent"], s["ok"], s["lost"], s["invalid"], s["rejected"], s["not_sent"], s["completed"]) == \
        (5, 2, 1, 1, 1, 1, 3)
    assert s["lost_by_kind"] == {"timeout": 1} and s["invalid_by_kind"] == {"missing_usage": 1}
    assert s["latency_s"]["p50"] == 2.0 and s["latency_s"]["max"] == 3.0
    assert (s["tokens"], s["tokens_known"]) == (4, 1)
    by_mode = rel.group(outs, lambda o: o.mode)
    assert set(by_mode) == {"chat full", "chat stream"} and by_mode["chat stream"]["invalid"] == 1


def test_verdict_and_markdown():
    soak = {"wall_s": 10.0, "summary": rel.summarize([outcome("ok"), outcome("rejected", "http_429")]),
            "requests_per_s": 0.1, "tokens_per_s": 0.4, "server_tokens_per_s": 0.5,
            "by_mode": {}, "by_drafter": {}, "by_temperature": {},
            "back_to_idle": {"returned": True, "seconds": 0.1, "running": 0, "waiting": 0, "kv_usage": 0.0},
            "server_counters": {"specserve_generation_tokens_total": 5.0}}
    result = {"phases": {"soak": soak}, "idle": soak["back_to_idle"],
              "health": {"interval_s": 0.5, "overall": rel.health_stats([("soak", 200, 0.01)] * 3),
                         "by_phase": {"soak": rel.health_stats([("soak", 200, 0.01)] * 3)}},
              "server": {"command": "specserve serve", "exit_status": 0, "ready_s": 1.0, "seconds_to_exit": 2.0}}
    problems, warnings = rel.verdict(result)
    assert problems == [] and warnings == ["1 soak request(s) rejected with 429 (queue full)"]
    result["server"].update(exit_status=143, signal="SIGTERM")
    result["health"]["overall"] = rel.health_stats([("soak", 200, 0.01)] * 2 + [("soak", None, 10.0)])
    problems, _ = rel.verdict(result)
    assert problems == ["/health: 1 of 3 samples not 200", "server exit status 143 (SIGTERM)"]
    result.update(passed=False, problems=problems, warnings=warnings,
                  meta={"num_requests": 2, "concurrency": 1, "disconnects": 0, "datetime": "now", "duration_s": 1.0,
                        "machine": {"platform": "p", "cpu_count": 2}, "started_server": True, "url": "u",
                        "prompts": "builtin", "num_prompts": 12, "invocation": "python -m ..."})
    md = rel.markdown(result)
    assert "| **all** | 3 | 2 | 0 | 1 | 10.0 |" in md and "| 10000.0 |" in md
    assert "**FAIL**" in md and "exit status **143** (SIGTERM)" in md and "| **all** | 2 | 1 | 0 | 0 | 1 |" in md
