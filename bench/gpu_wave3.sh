#!/usr/bin/env bash
# Wave-3 GPU check, one call: the new Triton kernels' tests compiled (LoRA shrink/expand, fused MoE, paged
# attention with windows and sinks), the families and the mixed-LoRA batch on the GPU vs HF, then the LoRA
# and speculative-decoding benchmarks. Installs nothing from the network (carried wheels only).
#
#   OUT=/tmp/out bash bench/gpu_wave3.sh                 # from the repo root on the GPU machine
#   PARTS=tests,mxfp4,lora,oracle,ngram,graphs,structured SMOL=build/smol-model  # which parts; SMOL: the real SmolLM2
#     for ngram, a model directory or the packaged .gguf (converted there; carry the gguf wheel in build/wheels-gguf)
#   GRAPH_MODELS=smollm2-135m,llama-3.1-8b     # the shapes bench/step_graphs.py runs
#   PARTS=shapes SHAPE_MODELS=gemma-3-12b SHAPE_TP=1; PARTS=w4a16 W4A16_ARGS='--rows 1,4,8 --gemv-sweep'
#   PARTS=shapes SHAPE_MODELS=gemma-3-12b SHAPE_TP=1   # issue 20's shapes (bench/model_shapes.py), one per call
#   PARTS=structured,hoststep,gateway STRUCTURED_RUNS='_before:--fill-threads 1 --switch-interval-ms 5;:'  # issue 23's
#     structured ratio before/after, the host phases with json_schema rows, the gateway's CPU per token
#   PARTS=quant QUANT_RUNS='llama-3.1-8b:gptq:1,64;llama-3.1-70b:gptq:1,64'  # model:weights:batches, each a
#     model_shapes run with a kernel profile (issue 21); PARTS=moeq: the fp8 / int4 fused-MoE kernel timings
# Logs and JSON go under $OUT; a short summary is printed last.
set -uo pipefail
OUT=${OUT:-bench/results/gpu-wave3}
PARTS=${PARTS:-tests,lora,oracle}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # never NVLink multicast
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-build/triton-cache}
# Carried wheels (build/wheels-*/: the services' packages, gguf for SMOL=*.gguf), once per machine.
if compgen -G "build/wheels-*/*.whl" > /dev/null; then
  [ -d /tmp/site ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site build/wheels-*/*.whl
  export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$OUT/env.txt" 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> "$OUT/env.txt" 2>&1
has() { [[ ",$PARTS," == *",$1,"* ]]; }
summary=()

if has tests; then
  # TESTS: pytest arguments (default: the wave-3 kernels and families, the host KV tier, 4-bit checkpoints)
  # shellcheck disable=SC2086
  timeout "${TEST_TIMEOUT:-420}" python3 -m pytest -q -o addopts='' -p no:cacheprovider -rs \
    ${TESTS:-tests/kernels/test_lora_kernels.py tests/kernels/test_paged_attention.py tests/kernels/test_fused_moe.py \
      tests/kernels/test_moe_align.py tests/models/test_gpu_models.py tests/engine/test_kv_offload.py \
      tests/models/test_compressed_tensors.py tests/models/test_int4.py tests/models/test_mxfp4.py} \
    > "$OUT/tests.log" 2>&1
  summary+=("tests rc=$? : $(tail -n 1 "$OUT/tests.log")")
fi
if has mxfp4; then
  timeout "${BENCH_TIMEOUT:-600}" python3 -m bench moe_kernel --mxfp4 --json "$OUT/moe_kernel_mxfp4.json" \
    > "$OUT/mxfp4.log" 2>&1
  summary+=("mxfp4 rc=$?")
fi
if has lora; then
  timeout "${BENCH_TIMEOUT:-600}" python3 -m bench.lora --out-dir "$OUT" > "$OUT/lora.log" 2>&1
  summary+=("lora rc=$?")
fi
if has oracle; then
  timeout "${BENCH_TIMEOUT:-600}" python3 -m bench.spec_decode --parts oracle --corruption "${CORRUPTION:-0,0.5}" \
    --out "$OUT/spec_oracle.json" > "$OUT/spec_oracle.log" 2>&1
  summary+=("spec oracle rc=$?")
fi
if has graphs; then  # mixed/prefill-step CUDA graphs on and off: TTFT, throughput, same tokens (issue 23)
  timeout "${BENCH_TIMEOUT:-600}" python3 -m bench.step_graphs --models "${GRAPH_MODELS:-smollm2-135m}" \
    --json "$OUT/step_graphs.json" > "$OUT/step_graphs.log" 2>&1
  summary+=("step graphs rc=$?")
fi
if has structured; then  # json_schema beside plain requests (issue 23): the grammar worker's cost
  # STRUCTURED_RUNS='tag:args;...' (default one run, the engine's settings), e.g. '_before:--fill-threads 1 --switch-interval-ms 5;:'
  IFS=';' read -ra structured_runs <<< "${STRUCTURED_RUNS:-:}"
  for run in "${structured_runs[@]}"; do
    tag=${run%%:*}
    # shellcheck disable=SC2086
    timeout "${BENCH_TIMEOUT:-600}" python3 -m bench.structured_throughput --tokenizer "${TOKENIZER:-build/smollm2-tokenizer}" \
      --models smollm2-135m --max-num-batched-tokens 2048 --out-dir "$OUT" --tag "$tag" ${run#*:} \
      > "$OUT/structured$tag.log" 2>&1
    summary+=("structured$tag rc=$?")
  done
fi
if has gateway; then  # the gateway's CPU per streamed token on this host's cores (bench/gateway_stream.py)
  for mp in "" --multiprocess; do
    timeout 300 python3 -m bench.gateway_stream --streams 256 --tokens 128 $mp --tokenizer "${TOKENIZER:-build/smollm2-tokenizer}" \
      --json "$OUT/gateway_stream${mp:+_multiprocess}.json" >> "$OUT/gateway_stream.log" 2>&1
  done
  summary+=("gateway stream rc=$?")
fi
if has hoststep; then  # host ms per step at 256 rows, half of them json_schema, and all plain (same vocabulary)
  tok=${TOKENIZER:-build/smollm2-tokenizer}
  timeout 300 python3 -m bench.host_step --device cuda --async-scheduling --grammar-fraction 0.5 --tokenizer "$tok" \
    --json "$OUT/host_step_grammar.json" --cprofile "$OUT/host_step_grammar_cprofile.txt" > "$OUT/host_step.log" 2>&1
  timeout 300 python3 -m bench.host_step --device cuda --async-scheduling --vocab-size 49152 --tokenizer "$tok" \
    --json "$OUT/host_step_plain.json" >> "$OUT/host_step.log" 2>&1
  summary+=("host step rc=$?")
fi
if has ngram; then
  timeout "${BENCH_TIMEOUT:-600}" python3 -m bench.spec_decode --parts ngram ${SMOL:+--model "$SMOL"} \
    --out "$OUT/spec_ngram.json" > "$OUT/spec_ngram.log" 2>&1
  summary+=("spec ngram rc=$?")
fi
if has shapes; then  # random-weight Qwen3-30B-A3B / gpt-oss-20b / Gemma-3-12B / Mixtral shapes, 256x512x256 (issue 20)
  timeout "${BENCH_TIMEOUT:-600}" python3 -m bench model_shapes --models "${SHAPE_MODELS:-gemma-3-12b}" \
    --tensor-parallel-size "${SHAPE_TP:-1}" --json "$OUT/model_shapes.json" > "$OUT/model_shapes.log" 2>&1
  summary+=("model shapes rc=$?")
fi
if has w4a16; then  # the W4A16 GEMV (M <= 8) and GEMM against cuBLAS bf16 and the weight-read floor (issue 21)
  timeout "${BENCH_TIMEOUT:-600}" python3 -m bench w4a16_gemm ${W4A16_ARGS:-} --json "$OUT/w4a16_gemm.json" \
    > "$OUT/w4a16.log" 2>&1
  summary+=("w4a16 rc=$?")
fi
if has quant; then  # random weights in each format's own layout: bf16 vs fp8 vs 4-bit, per batch size (issue 21)
  IFS=';' read -ra quant_runs <<< "${QUANT_RUNS:-llama-3.1-8b:none:1,64,256;llama-3.1-8b:gptq:1,64,256;llama-3.1-8b:fp8:1,64,256}"
  for run in "${quant_runs[@]}"; do
    IFS=: read -r model weights batches <<< "$run"
    timeout "${BENCH_TIMEOUT:-600}" python3 -m bench model_shapes --models "$model" --quantization "$weights" \
      --batches "$batches" --kernel-profile "${KERNEL_PROFILE:-8}" --run-timeout-s "${RUN_TIMEOUT:-400}" \
      --json "$OUT/quant_${model}_$weights.json" > "$OUT/quant_${model}_$weights.log" 2>&1
    summary+=("quant $model $weights rc=$?")
  done
fi
if has moeq; then  # fp8 and int4 experts in the fused-MoE kernel vs bf16, Qwen3-30B-A3B layer (issue 21)
  for fmt in fp8 w4a16; do
    timeout "${BENCH_TIMEOUT:-600}" python3 -m bench moe_kernel --$fmt --json "$OUT/moe_kernel_$fmt.json" \
      > "$OUT/moe_$fmt.log" 2>&1
    summary+=("moe kernel $fmt rc=$?")
  done
fi

cat "$OUT/env.txt"
for log in tests mxfp4 lora spec_oracle spec_ngram step_graphs model_shapes w4a16 moe_fp8 moe_w4a16; do
  [ -f "$OUT/$log.log" ] && { echo "--- $log"; tail -n 22 "$OUT/$log.log"; }
done
for log in "$OUT"/structured*.log "$OUT"/host_step.log "$OUT"/gateway_stream.log; do
  [ -f "$log" ] && { echo "--- $log"; tail -n 8 "$log"; }
done
for log in "$OUT"/quant_*.log; do
  [ -f "$log" ] && { echo "--- $log"; grep '^|' "$log"; }
done
printf '%s\n' "${summary[@]}"
