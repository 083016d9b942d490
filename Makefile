# Two commands do everything on a fresh machine: `make serve` and `make test`.
VENV ?= .venv
PYTHON := $(VENV)/bin/python
# Without CUDA take the CPU build of torch (a small local wheel) instead of the multi-GB CUDA one.
TORCH_CPU ?= torch==2.13.0

.PHONY: install install-test test serve clean

# What serving needs: the package and its runtime dependencies.
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PYTHON) -m pip install -q --upgrade pip
	@if ! command -v nvidia-smi >/dev/null 2>&1; then \
		$(PYTHON) -m pip install -q "$(TORCH_CPU)"; fi
	$(PYTHON) -m pip install -q -e .
	touch $@

# The test extras on top (pytest, transformers, the openai client, triton, ...), and Ray and
# NIXL, whose executor backend and KV connector have their tests too.
$(VENV)/.installed-test: $(VENV)/.installed
	$(PYTHON) -m pip install -q -e '.[test,ray,nixl]'
	touch $@

install: $(VENV)/.installed

install-test: $(VENV)/.installed-test

# Two worker processes, each running whole test files (a file's fixtures are made once): on a
# 2-core machine the suite takes about 15 minutes against 24 in one process, since much of it
# waits on servers and rank processes starting. TEST_WORKERS=0 runs it in one process. The
# slowest tests are listed at the end, to keep the suite within its time on a small CPU.
TEST_WORKERS ?= 2
test: $(VENV)/.installed-test
	$(PYTHON) -m pytest -n $(TEST_WORKERS) --dist loadfile --durations=25

# The OpenAI-compatible server on the default model at http://127.0.0.1:8000 .
serve: $(VENV)/.installed
	$(VENV)/bin/muse serve --host 127.0.0.1 --port 8000 \
		--reasoning-parser muse --tool-call-parser muse --enable-auto-tool-choice

clean:
	rm -rf $(VENV) build *.egg-info
