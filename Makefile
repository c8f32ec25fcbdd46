# Two commands a newcomer needs: `make demo` and `make test`. Everything else is for developers.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: venv demo test lint e2e e2e-venv bench bench-proxy bench-memory fmt clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev,vision]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/warmroute demo

# Fast suite: unit + integration (real Redis and local upstream servers; no vLLM).
test: $(STAMP)
	$(BIN)/python -m pytest -q -m "not e2e" tests

# End-to-end suite against real vLLM engines on the CPU (builds the engine venv once).
e2e-venv:
	bash tests/e2e/venv.sh

e2e: $(STAMP) e2e-venv
	$(BIN)/python -m pytest -q -m e2e tests/e2e

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

fmt: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

bench: $(STAMP)
	$(BIN)/warmroute bench --json bench-out/bench.json

# Affinity hits and new conversations, direct vs one gateway worker (~2.5 min; --paths hit,new,new-session).
bench-proxy: $(STAMP)
	$(BIN)/python -m tools.bench_proxy --json bench-out/proxy.json

# 1 M pinned conversations in the in-memory affinity store: RSS, time per claim, gc.collect() pause.
bench-memory: $(STAMP)
	$(BIN)/python -m tools.bench_memory --json bench-out/memory.json

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
