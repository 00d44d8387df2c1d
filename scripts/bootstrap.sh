#!/usr/bin/env bash
# Create (or refresh) the development virtual environment in .venv.
# Idempotent: re-running only installs what changed. Used by `make demo`, `make test` and .ci/run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "creating the virtual environment in .venv ..."
  "$PY" -m venv .venv
fi
stamp=.venv/.ciuic-installed
want=$(cat pyproject.toml scripts/bootstrap.sh scripts/constraints.txt | sha256sum | cut -c1-16)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "installing ciuic and its development tools into .venv (a minute on a fresh clone) ..."
  .venv/bin/python -m pip install --quiet --upgrade pip
  # Every install below is held to the versions the suite last passed with (scripts/lock.sh),
  # so a new release on the registry cannot break a clean clone.
  export PIP_CONSTRAINT="$PWD/scripts/constraints.txt"
  # The dev/CI pin: a CPU build of torch that this machine installs from local files.
  .venv/bin/python -m pip install --quiet "torch==2.13.0"
  .venv/bin/python -m pip install --quiet -e ".[dev]"
  # torchtitan (Python 3.11+) on its own: resolved together with the dev extra, pip's
  # resolver backtracks for many minutes; against what is installed it resolves at once
  if "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    .venv/bin/python -m pip install --quiet "torchtitan==0.3.0"
  fi
  # megatron-core for tests/test_megatron.py (one 2.6 MB wheel, ~2 s; its deps are installed
  # already); psutil, which it does not declare, or its dist_checkpointing.save hangs
  .venv/bin/python -m pip install --quiet "megatron-core==0.16.1" psutil
  echo "$want" > "$stamp"
  echo ".venv is ready"
fi
# ciuic's own bytecode, written once (only what changed since): where PYTHONDONTWRITEBYTECODE is
# set, as on the development VM, every process compiled ciuic's modules again, 0.3 of the 4 s
# that `import ciuic.manager` took there, and the test suite starts a process a second or so
.venv/bin/python -m compileall -q -j 0 src tests >/dev/null
