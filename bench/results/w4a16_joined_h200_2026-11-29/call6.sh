#!/usr/bin/env bash
# Session 23 call 6 (one H200): the 4-bit model, fused-QKV, quant-family and random-quantized tests on the GPU with
# this session's GEMM tiles and scale prefetch (every Int4Linear at 2-64 rows takes them).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONPATH=.
export TRITON_CACHE_DIR=$PWD/build/triton-cache
python3 -m pip install -q --no-deps build/wheels-cp312/*.whl > /tmp/pip.log 2>&1
timeout 250 python3 -m pytest -q -o addopts='' -p no:cacheprovider -rs tests/models/test_random_quantized.py \
  tests/models/test_int4_moe.py tests/models/test_fused_qkv_quantized.py tests/models/test_quant_families.py \
  tests/models/test_compressed_tensors.py tests/models/test_compressed_tensors_library.py > $OUT/tests.log 2>&1
echo "tests rc=$? at ${SECONDS}s"; grep -E "passed|failed|^FAILED|^ERROR" $OUT/tests.log | tail -n 12
