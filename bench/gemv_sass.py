"""The W4A16 GEMV's inner loop as sm_90 SASS, compiled offline: registers, programs an SM, and instructions per weight.

    python3 -m bench gemv_sass [--tiles 512,4,8 256,2,8 512,4,4] [--sms 132 --clock-ghz 1.98]

No GPU needed: triton compiles the kernel (kernels/w4a16_gemv.py, one row, PDL, prefetch, split-K) to PTX, its
bundled ptxas to a cubin and nvdisasm lists the SASS. The longest loop (the K walk) is counted by opcode. Each
of an SM's four schedulers issues one warp instruction a cycle, so at the loop's instructions per weight the
SM cannot unpack faster than 4 x 32 / (instructions per weight) weights a cycle; the integer pipe (logic, shifts,
byte permutes, integer adds) does 64 lanes a cycle, half the FMA rate, so its instructions count twice. The
lower of the two is the "ceiling" below, in bytes of 4-bit weights a second over `--sms` SMs at `--clock-ghz`
(an H100 / H200 SXM: 132 SMs, 1.98 GHz boost). A kernel at it is bound by instruction throughput, not by
memory, whatever the HBM allows.
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from pagedserve.kernels import w4a16_gemv

TYPES = {"x_ptr": "*bf16", "qweight_ptr": "*i32", "qzeros_ptr": "*i32", "scales_ptr": "*bf16", "out_ptr": "*bf16"}
TYPES |= {"partial_ptr": "*fp32", "counter_ptr": "*i32"}
SASS_LINE = re.compile(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)")
REGISTERS_PER_SM, MAX_THREADS_PER_SM = 65536, 2048
INTEGER_PIPE = {"LOP3", "SHF", "PRMT", "IADD3", "MOV", "SEL", "ISETP", "LEA", "SGXT", "BMSK"}


def sass(block_n: int, warps: int, rows: int, split: int = 4) -> tuple[int, str]:
    """(registers a thread, the SASS listing) of the one-row GEMV at these tiles."""
    kernel = w4a16_gemv._w4a16_gemv_kernel
    names = kernel.arg_names
    constexprs = dict(
        BLOCK_M=1, BLOCK_N=block_n, SLICE_GROUPS=False, SPLIT_K=split, ROWS=rows, PREFETCH=True, USE_PDL=True
    )
    signature = {n: "constexpr" if n in constexprs else TYPES.get(n, "i32") for n in names}
    # the divisibility a real launch specialises on (without it no load vectorises)
    aligned = [n for n in names if n.endswith("_ptr") or n.startswith("stride_") or n in ("N", "K", "k_per_split")]
    source = ASTSource(
        kernel,
        signature,
        constexprs={(names.index(k),): v for k, v in constexprs.items()},
        attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned},
    )
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    ptxas = Path(triton.backends.nvidia.compiler.get_ptxas(90).path)
    with tempfile.TemporaryDirectory() as tmp:
        ptx, cubin = Path(tmp, "k.ptx"), Path(tmp, "k.cubin")
        ptx.write_text(compiled.asm["ptx"])
        log = subprocess.run(
            [ptxas, "-v", "--gpu-name=sm_90a", ptx, "-o", cubin], capture_output=True, text=True, check=True
        ).stderr
        listing = subprocess.run([ptxas.with_name("nvdisasm"), "-c", cubin], capture_output=True, text=True).stdout
    found = re.search(r"Used (\d+) registers", log)
    assert found, log
    return int(found.group(1)), listing


def longest_loop(listing: str) -> collections.Counter[str]:
    """Opcodes of the longest backward-branch loop of a SASS listing."""
    lines = listing.splitlines()
    labels = {line.strip()[:-1]: i for i, line in enumerate(lines) if re.match(r"^\.L_x_\d+:$", line.strip())}
    best: list[str] = []
    for i, line in enumerate(lines):
        target = re.search(r"BRA `\((\.L_x_\d+)\)", line)
        if target and labels.get(target.group(1), i) < i:
            body = [m.group(1) for m in map(SASS_LINE.match, lines[labels[target.group(1)] : i + 1]) if m]
            best = max(best, body, key=len)
    return collections.Counter(best)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiles", nargs="+", default=["512,4,8", "256,2,8", "512,4,4", "1024,4,4"])
    parser.add_argument("--sms", type=int, default=132)
    parser.add_argument("--clock-ghz", type=float, default=1.98)
    args = parser.parse_args()
    header = ("BLOCK_N,warps,ROWS", "regs", "progs/SM", "loop", "/weight", "int/weight", "ceiling")
    print("{:>18} {:>5} {:>8} {:>6} {:>8} {:>10} {:>12}  top opcodes".format(*header))
    for tiles in args.tiles:
        block_n, warps, rows = map(int, tiles.split(","))
        registers, listing = sass(block_n, warps, rows)
        per_warp = -(-registers // 8) * 8 * 32
        programs = min(REGISTERS_PER_SM // (per_warp * warps), MAX_THREADS_PER_SM // (32 * warps))
        loop = longest_loop(listing)
        weights = (block_n // (32 * warps)) * rows * 8  # a thread's columns x packed rows x 8 codes
        per_weight = sum(loop.values()) / weights
        integer = sum(n for op, n in loop.items() if op in INTEGER_PIPE) / weights
        cycles = max(per_weight, 2 * integer) / (4 * 32)  # an SM's cycles a weight
        ceiling = args.sms * args.clock_ghz * 1e9 / cycles / 2 / 1e12  # TB/s of 4-bit weights
        top = " ".join(f"{op}:{n}" for op, n in loop.most_common(8))
        cells = f"{tiles:>18} {registers:5d} {programs:8d} {sum(loop.values()):6d} {per_weight:8.2f} {integer:10.2f}"
        print(f"{cells} {ceiling:7.2f} TB/s  {top}")


if __name__ == "__main__":
    main()
