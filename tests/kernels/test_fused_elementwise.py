"""The fused elementwise kernels against their torch references (interpreter on CPU, compiled on CUDA).

Outputs are NaN-poisoned wherever a kernel must write, so a skipped row or column shows up.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from pagedserve.kernels import reference
from pagedserve.kernels.fused_norm import add_rms_norm_
from pagedserve.kernels.rotary_kv_write import rotary_write_kv_cache
from pagedserve.kernels.silu_mul import silu_mul
from pagedserve.services.engine.models.rotary import RopeParams, RotaryEmbedding

_TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3)}


def _rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * h.to(x.dtype).float()).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("hidden", [64, 96, 576])
def test_add_rms_norm_matches_reference(device: torch.device, dtype: torch.dtype, hidden: int) -> None:
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn((7, hidden), generator=gen, device=device).to(dtype)
    residual = torch.randn((7, hidden), generator=gen, device=device).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen, device=device)).to(dtype)
    expected_residual = x + residual
    expected = _rms_norm_ref(expected_residual, weight, 1e-5)
    out, new_residual = add_rms_norm_(x.clone(), residual.clone(), weight, 1e-5)
    torch.testing.assert_close(new_residual, expected_residual, atol=0, rtol=0)
    torch.testing.assert_close(out, expected, **_TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_add_rms_norm_first_layer_copies_x_into_poisoned_residual(device: torch.device, dtype: torch.dtype) -> None:
    x = torch.randn((5, 64), device=device).to(dtype)
    weight = torch.rand(64, device=device).to(dtype)
    poisoned = torch.full_like(x, float("nan"))
    out, residual = add_rms_norm_(x.clone(), None, weight, 1e-6, residual_out=poisoned)
    assert residual is poisoned
    torch.testing.assert_close(residual, x, atol=0, rtol=0)
    torch.testing.assert_close(out, _rms_norm_ref(x, weight, 1e-6), **_TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("intermediate", [96, 1536, 2500])
def test_silu_mul_matches_reference(device: torch.device, dtype: torch.dtype, intermediate: int) -> None:
    gate_up = (3 * torch.randn((6, 2 * intermediate), device=device)).to(dtype)
    out = torch.full((6, intermediate), float("nan"), device=device, dtype=dtype)
    silu_mul(gate_up, out)
    gate, up = gate_up.float().chunk(2, dim=-1)
    torch.testing.assert_close(out, (F.silu(gate) * up).to(dtype), **_TOL[dtype])


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "rotary_dim", "block_size", "dtype"),
    [
        (4, 2, 32, 32, 16, torch.float32),
        (9, 3, 64, 64, 16, torch.float16),  # SmolLM2's head counts (non-power-of-2)
        (4, 1, 40, 20, 8, torch.float16),  # partially rotary, odd head_dim
        (2, 2, 64, 16, 16, torch.float32),  # rotary_pct 0.25
    ],
)
def test_rotary_kv_write_matches_unfused(
    device: torch.device,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    rotary_dim: int,
    block_size: int,
    dtype: torch.dtype,
) -> None:
    gen = torch.Generator(device=device).manual_seed(3)
    num_tokens, num_blocks = 19, 5
    rotary = RotaryEmbedding(RopeParams("default", 10000.0, rotary_dim), max_position=512)
    positions = torch.randint(0, 512, (num_tokens,), generator=gen, device=device)
    slots = torch.randperm(num_blocks * block_size, generator=gen, device=device)[:num_tokens]
    slots[[2, 9]] = -1  # padding tokens: rotated but never written
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.randn((num_tokens, q_size + 2 * kv_size), generator=gen, device=device).to(dtype)

    def views(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = t.split([q_size, kv_size, kv_size], dim=-1)
        return (
            q.view(num_tokens, num_heads, head_dim),
            k.view(num_tokens, num_kv_heads, head_dim),
            v.view(num_tokens, num_kv_heads, head_dim),
        )

    q0, k0, v0 = views(qkv)
    q_ref, k_ref = rotary(positions, q0, k0)
    cache_ref = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"), device=device)
    cache_ref = cache_ref.to(dtype)
    cache = cache_ref.clone()
    reference.write_kv_cache(k_ref, v0, cache_ref, slots)

    fused = qkv.clone()
    q, k, v = views(fused)
    cos, sin = rotary.caches_for(q)
    rotary_write_kv_cache(positions, q, k, v, cos, sin, cache, slots)
    torch.testing.assert_close(q, q_ref, **_TOL[dtype])
    torch.testing.assert_close(k, k_ref, **_TOL[dtype])
    torch.testing.assert_close(cache, cache_ref, equal_nan=True, **_TOL[dtype])  # unwritten slots stay NaN
    written = slots[slots >= 0]
    assert not cache.view(2, -1, num_kv_heads, head_dim)[:, written].isnan().any()
