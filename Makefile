# Two commands a newcomer needs: `make demo` and `make test` (`make doctor` says what the machine lacks).
# Everything else is for developers.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
# VISION=1: the dev install plus the CPU vision sidecar's extra (torch, transformers), e.g. `make test VISION=1`.
# PyPI's torch is the CUDA build (~2.5 GB with its nvidia wheels); TORCH_INDEX=https://download.pytorch.org/whl/cpu
# gets the ~200 MB CPU build instead.
VISION  ?=
TORCH_INDEX ?=
# What is installed, one stamp each: the demo needs the package alone, the tests its dev extra.
BASE    := $(VENV)/.installed-base
DEV     := $(VENV)/.installed-dev
VIS     := $(VENV)/.installed-vision
TESTENV := $(if $(filter 1,$(VISION)),$(VIS),$(DEV))

.PHONY: venv doctor demo test lint e2e e2e-venv bench bench-proxy bench-memory fmt clean

# A venv whose python does not run or has no pip (a failed `python3 -m venv` leaves bin/python behind) is
# recreated: its stamps are forced out of date here, and the recipe below starts it over.
ifneq ($(shell $(BIN)/python -c 'import pip' >/dev/null 2>&1 && echo ok),ok)
.PHONY: $(BASE) $(DEV) $(VIS)
endif

define fresh_venv
	@if ! $(BIN)/python -c 'import pip' >/dev/null 2>&1; then \
	  rm -rf $(VENV); \
	  echo "creating $(VENV) with $(PY)"; \
	  $(PY) -m venv $(VENV) || { rm -rf $(VENV); \
	    echo "'$(PY) -m venv' failed: on Debian/Ubuntu, sudo apt-get install -y python3-venv" >&2; exit 1; }; \
	  $(BIN)/python -m pip install -q --upgrade pip; \
	fi
endef

$(BASE): pyproject.toml
	$(fresh_venv)
	@echo "installing warmroute and its runtime dependencies into $(VENV) (~80 MB on disk) ..."
	$(BIN)/python -m pip install -e .
	touch $@

$(DEV): pyproject.toml
	$(fresh_venv)
	@echo "installing warmroute with its dev extra into $(VENV): pytest, ruff, mypy, matplotlib, ... (~500 MB on disk) ..."
	$(BIN)/python -m pip install -e '.[dev]'
	touch $(BASE) $@

$(VIS): pyproject.toml
	$(fresh_venv)
	@echo "installing warmroute with its dev and vision extras into $(VENV): torch, transformers, ..."
	@echo "(torch from PyPI is the CUDA build, ~2.5 GB; TORCH_INDEX=https://download.pytorch.org/whl/cpu: ~200 MB)"
	$(BIN)/python -m pip install -e '.[dev,vision]' $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))
	touch $(BASE) $(DEV) $@

venv: $(TESTENV)

# Which optional tools are missing, how many tests skip without each, and the apt-get line (no venv needed).
doctor:
	$(PY) -m tools.doctor --venv $(VENV)

demo: $(BASE)
	$(BIN)/warmroute demo

# Fast suite: unit + integration (real Redis and local upstream servers; no vLLM).
test: $(TESTENV)
	@$(BIN)/python -m tools.doctor --short --venv $(VENV)
	$(BIN)/python -m pytest -q -m "not e2e" tests

# End-to-end suite against real vLLM engines on the CPU (builds the engine venv once).
e2e-venv:
	bash tests/e2e/venv.sh

e2e: $(TESTENV) e2e-venv
	$(BIN)/python -m pytest -q -m e2e tests/e2e

# mypy checks the vision sidecar against torch's own types: lint always has the vision extra.
lint: $(VIS)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

fmt: $(TESTENV)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

bench: $(DEV)
	$(BIN)/warmroute bench --json bench-out/bench.json

# Affinity hits and new conversations, direct vs one gateway worker (~2.5 min; --paths hit,new,new-session).
# Then gateway CPU per request compared (tools.bench_proxy --simultaneous --pin: every gateway loaded at once,
# all on one pinned CPU, ratios per round): ttft and affinity, with an A/A pair of the first gateway in the run;
# OLD=<checkout>: that checkout's affinity first (and twice), this one's affinity and ttft after it.
CPU_GATEWAYS = $(if $(OLD),old=$(OLD):affinity$(,)old2=$(OLD):affinity$(,)affinity=.:affinity$(,)ttft=.:ttft,affinity=.:affinity$(,)affinity2=.:affinity$(,)ttft=.:ttft)
, := ,
bench-proxy: $(DEV)
	$(BIN)/python -m tools.bench_proxy --json bench-out/proxy.json
	$(BIN)/python -m tools.bench_proxy --simultaneous --pin --gateways '$(CPU_GATEWAYS)' --json bench-out/proxy-cpu.json

# 1 M pinned conversations in the in-memory affinity store: RSS, time per claim, gc.collect() pause.
bench-memory: $(DEV)
	$(BIN)/python -m tools.bench_memory --json bench-out/memory.json

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
