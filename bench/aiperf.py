"""AIPerf, NVIDIA's load generator, against `specserve serve`: how an external client sees the server.

    specserve bench aiperf [--aiperf PATH] [--drafters none auto] [--concurrency 1 4 16 32]
        [--requests-per-stream 4] [--max-tokens 128] [--rounds 1] [--out bench/results/aiperf_cpu]
    (or: python -m specserve.bench.aiperf ...)

AIPerf lives in its own environment: `--aiperf` names its executable; without it the bench uses
`$SPECSERVE_AIPERF`, else `aiperf` on PATH, else installs `aiperf==0.13.*` into
`~/.cache/specserve/aiperf-venv` (`python -m venv` + pip; needs PyPI once). It needs no torch.

For each `--drafters` setting the bench starts its own server (`python -m specserve.server serve --model
MODEL --drafter SETTING --host 127.0.0.1 --port P`, the server's defaults otherwise, as `make serve`
runs it; `auto` is the default), all of them before the first run. Then, for each `--concurrency` C,
each server in turn (the others idle), `--rounds` times with the order reversed every other round
(ABBA: a drift of the machine hits the settings of a level alike; `schedule`), it runs

    aiperf profile -m MODEL -u URL --endpoint-type chat --streaming --concurrency C
        --request-count max(8, R x C) --input-file PROMPTS --custom-dataset-type single_turn
        --tokenizer TOKENIZER --use-server-token-count
        --extra-inputs '{"max_tokens": T, "ignore_eos": true, "temperature": 0}'

after a warm-up of C requests. PROMPTS: the chat prompts of MT-Bench, HumanEval and GSM8K in turn
(`--datasets`); TOKENIZER: the served model's tokenizer saved to a folder (AIPerf loads it offline).
It reads AIPerf's JSON export: time to first token, inter-token latency, output tokens/s,
requests/s, and the acceptance AIPerf computes from our responses' `metrics.speculative_decoding`
(vLLM's per-request shape): acceptance length (tokens per verification step, bonus included), per
request and pooled, and the draft acceptance rate; beside them the acceptance length from the
`vllm:spec_decode_*` counters of /metrics over the same requests; with several rounds, each
setting's ratio to plain decoding per round (its own pair) and their median. Writes PREFIX.json and PREFIX.md,
and AIPerf's own exports in PREFIX.aiperf/ (git-ignored).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx

from specserve.bench.datasets import add_dataset_args, load_prompts
from specserve.bench.common import ManagedServer, free_port

AIPERF_REQUIREMENT = "aiperf==0.13.*"
DEFAULT_VENV = Path.home() / ".cache" / "specserve" / "aiperf-venv"

# AIPerf's metric tags -> our columns (unit as AIPerf exports them)
METRICS = {
    "time_to_first_token": "ttft_ms",
    "inter_token_latency": "itl_ms",
    "request_latency": "latency_ms",
    "output_token_throughput": "output_tok_s",
    "request_throughput": "requests_s",
    "spec_decode_acceptance_length": "acceptance_length",
    "spec_decode_draft_acceptance_rate": "draft_acceptance_rate",
}


def find_aiperf(explicit: str | None, install_dir: Path) -> str:
    """The aiperf executable: `explicit`, $SPECSERVE_AIPERF, on PATH, or installed into `install_dir`."""
    for candidate in (explicit, os.environ.get("SPECSERVE_AIPERF"), shutil.which("aiperf")):
        if candidate:
            return candidate
    exe = install_dir / "bin" / "aiperf"
    if not exe.exists():
        print(f"installing {AIPERF_REQUIREMENT} into {install_dir} ...", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(install_dir)], check=True)
        subprocess.run([str(install_dir / "bin" / "pip"), "install", "-q", AIPERF_REQUIREMENT], check=True)
    return str(exe)


def aiperf_version(exe: str) -> str:
    out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=120)
    return (out.stdout.strip().splitlines() or ["?"])[-1]


def write_prompts(path: Path, datasets: list[str], per_dataset: int, args) -> int:
    """AIPerf's single_turn JSONL ({"text": prompt} per line), the datasets' prompts interleaved."""
    sets = [load_prompts(name, per_dataset, prompt_field=args.prompt_field, messages_field=args.messages_field)
            for name in datasets]
    rows = [p for group in zip(*sets) for p in group]
    path.write_text("".join(json.dumps({"text": p}) + "\n" for p in rows))
    return len(rows)


def save_tokenizer(model: str, folder: Path) -> str:
    """The served model's tokenizer saved where AIPerf can load it without the hub; its served name."""
    from specserve.engine.loader import load_model

    loaded = load_model(model)
    loaded.tokenizer.save_pretrained(str(folder))
    return loaded.name


