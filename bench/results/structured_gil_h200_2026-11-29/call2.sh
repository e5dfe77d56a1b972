#!/usr/bin/env bash
# Session 24 call 2 (one H200): call 1's A/B ran each variant once, and the first process's host phases were ~2x
# slower than the second's on the same all-plain work. Here a warm-up run first, then the two accepts interleaved
# twice (held = matcher_calls.batch_accept, the engine's; xgr = xgrammar's own batched accept), then the held
# accept with 4 mask-filling threads. Each run: all-plain, mixed and all-json, SmolLM2 shape, 256 x 512 x 256.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONPATH=.
export TRITON_CACHE_DIR=$PWD/build/triton-cache
python3 -m pip install -q --no-deps build/wheels-cp312/*.whl > /tmp/pip.log 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > $OUT/env.txt
nproc >> $OUT/env.txt; uptime >> $OUT/env.txt; cat $OUT/env.txt
common="--tokenizer build/smollm2-tokenizer --models smollm2-135m --max-num-batched-tokens 2048"
timeout 100 python3 -m bench.structured_throughput $common --quick --out-dir /tmp/warm > /tmp/warm.log 2>&1
echo "warm-up rc=$? at ${SECONDS}s"
for run in r1_held r2_xgr r3_held r4_xgr r5_held_threads4; do
  flag=""
  case $run in *xgr) flag="--xgrammar-accept";; *threads4) flag="--fill-threads 4";; esac
  timeout 100 python3 -m bench.structured_throughput $common $flag --tag _$run --out-dir $OUT >> $OUT/structured.log 2>&1
  echo "$run rc=$? at ${SECONDS}s"; tail -n 2 $OUT/structured_throughput_h200_$run.md 2>/dev/null | tail -n 1
  rm -f $OUT/structured_throughput_h200_$run.md
done
