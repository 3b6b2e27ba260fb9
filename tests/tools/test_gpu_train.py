"""`tools/gpu-train --dry-run`: a drafter trained on a GPU machine in one command (more answers beside
the committed ones, training on both folders, τ through the engine, two tars back), run on the CPU
with tiny sizes on a tiny Llama, so that the script cannot rot while no GPU machine is at hand."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

from specserve.drafters.train.distill import read_shard
from specserve.server import cli

ROOT = Path(__file__).resolve().parents[2]


def write_data(folder: Path) -> Path:
    """A prompt pool of two sources (8 prompts) and two prompts of each benchmark set."""
    folder.mkdir()
    pool = [{"id": f"{s}-{i}", "source": s, "turns": [f"Prompt {i} of {s}: say hello and count to {i + 3}."]}
            for s in ("a", "b") for i in range(4)]
    (folder / "train_prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in pool))
    for name in ("mt_bench", "humaneval", "gsm8k"):
        rows = [{"id": i, "category": name, "turns": [f"Question {i} of {name}: count to {i + 3}."]} for i in range(2)]
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def rows_of(folder: Path) -> set[int]:
    return {row for s in folder.glob("t0-*.npz") for row in read_shard(s)}


def test_the_dry_run_distills_beside_the_committed_answers_trains_and_measures(tmp_path, tiny_llama_dir):
    data = write_data(tmp_path / "data")
    committed = tmp_path / "committed"
    assert cli.main(["train", "distill", "--model", str(tiny_llama_dir), "--data", str(data), "--out", str(committed),
                     "--device", "cpu", "--max-tokens", "8", "--max-prompts", "4", "--no-progress",
                     "--log-level", "warning"]) == 0
    out = tmp_path / "out"
    env = {**os.environ, "SPECSERVE_DATA": str(data), "PYTHON": sys.executable}
    train_args = ("--option init=random --option ttt_steps=2 --epochs 1 --lr 1e-3 --max-len 128 --top-k 4 "
                  "--eval-examples 2 --batch-tokens 512 --option train_batch_tokens=256 --dtype float32 "
                  "--option engine_tau_prompts=2")
    proc = subprocess.run(
        [str(ROOT / "tools" / "gpu-train"), "--dry-run", "--out", str(out), "--committed", str(committed),
         "--model", str(tiny_llama_dir), "--train-args", train_args, "--tau-prompts", "2"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:] + proc.stdout[-2000:]
    s = json.loads((out / "gpu_train.json").read_text())

    # two more greedy answers, of prompts the committed folder had not answered
    assert s["distill"]["answers"] == 2 and s["distill"]["excluded"] == [str(committed)]
    assert s["distill"]["answers_by_temperature"] == {"0": 2} and s["distill"]["tok_s"] > 0
    with tarfile.open(out / "distill.tar") as tar:
        tar.extractall(tmp_path / "back", filter="data")
    fresh = tmp_path / "back" / "distill"
    assert len(rows_of(fresh)) == 2 and not rows_of(fresh) & rows_of(committed)

    # the drafter trained on both folders: 4 + 2 greedy answers, and the committed folder's sampled ones
    t = s["train"]
    assert t["device"] == "cpu" and t["steps"] > 0 and t["tau"] >= 1.0 and t["served"]["tau"] >= 1.0
    assert t["num_examples"] == 4 + 4 + 2 and t["distilled"][0] == str(committed)
    with tarfile.open(out / "eagle3.tar") as tar:
        names = set(tar.getnames())
    assert {"eagle3/meta.json", "eagle3/model.safetensors"} <= names and "eagle3/train-state.pt" not in names

    # its τ through the engine on each benchmark set, token for token plain decoding's output
    assert set(s["bench"]) == {"mt_bench", "humaneval", "gsm8k"}
    assert all(r["tau"] >= 1.0 and r["greedy_mismatches"] == 0 and r["error"] is None for r in s["bench"].values())
    lines = proc.stdout.strip().splitlines()      # the short table comes last
    assert lines[0].startswith("distill on cpu: 2 answers") and lines[1].startswith("eagle3 on cpu")
    assert [line.split()[1] for line in lines[-3:]] == ["mt_bench", "humaneval", "gsm8k"]
