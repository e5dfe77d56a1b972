"""Registers, spills and shared memory of the decode sweep's kernel variants, compiled for sm_90 offline.

    PYTHONPATH=/path/to/triton-3.6:. python3 bench/decode_resources.py

No GPU needed: triton compiles to PTX and its bundled ptxas reports the resources. Use the triton
version the GPU box runs (3.6 today; `pip install --target DIR triton==3.6.0`), since the pipeliner
changes between versions. The strides get the divisibility-by-16 hint a real launch specialises on
(without it no load vectorises and every variant looks like it spills). It showed that today's
gathers are not multi-buffered (shared memory does not grow with num_stages) and prefetch=1 is.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

# This script sits next to bench/kernels.py, which shares its name with the `kernels` package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

from pagedserve.kernels import paged_attention as pa  # noqa: E402
from pagedserve.kernels.launch_config import AttentionConfig, choose_config  # noqa: E402

_spec = importlib.util.spec_from_file_location("bench_kernels", Path(__file__).with_name("kernels.py"))
assert _spec is not None and _spec.loader is not None
bench = importlib.util.module_from_spec(_spec)
sys.modules["bench_kernels"] = bench  # dataclasses look their module up while the class is built
_spec.loader.exec_module(bench)

TYPES = {
    "seg_out_ptr": "*fp32",
    "seg_max_ptr": "*fp32",
    "seg_sum_ptr": "*fp32",
    "block_tables_ptr": "*i32",
    "seq_lens_ptr": "*i32",
    "query_start_loc_ptr": "*i32",
    "qk_scale": "fp32",
    "v_scale": "fp32",
    "softcap": "fp32",
}


def resources(cfg: AttentionConfig, num_heads: int, num_kv_heads: int, head_dim: int) -> str:
    constexprs = dict(
        NUM_HEADS=num_heads,
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        HEAD_DIM_PADDED=head_dim,
        BLOCK_SIZE=16,
        BLOCK_M=cfg.block_m,
        BLOCK_Q=1,
        TILE_N=cfg.tile_n,
        NUM_SEGMENTS=cfg.num_segments,
        IS_DECODE_ONLY=True,
        DOT_PRECISION="tf32",
        PREFETCH=cfg.prefetch,
        LOOP_STAGES=cfg.loop_stages or None,
        UNROLL=cfg.unroll or None,
        KV_EVICT="evict_first" if cfg.evict_kv else "",
        BT_EVICT="evict_last" if cfg.evict_kv else "",
        LATE_V=cfg.late_v,
        USE_DOT=cfg.use_dot,
        PERSISTENT_PROGRAMS=cfg.persistent_programs,
        HAS_WINDOW=False,
        HAS_SINKS=False,
        SOFTCAP=False,
    )
    names = pa._paged_attention_kernel.arg_names
    signature = {
        n: "constexpr" if n in constexprs else TYPES.get(n, "*bf16" if n.endswith("_ptr") else "i32") for n in names
    }
    aligned = [n for n in names if n.endswith("_ptr") or n.startswith("stride_")]
    src = ASTSource(
        pa._paged_attention_kernel,
        signature,
        constexprs={(names.index(k),): v for k, v in constexprs.items()},
        attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned},
    )
    compiled = triton.compile(
        src, target=GPUTarget("cuda", 90, 32), options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    )
    ptxas = triton.backends.nvidia.compiler.get_ptxas(90).path
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(compiled.asm["ptx"])
        f.flush()
        log = subprocess.run(
            [ptxas, "-v", "--gpu-name=sm_90a", f.name, "-o", "/dev/null"], capture_output=True, text=True, check=True
        ).stderr
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores", log)
    return (
        f"{regs.group(1) if regs else '?':>4} regs {spills.group(1) if spills else '?':>5} B spilled "
        f"{compiled.metadata.shared / 1024:6.1f} KiB smem"
    )


def main() -> None:
    for shape in bench.SHAPES:
        if not shape.name.startswith("decode"):
            continue
        base = choose_config(
            num_seqs=len(shape.seq_lens),
            num_heads=shape.num_heads,
            num_kv_heads=shape.num_kv_heads,
            head_dim=shape.head_dim,
            max_query_len=1,
            num_sms=132,
        )
        print(shape.name, flush=True)
        seen: list[AttentionConfig] = []
        for phase in bench.decode_sweep(base, 132, shape.num_heads // shape.num_kv_heads):
            for cfg in [base, *phase(base)]:
                if cfg in seen:
                    continue
                seen.append(cfg)
                try:
                    line = resources(cfg, shape.num_heads, shape.num_kv_heads, shape.head_dim)
                except Exception as exc:  # a variant this triton cannot compile: the GPU sweep would skip it too
                    line = f"FAILED {type(exc).__name__}: {str(exc)[:160]}"
                print(f"  {bench.config_diff(base, cfg):<62} {line}", flush=True)


if __name__ == "__main__":
    main()
