#!/usr/bin/env bash
# The GPU checks, as one prepared run on a lent machine (the device tool's `run`):
#   scripts/device_wheels.sh                       # here, first: wheels into .whl/
#   run: command "bash scripts/device_check.sh", carry [".whl"], timeout_s 480
# Steps: install the carried wheels, describe the machine, the CUDA tests (tests/test_cuda.py,
# Megatron's tests/test_cuda_megatron.py, in-process recovery's NCCL abort in
# tests/test_cuda_inprocess.py) and a few CPU suites on that machine's torch, then the
# GPU benchmark (bench/run.py --state h200: stall into pinned buffers on a side stream, durable,
# restore into device tensors, beside dcp.async_save and torch.save on the same GPU) within
# BENCH_DEADLINE_S. One JSON, $OUT/device-check.json (scripts/device_report.py), holds every
# step's status and time, the tests' counts and failures, and the benchmark's results; the logs
# lie beside it. Where a GPU is present the CUDA tests must run: CIUIC_REQUIRE_CUDA=1 turns their
# skip into a failure, and any failed step fails the run, named on its last line.
# The dry run here, on the CPU (tests/test_device_check.py runs it):
#   OUT=/tmp/dev PATH=.venv/bin:$PATH WHEELS=none BENCH_ARGS="--device cpu --scale 16" \
#       bash scripts/device_check.sh
set -uo pipefail
OUT=${OUT:-/tmp/ciuic-device}
mkdir -p "$OUT"
: > "$OUT/steps.tsv"
export PYTHONUNBUFFERED=1
# the CUDA tests, Megatron's GPU test, then CPU suites whose code paths the GPU run shares
TESTS=${DEVICE_TESTS:-tests/test_cuda.py tests/test_cuda_megatron.py \
tests/test_cuda_inprocess.py tests/test_engine.py tests/test_overlap.py tests/test_floatcodec.py \
tests/test_unchanged.py}

step() {  # step NAME LOGFILE COMMAND...: run it, its output to the terminal and to LOGFILE
    local name=$1 log=$2 start rc
    shift 2
    echo "=== $name"
    start=$(date +%s%N)
    "$@" 2>&1 | tee "$OUT/$log"
    rc=${PIPESTATUS[0]}
    printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$((($(date +%s%N) - start) / 1000000))" "$log" \
        >> "$OUT/steps.tsv"
    return "$rc"
}

install_wheels() {
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl
}

describe() {
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv \
        || echo "nvidia-smi: no GPU here"
    python3 -c 'import torch, sys; print(sys.version); print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.is_available())'
    nproc; free -g; df -hT /tmp "$PWD"
}

if [ "${WHEELS:-.whl}" != none ]; then
    step wheels wheels.log install_wheels
fi
export PYTHONPATH=/tmp/site:$PWD/src:$PWD
if nvidia-smi -L >/dev/null 2>&1; then
    export CIUIC_REQUIRE_CUDA=1  # a GPU is here: a CUDA test that would skip fails instead
fi
step machine machine.txt describe
# shellcheck disable=SC2086  # TESTS and BENCH_ARGS are lists of words
step tests tests.log python3 -m pytest -q -p no:cacheprovider --timeout 240 \
    --junitxml="$OUT/tests.xml" $TESTS
BENCH_DIR=${BENCH_DIR:-$PWD/.bench-tmp}  # on the checkout's disk, not a RAM /tmp
# shellcheck disable=SC2086
step bench bench-h200.log env PYTHONWARNINGS=ignore python3 bench/run.py --state h200 \
    --rounds "${BENCH_ROUNDS:-3}" --deadline-s "${BENCH_DEADLINE_S:-240}" ${BENCH_ARGS:-} \
    --dir "$BENCH_DIR" --json "$OUT/bench-h200.json"
rm -rf "$BENCH_DIR"
python3 scripts/device_report.py "$OUT" ${CIUIC_REQUIRE_CUDA:+--gpu}
