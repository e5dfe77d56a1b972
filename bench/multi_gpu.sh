#!/usr/bin/env bash
# The multi-GPU runs (issues 10 and 11) on one host with 2+ GPUs, in parts that each fit a 10-minute call;
# run them in order on one machine (the tensor-parallel report accumulates in $WORK).
#
#   OUT=/tmp/out PART=tp8b    bash bench/multi_gpu.sh  # TP=1 vs TP=2 on the Llama-3.1-8B shape, and fp32 reference
#   OUT=/tmp/out PART=tpsizes bash bench/multi_gpu.sh  # TP=1, 2 and 4 (4+ GPUs) on the 8B shape at 256 concurrent
#   OUT=/tmp/out PART=tp70b   bash bench/multi_gpu.sh  # Llama-3.1-70B shape at TP=2: offline, then served
#   OUT=/tmp/out PART=scaling bash bench/multi_gpu.sh  # one gateway over 1 and 2 engine replicas (8B shape)
#   OUT=/tmp/out PART=archeck bash bench/multi_gpu.sh  # custom / fused all-reduce vs NCCL on 2, 4, 8 GPUs
#   OUT=/tmp/out PART=tpfused bash bench/multi_gpu.sh  # 8B TP=1, then TP=2 (and 4) NCCL vs fused all-reduce+norm
#   OUT=/tmp/out PART=gemv    bash bench/multi_gpu.sh  # decode GEMV: tests, sweep, 8B TP=1 (and 2) cuBLAS vs GEMV
#   OUT=/tmp/out PART=pdl     bash bench/multi_gpu.sh  # programmatic dependent launch: tests, 8B TP=1 (and 2) off vs on
#   OUT=/tmp/out PART=push    bash bench/multi_gpu.sh  # fused all-reduce push vs pull: check, latency, tests, 8B TP=2 ITL
#   OUT=/tmp/out PART=decode1 bash bench/multi_gpu.sh  # one GPU, 8B batch 1 and 64: bf16 cuBLAS / GEMV, GPTQ W4A16
#
# Models are random-weight: config-only directories (bench/serve/random_model.py --config-only) whose
# engines generate their weights (PAGEDSERVE_LOAD_FORMAT=random), so nothing large is written.
# Needs the service dependencies importable (carry cp312 wheels; see bench/serve_gpu.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/multi-gpu}
WORK=${WORK:-/tmp/pagedserve-tp}
TOKENIZER_DIR=${TOKENIZER_DIR:-build/smollm2-tokenizer}
NUM_GPUS=$(python3 -c "import torch; print(torch.cuda.device_count())")
mkdir -p "$OUT" "$WORK"
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-build/triton-cache}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # the host's rule

config_dir() {  # shape -> a config-only model directory (with SmolLM2's tokenizer padded to the vocab)
  local dir="$WORK/models/$1-random"
  python3 -m bench.serve.random_model --shape "$1" --config-only --out "$dir" --tokenizer-dir "$TOKENIZER_DIR" \
    --max-model-len 2048 > /dev/null
  echo "$dir"
}

tp_variant() {  # tp, tag, requests, bench.tensor_parallel flags...: 8B at TP=tp into $OUT/tp$tp-$tag (and its .log),
               # comparing with the TP=1 run of the same tag when there was one
  local tp=$1 tag=$2 n=$3; shift 3
  local dir="tp$tp-$tag"
  mkdir -p "$WORK/$dir" && cp "$WORK/tp1-$tag/8b-tp1.json" "$WORK/$dir/" 2> /dev/null
  timeout 200 python3 -m bench.tensor_parallel --phases "8b-tp$tp" --num-requests "$n" "$@" \
    --work-dir "$WORK/$dir" --out-dir "$OUT/$dir" > "$OUT/$dir.log" 2>&1
  echo "$dir rc=$?"
  grep -E "^\| 8b-" "$OUT/$dir.log" | tail -n 2
}

