# Two commands do everything on a fresh machine: `make serve` and `make test`.
VENV ?= .venv
PYTHON := $(VENV)/bin/python
# Without CUDA take the CPU build of torch (a small local wheel) instead of the multi-GB CUDA one.
TORCH_CPU ?= torch==2.13.0

.PHONY: install test clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PYTHON) -m pip install -q --upgrade pip
	@if ! command -v nvidia-smi >/dev/null 2>&1; then \
		$(PYTHON) -m pip install -q "$(TORCH_CPU)"; fi
	$(PYTHON) -m pip install -q -e '.[test]'
	touch $@

install: $(VENV)/.installed

test: $(VENV)/.installed
	$(PYTHON) -m pytest

clean:
	rm -rf $(VENV) build *.egg-info
