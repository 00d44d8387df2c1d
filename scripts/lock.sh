#!/usr/bin/env bash
# Regenerate scripts/constraints.txt from the working .venv, after `pip check` passes there.
# The dev/CI environment installs under these pins, so that CI resolves what was tested here
# and a release on the registry cannot break a clean clone (transformers 5.25 wanting
# huggingface-hub>=2.4 while torchtitan 0.3's datasets<4.8 wants <2 did, on 2026-12-03).
# The pins apply to the Python the environment was locked on; others resolve freely.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python -m pip check
py=$(.venv/bin/python -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
{
  echo "# Written by scripts/lock.sh from a .venv that passed the full suite; do not edit by hand."
  .venv/bin/python -m pip freeze --exclude-editable --all \
    | grep -v -i -E '^(ciuic|pip|setuptools|wheel)[=@ ]' \
    | sed -E 's/\+[a-z0-9.]+$//' \
    | sed -E "s/\$/ ; python_version == \"$py\"/"
} > scripts/constraints.txt
echo "scripts/constraints.txt: $(grep -c == scripts/constraints.txt) pins for Python $py"
