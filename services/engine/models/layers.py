"""Building blocks shared by every family: norms, fused projections, MLPs and the attention layer.

Projections that HF stores separately but that run as one matmul (q/k/v, gate/up) are fused here;
their `load_shard` methods copy each checkpoint tensor into its rows of the fused weight:

    qkv_proj.weight  rows [ q: num_heads*head_dim | k: num_kv_heads*head_dim | v: num_kv_heads*head_dim ]
    gate_up_proj.weight rows [ gate: intermediate | up: intermediate ]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.services.engine import dense
from pagedserve.services.engine.attention import AttentionMetadata
from pagedserve.services.engine.models import fused_ops
from pagedserve.services.engine.models.rotary import RotaryEmbedding

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_fast": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


def get_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in _ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not supported (supported: {', '.join(_ACTIVATIONS)})")
    return _ACTIVATIONS[name]


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in fp32 like HF's LlamaRMSNorm, weight applied in the input dtype."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused_ops.rms_norm(x, self.weight, self.eps)


@dense.plain_linear
class DenseLinear(nn.Linear):
    """nn.Linear through dense.linear: decode rows on CUDA take the GEMV."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dense.linear(x, self.weight, self.bias)


class ShardedLinear(DenseLinear):
    """A linear layer whose output rows are several checkpoint tensors stacked (fused q/k/v, gate/up)."""

    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool) -> None:
        super().__init__(in_features, sum(shard_sizes.values()), bias=bias)
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        start = 0
        for shard_id, size in shard_sizes.items():
            self.shard_offsets[shard_id] = (start, size)
            start += size

    def load_shard(self, param_name: str, loaded: torch.Tensor, shard_id: str) -> None:
        start, size = self.shard_offsets[shard_id]
        param = self.weight if param_name == "weight" else self.bias
        assert param is not None and loaded.shape[0] == size, (param_name, shard_id, tuple(loaded.shape))
        param.data[start : start + size].copy_(loaded)


def project_out(linear: nn.Module, x: torch.Tensor, partial: bool) -> torch.Tensor:
    """linear(x), or its unreduced partial where asked and the layer is row-parallel (has forward_partial)."""
    forward_partial = getattr(linear, "forward_partial", None) if partial else None
    return forward_partial(x) if forward_partial is not None else linear(x)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)): Llama, Mistral, Qwen."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str, bias: bool = False) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = ShardedLinear(hidden_size, {"gate": intermediate_size, "up": intermediate_size}, bias)
        self.down_proj = DenseLinear(intermediate_size, hidden_size, bias=bias)
        self.act = get_activation(act)
        self.is_silu = act in ("silu", "swish")

    def forward(self, x: torch.Tensor, partial: bool = False) -> torch.Tensor:
        """partial: under tensor parallelism the down projection's output may be this rank's unreduced
        addend, which only fused_ops.add_rms_norm may read (parallel/partial_sums.py)."""
        if self.is_silu:
            # one row on CUDA: the gate_up GEMV applies the SiLU itself (one launch, no [1, 2I] round trip)
            h = dense.gate_up_silu(self.gate_up_proj, x) if fused_ops.is_fused(x) else None
            if h is None:
                h = fused_ops.silu_and_mul(self.gate_up_proj(x))
            return project_out(self.down_proj, h, partial)
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return project_out(self.down_proj, self.act(gate) * up, partial)


