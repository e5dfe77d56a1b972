#!/usr/bin/env bash
# Session 24 call 3 (one H200): the held accept at GIL switch intervals of 0.5 (the engine's), 0.2 and 0.1 ms, in
# turn, twice (call 2 saw the same code give 0.735 and 0.906 in two runs). All-plain, mixed and all-json each run.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONPATH=.
export TRITON_CACHE_DIR=$PWD/build/triton-cache
python3 -m pip install -q --no-deps build/wheels-cp312/*.whl > /tmp/pip.log 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > $OUT/env.txt
nproc >> $OUT/env.txt; uptime >> $OUT/env.txt; cat $OUT/env.txt
common="--tokenizer build/smollm2-tokenizer --models smollm2-135m --max-num-batched-tokens 2048"
timeout 100 python3 -m bench.structured_throughput $common --quick --out-dir /tmp/warm > /tmp/warm.log 2>&1
echo "warm-up rc=$? at ${SECONDS}s"
for run in a_0.5 b_0.2 c_0.1 d_0.5 e_0.2 f_0.1; do
  ms=${run#*_}
  timeout 100 python3 -m bench.structured_throughput $common --switch-interval-ms $ms --tag _$run --out-dir /tmp/s \
    >> $OUT/structured.log 2>&1
  echo "$run rc=$? at ${SECONDS}s"; tail -n 1 /tmp/s/structured_throughput_h200_$run.md
  cp /tmp/s/structured_throughput_h200_$run.json $OUT/
done
