#!/usr/bin/env bash
# Session 22 call 3 (one H200): the W4A16 GEMV unpacking two codes per and-or (_biased_pair): its GPU tests, the
# kernel sweep at one row, and Llama-3.1-8B-shape decode at batch 1, GPTQ against bf16, on the same machine.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONPATH=.
export TRITON_CACHE_DIR=$PWD/build/triton-cache
python3 -m pip install -q --no-deps build/wheels-cp312/*.whl > $OUT/pip.log 2>&1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $OUT/env.txt
timeout 200 python3 -m pytest -q -o addopts='' -p no:cacheprovider -rs tests/kernels/test_w4a16_gemv.py \
  tests/kernels/test_w4a16_gemm.py tests/models/test_int4.py > $OUT/tests.log 2>&1
echo "tests rc=$? at ${SECONDS}s"; grep -E "passed|failed|^FAILED|^ERROR" $OUT/tests.log | tail -n 8
timeout 120 python3 -m bench w4a16_gemm --rows 1 --gemv-sweep --pdl --json $OUT/gemv_sweep_pairs.json > $OUT/gemv_sweep_pairs.log 2>&1
echo "gemv rc=$? at ${SECONDS}s"; tail -n 5 $OUT/gemv_sweep_pairs.log
for q in gptq none; do
  timeout 200 python3 -m bench model_shapes --models llama-3.1-8b --batches 1 --quantization $q --kernel-profile 8 \
    --run-timeout-s 180 --json $OUT/e2e_8b_$q.json > $OUT/e2e_8b_$q.log 2>&1
  echo "e2e $q rc=$? at ${SECONDS}s"; grep -E "tok/s|llama" $OUT/e2e_8b_$q.log | tail -n 3
done
