#!/usr/bin/env bash
# Session 23 call 7 (one H200): the W4A16 GEMM's split trimming on the GPU (its orientation/split tests); Nsight
# Compute on the prefill attention (issue 23's prefill goal): the engine's kernel against SDPA's default on the 8 x
# 2048 (32/8, d128) and SmolLM2 (16 x 512, 9/3, d64) shapes, durations, throughputs and stall reasons.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONPATH=.
export TRITON_CACHE_DIR=$PWD/build/triton-cache
python3 -m pip install -q --no-deps build/wheels-cp312/*.whl > /tmp/pip.log 2>&1
timeout 60 python3 -m pytest -q -o addopts='' -p no:cacheprovider tests/kernels/test_w4a16_gemm.py -k orientations \
  > $OUT/tests.log 2>&1
echo "tests rc=$? at ${SECONDS}s"; grep -E "passed|failed|^FAILED|^ERROR" $OUT/tests.log | tail -n 4
for shape in "prefill 8x2048" "smollm2 prefill 16x512"; do
  tag=$(echo $shape | tr ' ' '_')
  timeout 60 ncu --set full -k regex:"prefill|fmha|flash|cudnn|sdpa" --launch-skip 2 --launch-count 2 -f \
    -o /tmp/ncu_$tag python3 -m bench kernels --once "$shape" > /tmp/ncu_$tag.log 2>&1
  echo "ncu $shape rc=$? at ${SECONDS}s"
  ncu --import /tmp/ncu_$tag.ncu-rep --page raw 2>&1 | grep -E ", Context [0-9]|gpu__time_duration.sum |sm__throughput.avg.pct_of_peak_sustained_elapsed |sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active |sm__warps_active.avg.pct_of_peak_sustained_active |launch__registers_per_thread |launch__grid_size |launch__block_size |smsp__average_warps_issue_stalled_.*_per_issue_active" > $OUT/ncu_$tag.txt
  grep -E ", Context|gpu__time_duration.sum |tensor_op_hmma" $OUT/ncu_$tag.txt | cut -c1-150
done
