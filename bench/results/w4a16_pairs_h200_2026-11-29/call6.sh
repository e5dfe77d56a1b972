#!/usr/bin/env bash
# Session 22 call 6 (one H200): the structured-output ratio with xgrammar's mask filling on 1 and 4 threads,
# alternated, four runs each (GIL switch interval 0.5 ms, the engine's).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONPATH=.
export TRITON_CACHE_DIR=$PWD/build/triton-cache
python3 -m pip install -q --no-deps build/wheels-cp312/*.whl > $OUT/pip.log 2>&1
nproc > $OUT/env.txt
mkdir -p $OUT/structured
for round in 1 2 3 4; do
  for threads in 1 4; do
    timeout 60 python3 -m bench.structured_throughput --tokenizer build/smollm2-tokenizer --models smollm2-135m \
      --max-num-batched-tokens 2048 --fill-threads $threads --out-dir $OUT/structured --tag _t${threads}_r$round \
      > $OUT/structured/run_t${threads}_r$round.log 2>&1
    echo "threads $threads r$round rc=$? at ${SECONDS}s $(grep -E '^\| smollm2' $OUT/structured/run_t${threads}_r$round.log | cut -d'|' -f3-8)"
  done
done
rm -f $OUT/structured/*.md; tar czf $OUT/structured.tgz -C $OUT structured && rm -rf $OUT/structured
