#!/usr/bin/env bash
# Session 23 call 5 (one H200): the separate-slice GEMM tiles load each tile's scale and zero a tile ahead (call 4's
# profile: long-scoreboard stalls; the compiler had left those loads unpipelined). GPU tests; the default tiles at
# 16 and 64 rows; a profile of gate_up at 64 rows; the 8B decode at batch 1 and 64 (GPTQ).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONPATH=.
export TRITON_CACHE_DIR=$PWD/build/triton-cache
python3 -m pip install -q --no-deps build/wheels-cp312/*.whl > /tmp/pip.log 2>&1
timeout 120 python3 -m pytest -q -o addopts='' -p no:cacheprovider -rs tests/kernels/test_w4a16_gemm.py \
  tests/models/test_int4.py tests/models/test_int4_models.py > $OUT/tests.log 2>&1
echo "tests rc=$? at ${SECONDS}s"; grep -E "passed|failed|^FAILED|^ERROR" $OUT/tests.log | tail -n 8
timeout 120 python3 -m bench w4a16_gemm --rows 64,16 --formats tiled --pdl --json $OUT/gemm.json > $OUT/gemm.log 2>&1
echo "gemm rc=$? at ${SECONDS}s"; tail -n 8 $OUT/gemm.log
timeout 90 ncu --set full -k regex:w4a16 --launch-skip 2 --launch-count 1 -f -o /tmp/ncu_64_gate_up \
  python3 -m bench w4a16_gemm --once 64:gate_up > /tmp/ncu.log 2>&1
ncu --import /tmp/ncu_64_gate_up.ncu-rep --page raw 2>&1 | grep -E "gpu__time_duration.sum|smsp__average_warps_issue_stalled_.*_per_issue_active" \
  | sort -k3 -g -r | head -n 8 > $OUT/ncu_64_gate_up_stalls.txt
cat $OUT/ncu_64_gate_up_stalls.txt | awk '{print $1, $NF}' | head -n 6
timeout 150 python3 -m bench model_shapes --models llama-3.1-8b --batches 1,64 --quantization gptq \
  --run-timeout-s 140 --json $OUT/e2e_8b_gptq.json > $OUT/e2e_8b_gptq.log 2>&1
echo "e2e gptq rc=$? at ${SECONDS}s"; grep -E "^\| llama" $OUT/e2e_8b_gptq.log | tail -n 2
