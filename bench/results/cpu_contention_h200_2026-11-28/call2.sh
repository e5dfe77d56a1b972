#!/usr/bin/env bash
# Session 20 call 2: served runs of the same code: default, server and clients on cores of their own, engine reniced.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
R=$PWD
export TRITON_CACHE_DIR=$R/build/triton-cache
python3 -m pip install -q --no-deps build/wheels-cp312/*.whl > $OUT/pip.log 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/env.txt; nproc >> $OUT/env.txt; lscpu | grep -i "model name\|^CPU(s)\|Thread" >> $OUT/env.txt
COMMON="SHAPE=smollm2-135m TOKENIZER_DIR=$R/build/smollm2-tokenizer MODEL_ROOT=$R/build/random-models SWEEP=256 SINGLE=16 GRAPH_TOKENS=8192 PROFILE_STEPS=1"
run() { # name phases extra-env...
  local name=$1 phases=$2; shift 2
  ( env OUT=$OUT/$name $COMMON SERVE_ARGS="--workers 4" PHASES=$phases PYTHONPATH=. "$@" timeout 250 bash bench/serve_gpu.sh > $OUT/$name.log 2>&1 ); echo "$name rc=$?"
}
run plain1 model,offline,served
run pinned1 served SERVER_CPUS=0-9 CLIENT_CPUS=10-15
run niced1 served ENGINE_NICE=-10
for n in plain1 pinned1 niced1; do echo "== $n"; grep -E "^\| (main|concurrency 256|output tok/s)" $OUT/$n/serve_smollm2-135m_h200.md 2>/dev/null | cut -c1-200; done
grep -h "All 256" $OUT/plain1/*offline.md
