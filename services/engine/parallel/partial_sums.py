"""Row-parallel outputs left unreduced in a symmetric buffer, summed by the next residual add + RMSNorm.

A tensor-parallel decoder layer ends both sublayers with a row-parallel projection whose all-reduce feeds
a residual add and an RMSNorm. Done apart, that is a copy into the all-reduce buffer (or NCCL's kernel)
plus the norm kernel, twice a layer. Here the projection's GEMM writes its partial sum straight into this
rank's symmetric buffer (`RowParallelLinear.forward_partial`), and `fused_ops.add_rms_norm`, seeing a
tensor that lives in that buffer (`owner_of`), finishes it with one kernel: sum over the peers' buffers,
residual add and RMSNorm (kernels/all_reduce_norm.py).

A partial is only meant for that norm: nothing else may read it (its values are this rank's addend), and
the partial after next overwrites it. Models ask for partials only where the norm follows directly.

Partials alternate between two halves of the buffer, so the kernel needs no barrier at its end (one round
trip between the GPUs a call instead of two; the argument is in kernels/all_reduce_norm.py). That holds
while consecutive calls use different halves, also from one CUDA graph replay to the next: every forward
runs inside `forward_pass`, which starts it on the first half and, after an odd number of calls, ends it
with a barrier kernel.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from pagedserve.services.engine.parallel.all_reduce_plan import default_one_shot_max_bytes
from pagedserve.services.engine.parallel.custom_all_reduce import build_on_every_rank, p2p_obstacle

log = logging.getLogger(__name__)

FUSED_WORLD_SIZES = (2, 4, 8)  # the kernel's flag lanes are a power-of-two arange
FUSED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

_active: list[SymmetricPartials] = []  # this process's buffers (one per tensor-parallel replica)


def half_size(max_bytes: int) -> int:
    """Bytes of each half: max_bytes rounded up to 256 (every dtype's rows start aligned)."""
    return -(-max_bytes // 256) * 256


def buffer_size(max_bytes: int, world_size: int, push: bool) -> int:
    """Bytes of each rank's buffer: two halves for its partials and, pushing, an inbox per half with a slot for
    each rank's copy."""
    return 2 * half_size(max_bytes) * (1 + (world_size if push else 0))


class SymmetricPartials:
    """One symmetric buffer per rank, two halves of `max_bytes` for partial sums (and, with `push`, the inboxes
    peers copy theirs into), and the kernel that finishes them."""

    def __init__(self, buffer: torch.Tensor, handle: Any, max_bytes: int, push: bool = False) -> None:
        self.buffer, self.max_bytes, self.push = buffer, max_bytes, push
        self.half_bytes = half_size(max_bytes)
        self.rank, self.world_size = int(handle.rank), int(handle.world_size)
        assert buffer.numel() >= buffer_size(max_bytes, self.world_size, push), (buffer.numel(), max_bytes)
        self.buffer_ptrs = handle.buffer_ptrs_dev  # [world] int64 on the device
        self.signal_pad_ptrs = handle.signal_pad_ptrs_dev
        self._start = buffer.data_ptr()
        self._half = 0  # where the next partial goes
        self.calls = 0  # finishes launched (eager calls and graph captures)
        self.barriers = 0  # barrier kernels launched by `settle`

    @classmethod
    def allocate(cls, group: Any, device: torch.device, max_bytes: int, push: bool = False) -> SymmetricPartials:
        """Collective over `group` (every rank, same max_bytes and push): its own buffer and signal pad, apart
        from the custom all-reduce's, so neither protocol's flags or slots meet the other's. Pushing, every
        inbox is emptied before any rank may copy into it."""
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem

        from pagedserve.kernels.all_reduce_norm import EMPTY_BYTE

        world_size = dist.get_world_size(group)
        buffer = symm_mem.empty(buffer_size(max_bytes, world_size, push), dtype=torch.uint8, device=device)
        handle = symm_mem.rendezvous(buffer, group)
        if push:
            buffer[2 * half_size(max_bytes) :].fill_(EMPTY_BYTE)
            torch.cuda.synchronize(device)
            dist.barrier(group)
        return cls(buffer, handle, max_bytes, push)

    def fits(self, num_rows: int, hidden: int, dtype: torch.dtype) -> bool:
        return 0 < num_rows * hidden * dtype.itemsize <= self.max_bytes and dtype in FUSED_DTYPES

    def slot(self, num_rows: int, hidden: int, dtype: torch.dtype) -> torch.Tensor:
        """Where this rank's next [num_rows, hidden] partial goes (the start of the half after the last one's)."""
        start = self._half * self.half_bytes
        return self.buffer[start : start + num_rows * hidden * dtype.itemsize].view(dtype).view(num_rows, hidden)

    def _half_of(self, x: torch.Tensor) -> int | None:
        if x.device != self.buffer.device:
            return None
        return {self._start: 0, self._start + self.half_bytes: 1}.get(x.data_ptr())

    def holds(self, x: torch.Tensor) -> bool:
        return self._half_of(x) is not None

    def settle(self) -> None:
        """Makes the next partial go to the first half. After an odd number of calls the last one used it, so
        a barrier kernel first waits until no peer still reads it."""
        if self._half == 1:
            self._barrier()
            self.barriers += 1
        self._half = 0

    def _barrier(self) -> None:
        from pagedserve.kernels.all_reduce_norm import barrier

        barrier(self.signal_pad_ptrs, self.rank, self.world_size, self.buffer.device)

    def finish_add_rms_norm(
        self, partial: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (rmsnorm(residual + sum) * weight, residual + sum)
        if residual.shape != partial.shape or residual.dtype != partial.dtype or not partial.is_contiguous():
            raise ValueError(
                f"a partial sum {tuple(partial.shape)} {partial.dtype} needs a residual of its shape and dtype,"
                f" got {tuple(residual.shape)} {residual.dtype}"
            )
        half = self._half_of(partial)
        assert half is not None, "not a partial of this buffer"
        self.calls += 1
        self._half = 1 - half
        return self._sum_add_norm(partial, residual, weight, eps, half), residual

    def _sum_add_norm(
        self, partial: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, half: int
    ) -> torch.Tensor:
        from pagedserve.kernels.all_reduce_norm import all_reduce_add_rms_norm, push_all_reduce_add_rms_norm

        size = partial.element_size()
        if self.push:  # inboxes after both halves: half h's at 2 * half_bytes + h * world * half_bytes
            inbox = (2 + half * self.world_size) * self.half_bytes
            return push_all_reduce_add_rms_norm(
                self.buffer_ptrs,
                self.rank,
                self.world_size,
                residual,
                weight,
                eps,
                offset=half * self.half_bytes // size,
                inbox=inbox // size,
                slot=self.half_bytes // size,
            )
        return all_reduce_add_rms_norm(
            self.buffer_ptrs,
            self.signal_pad_ptrs,
            self.rank,
            self.world_size,
            residual,
            weight,
            eps,
            offset=half * self.half_bytes // partial.element_size(),
            end_barrier=False,
        )


def register(partials: SymmetricPartials) -> None:
    _active.append(partials)


def unregister(partials: SymmetricPartials) -> None:
    if partials in _active:
        _active.remove(partials)


@contextmanager
def forward_pass() -> Iterator[None]:
    """Around every model forward, eager or captured in a CUDA graph (module docstring): its partials start
    on the first half, and it leaves the buffers ready for the next forward to do the same."""
    for partials in _active:
        partials.settle()  # a forward outside this block may have left an odd count
    yield
    for partials in _active:
        partials.settle()


def owner_of(x: torch.Tensor) -> SymmetricPartials | None:
    """The buffer `x` is an unreduced partial of, or None for an ordinary tensor."""
    for partials in _active:
        if partials.holds(x):
            return partials
    return None


def setup_partials(ctx: Any, max_bytes: int, push: bool = False) -> SymmetricPartials | None:
    """Every rank of `ctx` (a ParallelContext on CUDA) calls this after init; all get one or all None
    (None: row-parallel outputs are all-reduced as before; the reason is logged once, by rank 0).
    Partials above the one-shot limit for the world size (each rank reads all W buffers: 512 KiB at 4
    ranks, 256 KiB at 8, none at 2) go to NCCL: at 4 ranks, 256 decode rows (2 MiB) ran 2% slower fused."""
    obstacle = None
    if ctx.world_size not in FUSED_WORLD_SIZES:
        obstacle = f"it takes {'/'.join(map(str, FUSED_WORLD_SIZES))} ranks, not {ctx.world_size}"
    elif torch.version.hip is not None:
        obstacle = "its signal flags are NVIDIA PTX (ROCm build)"
    else:
        obstacle = p2p_obstacle(ctx.device, ctx.world_size)
    partials = build_on_every_rank(
        ctx,
        obstacle,
        lambda: SymmetricPartials.allocate(ctx.model_group, ctx.device, max_bytes, push),
        "fused all-reduce + RMSNorm off: NCCL, then the norm",
    )
    if partials is None:
        return None
    register(partials)
    partials.max_bytes = min(max_bytes, default_one_shot_max_bytes(ctx.world_size))
    if ctx.rank == 0:
        log.info(
            "fused all-reduce + residual add + RMSNorm on (%s), for partial sums up to %d bytes",
            "push" if push else "pull",
            partials.max_bytes,
        )
    return partials
