"""Serving drafters build their networks from drafters/nets/ and never import the training code
(drafters/train/), not even lazily; the trainers' old names still reach the same objects."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import specserve.drafters as drafters_pkg

SERVING = ("base", "draft_vocab", "ngram", "mag", "draft_model", "student", "medusa", "eagle", "parallelspec", "ctc",
           "falcon")
NETS = ("checkpoint", "eagle", "medusa", "parallelspec", "student", "tree_tuning", "ctc", "falcon")
ROOT = Path(drafters_pkg.__path__[0])


def test_importing_serving_drafters_does_not_import_training():
    mods = [f"specserve.drafters.{m}" for m in SERVING] + [f"specserve.drafters.nets.{m}" for m in NETS]
    code = ("import importlib, sys\n"
            f"for m in {mods!r}:\n    importlib.import_module(m)\n"
            "print(sorted(k for k in sys.modules if k.startswith('specserve.drafters.train')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_no_serving_module_imports_training_anywhere():
    """Also the imports inside functions (constructors load checkpoints lazily)."""
    files = [ROOT / f"{m}.py" for m in SERVING] + [ROOT / "nets" / f"{m}.py" for m in NETS]
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            assert not any(n.startswith("specserve.drafters.train") for n in names), (path.name, names)


def test_training_names_reach_the_same_objects():
    from specserve.drafters.nets import ctc, eagle, falcon, medusa, parallelspec, student
    from specserve.drafters.train import ctc as train_ctc
    from specserve.drafters.train import eagle as train_eagle
    from specserve.drafters.train import falcon as train_falcon
    from specserve.drafters.train import medusa as train_medusa
    from specserve.drafters.train import parallelspec as train_parallelspec
    from specserve.drafters.train import student as train_student

    assert train_eagle.EagleHead is eagle.EagleHead and train_eagle.load_head is eagle.load_head
    assert train_medusa.MedusaHeads is medusa.MedusaHeads
    assert train_parallelspec.ParallelSpecModule is parallelspec.ParallelSpecModule
    assert train_student.StudentModel is student.StudentModel and train_student.load_student is student.load_student
    assert train_ctc.CTCDraftNet is ctc.CTCDraftNet
    assert train_falcon.FalconHead is falcon.FalconHead and train_falcon.save_head is falcon.save_head
