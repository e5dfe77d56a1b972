#!/usr/bin/env bash
# Session 24 call 4 (one H200): where the GIL goes when 256 json_schema rows share a step. py-spy samples the
# threads holding the GIL (--gil) through one structured_throughput process (all-plain, mixed, all-json runs).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONPATH=.
export TRITON_CACHE_DIR=$PWD/build/triton-cache
python3 -m pip install -q --no-deps build/wheels-cp312/*.whl > /tmp/pip.log 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > $OUT/env.txt
nproc >> $OUT/env.txt; uptime >> $OUT/env.txt; cat $OUT/env.txt
common="--tokenizer build/smollm2-tokenizer --models smollm2-135m --max-num-batched-tokens 2048"
timeout 100 python3 -m bench.structured_throughput $common --quick --out-dir /tmp/warm > /tmp/warm.log 2>&1
echo "warm-up rc=$? at ${SECONDS}s"
timeout 200 py-spy record --gil --format raw -r 500 -o /tmp/pyspy_gil.txt -- \
  python3 -m bench.structured_throughput $common --tag _pyspy_gil --out-dir /tmp/s > $OUT/structured_gil.log 2>&1
echo "py-spy --gil rc=$? at ${SECONDS}s"; tail -n 1 /tmp/s/structured_throughput_h200_pyspy_gil.md
cp /tmp/s/structured_throughput_h200_pyspy_gil.json $OUT/; gzip -c /tmp/pyspy_gil.txt > $OUT/pyspy_gil.txt.gz
timeout 200 py-spy record --format raw -r 500 -o /tmp/pyspy_running.txt -- \
  python3 -m bench.structured_throughput $common --tag _pyspy_running --out-dir /tmp/s > $OUT/structured_running.log 2>&1
echo "py-spy rc=$? at ${SECONDS}s"; tail -n 1 /tmp/s/structured_throughput_h200_pyspy_running.md
cp /tmp/s/structured_throughput_h200_pyspy_running.json $OUT/; gzip -c /tmp/pyspy_running.txt > $OUT/pyspy_running.txt.gz
ls -la $OUT
