#!/usr/bin/env bash
# Session 21 call 2 (2x H200): GPU checks of session 20's un-run refactor (kernels/fused_norm.rms_norm_row shared by
# the add+RMSNorm kernel and both fused all-reduce kernels): the all-reduce check (bit-exact vs reference, eager and
# graphs, pull and push) and the GPU tests that run those kernels.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONPATH=.
export TRITON_CACHE_DIR=$PWD/build/triton-cache
python3 -m pip install -q --no-deps build/wheels-cp312/*.whl > $OUT/pip.log 2>&1
nvidia-smi --query-gpu=name --format=csv > $OUT/env.txt; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >> $OUT/env.txt
for flag in "" --push; do
  timeout 150 python3 -m bench.custom_all_reduce --world-size 2 --buffer-bytes $((8 << 20)) $flag > "$OUT/custom_ar${flag}.log" 2>&1
  echo "custom_all_reduce ${flag:-pull} rc=$? at ${SECONDS}s"; grep -E "cases|match|^\| (1|8|64|256) \|" "$OUT/custom_ar${flag}.log" | tail -n 8
done
timeout 330 python3 -m pytest -q -o addopts='' -p no:cacheprovider -rs tests/kernels/test_fused_elementwise.py \
  tests/engine/test_tensor_parallel_gpu.py tests/engine/test_partial_sums.py \
  tests/models/test_gpu_models.py::test_greedy_through_engine_on_gpu \
  tests/models/test_gpu_models.py::test_programmatic_dependent_launch_keeps_every_token > $OUT/gpu_tests.log 2>&1
echo "gpu tests rc=$? at ${SECONDS}s"; tail -n 8 $OUT/gpu_tests.log
