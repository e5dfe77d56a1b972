#!/usr/bin/env bash
# Session 23 call 2 (one H200): the tiled GEMM's defaults back to separate slices (SWAP 1; call 1's joined default
# was slower end to end); its tile sweep at 64 and 16 rows, each candidate logged and the JSON written row by row
# (call 1's sweep timed out before its JSON); the 8B GPTQ decode at batch 64 on the defaults; which profilers exist.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONPATH=.
export TRITON_CACHE_DIR=$PWD/build/triton-cache
(which ncu nsys; ls /usr/local/cuda*/bin 2>/dev/null | grep -iE "ncu|nsys|nsight") > $OUT/profilers.txt 2>&1
timeout 200 python3 -m bench w4a16_gemm --rows 64,16 --sweep --formats tiled --pdl \
  --json $OUT/gemm_sweep.json > $OUT/gemm_sweep.log 2>&1
echo "sweep rc=$? at ${SECONDS}s"; grep -vE "^  " $OUT/gemm_sweep.log | tail -n 9
timeout 130 python3 -m bench model_shapes --models llama-3.1-8b --batches 64 --quantization gptq \
  --run-timeout-s 120 --json $OUT/e2e_8b_gptq.json > $OUT/e2e_8b_gptq.log 2>&1
echo "e2e gptq rc=$? at ${SECONDS}s"; grep -E "^\| llama" $OUT/e2e_8b_gptq.log | tail -n 1
cat $OUT/profilers.txt