def aiperf_command(exe: str, model_name: str, url: str, concurrency: int, num_requests: int, prompts: Path,
                   tokenizer: Path, max_tokens: int, artifacts: Path) -> list[str]:
    extra = json.dumps({"max_tokens": max_tokens, "ignore_eos": True, "temperature": 0})
    return [exe, "profile", "-m", model_name, "-u", url, "--endpoint-type", "chat", "--streaming",
            "--concurrency", str(concurrency), "--request-count", str(num_requests),
            "--input-file", str(prompts), "--custom-dataset-type", "single_turn",
            "--tokenizer", str(tokenizer), "--use-server-token-count",
            "--extra-inputs", extra, "--output-artifact-dir", str(artifacts), "--no-auto-plot"]


def read_export(artifacts: Path) -> dict:
    """Our columns from AIPerf's JSON export under `artifacts` (mean, p50, p99 where it has them)."""
    export = artifacts / "profile_export_aiperf.json"   # the profiling phase's (phases/ holds each phase's too)
    if not export.is_file():
        raise RuntimeError(f"AIPerf wrote no {export.name} under {artifacts}")
    data = json.loads(export.read_text())
    records = data.get("records", data)
    out: dict = {}
    for tag, col in METRICS.items():
        rec = records.get(tag) if isinstance(records, dict) else None
        if not isinstance(rec, dict):
            continue
        out[col] = {k: rec.get(k) for k in ("avg", "p50", "p99") if rec.get(k) is not None}
        if rec.get("unit"):
            out[col]["unit"] = rec["unit"]
    hist = {int(j): int(n) for j, n in (data.get("pooled_spec_decode_acceptance_histogram") or {}).items()}
    if hist:   # every verification step of the level pooled: tokens per step, bonus included
        out["pooled_acceptance_length"] = 1 + sum(j * n for j, n in hist.items()) / sum(hist.values())
        out["acceptance_histogram"] = hist
    for key in ("error_summary", "was_cancelled"):
        if key in data:
            out[key] = data[key]
    return out


def warm_up(base: str, model_name: str, prompts: Path, concurrency: int, max_tokens: int) -> None:
    """`concurrency` requests at once, like the level's, before it (and before its /metrics scrape, so
    that AIPerf's figures and the counters' cover the same requests)."""
    import asyncio

    texts = [json.loads(line)["text"] for line in prompts.read_text().splitlines()[:concurrency]]

    async def one(client: httpx.AsyncClient, text: str) -> None:
        body = {"model": model_name, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
                "ignore_eos": True, "temperature": 0}
        (await client.post(base + "/v1/chat/completions", json=body, timeout=600)).raise_for_status()

    async def all_of() -> None:
        async with httpx.AsyncClient() as client:
            await asyncio.gather(*(one(client, t) for t in texts))

    asyncio.run(all_of())


