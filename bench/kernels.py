"""Our attention kernels vs torch SDPA (contiguous K/V) on the same shapes.

    PYTHONPATH=. python3 bench/kernels.py [--sweep] [--only prefill] [--json bench/results/kernels-h100.json]
        [--window 128] [--sinks] [--softcap 50]

"ours" is what the engine runs for the shape (`pagedserve.kernels.triton_backend.attend` given the step's new K/V,
as the fused rotary path calls it): the prefill kernel for prefill-heavy batches, the paged kernel
otherwise. Rows also show the other kernel where it could run ("paged_us", "prefill_kernel_us").

Times are medians of CUDA-graph replays (each graph runs the call many times, rotating over input
copies that together exceed L2), so launch overhead is out and the data comes from HBM. TB/s counts
the bytes a call must move at least (every K/V entry once, the queries and the output); "% copy" is
that rate over the measured device-to-device copy rate (bytes read + written). `--sweep` also times
alternative tilings of the kernel the engine uses for the shape (prefill kernel: tiles, GQA packing,
pointer vs TMA loads, warp specialisation; a variant that fails to compile is recorded and skipped) and
prints the best, which is how kernels/launch_config.py is tuned.

`--window W`, `--sinks`, `--softcap C` time every kernel with those attention features on (a local layer
of Mistral / Gemma / gpt-oss): the oracle is then the torch path, bytes and FLOPs count only the keys a
window lets the step see, and SDPA stays plain causal attention over the whole context (it has none of
them), for reference only.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import statistics
import sys
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import triton

# This script shares its name with the `kernels` package: keep its own folder off the import path.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

from pagedserve.kernels import reference  # noqa: E402
from pagedserve.kernels.attention_metadata import AttentionMetadata  # noqa: E402
from pagedserve.kernels.launch_config import (  # noqa: E402
    KV_LOADS,
    PREFILL_QUERY_LEN,
    AttentionConfig,
    PrefillConfig,
    choose_config,
    choose_prefill_config,
    uses_prefill_kernel,
)
from pagedserve.kernels.paged_attention import paged_attention  # noqa: E402
from pagedserve.kernels.paged_batch import PagedBatch, make_paged_batch, step_qkv  # noqa: E402
from pagedserve.kernels.prefill_attention import prefill_attention  # noqa: E402
from pagedserve.kernels.triton_backend import attend  # noqa: E402
from pagedserve.services.engine.torch_attention import paged_attention_padded  # noqa: E402

DTYPE = torch.bfloat16
DEVICE = "cuda"  # a CPU smoke run of the plumbing (interpreter) swaps this


@dataclass(frozen=True)
class Shape:
    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    groups: tuple[tuple[int, int, int], ...]  # (num_seqs, query_len, seq_len)
    block_size: int = 16
    kv_dtype: torch.dtype = DTYPE  # float8_e4m3fn: our kernel on an fp8 cache (SDPA stays bf16: it has none)

    @property
    def query_lens(self) -> list[int]:
        return [q for n, q, _ in self.groups for _ in range(n)]

    @property
    def seq_lens(self) -> list[int]:
        return [s for n, _, s in self.groups for _ in range(n)]


SHAPES = [
    Shape("decode b64 ctx4096 32/8 d128", 32, 8, 128, ((64, 1, 4096),)),
    Shape("decode b256 ctx1024 32/8 d128", 32, 8, 128, ((256, 1, 1024),)),
    Shape("decode b32 ctx8192 9/3 d64", 9, 3, 64, ((32, 1, 8192),)),
    Shape("decode b256 ctx1024 32/8 d128 fp8", 32, 8, 128, ((256, 1, 1024),), kv_dtype=torch.float8_e4m3fn),
    Shape("decode b64 ctx4096 32/8 d128 fp8", 32, 8, 128, ((64, 1, 4096),), kv_dtype=torch.float8_e4m3fn),
    Shape("prefill 8x2048 32/8 d128", 32, 8, 128, ((8, 2048, 2048),)),
    Shape("smollm2 prefill 16x512 9/3 d64", 9, 3, 64, ((16, 512, 512),)),
    Shape(
        "mixed 2x512 new + 2x512 after 1536 + 128 decodes ctx2048, 32/8 d128",
        32,
        8,
        128,
        ((2, 512, 512), (2, 512, 2048), (128, 1, 2048)),
    ),
]


@dataclass(frozen=True)
class Features:
    """Attention features every timed call runs with (--window, --sinks, --softcap); none by default."""

    window: int | None = None
    sinks: bool = False
    softcap: float | None = None

    def __bool__(self) -> bool:
        return self.window is not None or self.sinks or self.softcap is not None

    def label(self) -> str:
        parts = [f"window {self.window}"] if self.window is not None else []
        parts += ["sinks"] if self.sinks else []
        parts += [f"softcap {self.softcap:g}"] if self.softcap is not None else []
        return ", ".join(parts)

    def kwargs(self, num_heads: int, device: str) -> dict[str, Any]:
        """window / sinks / softcap as the kernels take them (sinks: one learned logit per head, bf16)."""
        sinks = torch.linspace(-2.0, 3.0, num_heads, device=device).to(DTYPE) if self.sinks else None
        return {"window": self.window, "sinks": sinks, "softcap": self.softcap}


def traffic(shape: Shape, kv_dtype: torch.dtype | None = None, window: int | None = None) -> tuple[int, float]:
    """(minimum bytes moved, attention FLOPs) of one call, with the shape's KV dtype unless given. With a window
    a query at position p sees keys (p - window, p]: only those count."""
    elem = torch.tensor([], dtype=DTYPE).element_size()
    kv_elem = (kv_dtype or shape.kv_dtype).itemsize
    reach = math.inf if window is None else window - 1  # keys a step's first query sees before its own
    kv_keys = sum(min(s, q + reach) for q, s in zip(shape.query_lens, shape.seq_lens))
    kv = int(kv_keys) * shape.num_kv_heads * shape.head_dim * 2 * kv_elem
    qo = 2 * sum(shape.query_lens) * shape.num_heads * shape.head_dim * elem
    if window is None:
        pairs = sum(q * (s - q) + q * (q + 1) / 2 for q, s in zip(shape.query_lens, shape.seq_lens))
    else:  # the query at position p sees min(p + 1, window) keys
        pairs = sum(min(p + 1, window) for q, s in zip(shape.query_lens, shape.seq_lens) for p in range(s - q, s))
    return kv + qo, 4.0 * shape.num_heads * shape.head_dim * pairs


def time_us(calls: list[Callable[[], object]], target_ms: float = 8.0) -> float:
    """Median per-call time of a CUDA graph that cycles through `calls` (one per input copy)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls * 2:  # compile, autotune libraries, warm the allocator
            call()
    torch.cuda.current_stream().wait_stream(stream)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for call in calls:
        call()
    end.record()
    torch.cuda.synchronize()
    reps = max(1, min(100, math.ceil(target_ms / max(start.elapsed_time(end), 1e-3))))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            for call in calls:
                call()
    graph.replay()
    times = []
    for _ in range(7):
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    del graph
    return statistics.median(times) * 1000.0 / (reps * len(calls))


