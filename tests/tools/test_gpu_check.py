"""`tools/gpu-check --dry-run`: the GPU bring-up's one command, run on the CPU with tiny sizes (the gpu
tests skip, Triton runs under its interpreter, `specserve bench gpu --dry-run` on a tiny Llama), so
that the script and the benchmark cannot rot while no GPU machine is at hand."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def write_prompts(folder: Path) -> Path:
    """Two prompts in each benchmark set's format (`{id, category, turns}` per line)."""
    folder.mkdir()
    for name in ("mt_bench", "humaneval", "gsm8k"):
        rows = [{"id": i, "category": name, "turns": [f"Question {i} of {name}: say hello and count to {i + 3}."]}
                for i in range(2)]
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def test_the_dry_run_measures_every_figure_and_prints_the_table(tmp_path, tiny_llama_dir):
    out = tmp_path / "out"
    env = {**os.environ, "SPECSERVE_DATA": str(write_prompts(tmp_path / "data")), "PYTHON": sys.executable}
    proc = subprocess.run(
        # one folder's -m gpu tests: here they all skip, and the whole tree would add only its collection (~10 s)
        [str(ROOT / "tools" / "gpu-check"), "--dry-run", "--out", str(out), "--tests", "-m gpu tests/unit/kernels",
         "--bench-args", f"--model {tiny_llama_dir} --drafters ngram auto draft_model"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:] + proc.stdout[-2000:]
    s = json.loads((out / "gpu_summary.json").read_text())
    assert s["errors"] == [] and s["dry_run"] and s["dtype"] == "float32"
    assert s["meta"]["graphs"] and s["step_anatomy"]["graph_replay_ms"] > 0     # through the stand-in
    assert set(s["plain_eager_tok_s"]) == {"1", "2"}
    assert set(s["host_profile"]) == {"none", "ngram"} and s["host_profile"]["ngram"]["top_tottime_ms_per_step"]
    assert "==== ngram" in (out / "host_profile.txt").read_text()
    assert set(s["plain_tok_s"]) == {"1", "2"} and min(s["plain_tok_s"].values()) > 0
    assert set(s["speedup"]["ngram"]) == {"1", "2"} and s["tau"]["ngram"]["1"] >= 1.0
    # fp32 on the CPU: speculation is lossless, token for token
    assert s["greedy_mismatch_rate"]["ngram"] == {"1": 0.0, "2": 0.0}
    assert s["greedy_mismatch_rate"]["auto"] == {"1": 0.0, "2": 0.0}   # the server's default, measured too
    assert set(s["draft_steps"]) == {"ngram", "auto", "draft_model"}
    # the fixed budget drafts every step: the host's milliseconds per draft step, proposing and verifying
    assert s["draft_steps_fixed"]["draft_model"]["1"] > 0
    assert s["draft_ms_fixed"]["draft_model"]["1"] > 0 and s["verify_ms_fixed"]["draft_model"]["1"] > 0
    assert set(s["triton_compiles"]) == {"counts", "samples"}     # none under the interpreter
    assert s["hf_tok_s"]["1"] > 0 and s["hf_mode"] == "eager"
    assert s["floor_ms_per_token"] > 0 and all(v["triton_us"] > 0 for v in s["kernel_us"].values())
    assert set(s["verify_us"]) == {"T1xN8", "T32xN8"} and all(v["triton_us"] > 0 for v in s["verify_us"].values())
    assert (out / "gpu_dry-run.md").read_text().startswith("## GPU bring-up")
    assert "pytest exit 0" in (out / "gpu-check.log").read_text()
    lines = proc.stdout.strip().splitlines()     # the short table comes last: plain, then each drafter
    assert lines[-4].startswith("plain tok/s")
    assert sorted(line.split()[0] for line in lines[-3:]) == ["auto", "draft_model", "ngram"]
