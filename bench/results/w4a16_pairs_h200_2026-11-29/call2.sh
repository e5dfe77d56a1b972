#!/usr/bin/env bash
# Session 22 call 2 (one H200): structured throughput (SmolLM2 shape, 256 x 512 x 256, half json_schema) at GIL
# switch intervals of 0.5 (the engine's), 0.2 and 0.1 ms. Call 1's runs lacked xgrammar 0.2.9's tvm_ffi wheel.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONPATH=.
export TRITON_CACHE_DIR=$PWD/build/triton-cache
python3 -m pip install -q --no-deps build/wheels-cp312/*.whl > $OUT/pip.log 2>&1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $OUT/env.txt
for ms in 0.5 0.2 0.1 0.5; do
  timeout 130 python3 -m bench.structured_throughput --tokenizer build/smollm2-tokenizer --models smollm2-135m \
    --max-num-batched-tokens 2048 --switch-interval-ms $ms --out-dir $OUT --tag _switch${ms}_$SECONDS > $OUT/structured_${ms}_$SECONDS.log 2>&1
  echo "structured ${ms}ms rc=$? at ${SECONDS}s"
done
grep -h -iE "ratio" $OUT/structured_*.log | tail -n 12
