"""The dense decode GEMV (kernels/gemv.py) vs F.linear: 1-4 rows, ragged N and K, bias, split-K (several
slices, more slices than K needs), strided outputs; and dense.linear's choice of it.
bf16 on CUDA, fp32 in the interpreter."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from pagedserve.kernels import gemv as gemv_module
from pagedserve.kernels.gemv import GemvConfig, gemv, gemv_silu_mul
from pagedserve.kernels.silu_mul import silu_mul
from pagedserve.services.engine import attention, dense
from pagedserve.services.engine.models.layers import DenseLinear


def _dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def _check(got: torch.Tensor, want: torch.Tensor) -> None:
    tolerance = 2e-2 if got.dtype in (torch.bfloat16, torch.float16) else 1e-5
    torch.testing.assert_close(got.float(), want.float(), rtol=tolerance, atol=tolerance * want.abs().max().item())


@pytest.mark.parametrize(
    ("m", "n", "k", "bias", "config"),
    [
        (1, 40, 256, False, None),  # one slice
        (1, 37, 200, True, (8, 64, 2, 1)),  # ragged N and K: masked rows and inputs
        (3, 24, 512, True, (4, 128, 4, 2)),  # 2 slices: the last slice adds the partials (and the bias once)
        (2, 16, 384, False, (8, 128, 4, 3)),  # 3 slices
        (4, 9, 96, True, (16, 32, 1, 5)),  # 5 slices of 32 over 96 inputs: capped to 3, the last one short
    ],
)
def test_gemv_matches_linear(
    device: torch.device, m: int, n: int, k: int, bias: bool, config: GemvConfig | None
) -> None:
    torch.manual_seed(0)
    dtype = _dtype(device)
    x = torch.randn(m, k).to(device, dtype)
    weight = (torch.randn(n, k) * 0.05).to(device, dtype)
    b = torch.randn(n).to(device, dtype) if bias else None
    want = F.linear(x.float(), weight.float(), None if b is None else b.float())
    _check(gemv(x, weight, b, config=config), want)
    _check(gemv(x, weight, b, config=config), want)  # the split counters were reset by the call before


def test_gemv_writes_a_strided_output(device: torch.device) -> None:
    """The partial-sum slots of tensor parallelism hand out row-strided views (parallel/partial_sums.py)."""
    torch.manual_seed(1)
    dtype = _dtype(device)
    x = torch.randn(2, 128).to(device, dtype)
    weight = (torch.randn(24, 128) * 0.1).to(device, dtype)
    buffer = torch.full((2, 40), 7.0, device=device, dtype=dtype)
    out = buffer[:, 8:32]
    gemv(x, weight, out=out, config=(8, 32, 1, 2))
    _check(out, x.float() @ weight.float().T)
    assert (buffer[:, :8] == 7).all() and (buffer[:, 32:] == 7).all()  # nothing outside the view


def test_gemv_one_row_output_with_any_row_stride(device: torch.device) -> None:
    """A [1, N] view may carry any row stride (here 1): the split-K partials must not follow it."""
    dtype = _dtype(device)
    x = torch.randn(1, 256).to(device, dtype)
    weight = (torch.randn(64, 256) * 0.05).to(device, dtype)
    out = torch.empty(64, 1, device=device, dtype=dtype).t()
    gemv(x, weight, out=out, config=(4, 64, 2, 4))
    _check(out, x.float() @ weight.float().T)


@pytest.fixture
def gemv_rows() -> Iterator[None]:
    """Restore the process's GEMV row limit and attention backend after a dispatch test."""
    rows, backend = dense.gemv_max_rows(), attention.backend_name()
    yield
    dense.set_gemv_max_rows(rows)
    attention.use_backend(backend)


def test_dispatch_limits(gemv_rows: None) -> None:
    assert dense.MAX_ROWS == gemv_module.MAX_ROWS
    with pytest.raises(ValueError, match="gemv_max_rows"):
        dense.set_gemv_max_rows(gemv_module.MAX_ROWS + 1)


