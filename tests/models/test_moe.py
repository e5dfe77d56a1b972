"""The grouped MoE (tokens sorted per expert, one matmul per hit expert) and the graph-capturable dense
one against a per-token loop; routing per config; both checkpoint layouts load; tensor parallelism is
refused with a clear error."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedserve.services.engine.models import load_model
from pagedserve.services.engine.models.moe import MoE, experts_reference, route
from pagedserve.services.engine.parallel.moe import ParallelExperts
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


def test_tensor_parallel_splits_every_expert_and_reduces_once(tmp_path: Path) -> None:
    """Under TP each rank holds every expert's slice of the intermediate dim (tests/models/
    test_tensor_parallel_families.py runs the MoE cases on 2 ranks); a fused 3-D checkpoint tensor loads
    as the per-expert ones do."""
    build_tiny_model("qwen3_moe-qknorm-normtopk", tmp_path)
    model = load_model(tmp_path, "float32", "cpu", show_progress=False)
    full = next(m for m in model.modules() if isinstance(m, MoE))
    w13, w2 = full.experts.gate_up_proj.data, full.experts.down_proj.data  # [E, 2I, H], [E, H, I]
    size = full.experts.intermediate_size // 2
    ctx = ParallelContext(rank=1, world_size=2, device=torch.device("cpu"))
    with torch.device("meta"):
        shard_model(model, ctx)
    moe = next(m for m in model.modules() if isinstance(m, MoE))
    assert isinstance(moe.experts, ParallelExperts) and moe.reduce == ctx.all_reduce
    experts = moe.experts.to_empty(device="cpu")
    assert experts.gate_up_proj.shape == (4, 2 * size, 64)
    experts.load_piece("gate_up_proj", None, lambda dim, start, n: w13.narrow(dim, start, n))
    experts.load_piece("down_proj", None, lambda dim, start, n: w2.narrow(dim, start, n))
    rows = torch.cat([torch.arange(size, 2 * size), torch.arange(3 * size, 4 * size)])  # rank 1: second halves
    torch.testing.assert_close(experts.gate_up_proj, w13[:, rows])
    torch.testing.assert_close(experts.down_proj, w2[:, :, size:])
    experts.gate_up_proj.data[2], experts.down_proj.data[2] = 0.0, 0.0
    for shard_id in ("gate:2", "up:2", "down:2"):  # per-expert Hub tensors, as load_sharded hands them over
        part, e = shard_id.split(":")
        tensor = w2[int(e)] if part == "down" else w13[int(e)].chunk(2)[part == "up"]
        experts.load_piece("down_proj" if part == "down" else "gate_up_proj", shard_id, tensor.narrow)
    torch.testing.assert_close(experts.gate_up_proj[2], w13[2, rows])
    torch.testing.assert_close(experts.down_proj[2], w2[2, :, size:])
