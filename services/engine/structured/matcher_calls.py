"""xgrammar's batched accept with one GIL hand-back at most, instead of 2N + 2.

Since xgrammar 0.1.33 every call into its binding (apache-tvm-ffi) releases the GIL and takes it back. Beside the
engine thread, busy in Python between kernels, a take-back after more than a few tens of µs waits up to the switch
interval. xgrammar's own `BatchGrammarMatcher.batch_accept_token` then reads its result array one element at a
time, each read a call of its own: 2N + 1 more hand-backs for N rows. Beside a busy thread at a 0.5 ms interval,
128 rows took 2.6-4.5 ms on two CPU cores and 16.5 ms on an H200 host, where they take 0.11-0.30 ms alone
(bench/xgrammar_gil.py; bench/results/xgrammar_gil_cpu/, structured_gil_h200_2026-11-29/).

Here the result is read in one call that keeps the GIL, which asks whether any row rejected its token; only then
is it read row by row. The accept itself keeps the GIL through its C++ too (HOLD_GIL; 128 json_schema matchers:
~0.1-0.2 ms, less than one hand-back costs the worker). The mask fill, the step's long call, still releases it
once (mask_worker.py).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

# The accept's C++ keeps the GIL (the engine thread waits that long) rather than hand it back after (the worker
# waits up to a switch interval). Read at the first accept; bench/structured_throughput.py --accept-releases-gil.
HOLD_GIL = True


@functools.cache
def binding_accept() -> Any:
    """The binding's batched accept (a tvm-ffi Function), set to keep the GIL as HOLD_GIL says; None where
    xgrammar's binding is not tvm-ffi (before 0.1.33 its wrapper returned a list and released the GIL once)."""
    try:
        from xgrammar.matcher import _core
    except ImportError:
        return None
    accept = getattr(getattr(_core, "BatchGrammarMatcher", None), "batch_accept_token", None)
    if accept is None or not hasattr(accept, "release_gil"):
        return None
    accept.release_gil = not HOLD_GIL  # process-wide (xgrammar's wrapper too): its C++ never calls into Python
    try:  # the result's one read below: a C++ lookup of a few µs, never worth a hand-back
        from tvm_ffi import _ffi_api as containers

        contains: Any = containers.ArrayContains
        contains.release_gil = False
    except (ImportError, AttributeError):
        pass
    return accept


def batch_accept(matchers: Sequence[Any], token_ids: Sequence[int]) -> list[bool]:
    """Advance each matcher by its token: whether each accepted it (xgrammar's batched accept)."""
    accept = binding_accept()
    if accept is None:
        import xgrammar as xgr

        return list(xgr.BatchGrammarMatcher.batch_accept_token(list(matchers), list(token_ids)))
    result = accept([matcher._handle for matcher in matchers], list(token_ids), False)
    # One call (tvm-ffi's ArrayContains), the usual answer under a mask. The array holds ints: 0 is not found
    # among bools, so the test's rejected token guards this against a binding that returns bools.
    if 0 not in result:
        return [True] * len(matchers)
    return [bool(ok) for ok in result]
