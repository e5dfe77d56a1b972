"""A step's grammar work on a worker thread, beside the engine thread's launch of the step:

    engine thread:  schedule N+1 | submit | prepare N+1, launch its forward | join: copy masks, sample
    worker:                      | wait for N's tokens, advance the grammars | fill N+1's masks |

The worker's xgrammar calls run in C++ while the engine thread's Python prepares and launches the step, instead
of after it. Every call into xgrammar's binding releases the GIL and takes it back, and beside a thread busy in
Python each take-back can wait up to the switch interval (bench/xgrammar_gil.py: xgrammar's batched accept of 128
matchers, which reads its result one element, one hand-back, at a time, took 0.17 ms alone and ~5 ms beside a
busy thread at a 0.5 ms interval). So the worker hands the GIL back as seldom as it can: the accept keeps it
(matcher_calls.py), the fill releases it once. The engine joins the work (`GrammarTask.join`) before sampling
and before it reads step N's tokens; between submit and join it touches none of the grammars it handed over.

With grammar processes (grammar_process.py, `submit_remote`) step N's tokens go to them with the rows to fill in
one message, not waited for: from the engine thread when they are on the host already (a step bound by the host
finds them there), else from the worker thread once they arrive. The engine thread collects the replies when it
samples; the masks are in the processes' shared buffers.

Masks are filled into rows 0..k-1 of a pinned host buffer (two, used in turn: the copy out of one may
still wait behind a forward pass on the device while the worker fills the other), so only the grammar
rows travel to the device, where they are scattered to their rows of the step's bitmask.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from pagedserve.services.engine.request import Request
from pagedserve.services.engine.structured.bitmask import TokenBitmask
from pagedserve.services.engine.structured.grammar_process import NUM_SLOTS, GrammarProcess
from pagedserve.services.engine.structured.state import GrammarState, RemoteGrammarState

log = logging.getLogger(__name__)
NUM_HOST_BUFFERS = NUM_SLOTS
# xgrammar's threads for a step's masks. More than one was slower on a 2-core machine (bench/grammar_handback.py:
# 1.2-1.9 vs 0.2 ms of join wait at 128 rows), and 4 made no difference on an H200 host
# (bench/results/structured_gil_h200_2026-11-29/, call 2).
FILL_THREADS = 1
# The worker's Python around its xgrammar calls needs the GIL back from the engine thread, which runs
# Python between kernels: with the default 5 ms switch interval each hand-back could wait out most of a step
# (bench/grammar_handback.py, 2 ms of engine Python: 1.2-2.0 ms of join wait at 5 ms, 0.2 ms at 0.5 ms).
SWITCH_INTERVAL_S = 0.0005


class GrammarTask:
    """One step's submitted grammar work: its `accept` result and its masks, once joined."""

    def __init__(self, worker: MaskWorker, future: Future[tuple[Any, int, int]]) -> None:
        self._worker = worker
        self._future = future
        self._joined: tuple[Any, TokenBitmask | None] | None = None

    def join(self) -> tuple[Any, TokenBitmask | None]:
        """Wait for the worker (once): what `accept` returned, and the step's masks on the device (None
        when no row is constrained)."""
        if self._joined is None:
            accepted, slot, num_rows = self._future.result()
            self._joined = accepted, self._worker.to_device(slot, num_rows) if num_rows else None
        return self._joined

    def masks(self) -> TokenBitmask | None:
        return self.join()[1]


