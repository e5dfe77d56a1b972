#!/usr/bin/env bash
# Session 21 call 4 (2x H200): 4-bit (GPTQ) checkpoints under tensor parallelism, random weights of the 8B and 70B
# shapes in the 4-bit layout (8B and 70B at TP=2), and the 8B shape quantized to FP8 at load at TP=2.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONPATH=.
export TRITON_CACHE_DIR=$PWD/build/triton-cache
python3 -m pip install -q --no-deps build/wheels-cp312/*.whl > $OUT/pip.log 2>&1
nvidia-smi --query-gpu=name --format=csv > $OUT/env.txt; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >> $OUT/env.txt
run() { # name timeout args...
  local name=$1 limit=$2; shift 2
  timeout "$limit" python3 -m bench model_shapes --quantization gptq --batches 1,64 --json "$OUT/$name.json" "$@" > "$OUT/$name.log" 2>&1
  echo "$name rc=$? at ${SECONDS}s"; grep -E "^\|" "$OUT/$name.log" | tail -n 4
}
run gptq8b_tp2 150 --models llama-3.1-8b --tensor-parallel-size 2
run gptq70b_tp2 190 --models llama-3.1-70b --tensor-parallel-size 2
run() { local name=$1 limit=$2; shift 2
  timeout "$limit" python3 -m bench model_shapes --batches 1,64 --json "$OUT/$name.json" "$@" > "$OUT/$name.log" 2>&1
  echo "$name rc=$? at ${SECONDS}s"; grep -E "^\|" "$OUT/$name.log" | tail -n 4; }
run fp8_8b_tp2 150 --models llama-3.1-8b --quantization fp8 --tensor-parallel-size 2