def copy_bandwidth() -> dict[str, float]:
    """Device copy rates in TB/s (bytes read + written), and a read-only rate for context."""
    src = torch.randn(2**28, device="cuda")  # 1 GiB of fp32
    dst = torch.empty_like(src)
    total = torch.empty((), device="cuda")
    nbytes = src.numel() * src.element_size()
    rates = {
        "memcpy": 2 * nbytes / time_us([lambda: dst.copy_(src)]) / 1e6,
        "elementwise": 2 * nbytes / time_us([lambda: torch.mul(src, 1.0, out=dst)]) / 1e6,
        "read_only_sum": nbytes / time_us([lambda: torch.sum(src, 0, out=total)]) / 1e6,
    }
    rates["copy"] = max(rates["memcpy"], rates["elementwise"])
    return rates


def num_copies(bytes_per_call: int) -> int:
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 * 2**20)
    return max(1, min(8, math.ceil(3 * l2 / bytes_per_call)))


def sdpa_calls(shape: Shape, copies: int) -> list[Callable[[], object]]:
    """One SDPA call per group of equal-length sequences, on contiguous [n, heads, len, d] tensors."""
    from torch.nn.attention.bias import causal_lower_right

    def one_copy() -> Callable[[], object]:
        parts = []
        for n, q_len, s_len in shape.groups:
            q = torch.randn(n, shape.num_heads, q_len, shape.head_dim, device="cuda", dtype=DTYPE)
            k = torch.randn(n, shape.num_kv_heads, s_len, shape.head_dim, device="cuda", dtype=DTYPE)
            v = torch.randn_like(k)
            mask = None if q_len in (1, s_len) else causal_lower_right(q_len, s_len)
            parts.append((q, k, v, mask, q_len == s_len and q_len > 1))

        def call() -> None:
            for q, k, v, mask, is_causal in parts:
                F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=True)

        return call

    return [one_copy() for _ in range(copies)]


