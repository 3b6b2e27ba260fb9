"""The constraint flood of `specserve bench reliability`: heavy structured-output constraints in
flight at once, and what they cost the requests beside them.

    small chats alone -> N heavy constraints kept in flight (each answered one replaced by a new one)
    while the same small chats are timed -> back to idle

The heavy constraints (`heavy_bodies`) are the adversarial ones the server once crashed, stalled or
answered wrongly on: long `$ref` chains, thousands of chained Lark rules or optional properties,
huge repetitions, choices of 20,000-60,000 strings, a schema with no finite instance, a grammar whose
matcher fails mid-generation; each distinct (no shared compile). Each must end as a success that
keeps its constraint, a clean 400, or an explicit `constraint_failed` error (a 429 is shed load);
anything else is lost. Reported: the small unconstrained and small constrained chats' seconds,
alone and during the flood (their ratio; the goal is within 3x), /health's latency during the
flood, and the server's RSS before and after (the goal is within 200 MB of its start).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time

import httpx

PATH = "/v1/chat/completions"
SMALL = {"messages": [{"role": "user", "content": "Is the sky blue? Answer yes or no."}], "max_tokens": 8,
         "temperature": 0}
SMALL_CONSTRAINED = {**SMALL, "structured_outputs": {"regex": "(yes|no)"}}
REPEATS = 5


def _ref_chain(n: int, tag: int) -> dict:
    defs = {f"d{tag}_{i}": {"$ref": f"#/$defs/d{tag}_{i + 1}"} for i in range(n)}
    defs[f"d{tag}_{n}"] = {"type": "string", "maxLength": 8}
    return {"$defs": defs, "$ref": f"#/$defs/d{tag}_0"}


def _schema(schema: dict) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}}


def heavy_bodies(n: int, start: int = 0) -> list[tuple[str, dict, object]]:
    """n (kind, request extras, check) triples, cycling through the adversarial cases, each distinct
    (tagged by its index from `start`); `check(text)` says whether a successful answer keeps its
    constraint."""
    def is_json(pred):
        def check(text: str) -> bool:
            try:
                return pred(json.loads(text))
            except ValueError:
                return False
        return check

    cases = []
    for i in range(start, start + n):
        k = i % 8
        if k == 0:
            cases.append(("ref chain 1000", _schema(_ref_chain(1000, i)), is_json(lambda v: isinstance(v, str))))
        elif k == 1:
            rules = "\n".join(f"r{i}x{j}: r{i}x{j + 1}" for j in range(3000))
            cases.append(("lark chain 3000", {"structured_outputs": {"grammar": f"start: r{i}x0\n{rules}\n"
                                                                                f'r{i}x3000: "x"'}},
                          lambda t: t == "x"))
        elif k == 2:
            props = {f"p{i}_{j}": {"type": "integer"} for j in range(2500)}
            cases.append(("2500 optional properties", _schema({"type": "object", "properties": props}),
                          is_json(lambda v: isinstance(v, dict))))
        elif k == 3:
            cases.append(("regex a{1000000}", {"structured_outputs": {"regex": f"{i}a{{1000000}}"}},
                          lambda t: False))
        elif k == 4:
            choices = [f"c{i}_{j:05d}" for j in range(20000)]
            cases.append(("choice 20000", {"structured_outputs": {"choice": choices}},
                          lambda t, s=frozenset(choices): t in s))
        elif k == 5:
            choices = [f"w{i}_{j:05d}" for j in range(60000)]
            cases.append(("choice 60000", {"structured_outputs": {"choice": choices}},
                          lambda t, s=frozenset(choices): t in s))
        elif k == 6:
            cases.append(("$ref cycle", _schema({"$defs": {f"a{i}": {"$ref": f"#/$defs/a{i}"}},
                                                 "$ref": f"#/$defs/a{i}"}), lambda t: False))
        else:
            cases.append(("matcher error mid-generation", {"structured_outputs": {"grammar": f'start: "{i}" start'}},
                          lambda t: False))
    return cases


def rss_bytes(pid: int | None) -> int | None:
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


async def _timed(client: httpx.AsyncClient, body: dict) -> float | None:
    t0 = time.perf_counter()
    r = await client.post(PATH, json=body)
    return time.perf_counter() - t0 if r.status_code == 200 else None


async def _small_times(client: httpx.AsyncClient) -> dict[str, float | None]:
    """The median seconds of each small chat, the two kinds interleaved (both see the same load)."""
    times: dict[str, list[float]] = {"unconstrained": [], "constrained": []}
    for _ in range(REPEATS):
        for name, body in (("unconstrained", SMALL), ("constrained", SMALL_CONSTRAINED)):
            t = await _timed(client, body)
            if t is not None:
                times[name].append(t)
    return {name: statistics.median(ts) if ts else None for name, ts in times.items()}


def _outcome(r: httpx.Response | BaseException, check) -> str:
    if isinstance(r, BaseException):
        return "lost"
    if r.status_code == 429:
        return "rejected"
    if r.status_code == 400:
        code = (r.json().get("error") or {}).get("code")
        return "constraint_failed" if code == "constraint_failed" else "refused"
    if r.status_code != 200:
        return "lost"
    choice = r.json()["choices"][0]
    if choice["finish_reason"] == "stop" and not check(choice["message"]["content"] or ""):
        return "invalid"
    return "ok"


async def run_constraint_flood(client: httpx.AsyncClient, probe: httpx.AsyncClient, n: int,
                               pid: int | None) -> dict:
    await _small_times(client)                       # warm: the regex compiled and cached, the lanes started
    rss_start = rss_bytes(pid)
    alone = await _small_times(client)
    answered: list[tuple[str, str]] = []             # (case, outcome) of every heavy request
    counter = iter(range(10 ** 9))
    stop = asyncio.Event()

    async def keep_one_in_flight() -> None:
        while not stop.is_set():
            (kind, extra, check), = heavy_bodies(1, next(counter))
            try:
                r = await client.post(PATH, json={**SMALL, "max_tokens": 16, **extra})
            except httpx.HTTPError as exc:
                r = exc
            answered.append((kind, _outcome(r, check)))

    t0 = time.perf_counter()
    workers = [asyncio.ensure_future(keep_one_in_flight()) for _ in range(n)]
    await asyncio.sleep(1.0)                         # the flood under way
    during = await _small_times(client)
    health_ms = []
    for _ in range(REPEATS):
        h0 = time.perf_counter()
        await probe.get("/health")
        health_ms.append(1000 * (time.perf_counter() - h0))
    measured_s = time.perf_counter() - t0
    stop.set()
    await asyncio.gather(*workers)
    wall = time.perf_counter() - t0
    outcomes = [o for _, o in answered]
    by_case: dict[str, dict[str, int]] = {}
    for kind, o in answered:
        by_case.setdefault(kind, {}).setdefault(o, 0)
        by_case[kind][o] += 1
    await asyncio.sleep(2.0)
    rss_end = rss_bytes(pid)
    ratios = {k: (during[k] / alone[k] if during.get(k) and alone.get(k) else None) for k in alone}
    return {"wall_s": wall, "measured_s": measured_s, "num_in_flight": n, "num_heavy": len(answered),
            "alone_s": alone, "during_s": during, "ratio": ratios, "health_ms_during": health_ms,
            "outcomes": {o: outcomes.count(o) for o in sorted(set(outcomes))}, "by_case": by_case,
            "rss_start_bytes": rss_start, "rss_end_bytes": rss_end,
            "rss_growth_bytes": rss_end - rss_start if rss_start is not None and rss_end is not None else None}


def flood_verdict(phase: dict) -> tuple[list[str], list[str]]:
    problems, warnings = [], []
    o = phase["outcomes"]
    if o.get("lost") or o.get("invalid"):
        problems.append(f"constraint flood: {o.get('lost', 0)} lost, {o.get('invalid', 0)} successes that broke "
                        "their constraint")
    for name, ratio in phase["ratio"].items():
        if ratio is None:
            problems.append(f"constraint flood: the small {name} chat failed")
        elif ratio > 3:
            warnings.append(f"constraint flood: the small {name} chat took {ratio:.1f}x its time alone (goal 3x)")
    growth = phase.get("rss_growth_bytes")
    if growth is not None and growth > 200 * 1024 ** 2:
        warnings.append(f"constraint flood: the server's RSS grew {growth / 1024 ** 2:.0f} MB (goal 200 MB)")
    return problems, warnings


def flood_lines(phase: dict) -> list[str]:
    def s(v):
        return "n/a" if v is None else f"{v:.2f}"

    mb = (lambda b: "n/a" if b is None else f"{b / 1024 ** 2:.0f}")
    lines = [f"### Constraint flood ({phase['wall_s']:.1f} s)", "",
             f"{phase['num_in_flight']} heavy constraints kept in flight for {phase['measured_s']:.1f} s, "
             f"{phase['num_heavy']} answered: " + ", ".join(f"{k} {v}" for k, v in phase["outcomes"].items()) + ".",
             "", f"| small chat (median of {REPEATS}) | alone s | during the flood s | ratio |", "|---|---|---|---|"]
    for name in phase["alone_s"]:
        lines.append(f"| {name} | {s(phase['alone_s'][name])} | {s(phase['during_s'][name])} "
                     f"| {s(phase['ratio'][name])} |")
    lines += ["", f"/health during the flood: {', '.join(f'{v:.0f}' for v in phase['health_ms_during'])} ms. "
                  f"Server RSS {mb(phase['rss_start_bytes'])} MB before, {mb(phase['rss_end_bytes'])} MB 2 s after "
                  f"(growth {mb(phase['rss_growth_bytes'])} MB).", "",
              "| case | outcomes |", "|---|---|"]
    lines += [f"| {kind} | {', '.join(f'{k} {v}' for k, v in c.items())} |" for kind, c in phase["by_case"].items()]
    return lines + [""]
