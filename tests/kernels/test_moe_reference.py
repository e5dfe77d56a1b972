"""The torch MoE paths (the CPU path: grouped per expert; the graph-capturable dense one; the per-expert
loop oracle) against a per-token loop written out longhand, with and without gpt-oss's biases and
clamped SwiGLU; unsupported activations are refused with the supported list."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels.moe_reference import experts_dense, experts_grouped, experts_loop
from tests.kernels.moe_cases import per_token_oracle, random_case


@pytest.mark.parametrize("swiglu", [False, True], ids=["silu", "swigluoai-bias"])
@pytest.mark.parametrize(("scoring", "renormalize"), [("softmax", True), ("sigmoid", False)])
def test_torch_paths_equal_a_per_token_loop(swiglu: bool, scoring: str, renormalize: bool) -> None:
    case = random_case(23, 32, 24, 6, 2, scoring=scoring, renormalize=renormalize, swiglu=swiglu)
    assert len(case.topk_ids.unique()) > 2
    expected = per_token_oracle(case)
    args = (case.x, case.w13, case.w2, case.topk_weights, case.topk_ids)
    for path in (experts_loop, experts_grouped, experts_dense):
        torch.testing.assert_close(path(*args, **case.kwargs), expected, atol=1e-5, rtol=1e-5)


def test_clamp_is_exercised_and_matters() -> None:
    """The swiglu cases push some gate/up values past the limit, so a missing clamp would show."""
    case = random_case(23, 32, 24, 6, 2, swiglu=True)
    kwargs = dict(case.kwargs)
    clamped = experts_grouped(case.x, case.w13, case.w2, case.topk_weights, case.topk_ids, **kwargs)
    kwargs["swiglu_limit"] = 1e9
    unclamped = experts_grouped(case.x, case.w13, case.w2, case.topk_weights, case.topk_ids, **kwargs)
    assert not torch.allclose(clamped, unclamped, atol=1e-3)


def test_unsupported_activation_is_refused() -> None:
    case = random_case(2, 16, 8, 4, 2)
    with pytest.raises(ValueError, match=r"'gelu'.*supported: silu, swigluoai"):
        experts_grouped(case.x, case.w13, case.w2, case.topk_weights, case.topk_ids, activation="gelu")
    with pytest.raises(ValueError, match="swiglu_alpha and swiglu_limit"):
        experts_grouped(case.x, case.w13, case.w2, case.topk_weights, case.topk_ids, activation="swigluoai")
