"""The grouped MoE (tokens sorted per expert, one matmul per hit expert) and the graph-capturable dense
one against a per-token loop; routing per config; both checkpoint layouts load; tensor parallelism is
refused with a clear error."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedserve.services.engine.models import load_model
from pagedserve.services.engine.models.moe import MoE, experts_reference, route
from pagedserve.services.engine.parallel.sharding import shard_model
from pagedserve.services.engine.parallel.state import ParallelContext
from tests.models.paged_driver import PagedDriver
from tests.models.tiny_models import build_tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


def _random_moe(scoring: str, renormalize: bool, shared: int = 0) -> MoE:
    torch.manual_seed(0)
    moe = MoE(
        64,
        32,
        num_experts=8,
        top_k=2,
        act="silu",
        renormalize=renormalize,
        scoring=scoring,
        shared_intermediate_size=shared,
    )
    for p in moe.parameters():
        p.data.normal_(0, 0.2)
    return moe


@pytest.mark.parametrize(("scoring", "renormalize"), [("softmax", True), ("softmax", False), ("sigmoid", True)])
def test_grouped_experts_equal_a_per_token_loop(scoring: str, renormalize: bool) -> None:
    moe = _random_moe(scoring, renormalize)
    x = torch.randn(37, 64)
    weights, ids = route(moe.gate(x), 2, scoring, renormalize)
    assert len(ids.unique()) > 1  # several experts hit, so the grouping is exercised
    expected = experts_reference(moe.experts, x, weights, ids)
    torch.testing.assert_close(moe.experts(x, weights, ids), expected)
    torch.testing.assert_close(moe.experts.forward_dense(x, weights, ids), expected)  # the CUDA-graph path


def test_routing_follows_the_config() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    weights, ids = route(logits, 2, "softmax", renormalize=False)
    assert ids.tolist() == [[0, 1]]
    torch.testing.assert_close(weights, logits.softmax(-1)[:, :2])
    renormalized, _ = route(logits, 2, "softmax", renormalize=True)
    torch.testing.assert_close(renormalized.sum(-1), torch.ones(1))
    sigmoid, _ = route(logits, 2, "sigmoid", renormalize=False)
    torch.testing.assert_close(sigmoid, logits.sigmoid()[:, :2])
    with pytest.raises(ValueError, match=r"'noaux_tc'.*softmax, sigmoid"):
        route(logits, 2, "noaux_tc", renormalize=False)


def test_shared_expert_is_added_through_its_sigmoid_gate() -> None:
    moe = _random_moe("softmax", False, shared=48)
    x = torch.randn(5, 64)
    assert moe.shared_expert is not None and moe.shared_expert_gate is not None
    routed = moe.experts(x, *route(moe.gate(x), 2, "softmax", False))
    shared = torch.sigmoid(moe.shared_expert_gate(x)) * moe.shared_expert(x)
    torch.testing.assert_close(moe(x), routed + shared)


@pytest.mark.parametrize("case", ["mixtral-moe-top2-renormalized", "qwen2_moe-shared-expert-dense-layer0"])
def test_fused_3d_expert_names_load_like_per_expert_files(case: str, tmp_path: Path) -> None:
    """transformers 5 keeps experts as 3-D `experts.gate_up_proj`/`down_proj` in memory; the files
    `save_pretrained` writes hold one Linear per expert. Both must give the same model."""
    hf = build_tiny_model(case, tmp_path)
    fused_names = dict(hf.state_dict())
    assert any(name.endswith("experts.gate_up_proj") for name in fused_names)
    from_files = load_model(tmp_path, "float32", "cpu", show_progress=False)
    from_fused = load_model(tmp_path, "float32", "cpu", show_progress=False, tensors=fused_names.items())
    prompts = [[5, 9, 200, 17, 3], [44]]
    assert PagedDriver(from_fused).greedy(prompts, 8) == PagedDriver(from_files).greedy(prompts, 8)


def test_tensor_parallel_refuses_moe_with_a_clear_error(tmp_path: Path) -> None:
    build_tiny_model("qwen3_moe-qknorm-normtopk", tmp_path)
    model = load_model(tmp_path, "float32", "cpu", show_progress=False)
    with pytest.raises(ValueError, match=r"Qwen3MoeForCausalLM: mixture-of-experts .* tensor parallelism"):
        shard_model(model, ParallelContext(rank=0, world_size=2, device=torch.device("cpu")))
