#!/usr/bin/env bash
# Session 23 call 3 (one H200): per-shape tiled GEMM defaults at <= 64 rows (64 columns with the slices joined where
# the 128-column tiles are few; the auto split at 16 rows on gate_up): GPU tests; Nsight Compute profiles of the
# served kernels on the 8B gate_up at 64 rows (GEMM) and 1 row (GEMV) and down at 64 rows; the 8B decode at batch
# 1 and 64 (GPTQ) and 64 (bf16).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONPATH=.
export TRITON_CACHE_DIR=$PWD/build/triton-cache
python3 -m pip install -q --no-deps build/wheels-cp312/*.whl > /tmp/pip.log 2>&1
timeout 120 python3 -m pytest -q -o addopts='' -p no:cacheprovider -rs tests/kernels/test_w4a16_gemm.py \
  tests/models/test_int4.py > $OUT/tests.log 2>&1
echo "tests rc=$? at ${SECONDS}s"; grep -E "passed|failed|^FAILED|^ERROR" $OUT/tests.log | tail -n 8
for once in 64:gate_up 64:down 1:gate_up; do
  tag=${once/:/_}
  timeout 90 ncu --set full -k regex:w4a16 --launch-skip 2 --launch-count 1 -f -o /tmp/ncu_$tag \
    python3 -m bench w4a16_gemm --once $once > /tmp/ncu_$tag.log 2>&1
  echo "ncu $once rc=$? at ${SECONDS}s"
  (tail -n 5 /tmp/ncu_$tag.log; ncu --import /tmp/ncu_$tag.ncu-rep --page details) > $OUT/ncu_$tag.txt 2>&1
  grep -E "Duration|Memory Throughput|Compute \(SM\) Throughput|Achieved Occupancy|Registers Per" $OUT/ncu_$tag.txt | head -n 6
done
timeout 150 python3 -m bench model_shapes --models llama-3.1-8b --batches 1,64 --quantization gptq \
  --run-timeout-s 140 --json $OUT/e2e_8b_gptq.json > $OUT/e2e_8b_gptq.log 2>&1
echo "e2e gptq rc=$? at ${SECONDS}s"; grep -E "^\| llama" $OUT/e2e_8b_gptq.log | tail -n 2
timeout 120 python3 -m bench model_shapes --models llama-3.1-8b --batches 64 --quantization none \
  --run-timeout-s 110 --json /tmp/e2e_8b_none.json > $OUT/e2e_8b_none.log 2>&1
echo "e2e none rc=$? at ${SECONDS}s"; grep -E "^\| llama" $OUT/e2e_8b_none.log | tail -n 1