serve_and_bench() {  # model dir, name, serve flags..., then bench.serve flags after "--"
  local dir=$1 name=$2; shift 2
  local serve_args=() bench_args=()
  while [[ $# -gt 0 && $1 != "--" ]]; do serve_args+=("$1"); shift; done
  shift
  bench_args=("$@")
  PAGEDSERVE_LOAD_FORMAT=random python3 -m pagedserve.services.cli serve --model "$dir" --host 127.0.0.1 --port 8000 \
    --max-model-len 2048 "${serve_args[@]}" > "$OUT/server_$name.log" 2>&1 &
  local server=$!
  python3 - "$server" << 'EOF'
import os, sys, time, httpx
pid, deadline = int(sys.argv[1]), time.monotonic() + 420
while time.monotonic() < deadline:
    try:
        os.kill(pid, 0)
    except OSError:
        sys.exit("the server exited during start-up")
    try:
        if httpx.get("http://127.0.0.1:8000/ready", timeout=1).status_code == 200:
            sys.exit(0)
    except httpx.HTTPError:
        pass
    time.sleep(0.5)
sys.exit("the server was not ready in time")
EOF
  local rc=$?
  if [[ $rc -eq 0 ]]; then
    python3 -m bench.serve --url http://127.0.0.1:8000 --model "$(basename "$dir")" --tokenizer "$dir" \
      --device-label "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) x$NUM_GPUS" \
      --result-dir "$OUT" --result-name "serve_$name" "${bench_args[@]}" > "$OUT/bench_$name.log" 2>&1
    rc=$?
  fi
  kill -TERM "$server" 2> /dev/null
  wait "$server" 2> /dev/null
  tail -n 25 "$OUT/bench_$name.log" 2> /dev/null
  return $rc
}

case "${PART:-tp8b}" in
  tp8b)
    timeout 560 python3 -m bench.tensor_parallel --phases 8b-tp1,8b-tp2,8b-fp32 --work-dir "$WORK/tp" \
      > "$OUT/tp8b.log" 2>&1
    echo "tensor_parallel rc=$?"
    cp bench/results/tensor_parallel_cuda.* "$OUT/" 2> /dev/null
    tail -n 30 "$OUT/tp8b.log"
    ;;
  tpsizes)  # TP=1, 2 and (with 4+ GPUs) 4 at 256 concurrent (issue 23): throughput and single-stream ITL
    phases=8b-tp1,8b-tp2
    [[ $NUM_GPUS -ge 4 ]] && phases=$phases,8b-tp4
    timeout 560 python3 -m bench.tensor_parallel --phases "$phases" --num-requests 256 --work-dir "$WORK/tp" \
      > "$OUT/tpsizes.log" 2>&1
    echo "tensor_parallel rc=$?"
    cp bench/results/tensor_parallel_cuda.* "$OUT/" 2> /dev/null
    tail -n 30 "$OUT/tpsizes.log"
    ;;
  archeck)  # the symmetric-memory all-reduce and the fused all-reduce + add + RMSNorm: correctness, latency
    for world in 2 4 8; do
      [[ $NUM_GPUS -ge $world ]] || continue
      OUT=$OUT timeout 240 python3 -m bench.custom_all_reduce --world-size "$world" --buffer-bytes $((8 << 20)) \
        > "$OUT/custom_ar_tp$world.log" 2>&1
      echo "custom_all_reduce tp$world rc=$?"
      grep -v "^wrote" "$OUT/custom_ar_tp$world.log" | tail -n 22
    done
    ;;
  tpfused)  # 8B single-stream ITL and throughput: TP=1; TP=2 (and 4) with NCCL, then with the fused path
    sizes=${TP_SIZES:-2}
    [[ $NUM_GPUS -ge 4 && -z ${TP_SIZES:-} ]] && sizes="2 4"
    n=${NUM_REQUESTS:-64}
    timeout 200 python3 -m bench.tensor_parallel --phases 8b-tp1 --num-requests "$n" --work-dir "$WORK/tp1" \
      --out-dir "$OUT/tp1" > "$OUT/tp1.log" 2>&1
    echo "tp1 rc=$?"
    for tp in $sizes; do
      for variant in nccl fused; do
        flags=()
        [[ $variant == nccl ]] && flags=(--fused-all-reduce-max-bytes 0)
        mkdir -p "$WORK/tp$tp-$variant" && cp "$WORK/tp1/8b-tp1.json" "$WORK/tp$tp-$variant/" 2> /dev/null
        timeout 200 python3 -m bench.tensor_parallel --phases "8b-tp$tp" --num-requests "$n" "${flags[@]}" \
          --work-dir "$WORK/tp$tp-$variant" --out-dir "$OUT/tp$tp-$variant" > "$OUT/tp$tp-$variant.log" 2>&1
        echo "tp$tp $variant rc=$?"
        grep -E "^\| 8b-|itl_p50|divergence" "$OUT/tp$tp-$variant.log" | tail -n 4
      done
    done
    ;;
  gemv)  # the dense decode GEMV (issue 23): kernel tests and sweep, then 8B throughput and single-stream ITL at
         # TP=1 (and TP=2 with 2+ GPUs) with cuBLAS (--gemv-max-rows 0) and with the GEMV, and a decode-step profile
    if python3 -c "import pytest" 2> /dev/null; then
      tests=(tests/kernels/test_gemv.py)  # GPU_TESTS=1: also every family vs HF and TP=2 vs TP=1 with the GEMV on
      [[ ${GPU_TESTS:-0} == 1 ]] && tests+=(tests/models/test_gpu_models.py tests/engine/test_tensor_parallel_gpu.py)
      timeout 240 python3 -m pytest -q -o addopts='' -p no:cacheprovider -rs "${tests[@]}" > "$OUT/gemv_tests.log" 2>&1
      echo "gemv tests rc=$?"; tail -n 4 "$OUT/gemv_tests.log"
    fi
    if [[ ${SWEEP:-1} == 1 ]]; then
      timeout 300 python3 -m bench gemv --shapes "${GEMV_SHAPES:-8b-tp1,8b-tp2,8b-tp4,smollm2}" --json "$OUT/gemv.json" \
        > "$OUT/gemv.log" 2>&1
      echo "gemv bench rc=$?"; tail -n 50 "$OUT/gemv.log"
    fi
    sizes=${TP_SIZES:-1}
    [[ $NUM_GPUS -ge 2 && -z ${TP_SIZES:-} ]] && sizes="1 2"
    n=${NUM_REQUESTS:-256}
    for tp in $sizes; do
      for rows in ${GEMV_ROWS:-0 1}; do
        tp_variant "$tp" "gemv$rows" "$n" --gemv-max-rows "$rows"
      done
      if [[ ${PROFILE:-1} == 1 ]]; then
        timeout 150 python3 -m bench model_shapes --models llama-3.1-8b --tensor-parallel-size "$tp" --batches 1 \
          --kernel-profile 8 --json "$OUT/profile_tp${tp}_gemv.json" > "$OUT/profile_tp$tp.log" 2>&1
        echo "profile tp$tp rc=$?"
      fi
    done
    ;;
  push)  # the fused all-reduce's push protocol against pull: the check and latency, GPU tests, 8B TP=1 / TP=2 ITL
    for proto in push pull; do
      flag=$([[ $proto == push ]] && echo --push)
      OUT=$OUT timeout 200 python3 -m bench.custom_all_reduce --world-size 2 --buffer-bytes $((8 << 20)) $flag \
        > "$OUT/custom_ar_$proto.log" 2>&1
      echo "custom_all_reduce $proto rc=$?"; grep -E "cases|^\| (1|8|64|256) \|" "$OUT/custom_ar_$proto.log" | tail -n 6
    done
    if python3 -c "import pytest" 2> /dev/null && [[ ${GPU_TESTS:-1} == 1 ]]; then
      timeout "${TEST_TIMEOUT:-200}" python3 -m pytest -q -o addopts='' -p no:cacheprovider -rs \
        tests/engine/test_tensor_parallel_gpu.py tests/kernels/test_push_all_reduce.py > "$OUT/push_tests.log" 2>&1
      echo "push tests rc=$?"; tail -n 4 "$OUT/push_tests.log"
    fi
    n=${NUM_REQUESTS:-64}
    tp_variant 1 push1 "$n"
    mkdir -p "$WORK/tp1-push0" && cp "$WORK/tp1-push1/8b-tp1.json" "$WORK/tp1-push0/" 2> /dev/null
    for p in ${PUSH_VALUES:-1 0}; do
      tp_variant 2 "push$p" "$n" --fused-push "$p"
    done
    ;;
  pdl)  # programmatic dependent launch (issue 23): GPU tests with it on (the engine's default), then 8B
        # single-stream ITL and throughput at TP=1 (and 2) with --pdl 0 and 1 (GEMV on), and QUANT=1: W4A16 at batch 1
    if python3 -c "import pytest" 2> /dev/null && [[ ${GPU_TESTS:-1} == 1 ]]; then
      timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -o addopts='' -p no:cacheprovider -rs ${TESTS:-tests/kernels/test_gemv.py \
        tests/models/test_gpu_models.py::test_programmatic_dependent_launch_keeps_every_token \
        tests/models/test_gpu_models.py::test_greedy_through_engine_on_gpu tests/engine/test_tensor_parallel_gpu.py} \
        > "$OUT/pdl_tests.log" 2>&1
      echo "pdl tests rc=$?"; tail -n 6 "$OUT/pdl_tests.log"
    fi
    if [[ ${GEMV_BENCH:-0} == 1 ]]; then  # the dense GEMVs (and the gate_up GEMV with its SiLU) launched with PDL
      timeout 200 python3 -m bench gemv --rows 1 --no-sweep --pdl --shapes "${GEMV_SHAPES:-8b-tp1,8b-tp2,smollm2}" \
        --json "$OUT/gemv_pdl.json" > "$OUT/gemv_pdl.log" 2>&1
      echo "gemv bench rc=$?"; tail -n 20 "$OUT/gemv_pdl.log"
    fi
    sizes=${TP_SIZES:-1}
    [[ $NUM_GPUS -ge 2 && -z ${TP_SIZES:-} ]] && sizes="1 2"
    n=${NUM_REQUESTS:-64}
    for tp in $sizes; do
      for p in ${PDL_VALUES:-0 1}; do
        tp_variant "$tp" "pdl$p" "$n" --pdl "$p"
      done
    done
    if [[ ${QUANT:-0} == 1 ]]; then
      for p in ${PDL_VALUES:-0 1}; do
        timeout 200 python3 -m bench model_shapes --models llama-3.1-8b --batches 1 --quantization gptq --pdl "$p" \
          --json "$OUT/gptq_pdl$p.json" > "$OUT/gptq_pdl$p.log" 2>&1
        echo "gptq pdl=$p rc=$?"; grep -E "^\| llama" "$OUT/gptq_pdl$p.log" | tail -n 2
      done
    fi
    if [[ ${PROFILE:-0} == 1 ]]; then
      for tp in $sizes; do
        timeout 150 python3 -m bench model_shapes --models llama-3.1-8b --tensor-parallel-size "$tp" --batches 1 \
          --kernel-profile 8 --json "$OUT/profile_tp${tp}_pdl.json" > "$OUT/profile_tp${tp}_pdl.log" 2>&1
        echo "profile tp$tp rc=$?"
      done
    fi
    ;;
  decode1)  # 8B decode at batch 1 and 64 on one GPU: bf16 with cuBLAS, bf16 with the GEMV, GPTQ W4A16 (issue 21)
    for variant in "bf16-cublas --gemv-max-rows 0" "bf16-gemv --gemv-max-rows 1" "gptq --quantization gptq"; do
      read -r name flags <<< "$variant"
      # shellcheck disable=SC2086  # the flags split into words
      timeout 200 python3 -m bench model_shapes --models llama-3.1-8b --batches 1,64 $flags \
        --json "$OUT/decode1_$name.json" > "$OUT/decode1_$name.log" 2>&1
      echo "$name rc=$?"; grep -E "^\| llama" "$OUT/decode1_$name.log" | tail -n 2
    done
    ;;
  tp70b)
    timeout 300 python3 -m bench.tensor_parallel --phases 70b-tp2 --work-dir "$WORK/tp" > "$OUT/tp70b.log" 2>&1
    echo "tensor_parallel rc=$?"
    cp bench/results/tensor_parallel_cuda.* "$OUT/" 2> /dev/null
    tail -n 20 "$OUT/tp70b.log"
    dir=$(config_dir 70b)
    serve_and_bench "$dir" 70b-tp2 --tensor-parallel-size 2 --gpus 0,1 --workers 2 -- \
      --num-prompts 128 --input-len 512 --output-len 128 --max-concurrency 128 --single-stream 4 --client-processes 4
    echo "served 70b rc=$?"
    ;;
  scaling)
    dir=$(config_dir 8b)
    [[ $NUM_GPUS -ge 4 ]] && engines="1,2,$NUM_GPUS" || engines="1,$NUM_GPUS"
    PAGEDSERVE_LOAD_FORMAT=random timeout 560 python3 -m bench.scaling --model-dir "$dir" --engines "$engines" \
      --out "$OUT" > "$OUT/scaling.log" 2>&1
    echo "scaling rc=$?"
    tail -n 12 "$OUT/scaling.log"
    ;;
esac

# At most a few files come back from a lent machine: logs and plots go into one archive.
(cd "$OUT" && tar czf "logs_${PART:-tp8b}.tgz" --ignore-failed-read ./*.log ./*.png 2> /dev/null; rm -f ./*.log ./*.png)
