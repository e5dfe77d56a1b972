"""Turn a family's freshly built (meta-device) model into this rank's shard, in place.

Every family builds its layers from `layers.py`, so sharding rewrites those building blocks and
leaves the families untouched (and the one-GPU code path exactly as it was):

    Attention   qkv_proj -> column-parallel [q_r | k_r | v_r]; o_proj -> row-parallel (1 all-reduce)
                num_heads / num_kv_heads / q_size / kv_size become this rank's
    GatedMLP    gate_up_proj -> column-parallel [gate_r | up_r]; down_proj -> row-parallel (1 all-reduce)
    MLP         up_proj -> column-parallel; down_proj -> row-parallel (1 all-reduce)
    DecoderLM   embed_tokens and lm_head -> vocabulary-parallel; logits all-gathered
    MoE         every expert's intermediate dim split like a GatedMLP's (parallel/moe.py); the routed sum
                is all-reduced once; Qwen2-MoE's shared expert is a GatedMLP with its own all-reduce

Weights are loaded with the model's full spec (checkpoint reorderings need the full head counts);
`local_spec` then gives the spec the runner sizes this rank's KV cache with.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from pagedserve.services.engine.models.base import CausalLM, DecoderLM
from pagedserve.services.engine.models.layers import MLP, Attention, GatedMLP
from pagedserve.services.engine.models.moe import MoE
from pagedserve.services.engine.models.spec import ModelSpec
from pagedserve.services.engine.parallel.embedding import LogitsGather, VocabParallelEmbedding
from pagedserve.services.engine.parallel.linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    attention_parts,
    even_part,
)
from pagedserve.services.engine.parallel.moe import parallel_experts
from pagedserve.services.engine.parallel.state import ParallelContext


def local_spec(spec: ModelSpec, ctx: ParallelContext) -> ModelSpec:
    q, kv = attention_parts(spec.num_heads, spec.num_kv_heads, 1, ctx)
    num_heads, num_kv_heads = q.size, kv.size
    return dataclasses.replace(spec, num_heads=num_heads, num_kv_heads=num_kv_heads)


def shard_model(model: CausalLM, ctx: ParallelContext) -> None:
    """Replace the model's projections and embeddings by this rank's shards (call on meta)."""
    if not isinstance(model, DecoderLM):
        raise ValueError(f"{type(model).__name__} does not support tensor parallelism")
    spec = model.spec
    if not model.supports_tensor_parallel:
        raise ValueError(
            f"{spec.architecture} does not support tensor parallelism yet; run it with tensor_parallel_size 1"
        )
    for module in list(model.modules()):
        if isinstance(module, MoE):
            _shard_moe(module, spec.hidden_size, ctx)
        elif isinstance(module, Attention):
            _shard_attention(module, spec.hidden_size, ctx)
        elif isinstance(module, GatedMLP):
            _shard_gated_mlp(module, spec.hidden_size, ctx)
        elif isinstance(module, MLP):
            _shard_mlp(module, spec.hidden_size, ctx)
    model.model.embed_tokens = VocabParallelEmbedding(spec.vocab_size, spec.hidden_size, ctx)  # type: ignore[assignment]
    if model.lm_head is not None:
        model.lm_head = VocabParallelEmbedding(spec.vocab_size, spec.hidden_size, ctx)  # type: ignore[assignment]
    model.logits_gather = LogitsGather(spec.vocab_size, ctx)


def _has_bias(linear: nn.Module) -> bool:
    return getattr(linear, "bias", None) is not None


def _shard_attention(attn: Attention, hidden_size: int, ctx: ParallelContext) -> None:
    q, kv = attention_parts(attn.num_heads, attn.num_kv_heads, attn.head_dim, ctx)
    qkv_bias, out_bias = _has_bias(attn.qkv_proj), _has_bias(attn.o_proj)
    attn.qkv_proj = ColumnParallelLinear(hidden_size, {"q": q, "k": kv, "v": kv}, qkv_bias)  # type: ignore[assignment]
    attn.o_proj = RowParallelLinear(q, hidden_size, out_bias, ctx)  # type: ignore[assignment]
    attn.num_heads, attn.num_kv_heads = q.size // attn.head_dim, kv.size // attn.head_dim
    attn.q_size, attn.kv_size = q.size, kv.size


def _shard_gated_mlp(mlp: GatedMLP, hidden_size: int, ctx: ParallelContext) -> None:
    part = even_part(mlp.intermediate_size, ctx)
    in_bias, out_bias = _has_bias(mlp.gate_up_proj), _has_bias(mlp.down_proj)
    mlp.gate_up_proj = ColumnParallelLinear(hidden_size, {"gate": part, "up": part}, in_bias)  # type: ignore[assignment]
    mlp.down_proj = RowParallelLinear(part, hidden_size, out_bias, ctx)  # type: ignore[assignment]
    mlp.intermediate_size = part.size


def _shard_moe(moe: MoE, hidden_size: int, ctx: ParallelContext) -> None:
    moe.experts = parallel_experts(moe.experts, hidden_size, ctx)
    moe.reduce = ctx.all_reduce


def _shard_mlp(mlp: MLP, hidden_size: int, ctx: ParallelContext) -> None:
    intermediate = mlp.up_proj.out_features
    part = even_part(intermediate, ctx)
    mlp.up_proj = ColumnParallelLinear(hidden_size, {"": part}, _has_bias(mlp.up_proj))  # type: ignore[assignment]
    mlp.down_proj = RowParallelLinear(part, hidden_size, _has_bias(mlp.down_proj), ctx)  # type: ignore[assignment]