def sdpa_times(shape: Shape, copies: int) -> dict[str, float | str]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    calls = sdpa_calls(shape, copies)
    times: dict[str, float | str] = {}
    for backend in (None, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION):
        name = "default" if backend is None else backend.name.lower()
        try:
            if backend is None:
                times[name] = time_us(calls)
            else:
                with sdpa_kernel([backend]):
                    times[name] = time_us(calls)
        except Exception as exc:  # a backend that does not take this shape (GQA, mask, ...)
            times[name] = f"n/a: {type(exc).__name__}: {str(exc)[:120]}"
    return times


@dataclass(slots=True)
class StepInputs:
    """One input copy: the paged batch plus this step's q/k/v as views of one fused qkv buffer."""

    batch: PagedBatch
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    meta: AttentionMetadata


def step_inputs(batch: PagedBatch) -> StepInputs:
    query, key, value = step_qkv(batch)
    meta = AttentionMetadata(
        batch.slot_mapping,
        batch.query_start_loc,
        batch.seq_lens,
        batch.block_tables,
        batch.max_query_len,
        batch.max_seq_len,
    )
    return StepInputs(batch, query, key, value, meta)


def shape_inputs(shape: Shape, seed: int) -> StepInputs:
    """One random input copy of `shape`: its paged batch and this step's q/k/v."""
    return step_inputs(
        make_paged_batch(
            shape.query_lens,
            shape.seq_lens,
            num_heads=shape.num_heads,
            num_kv_heads=shape.num_kv_heads,
            head_dim=shape.head_dim,
            block_size=shape.block_size,
            dtype=DTYPE,
            device=DEVICE,
            seed=seed,
            kv_dtype=shape.kv_dtype,
        )
    )


Call = Callable[[], object]


def engine_call(features: dict[str, Any]) -> Callable[[StepInputs], Call]:
    def bind(x: StepInputs) -> Call:
        scale = x.query.shape[2] ** -0.5
        return lambda: attend(x.query, x.batch.kv_cache, x.meta, scale, key=x.key, value=x.value, **features)

    return bind


def paged_call(config: AttentionConfig, features: dict[str, Any]) -> Callable[[StepInputs], Call]:
    def bind(x: StepInputs) -> Call:
        b, scale = x.batch, x.query.shape[2] ** -0.5
        return lambda: paged_attention(
            x.query, b.kv_cache, b.query_start_loc, b.seq_lens, b.block_tables, scale, config, **features
        )

    return bind