class RemoteGrammarTask:
    """One step's grammar work posted to the grammar process: `join` as GrammarTask's."""

    def __init__(
        self,
        worker: MaskWorker,
        process: GrammarProcess,
        posted: Future[tuple[Any, int]] | tuple[Any, int],  # (the step result or None, the step's ticket)
        accept_rows: Sequence[tuple[int, Request]],
        ended_rows: list[int],  # accept rows whose grammar had ended before (completed, or failed)
        slot: int,
        num_rows: int,  # the step's fill entries
    ) -> None:
        self._worker = worker
        self._process = process
        self._posted = posted
        self._accept_rows = accept_rows
        self._ended_rows = ended_rows
        self._slot = slot
        self._num_rows = num_rows
        self._joined: tuple[Any, TokenBitmask | None] | None = None

    def join(self) -> tuple[Any, TokenBitmask | None]:
        """(the step result and per row whether its grammar ended it, or None without an accept; the masks)."""
        if self._joined is None:
            result, ticket = self._posted if isinstance(self._posted, tuple) else self._posted.result()
            ended = self._process.collect_step(ticket)
            accepted = None if result is None else (result, self._ends(ended, len(result.sampled_token_ids)))
            self._joined = accepted, self._worker.to_device(self._slot, self._num_rows) if self._num_rows else None
        return self._joined

    def masks(self) -> TokenBitmask | None:
        return self.join()[1]

    def _ends(self, ended: dict[int, str], num_rows: int) -> list[bool]:
        """Per row of the step: whether its grammar ended the sequence (completed, or rejected its token)."""
        ends = [False] * num_rows
        for row in self._ended_rows:
            ends[row] = True
        if ended:  # usually none
            for row, request in self._accept_rows:
                grammar = request.grammar
                assert isinstance(grammar, RemoteGrammarState)
                outcome = ended.get(grammar.matcher_id)
                if outcome is not None:
                    grammar.note(outcome)
                    ends[row] = True
                    if grammar.error is not None:
                        log.error("request %s: %s", request.request_id, grammar.error)
        return ends


StepGrammarTask = GrammarTask | RemoteGrammarTask


def _tokens_on_host(handle: Any) -> bool:
    """Whether a launched step's tokens reached the host (its copy's event is done), without waiting."""
    if not hasattr(handle, "ready"):
        return False
    return handle.ready is None or bool(handle.ready.query())


