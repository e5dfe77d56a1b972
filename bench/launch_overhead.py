"""Host time per launch of the ops an eager SmolLM2-shaped layer runs (CUDA; what bounds a prefill step).

    python3 -m bench.launch_overhead          # from the repo root

Each op is called 30 times on an 8,192-token step (16 x 512, 9/3 heads, head_dim 64) without waiting for
the GPU (the queue never fills at this count); the table shows host microseconds per call. A step whose
kernels take less than the sum of these per layer is launch-bound.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pagedserve.kernels.fused_norm import add_rms_norm_
from pagedserve.kernels.launch_config import choose_config, choose_prefill_config
from pagedserve.kernels.paged_attention import paged_attention
from pagedserve.kernels.prefill_attention import prefill_attention
from pagedserve.kernels.rotary_kv_write import rotary_write_kv_cache
from pagedserve.kernels.silu_mul import silu_mul


def host_us(fn: Callable[[], object], calls: int = 30) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    seconds = (time.perf_counter() - start) / calls
    torch.cuda.synchronize()
    return seconds * 1e6


def main() -> None:
    dev, bf = "cuda", torch.bfloat16
    tokens, heads, kv_heads, head_dim, hidden, inter = 8192, 9, 3, 64, 576, 1536
    x = torch.randn(tokens, hidden, device=dev, dtype=bf)
    norm_weight = torch.ones(hidden, device=dev, dtype=bf)
    qkv_weight = torch.randn((heads + 2 * kv_heads) * head_dim, hidden, device=dev, dtype=bf)
    gate_up = torch.randn(tokens, 2 * inter, device=dev, dtype=bf)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device=dev, dtype=bf)
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    q = qkv[:, :q_size].view(tokens, heads, head_dim)
    k = qkv[:, q_size : q_size + kv_size].view(tokens, kv_heads, head_dim)
    v = qkv[:, q_size + kv_size :].view(tokens, kv_heads, head_dim)
    positions = torch.arange(tokens, device=dev) % 512
    cos = torch.randn(4096, head_dim, device=dev, dtype=bf)
    sin = torch.randn(4096, head_dim, device=dev, dtype=bf)
    cache = torch.zeros(2, 1024, 16, kv_heads, head_dim, device=dev, dtype=bf)
    slots = torch.arange(tokens, device=dev)
    starts = torch.arange(0, tokens + 1, 512, device=dev, dtype=torch.int32)
    lens = torch.full((16,), 512, device=dev, dtype=torch.int32)
    tables = torch.arange(16 * 32, device=dev, dtype=torch.int32).view(16, 32)
    prefill = choose_prefill_config(num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    paged = choose_config(
        num_seqs=16, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, max_query_len=512, num_sms=num_sms
    )
    ops: dict[str, Callable[[], object]] = {
        "linear (qkv projection)": lambda: F.linear(x, qkv_weight),
        "add + RMSNorm": lambda: add_rms_norm_(x, None, norm_weight, 1e-5),
        "SiLU x mul": lambda: silu_mul(gate_up),
        "rotary + KV write": lambda: rotary_write_kv_cache(positions, q, k, v, cos, sin, cache, slots),
        f"prefill attention ({prefill.kv_load})": lambda: prefill_attention(
            q, k, v, cache, starts, lens, tables, 0.125, prefill
        ),
        "paged attention": lambda: paged_attention(q, cache, starts, lens, tables, 0.125, paged),
        "qkv split + view": lambda: qkv.split([q_size, kv_size, kv_size], dim=-1)[0].view(tokens, heads, head_dim),
    }
    print(f"{torch.cuda.get_device_name()}: host µs per call")
    for name, fn in ops.items():
        print(f"  {name:34s} {host_us(fn):7.1f}")


if __name__ == "__main__":
    main()
