#!/usr/bin/env bash
# Session 21 call 1: gateway and tokenizer processes at niceness 10 (--gateway-nice / --tokenizer-nice, no
# privilege needed) against a plain run, alternating, on one shared 16-core H200 host.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
R=$PWD
export TRITON_CACHE_DIR=$R/build/triton-cache
python3 -m pip install -q --no-deps build/wheels-cp312/*.whl > $OUT/pip.log 2>&1
nvidia-smi --query-gpu=name --format=csv > $OUT/env.txt; nproc >> $OUT/env.txt; lscpu | grep -i "model name" >> $OUT/env.txt
git log -1 --format=%h >> $OUT/env.txt 2>/dev/null
COMMON="SHAPE=smollm2-135m TOKENIZER_DIR=$R/build/smollm2-tokenizer MODEL_ROOT=$R/build/random-models SWEEP=256 SINGLE=16 GRAPH_TOKENS=8192 PROFILE_STEPS=1"
FRONT="--workers 4 --gateway-nice 10 --tokenizer-nice 10"
run() { # name phases serve-args
  local name=$1 phases=$2 serve=$3
  ( env OUT=$OUT/$name $COMMON SERVE_ARGS="$serve" PHASES=$phases PYTHONPATH=. timeout 230 bash bench/serve_gpu.sh > $OUT/$name.log 2>&1 ); echo "$name rc=$? at ${SECONDS}s"
}
run front1 model,offline,served "$FRONT"
run plain1 served "--workers 4"
run front2 served "$FRONT"
[[ $SECONDS -lt 470 ]] && run plain2 served "--workers 4"
for n in front1 plain1 front2 plain2; do echo "== $n"; grep -E "^\| (main|concurrency 256|output tok/s)" $OUT/$n/serve_smollm2-135m_h200.md 2>/dev/null | cut -c1-200; grep -h "niceness" $OUT/$n/server_*.log | head -3 | cut -c1-160; done
grep -h "All 256" $OUT/front1/*offline.md
