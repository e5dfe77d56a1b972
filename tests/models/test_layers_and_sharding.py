"""Shared decoder layers vs HF's, and how tensor parallelism splits attention heads over ranks."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from pagedserve.services.engine.models import load_model
from pagedserve.services.engine.models.layers import RMSNorm, get_activation
from pagedserve.services.engine.models.loader import ARCHITECTURES, UnsupportedArchitectureError, model_class
from pagedserve.services.engine.models.spec import ModelSpec
from pagedserve.services.engine.parallel.sharding import local_spec
from tests.models.tiny_models import build_tiny_model


@pytest.fixture(scope="module")
def tiny_spec(tmp_path_factory: pytest.TempPathFactory) -> ModelSpec:
    model_dir = tmp_path_factory.mktemp("tiny")
    build_tiny_model("llama-mqa-bias-linearrope", model_dir)
    return load_model(model_dir, dtype="float32", device="cpu", show_progress=False).spec


def test_rms_norm_matches_hf() -> None:
    torch.manual_seed(0)
    ours, hf = RMSNorm(32, eps=1e-5), LlamaRMSNorm(32, eps=1e-5)
    with torch.no_grad():
        ours.weight.copy_(torch.randn(32))
        hf.weight.copy_(ours.weight)
    x = torch.randn(5, 32) * 3
    torch.testing.assert_close(ours(x), hf(x), rtol=1e-5, atol=1e-5)


def test_activations_by_their_config_names() -> None:
    x = torch.linspace(-3, 3, 13)
    torch.testing.assert_close(get_activation("silu")(x), torch.nn.functional.silu(x))
    torch.testing.assert_close(get_activation("gelu")(x), torch.nn.functional.gelu(x))


def test_an_unknown_architecture_names_the_supported_ones() -> None:
    assert model_class({"architectures": ["LlamaForCausalLM"]}) is ARCHITECTURES["LlamaForCausalLM"]
    with pytest.raises(UnsupportedArchitectureError, match="LlamaForCausalLM") as err:
        model_class({"architectures": ["NotAModel"]})
    assert "NotAModel" in str(err.value)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "world", "per_rank"),
    [
        (9, 3, 2, [(3, 1), (6, 2)]),  # SmolLM2: three KV heads over two ranks, unevenly
        (32, 8, 4, [(8, 2)] * 4),
        (16, 1, 4, [(4, 1)] * 4),  # multi-query: the KV head is replicated, its query group split
    ],
)
def test_each_rank_serves_its_share_of_the_heads(
    heads: int, kv_heads: int, world: int, per_rank: list[tuple[int, int]], tiny_spec: ModelSpec
) -> None:
    spec = dataclasses.replace(tiny_spec, num_heads=heads, num_kv_heads=kv_heads)
    got = []
    for rank in range(world):
        ctx = SimpleNamespace(rank=rank, world_size=world)
        shard = local_spec(spec, ctx)
        got.append((shard.num_heads, shard.num_kv_heads))
    assert got == per_rank
