"""gpt-oss (GptOssForCausalLM): bf16/fp32 checkpoints and the MXFP4 ones OpenAI ships.

    per layer: x = x + attn(rmsnorm(x));  x = x + moe(rmsnorm(x))
    attention: q/k/v/o with biases, YaRN rope, a learned sink logit per head in the softmax denominator,
               local layers (config.layer_types "sliding_attention") see only the last `sliding_window` keys
    moe:       router with a bias; softmax over the top-k logits; experts with biases and a clamped SwiGLU
               (gate <= limit, |up| <= limit, out = (up + 1) * gate * sigmoid(alpha * gate))

Checkpoints keep the experts as HF's 3-D tensors, transposed and with gate/up interleaved:

    experts.gate_up_proj  [num_experts, hidden, 2 * intermediate]  columns g0 u0 g1 u1 ...
    experts.down_proj     [num_experts, intermediate, hidden]

`checkpoint_to_params` turns them into `moe.Experts`' layout ([E, 2I, hidden] rows [ gate | up ],
[E, hidden, I]), so the grouped/dense expert paths of moe.py run them. MXFP4 checkpoints (openai/gpt-oss-*,
`quant_method` "mxfp4") store each as `{name}_blocks` + `{name}_scales` in the untransposed layout
([E, 2I, hidden] with gate/up rows interleaved; [E, hidden, I]). The loader decides (config key
mxfp4.PACKED_EXPERTS_KEY, from load_model's `mxfp4_packed`; by default packed only on CUDA and only where the
bf16 experts would take more than half the GPU: mxfp4.keeps_experts_packed):

    packed       Mxfp4Experts keeps the codes and scales (rows de-interleaved, which moves whole bytes, so
                 it is exact) and the fused-MoE kernel dequantises them in registers: ~4.25 bits a weight
    dequantised  the pair becomes the dense weight at load (exact in bf16, see mxfp4.py): gpt-oss-20b
                 takes ~42 GB, and every expert path (the torch ones on CPU) runs it

Sinks and windows run in the torch attention path and in the Triton paged kernel.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.kernels import moe_reference
from pagedserve.services.engine import attention
from pagedserve.services.engine.attention import AttentionMetadata
from pagedserve.services.engine.models import mxfp4
from pagedserve.services.engine.models.base import DecoderLM, ParamPiece
from pagedserve.services.engine.models.layers import DenseLinear, ShardedLinear
from pagedserve.services.engine.models.llama import PACKED_PROJECTIONS
from pagedserve.services.engine.models.moe import Experts, fused_experts
from pagedserve.services.engine.models.rotary import RotaryEmbedding, rope_params_from_config
from pagedserve.services.engine.models.spec import ModelSpec

SLIDING = "sliding_attention"
_DEFAULT_ROPE_THETA = 150000.0  # GptOssConfig.default_theta: what HF uses when the config names none


class GptOssRMSNorm(nn.Module):
    """HF's GptOssRMSNorm: the weight multiplies the fp32 normed value, then the cast (Llama casts first)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * h).to(x.dtype)


def layer_types(cfg: dict[str, Any]) -> list[str]:
    """HF's default when the config lists none: local, global, local, ..."""
    if cfg.get("layer_types"):
        return list(cfg["layer_types"])
    return [SLIDING if i % 2 == 0 else "full_attention" for i in range(int(cfg["num_hidden_layers"]))]


