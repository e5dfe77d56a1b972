#!/usr/bin/env bash
# Session 24 call 1 (one H200): the grammar worker's batched accept keeps the GIL (matcher_calls.batch_accept).
# GPU structured tests; the xgrammar calls beside a busy thread on this host; the structured throughput A/B
# (the engine's accept, then xgrammar's own with --xgrammar-accept), each with all-plain, mixed and all-json runs.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONPATH=.
export TRITON_CACHE_DIR=$PWD/build/triton-cache
python3 -m pip install -q --no-deps build/wheels-cp312/*.whl > /tmp/pip.log 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > $OUT/env.txt
python3 -c "import torch, triton, sys; print(sys.version.split()[0], torch.__version__, triton.__version__)" >> $OUT/env.txt
nproc >> $OUT/env.txt; cat $OUT/env.txt
timeout 90 python3 -m pytest -q -o addopts='' -p no:cacheprovider tests/engine/test_structured_cuda.py > $OUT/tests.log 2>&1
echo "tests rc=$? at ${SECONDS}s"; grep -E "passed|failed|^FAILED|^ERROR" $OUT/tests.log | tail -n 4
timeout 60 python3 -m bench.xgrammar_gil --tokenizer build/smollm2-tokenizer --json $OUT/xgrammar_gil_h200.json > /tmp/xg.log 2>&1
echo "xgrammar_gil rc=$? at ${SECONDS}s"; tail -n 7 /tmp/xg.log
for variant in held_accept xgrammar_accept; do
  flag=""; [ $variant = xgrammar_accept ] && flag="--xgrammar-accept"
  timeout 220 python3 -m bench.structured_throughput --tokenizer build/smollm2-tokenizer --models smollm2-135m \
    --max-num-batched-tokens 2048 $flag --tag _$variant --out-dir $OUT >> $OUT/structured.log 2>&1
  echo "structured $variant rc=$? at ${SECONDS}s"; tail -n 3 $OUT/structured_throughput_h200_$variant.md 2>/dev/null
done
