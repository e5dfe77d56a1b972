"""Structured output's matchers in processes of their own (`--grammar-processes N`; 0, off, by default).

Beside the engine thread, a grammar worker thread shares the engine's GIL. On an H200 host 256 json_schema rows
added ~1.9 ms to a 2.3 ms step that way (bench/results/structured_gil_h200_2026-11-29/): the worker's Python and
its GIL-held accept ran between the engine thread's kernel launches, and each take-back of the GIL after the mask
fill's C++ waited for the engine thread. Here the matchers, their reasoning gates and the fill live in child
processes, each with a GIL of its own, each owning the matchers whose id it is given (id % processes). The engine
sends a step's (grammar, token) pairs and the rows to fill in one message to all; each child writes its rows' masks
into shared memory, which the engine pins so the upload stays asynchronous.

Engine side: `GrammarProcess`. Requests are posted and their replies collected by ticket, in order: a step is
posted as soon as its tokens reach the host (by the engine thread or the mask worker, mask_worker.py), and the
engine thread collects the reply when it samples; it also opens matchers and replays tokens, whose replies may
arrive after a step's.
Child side: `serve`. Grammars are compiled in the engine (admission waits on them there) and sent once per spec,
as xgrammar's serialised form.

A child is `python -m` this module, given a socket and an anonymous shared file: not multiprocessing's spawn,
which re-imports the engine's main script in the child (an offline script without a `__main__` guard would start
itself again), and nothing to name or clean up when either side is killed.
"""

from __future__ import annotations

import itertools
import logging
import mmap
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import weakref
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch

from pagedserve.services.engine.structured.compiler import CACHE_SIZE
from pagedserve.services.engine.structured.matcher_calls import batch_accept
from pagedserve.services.engine.structured.reasoning_gate import ReasoningGate
from pagedserve.shared.grammar_spec import GrammarSpec

log = logging.getLogger(__name__)
# The child's threads for a step's masks. Up to 8 (half the H200 host's 16 cores) against 1 made no difference
# beyond run-to-run noise (bench/results/grammar_process_h200_2026-11-29/, call 4: the child's work a step, 256
# json_schema rows, 1.48 against 1.60 ms; 128 rows 1.19 against 1.06): its Python and the accept are serial.
FILL_THREADS = 1
NUM_SLOTS = 2  # mask buffers used in turn (mask_worker.py: one may still be copied out while the other fills)
TERMINATED = ""  # an accept's outcome for a grammar that completed; any other string is its error
REPLY_TIMEOUT_S = 60.0  # a child that answers nothing for this long is taken for hung: the engine must not hang
_matcher_ids = itertools.count()  # across every GrammarProcess: a replacement never reuses a live grammar's id


class GrammarProcessError(RuntimeError):
    """The grammar process failed or died: every grammar request of the engine is lost with it."""


