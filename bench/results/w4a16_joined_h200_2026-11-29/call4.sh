#!/usr/bin/env bash
# Session 23 call 4 (one H200): why the 4-bit kernels stop where they do. Nsight Compute's stall reasons (warp
# cycles a issued instruction, by reason) for the served kernels on the 8B gate_up at 64, 16 and 1 row (GEMM, GEMM,
# GEMV) and down at 64; the 8B GPTQ decode at batch 64 with a kernel profile, on call 3's defaults.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONPATH=.
export TRITON_CACHE_DIR=$PWD/build/triton-cache
python3 -m pip install -q --no-deps build/wheels-cp312/*.whl > /tmp/pip.log 2>&1
for once in 64:gate_up 64:down 16:gate_up 1:gate_up; do
  tag=${once/:/_}
  timeout 90 ncu --set full -k regex:w4a16 --launch-skip 2 --launch-count 1 -f -o /tmp/ncu_$tag \
    python3 -m bench w4a16_gemm --once $once > /tmp/ncu_$tag.log 2>&1
  echo "ncu $once rc=$? at ${SECONDS}s"
  ncu --import /tmp/ncu_$tag.ncu-rep --page raw > /tmp/raw_$tag.txt 2>&1
  (echo "== $once"; grep -E "_kernel \(|gpu__time_duration.sum|sm__warps_active.avg.per_cycle_active|smsp__average_warps_issue_stalled_.*_per_issue_active|smsp__issue_active.avg.per_cycle_active|sm__pipe_tensor_op_hmma_cycles_active.avg.pct|sm__inst_executed_pipe_alu|dram__throughput.avg.pct" /tmp/raw_$tag.txt) >> $OUT/ncu_stalls.txt
done
python3 - $OUT/ncu_stalls.txt <<'PY'
import re, sys
block, rows = None, {}
for line in open(sys.argv[1]):
    if line.startswith("== "):
        block = line[3:].strip(); rows[block] = {}
    m = re.search(r"smsp__average_warps_issue_stalled_(\w+)_per_issue_active\.ratio\s+\S*\s+([\d.,]+)", line)
    if m and block:
        rows[block][m.group(1)] = float(m.group(2).replace(",", ""))
for block, stalls in rows.items():
    top = sorted(stalls.items(), key=lambda kv: -kv[1])[:6]
    print(block, " ".join(f"{k}:{v:.2f}" for k, v in top))
PY
timeout 150 python3 -m bench model_shapes --models llama-3.1-8b --batches 64 --quantization gptq --kernel-profile 8 \
  --run-timeout-s 140 --json $OUT/e2e_8b_gptq.json > $OUT/e2e_8b_gptq.log 2>&1
echo "e2e gptq rc=$? at ${SECONDS}s"; grep -E "^\| llama" $OUT/e2e_8b_gptq.log | tail -n 1
