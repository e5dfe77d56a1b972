"""An EAGLE-3 draft head (Li et al. 2025), loaded from its published checkpoint, as vLLM's `llama_eagle3.py` reads it.

    fc        [3 * target_hidden -> hidden]: fuses the target's residual stream entering three of its layers
    layer     one Llama decoder layer whose q/k/v read [input_layernorm(embed(token)) | hidden_norm(hidden)]
              (2 * hidden wide); the residual is the fused hidden (or its norm: `norm_before_residual`)
    norm      -> lm_head over a draft vocabulary (`draft_vocab_size`); draft id i is target id i + d2t[i]

Checkpoint names (yuhuili/EAGLE3-*, SGLang's and vLLM's exports): `fc.weight`, `midlayer.*` or `layers.0.*`
(with q/k/v and gate/up separate), `norm.weight`, `lm_head.weight`, `d2t` (int64 offsets), `t2d` (bool mask, not
needed), sometimes `embed_tokens.weight`, any of them possibly under `model.`. Without their own embeddings,
heads share the target's. Which target layers: the config's `eagle_aux_hidden_state_layer_ids` (top level or
in `eagle_config`), else vLLM's default (2, L // 2, L - 3).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pagedserve.services.engine.attention import AttentionMetadata
from pagedserve.services.engine.models.layers import Attention, GatedMLP, RMSNorm, ShardedLinear
from pagedserve.services.engine.models.llama import PACKED_PROJECTIONS
from pagedserve.services.engine.models.rotary import RotaryEmbedding, rope_params_from_config
from pagedserve.services.engine.models.spec import read_json
from pagedserve.services.engine.models.weights import iter_checkpoint

FIELD = "speculative_config.model"  # what every load error names
ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


class HeadConfigError(ValueError):
    def __init__(self, message: str) -> None:
        super().__init__(f"{FIELD}: {message}")


@dataclass(frozen=True, slots=True)
class Eagle3Config:
    hidden_size: int
    target_hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    hidden_act: str
    rms_norm_eps: float
    vocab_size: int  # the target's: ids the head reads and d2t maps to
    draft_vocab_size: int
    aux_layer_ids: tuple[int, ...] | None  # None: the target's default
    norm_before_residual: bool
    attention_bias: bool
    mlp_bias: bool
    raw: dict[str, Any]  # for the rope parameters

    @classmethod
    def from_json(cls, cfg: dict[str, Any]) -> Eagle3Config:
        architectures = cfg.get("architectures") or []
        if not any(a in ARCHITECTURES for a in architectures):
            raise HeadConfigError(
                f"config.json architectures {architectures} name no EAGLE-3 head ({', '.join(ARCHITECTURES)}); "
                "speculators-format checkpoints (Eagle3Speculator) are not read yet"
            )
        if int(cfg.get("num_hidden_layers", 1)) != 1:
            raise HeadConfigError(f"num_hidden_layers {cfg['num_hidden_layers']}: only one-layer heads are supported")
        hidden = int(cfg["hidden_size"])
        num_heads = int(cfg["num_attention_heads"])
        eagle = cfg.get("eagle_config") or {}
        layer_ids = cfg.get("eagle_aux_hidden_state_layer_ids") or eagle.get("eagle_aux_hidden_state_layer_ids")
        if eagle.get("use_aux_hidden_state", True) is False:
            raise HeadConfigError("eagle_config.use_aux_hidden_state is false: an EAGLE-1/2 head, not EAGLE-3")
        vocab = int(cfg["vocab_size"])
        return cls(
            hidden_size=hidden,
            target_hidden_size=int(cfg.get("target_hidden_size") or hidden),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or hidden // num_heads),
            intermediate_size=int(cfg["intermediate_size"]),
            hidden_act=str(cfg.get("hidden_act", "silu")),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            vocab_size=vocab,
            draft_vocab_size=int(cfg.get("draft_vocab_size") or vocab),
            aux_layer_ids=None if not layer_ids else tuple(int(i) for i in layer_ids),
            norm_before_residual=bool(cfg.get("norm_before_residual", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            raw=cfg,
        )


def default_aux_layer_ids(num_layers: int) -> tuple[int, ...]:
    """vLLM's and the EAGLE repo's choice: an early, the middle and a late layer."""
    return (2, num_layers // 2, num_layers - 3)


class Eagle3Layer(nn.Module):
    def __init__(self, cfg: Eagle3Config, max_position: int) -> None:
        super().__init__()
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        rotary = RotaryEmbedding(rope_params_from_config(cfg.raw, cfg.head_dim), max_position)
        attn = Attention(
            hidden, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, rotary, cfg.attention_bias, cfg.attention_bias
        )
        # q/k/v read the token's embedding and the hidden state side by side.
        attn.qkv_proj = ShardedLinear(
            2 * hidden, {"q": attn.q_size, "k": attn.kv_size, "v": attn.kv_size}, bias=cfg.attention_bias
        )
        self.self_attn = attn
        self.mlp = GatedMLP(hidden, cfg.intermediate_size, cfg.hidden_act, bias=cfg.mlp_bias)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.hidden_norm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.norm_before_residual = cfg.norm_before_residual

    def forward(
        self,
        positions: torch.Tensor,  # [n] int64
        embeds: torch.Tensor,  # [n, hidden]
        hidden: torch.Tensor,  # [n, hidden]: fc(target aux states), or the head's own pre-norm output
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [n, hidden]: the pre-norm output
        normed_hidden = self.hidden_norm(hidden)
        residual = normed_hidden if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed_hidden], dim=-1)
        residual = residual + self.self_attn(positions, x, kv_cache, meta)
        return residual + self.mlp(self.post_attention_layernorm(residual))


class Eagle3Head(nn.Module):
    def __init__(self, cfg: Eagle3Config, max_position: int, own_embeddings: bool) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens: nn.Module | None = nn.Embedding(cfg.vocab_size, cfg.hidden_size) if own_embeddings else None
        self.fc = nn.Linear(3 * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.layer = Eagle3Layer(cfg, max_position)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.d2t: torch.Tensor
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))

    def forward(
        self,
        input_ids: torch.Tensor,  # [n] int64
        positions: torch.Tensor,  # [n] int64
        hidden: torch.Tensor,  # [n, hidden]
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [n, hidden]: pre-norm, what the next draft position reads as its hidden state
        assert self.embed_tokens is not None, "the target's embeddings are attached at load"
        return self.layer(positions, self.embed_tokens(input_ids), hidden, kv_cache, meta)

    def greedy_target_ids(self, prenorm: torch.Tensor) -> torch.Tensor:  # [n] int64 in the target's vocabulary
        draft_ids = self.lm_head(self.norm(prenorm)).argmax(dim=-1)
        return draft_ids + self.d2t[draft_ids]


def _param_names(name: str) -> Iterator[tuple[str, str | None]]:
    """Checkpoint name -> (our parameter, shard id); nothing for tensors the head does not use."""
    name = name.removeprefix("model.")
    if name == "t2d":  # the inverse of d2t: which target ids the draft vocabulary covers
        return
    for prefix in ("midlayer.", "layers.0."):
        if name.startswith(prefix):
            name = "layer." + name.removeprefix(prefix)
    for hf_name, (ours, shard_id) in PACKED_PROJECTIONS.items():
        if f".{hf_name}." in name:
            yield name.replace(f".{hf_name}.", f".{ours}."), shard_id
            return
    yield name, None


def _checkpoint_tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(path.glob("*.safetensors"))
    if files:
        yield from iter_checkpoint(files, show_progress=False)
        return
    bins = sorted(path.glob("pytorch_model*.bin"))  # yuhuili/EAGLE3-* publish a pickled state dict
    if not bins:
        raise HeadConfigError(f"no *.safetensors or pytorch_model.bin weights in {path}")
    for file in bins:
        yield from torch.load(file, map_location="cpu", weights_only=True).items()


def read_eagle3_config(path: Path) -> Eagle3Config:
    if not (path / "config.json").is_file():
        raise HeadConfigError(f"no config.json in {path}")
    return Eagle3Config.from_json(read_json(path / "config.json"))


def load_eagle3_head(
    path: Path, cfg: Eagle3Config, dtype: torch.dtype, device: torch.device, max_position: int
) -> Eagle3Head:
    """The head with its checkpoint's weights; its embeddings are None unless the checkpoint has its own."""
    tensors = dict(_checkpoint_tensors(path))
    own_embeddings = any(n.removeprefix("model.") == "embed_tokens.weight" for n in tensors)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            head = Eagle3Head(cfg, max_position, own_embeddings)
    finally:
        torch.set_default_dtype(previous)
    head.to_empty(device=device)
    params = dict(head.named_parameters()) | dict(head.named_buffers())
    unwritten = set(params)
    shards_left: dict[str, set[str]] = {}  # fused parameter -> checkpoint pieces still to come
    with torch.no_grad():
        for ckpt_name, tensor in tensors.items():
            for name, shard_id in _param_names(ckpt_name):
                if name not in params:
                    raise HeadConfigError(f"unexpected tensor {ckpt_name!r} in {path}")
                if shard_id is not None:
                    module = head.get_submodule(name.rpartition(".")[0])
                    assert isinstance(module, ShardedLinear)
                    start, size = module.shard_offsets[shard_id]
                    target = params[name][start : start + size]
                    shards_left.setdefault(name, set(module.shard_offsets)).discard(shard_id)
                else:
                    target = params[name]
                if tuple(tensor.shape) != tuple(target.shape):
                    raise HeadConfigError(
                        f"tensor {ckpt_name!r} has shape {tuple(tensor.shape)}, the config implies "
                        f"{tuple(target.shape)}"
                    )
                target.copy_(tensor)
                if not shards_left.get(name):
                    unwritten.discard(name)
    if "d2t" in unwritten and cfg.draft_vocab_size == cfg.vocab_size:
        unwritten.discard("d2t")  # a full vocabulary needs no map: offsets of 0
        head.d2t.zero_()
    if unwritten:
        raise HeadConfigError(f"the checkpoint in {path} lacks {sorted(unwritten)}")
    target_ids = torch.arange(cfg.draft_vocab_size, device=device) + head.d2t
    if int(target_ids.min()) < 0 or int(target_ids.max()) >= cfg.vocab_size:
        raise HeadConfigError(f"d2t maps draft ids outside the vocabulary of {cfg.vocab_size}")
    return head