class GrammarProcess:
    """The child processes, their sockets and the shared mask buffers (engine side).

    Every request goes to every child, pickled once; a child serves the matchers whose id it owns (id % children) and
    answers the rest with nothing. A step's masks are written at the index of their entry in the step's fill list, so
    the children write disjoint rows of one slot, with no offsets to agree on.
    """

    def __init__(self, tokenizer_info: Any, vocab_size: int, max_rows: int, pin: bool, num_children: int = 1) -> None:
        import xgrammar as xgr

        words = xgr.get_bitmask_shape(max_rows, vocab_size)[1]
        shape = (NUM_SLOTS, max_rows, words)
        self._file = _shared_file(_size(shape))
        self._mmap = mmap.mmap(self._file.fileno(), _size(shape))
        # [slot, entry, word]: the masks of a step's fill entries; rows: each entry's row in the step
        self.masks, self.rows = _views(self._mmap, shape)
        self.masks.fill_(-1)
        if pin:  # page-locked, so `.to(cuda, non_blocking=True)` is an asynchronous copy
            _check(torch.cuda.cudart().cudaHostRegister(self.masks.data_ptr(), len(self._mmap), 0))
        # unpinned before the buffer is unmapped, also when the engine is dropped without shutdown() (a later
        # buffer at the same address could not be registered)
        self._unpin = weakref.finalize(self, _unregister, self.masks.data_ptr() if pin else None)
        self._children: list[subprocess.Popen[bytes]] = []
        self._conns: list[Connection] = []
        self.closed = False  # shut down, or broken by a child's death or silence: every grammar of it has failed
        try:
            for index in range(num_children):
                ours, theirs = socket.socketpair()
                fds = (theirs.fileno(), self._file.fileno())
                command = [sys.executable, "-m", __name__, *map(str, (*fds, *shape, index, num_children))]
                # (a session of its own: a Ctrl-C reaches the engine, which shuts the children down)
                self._children.append(subprocess.Popen(command, pass_fds=fds, start_new_session=True))
                theirs.close()
                self._conns.append(Connection(ours.detach()))
        except BaseException:
            self.shutdown()
            raise
        self._send_lock = threading.Lock()  # a request and its ticket
        self._receive_lock = threading.Lock()
        self._num_posted = 0
        self._num_received = [0] * num_children
        self._replies: list[dict[int, tuple[bool, Any]]] = [{} for _ in self._conns]  # by ticket, until collected
        self._dropped: deque[int] = deque()  # matchers to free, sent with the next request
        try:
            self._call("start", tokenizer_info.serialize_json(), FILL_THREADS)
        except BaseException:
            self.shutdown()
            raise

    def open(self, spec: GrammarSpec, compiled: Any, gate: ReasoningGate | None) -> int:
        """Start a matcher for `compiled` (the grammar of `spec`) behind `gate`: its id."""
        matcher_id = next(_matcher_ids)
        if "missing" in self._call("open", matcher_id, spec, None, gate):  # its child has not got the grammar (now)
            self._call("open", matcher_id, spec, compiled.serialize_json(), gate)
        return matcher_id

    def drop(self, matcher_id: int) -> None:
        """Free a matcher (with the next request: called from a finaliser, it must not wait)."""
        self._dropped.append(matcher_id)

    def accept(self, pairs: Sequence[tuple[int, int]]) -> dict[int, str]:
        """Advance matchers by tokens, in order ((matcher id, token id) pairs; a matcher's tokens after its end
        or a rejection are ignored): TERMINATED or an error for each matcher that ended, by id."""
        return _merged(self._call("accept", pairs))

    def fill(self, slot: int, rows: Sequence[tuple[int, int]]) -> int:
        """The masks of these (row, matcher id) into `slot`'s entries 0..k-1 (their rows in self.rows[slot]; a
        matcher that does not constrain its next token gets an all-allowed mask): k."""
        self._call("step", [], [], slot, rows, (0.0, 0.0))
        return len(rows)

    def post_step(
        self,
        matcher_ids: Sequence[int],
        token_ids: Sequence[int],
        slot: int,
        rows: Sequence[tuple[int, int]],
        submitted_at: float,  # time.monotonic() when the engine thread handed the step over
    ) -> int:
        """A step's grammar work in one message, not waited for: `accept` of the pairs, then `fill`. Its ticket:
        `collect_step` gives the accept's outcomes."""
        return self._post("step", matcher_ids, token_ids, slot, rows, (submitted_at, time.monotonic()))

    def collect_step(self, ticket: int) -> dict[int, str]:
        return _merged(self.collect(ticket))

    def step_timings(self) -> dict[str, float]:
        """Medians over the steps so far, ms, of the slowest child: hand-over to post (the wait for the tokens and,
        on the mask worker, the GIL), post to the child's start, the child's work."""
        per_child: list[dict[str, float]] = self._call("step_timings")
        return {name: max(timings[name] for timings in per_child) for name in per_child[0]}

    def num_matchers(self) -> int:
        """How many matchers the children hold (after freeing the dropped ones)."""
        return sum(self._call("num_matchers"))

    def _call(self, *request: Any) -> list[Any]:
        return self.collect(self._post(*request))

    def _post(self, *request: Any) -> int:
        with self._send_lock:
            if self.closed:
                raise self._gone()
            dropped = []
            while self._dropped:  # (finalisers append from any thread: popleft never loses one)
                dropped.append(self._dropped.popleft())
            payload = ForkingPickler.dumps((dropped, request))
            try:
                for conn in self._conns:
                    conn.send_bytes(payload)
            except OSError as exc:
                self.closed = True  # some children got it, some not: their replies no longer line up
                raise self._gone() from exc
            ticket, self._num_posted = self._num_posted, self._num_posted + 1
            return ticket

    def collect(self, ticket: int) -> list[Any]:
        """Each child's reply to a posted request (replies come in order: earlier ones wait here for their
        posters)."""
        replies = []
        with self._receive_lock:
            for index, conn in enumerate(self._conns):
                waiting = self._replies[index]
                while ticket not in waiting:
                    try:
                        if not conn.poll(REPLY_TIMEOUT_S):
                            raise TimeoutError(f"no reply in {REPLY_TIMEOUT_S:.0f} s")
                        waiting[self._num_received[index]] = conn.recv()
                    except (EOFError, OSError) as exc:  # (TimeoutError is an OSError)
                        self.closed = True
                        raise self._gone() from exc
                    self._num_received[index] += 1
                replies.append(waiting.pop(ticket))
        for ok, reply in replies:
            if not ok:
                raise GrammarProcessError(f"the grammar process failed:\n{reply}")
        return [reply for _, reply in replies]

    def is_alive(self) -> bool:
        return not self.closed and all(child.poll() is None for child in self._children)

    def _gone(self) -> GrammarProcessError:
        codes = [child.poll() for child in self._children]
        return GrammarProcessError(f"a grammar process is gone (exit codes {codes})")

    def shutdown(self) -> None:
        self.closed = True
        for conn in self._conns:
            conn.close()  # the child's recv ends
        for child in self._children:
            try:
                child.wait(timeout=5)
            except subprocess.TimeoutExpired:
                child.kill()
        self._unpin()
        self._file.close()  # (the mapping stays while the mask views live)


