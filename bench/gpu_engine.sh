#!/usr/bin/env bash
# One GPU run of everything issue 13 needs measured, in ~9 minutes, each part under its own timeout so
# a failing or slow part never stops the rest. Installs nothing. From the repo root on the GPU machine:
#
#   OUT=/tmp/out bash bench/gpu_engine.sh
#   PARTS="tests kernels" OUT=... bash bench/gpu_engine.sh      # a subset (default: all)
#   HF=1 ...                                                      # also HF generate_batch on SmolLM2 (+~70 s)
#
# Parts (logs under $OUT):
#   tests       tests/kernels (fused kernels, fp8 KV, compiled), GPU model tests of the fused path + fp8
#   layers      CUDA kernels per decoder layer, unfused vs fused (bench/layer_kernels.py)
#   kernels     bench/kernels.py: paged attention vs SDPA
#   throughput  bench/throughput.py: smollm2-135m bf16, llama-3.1-8b bf16 / fp8 weights / fp8 KV
#   host        bench/host_step.py --device cuda: host ms per decode step at 256 sequences
#   decodeheavy bench/throughput.py on a decode-heavy 8B workload (128 x 128 prompt x 512 output): bf16 / fp8
#               weights / fp8 weights + fp8 KV, where the weights are most of the bytes a step moves
#   steps       bench/step_kernels.py: GPU time per kernel of a prefill and a decode step (both shapes)
# Each part's timeout is also cut to what is left of TOTAL_S (default 540 s), so the summary always prints.
# A short table is printed last.
set -uo pipefail
OUT=${OUT:-bench/results/gpu-engine-run}
PARTS=${PARTS:-layers throughput decodeheavy tests kernels host steps}  # they always run in this order: most wanted first
TOTAL_S=${TOTAL_S:-540}
mkdir -p "$OUT"
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-build/triton-cache}
START=$(date +%s)
declare -A RC

{
  nvidia-smi
  python3 -c "import sys, torch, triton; print(sys.version); print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
} > "$OUT/env.txt" 2>&1

has() { [[ " $PARTS " == *" $1 "* ]]; }
# budget N: a part's timeout, N seconds or what is left of TOTAL_S (minus 10 s for the summary)
budget() {
  local left=$(( TOTAL_S - ($(date +%s) - START) - 10 ))
  (( left < $1 )) && echo $(( left > 1 ? left : 1 )) || echo "$1"
}
# -o addopts='': the repo's addopts need pytest-timeout; --confcutdir: tests/conftest.py needs redis.
PYTEST=(python3 -m pytest -q -o addopts= -p no:cacheprovider -rs)

if has layers; then
  timeout "$(budget "${LAYERS_TIMEOUT:-60}")" python3 -m bench.layer_kernels --json "$OUT/layer_kernels.json" > "$OUT/layer_kernels.log" 2>&1
  RC[layers]=$?
fi

if has throughput; then
  hf_smol="--hf-requests 0"
  [[ -n "${HF:-}" ]] && hf_smol="--hf-requests 256"
  timeout "$(budget "${SMOL_TIMEOUT:-90}")" python3 -m bench.throughput --models smollm2-135m $hf_smol --skip-correctness \
    --out-dir "$OUT" --tag _smollm2 > "$OUT/throughput_smollm2.log" 2>&1
  RC[throughput_smollm2]=$?
  # fp8 first after bf16: the fp8-vs-bf16 pair matters most. Correctness (logprob error vs HF fp32, with
  # HF bf16's own beside it) only for fp8 weights: it needs an fp32 copy of the 8B model (~40 s).
  timeout "$(budget "${LLAMA_TIMEOUT:-260}")" python3 -m bench.throughput --models llama-3.1-8b --hf-requests 0 \
    --variants bf16,fp8,fp8kv,fp8+fp8kv --check-variants fp8 --check-tokens 16 --out-dir "$OUT" --tag _8b \
    > "$OUT/throughput_8b.log" 2>&1
  RC[throughput_8b]=$?
fi

if has decodeheavy; then
  timeout "$(budget "${DECODE_HEAVY_TIMEOUT:-150}")" python3 -m bench.throughput --models llama-3.1-8b --hf-requests 0 \
    --variants bf16,fp8,fp8+fp8kv --skip-correctness --skip-concurrency --num-requests 128 --prompt-len 128 \
    --output-len 512 --out-dir "$OUT" --tag _8b_decode_heavy > "$OUT/throughput_8b_decode_heavy.log" 2>&1
  RC[decodeheavy]=$?
fi

if has tests; then
  timeout "$(budget "${TEST_TIMEOUT:-300}")" "${PYTEST[@]}" --confcutdir=tests/kernels tests/kernels > "$OUT/tests_kernels.log" 2>&1
  RC[tests_kernels]=$?
  # fp32 fused path vs HF on every family (Triton backend), then fp8 weights / KV on the GPU.
  timeout "$(budget "${MODEL_TEST_TIMEOUT:-90}")" "${PYTEST[@]}" -s --confcutdir=tests/models tests/models/test_gpu_fp8.py \
    tests/models/test_gpu_models.py::test_fp32_prefill_logits > "$OUT/tests_models.log" 2>&1
  RC[tests_models]=$?
fi

if has kernels; then
  timeout "$(budget "${BENCH_TIMEOUT:-90}")" python3 bench/kernels.py --json "$OUT/kernels.json" > "$OUT/kernels.log" 2>&1
  RC[kernels]=$?
fi

if has host; then
  timeout "$(budget "${HOST_TIMEOUT:-60}")" python3 -m bench.host_step --device cuda --steps 32 --repeats 3 \
    --json "$OUT/host_step_cuda.json" > "$OUT/host_step.log" 2>&1
  RC[host]=$?
fi

if has steps; then
  timeout "$(budget "${STEPS_TIMEOUT:-90}")" python3 -m bench.step_kernels --json "$OUT/step_kernels.json" \
    > "$OUT/step_kernels.log" 2>&1
  RC[steps]=$?
fi

echo "=== $(grep -E "NVIDIA H|torch" "$OUT/env.txt" | head -n 2 | tr '\n' ' ') ($(( $(date +%s) - START )) s)"
for part in "${!RC[@]}"; do echo "rc $part=${RC[$part]}"; done | sort
if has tests; then
  echo "--- tests/kernels: $(tail -n 1 "$OUT/tests_kernels.log")"
  echo "--- GPU model tests: $(tail -n 1 "$OUT/tests_models.log")"
  grep -E "rel err vs fp32|^bf16 \[" "$OUT/tests_models.log" | head -n 6
fi
if has layers; then
  echo "--- kernels per decoder layer"
  grep -vE "^    " "$OUT/layer_kernels.log" | tail -n 3
fi
if has kernels; then
  echo "--- paged attention vs SDPA"
  tail -n 8 "$OUT/kernels.log"
fi
if has host; then
  echo "--- host ms per decode step, 256 sequences (tiny model on CUDA)"
  tail -n 2 "$OUT/host_step.log"
fi
if has steps; then
  echo "--- GPU ms per step (eager, torch.profiler)"
  grep -E "^--- " "$OUT/step_kernels.log"
fi
if has throughput; then
  echo "--- throughput (256 x 512 prompt x 256 output tokens)"
  cat "$OUT"/throughput_*_smollm2.md "$OUT"/throughput_*_8b.md "$OUT"/throughput_*_8b_decode_heavy.md 2> /dev/null | grep -E "^\| [a-z]" | grep -v "^| model" \
    || tail -n 5 "$OUT/throughput_8b.log"
fi
