#!/usr/bin/env bash
# Fetch, here (PyPI is reachable here, not there), the wheels that the lent GPU machine lacks,
# into .whl/ (git-ignored), for its Python 3.12 on x86-64. The versions are the dev venv's.
# Then run scripts/device_check.sh there with `carry: [".whl"]` (see docs/benchmarks.md).
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
PY=.venv/bin/python
# what ciuic needs beyond what the device image has (torch, numpy, click, rich, pytest, ...)
names="blake3 zstandard SQLAlchemy alembic Mako cryptography cffi pycparser"
# tests/test_cuda_megatron.py: megatron-core (and psutil, which it does not declare), safetensors
names="$names megatron-core psutil safetensors"
rm -rf .whl && mkdir -p .whl
for name in $names; do
    version=$($PY -m pip show "$name" 2>/dev/null | sed -n 's/^Version: //p')
    [ -n "$version" ] || { echo "$name is not installed in .venv: run 'make test' once" >&2; exit 1; }
    $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform manylinux_2_34_x86_64 --platform manylinux_2_24_x86_64 \
        --platform manylinux1_x86_64 -d .whl "$name==$version"
done
ls -la .whl && du -sh .whl
