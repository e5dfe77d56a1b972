#!/usr/bin/env bash
# Session 21 call 6 (one H200; no 2-GPU machine lent): GPU tests of the quantized single-GPU paths after the review
# refactors (one decoder-linear swap for one GPU and for shards, one row-parallel contract).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONPATH=.
export TRITON_CACHE_DIR=$PWD/build/triton-cache
python3 -m pip install -q --no-deps build/wheels-cp312/*.whl > $OUT/pip.log 2>&1
timeout 330 python3 -m pytest -q -o addopts='' -p no:cacheprovider -rs tests/models/test_int4.py tests/models/test_gpu_fp8.py \
  tests/models/test_int4_models.py tests/models/test_quantized_experts.py tests/models/test_random_quantized.py \
  tests/engine/test_parallel_loading.py > $OUT/review_tests.log 2>&1
echo "tests rc=$? at ${SECONDS}s"; grep -E "passed|failed|^FAILED|^ERROR" $OUT/review_tests.log | tail -n 8
