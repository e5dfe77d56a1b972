#!/usr/bin/env bash
# Session 24 call 5 (one H200): the engine's accept holding the GIL through its C++ (matcher_calls.HOLD_GIL, the
# default) against releasing it (--accept-releases-gil; the result is read in one held call either way),
# interleaved twice after a warm-up. All-plain, mixed and all-json each run.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONPATH=.
export TRITON_CACHE_DIR=$PWD/build/triton-cache
python3 -m pip install -q --no-deps build/wheels-cp312/*.whl > /tmp/pip.log 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > $OUT/env.txt
nproc >> $OUT/env.txt; uptime >> $OUT/env.txt; cat $OUT/env.txt
common="--tokenizer build/smollm2-tokenizer --models smollm2-135m --max-num-batched-tokens 2048"
timeout 100 python3 -m bench.structured_throughput $common --quick --out-dir /tmp/warm > /tmp/warm.log 2>&1
echo "warm-up rc=$? at ${SECONDS}s"
for run in r1_hold r2_release r3_hold r4_release; do
  flag=""; case $run in *release) flag="--accept-releases-gil";; esac
  timeout 100 python3 -m bench.structured_throughput $common $flag --tag _$run --out-dir /tmp/s >> $OUT/structured.log 2>&1
  echo "$run rc=$? at ${SECONDS}s"; tail -n 1 /tmp/s/structured_throughput_h200_$run.md
  cp /tmp/s/structured_throughput_h200_$run.json $OUT/
done
