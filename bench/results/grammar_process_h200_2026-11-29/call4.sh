#!/usr/bin/env bash
# Session 25 call 4 (one H200; the device time left: ~260 s): the grammar process filling masks with up to 8 threads
# (the new default: half the cores) against one thread (--fill-threads 1), no tests, one warm-up.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONPATH=.
export TRITON_CACHE_DIR=$PWD/build/triton-cache
python3 -m pip install -q --no-deps build/wheels-cp312/*.whl > /tmp/pip.log 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > $OUT/env.txt
nproc >> $OUT/env.txt; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >> $OUT/env.txt
cat $OUT/env.txt
common="--tokenizer build/smollm2-tokenizer --models smollm2-135m --max-num-batched-tokens 2048"
timeout 70 python3 -m bench.structured_throughput $common --quick --out-dir /tmp/warm > /tmp/warm.log 2>&1
echo "warm-up rc=$? at ${SECONDS}s"
for run in p8 p1 p8b p1b; do
  [ $SECONDS -gt 150 ] && break
  case $run in
    p8*) flags="--grammar-process on" ;;
    p1*) flags="--grammar-process on --fill-threads 1" ;;
  esac
  timeout 60 python3 -m bench.structured_throughput $common $flags --tag _$run --out-dir /tmp/s \
    >> $OUT/structured.log 2>&1
  echo "$run rc=$? at ${SECONDS}s"; tail -n 1 /tmp/s/structured_throughput_h200_$run.md
  cp /tmp/s/structured_throughput_h200_$run.json $OUT/
done
