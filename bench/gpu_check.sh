#!/usr/bin/env bash
# GPU check of the Triton attention kernels: the kernel tests (bf16 shapes, offsets past 2^31,
# CUDA-graph replay; compiled, not interpreted), then bench/kernels.py. Installs nothing.
#
#   OUT=/tmp/out bash bench/gpu_check.sh          # from the repo root on the GPU machine
#   SWEEP=1 ...                                   # also time alternative tilings (slower)
#
# Logs and the benchmark JSON go under $OUT; a short summary is printed last.
set -uo pipefail
OUT=${OUT:-bench/results/gpu-run}
mkdir -p "$OUT"
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-build/triton-cache}  # kept between runs on a warm machine

{
  nvidia-smi
  python3 -c "import sys, torch, triton; print(sys.version); print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
} > "$OUT/env.txt" 2>&1

if python3 -c "import pytest" 2> /dev/null; then
  # -o addopts='': the repo's addopts need pytest-timeout; --confcutdir: tests/conftest.py needs redis.
  # Neither exists on a bare GPU box.
  timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -o addopts='' -p no:cacheprovider -rs --confcutdir=tests/kernels tests/kernels \
    > "$OUT/tests.log" 2>&1
else
  timeout "${TEST_TIMEOUT:-300}" python3 tests/kernels/test_gpu.py > "$OUT/tests.log" 2>&1
fi
test_rc=$?

timeout "${BENCH_TIMEOUT:-300}" python3 bench/kernels.py ${SWEEP:+--sweep} --json "$OUT/kernels.json" \
  > "$OUT/bench.log" 2>&1
bench_rc=$?

head -n 12 "$OUT/env.txt" | grep -E "NVIDIA|torch" || true
echo "--- tests (rc=$test_rc)"
tail -n 15 "$OUT/tests.log"
echo "--- bench (rc=$bench_rc)"
grep -E "^  sweep" "$OUT/bench.log" || true
tail -n 8 "$OUT/bench.log"
