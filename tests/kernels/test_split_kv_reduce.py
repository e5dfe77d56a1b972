"""Flash-decoding's segment merge vs the same merge in torch: weights 2^(m_s - M), empty segments weigh 0."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from pagedserve.kernels.split_kv_reduce import reduce_segments


def test_segments_merge_like_one_softmax(device: torch.device) -> None:
    torch.manual_seed(0)
    tokens, heads, segments, head_dim, padded = 3, 2, 4, 48, 64
    seg_out = torch.randn(tokens, heads, segments, padded, device=device)
    seg_max = torch.randn(tokens, heads, segments, device=device) * 3
    seg_sum = torch.rand(tokens, heads, segments, device=device) + 0.5
    seg_max[0, 0, 1], seg_sum[0, 0, 1], seg_out[0, 0, 1] = float("-inf"), 0.0, 0.0  # a segment that saw no key
    out = reduce_segments(torch.empty(tokens, heads, head_dim, device=device), seg_out, seg_max, seg_sum)
    weight = torch.exp2(seg_max - seg_max.max(dim=-1, keepdim=True).values)
    want = (seg_out * weight[..., None]).sum(2) / (seg_sum * weight).sum(2)[..., None]
    torch.testing.assert_close(out, want[..., :head_dim], rtol=1e-5, atol=1e-5)
