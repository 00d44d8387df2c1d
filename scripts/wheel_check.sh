#!/usr/bin/env bash
# The wheel, as a user gets it (issue 48): built from a clean checkout of what is committed,
# installed in a fresh virtual environment with nothing of the repository, it answers
# `ciuic --version` and runs `ciuic demo` (train, SIGKILL, resume, bit-identical, else exit 1),
# in a folder of its own. CI runs it after the tests (.ci/run); about 1.5 minutes.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
export PIP_CONSTRAINT="$root/scripts/constraints.txt" PIP_DISABLE_PIP_VERSION_CHECK=1
git clone --quiet "$root" "$work/checkout"
python3 -m venv "$work/build-env"
"$work/build-env/bin/python" -m pip install --quiet build 2>&1 | grep -v "^WARNING: Location" || true
(cd "$work/checkout" && "$work/build-env/bin/python" -m build --wheel --outdir "$work/dist" >/dev/null)
wheel=$(ls "$work"/dist/ciuic-*.whl)
echo "wheel-check: built $(basename "$wheel")"
python3 -m venv "$work/fresh"
"$work/fresh/bin/python" -m pip install --quiet "$wheel" "torch==2.13.0" 2>&1 \
  | grep -v "^WARNING: Location" || true
mkdir "$work/elsewhere"
cd "$work/elsewhere"  # no repository here: the installed wheel alone
"$work/fresh/bin/python" -c 'import ciuic, sys; sys.exit(0 if "/fresh/" in ciuic.__file__ else 1)'
"$work/fresh/bin/ciuic" --version
"$work/fresh/bin/ciuic" demo
echo "wheel-check: the wheel installs and runs its demo without the repository"
