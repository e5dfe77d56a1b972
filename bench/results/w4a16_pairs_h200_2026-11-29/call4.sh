#!/usr/bin/env bash
# Session 22 call 4 (one H200): the W4A16 GEMV with the pair magic as an argument (one LOP3 an and-or): GPU tests,
# the one-row sweep at 8 and 4 packed rows a load, and the 8B GPTQ decode at batch 1.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONPATH=.
export TRITON_CACHE_DIR=$PWD/build/triton-cache
python3 -m pip install -q --no-deps build/wheels-cp312/*.whl > $OUT/pip.log 2>&1
timeout 150 python3 -m pytest -q -o addopts='' -p no:cacheprovider -rs tests/kernels/test_w4a16_gemv.py \
  tests/models/test_int4.py > $OUT/tests.log 2>&1
echo "tests rc=$? at ${SECONDS}s"; grep -E "passed|failed|^FAILED|^ERROR" $OUT/tests.log | tail -n 8
for rows in 8 4; do
  timeout 120 python3 -m bench w4a16_gemm --rows 1 --gemv-sweep --pdl --gemv-rows $rows \
    --json $OUT/gemv_sweep_rows$rows.json > $OUT/gemv_sweep_rows$rows.log 2>&1
  echo "gemv rows=$rows rc=$? at ${SECONDS}s"; tail -n 4 $OUT/gemv_sweep_rows$rows.log
done
timeout 200 python3 -m bench model_shapes --models llama-3.1-8b --batches 1 --quantization gptq --kernel-profile 8 \
  --run-timeout-s 180 --json $OUT/e2e_8b_gptq.json > $OUT/e2e_8b_gptq.log 2>&1
echo "e2e gptq rc=$? at ${SECONDS}s"; grep -E "llama" $OUT/e2e_8b_gptq.log | tail -n 1