def vllm_bench_spec_counters(text: str) -> tuple[dict[str, float], dict[int, float]]:
    """The speculation counters of a /metrics exposition as `vllm bench serve` gathers them: lines
    starting `vllm:spec_decode` whose name ends `_total`, summed over label sets; per-position ones
    by `position` too."""
    totals: dict[str, float] = {}
    per_pos: dict[int, float] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:spec_decode"):
            continue
        name_labels, value = line.rsplit(" ", 1)
        name = name_labels.split("{")[0]
        if not name.endswith("_total"):
            continue
        totals[name] = totals.get(name, 0.0) + float(value)
        m = re.search(r'position="(\d+)"', name_labels)
        if m:
            per_pos[int(m.group(1))] = per_pos.get(int(m.group(1)), 0.0) + float(value)
    return totals, per_pos


SPEC_COUNTERS = {"drafts": "vllm:spec_decode_num_drafts_total",
                 "draft_tokens": "vllm:spec_decode_num_draft_tokens_total",
                 "accepted_tokens": "vllm:spec_decode_num_accepted_tokens_total"}


def scrape_spec_counters(base: str) -> dict[str, float]:
    """SPEC_COUNTERS (by our key) from the server's /metrics, read as `vllm bench serve` reads them."""
    totals = vllm_bench_spec_counters(httpx.get(base + "/metrics", timeout=30).text)[0]
    return {key: totals.get(name, 0.0) for key, name in SPEC_COUNTERS.items()}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specserve bench aiperf", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--aiperf", default=None, help="the aiperf executable (default: see above)")
    p.add_argument("--install-dir", type=Path, default=DEFAULT_VENV, help="where to install AIPerf when not found")
    p.add_argument("--model", default="default")
    p.add_argument("--drafters", nargs="+", default=["none", "auto"], help="one server per setting (--drafter)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 32])
    p.add_argument("--requests-per-stream", type=int, default=4,
                   help="requests per level: max(8, this x concurrency) (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--per-dataset", type=int, default=43, help="prompts taken from each dataset (default: %(default)s)")
    p.add_argument("--datasets", nargs="+", default=["mt_bench", "humaneval", "gsm8k"],
                   help="our benchmark names or dataset files/ids (bench/datasets.py)")
    add_dataset_args(p)
    p.add_argument("--rounds", type=int, default=1,
                   help="runs of every level, the settings' order reversed every other round (ABBA), so that a "
                        "drift of the machine hits them alike; each round's ratio to plain decoding is its own "
                        "pair's, and the table gives their median (default: %(default)s)")
    p.add_argument("--server-args", default="", help="extra `specserve serve` arguments (one string)")
    p.add_argument("--ready-timeout", type=float, default=600.0)
    p.add_argument("--out", default="bench/results/aiperf_cpu", help="PREFIX of PREFIX.json and PREFIX.md")
    return p


def main(argv: list[str] | None = None) -> int:
    import shlex

    import torch

    args = build_parser().parse_args(argv)
    exe = find_aiperf(args.aiperf, args.install_dir)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    raw = Path(str(out) + ".aiperf")
    shutil.rmtree(raw, ignore_errors=True)
    raw.mkdir(parents=True)
    work = Path(tempfile.mkdtemp(prefix="specserve-aiperf-"))
    tokenizer = work / "tokenizer"
    model_name = save_tokenizer(args.model, tokenizer)
    prompts = work / "prompts.jsonl"
    num_prompts = write_prompts(prompts, args.datasets, args.per_dataset, args)
    result = {
        "benchmark": "aiperf",
        "meta": {"command": "specserve bench aiperf " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])),
                 "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                 "machine": f"{platform.platform()}, {os.cpu_count()} CPUs", "python": platform.python_version(),
                 "torch": torch.__version__, "aiperf": aiperf_version(exe), "model": model_name,
                 "datasets": args.datasets, "prompts": num_prompts, "max_tokens": args.max_tokens},
        "runs": [],
    }
    servers: dict[str, tuple[ManagedServer, str]] = {}
    try:
        for drafter in args.drafters:      # every server up first; each waits idle while another is measured
            port = free_port()
            cmd = [sys.executable, "-m", "specserve.server", "serve", "--model", args.model, "--drafter", drafter,
                   "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning", *shlex.split(args.server_args)]
            server, base = ManagedServer(cmd, work / f"server-{drafter}.log"), f"http://127.0.0.1:{port}"
            servers[drafter] = (server, base)
            server.start()
            server.wait_ready(base, args.ready_timeout)
        for c, r, drafter in schedule(args.concurrency, list(servers), max(1, args.rounds)):
            result["runs"].append(run_level(exe, servers[drafter][1], drafter, c, args, model_name, prompts,
                                            tokenizer, raw, r if args.rounds > 1 else None))
    finally:
        for drafter, (server, _) in servers.items():
            result.setdefault("servers", {})[drafter] = server.stop(60)
        out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
        shutil.rmtree(work, ignore_errors=True)
    text = markdown(result)
    out.with_suffix(".md").write_text(text)
    print(text)
    return 0


