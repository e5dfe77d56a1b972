"""xgrammar's batched accept with one GIL hand-back fewer than 2N + 2.

Since xgrammar 0.1.33 every call into its binding (apache-tvm-ffi) releases the GIL and takes it back. Beside the
engine thread, busy in Python between kernels, a take-back after more than a few tens of µs waits up to the switch
interval. xgrammar's own `BatchGrammarMatcher.batch_accept_token` then reads its result array one element at a
time, each read a call of its own: 2N + 1 more hand-backs for N rows. On two cores, at a 0.5 ms interval, beside a
busy thread, 128 rows took 1.4-3.6 ms where they take 0.17 ms alone (bench/xgrammar_gil.py).

Here the accept keeps the GIL through its C++ (128 json_schema matchers: ~0.1 ms, less than one hand-back costs
the worker) and its result is read in one call, which asks whether any row rejected its token; only then is it
read row by row. The mask fill, the step's long call, still releases the GIL (mask_worker.py).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any


@functools.cache
def held_accept() -> Any:
    """The binding's batched accept (a tvm-ffi Function), set to keep the GIL; None where xgrammar's binding is
    not tvm-ffi (before 0.1.33 its wrapper returned a list and released the GIL once)."""
    try:
        from xgrammar.matcher import _core
    except ImportError:
        return None
    accept = getattr(getattr(_core, "BatchGrammarMatcher", None), "batch_accept_token", None)
    if accept is None or not hasattr(accept, "release_gil"):
        return None
    accept.release_gil = False  # process-wide: xgrammar's own wrapper then holds it too, as it may
    return accept


def batch_accept(matchers: Sequence[Any], token_ids: Sequence[int]) -> list[bool]:
    """Advance each matcher by its token: whether each accepted it (xgrammar's batched accept)."""
    accept = held_accept()
    if accept is None:
        import xgrammar as xgr

        return list(xgr.BatchGrammarMatcher.batch_accept_token(list(matchers), list(token_ids)))
    result = accept([matcher._handle for matcher in matchers], list(token_ids), False)
    if 0 not in result:  # one call (tvm-ffi's ArrayContains; the array holds ints), the usual answer under a mask
        return [True] * len(matchers)
    return [bool(ok) for ok in result]