class MLP(nn.Module):
    """down(act(up(x))): GPT-NeoX, Falcon."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str, bias: bool = True) -> None:
        super().__init__()
        self.up_proj = DenseLinear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = DenseLinear(intermediate_size, hidden_size, bias=bias)
        self.act = get_activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))


class Attention(nn.Module):
    """Fused qkv projection, optional per-head q/k RMSNorm (Qwen3), rotary, paged attention, output."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rotary: RotaryEmbedding,
        qkv_bias: bool = False,
        out_bias: bool = False,
        qk_norm_eps: float | None = None,
        window: int | None = None,  # sliding window of a local layer (Mistral, Qwen2, Phi-3); None: global
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.window = window
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.scale = head_dim**-0.5
        self.qkv_proj = ShardedLinear(
            hidden_size, {"q": self.q_size, "k": self.kv_size, "v": self.kv_size}, bias=qkv_bias
        )
        self.o_proj = DenseLinear(self.q_size, hidden_size, bias=out_bias)
        self.rotary = rotary
        self.q_norm = RMSNorm(head_dim, qk_norm_eps) if qk_norm_eps is not None else None
        self.k_norm = RMSNorm(head_dim, qk_norm_eps) if qk_norm_eps is not None else None
        # An fp8 KV cache stores K / k_scale and V / v_scale (1.0: e4m3's range, +-448, holds K/V as is).
        self.k_scale, self.v_scale = 1.0, 1.0

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens] int64
        hidden: torch.Tensor,  # [num_tokens, hidden_size]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        partial: bool = False,  # as GatedMLP.forward's: the output projection may leave its sum undone
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        # [num_tokens, num_heads, head_dim]
        out = fused_ops.rotary_and_attend(
            self.rotary, positions, q, k, v, kv_cache, meta, self.scale, self.k_scale, self.v_scale, self.window
        )
        return project_out(self.o_proj, out.reshape(num_tokens, self.q_size), partial)


class LayerNormBlock(nn.Module):
    """A LayerNorm decoder layer (GPT-NeoX, Falcon), with a parallel or a sequential residual.

    parallel:   x = x + attn(ln_1(x)) + mlp(ln_2(x))     (ln_2 is ln_1 when `has_mlp_norm` is False)
    sequential: h = x + attn(ln_1(x));  x = h + mlp(ln_2(h))
    """

    def __init__(
        self, attn: Attention, mlp: MLP, hidden_size: int, eps: float, is_parallel: bool, has_mlp_norm: bool
    ) -> None:
        super().__init__()
        self.self_attn, self.mlp, self.is_parallel = attn, mlp, is_parallel
        self.input_layernorm = nn.LayerNorm(hidden_size, eps=eps)
        self.post_attention_layernorm = nn.LayerNorm(hidden_size, eps=eps) if has_mlp_norm else None

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:  # x: [num_tokens, hidden_size]
        attn_in = self.input_layernorm(x)
        attn_out = self.self_attn(positions, attn_in, kv_cache, meta)
        mlp_norm = self.post_attention_layernorm
        if self.is_parallel:
            mlp_out = self.mlp(attn_in if mlp_norm is None else mlp_norm(x))
            return mlp_out + attn_out + x
        assert mlp_norm is not None
        h = attn_out + x
        return self.mlp(mlp_norm(h)) + h


# MoE routers (`mlp.gate`, gpt-oss's `mlp.router`, Qwen2-MoE's `shared_expert_gate`) stay in full precision under
# weight quantization, as quantized checkpoints leave them: a rounded router logit flips a token's experts at
# near-ties, which costs far more than the few bytes it saves.
ROUTER_NAMES = ("gate", "router", "shared_expert_gate")


def replace_decoder_linears(
    model: nn.Module,
    make: Callable[[str, Any], nn.Module],  # receives a module of one of `kinds`
    keep: Callable[[str], bool] | None = None,
    kinds: tuple[type[nn.Module], ...] = (nn.Linear,),
) -> int:
    """Swap every linear of `kinds` (nn.Linear; the parallel layers of a sharded model) inside the decoder layers
    for `make(full module name, linear)` (a quantized layer, on the meta model before loading); returns how many.
    Embeddings and lm_head are outside the layers; MoE routers and the linears `keep` names (full module names,
    e.g. model.layers.0.mlp.down_proj) stay as they are."""
    layers = model.get_submodule("model.layers")
    swaps = [
        (name, module)
        for name, module in layers.named_modules()
        if isinstance(module, kinds)
        and name.rpartition(".")[2] not in ROUTER_NAMES
        and not (keep and keep(f"model.layers.{name}"))
    ]
    for name, module in swaps:
        parent_name, _, child = name.rpartition(".")
        setattr(
            layers.get_submodule(parent_name) if parent_name else layers, child, make(f"model.layers.{name}", module)
        )
    return len(swaps)
