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

With a grammar process (grammar_process.py) the worker only passes the step's tokens and rows to it, one message
each, and the masks arrive in the process's shared buffers; the GIL-held work left here is a few list
comprehensions.

Masks are filled into rows 0..k-1 of a pinned host buffer (two, used in turn: the copy out of one may
still wait behind a forward pass on the device while the worker fills the other), so only the grammar
rows travel to the device, where they are scattered to their rows of the step's bitmask.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from pagedserve.services.engine.structured.bitmask import TokenBitmask
from pagedserve.services.engine.structured.grammar_process import NUM_SLOTS, GrammarProcess
from pagedserve.services.engine.structured.state import GrammarState, RemoteGrammarState

NUM_HOST_BUFFERS = NUM_SLOTS
# xgrammar's threads for a step's masks. More than one was slower on a 2-core machine (bench/grammar_handback.py:
# 1.2-1.9 vs 0.2 ms of join wait at 128 rows); a many-core GPU host is not measured yet (--fill-threads there).
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
        if self._executor is None:
            self._start()
        assert self._executor is not None
        slot, self._next_slot = self._next_slot, (self._next_slot + 1) % NUM_HOST_BUFFERS
        return GrammarTask(self, self._executor.submit(self._run, accept, fill, slot))

    def _start(self) -> None:
        import xgrammar as xgr

        words = xgr.get_bitmask_shape(self.max_rows, self.vocab_size)[1]
        pin = self.device.type == "cuda"
        self._process = process = self._process_of()
        for slot in range(NUM_HOST_BUFFERS):
            if process is not None:  # its shared buffers (pinned by it on CUDA)
                self._host.append(process.masks[slot])
                self._host_rows.append(process.rows[slot])
                continue
            self._host.append(torch.full((self.max_rows, words), -1, dtype=torch.int32, pin_memory=pin))
            self._host_rows.append(torch.zeros(self.max_rows, dtype=torch.int64, pin_memory=pin))
        self._bitmask = torch.full((self.max_rows, words), -1, dtype=torch.int32, device=self.device)
        self._fill = xgr.BatchGrammarMatcher(max_threads=FILL_THREADS).batch_fill_next_token_bitmask  # one C++ call
        sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-mask")

    def _run(
        self, accept: Callable[[], Any] | None, fill: Sequence[tuple[int, GrammarState]], slot: int
    ) -> tuple[Any, int, int]:
        accepted = accept() if accept is not None else None
        constrained = [(row, grammar) for row, grammar in fill if grammar.constrains_next]
        if not constrained:
            return accepted, slot, 0
        copied = self._copied[slot]
        if copied is not None and not copied.query():  # usually done; query() keeps the GIL, a wait hands it back
            copied.synchronize()  # the copy out of this buffer two steps ago
        if self._process is not None:
            remote = [(row, g.matcher_id) for row, g in constrained if isinstance(g, RemoteGrammarState)]
            return accepted, slot, self._process.fill(slot, remote)
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
