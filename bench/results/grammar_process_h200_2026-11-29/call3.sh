#!/usr/bin/env bash
# Session 25 call 3 (one H200): as call 2, the grammar process now timing its steps (hand-over, post to start, work): structured output with the matchers in the grammar process (on, the new CUDA
# default) against the worker thread of session 24 (off), interleaved, and a lower bound (--skip-grammar-work: grammar
# rows whose matchers are never advanced nor filled). The CUDA tests of the structured path first.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONPATH=.
export TRITON_CACHE_DIR=$PWD/build/triton-cache
python3 -m pip install -q --no-deps build/wheels-cp312/*.whl > /tmp/pip.log 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > $OUT/env.txt
nproc >> $OUT/env.txt; uptime >> $OUT/env.txt; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >> $OUT/env.txt
cat $OUT/env.txt
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/engine/test_structured_cuda.py > $OUT/tests.log 2>&1
echo "tests rc=$? at ${SECONDS}s"; tail -n 2 $OUT/tests.log
common="--tokenizer build/smollm2-tokenizer --models smollm2-135m --max-num-batched-tokens 2048"
timeout 100 python3 -m bench.structured_throughput $common --quick --out-dir /tmp/warm > /tmp/warm.log 2>&1
echo "warm-up rc=$? at ${SECONDS}s"; tail -n 3 /tmp/warm.log
for run in p1 t1 p2 t2 p3; do
  [ $SECONDS -gt 470 ] && break
  case $run in
    p*) flags="--grammar-process on" ;;
    t*) flags="--grammar-process off" ;;
    s*) flags="--grammar-process off --skip-grammar-work" ;;
    q*) flags="--grammar-process on --switch-interval-ms 0.1" ;;
  esac
  timeout 100 python3 -m bench.structured_throughput $common $flags --tag _$run --out-dir /tmp/s \
    >> $OUT/structured.log 2>&1
  echo "$run rc=$? at ${SECONDS}s"; tail -n 1 /tmp/s/structured_throughput_h200_$run.md
done
cd /tmp/s && tar czf $OUT/structured_json.tgz *.json
