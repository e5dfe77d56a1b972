#!/usr/bin/env bash
# Session 22 call 5 (one H200): the 4-bit model tests on the GPU after the GEMV changes; the 8B decode at batch 1
# and 64, bf16 and GPTQ; the structured-output ratio at GIL switch intervals 0.5 and 0.2 ms, alternated, four each.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONPATH=.
export TRITON_CACHE_DIR=$PWD/build/triton-cache
python3 -m pip install -q --no-deps build/wheels-cp312/*.whl > $OUT/pip.log 2>&1
timeout 220 python3 -m pytest -q -o addopts='' -p no:cacheprovider -rs tests/models/test_int4_models.py \
  tests/models/test_random_quantized.py tests/models/test_int4_moe.py tests/models/test_fused_qkv_quantized.py \
  tests/models/test_quant_families.py tests/kernels/test_w4a16_gemm.py > $OUT/tests.log 2>&1
echo "tests rc=$? at ${SECONDS}s"; grep -E "passed|failed|^FAILED|^ERROR" $OUT/tests.log | tail -n 8
for q in gptq none; do
  timeout 200 python3 -m bench model_shapes --models llama-3.1-8b --batches 1,64 --quantization $q \
    --run-timeout-s 180 --json $OUT/e2e_8b_$q.json > $OUT/e2e_8b_$q.log 2>&1
  echo "e2e $q rc=$? at ${SECONDS}s"; grep -E "^\| llama" $OUT/e2e_8b_$q.log | tail -n 2
done
mkdir -p $OUT/structured
for round in 1 2 3 4; do
  for ms in 0.5 0.2; do
    timeout 60 python3 -m bench.structured_throughput --tokenizer build/smollm2-tokenizer --models smollm2-135m \
      --max-num-batched-tokens 2048 --switch-interval-ms $ms --out-dir $OUT/structured --tag _${ms}_r$round \
      > $OUT/structured/run_${ms}_r$round.log 2>&1
    echo "structured $ms r$round rc=$? at ${SECONDS}s $(grep -E '^\| smollm2' $OUT/structured/run_${ms}_r$round.log | cut -d'|' -f3-6)"
  done
done
rm -f $OUT/structured/*.md; tar czf $OUT/structured.tgz -C $OUT structured && rm -rf $OUT/structured
