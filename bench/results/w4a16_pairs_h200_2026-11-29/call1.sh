#!/usr/bin/env bash
# Session 22 call 1 (one H200): the fused-MoE GPU tests after their fix (kernel on the CUDA device; bf16 measured
# against the float32 torch path), the GEMV's split-K sweep at 8 and 4 packed rows a load, and the structured
# throughput at GIL switch intervals of 0.5, 0.2 and 0.1 ms.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONPATH=.
export TRITON_CACHE_DIR=$PWD/build/triton-cache
python3 -m pip install -q --no-deps build/wheels-cp312/*.whl > $OUT/pip.log 2>&1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $OUT/env.txt
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >> $OUT/env.txt
timeout 200 python3 -m pytest -q -o addopts='' -p no:cacheprovider -rs tests/models/test_quantized_experts.py \
  tests/kernels/test_w4a16_gemv.py > $OUT/tests.log 2>&1
echo "tests rc=$? at ${SECONDS}s"; grep -E "passed|failed|^FAILED|^ERROR" $OUT/tests.log | tail -n 8
for rows in 8 4; do
  timeout 150 python3 -m bench w4a16_gemm --rows 1 --gemv-sweep --pdl --gemv-rows $rows \
    --json $OUT/gemv_sweep_rows$rows.json > $OUT/gemv_sweep_rows$rows.log 2>&1
  echo "gemv rows=$rows rc=$? at ${SECONDS}s"; tail -n 5 $OUT/gemv_sweep_rows$rows.log
done
for ms in 0.5 0.2 0.1; do
  timeout 110 python3 -m bench.structured_throughput --tokenizer build/smollm2-tokenizer --models smollm2-135m \
    --max-num-batched-tokens 2048 --switch-interval-ms $ms --out-dir $OUT --tag _switch$ms > $OUT/structured_$ms.log 2>&1
  echo "structured ${ms}ms rc=$? at ${SECONDS}s"; grep -iE "ratio|tok/s" $OUT/structured_$ms.log | tail -n 4
done
