#!/usr/bin/env bash
# The two commands of the README:
#   ./dev.sh demo   set everything up (Python 3.12 venv, pinned packages) and run the main demo
#   ./dev.sh test   set everything up and run the whole test suite
# Extra arguments go to the demo (`mcore-reshard demo ...`) or to pytest.
set -euo pipefail
cd "$(dirname "$0")"
VENV=${MCORE_RESHARD_VENV:-.venv}

find_python() {
  for cand in "${PYTHON:-}" python3.12; do
    [ -n "$cand" ] || continue
    if PYENV_VERSION=3.12.1 "$cand" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
      echo "$cand"; return 0
    fi
  done
  echo "error: Python 3.12 is needed (megatron-core >= 0.17); set PYTHON=/path/to/python3.12" >&2
  return 1
}

setup() {
  if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c 'import mcore_reshard, megatron.core, pytest, hypothesis, transformers' 2>/dev/null; then
    return 0
  fi
  py=$(find_python)
  echo "[dev.sh] creating $VENV with $py (torch 2.13.0 + megatron-core 0.19.2: ~2 min, ~5 GB)" >&2
  PYENV_VERSION=3.12.1 "$py" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip 2>&1 | grep -v '^WARNING: Location' || true
  "$VENV/bin/pip" install -q torch==2.13.0 2>&1 | grep -v '^WARNING: Location' || true
  "$VENV/bin/pip" install -q -e ".[megatron,test]" 2>&1 | grep -v '^WARNING: Location' || true
  "$VENV/bin/python" -c 'import mcore_reshard, megatron.core, pytest, hypothesis, transformers'
}

cmd=${1:-}
shift || true
case "$cmd" in
  demo) setup; exec "$VENV/bin/mcore-reshard" demo "$@" ;;
  test) setup; exec "$VENV/bin/python" -m pytest -q -rs "$@" ;;
  setup) setup ;;
  *) echo "usage: ./dev.sh demo|test|setup [args]" >&2; exit 2 ;;
esac
