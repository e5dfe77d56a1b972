"""One sequence's grammar: the compile it waits for, then a matcher that follows its output tokens.

The matcher advances only with tokens that are final (a step's tokens, once they reached the host), so
preemption, which recomputes the KV but keeps the tokens, leaves it valid; a continuation's tokens are
replayed into it once the grammar is ready. Behind a reasoning gate the matcher starts only with the token
after the reasoning's end marker (reasoning_gate.py). Under overlapped steps a worker thread advances it and
fills its mask (mask_worker.py), never while the engine's thread touches it.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

from pagedserve.services.engine.structured.grammar_process import TERMINATED, GrammarProcess
from pagedserve.services.engine.structured.matcher_calls import batch_accept
from pagedserve.services.engine.structured.reasoning_gate import ReasoningGate
from pagedserve.shared.grammar_spec import GrammarSpec


class GrammarState:
    def __init__(self, compiled: Future[Any], gate: ReasoningGate | None = None) -> None:
        self._compiled = compiled
        self.gate = gate
        self.matcher: Any = None
        self.error: str | None = None  # the compile failed, or a token was rejected
        self.is_terminated = False
        self.stop_token_ids: frozenset[int] = frozenset()  # the matcher's: only these can complete it

    @property
    def is_ready(self) -> bool:
        """Compiled (or failed): whether the scheduler may run the sequence. Never blocks."""
        return self.is_open or self.error is not None or self._start()

    @property
    def is_open(self) -> bool:
        """Whether its matcher was started."""
        return self.matcher is not None

    def wait(self, timeout: float) -> None:
        with contextlib.suppress(TimeoutError):
            self._compiled.exception(timeout=timeout)

    def _start(self) -> bool:
        if not self._compiled.done():
            return False
        exc = self._compiled.exception()
        if exc is not None:
            self.error = f"the grammar did not compile: {exc}"
            return True
        self._open(self._compiled.result())
        return True

    def _open(self, compiled: Any) -> None:
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled)
        self.stop_token_ids = frozenset(self.matcher.stop_token_ids)

    def replay(self, token_ids: list[int]) -> None:
        """Advance over tokens produced before the grammar was ready here (a continuation)."""
        for token_id in token_ids:
            if not self.accept(token_id):
                return

    def accept(self, token_id: int) -> bool:
        """Advance by a sampled token; False (and `error` set) if the grammar rejects it."""
        if self.matcher is None or self.is_terminated:
            return True
        if self.gate is not None and not self.gate.is_open:  # still reasoning: free text
            self.gate.feed(token_id)
            return True
        if not self.matcher.accept_token(token_id):
            self.error = f"the grammar rejected token {token_id}"
            return False
        self.is_terminated = bool(self.matcher.is_terminated())
        return True

    @property
    def constrains_next(self) -> bool:
        """Whether the next token is masked: the grammar applies (past any reasoning) and is not complete."""
        return self.matcher is not None and not self.is_terminated and (self.gate is None or self.gate.is_open)

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        """Constrain the row (it stays all-allowed before the grammar applies)."""
        if self.constrains_next:
            self.matcher.fill_next_token_bitmask(bitmask, row)


class RemoteGrammarState(GrammarState):
    """A grammar whose matcher and reasoning gate live in the grammar processes (grammar_process.py): here only
    its id there and its outcome (`error`, `is_terminated`), which every accept's reply brings back. If its
    processes die, it has failed."""

    def __init__(
        self, compiled: Future[Any], gate: ReasoningGate | None, spec: GrammarSpec, process: GrammarProcess
    ) -> None:
        self.process = process
        super().__init__(compiled, gate)
        self.spec = spec
        self.matcher_id = -1  # its id in the grammar processes, once opened

    @property
    def error(self) -> str | None:
        if self._error is None and self.process.closed and not self.is_terminated:
            return "the grammar process died"
        return self._error

    @error.setter
    def error(self, value: str | None) -> None:
        self._error = value

    def _open(self, compiled: Any) -> None:
        if self.error is not None:  # its processes died before it opened
            return
        self.matcher_id = self.process.open(self.spec, compiled, self.gate)
        self.gate = None  # the child's copy follows the tokens now
        weakref.finalize(self, self.process.drop, self.matcher_id)

    @property
    def is_open(self) -> bool:
        return self.matcher_id >= 0

    def replay(self, token_ids: list[int]) -> None:
        self._accept(token_ids)

    def accept(self, token_id: int) -> bool:
        return self._accept([token_id])

    def _accept(self, token_ids: list[int]) -> bool:
        if not self.constrains_next or not token_ids:
            return self.error is None
        self.note(self.process.accept([(self.matcher_id, t) for t in token_ids]).get(self.matcher_id))
        return self.error is None

    def note(self, outcome: str | None) -> None:
        """Take an accept's outcome: None (goes on), TERMINATED, or an error."""
        if outcome == TERMINATED:
            self.is_terminated = True
        elif outcome is not None:
            self.error = outcome

    @property
    def constrains_next(self) -> bool:
        """Whether the next token may be masked (the child knows whether the reasoning is over)."""
        return self.is_open and not self.is_terminated and self.error is None

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        raise NotImplementedError("a remote grammar's mask is filled in the grammar process (GrammarProcess.fill)")


def accept_all(grammars: Sequence[GrammarState], token_ids: Sequence[int]) -> list[bool]:
    """`GrammarState.accept` for many grammars, their matchers advanced in one xgrammar call (matcher_calls.py:
    with the fewest GIL hand-backs, as the mask worker calls it beside the engine's thread), or in one message
    to the grammar process."""
    if grammars and isinstance(grammars[0], RemoteGrammarState):
        return _accept_all_remote(grammars, token_ids)
    accepted = [True] * len(grammars)
    batch: list[int] = []
    for i, (grammar, token_id) in enumerate(zip(grammars, token_ids, strict=True)):
        if grammar.matcher is None or grammar.is_terminated:
            continue
        if grammar.gate is not None and not grammar.gate.is_open:  # still reasoning: free text
            grammar.gate.feed(token_id)
            continue
        batch.append(i)
    if not batch:
        return accepted
    matchers = [grammars[i].matcher for i in batch]
    for i, ok in zip(batch, batch_accept(matchers, [token_ids[i] for i in batch]), strict=True):
        grammar, token_id = grammars[i], token_ids[i]
        if not ok:
            grammar.error = f"the grammar rejected token {token_id}"
            accepted[i] = False
        elif token_id in grammar.stop_token_ids:  # (without a stop token the matcher does not terminate)
            grammar.is_terminated = bool(grammar.matcher.is_terminated())
    return accepted


def _accept_all_remote(grammars: Sequence[GrammarState], token_ids: Sequence[int]) -> list[bool]:
    """accept_all for an engine's grammars in the grammar process (all of them are, or none)."""
    accepted = [True] * len(grammars)
    live = [(i, g) for i, g in enumerate(grammars) if isinstance(g, RemoteGrammarState) and g.constrains_next]
    if not live:
        return accepted
    ended = live[0][1].process.accept([(g.matcher_id, token_ids[i]) for i, g in live])
    if ended:  # usually none: a step's tokens fit their grammars
        for i, grammar in live:
            outcome = ended.get(grammar.matcher_id)
            if outcome is not None:
                grammar.note(outcome)
                accepted[i] = grammar.error is None
    return accepted
