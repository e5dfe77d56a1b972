"""A request's grammar while it compiles, after it failed, and as tokens advance it; the early stop check."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import xgrammar

from pagedserve.services.engine.async_steps import is_stop_token
from pagedserve.services.engine.sampling_params import SamplingParams
from pagedserve.services.engine.structured.state import GrammarState
from tests.engine.engine_helpers import make_request


class _Matcher:
    """Accepts tokens 1..4 in order, then terminates (xgrammar's GrammarMatcher surface)."""

    stop_token_ids = (4,)  # the token that completes it

    def __init__(self, compiled: Any) -> None:
        self.next = 1

    def accept_token(self, token_id: int) -> bool:
        if token_id != self.next:
            return False
        self.next += 1
        return True

    def is_terminated(self) -> bool:
        return self.next > 4


def test_not_ready_until_compiled_then_tokens_advance_it(monkeypatch: Any) -> None:
    monkeypatch.setattr(xgrammar, "GrammarMatcher", _Matcher)
    compiled: Future[Any] = Future()
    state = GrammarState(compiled)
    assert not state.is_ready and state.matcher is None
    compiled.set_result("grammar")
    assert state.is_ready and isinstance(state.matcher, _Matcher)
    state.replay([1, 2])  # tokens streamed before a continuation reached this replica
    assert state.accept(3) and not state.is_terminated
    assert state.accept(4) and state.is_terminated
    assert state.accept(99)  # after termination the grammar no longer constrains


def test_a_rejected_token_and_a_failed_compile_are_errors() -> None:
    failed: Future[Any] = Future()
    failed.set_exception(ValueError("bad schema"))
    state = GrammarState(failed)
    assert state.is_ready and state.error == "the grammar did not compile: bad schema"
    done: Future[Any] = Future()
    done.set_result("grammar")
    rejecting = GrammarState(done)
    rejecting.matcher = _Matcher(None)
    assert not rejecting.accept(3) and rejecting.error == "the grammar rejected token 3"


def test_the_overlapped_steps_stop_check_matches_the_requests_own() -> None:
    """is_stop_token (async scheduling's early check) agrees with Request.stop_reason_after: EOS and stop ids
    end a sequence only once min_tokens are out."""
    request = make_request([5, 6, 7], SamplingParams(max_tokens=8, min_tokens=2, stop_token_ids=[9]))
    first, second = request.num_prompt_tokens, request.num_prompt_tokens + 1  # positions of outputs 1 and 2
    assert not is_stop_token(request, 2, first) and not is_stop_token(request, 9, first)  # min_tokens pending
    assert is_stop_token(request, 2, second) and is_stop_token(request, 9, second)
    assert not is_stop_token(request, 4, second)
