"""GrammarAdmission: sequences wait outside the scheduler while their grammar compiles; each is handed
over once its own compile is done (or failed), a continuation's tokens replayed into the grammar, and one
aborted meanwhile is dropped. The compiler pool (xgrammar, the tokenizer) is built on the first grammar."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch

from pagedserve.services.engine.request import Request, RequestStatus
from pagedserve.services.engine.sampling_params import SamplingParams
from pagedserve.services.engine.structured.admission import GrammarAdmission
from pagedserve.services.engine.structured.compiler import GrammarCompilerPool
from pagedserve.shared.grammar_spec import GrammarSpec
from pagedserve.shared.tokenizer_loader import load_tokenizer

VOCAB = 49152  # SmolLM2's
EOS = 2
CHOICE = GrammarSpec.choice(["yes please", "no thanks"])


def grammar_request(request_id: str, output: list[int] | None = None, spec: GrammarSpec = CHOICE) -> Request:
    params = SamplingParams(max_tokens=8, structured_output=spec)
    return Request.create(request_id, 0, [1, 2, 3], output or [], params, 8, frozenset({EOS}), 0, torch.device("cpu"))


class ControlledPool:
    """A compiler pool whose compiles the test ends, one future per request, in the order submitted."""

    def __init__(self) -> None:
        self.futures: list[Future[Any]] = []

    def submit(self, spec: GrammarSpec) -> Future[Any]:
        future: Future[Any] = Future()
        self.futures.append(future)
        return future


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path) -> Any:
    return load_tokenizer(smollm2_dir)


def test_requests_are_held_until_their_own_compile_ends(smollm2_dir: Path) -> None:
    admission = GrammarAdmission(smollm2_dir, VOCAB, [EOS])
    pool = admission._pool = ControlledPool()
    first, second, third = (grammar_request(name) for name in ("first", "second", "third"))
    for request in (first, second, third):
        admission.attach(request)
        assert request.grammar is not None and not request.grammar.is_ready
    assert len(admission) == 3 and admission.pop_ready() == []

    pool.futures[1].set_exception(ValueError("bad schema"))  # the second fails first
    assert admission.pop_ready() == [second] and len(admission) == 2
    assert second.grammar is not None and second.grammar.error is not None and "bad schema" in second.grammar.error

    third.status = RequestStatus.FINISHED  # aborted while compiling: never handed over, even once compiled
    assert admission.pop_ready() == [] and admission.compiling == [first]
    pool.futures[2].set_exception(ValueError("too late"))
    pool.futures[0].set_exception(ValueError("also bad"))
    assert admission.pop_ready() == [first] and len(admission) == 0


def test_wait_blocks_for_the_oldest_compile_only_as_long_as_asked(smollm2_dir: Path) -> None:
    admission = GrammarAdmission(smollm2_dir, VOCAB, [EOS])
    admission.wait(5)  # nothing compiling: returns at once (and builds no pool)
    assert admission._pool is None
    pool = admission._pool = ControlledPool()
    admission.attach(grammar_request("a"))
    started = time.monotonic()
    admission.wait(0.1)  # still compiling: gives up after the timeout, no error
    assert 0.1 <= time.monotonic() - started < 1.0
    threading.Timer(0.1, pool.futures[0].set_exception, [ValueError("done")]).start()
    started = time.monotonic()
    admission.wait(10)  # wakes as soon as the compile ends
    assert time.monotonic() - started < 5 and len(admission.pop_ready()) == 1


def test_the_real_pool_compiles_and_a_continuation_is_replayed(smollm2_dir: Path, tokenizer: Any) -> None:
    admission = GrammarAdmission(smollm2_dir, VOCAB, [EOS])
    assert admission._pool is None and admission.pop_ready() == []  # nothing loaded before the first grammar
    yes = tokenizer.encode("yes", add_special_tokens=False)
    fresh, resumed = grammar_request("fresh"), grammar_request("resumed", output=yes)
    bad = grammar_request("bad", output=tokenizer.encode("maybe", add_special_tokens=False))
    for request in (fresh, resumed, bad):
        admission.attach(request)
    assert isinstance(admission.pool, GrammarCompilerPool)
    ready: list[Request] = []
    deadline = time.monotonic() + 30
    while len(ready) < 3 and time.monotonic() < deadline:
        admission.wait(1)
        ready += admission.pop_ready()
    assert {r.request_id for r in ready} == {"fresh", "resumed", "bad"} and len(admission) == 0

    no = tokenizer.encode("no", add_special_tokens=False)[0]
    assert fresh.grammar is not None and fresh.grammar.error is None
    assert fresh.grammar.accept(no)  # "no thanks" is still open to a fresh sequence
    assert resumed.grammar is not None and resumed.grammar.error is None  # "yes" was replayed into it
    assert not resumed.grammar.accept(no)  # so "no" is no longer allowed
    assert bad.grammar is not None and bad.grammar.error is not None and "rejected" in bad.grammar.error
    admission.pool.shutdown()
