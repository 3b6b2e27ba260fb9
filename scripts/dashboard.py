"""The Grafana dashboard without Grafana: evaluate its panels on a Prometheus and draw them with matplotlib.

``deploy/grafana/specserve.json`` is the dashboard; Grafana itself is not needed to see it. This script reads
the JSON, substitutes the template variables (``$drafter``, ``$__rate_interval``, ``$__range``), queries a
Prometheus for every panel over a time range and lays the panels out on their grid in one PNG::

    # an existing Prometheus that scrapes a specserve server
    python scripts/dashboard.py render --prometheus http://127.0.0.1:9090 --last 15m --out docs/dashboard.png

    # all in one: serve a model with the none/ngram/mag drafters, run a local Prometheus (the `prometheus`
    # binary, e.g. Debian's package) with deploy/prometheus/rules.yml, send traffic, render (docs/dashboard.png)
    python scripts/dashboard.py demo --model default --duration 600 --out docs/dashboard.png

The same helpers (`panel_queries`, `local_prometheus`, `Prometheus`) back tests/deploy/test_prometheus.py.

A repository tool, not part of the installed package: run it from a checkout with specserve installed with the
bench extra (``pip install -e '.[bench]'``: matplotlib, httpx) and pyyaml.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import re
import shutil
import socket
import subprocess
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator

import httpx

REPO = Path(__file__).resolve().parent.parent
DASHBOARD = REPO / "deploy" / "grafana" / "specserve.json"
RULES = REPO / "deploy" / "prometheus" / "rules.yml"

_DURATION = re.compile(r"^(\d+)(ms|s|m|h|d)$")
_UNITS_S = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}


def seconds(duration: str) -> float:
    """"30s" / "15m" / "1h" -> seconds."""
    m = _DURATION.match(duration)
    if not m:
        raise ValueError(f"not a duration: {duration!r}")
    return int(m.group(1)) * _UNITS_S[m.group(2)]


# ---- the dashboard ---------------------------------------------------------------------------------


def load_dashboard(path: Path | str = DASHBOARD) -> dict:
    return json.loads(Path(path).read_text())


def iter_panels(dashboard: dict) -> Iterator[dict]:
    """Every panel that is not a row, in order (the panels of collapsed rows included)."""
    for panel in dashboard.get("panels", []):
        if panel.get("type") == "row":
            yield from panel.get("panels", [])
        else:
            yield panel


def substitute(expr: str, variables: dict[str, str]) -> str:
    """Replace Grafana variables (``$name``, ``${name}``, ``[[name]]``) in `expr`, longest names first."""
    for name in sorted(variables, key=len, reverse=True):
        value = variables[name]
        expr = expr.replace("${" + name + "}", value).replace("[[" + name + "]]", value)
        expr = re.sub(r"\$" + re.escape(name) + r"(?![A-Za-z0-9_])", lambda _: value, expr)
    return expr


def dashboard_variables(drafter: str = ".*", rate_interval: str = "1m", range_: str = "15m") -> dict[str, str]:
    """Values for the dashboard's variables: `drafter` is a regex (the "All" value is ``.*``)."""
    return {"drafter": drafter, "__rate_interval": rate_interval, "__range": range_, "__interval": rate_interval,
            "datasource": "prometheus"}


@dataclass
class PanelQuery:
    panel: dict
    ref_id: str
    expr: str               # variables substituted
    legend: str
    instant: bool


def panel_queries(dashboard: dict, variables: dict[str, str]) -> list[PanelQuery]:
    return [PanelQuery(panel, t.get("refId", "A"), substitute(t["expr"], variables), t.get("legendFormat", ""),
                       bool(t.get("instant")) and not t.get("range", False))
            for panel in iter_panels(dashboard) for t in panel.get("targets", [])]


