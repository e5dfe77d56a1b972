"""The grammar bitmask applied on a CUDA device (xgrammar's Triton kernel) equals the CPU result; the grammar
process's masks upload from page-locked shared memory."""

from __future__ import annotations

from concurrent.futures import Future

import pytest
import torch

from pagedserve.services.engine.structured.bitmask import TokenBitmask, apply_token_bitmask
from pagedserve.services.engine.structured.grammar_process import GrammarProcess
from pagedserve.services.engine.structured.state import RemoteGrammarState
from pagedserve.shared.grammar_spec import GrammarSpec

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


def test_grammar_process_masks_upload_from_pinned_shared_memory() -> None:
    """The grammar process's shared mask buffer is page-locked in the engine process, and its masks reach the
    device as the matcher gives them (a ten-digit vocabulary: no tokenizer files needed)."""
    xgr = pytest.importorskip("xgrammar")
    vocab = [*"0123456789", "a", "b", "</s>"]
    info = xgr.TokenizerInfo(vocab, stop_token_ids=[12])
    spec = GrammarSpec("regex", "[0-9]{2}")
    compiled = xgr.GrammarCompiler(info).compile_regex(spec.value)
    process = GrammarProcess(info, len(vocab), max_rows=4, pin=True)
    try:
        assert process.masks.is_pinned() and process.rows.is_pinned()
        done: Future[object] = Future()
        done.set_result(compiled)
        grammar = RemoteGrammarState(done, None, spec, process)
        assert grammar.is_ready and grammar.accept(7)  # the token "7"
        num_rows = process.fill(1, [(3, grammar.matcher_id)])
        masks = process.masks[1][:num_rows].to("cuda", non_blocking=True)
        rows = process.rows[1][:num_rows].to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        matcher = xgr.GrammarMatcher(compiled)
        assert matcher.accept_token(7)
        expected = xgr.allocate_token_bitmask(1, len(vocab))
        matcher.fill_next_token_bitmask(expected, 0)
        assert rows.tolist() == [3] and torch.equal(masks.cpu(), expected)
    finally:
        process.shutdown()