def _merged(outcomes: list[dict[int, str]]) -> dict[int, str]:
    """The children's accept outcomes as one (each reports only the matchers it owns)."""
    merged: dict[int, str] = {}
    for part in outcomes:
        merged.update(part)
    return merged


def _unregister(pointer: int | None) -> None:
    if pointer is not None:
        torch.cuda.synchronize()  # an upload from the buffer may still be queued
        torch.cuda.cudart().cudaHostUnregister(pointer)


def _shared_file(size: int) -> Any:
    """An anonymous file of `size` bytes (gone when both processes close it)."""
    if hasattr(os, "memfd_create"):
        file = os.fdopen(os.memfd_create("pagedserve-grammar-masks"), "r+b")
    else:
        file = tempfile.TemporaryFile()  # noqa: SIM115 (returned open: the child maps it too)
    file.truncate(size)
    return file


def _size(shape: tuple[int, int, int]) -> int:
    slots, rows, words = shape
    return slots * rows * words * 4 + slots * rows * 8


def _views(buffer: mmap.mmap, shape: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The masks (int32 [slot, row, word]) and their rows (int64 [slot, row]) in one shared buffer."""
    slots, rows, words = shape
    flat = torch.frombuffer(buffer, dtype=torch.uint8)
    split = slots * rows * words * 4
    return flat[:split].view(torch.int32).view(shape), flat[split:].view(torch.int64).view(slots, rows)


def _check(error: Any) -> None:
    if int(error) != 0:
        raise RuntimeError(f"cudaHostRegister failed: {error}")


@dataclass(slots=True)
class _Matcher:
    matcher: Any  # xgrammar.GrammarMatcher
    gate: ReasoningGate | None
    stop_token_ids: frozenset[int]
    ended: bool = False  # completed or rejected: takes no more tokens, fills no mask

    @property
    def constrains_next(self) -> bool:
        return not self.ended and (self.gate is None or self.gate.is_open)


_UNKNOWN = _Matcher(None, None, frozenset(), ended=True)  # an id never opened here: its mask allows everything


class _Child:
    """A child's state: compiled grammars by spec (a bounded cache) and the matchers it owns (id % children)."""

    def __init__(
        self, tokenizer_info_json: str, threads: int, masks: torch.Tensor, rows: torch.Tensor, index: int, count: int
    ) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        self.tokenizer_info = xgr.TokenizerInfo.deserialize_json(tokenizer_info_json)
        self.masks, self.rows = masks, rows.numpy()  # (the masks go to xgrammar as a tensor)
        self.index, self.count = index, count
        self.grammars: OrderedDict[GrammarSpec, Any] = OrderedDict()
        self.matchers: dict[int, _Matcher] = {}
        self.timings: deque[tuple[float, float, float]] = deque(maxlen=10_000)  # seconds, per step (step_timings)
        self.fill_batch = xgr.BatchGrammarMatcher(max_threads=threads).batch_fill_next_token_bitmask

    def open(self, matcher_id: int, spec: GrammarSpec, serialized: str | None, gate: ReasoningGate | None) -> str:
        if matcher_id % self.count != self.index:
            return "another's"
        compiled = self.grammars.get(spec)
        if compiled is None:
            if serialized is None:
                return "missing"
            compiled = self.xgr.CompiledGrammar.deserialize_json(serialized, self.tokenizer_info)
            self.grammars[spec] = compiled
            while len(self.grammars) > CACHE_SIZE:
                self.grammars.popitem(last=False)
        self.grammars.move_to_end(spec)
        matcher = self.xgr.GrammarMatcher(compiled)
        self.matchers[matcher_id] = _Matcher(matcher, gate, frozenset(matcher.stop_token_ids))
        return "opened"

    def accept(self, pairs: Sequence[tuple[int, int]]) -> dict[int, str]:
        """As GrammarState.accept / accept_all, for the pairs whose matcher is this child's: the gated tokens pass
        free, the rest go to xgrammar in batches (one batch while no matcher appears twice: a replay's tokens go
        one call each)."""
        ended: dict[int, str] = {}
        batch: list[tuple[int, _Matcher, int]] = []
        in_batch: set[int] = set()
        count, index = self.count, self.index
        for matcher_id, token_id in pairs:
            if matcher_id % count != index:
                continue
            state = self.matchers.get(matcher_id)
            if state is None:  # never opened here: fail that grammar, not the step
                ended[matcher_id] = f"the grammar process holds no matcher {matcher_id}"
                continue
            if state.ended:
                continue
            if state.gate is not None:
                if not state.gate.is_open:  # still reasoning: free text
                    state.gate.feed(token_id)
                    continue
                state.gate = None  # open for good
            if matcher_id in in_batch:
                self._accept_batch(batch, ended)
                batch, in_batch = [], set()
                if state.ended:
                    continue
            batch.append((matcher_id, state, token_id))
            in_batch.add(matcher_id)
        self._accept_batch(batch, ended)
        return ended

    @staticmethod
    def _accept_batch(batch: list[tuple[int, _Matcher, int]], ended: dict[int, str]) -> None:
        if not batch:
            return
        accepted = batch_accept([state.matcher for _, state, _ in batch], [token_id for _, _, token_id in batch])
        for (matcher_id, state, token_id), ok in zip(batch, accepted, strict=True):
            if not ok:
                state.ended = True
                ended[matcher_id] = f"the grammar rejected token {token_id}"
            elif token_id in state.stop_token_ids and state.matcher.is_terminated():
                state.ended = True  # (without a stop token the matcher does not terminate)
                ended[matcher_id] = TERMINATED

    def fill(self, slot: int, rows: Sequence[tuple[int, int]]) -> None:
        """This child's entries of the step's fill list: each entry's row, and its mask at the entry's index (all
        allowed where the matcher does not constrain its next token)."""
        count, index, matchers = self.count, self.index, self.matchers
        mine = [
            (entry, row, matchers.get(matcher_id, _UNKNOWN))
            for entry, (row, matcher_id) in enumerate(rows)
            if matcher_id % count == index
        ]
        if not mine:
            return
        entries = [entry for entry, _, _ in mine]
        self.rows[slot, entries] = [row for _, row, _ in mine]
        constrained = [(entry, state.matcher) for entry, _, state in mine if state.constrains_next]
        if len(constrained) < len(mine):
            free = [entry for entry, _, state in mine if not state.constrains_next]
            self.masks[slot, free] = -1
        if constrained:
            self.fill_batch([m for _, m in constrained], self.masks[slot], [entry for entry, _ in constrained])

    def step(
        self,
        matcher_ids: Sequence[int],
        token_ids: Sequence[int],
        slot: int,
        rows: Sequence[tuple[int, int]],
        times: tuple[float, float],
    ) -> dict[int, str]:
        start = time.monotonic()
        ended = self.accept(list(zip(matcher_ids, token_ids, strict=True))) if matcher_ids else {}
        self.fill(slot, rows)
        submitted, posted = times
        if submitted:  # (a synchronous fill has no hand-over to time)
            self.timings.append((posted - submitted, start - posted, time.monotonic() - start))
        return ended

    def step_timings(self) -> dict[str, float]:
        columns = list(zip(*self.timings, strict=True)) or [(0.0,)] * 3
        names = ("handover_ms", "post_to_start_ms", "work_ms")
        return {name: round(1e3 * statistics.median(column), 3) for name, column in zip(names, columns, strict=True)}

    def num_matchers(self) -> int:
        return len(self.matchers)


def serve(conn: Connection, masks: torch.Tensor, rows: torch.Tensor, index: int, count: int) -> None:
    """A child's loop: a request, its reply, until the engine closes the pipe."""
    torch.set_num_threads(1)
    child: _Child | None = None
    while True:
        try:
            dropped, (name, *args) = conn.recv()
        except (EOFError, OSError):
            return
        try:
            if child is None:  # the first request: ("start", the tokenizer's xgrammar description, fill threads)
                child = _Child(args[0], args[1], masks, rows, index, count)
                reply: tuple[bool, Any] = (True, None)
            else:
                for matcher_id in dropped:
                    child.matchers.pop(matcher_id, None)
                reply = (True, getattr(child, name)(*args))
        except Exception:
            reply = (False, traceback.format_exc())
        conn.send(reply)


def main() -> None:
    sock_fd, file_fd, slots, rows, words, index, count = map(int, sys.argv[1:])
    buffer = mmap.mmap(file_fd, _size((slots, rows, words)))
    masks, row_ids = _views(buffer, (slots, rows, words))
    serve(Connection(sock_fd), masks, row_ids, index, count)


if __name__ == "__main__":
    main()