class MaskWorker:
    """The worker thread and the bitmask buffers (allocated, with xgrammar imported, on first use)."""

    def __init__(
        self,
        vocab_size: int,
        max_rows: int,
        device: torch.device,
        process: Callable[[], GrammarProcess | None] = lambda: None,  # the grammar process, if any (once used)
    ) -> None:
        self.vocab_size = vocab_size
        self.max_rows = max_rows
        self.device = device
        self._process_of = process
        self._process: GrammarProcess | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._fill: Callable[..., Any] | None = None
        self._host: list[torch.Tensor] = []  # [max_rows, words] int32, masks in rows 0..k-1
        self._host_rows: list[torch.Tensor] = []  # [max_rows] int64: each of those rows' row in the step
        self._copied: list[torch.cuda.Event | None] = [None] * NUM_HOST_BUFFERS  # the copy out of each
        self._bitmask: torch.Tensor | None = None  # [max_rows, words] int32 on the device, rows as in the step
        self._next_slot = 0

    def submit(self, accept: Callable[[], Any] | None, fill: Sequence[tuple[int, GrammarState]]) -> GrammarTask:
        """Run `accept` (advance the grammars by the last step's tokens), then fill the masks of `fill`'s
        (row, grammar) pairs that constrain their next token, on the worker thread."""
        slot = self._take_slot()
        assert self._executor is not None
        return GrammarTask(self, self._executor.submit(self._run, accept, fill, slot))

    @property
    def process(self) -> GrammarProcess | None:
        return self._process

    def submit_remote(
        self,
        handle: Any,  # the previous step's (its `result()` waits for its tokens), or None: fill only
        accept_rows: Sequence[tuple[int, Request]],  # its rows whose grammar takes their token
        fill: Sequence[tuple[int, GrammarState]],
    ) -> RemoteGrammarTask:
        """`submit` for grammars in the grammar processes: the previous step's tokens go to them with this step's
        rows to fill, in one message, from this thread when they are on the host already, else from the worker
        thread once they arrive."""
        slot = self._take_slot()
        assert self._executor is not None
        if self._process is not self._process_of():  # it died and was replaced (admission.py)
            self._bind(self._process_of())
        process = self._process
        assert process is not None
        rows = [(row, g.matcher_id) for row, g in fill if isinstance(g, RemoteGrammarState) and g.constrains_next]
        ids, token_rows, ended_rows = [], [], []
        for row, request in accept_rows:
            grammar = request.grammar
            assert isinstance(grammar, RemoteGrammarState)
            if grammar.constrains_next:
                ids.append(grammar.matcher_id)
                token_rows.append(row)
            elif grammar.is_terminated or grammar.error is not None:
                ended_rows.append(row)
        submitted = time.monotonic()

        def task(posted: Future[tuple[Any, int]] | tuple[Any, int]) -> RemoteGrammarTask:
            return RemoteGrammarTask(self, process, posted, accept_rows, ended_rows, slot, len(rows))

        if handle is not None and ids and not _tokens_on_host(handle):  # on their way: the worker waits for them
            return task(self._executor.submit(self._post, process, handle, ids, token_rows, slot, rows, submitted))
        # The tokens are here (as a step bound by the host finds them: call 3 on the H200 measured 0.6-0.8 ms of
        # hand-over to the worker), or no grammar takes one: posted from this thread.
        result = handle.result() if handle is not None and ids else None
        tokens = [] if result is None else [result.sampled_token_ids[row] for row in token_rows]
        self._wait_copied(slot)
        ticket = process.post_step(ids if result is not None else [], tokens, slot, rows, submitted)
        if handle is not None and result is None:  # no grammar takes a token; the engine still waits for the result
            return task(self._executor.submit(lambda: (handle.result(), ticket)))
        return task((result, ticket))

    def _post(
        self,
        process: GrammarProcess,
        handle: Any,
        ids: list[int],
        token_rows: list[int],
        slot: int,
        rows: list[tuple[int, int]],
        submitted_at: float,
    ) -> tuple[Any, int]:
        result = handle.result()  # waits (without the GIL) for the previous step's tokens
        tokens = result.sampled_token_ids
        self._wait_copied(slot)
        return result, process.post_step(ids, [tokens[row] for row in token_rows], slot, rows, submitted_at)

    def _take_slot(self) -> int:
        """The host buffer for the next step's masks (the worker and buffers started on first use)."""
        if self._executor is None:
            self._start()
        slot, self._next_slot = self._next_slot, (self._next_slot + 1) % NUM_HOST_BUFFERS
        return slot

    def _wait_copied(self, slot: int) -> None:
        """Until the copy out of this buffer two steps ago is done (usually it is: query() keeps the GIL, a
        wait hands it back)."""
        copied = self._copied[slot]
        if copied is not None and not copied.query():
            copied.synchronize()

    def _start(self) -> None:
        import xgrammar as xgr

        words = xgr.get_bitmask_shape(self.max_rows, self.vocab_size)[1]
        pin = self.device.type == "cuda"
        process = self._process_of()
        for _ in range(NUM_HOST_BUFFERS if process is None else 0):
            self._host.append(torch.full((self.max_rows, words), -1, dtype=torch.int32, pin_memory=pin))
            self._host_rows.append(torch.zeros(self.max_rows, dtype=torch.int64, pin_memory=pin))
        self._bind(process)
        self._bitmask = torch.full((self.max_rows, words), -1, dtype=torch.int32, device=self.device)
        self._fill = xgr.BatchGrammarMatcher(max_threads=FILL_THREADS).batch_fill_next_token_bitmask  # one C++ call
        sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-mask")

    def _bind(self, process: GrammarProcess | None) -> None:
        """Take the grammar process's shared buffers (pinned by it on CUDA) as the host buffers."""
        self._process = process
        if process is not None:
            self._host = [process.masks[slot] for slot in range(NUM_HOST_BUFFERS)]
            self._host_rows = [process.rows[slot] for slot in range(NUM_HOST_BUFFERS)]
            self._copied = [None] * NUM_HOST_BUFFERS  # (the old buffers' copies wait for nothing of these)

    def _run(
        self, accept: Callable[[], Any] | None, fill: Sequence[tuple[int, GrammarState]], slot: int
    ) -> tuple[Any, int, int]:
        accepted = accept() if accept is not None else None
        constrained = [(row, grammar) for row, grammar in fill if grammar.constrains_next]
        if not constrained:
            return accepted, slot, 0
        self._wait_copied(slot)
        assert self._fill is not None
        self._fill([grammar.matcher for _, grammar in constrained], self._host[slot], None)  # rows 0..k-1
        rows = self._host_rows[slot].numpy()
        rows[: len(constrained)] = [row for row, _ in constrained]
        return accepted, slot, len(constrained)

    def to_device(self, slot: int, num_rows: int) -> TokenBitmask:
        """The filled masks, scattered to their rows of the step's bitmask (engine thread; no host sync)."""
        assert self._bitmask is not None
        masks = self._host[slot][:num_rows].to(self.device, non_blocking=True)
        rows = self._host_rows[slot][:num_rows].to(self.device, non_blocking=True)
        self._bitmask.index_copy_(0, rows, masks)
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
            self._copied[slot] = event
        return TokenBitmask(self._bitmask, rows)

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