def legend(fmt: str, labels: dict[str, str]) -> str:
    text = re.sub(r"\{\{\s*([A-Za-z0-9_]+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt or "")
    return text or "{" + ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"


# ---- Prometheus --------------------------------------------------------------------------------------


class Prometheus:
    """The HTTP API of one Prometheus (``/api/v1/query``, ``/api/v1/query_range``)."""

    def __init__(self, url: str, timeout: float = 30):
        self.url = url.rstrip("/")
        self._http = httpx.Client(base_url=self.url, timeout=timeout)

    def _get(self, path: str, params: dict) -> dict:
        r = self._http.get(path, params=params)
        body = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
        if r.status_code != 200 or body.get("status") != "success":
            raise RuntimeError(f"{path} {params}: HTTP {r.status_code}: {body.get('error') or r.text[:500]}")
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        """An instant vector: [{"metric": {...}, "value": [t, "v"]}, ...]."""
        params = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        return self._get("/api/v1/query", params)["result"]

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict]:
        """A range matrix: [{"metric": {...}, "values": [[t, "v"], ...]}, ...]."""
        return self._get("/api/v1/query_range", {"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}",
                                                  "step": f"{max(step, 0.001):.3f}"})["result"]

    def label_values(self, label: str, match: str) -> list[str]:
        return self._get(f"/api/v1/label/{label}/values", {"match[]": match})

    def ready(self) -> bool:
        try:
            return self._http.get("/-/ready").status_code == 200
        except httpx.HTTPError:
            return False

    def close(self) -> None:
        self._http.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prometheus_config(targets: list[str], rules: list[Path], scrape_interval: str = "1s") -> str:
    """A Prometheus config scraping `targets` (host:port) at `scrape_interval`, evaluating `rules` as often."""
    import yaml

    return yaml.safe_dump({
        "global": {"scrape_interval": scrape_interval, "evaluation_interval": scrape_interval,
                   "scrape_timeout": scrape_interval if seconds(scrape_interval) < 10 else "10s"},
        "rule_files": [str(Path(r).resolve()) for r in rules],
        "scrape_configs": [{"job_name": "specserve", "metrics_path": "/metrics",
                            "static_configs": [{"targets": list(targets)}]}],
    }, sort_keys=False)


@contextmanager
def local_prometheus(targets: list[str], rules: list[Path] = (RULES,), scrape_interval: str = "1s",
                     binary: str = "prometheus", workdir: Path | None = None, tsdb: Path | None = None,
                     startup_timeout: float = 30) -> Iterator[Prometheus]:
    """Run `binary` on a free loopback port scraping `targets` with `rules` loaded, until the block ends.
    Its TSDB goes to `tsdb` when given (kept afterwards: ``prometheus --storage.tsdb.path=TSDB`` serves it again
    for `render`), else to a temporary folder."""
    exe = shutil.which(binary)
    if exe is None:
        raise FileNotFoundError(f"no {binary!r} on PATH (Debian: apt-get install prometheus)")
    with tempfile.TemporaryDirectory(prefix="specserve-prometheus-", dir=workdir) as tmp:
        tmp = Path(tmp)
        config = tmp / "prometheus.yml"
        config.write_text(prometheus_config(targets, list(rules), scrape_interval))
        port = _free_port()
        log = (tmp / "prometheus.log").open("wb")
        proc = subprocess.Popen([exe, f"--config.file={config}", f"--storage.tsdb.path={tsdb or tmp / 'data'}",
                                 f"--web.listen-address=127.0.0.1:{port}", "--web.enable-lifecycle",
                                 "--storage.tsdb.retention.time=30d", "--log.level=warn"],
                                stdout=log, stderr=subprocess.STDOUT)
        prom = Prometheus(f"http://127.0.0.1:{port}")
        try:
            deadline = time.monotonic() + startup_timeout
            while not prom.ready():
                if proc.poll() is not None or time.monotonic() > deadline:
                    log.flush()
                    raise RuntimeError(f"prometheus did not become ready (exit {proc.poll()}):\n"
                                       + (tmp / "prometheus.log").read_text()[-3000:])
                time.sleep(0.1)
            yield prom
        finally:
            prom.close()
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.close()


# ---- drawing -------------------------------------------------------------------------------------------

BG, PANEL_BG, FG, GRID = "#111217", "#181b1f", "#d8d9da", "#2c3235"
PALETTE = ["#73bf69", "#f2cc0c", "#8ab8ff", "#ff780a", "#f2495c", "#5794f2", "#b877d9", "#705da0", "#37872d",
           "#fade2a", "#447ebc", "#c15c17", "#890f02", "#0a437c", "#6d1f62", "#584477"]