def schedule(concurrency: list[int], settings: list[str], rounds: int) -> list[tuple[int, int, str]]:
    """The runs in order, as (concurrency, round, setting): each level's rounds one after the other,
    every setting in turn within a round, in reverse order every other round (ABBA), so that a slow
    stretch of the machine, or a steady drift, hits the settings of a level alike."""
    return [(c, r, s) for c in concurrency for r in range(rounds)
            for s in (settings if r % 2 == 0 else settings[::-1])]


def run_level(exe: str, base: str, drafter: str, c: int, args, model_name: str, prompts: Path, tokenizer: Path,
              raw: Path, round_no: int | None = None) -> dict:
    """One AIPerf run at concurrency `c` against the server at `base` (after a warm-up of `c`
    requests), with the speculation counters /metrics gained over it; `round_no` when the level
    runs more than once (`--rounds`)."""
    n = max(8, args.requests_per_stream * c)
    artifacts = raw / (f"{drafter}-c{c}" + (f"-r{round_no}" if round_no is not None else ""))
    warm_up(base, model_name, prompts, c, args.max_tokens)
    before = scrape_spec_counters(base)
    t0 = time.monotonic()
    run = subprocess.run(aiperf_command(exe, model_name, base, c, n, prompts, tokenizer, args.max_tokens, artifacts),
                         capture_output=True, text=True)
    seconds = time.monotonic() - t0
    if run.returncode != 0:
        raise RuntimeError(f"aiperf failed ({run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
    after = scrape_spec_counters(base)
    row = {"drafter": drafter, "concurrency": c, "requests": n, "seconds": round(seconds, 1), **read_export(artifacts)}
    if round_no is not None:
        row["round"] = round_no
    level = {key: after[key] - before[key] for key in SPEC_COUNTERS}
    level["acceptance_length"] = 1 + level["accepted_tokens"] / level["drafts"] if level["drafts"] else None
    row["metrics_endpoint"] = level
    print(f"{drafter} c={c}{f' round {round_no}' if round_no is not None else ''}: "
          f"{row.get('output_tok_s', {}).get('avg')} tok/s in {seconds:.0f} s", file=sys.stderr,
          flush=True)
    return row


def _num(value, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def _fmt(row: dict, col: str, key: str = "avg", spec: str = ".1f") -> str:
    return _num((row.get(col) or {}).get(key), spec)


def markdown(result: dict) -> str:
    meta = result.get("meta", {})
    lines = [f"#### AIPerf {meta.get('aiperf', '')} against `specserve serve`: {meta.get('model', '')}, "
             f"{meta.get('max_tokens')} tokens per request (EOS ignored), greedy, streaming chat",
             "",
             f"{meta.get('date', '')}; {meta.get('machine', '')}; torch {meta.get('torch', '')}; prompts: "
             f"{', '.join(meta.get('datasets', []))} ({meta.get('prompts')} in turn).",
             "",
             "| drafter | concurrency | requests | output tok/s | requests/s | TTFT ms (p50 / p99) "
             "| ITL ms (p50 / p99) | acceptance length (AIPerf: per request / pooled) | draft acceptance (AIPerf) "
             "| acceptance length (/metrics) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    runs = result.get("runs", [])
    rounds = any("round" in r for r in runs)
    if rounds:
        lines[-2] = lines[-2].replace("| concurrency |", "| concurrency | round |")
        lines[-1] += "---|"
    ratios = level_ratios(runs) if rounds else {}
    plain = _plain_tok_s(runs)
    for r in runs:
        tok = _fmt(r, "output_tok_s")
        base = plain.get((r["concurrency"], r.get("round")))
        if r["drafter"] != "none" and base and (r.get("output_tok_s") or {}).get("avg"):
            tok += f" ({r['output_tok_s']['avg'] / base:.2f}×)"
        ml = (r.get("metrics_endpoint") or {}).get("acceptance_length")
        cells = f"| {r['drafter']} | {r['concurrency']} |" + (f" {r.get('round', '–')} |" if rounds else "")
        lines.append(f"{cells} {r['requests']} | {tok} | {_fmt(r, 'requests_s', spec='.2f')} "
                     f"| {_fmt(r, 'ttft_ms', 'p50', '.0f')} / {_fmt(r, 'ttft_ms', 'p99', '.0f')} "
                     f"| {_fmt(r, 'itl_ms', 'p50', '.1f')} / {_fmt(r, 'itl_ms', 'p99', '.1f')} "
                     f"| {_fmt(r, 'acceptance_length', spec='.2f')} / {_num(r.get('pooled_acceptance_length'), '.2f')} "
                     f"| {_fmt(r, 'draft_acceptance_rate', spec='.0f')}{'%' if r.get('draft_acceptance_rate') else ''} "
                     f"| {_num(ml, '.2f')} |")
    lines += ["", "output tok/s: AIPerf's output token throughput (in brackets: over plain decoding at the same "
              "concurrency, same run); TTFT and ITL as AIPerf measures them from the stream; acceptance length: "
              "tokens per verification step (bonus included), as AIPerf reads it from the responses' "
              "`metrics.speculative_decoding` (the mean of the requests' own, over the requests that drafted; and "
              "pooled over every step, from its histogram), and from the `vllm:spec_decode_*` counters of /metrics "
              "as `vllm bench serve` reads them (pooled over the level's requests; a warm-up of C requests "
              "precedes each level); draft acceptance: accepted / drafted tokens, the mean of the requests'.", ""]
    if rounds and ratios:
        lines += ["Over plain decoding, each round's pair (the settings' order reversed every other round), the "
                  "median over rounds and the range:", "", "| drafter | concurrency | output tok/s vs plain |",
                  "|---|---|---|"]
        lines += [f"| {d} | {c} | {statistics.median(v):.2f}× ({min(v):.2f}–{max(v):.2f}) |"
                  for (d, c), v in ratios.items()]
        lines.append("")
    return "\n".join(lines)


def level_ratios(runs: list[dict]) -> dict[tuple[str, int], list[float]]:
    """(setting, concurrency) -> each round's output tokens/s over plain decoding's in the same
    level and round, for every setting but plain."""
    plain = _plain_tok_s(runs)
    out: dict[tuple[str, int], list[float]] = {}
    for r in runs:
        base = plain.get((r["concurrency"], r.get("round")))
        tok = (r.get("output_tok_s") or {}).get("avg")
        if r["drafter"] != "none" and base and tok:
            out.setdefault((r["drafter"], r["concurrency"]), []).append(tok / base)
    return out


def _plain_tok_s(runs: list[dict]) -> dict[tuple[int, int | None], float | None]:
    """(concurrency, round) -> plain decoding's output tokens/s in that level and round."""
    return {(r["concurrency"], r.get("round")): (r.get("output_tok_s") or {}).get("avg")
            for r in runs if r["drafter"] == "none"}


if __name__ == "__main__":
    sys.exit(main())