class ClampedSwiGLUExperts(Experts):
    """moe.Experts with a bias on both projections and gpt-oss's clamped SwiGLU (`swigluoai`): the fused-MoE
    kernel on CUDA, the torch paths elsewhere, as every MoE family."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, alpha: float, limit: float) -> None:
        super().__init__(num_experts, hidden_size, intermediate_size, "silu")
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size))
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.alpha, self.limit = alpha, limit
        self.activation = "swigluoai"

    def _options(self) -> dict[str, Any]:
        return dict(
            activation=self.activation,
            w13_bias=self.gate_up_proj_bias,
            w2_bias=self.down_proj_bias,
            swiglu_alpha=self.alpha,
            swiglu_limit=self.limit,
        )

    def expert_weights(self, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert `expert`'s dense (gate_up [2I, hidden], down [hidden, I])."""
        return self.gate_up_proj[expert], self.down_proj[expert]

    def expert_mlp(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        w13, w2 = self.expert_weights(expert)
        gate_up = F.linear(x, w13.to(x.dtype), self.gate_up_proj_bias[expert])
        gate, up = gate_up.chunk(2, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        glu = gate * torch.sigmoid(gate * self.alpha)
        return F.linear((up + 1) * glu, w2.to(x.dtype), self.down_proj_bias[expert])

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return fused_experts(x, self.gate_up_proj, self.down_proj, weights, ids, **self._options())

    def forward_dense(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return moe_reference.experts_dense(x, self.gate_up_proj, self.down_proj, weights, ids, **self._options())


class Mxfp4Experts(ClampedSwiGLUExperts):
    """The experts kept as MXFP4 on the device: uint8 codes and E8M0 scales in mxfp4.py's flat layout, w13's
    rows [ gate | up ]. Every call runs the fused-MoE kernel, which dequantises in registers, also as the
    CUDA-graph path (`forward_dense`): it has no host sync, and the torch dense path would need dense
    weights. That needs Triton: compiled on CUDA, the interpreter on CPU (TRITON_INTERPRET=1, tests)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, alpha: float, limit: float) -> None:
        super().__init__(num_experts, hidden_size, intermediate_size, alpha, limit)
        del self.gate_up_proj, self.down_proj  # the dense placeholders (still on meta) give way to the codes
        e, h, i = num_experts, hidden_size, intermediate_size
        self.gate_up_proj_blocks = _uint8_parameter(e, 2 * i, h // 2)
        self.gate_up_proj_scales = _uint8_parameter(e, 2 * i, h // mxfp4.BLOCK)
        self.down_proj_blocks = _uint8_parameter(e, h, i // 2)
        self.down_proj_scales = _uint8_parameter(e, h, i // mxfp4.BLOCK)

    def expert_weights(self, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantised on the fly: the per-token oracle of the tests, not a serving path."""
        w13 = mxfp4.dequantize_flat(self.gate_up_proj_blocks[expert], self.gate_up_proj_scales[expert])
        return w13, mxfp4.dequantize_flat(self.down_proj_blocks[expert], self.down_proj_scales[expert])

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        w13, w2 = self.gate_up_proj_blocks, self.down_proj_blocks
        w13_scale, w2_scale = self.gate_up_proj_scales, self.down_proj_scales
        return fused_experts(x, w13, w2, weights, ids, w13_scale=w13_scale, w2_scale=w2_scale, **self._options())

    def forward_dense(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self.forward(x, weights, ids)


def _uint8_parameter(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=torch.uint8), requires_grad=False)


class GptOssMoE(nn.Module):
    def __init__(self, cfg: dict[str, Any], spec: ModelSpec) -> None:
        super().__init__()
        num_experts = int(cfg["num_local_experts"])
        self.top_k = int(cfg["num_experts_per_tok"])
        self.router = nn.Linear(spec.hidden_size, num_experts, bias=True)
        experts_class = Mxfp4Experts if cfg.get(mxfp4.PACKED_EXPERTS_KEY) else ClampedSwiGLUExperts
        self.experts = experts_class(
            num_experts,
            spec.hidden_size,
            int(cfg["intermediate_size"]),
            alpha=float(cfg.get("swiglu_alpha", 1.702)),
            limit=float(cfg.get("swiglu_limit", 7.0)),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden] -> same
        # HF's router: top-k of the raw logits, then a softmax over those k only.
        top_logits, ids = self.router(x).float().topk(self.top_k, dim=-1)
        out: torch.Tensor = self.experts(x, top_logits.softmax(-1), ids)
        return out


class GptOssAttention(nn.Module):
    def __init__(self, cfg: dict[str, Any], spec: ModelSpec, rotary: RotaryEmbedding, window: int | None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        bias = bool(cfg.get("attention_bias", True))
        self.qkv_proj = ShardedLinear(spec.hidden_size, {"q": self.q_size, "k": self.kv_size, "v": self.kv_size}, bias)
        self.o_proj = DenseLinear(self.q_size, spec.hidden_size, bias=bias)
        self.sinks = nn.Parameter(torch.empty(self.num_heads))  # [num_heads] learned logit per head
        self.rotary, self.window = rotary, window
        self.scale = self.head_dim**-0.5

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        n = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(n, self.num_heads, self.head_dim)
        k = k.reshape(n, self.num_kv_heads, self.head_dim)
        v = v.reshape(n, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k)
        out = attention.paged_attention(q, k, v, kv_cache, meta, self.scale, window=self.window, sinks=self.sinks)
        return self.o_proj(out.reshape(n, self.q_size))


class GptOssDecoderLayer(nn.Module):
    def __init__(self, cfg: dict[str, Any], spec: ModelSpec, rotary: RotaryEmbedding, window: int | None) -> None:
        super().__init__()
        eps = float(cfg.get("rms_norm_eps", 1e-5))
        self.self_attn = GptOssAttention(cfg, spec, rotary, window)
        self.mlp = GptOssMoE(cfg, spec)
        self.input_layernorm = GptOssRMSNorm(spec.hidden_size, eps)
        self.post_attention_layernorm = GptOssRMSNorm(spec.hidden_size, eps)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        x = x + self.self_attn(positions, self.input_layernorm(x), kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class GptOssForCausalLM(DecoderLM):
    supports_tensor_parallel = False  # mixture-of-experts and its own attention class: not sharded yet
    loads_mxfp4 = True  # the experts' blocks/scales: kept packed or dequantised (see the module docstring)
    supports_aux_hidden_states = False  # its own forward keeps none

    def __init__(self, cfg: dict[str, Any], spec: ModelSpec) -> None:
        rotary = RotaryEmbedding(rope_params_from_config(cfg, spec.head_dim, _DEFAULT_ROPE_THETA), spec.max_model_len)
        layers: list[nn.Module] = [
            GptOssDecoderLayer(cfg, spec, rotary, spec.window_of(i)) for i in range(spec.num_layers)
        ]
        norm = GptOssRMSNorm(spec.hidden_size, float(cfg.get("rms_norm_eps", 1e-5)))
        super().__init__(spec, layers, norm, is_tied=bool(cfg.get("tie_word_embeddings", False)))
        self.mxfp4_packed = bool(cfg.get(mxfp4.PACKED_EXPERTS_KEY))
        self._mxfp4_pending: dict[str, dict[str, torch.Tensor]] = {}  # weight -> its blocks/scales seen so far

    @staticmethod
    def normalize_config(cfg: dict[str, Any]) -> dict[str, Any]:
        method = (cfg.get("quantization_config") or {}).get("quant_method")
        if method not in (None, "mxfp4"):
            raise ValueError(f"GptOssForCausalLM: {method!r} checkpoints are not supported (bf16 or mxfp4)")
        window = cfg.get("sliding_window")
        windows = [int(window) if t == SLIDING and window else None for t in layer_types(cfg)]
        return {**cfg, "layer_windows": windows}

    @classmethod
    def from_config(cls, cfg: dict[str, Any], spec: ModelSpec) -> GptOssForCausalLM:
        return cls(cfg, spec)

    def checkpoint_to_params(self, name: str, tensor: torch.Tensor) -> Iterator[ParamPiece]:
        if self.is_tied and name.startswith("lm_head."):
            return
        if name.endswith(MXFP4_SUFFIXES) and self.mxfp4_packed:
            yield name, _mxfp4_packed_param(name, tensor), None
        elif name.endswith(MXFP4_SUFFIXES):
            yield from self._mxfp4_to_params(name, tensor)
        elif name.endswith(".experts.gate_up_proj"):  # [E, hidden, 2I] interleaved -> [E, 2I, hidden] [gate | up]
            yield name, _deinterleave(tensor.transpose(1, 2)), None
        elif name.endswith(".experts.gate_up_proj_bias"):  # [E, 2I] interleaved -> [gate | up]
            yield name, _deinterleave(tensor), None
        elif name.endswith(".experts.down_proj"):  # [E, I, hidden] -> [E, hidden, I]
            yield name, tensor.transpose(1, 2).contiguous(), None
        else:
            for hf_name, (ours, shard_id) in PACKED_PROJECTIONS.items():
                if f".{hf_name}." in name:
                    yield name.replace(f".{hf_name}.", f".{ours}."), tensor, shard_id
                    return
            yield name, tensor, None

    def _mxfp4_to_params(self, name: str, tensor: torch.Tensor) -> Iterator[ParamPiece]:
        """Hold a weight's blocks or scales until its other half arrives (files may order them either way),
        then the dequantised weight: rows interleaved as the checkpoint's are, the bias's layout."""
        weight, _, part = name.rpartition("_")
        pair = self._mxfp4_pending.setdefault(weight, {})
        pair[part] = tensor
        if len(pair) < 2:
            return
        del self._mxfp4_pending[weight]
        try:
            dense = mxfp4.dequantize(pair["blocks"], pair["scales"])
        except ValueError as e:
            raise ValueError(f"{weight}_blocks/_scales: {e}") from None
        yield weight, _deinterleave(dense) if weight.endswith(".gate_up_proj") else dense, None


MXFP4_SUFFIXES = tuple(f".experts.{w}_{part}" for w in ("gate_up_proj", "down_proj") for part in ("blocks", "scales"))


def _mxfp4_packed_param(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """A checkpoint's blocks ([E, rows, cols/32, 16] -> the kernel's [E, rows, cols/2]) or scales as
    Mxfp4Experts holds them; gate_up's interleaved rows become [ gate | up ] (whole rows of bytes move)."""
    if tensor.dtype != torch.uint8 or (name.endswith("_blocks") and tensor.shape[-1] != mxfp4.BLOCK // 2):
        raise ValueError(f"{name}: want uint8 MXFP4 {'blocks [..., 16]' if name.endswith('_blocks') else 'scales'}")
    packed = tensor.flatten(-2) if name.endswith("_blocks") else tensor
    return _deinterleave(packed) if ".gate_up_proj_" in name else packed.contiguous()


def _deinterleave(t: torch.Tensor) -> torch.Tensor:
    """Columns g0 u0 g1 u1 ... of dim 1 -> g0 g1 ... u0 u1 ... (a new contiguous tensor)."""
    return torch.cat([t[:, 0::2], t[:, 1::2]], dim=1)