def _format(value: float, unit: str, decimals: int | None = None) -> str:
    if value is None or math.isnan(value):
        return "n/a"
    if unit == "percentunit":
        return f"{value * 100:.{1 if decimals is None else max(0, decimals - 2)}f}%"
    if unit == "s":
        if value == 0:
            return "0 s"
        return f"{value * 1000:.3g} ms" if abs(value) < 1 else f"{value:.3g} s"
    if unit == "reqps":
        return f"{value:.3g} req/s"
    if decimals is not None:
        return f"{value:.{decimals}f}"
    return f"{value:.3g}"


def _unit_of(panel: dict, name: str) -> str:
    unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "short")
    for o in panel.get("fieldConfig", {}).get("overrides", []):
        if _override_matches(o, name):
            for p in o.get("properties", []):
                if p.get("id") == "unit":
                    unit = p["value"]
    return unit


def _override_matches(override: dict, name: str) -> bool:
    m = override.get("matcher", {})
    if m.get("id") == "byName":
        return name == m.get("options")
    if m.get("id") == "byRegexp":
        return re.fullmatch(m.get("options", ""), name) is not None
    return False


def _on_right_axis(panel: dict, name: str) -> bool:
    return any(_override_matches(o, name) and any(p.get("id") == "custom.axisPlacement" and p.get("value") == "right"
                                                   for p in o.get("properties", []))
               for o in panel.get("fieldConfig", {}).get("overrides", []))


def _threshold_color(panel: dict, value: float) -> str:
    steps = panel.get("fieldConfig", {}).get("defaults", {}).get("thresholds", {}).get("steps", [])
    color = "green"
    for s in steps:
        if s.get("value") is None or (value is not None and not math.isnan(value) and value >= s["value"]):
            color = s.get("color", color)
    return {"green": "#73bf69", "red": "#f2495c", "orange": "#ff9830", "yellow": "#fade2a"}.get(color, color)


def _float(v) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return float("nan")


def _axes_unit_formatter(unit: str):
    from matplotlib.ticker import FuncFormatter

    return FuncFormatter(lambda v, _: _format(v, unit))


