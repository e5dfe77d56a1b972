"""Sequences whose grammar is still compiling wait here, outside the scheduler, so they never hold
up the batch: the engine hands each to the scheduler once its grammar is ready (or failed).

The compiler pool (and with it xgrammar and the tokenizer) is created on the first grammar request, and with
it, where the engine asks for one, the grammar process that holds the matchers (grammar_process.py).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from pagedserve.services.engine.request import Request
from pagedserve.services.engine.structured.grammar_process import GrammarProcess
from pagedserve.services.engine.structured.reasoning_gate import ReasoningGate
from pagedserve.services.engine.structured.state import GrammarState, RemoteGrammarState
from pagedserve.shared.tokenizer_loader import load_tokenizer

log = logging.getLogger(__name__)


class GrammarAdmission:
    def __init__(
        self,
        tokenizer_source: str | Path,
        vocab_size: int,
        stop_token_ids: list[int],
        max_rows: int = 256,  # a step's rows (the grammar processes' mask buffers)
        num_processes: int = 0,  # > 0: the matchers in this many grammar processes (0: in this one)
        pin_masks: bool = False,  # their mask buffers page-locked (CUDA)
    ) -> None:
        self.tokenizer_source = tokenizer_source
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids
        self.compiling: list[Request] = []
        self._pool: Any = None
        self._max_rows = max_rows
        self._num_processes = num_processes
        self._pin_masks = pin_masks
        self.process: GrammarProcess | None = None

    @property
    def pool(self) -> Any:
        if self.process is not None and not self.process.is_alive():
            # A grammar process died: its grammars fail (RemoteGrammarState: their requests end, with the error
            # logged; a step that finds it gone first raises, and the engine service ends the running requests),
            # and grammars from now on go to new processes.
            log.error("a grammar process died; starting new ones for the requests to come")
            self.process.shutdown()
            self.process = self._start_processes(self._pool)
        if self._pool is None:
            from pagedserve.services.engine.structured.compiler import GrammarCompilerPool

            tokenizer = load_tokenizer(self.tokenizer_source)
            pool = GrammarCompilerPool(tokenizer, self.vocab_size, self.stop_token_ids)
            self.process = self._start_processes(pool)  # (first: if it fails, the next request tries again)
            self._pool = pool
        return self._pool

    def _start_processes(self, pool: Any) -> GrammarProcess | None:
        if not self._num_processes:
            return None
        info, processes = pool.tokenizer_info, self._num_processes
        return GrammarProcess(info, self.vocab_size, self._max_rows, self._pin_masks, processes)

    @property
    def is_used(self) -> bool:
        """Whether a grammar request ever came (before that, steps skip every grammar check)."""
        return self._pool is not None

    def attach(self, request: Request) -> None:
        """Start (or share) the compile of the request's grammar and hold the request until it is done."""
        spec = request.params.structured_output
        assert spec is not None
        params = request.params
        gate = None
        if params.reasoning_end_ids:  # a reasoning parser's request: the grammar waits for the answer
            gate = ReasoningGate.for_prompt(
                params.reasoning_start_ids or [], params.reasoning_end_ids, request.prompt_token_ids
            )
        compiled = self.pool.submit(spec)
        if self.process is not None:
            request.grammar = RemoteGrammarState(compiled, gate, spec, self.process)
        else:
            request.grammar = GrammarState(compiled, gate)
        self.compiling.append(request)

    def pop_ready(self) -> list[Request]:
        """Requests whose grammar is ready or failed (a continuation's tokens replayed); drops finished ones."""
        ready, still = [], []
        for request in self.compiling:
            if request.is_finished:
                continue  # aborted while compiling
            grammar = request.grammar
            assert grammar is not None
            if grammar.is_ready:
                grammar.replay(request.output_token_ids)
                ready.append(request)
            else:
                still.append(request)
        self.compiling = still
        return ready

    def wait(self, timeout: float) -> None:
        """Block briefly for the oldest compile (the engine has nothing else to run)."""
        if self.compiling and self.compiling[0].grammar is not None:
            self.compiling[0].grammar.wait(timeout)

    def __len__(self) -> int:
        return len(self.compiling)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
        if self.process is not None:
            self.process.shutdown()
