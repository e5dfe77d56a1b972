#!/usr/bin/env bash
# Session 21 call 5 (one H200): the W4A16 kernel and Int4Linear GPU tests after the act-order shard change
# (a GEMM on a shard's rows with every group's scales; Int4Linear num_groups).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONPATH=.
export TRITON_CACHE_DIR=$PWD/build/triton-cache
python3 -m pip install -q --no-deps build/wheels-cp312/*.whl > $OUT/pip.log 2>&1
timeout 400 python3 -m pytest -q -o addopts='' -p no:cacheprovider -rs tests/kernels/test_w4a16_gemm.py \
  tests/models/test_int4.py tests/engine/test_parallel_loading.py > $OUT/w4a16_tests.log 2>&1
echo "tests rc=$? at ${SECONDS}s"; grep -E "passed|failed|^FAILED|^ERROR" $OUT/w4a16_tests.log | tail -n 8