def render(dashboard: dict, prom: Prometheus, start: float, end: float, out: Path | str,
           drafter: str = ".*", rate_interval: str | None = None, title_note: str = "") -> Path:
    """Draw every panel of `dashboard` over [start, end] into `out` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.dates as mdates
    import matplotlib.pyplot as plt

    span = max(end - start, 60.0)
    step = max(1.0, span / 240)
    rate_interval = rate_interval or f"{max(30, int(4 * step))}s"
    variables = dashboard_variables(drafter, rate_interval, f"{int(span)}s")
    queries: dict[int, list[PanelQuery]] = {}
    for q in panel_queries(dashboard, variables):
        queries.setdefault(id(q.panel), []).append(q)

    rows_h = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in dashboard["panels"])
    unit_in = 0.42                                      # inches per grid row
    header_in = 0.9
    fig_w, fig_h = 22.0, rows_h * unit_in + header_in
    fig = plt.figure(figsize=(fig_w, fig_h), facecolor=BG)
    when = datetime.fromtimestamp(end, tz=timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    fig.text(0.01, 1 - 0.35 / fig_h, dashboard.get("title", ""), color=FG, fontsize=16, weight="bold", va="center")
    fig.text(0.99, 1 - 0.35 / fig_h, f"drafter={drafter}   {span / 60:.0f} min to {when}   "
             f"$__rate_interval={rate_interval}" + (f"   {title_note}" if title_note else ""),
             color="#8e8e8e", fontsize=10, va="center", ha="right")
    pad = 0.06

    def box(grid):
        x = grid["x"] / 24 * fig_w + pad
        w = grid["w"] / 24 * fig_w - 2 * pad
        top = header_in + grid["y"] * unit_in + pad
        h = grid["h"] * unit_in - 2 * pad
        return x / fig_w, 1 - (top + h) / fig_h, w / fig_w, h / fig_h

    for panel in dashboard["panels"]:
        x, y, w, h = box(panel["gridPos"])
        if panel.get("type") == "row":
            fig.text(x, y + h / 2, panel.get("title", ""), color=FG, fontsize=13, weight="bold", va="center")
            continue
        frame = fig.add_axes((x, y, w, h))
        frame.set_facecolor(PANEL_BG)
        frame.set_xticks([]), frame.set_yticks([])
        for s in frame.spines.values():
            s.set_color(GRID)
        title_h = 0.32 / fig_h
        frame.text(0.01, 1 - 0.16 / (h * fig_h), panel.get("title", ""), transform=frame.transAxes, color=FG,
                   fontsize=10.5, weight="bold", va="center")
        inner = (x + 0.45 / fig_w, y + 0.55 / fig_h, w - 0.6 / fig_w, h - title_h - 0.75 / fig_h)
        kind = panel.get("type")
        panel_q = queries.get(id(panel), [])
        if kind == "timeseries":
            if any(p.get("id") == "custom.axisPlacement" and p.get("value") == "right"
                   for o in panel.get("fieldConfig", {}).get("overrides", []) for p in o.get("properties", [])):
                inner = (inner[0], inner[1], inner[2] - 0.75 / fig_w, inner[3])     # room for the right axis
            _draw_timeseries(fig, inner, panel, panel_q, prom, start, end, step, mdates)
        elif kind == "stat":
            _draw_stat(fig, (x, y, w, h - title_h), panel, panel_q, prom, end)
        elif kind == "bargauge":
            _draw_bargauge(fig, (x + 0.85 / fig_w, y + 0.1 / fig_h, w - 0.95 / fig_w, h - title_h - 0.2 / fig_h),
                           panel, panel_q, prom, end)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80, facecolor=BG)
    plt.close(fig)
    return out


def _style(ax, unit):
    ax.set_facecolor(PANEL_BG)
    ax.tick_params(colors="#a0a0a0", labelsize=8)
    for s in ax.spines.values():
        s.set_visible(False)
    ax.grid(True, color=GRID, linewidth=0.6)
    ax.yaxis.set_major_formatter(_axes_unit_formatter(unit))


def _draw_timeseries(fig, rect, panel, queries, prom, start, end, step, mdates):
    defaults = panel.get("fieldConfig", {}).get("defaults", {})
    unit = defaults.get("unit", "short")
    ax = fig.add_axes(rect)
    _style(ax, unit)
    right = None
    color_i = 0
    handles = []
    for q in queries:
        for series in prom.query_range(q.expr, start, end, step):
            name = legend(q.legend, series["metric"])
            ts = [datetime.fromtimestamp(float(t), tz=timezone.utc) for t, _ in series["values"]]
            vs = [_float(v) for _, v in series["values"]]
            target = ax
            if _on_right_axis(panel, name):
                if right is None:
                    right = ax.twinx()
                    _style(right, _unit_of(panel, name))
                    right.grid(False)
                target = right
            (line,) = target.plot(ts, vs, color=PALETTE[color_i % len(PALETTE)], linewidth=1.6, label=name)
            handles.append(line)
            color_i += 1
    ax.set_xlim(datetime.fromtimestamp(start, tz=timezone.utc), datetime.fromtimestamp(end, tz=timezone.utc))
    ax.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M" if end - start > 600 else "%H:%M:%S"))
    if "min" in defaults:
        ax.set_ylim(bottom=defaults["min"])
    if "max" in defaults:
        ax.set_ylim(top=defaults["max"])
    if right is not None:
        right.set_ylim(bottom=0)
    if handles:
        ax.legend(handles=handles, loc="upper left", fontsize=7, ncol=min(3, len(handles)), frameon=False,
                  labelcolor=FG, bbox_to_anchor=(0, -0.1), borderaxespad=0.2)
    else:
        ax.text(0.5, 0.5, "No data", transform=ax.transAxes, color="#8e8e8e", ha="center", va="center")


def _draw_stat(fig, rect, panel, queries, prom, end):
    defaults = panel.get("fieldConfig", {}).get("defaults", {})
    items = []
    for q in queries:
        for series in prom.query(q.expr, end):
            items.append((legend(q.legend, series["metric"]), _float(series["value"][1])))
    items.sort()
    x, y, w, h = rect
    if not items:
        fig.text(x + w / 2, y + h / 2, "No data", color="#8e8e8e", ha="center", va="center")
        return
    for i, (name, value) in enumerate(items):
        cx = x + w * (i + 0.5) / len(items)
        fig.text(cx, y + h * 0.5, _format(value, defaults.get("unit", "short"), defaults.get("decimals")),
                 color=_threshold_color(panel, value), fontsize=22, weight="bold", ha="center", va="center")
        fig.text(cx, y + h * 0.14, name, color=FG, fontsize=9, ha="center", va="center")


def _draw_bargauge(fig, rect, panel, queries, prom, end):
    defaults = panel.get("fieldConfig", {}).get("defaults", {})
    unit = defaults.get("unit", "short")
    items = []
    for q in queries:
        for series in prom.query(q.expr, end):
            m = series["metric"]
            key = (m.get("drafter", ""), int(m["position"]) if m.get("position", "").isdigit() else 0)
            items.append((key, legend(q.legend, m), _float(series["value"][1])))
    items.sort()
    ax = fig.add_axes(rect)
    ax.set_facecolor(PANEL_BG)
    for s in ax.spines.values():
        s.set_visible(False)
    if not items:
        ax.set_xticks([]), ax.set_yticks([])
        ax.text(0.5, 0.5, "No data", transform=ax.transAxes, color="#8e8e8e", ha="center", va="center")
        return
    names = [n for _, n, _ in items][::-1]
    values = [0.0 if math.isnan(v) else v for _, _, v in items][::-1]
    drafters = sorted({k[0] for k, _, _ in items})
    colors = [PALETTE[drafters.index(k[0]) % len(PALETTE)] for k, _, _ in items][::-1]
    top = defaults.get("max", max(values) or 1)
    ax.barh(range(len(values)), [top] * len(values), color=GRID, height=0.75)
    ax.barh(range(len(values)), values, color=colors, height=0.75)
    ax.set_xlim(0, top)
    ax.set_yticks(range(len(values)), names, fontsize=7 if len(values) < 20 else 5.5, color=FG)
    ax.set_xticks([])
    for i, v in enumerate(values):
        ax.text(top * 0.99, i, _format(v, unit, defaults.get("decimals")), color=FG, fontsize=6.5, ha="right",
                va="center")


# ---- demo: a server, a local Prometheus, traffic, the PNG -------------------------------------------------


async def _traffic(base: str, model: str, prompts: list[str], drafters: list[str], duration: float,
                   max_concurrency: int, max_tokens: int, seed: int = 0) -> dict:
    """Streaming chat requests for `duration` seconds, each with a drafter picked in turn; concurrency rises
    from 1 to `max_concurrency` and back over the run; one request in 25 names an unknown drafter (a 400)."""
    rng = random.Random(seed)
    counts = {"ok": 0, "rejected": 0}
    t_end = time.monotonic() + duration
    t0 = time.monotonic()

    def wanted_workers() -> int:
        phase = (time.monotonic() - t0) / max(duration, 1)
        return max(1, round(1 + (max_concurrency - 1) * math.sin(math.pi * min(phase, 1.0))))

    async def worker(i: int, client: httpx.AsyncClient) -> None:
        n = i
        while time.monotonic() < t_end:
            if i >= wanted_workers():
                await asyncio.sleep(0.5)
                continue
            n += 1
            drafter = drafters[n % len(drafters)]
            body = {"model": model, "messages": [{"role": "user", "content": rng.choice(prompts)}],
                    "max_tokens": rng.choice([max_tokens // 2, max_tokens]), "temperature": 0, "stream": True,
                    "speculative": {"drafter": drafter if rng.random() > 0.04 else "eagle"}}
            async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    await r.aread()
                    counts["rejected"] += 1
                    continue
                async for _ in r.aiter_lines():
                    pass
                counts["ok"] += 1

    async with httpx.AsyncClient(base_url=base, timeout=600) as client:
        await asyncio.gather(*(worker(i, client) for i in range(max_concurrency)))
    return counts


def demo(model: str = "default", duration: float = 600, out: Path | str = REPO / "docs" / "dashboard.png",
         drafters: tuple[str, ...] = ("none", "ngram", "mag"), datasets: tuple[str, ...] = ("humaneval", "mt_bench"),
         max_concurrency: int = 4, max_tokens: int = 128, scrape_interval: str = "2s",
         dashboard_path: Path | str = DASHBOARD, tsdb: Path | str | None = None) -> Path:
    from specserve.bench.datasets import load_prompts
    from specserve.bench.serve_throughput import start_server
    from specserve.engine.async_engine import AsyncEngine
    from specserve.engine.config import EngineConfig

    engine = AsyncEngine.from_config(EngineConfig(model=model, dtype="float32", device="cpu",
                                                  drafters=tuple(drafters), max_num_seqs=max(8, max_concurrency),
                                                  max_model_len=2048))
    server, base = start_server(engine)
    try:
        prompts = [p for name in datasets for p in load_prompts(name, 40)]
        host_port = base.removeprefix("http://")
        with local_prometheus([host_port], scrape_interval=scrape_interval,
                              tsdb=Path(tsdb).resolve() if tsdb else None) as prom:
            time.sleep(3 * seconds(scrape_interval))             # a baseline of zeros before the traffic
            start = time.time()
            served = httpx.get(base + "/v1/models").json()["data"][0]["id"]
            counts = asyncio.run(_traffic(base, served, prompts, list(drafters), duration, max_concurrency,
                                          max_tokens))
            time.sleep(3 * seconds(scrape_interval))
            end = time.time()
            note = f"{served} on {engine.engine.device}, {counts['ok']} requests"
            path = render(load_dashboard(dashboard_path), prom, start - 5, end, out, title_note=note)
        print(f"{counts['ok']} requests served, {counts['rejected']} rejected; wrote {path}\n"
              f"traffic from {start:.0f} to {end:.0f} (unix s): render again with --end {end:.0f} --last "
              f"{int(end - start + 5)}s" + (f" from `prometheus --storage.tsdb.path={tsdb}`" if tsdb else ""))
        return path
    finally:
        server.should_exit = True
        time.sleep(1)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    r = sub.add_parser("render", help="render the dashboard from an existing Prometheus")
    r.add_argument("--prometheus", default="http://127.0.0.1:9090")
    r.add_argument("--last", default="15m", help="time range ending now (e.g. 15m, 1h)")
    r.add_argument("--end", type=float, default=None, help="end of the range (unix seconds; default now)")
    r.add_argument("--drafter", default=".*", help="the $drafter regex")
    r.add_argument("--rate-interval", default=None, help="$__rate_interval (default: 4 steps, at least 30s)")
    r.add_argument("--dashboard", default=str(DASHBOARD))
    r.add_argument("--out", default=str(REPO / "docs" / "dashboard.png"))
    d = sub.add_parser("demo", help="serve a model, run Prometheus, send traffic, render")
    d.add_argument("--model", default="default")
    d.add_argument("--duration", type=float, default=600, help="seconds of traffic")
    d.add_argument("--drafters", nargs="+", default=["none", "ngram", "mag"])
    d.add_argument("--datasets", nargs="+", default=["humaneval", "mt_bench"])
    d.add_argument("--max-concurrency", type=int, default=4)
    d.add_argument("--max-tokens", type=int, default=128)
    d.add_argument("--scrape-interval", default="2s")
    d.add_argument("--dashboard", default=str(DASHBOARD))
    d.add_argument("--out", default=str(REPO / "docs" / "dashboard.png"))
    d.add_argument("--tsdb", default=None, help="keep Prometheus' data in this folder (to render it again)")
    args = ap.parse_args(argv)
    if args.command == "render":
        end = args.end or time.time()
        prom = Prometheus(args.prometheus)
        path = render(load_dashboard(args.dashboard), prom, end - seconds(args.last), end, args.out,
                      drafter=args.drafter, rate_interval=args.rate_interval)
        print(f"wrote {path}")
    else:
        demo(args.model, args.duration, args.out, tuple(args.drafters), tuple(args.datasets), args.max_concurrency,
             args.max_tokens, args.scrape_interval, args.dashboard, args.tsdb)


if __name__ == "__main__":
    main()
