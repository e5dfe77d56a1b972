"""FP8 vs bf16 linears at decode sizes on the Llama-3.1-8B shapes (CUDA; why FP8 weights gain < 2x there).

    python3 -m bench.fp8_gemm                 # from the repo root

Per linear (qkv, o, gate_up, down) and rows M: bf16 `F.linear`; `torch._scaled_mm` with row-wise scales
(what `--quantization fp8` runs) with and without our per-token activation quantisation; tensor-wise
scales for comparison. Microseconds, CUDA-graph timed (`triton.testing.do_bench_cudagraph`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from triton.testing import do_bench_cudagraph

from pagedserve.kernels.fp8_quant import quantize_rows_fp8

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}  # (K, N)


def time_linear(rows: int, k: int, n: int) -> list[float]:
    """µs of: bf16, row-wise fp8, row-wise fp8 with quantisation, tensor-wise fp8, the quantisation alone."""
    dev, bf, fp8 = "cuda", torch.bfloat16, torch.float8_e4m3fn
    x = torch.randn(rows, k, device=dev, dtype=bf)
    w = torch.randn(n, k, device=dev, dtype=bf)
    w_q, x_q = w.to(fp8), x.to(fp8)
    scale_a, scale_b, one = torch.ones(rows, 1, device=dev), torch.ones(1, n, device=dev), torch.ones((), device=dev)

    def rowwise() -> torch.Tensor:
        return torch._scaled_mm(x_q, w_q.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=bf)

    def quantised() -> torch.Tensor:
        a, s = quantize_rows_fp8(x)
        return torch._scaled_mm(a, w_q.t(), scale_a=s[:, None], scale_b=scale_b, out_dtype=bf)

    def tensorwise() -> torch.Tensor:
        return torch._scaled_mm(x_q, w_q.t(), scale_a=one, scale_b=one, out_dtype=bf)

    calls = [lambda: F.linear(x, w), rowwise, quantised, tensorwise, lambda: quantize_rows_fp8(x)]
    return [do_bench_cudagraph(call) * 1e3 for call in calls]


def main() -> None:
    print(f"{torch.cuda.get_device_name()}: µs per call")
    print(f"{'M':>5} {'linear':>8} {'bf16':>8} {'rowwise':>8} {'+quant':>8} {'tensorw':>8} {'quant':>7}")
    for rows in (128, 256, 1024):
        for name, (k, n) in SHAPES.items():
            times = time_linear(rows, k, n)
            print(f"{rows:5d} {name:>8} " + " ".join(f"{t:8.1f}" for t in times), flush=True)


if __name__ == "__main__":
    main()
