"""Programmatic dependent launch (PDL, sm_90 and later) for the kernels of a decode step.

A one-row decode step is a chain of ~10 short kernels a layer (norm, GEMV, rotary + KV write, attention,
GEMV, ...). Launched one after another, each starts only once the one before has ended and flushed, so
every kernel boundary costs a launch and a ramp-up of the HBM stream. Launched with `launch_pdl`, a kernel's
programs may start as soon as every program of the kernel before has called `gdc_launch_dependents` (or
ended); the CUDA graph capture keeps that as a programmatic edge.

The contract each kernel here keeps when USE_PDL is on (`prologue`):
    - before `gdc_wait` it reads only what no kernel of the step writes (weights), and writes nothing;
    - `gdc_wait` returns once the kernel before has ended and its writes are visible (and so, by
      induction, every kernel before it);
    - right after it, `gdc_launch_dependents` lets the next kernel's programs take free SM slots.
A kernel that breaks the chain (cuBLAS, a torch op) is simply launched as usual: the next PDL kernel waits for
it in `gdc_wait` like for any other.

Switched by `launch_config.set_pdl` (RunnerConfig.pdl, applied by the worker); the interpreter never uses it.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import torch
import triton
import triton.language as tl

from pagedserve.kernels.launch_config import pdl_enabled


@cache
def _supports(device_index: int) -> bool:
    """NVIDIA sm_90 and later (a ROCm build reports its own capability numbers and has no griddepcontrol)."""
    return torch.version.hip is None and torch.cuda.get_device_capability(device_index)[0] >= 9


def active(device: torch.device) -> bool:
    """Whether launches on `device` use PDL now: enabled, a CUDA device of sm_90 or later."""
    if not pdl_enabled() or device.type != "cuda":
        return False
    return _supports(device.index if device.index is not None else torch.cuda.current_device())


def launch_options(on: bool) -> dict[str, Any]:
    """A PDL kernel's launch keywords: its USE_PDL constexpr and, when on, `launch_pdl`, always together (the
    contract needs the wait whenever the launch lets the kernel start early; the interpreter takes no
    launch_pdl)."""
    return {"USE_PDL": True, "launch_pdl": True} if on else {"USE_PDL": False}


def launch(device: torch.device) -> dict[str, Any]:
    """`launch_options` for a launch on `device` now (`active`)."""
    return launch_options(active(device))


@triton.jit
def prologue(USE_PDL: tl.constexpr):
    """Waits for the kernel before, then lets the next one start (the module's contract)."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
