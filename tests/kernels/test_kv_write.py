from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from pagedserve.kernels import reference
from pagedserve.kernels.kv_write import write_kv_cache


@pytest.mark.parametrize(
    ("num_kv_heads", "head_dim", "block_size", "dtype"),
    [(2, 32, 16, torch.float32), (3, 40, 32, torch.float16), (1, 64, 16, torch.float16)],
)
def test_matches_reference_and_skips_padding(
    device: torch.device, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
) -> None:
    gen = torch.Generator(device=device).manual_seed(1)
    num_blocks, num_tokens = 6, 21
    slots = torch.randperm(num_blocks * block_size, generator=gen, device=device)[:num_tokens]
    slots[[3, 11]] = -1  # padding tokens
    # K/V as slices of a fused projection output: token stride != num_kv_heads * head_dim.
    fused = torch.randn((num_tokens, 3, num_kv_heads, head_dim), generator=gen, device=device)
    key, value = fused[:, 1], fused[:, 2]
    cache = torch.randn((2, num_blocks, block_size, num_kv_heads, head_dim), generator=gen, device=device)
    cache = cache.to(dtype)
    expected = cache.clone()
    reference.write_kv_cache(key, value, expected, slots)
    write_kv_cache(key, value, cache, slots)
    assert torch.equal(cache, expected)
    written = cache.view(2, -1, num_kv_heads, head_dim)[:, slots[slots >= 0]]
    assert torch.equal(written[0], key[slots >= 0].to(dtype))


def test_empty_step_writes_nothing(device: torch.device) -> None:
    cache = torch.zeros((2, 2, 16, 1, 16), device=device)
    empty = torch.zeros((0, 1, 16), device=device)
    write_kv_cache(empty, empty, cache, torch.zeros(0, dtype=torch.long, device=device))
    assert not cache.any()
