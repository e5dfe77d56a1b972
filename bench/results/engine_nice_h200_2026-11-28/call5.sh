#!/usr/bin/env bash
# Session 20 call 5: the product flag --engine-nice -10 (set by the engine at start) against a plain run.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
R=$PWD
export TRITON_CACHE_DIR=$R/build/triton-cache
python3 -m pip install -q --no-deps build/wheels-cp312/*.whl > $OUT/pip.log 2>&1
nvidia-smi --query-gpu=name --format=csv > $OUT/env.txt; nproc >> $OUT/env.txt; lscpu | grep -i "model name" >> $OUT/env.txt
COMMON="SHAPE=smollm2-135m TOKENIZER_DIR=$R/build/smollm2-tokenizer MODEL_ROOT=$R/build/random-models SWEEP=256 SINGLE=16 GRAPH_TOKENS=8192 PROFILE_STEPS=1"
run() { # name phases serve-args
  local name=$1 phases=$2 serve=$3
  ( env OUT=$OUT/$name $COMMON SERVE_ARGS="$serve" PHASES=$phases PYTHONPATH=. timeout 250 bash bench/serve_gpu.sh > $OUT/$name.log 2>&1 ); echo "$name rc=$?"
}
run nice1 model,offline,served "--workers 4 --engine-nice -10"
run plain1 served "--workers 4"
run nice2 served "--workers 4 --engine-nice -10"
for n in nice1 plain1 nice2; do echo "== $n"; grep -E "^\| (main|concurrency 256|output tok/s)" $OUT/$n/serve_smollm2-135m_h200.md 2>/dev/null | cut -c1-200; grep -h "niceness" $OUT/$n/server_*.log | head -2 | cut -c1-200; done
grep -h "All 256" $OUT/nice1/*offline.md