def test_linear_dispatch_keeps_cpu_on_torch(gemv_rows: None) -> None:
    """dense.linear: CPU tensors never take the GEMV; out= means the same on the torch path."""
    torch.manual_seed(3)
    x, weight = torch.randn(2, 32), torch.randn(16, 32)
    dense.set_gemv_max_rows(4)
    assert not dense.takes_gemv(x, weight)
    out = torch.empty(2, 16)
    assert dense.linear(x, weight, out=out) is out
    torch.testing.assert_close(out, F.linear(x, weight))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GEMV dispatch is for CUDA tensors")
def test_linear_dispatch_takes_the_gemv_for_decode_rows(gemv_rows: None) -> None:
    attention.use_backend("triton")
    x = torch.randn(3, 256, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16) * 0.05
    dense.set_gemv_max_rows(2)
    assert dense.takes_gemv(x[:2], weight) and not dense.takes_gemv(x, weight)
    assert not dense.takes_gemv(x[:2].float(), weight.float())  # fp32 stays on cuBLAS
    assert not dense.takes_gemv(x[:2], weight, weight[0].float())  # a bias of another dtype: F.linear's error
    torch.testing.assert_close(dense.linear(x[:2], weight), gemv(x[:2], weight), rtol=0, atol=0)


@pytest.mark.parametrize(
    ("n", "k", "config"),
    [
        (40, 64, (4, 64, 2, 1)),  # one step a row: one launch
        (37, 200, (8, 256, 2, 1)),  # ragged: masked gate/up rows and inputs, one launch
        (24, 512, (4, 128, 4, 1)),  # rows of several steps: the two launches instead, the same result
        (24, 128, (4, 128, 4, 2)),  # a split config: the two launches
    ],
)
def test_gemv_silu_mul_equals_the_projection_then_the_silu_kernel(
    device: torch.device, n: int, k: int, config: GemvConfig
) -> None:
    """One program per (gate row, up row): bit for bit what the gate_up GEMV and kernels/silu_mul.py give."""
    torch.manual_seed(4)
    dtype = _dtype(device)
    x = torch.randn(1, k).to(device, dtype)
    weight = (torch.randn(2 * n, k) * 0.1).to(device, dtype)
    want = silu_mul(gemv(x, weight, config=config))
    got = gemv_silu_mul(x, weight, config=config)
    assert got.shape == (1, n)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    gate, up = (x.float() @ weight.float().T).split(n, dim=-1)
    _check(got, F.silu(gate) * up)


def test_gate_up_silu_takes_only_plain_one_row_layers(gemv_rows: None) -> None:
    """dense.gate_up_silu stands in for a plain layer's forward only: not for a subclass that overrides
    forward (LoRA, quantized), a biased layer, or CPU rows (those project, then apply the SiLU)."""

    class Scaled(DenseLinear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 2 * super().forward(x)

    x = torch.randn(1, 32)
    assert dense.gate_up_silu(DenseLinear(32, 16, bias=False), x) is None  # CPU: takes_gemv says no
    assert type(DenseLinear(32, 16)).forward in dense._plain_forwards
    assert Scaled.forward not in dense._plain_forwards
    assert dense.gate_up_silu(Scaled(32, 16, bias=False), x) is None
    if torch.cuda.is_available():
        attention.use_backend("triton")
        cuda_x = x.to("cuda", torch.bfloat16)
        plain = DenseLinear(32, 16, bias=False).to("cuda", torch.bfloat16)
        got = dense.gate_up_silu(plain, cuda_x)
        assert got is not None
        torch.testing.assert_close(got, silu_mul(plain(cuda_x)), rtol=0, atol=0)
        assert dense.gate_up_silu(Scaled(32, 16, bias=False).to("cuda", torch.bfloat16), cuda_x) is None
        assert dense.gate_up_silu(DenseLinear(32, 16, bias=True).to("cuda", torch.bfloat16), cuda_x) is None
