"""`tools/gpu_ab.py`: the A/B of an older revision's engine against the working tree, packed here
and run there in one command; its dry run on the CPU (a tiny model, 8 tokens) so that it cannot rot
while no GPU machine is at hand."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from test_gpu_check import write_prompts

ROOT = Path(__file__).resolve().parents[2]


def packed(tmp_path, model_dir):
    """(the tool's command, its environment, the packed folder, an output folder): HEAD against this
    tree over `model_dir`'s config, a few prompts of each benchmark set."""
    env = {**os.environ, "SPECSERVE_DATA": str(write_prompts(tmp_path / "data"))}
    ab, out = tmp_path / "ab", tmp_path / "out"
    tool = [sys.executable, str(ROOT / "tools" / "gpu_ab.py")]
    subprocess.run(tool + ["pack", "--old", "HEAD", "--model-dir", str(model_dir), "--ab", str(ab)],
                   cwd=ROOT, env=env, check=True, capture_output=True, timeout=120)
    return tool, env, ab, out


def test_the_dry_run_measures_both_trees(tmp_path, tiny_llama_dir):
    tool, env, ab, out = packed(tmp_path, tiny_llama_dir)
    assert (ab / "old" / "specserve" / "engine" / "core.py").is_file()
    assert (ab / "new" / "specserve" / "engine" / "core.py").is_file() and not (ab / "model" / "model.safetensors").exists()
    proc = subprocess.run(tool + ["run", "--ab", str(ab), "--out", str(out), "--dry-run", "--rounds", "1",
                                  "--variants", "old,new,new+SPECSERVE_X=1"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((out / "ab.json").read_text())["results"]
    assert [r["variant"] for r in results] == ["old", "new", "new+SPECSERVE_X=1"]
    for r in results:     # each child imported its own tree
        assert r["tree"] == str(ab / r["variant"].split("+")[0] / "specserve")
        assert all(r[k]["tok_s"] > 0 for k in ("plain_b1", "ngram_b1", "plain_b32", "ngram_b32",
                                                        "eagle_b32"))
    assert results[2]["env"]["SPECSERVE_X"] == "1" and "SPECSERVE_X" not in results[1]["env"]


def test_the_profile_dry_run_sweeps_batches_with_and_without_async_scheduling(tmp_path, tiny_llama_dir):
    tool, env, ab, out = packed(tmp_path, tiny_llama_dir)
    proc = subprocess.run(tool + ["profile", "--ab", str(ab), "--out", str(out), "--dry-run"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads((out / "profile.json").read_text())
    assert set(r["sweep"]) == {f"b{b}_{mode}" for b in (1, 2) for mode in ("sync", "async")}
    assert all(min(v["tok_s"]) > 0 and len(v["median_step_ms"]) == 2 for v in r["sweep"].values())
    assert set(r["kernels"]) == {"b1_graphs", "b32_graphs", "b1_eager"}
    assert all(v["steps"] > 0 and v["wall_ms_per_step"] > 0 for v in r["kernels"].values())
    assert "==== b1_eager" in (out / "profile.txt").read_text()


def test_the_profile_dry_run_takes_draft_steps_apart(tmp_path, tiny_llama_dir):
    tool, env, ab, out = packed(tmp_path, tiny_llama_dir)
    proc = subprocess.run(tool + ["profile", "--ab", str(ab), "--out", str(out), "--dry-run", "--parts", "drafters"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads((out / "profile.json").read_text())
    assert "sweep" not in r and set(r["drafters"]) == {"none", "ngram", "eagle", "draft_model"}
    assert all(v["steps"] > 0 and v["wall_ms_per_step"] > 0 and v["host"] for v in r["drafters"].values())
    # the fixed budget: the model-based drafters draft every step, and each step's proposing is timed
    for name in ("eagle", "draft_model"):
        assert r["drafters"][name]["draft_steps"] > 0 and r["drafters"][name]["draft_ms"] > 0
    assert "==== drafter eagle" in (out / "profile.txt").read_text()
