"""The grammar bitmask applied on a CUDA device (xgrammar's Triton kernel) equals the CPU result."""

from __future__ import annotations

import pytest
import torch

from pagedserve.services.engine.structured.bitmask import TokenBitmask, apply_token_bitmask

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("vocab_size", [49152, 128256, 1000])
def test_bitmask_on_cuda_matches_cpu(vocab_size: int) -> None:
    xgr = pytest.importorskip("xgrammar")
    generator = torch.Generator().manual_seed(0)
    num_rows = 64
    logits = torch.randn(num_rows, vocab_size, generator=generator)
    bits = torch.randint(
        -(2**31), 2**31 - 1, xgr.get_bitmask_shape(num_rows, vocab_size), generator=generator, dtype=torch.int64
    ).to(torch.int32)
    rows = list(range(0, num_rows, 3))
    on_cpu = logits.clone()
    apply_token_bitmask(on_cpu, TokenBitmask(bits, rows))
    on_cuda = logits.cuda()
    apply_token_bitmask(on_cuda, TokenBitmask(bits.cuda(), rows))
    assert torch.equal(on_cuda.cpu(), on_cpu)
    untouched = [r for r in range(num_rows) if r not in rows]
    assert torch.equal(on_cpu[untouched], logits[untouched])  # rows without a grammar keep their logits
    assert torch.isinf(on_cpu[rows]).any()
