#!/usr/bin/env bash
# Session 23 call 1 (one H200): the tiled W4A16 GEMM with a tile's slices joined in the inputs' order (one dot of
# depth 128, JOINED_SWAP 2 the default at <= 64 rows): GPU tests, the 8B decode at batch 1 and 64 (GPTQ with a
# kernel profile, bf16), and the tiled GEMM's tile sweep at 16, 64, 128 and 256 rows.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONPATH=.
export TRITON_CACHE_DIR=$PWD/build/triton-cache
python3 -m pip install -q --no-deps build/wheels-cp312/*.whl > /tmp/pip.log 2>&1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/env.txt
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >> $OUT/env.txt
timeout 150 python3 -m pytest -q -o addopts='' -p no:cacheprovider -rs tests/kernels/test_w4a16_gemm.py \
  tests/models/test_int4.py tests/models/test_int4_models.py > $OUT/tests.log 2>&1
echo "tests rc=$? at ${SECONDS}s"; grep -E "passed|failed|^FAILED|^ERROR" $OUT/tests.log | tail -n 8
timeout 150 python3 -m bench model_shapes --models llama-3.1-8b --batches 1,64 --quantization gptq --kernel-profile 8 \
  --run-timeout-s 140 --json $OUT/e2e_8b_gptq.json > $OUT/e2e_8b_gptq.log 2>&1
echo "e2e gptq rc=$? at ${SECONDS}s"; grep -E "^\| llama" $OUT/e2e_8b_gptq.log | tail -n 2
timeout 120 python3 -m bench model_shapes --models llama-3.1-8b --batches 64 --quantization none \
  --run-timeout-s 110 --json /tmp/e2e_8b_none.json > $OUT/e2e_8b_none.log 2>&1
echo "e2e none rc=$? at ${SECONDS}s"; grep -E "^\| llama" $OUT/e2e_8b_none.log | tail -n 1
timeout 230 python3 -m bench w4a16_gemm --rows 64,16,256,128 --sweep --formats tiled --pdl \
  --json $OUT/gemm_sweep.json > $OUT/gemm_sweep.log 2>&1
echo "sweep rc=$? at ${SECONDS}s"; grep -vE "^  " $OUT/gemm_sweep.log | tail -n 18