def prefill_call(config: PrefillConfig, features: dict[str, Any]) -> Callable[[StepInputs], Call]:
    def bind(x: StepInputs) -> Call:
        b, scale = x.batch, x.query.shape[2] ** -0.5
        return lambda: prefill_attention(
            x.query,
            x.key,
            x.value,
            b.kv_cache,
            b.query_start_loc,
            b.seq_lens,
            b.block_tables,
            scale,
            config,
            **features,
        )

    return bind


# An fp8 cache moves half the bytes per key: also try tiles of twice the keys (the same bytes per load
# as bf16's 64), more warps for the e4m3 -> bf16 conversion, and deeper pipelines.
FP8_DECODE_TILES = [
    (128, 4, 2),
    (128, 4, 3),
    (128, 4, 4),
    (128, 8, 2),
    (128, 8, 3),
    (128, 8, 4),
    (256, 8, 2),
    (256, 8, 3),
    (64, 8, 3),
    (64, 4, 5),
]


def decode_sweep(
    base: AttentionConfig, num_sms: int, group: int, kv_bytes: int = 2
) -> list[Callable[[AttentionConfig], list[AttentionConfig]]]:
    """Issue 13: each key-loop variant against today's config first, then segments and tiles around
    the winner, then the cheap variants toggled on top of it."""
    rows = 1 << max(0, group - 1).bit_length()  # block_m without the 16-row MMA minimum

    def variants(_: AttentionConfig) -> list[AttentionConfig]:
        # Compiled offline for sm_90 (triton 3.6): today's gathers are not multi-buffered (shared
        # memory does not grow with num_stages); with prefetch=1 it does (72 KB at 3 stages, d128).
        # late_v and loop_stages compiled to the same registers and shared memory as today: left to
        # the toggles and the tests.
        cands = [
            base.with_(prefetch=1),
            base.with_(prefetch=1, num_stages=3),
            base.with_(prefetch=1, num_stages=4),
            base.with_(prefetch=1, num_warps=8),
            base.with_(prefetch=1, tile_n=32, num_stages=4),
            base.with_(prefetch=1, evict_kv=True),
            base.with_(evict_kv=True),
            base.with_(prefetch=2, num_stages=1),
            base.with_(use_dot=False, block_m=rows, tile_n=16, loop_stages=3),
            base.with_(persistent_programs=2 * num_sms, prefetch=1),
            base.with_(tile_n=128, num_warps=8, late_v=True, prefetch=1),
            base.with_(unroll=2),
        ]
        return [c for i, c in enumerate(cands) if c != base and c not in cands[:i]]

    def segments(best: AttentionConfig) -> list[AttentionConfig]:
        return [best.with_(num_segments=n) for n in (best.num_segments // 2, best.num_segments * 2) if 1 <= n <= 32]

    def tiles(best: AttentionConfig) -> list[AttentionConfig]:
        # (tile_n, num_warps, num_stages)
        shapes = [(64, 4, 2), (64, 4, 4), (32, 4, 3), (128, 4, 2)] if best.use_dot else [(16, 4, 1), (32, 4, 1)]
        shapes += FP8_DECODE_TILES if kv_bytes == 1 and best.use_dot else []
        cands = [best.with_(tile_n=t, num_warps=w, num_stages=st) for t, w, st in shapes]
        return [c for c in cands if c != best]

    def toggles(best: AttentionConfig) -> list[AttentionConfig]:
        return [
            best.with_(evict_kv=not best.evict_kv),
            best.with_(prefetch=0 if best.prefetch else 1),
            best.with_(late_v=not best.late_v),
        ]

    return [variants, segments, tiles, toggles]


def paged_sweep(
    base: AttentionConfig, num_sms: int = 132, group: int = 4, kv_bytes: int = 2
) -> list[Callable[[AttentionConfig], list[AttentionConfig]]]:
    """Phases of alternatives; each phase varies the best config found by the phases before it."""
    if base.is_decode_only:
        return decode_sweep(base, num_sms, group, kv_bytes)
    # (block_m, tile_n, num_warps, num_stages)
    tiles4 = [
        (128, 64, 8, 3),
        (128, 64, 8, 4),
        (64, 64, 4, 2),
        (64, 64, 4, 4),
        (64, 64, 8, 3),
        (64, 128, 4, 3),
        (128, 128, 8, 3),
        (64, 32, 4, 3),
        (32, 64, 4, 3),
    ]
    return [lambda best: [best.with_(block_m=m, tile_n=t, num_warps=w, num_stages=st) for m, t, w, st in tiles4]]


def prefill_sweep(base: PrefillConfig) -> list[Callable[[PrefillConfig], list[PrefillConfig]]]:
    """Tiles first (pointer loads), then layout x K/V loads on the best tiles, then warp specialisation."""
    # (block_m, block_n, num_warps, num_stages)
    tiles = [
        (128, 64, 8, 3),
        (128, 64, 8, 4),
        (128, 128, 8, 2),
        (128, 128, 8, 3),
        (128, 64, 4, 3),
        (64, 64, 4, 3),
        (128, 32, 8, 4),
        (64, 128, 4, 2),
    ]
    return [
        lambda best: [best.with_(block_m=m, block_n=n, num_warps=w, num_stages=st) for m, n, w, st in tiles],
        lambda best: [best.with_(pack_gqa=p, kv_load=k) for p in (True, False) for k in KV_LOADS],
        lambda best: (
            [best.with_(warp_specialize=True, kv_load=k) for k in KV_LOADS]
            + [best.with_(warp_specialize=True, kv_load="device_tma", num_warps=4)]
        ),
    ]


def run_shape(
    shape: Shape, copy_tbs: float, num_sms: int, do_sweep: bool, features: Features = Features()
) -> dict[str, object]:
    nbytes, flops = traffic(shape, window=features.window)
    feats = features.kwargs(shape.num_heads, DEVICE)
    copies = num_copies(nbytes)
    inputs = [shape_inputs(shape, seed=i) for i in range(copies)]
    b0 = inputs[0].batch
    scale = shape.head_dim**-0.5
    if features:  # the reference oracle has no windows, sinks or soft-capping; the torch path has
        ref = paged_attention_padded(
            b0.query,
            b0.kv_cache,
            b0.query_start_loc,
            b0.seq_lens,
            b0.block_tables,
            b0.max_query_len,
            b0.max_seq_len,
            scale,
            **feats,
        )
    else:
        ref = reference.paged_attention(b0.query, b0.kv_cache, b0.query_start_loc, b0.seq_lens, b0.block_tables, scale)
    prefill_with = functools.partial(prefill_call, features=feats)
    paged_with = functools.partial(paged_call, features=feats)
    num_seqs, num_tokens = len(shape.seq_lens), b0.num_tokens
    paged_config = choose_config(
        num_seqs=num_seqs,
        num_heads=shape.num_heads,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        max_query_len=b0.max_query_len,
        num_sms=num_sms,
        kv_dtype_bytes=shape.kv_dtype.itemsize,
    )
    prefill_config = choose_prefill_config(
        num_heads=shape.num_heads, num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim
    )
    engine_uses_prefill = uses_prefill_kernel(num_tokens=num_tokens, num_seqs=num_seqs, max_query_len=b0.max_query_len)

    def measure(bind: Callable[[StepInputs], Call], config: object = None) -> dict[str, object]:
        row: dict[str, object] = {"config": asdict(config) if config is not None else "engine"}  # type: ignore[call-overload]
        try:
            out = bind(inputs[0])()
            assert isinstance(out, torch.Tensor)
            err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            us = time_us([bind(x) for x in inputs]) if err < 1e-2 else float("nan")
        except Exception as exc:  # e.g. out of shared memory for a large tile, a feature this Triton lacks
            row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            print(f"  {shape.name}: {row['config']} failed: {row['error']}", flush=True)
            return row
        row.update(us=us, rel_err=err)
        print(f"  {shape.name}: {row['config']} {us:.1f} us (rel err {err:.1e})", flush=True)
        return row

    ours = measure(engine_call(feats))
    ours["kernel"] = "prefill" if engine_uses_prefill else "paged"
    paged = measure(paged_with(paged_config), paged_config) if engine_uses_prefill else ours
    prefill: dict[str, object] | None = None
    if b0.max_query_len >= PREFILL_QUERY_LEN:
        prefill = ours if engine_uses_prefill else measure(prefill_with(prefill_config), prefill_config)
    tried: list[dict[str, object]] = []
    best_swept: dict[str, object] | None = None
    if do_sweep:
        if engine_uses_prefill:
            best_swept = run_sweep(shape.name, measure, prefill_with, prefill_config, prefill_sweep, ours, tried)
        else:
            group = shape.num_heads // shape.num_kv_heads
            best_swept = run_sweep(
                shape.name,
                measure,
                paged_with,
                paged_config,
                lambda base: paged_sweep(base, num_sms, group, shape.kv_dtype.itemsize),
                ours,
                tried,
            )
    sdpa = sdpa_times(shape, copies)
    sdpa_us = min((t for t in sdpa.values() if isinstance(t, float)), default=math.nan)
    sdpa_us = float(sdpa["default"]) if isinstance(sdpa["default"], float) else sdpa_us
    sdpa_bytes = traffic(shape, DTYPE)[0]  # SDPA reads a bf16 K/V even beside an fp8 row
    ours_us = float(ours.get("us", math.nan))  # type: ignore[arg-type]
    return {
        "shape": shape.name + (f" [{features.label()}]" if features else ""),
        "features": features.label(),
        "bytes": nbytes,
        "flops": flops,
        "input_copies": copies,
        "ours": ours,
        "paged_us": paged.get("us", paged.get("error")),
        "prefill_kernel_us": None if prefill is None else prefill.get("us", prefill.get("error")),
        "sdpa_us": sdpa,
        "ours_tbs": nbytes / ours_us / 1e6,
        "sdpa_tbs": sdpa_bytes / sdpa_us / 1e6,
        "ours_pct_copy": 100 * nbytes / ours_us / 1e6 / copy_tbs,
        "sdpa_pct_copy": 100 * sdpa_bytes / sdpa_us / 1e6 / copy_tbs,
        "ours_tflops": flops / ours_us / 1e6,
        "sdpa_tflops": flops / sdpa_us / 1e6,
        "speedup_vs_sdpa": sdpa_us / ours_us,
        "sdpa_default_us": sdpa_us,
        "ours_us": ours_us,
        "best_swept": best_swept,
        "sweep": tried,
    }


def run_sweep(
    name: str,
    measure: Callable[..., dict[str, object]],
    call_for: Callable[[Any], Callable[[StepInputs], Call]],
    base: Any,
    phases_for: Callable[[Any], list[Callable[[Any], list[Any]]]],
    base_row: dict[str, object],
    tried: list[dict[str, object]],
) -> dict[str, object]:
    """Run the phases, each around the best config so far; every measurement goes to `tried`."""
    best, best_us = base, float(base_row.get("us", math.inf))  # type: ignore[arg-type]
    seen = {base}
    for phase in phases_for(base):
        for cfg in phase(best):
            if cfg in seen:
                continue
            seen.add(cfg)
            tried.append(measure(call_for(cfg), cfg))
            us = float(tried[-1].get("us", math.inf))  # type: ignore[arg-type]
            if us < best_us:
                best, best_us = cfg, us
        print(f"  sweep {name}: best so far {best} {best_us:.1f} us", flush=True)
    return {"config": asdict(best), "us": best_us}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", action="store_true", help="also time alternative tilings")
    parser.add_argument("--json", type=Path, default=Path("bench/results/kernels.json"))
    parser.add_argument("--only", default="", help="run only shapes whose name contains this")
    parser.add_argument("--window", type=int, default=None, help="a sliding window on every call (keys)")
    parser.add_argument("--sinks", action="store_true", help="learned per-head sinks on every call")
    parser.add_argument("--softcap", type=float, default=None, help="attention-logit soft-capping on every call")
    parser.add_argument("--once", metavar="SHAPE", help="the engine's kernel and SDPA's, 3 calls each, for ncu")
    args = parser.parse_args()
    features = Features(args.window, args.sinks, args.softcap)
    if args.once:
        by_name = {shape.name: shape for shape in SHAPES}
        if args.once not in by_name:
            parser.error(f"--once takes one of: {', '.join(by_name)}")
        call_once(by_name[args.once], features)
        return
    props = torch.cuda.get_device_properties(0)
    rates = copy_bandwidth()
    copy_tbs = rates["copy"]
    print(f"{props.name}: {props.multi_processor_count} SMs, rates {rates}", flush=True)
    result: dict[str, object] = {
        "device": props.name,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "command": "PYTHONPATH=. python3 bench/kernels.py"
        + (" --sweep" if args.sweep else "")
        + (f" --only '{args.only}'" if args.only else "")
        + (f" --window {args.window}" if args.window is not None else "")
        + (" --sinks" if args.sinks else "")
        + (f" --softcap {args.softcap:g}" if args.softcap is not None else ""),
        "features": features.label(),
        "copy_tbs": copy_tbs,
        "bandwidth_tbs": rates,
        "rows": [],
    }
    rows: list[dict[str, object]] = result["rows"]  # type: ignore[assignment]
    args.json.parent.mkdir(parents=True, exist_ok=True)
    for shape in SHAPES:
        if args.only not in shape.name:
            continue
        try:
            rows.append(run_shape(shape, copy_tbs, props.multi_processor_count, args.sweep, features))
        except Exception:  # keep the other shapes' numbers
            traceback.print_exc()
            continue
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "sweep"}), flush=True)
        args.json.write_text(json.dumps(result, indent=1))  # after every shape: a timeout keeps the rest
        torch.cuda.empty_cache()
    print(f"\n{props.name}, copy {copy_tbs:.2f} TB/s (read + write), bf16, block_size 16")
    print(
        f"{'shape':<70} {'kernel':>7} {'ours µs':>9} {'SDPA µs':>9} {'SDPA/ours':>9} {'paged µs':>9} "
        f"{'prefill µs':>10} {'ours TB/s':>9} {'SDPA TB/s':>9} {'ours TF/s':>9} {'SDPA TF/s':>9}"
    )
    for r in rows:
        print(
            f"{r['shape']:<70} {r['ours'].get('kernel', '?'):>7} {r['ours_us']:>9.1f} "  # type: ignore[attr-defined]
            f"{r['sdpa_default_us']:>9.1f} {r['speedup_vs_sdpa']:>9.2f} {_us(r['paged_us']):>9} "
            f"{_us(r['prefill_kernel_us']):>10} {r['ours_tbs']:>9.2f} {r['sdpa_tbs']:>9.2f} "
            f"{r['ours_tflops']:>9.1f} {r['sdpa_tflops']:>9.1f}"
        )
    for r in rows:
        if r["best_swept"] is not None:
            print(f"best swept, {r['shape']}: {r['best_swept']}")


def call_once(shape: Shape, features: Features) -> None:
    """Three calls of the engine's attention and three of SDPA's default on one input of `shape`, eager (for a
    profiler: `ncu -k regex:...` picks the kernels)."""
    x = shape_inputs(shape, seed=0)
    ours, sdpa = engine_call(features.kwargs(shape.num_heads, DEVICE))(x), sdpa_calls(shape, 1)[0]
    for call in (ours, ours, ours, sdpa, sdpa, sdpa):
        call()
    torch.cuda.synchronize()


def _us(value: object) -> str:
    return f"{value:.1f}" if isinstance(value, float) else "-" if value is None else "error"


if __name__ == "__main__":
    main()
