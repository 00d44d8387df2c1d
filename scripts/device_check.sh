#!/usr/bin/env bash
# The GPU checks, as one prepared run on a lent machine (the device tool's `run`):
#   scripts/device_wheels.sh                       # here, first: wheels into .whl/
#   run: command "bash scripts/device_check.sh", carry [".whl"], timeout_s 420
# It installs the carried wheels, runs the CUDA tests and a few CPU suites on that machine's
# torch, then the H200 benchmark (bench/run.py --state h200), within BENCH_DEADLINE_S.
# Everything it prints also lands in $OUT (what comes back from the machine).
set -uo pipefail
OUT=${OUT:-/tmp/ciuic-device}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# a dry run here on the CPU: PATH=.venv/bin:$PATH WHEELS=none BENCH_ARGS="--device cpu --scale 16"
if [ "${WHEELS:-.whl}" != none ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || { echo "installing the carried wheels failed"; exit 1; }
fi
export PYTHONPATH=/tmp/site:$PWD/src:$PWD
{
    date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 -c 'import torch, sys; print(sys.version); print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.is_available())'
    nproc; free -g; df -hT /tmp "$PWD"
} 2>&1 | tee "$OUT/machine.txt"
python3 -m pytest -q -p no:cacheprovider --timeout 240 tests/test_cuda.py tests/test_engine.py \
    tests/test_overlap.py tests/test_floatcodec.py tests/test_unchanged.py \
    tests/test_cuda_megatron.py 2>&1 | tee "$OUT/tests.log"
tests=${PIPESTATUS[0]}
BENCH_DIR=${BENCH_DIR:-$PWD/.bench-tmp}  # on the checkout's disk, not a RAM /tmp
PYTHONWARNINGS=ignore python3 bench/run.py --state h200 --rounds "${BENCH_ROUNDS:-3}" --deadline-s "${BENCH_DEADLINE_S:-240}" \
    ${BENCH_ARGS:-} --dir "$BENCH_DIR" --json "$OUT/bench-h200.json" 2>&1 | tee "$OUT/bench-h200.log"
bench=${PIPESTATUS[0]}
rm -rf "$BENCH_DIR"
echo "tests rc=$tests bench rc=$bench"
[ "$tests" = 0 ] && [ "$bench" = 0 ]
