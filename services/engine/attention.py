"""Paged attention as the models call it: per-step metadata (defined in kernels/) plus a backend chosen at
start-up.

The CPU path is a batched torch version of `pagedserve.kernels.reference` (the oracle); on CUDA the Triton kernels in
`kernels/` take over (`use_backend("triton")`). Models never import a backend directly.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagedserve.kernels import reference
from pagedserve.kernels.attention_metadata import AttentionMetadata
from pagedserve.services.engine.torch_attention import paged_attention_padded

__all__ = ["AttentionMetadata", "backend_name", "default_backend", "paged_attention", "use_backend"]


# (key, value, kv_cache, slot_mapping, k_scale, v_scale); the scales matter for an fp8 cache only
WriteKV = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float, float], None]
# (query, kv_cache, meta, softmax scale, k_scale, v_scale)
Attend = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata, float, float, float], torch.Tensor]


_MAX_PADDED_TOKENS = 1 << 16  # bounds the padded K/V the CPU path gathers at once (per chunk of sequences)


def _torch_attend(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The CPU path: batched SDPA over padded sequences, in chunks that bound the padding's memory."""
    num_seqs = meta.seq_lens.shape[0]
    per_chunk = max(1, _MAX_PADDED_TOKENS // max(1, meta.max_seq_len))
    if per_chunk >= num_seqs:
        return paged_attention_padded(
            query,
            kv_cache,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_tables,
            meta.max_query_len,
            meta.max_seq_len,
            scale,
            k_scale,
            v_scale,
            window,
            softcap,
            sinks,
        )
    out = torch.empty_like(query)
    starts = meta.query_start_loc.tolist()
    for first in range(0, num_seqs, per_chunk):
        last = min(num_seqs, first + per_chunk)
        q0, q1 = starts[first], starts[last]
        if q1 == q0:
            continue
        out[q0:q1] = paged_attention_padded(
            query[q0:q1],
            kv_cache,
            meta.query_start_loc[first : last + 1] - q0,
            meta.seq_lens[first:last],
            meta.block_tables[first:last],
            meta.max_query_len,
            meta.max_seq_len,
            scale,
            k_scale,
            v_scale,
            window,
            softcap,
            sinks,
        )
    return out


def _reference_attend(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    return reference.paged_attention(
        query,
        kv_cache,
        meta.query_start_loc,
        meta.seq_lens,
        meta.block_tables,
        scale,
        k_scale=k_scale,
        v_scale=v_scale,
    )


_write_kv: WriteKV = reference.write_kv_cache
_attend: Attend = _torch_attend
_backend_name = "torch"


def use_backend(name: str) -> None:
    """Select the attention implementation for this process: "torch" (any device, batched),
    "reference" (the per-sequence oracle) or "triton" (CUDA)."""
    global _write_kv, _attend, _backend_name
    if name == "torch":
        _write_kv, _attend = reference.write_kv_cache, _torch_attend
    elif name == "reference":
        _write_kv, _attend = reference.write_kv_cache, _reference_attend
    elif name == "triton":
        from pagedserve.kernels import triton_backend  # imported lazily: triton is absent on many CPU machines

        _write_kv, _attend = triton_backend.write_kv_cache, triton_backend.attend
    else:
        raise ValueError(f"unknown attention backend {name!r} (expected 'torch', 'reference' or 'triton')")
    _backend_name = name


def backend_name() -> str:
    return _backend_name


def default_backend(device: torch.device) -> str:
    return "triton" if device.type == "cuda" else "torch"


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
    k_scale: float = 1.0,  # an fp8 cache stores K / k_scale (see kernels/reference.py)
    v_scale: float = 1.0,
    window: int | None = None,  # this layer's sliding window (Gemma's local layers); None: whole context
    softcap: float | None = None,  # attention-logit soft-capping (Gemma 2)
    sinks: torch.Tensor | None = None,  # [num_heads] learned sink logits (gpt-oss): extra softmax mass, no value
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Store this step's K/V in the paged cache, then attend over each sequence's context (or window)."""
    _write_kv(key, value, kv_cache, meta.slot_mapping, k_scale, v_scale)
    if _backend_name == "triton":
        # Both Triton kernels have windows, sinks and soft-capping; handing over this step's K/V lets a
        # prefill-heavy step take the prefill kernel (as the fused rotary path does).
        from pagedserve.kernels import triton_backend

        return triton_backend.attend(
            query,
            kv_cache,
            meta,
            scale,
            k_scale,
            v_scale,
            key=key,
            value=value,
            window=window,
            sinks=sinks,
            softcap=softcap,
        )
    if window is None and softcap is None and sinks is None:
        return _attend(query, kv_cache, meta, scale, k_scale, v_scale)
    if _attend is _torch_attend:
        return _torch_attend(query, kv_cache, meta, scale, k_scale, v_scale, window, softcap, sinks)
    raise NotImplementedError(
        f"the {_backend_name!r} attention backend lacks windows / sinks / logit soft-capping; "
        "use --device cpu / the torch backend"
    )
