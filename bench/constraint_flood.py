"""The constraint flood of `specserve bench reliability`: heavy structured-output constraints in
flight at once, and what they cost the requests beside them.

    small chats alone -> N plain requests kept in flight while the same small chats are timed (the
    control) -> N heavy constraints kept in flight (each answered one replaced by a new one), the
    small chats timed again -> back to idle

The heavy constraints (`heavy_bodies`) are the adversarial ones the server once crashed, stalled or
answered wrongly on: long `$ref` chains, thousands of chained Lark rules or optional properties,
huge repetitions, choices of 20,000-60,000 strings, a schema with no finite instance, a grammar whose
matcher fails mid-generation; each distinct (no shared compile). Each must end as a success that
keeps its constraint, a clean 400, or an explicit `constraint_failed` error (a 429 is shed load);
anything else is lost. Reported: the small unconstrained and small constrained chats' seconds,
alone, during a plain control flood (as many unconstrained requests of the same size in flight:
what N more clients cost on this machine) and during the constraint flood; the constraints' own
cost is the constraint flood against the control (goal: within the noise), /health's latency
during the floods, and the server's RSS before and after (the goal is within 200 MB of its start).
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
CONTROL_NOISE = 1.25   # the constraint flood against the plain one: within this machine's run-to-run noise


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


def _heavy(i: int) -> tuple[str, dict, object]:
    (kind, extra, check), = heavy_bodies(1, i)
    return kind, {**SMALL, "max_tokens": 16, **extra}, check


def _control(i: int) -> tuple[str, dict, object]:
    return "unconstrained", {**SMALL, "max_tokens": 16}, lambda t: True


async def _flood(client: httpx.AsyncClient, probe: httpx.AsyncClient, n: int, request_of) -> dict:
    """n requests kept in flight (`request_of(i)`: the i-th one's (case, body, check)) while the small
    chats and /health are timed."""
    answered: list[tuple[str, str]] = []             # (case, outcome) of every flood request
    counter = iter(range(10 ** 9))
    stop = asyncio.Event()

    async def keep_one_in_flight() -> None:
        while not stop.is_set():
            kind, body, check = request_of(next(counter))
            try:
                r = await client.post(PATH, json=body)
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
    return {"during": during, "health_ms": health_ms, "measured_s": measured_s, "answered": answered,
            "wall_s": time.perf_counter() - t0}


def _ratios(during: dict, alone: dict) -> dict:
    return {k: (during[k] / alone[k] if during.get(k) and alone.get(k) else None) for k in alone}


async def run_constraint_flood(client: httpx.AsyncClient, probe: httpx.AsyncClient, n: int,
                               pid: int | None, control: bool = True) -> dict:
    """The flood phase. `control`: first the same flood of plain requests (same prompt, max_tokens and
    number in flight, no constraint), so that what the constraints themselves cost the small chats
    stands apart from what n more clients cost them on this machine."""
    await _small_times(client)                       # warm: the regex compiled and cached, the lanes started
    rss_start = rss_bytes(pid)
    alone = await _small_times(client)
    plain = await _flood(client, probe, n, _control) if control else None
    if plain is not None:
        await asyncio.sleep(2.0)
    rss_flood = rss_bytes(pid)                       # after the control: the constraint flood's own start
    flood = await _flood(client, probe, n, _heavy)
    outcomes = [o for _, o in flood["answered"]]
    by_case: dict[str, dict[str, int]] = {}
    for kind, o in flood["answered"]:
        by_case.setdefault(kind, {}).setdefault(o, 0)
        by_case[kind][o] += 1
    await asyncio.sleep(2.0)
    rss_end = rss_bytes(pid)
    during = flood["during"]
    result = {"wall_s": flood["wall_s"], "measured_s": flood["measured_s"], "num_in_flight": n,
              "num_heavy": len(flood["answered"]), "alone_s": alone, "during_s": during,
              "ratio": _ratios(during, alone), "health_ms_during": flood["health_ms"],
              "outcomes": {o: outcomes.count(o) for o in sorted(set(outcomes))}, "by_case": by_case,
              "rss_start_bytes": rss_start, "rss_flood_start_bytes": rss_flood, "rss_end_bytes": rss_end,
              "rss_growth_bytes": rss_end - rss_flood if rss_flood is not None and rss_end is not None else None,
              "rss_growth_from_start_bytes":
                  rss_end - rss_start if rss_start is not None and rss_end is not None else None}
    if plain is not None:
        plain_outcomes = [o for _, o in plain["answered"]]
        result["control"] = {
            "wall_s": plain["wall_s"], "num_answered": len(plain["answered"]),
            "outcomes": {o: plain_outcomes.count(o) for o in sorted(set(plain_outcomes))},
            "during_s": plain["during"], "ratio": _ratios(plain["during"], alone),
            "health_ms_during": plain["health_ms"]}
        result["ratio_to_control"] = _ratios(during, plain["during"])
    return result


def flood_verdict(phase: dict) -> tuple[list[str], list[str]]:
    problems, warnings = [], []
    o = phase["outcomes"]
    if o.get("lost") or o.get("invalid"):
        problems.append(f"constraint flood: {o.get('lost', 0)} lost, {o.get('invalid', 0)} successes that broke "
                        "their constraint")
    to_control = phase.get("ratio_to_control")
    for name, ratio in phase["ratio"].items():
        if ratio is None:
            problems.append(f"constraint flood: the small {name} chat failed")
        elif to_control is not None:     # the constraints' own cost: against the same plain load, in the noise
            r = to_control.get(name)
            if r is None:
                problems.append(f"constraint flood: the small {name} chat failed under the plain control flood")
            elif r > CONTROL_NOISE:
                warnings.append(f"constraint flood: the small {name} chat took {r:.2f}x its time under the same "
                                f"plain load (goal {CONTROL_NOISE}x)")
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
    control = phase.get("control")
    if control is not None:
        lines[-2:] = [f"| small chat (median of {REPEATS}) | alone s | {phase['num_in_flight']} plain in flight s "
                      f"| {phase['num_in_flight']} heavy constraints in flight s | heavy / alone | heavy / plain |",
                      "|---|---|---|---|---|---|"]
    for name in phase["alone_s"]:
        if control is None:
            lines.append(f"| {name} | {s(phase['alone_s'][name])} | {s(phase['during_s'][name])} "
                         f"| {s(phase['ratio'][name])} |")
        else:
            lines.append(f"| {name} | {s(phase['alone_s'][name])} | {s(control['during_s'][name])} "
                         f"| {s(phase['during_s'][name])} | {s(phase['ratio'][name])} "
                         f"| {s(phase['ratio_to_control'][name])} |")
    if control is not None:
        lines += ["", f"The plain control flood (the same prompt and max_tokens, no constraint) ran first: "
                      f"{control['num_answered']} answered in {control['wall_s']:.1f} s "
                      f"({', '.join(f'{k} {v}' for k, v in control['outcomes'].items())}); "
                      f"/health during it {', '.join(f'{v:.0f}' for v in control['health_ms_during'])} ms. "
                      f"The constraints' own cost is the last column (goal: within {CONTROL_NOISE}x, the noise)."]
    lines += ["", f"/health during the flood: {', '.join(f'{v:.0f}' for v in phase['health_ms_during'])} ms. "
                  f"Server RSS {mb(phase.get('rss_flood_start_bytes', phase['rss_start_bytes']))} MB before the "
                  f"constraint flood, {mb(phase['rss_end_bytes'])} MB 2 s after (growth "
                  f"{mb(phase['rss_growth_bytes'])} MB; {mb(phase['rss_start_bytes'])} MB before the control "
                  f"flood).", "",
              "| case | outcomes |", "|---|---|"]
    lines += [f"| {kind} | {', '.join(f'{k} {v}' for k, v in c.items())} |" for kind, c in phase["by_case"].items()]
    return lines + [""]
