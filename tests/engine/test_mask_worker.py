"""The mask worker: a step's grammar work on its own thread. It runs the advance first, then fills only the
rows whose grammar constrains the next token, each with the mask its matcher gives alone, and places them at
their rows of the step; its two host buffers, used in turn, never mix steps. `accept_all` advances grammars
as `GrammarState.accept` does, one by one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import xgrammar as xgr

from pagedserve.services.engine.structured import matcher_calls
from pagedserve.services.engine.structured.bitmask import TokenBitmask, apply_token_bitmask
from pagedserve.services.engine.structured.compiler import GrammarCompilerPool
from pagedserve.services.engine.structured.mask_worker import MaskWorker
from pagedserve.services.engine.structured.state import GrammarState, accept_all
from pagedserve.shared.grammar_spec import GrammarSpec
from pagedserve.shared.tokenizer_loader import load_tokenizer

VOCAB = 49152  # SmolLM2's
EOS = 2


@pytest.fixture(scope="module")
def pool(smollm2_dir: Path) -> GrammarCompilerPool:
    return GrammarCompilerPool(load_tokenizer(smollm2_dir), VOCAB, [EOS])


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path) -> Any:
    return load_tokenizer(smollm2_dir)


def ready(pool: GrammarCompilerPool, spec: GrammarSpec) -> GrammarState:
    state = GrammarState(pool.submit(spec))
    pool.submit(spec).result()
    assert state.is_ready and state.error is None
    return state


def alone(state: GrammarState) -> torch.Tensor:
    bitmask = xgr.allocate_token_bitmask(1, VOCAB)
    state.fill_bitmask(bitmask, 0)
    return bitmask[0]


def test_masks_land_at_their_rows_after_the_advance(pool: GrammarCompilerPool, tokenizer: Any) -> None:
    digits, words = ready(pool, GrammarSpec("regex", r"[0-9]{4}")), ready(pool, GrammarSpec.choice(["yes", "no"]))
    done = ready(pool, GrammarSpec.choice(["ok"]))
    for token_id in [*tokenizer.encode("ok", add_special_tokens=False), EOS]:
        assert done.accept(token_id)
    assert done.is_terminated and not done.constrains_next
    worker = MaskWorker(VOCAB, max_rows=8, device=torch.device("cpu"))
    seven = tokenizer.encode("7", add_special_tokens=False)
    order: list[str] = []

    def accept() -> str:
        order.append("accept")
        assert accept_all([digits], seven) == [True]
        return "advanced"

    task = worker.submit(accept, [(1, digits), (4, words), (6, done)])
    accepted, masks = task.join()
    assert accepted == "advanced" and order == ["accept"]
    assert masks is not None and masks.row_ids.tolist() == [1, 4]  # the finished grammar constrains nothing
    assert torch.equal(masks.bitmask[1], alone(digits)) and torch.equal(masks.bitmask[4], alone(words))
    assert task.join()[1] is masks  # joined once

    for _ in range(3):  # both host buffers in turn, then the first again, each step's digits mask another
        assert accept_all([digits], seven) == [True]
        masks = worker.submit(None, [(0, words), (2, digits)]).masks()
        assert masks is not None and masks.row_ids.tolist() == [0, 2]
        assert torch.equal(masks.bitmask[0], alone(words)) and torch.equal(masks.bitmask[2], alone(digits))
    assert worker.submit(None, [(3, done)]).masks() is None
    worker.shutdown()


def test_accept_all_matches_one_by_one(pool: GrammarCompilerPool, tokenizer: Any) -> None:
    spec = GrammarSpec.choice(["yes", "no"])
    yes = [*tokenizer.encode("yes", add_special_tokens=False), EOS]
    batched, single = [ready(pool, spec) for _ in range(2)], [ready(pool, spec) for _ in range(2)]
    bad = tokenizer.encode("7", add_special_tokens=False)[0]
    for token_id in yes:
        tokens = [token_id, bad if token_id == yes[0] else token_id]  # the second one is rejected at once
        assert accept_all(batched, tokens) == [s.accept(t) for s, t in zip(single, tokens)]
        assert [s.is_terminated for s in batched] == [s.is_terminated for s in single]
        assert [s.error for s in batched] == [s.error for s in single]
    assert batched[0].is_terminated and "rejected" in (batched[1].error or "")


def test_the_cpu_apply_matches_xgrammars_kernel() -> None:
    generator = torch.Generator().manual_seed(0)
    for vocab_size in (1000, VOCAB, VOCAB + 3):
        logits = torch.randn(12, vocab_size, generator=generator)
        shape = xgr.get_bitmask_shape(12, vocab_size)
        bits = torch.randint(-(2**31), 2**31 - 1, shape, generator=generator, dtype=torch.int64).to(torch.int32)
        rows = [0, 5, 11]
        expected = logits.clone()
        xgr.apply_token_bitmask_inplace(expected, bits, vocab_size=vocab_size, indices=rows)
        for row_ids in (rows, torch.tensor(rows)):
            ours = logits.clone()
            apply_token_bitmask(ours, TokenBitmask(bits, row_ids))
            assert torch.equal(ours, expected)


def test_the_engines_accept_answers_as_xgrammars(pool: GrammarCompilerPool, tokenizer: Any, monkeypatch: Any) -> None:
    """matcher_calls.batch_accept (the binding's accept, kept from handing the GIL back; its result read in one
    call unless a row rejected) advances matchers and answers as xgrammar's wrapper does, and as its fallback."""
    accept = matcher_calls.binding_accept()
    assert accept is not None and accept.release_gil is False  # the installed xgrammar takes the held path
    spec = GrammarSpec("regex", r"[0-9]{4}")
    digit, letter = (tokenizer.encode(text, add_special_tokens=False)[0] for text in ("7", "a"))

    def matchers() -> list[Any]:
        return [ready(pool, spec).matcher for _ in range(3)]

    for tokens in ([digit] * 3, [digit, letter, digit]):
        theirs, ours, fallback = matchers(), matchers(), matchers()
        expected = xgr.BatchGrammarMatcher.batch_accept_token(theirs, tokens)
        assert expected == [token == digit for token in tokens]
        assert matcher_calls.batch_accept(ours, tokens) == expected
        with monkeypatch.context() as patch:
            patch.setattr(matcher_calls, "binding_accept", lambda: None)
            assert matcher_calls.batch_accept(fallback, tokens) == expected
        for mine, reference in ((ours, theirs), (fallback, theirs)):  # the matchers advanced alike
            for a, b in zip(mine, reference, strict=True):
                assert torch.equal(_mask(a), _mask(b))


def _mask(matcher: Any) -> torch.Tensor:
    bitmask = xgr.allocate_token_bitmask(1, VOCAB)
    matcher.fill_next_token_bitmask(bitmask, 0)
    return bitmask[0]
