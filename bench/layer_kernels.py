"""Kernels launched per Llama decoder layer, unfused vs fused (torch.profiler, one eager decode step).

    python3 -m bench.layer_kernels [--json out.json]      # on a CUDA machine, from the repo root

For each shape (SmolLM2-135M, Llama-3.1-8B; random weights, 2 layers), a decode batch of 64 sequences
at 512 context is run through one decoder layer with `fused_ops` off and on, and every CUDA kernel the
profiler sees is counted and named. Prints a table; --json writes the counts and kernel names.
On CPU (`--device cpu`, TRITON_INTERPRET=1) it only smoke-tests the script and counts nothing useful.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from pagedserve.services.engine import attention
from pagedserve.services.engine.attention import AttentionMetadata
from pagedserve.services.engine.models import fused_ops, load_model
from pagedserve.services.engine.models.llama import LlamaDecoderLayer

SHAPES: dict[str, dict[str, Any]] = {
    "smollm2-135m": dict(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    ),
    "llama-3.1-8b": dict(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ),
}


def build(name: str, device: torch.device, dtype: torch.dtype, num_layers: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        **SHAPES[name], num_hidden_layers=num_layers, max_position_embeddings=4096, architectures=["LlamaForCausalLM"]
    )
    model_dir = Path(tempfile.mkdtemp(prefix=f"layer-kernels-{name}-"))
    config.save_pretrained(model_dir)
    with device:
        hf = LlamaForCausalLM._from_config(config, dtype=dtype).eval().requires_grad_(False)
    return load_model(
        model_dir, dtype, device, max_model_len=4096, show_progress=False, tensors=hf.state_dict().items()
    )


def decode_batch(model: Any, num_seqs: int, ctx: int, block_size: int, device: torch.device) -> tuple[Any, ...]:
    spec = model.spec
    blocks_per_seq = (ctx + block_size - 1) // block_size
    num_blocks = num_seqs * blocks_per_seq
    kv_cache = torch.randn((2, num_blocks, block_size, spec.num_kv_heads, spec.head_dim), device=device)
    kv_cache = kv_cache.to(spec.dtype)
    tables = torch.randperm(num_blocks, device=device).view(num_seqs, blocks_per_seq).to(torch.int32)
    positions = torch.full((num_seqs,), ctx - 1, device=device, dtype=torch.int64)
    slots = tables[:, (ctx - 1) // block_size].long() * block_size + (ctx - 1) % block_size
    meta = AttentionMetadata(
        slot_mapping=slots,
        query_start_loc=torch.arange(num_seqs + 1, device=device, dtype=torch.int32),
        seq_lens=torch.full((num_seqs,), ctx, device=device, dtype=torch.int32),
        block_tables=tables,
        max_query_len=1,
        max_seq_len=ctx,
    )
    x = torch.randn((num_seqs, spec.hidden_size), device=device).to(spec.dtype)
    return positions, x, kv_cache, meta


def count_layer_kernels(model: Any, batch: tuple[Any, ...], fused: bool) -> Counter[str]:
    positions, x, kv_cache, meta = batch
    layer = model.model.layers[1]
    assert isinstance(layer, LlamaDecoderLayer)
    fused_ops.set_fusion("on" if fused else "off")

    def run(x_in: torch.Tensor, residual: torch.Tensor) -> None:
        with torch.inference_mode():
            if fused:
                layer.forward_residual(positions, x_in, residual, kv_cache, meta)
            else:
                layer(positions, x_in, kv_cache, meta)

    run(x.clone(), x.clone())  # compile / autotune outside the profile
    inputs = (x.clone(), x.clone())  # the fused layer works in place: fresh inputs, made before profiling
    if x.is_cuda:
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA] if x.is_cuda else [ProfilerActivity.CPU]) as prof:
        run(*inputs)
        if x.is_cuda:
            torch.cuda.synchronize()
    names: Counter[str] = Counter()
    for event in prof.events():
        if x.is_cuda and event.device_type == torch.autograd.DeviceType.CUDA:
            names[event.name[:90]] += 1
    return +names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--num-seqs", type=int, default=64)
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    attention.use_backend("triton")
    report: dict[str, Any] = {}
    print(
        f"{'shape':14s} {'unfused':>8s} {'fused':>6s}   (CUDA kernels per decoder layer, decode b{args.num_seqs}"
        f" x {args.ctx} ctx)"
    )
    for name in SHAPES:
        model = build(name, device, dtype, num_layers=2)
        batch = decode_batch(model, args.num_seqs, args.ctx, 16, device)
        counts = {mode: count_layer_kernels(model, batch, mode == "fused") for mode in ("unfused", "fused")}
        report[name] = {mode: {"total": sum(c.values()), "kernels": dict(c)} for mode, c in counts.items()}
        print(f"{name:14s} {report[name]['unfused']['total']:8d} {report[name]['fused']['total']:6d}", flush=True)
        for mode, c in counts.items():
            for kernel, n in sorted(c.items()):
                print(f"    {mode:8s} {n:3d} x {kernel}")
        del model, batch
    fused_ops.set_fusion("auto")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
