#!/usr/bin/env bash
# Session 21 call 3 (one H200): the GPU model tests that session 20's call ran out of time in, and test_partial_sums'
# model test, now on CUDA.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONPATH=.
export TRITON_CACHE_DIR=$PWD/build/triton-cache
python3 -m pip install -q --no-deps build/wheels-cp312/*.whl > $OUT/pip.log 2>&1
nvidia-smi --query-gpu=name --format=csv > $OUT/env.txt; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >> $OUT/env.txt
timeout 100 python3 -m pytest -q -o addopts='' -p no:cacheprovider -rs tests/engine/test_partial_sums.py > $OUT/partial_sums.log 2>&1
echo "partial sums rc=$? at ${SECONDS}s"; tail -n 3 $OUT/partial_sums.log
timeout 460 python3 -m pytest -q -o addopts='' -p no:cacheprovider -rs --durations=15 tests/models/test_gpu_models.py > $OUT/gpu_models.log 2>&1
echo "gpu models rc=$? at ${SECONDS}s"; grep -E "passed|failed|^FAILED|^ERROR" $OUT/gpu_models.log | tail -n 12
