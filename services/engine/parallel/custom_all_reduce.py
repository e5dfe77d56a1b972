"""A custom all-reduce for tensor parallelism on one host: small messages over symmetric memory, NCCL above.

Decode steps all-reduce a few KB per layer (8B shape: 8 KB a token, twice a layer), where NCCL's
latency dominates. Here every rank maps every peer's buffer (torch symmetric memory, CUDA backend:
cuMem handles exchanged over a Unix socket) and torch's one-shot / two-shot kernels read the peers'
buffers directly, behind signal-pad barriers (all_reduce_plan says which; host_all_reduce is the same
protocol on CPU, for the tests).

No NVLink multicast: the kernels used read peers through plain P2P pointers, and
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 (set here before the buffer exists) makes the rendezvous skip
cuMulticastCreate. Graph-capturable: one buffer, allocated and exchanged at start-up; each call is one
or two kernels on the current stream with no host synchronization, so decode graphs capture them.
"""

from __future__ import annotations

import logging
import os
import socket
from collections import Counter
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import torch
import torch.distributed as dist

from pagedserve.services.engine.parallel.all_reduce_plan import Algorithm, AllReducePlan

log = logging.getLogger(__name__)
T = TypeVar("T")


class Transport(Protocol):
    def one_shot_(self, tensor: torch.Tensor) -> None: ...

    def two_shot_(self, tensor: torch.Tensor) -> None: ...


class CustomAllReduce:
    """Sums a tensor in place over the ranks when the plan picks a custom algorithm."""

    def __init__(self, transport: Transport, plan: AllReducePlan) -> None:
        self.transport, self.plan = transport, plan
        self.calls: Counter[Algorithm] = Counter()  # per algorithm (eager calls and graph captures)

    def reduce_(self, tensor: torch.Tensor) -> bool:
        """True when `tensor` now holds the sum; False: the caller all-reduces it with NCCL."""
        algorithm = self.plan.choose_for(tensor)
        self.calls[algorithm] += 1
        if algorithm is Algorithm.ONE_SHOT:
            self.transport.one_shot_(tensor)
        elif algorithm is Algorithm.TWO_SHOT:
            self.transport.two_shot_(tensor)
        return algorithm is not Algorithm.NCCL


class SymmMemTransport:
    """torch's symm_mem kernels on one byte buffer of `max_bytes` per rank."""

    def __init__(self, group: Any, device: torch.device, max_bytes: int) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        if getattr(symm_mem, "get_backend", lambda _: None)(device) not in (None, "CUDA"):
            symm_mem.set_backend("CUDA")  # NVSHMEM/NCCL backends bring their own setup; CUDA is P2P only
        self.buffer = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)
        symm_mem.rendezvous(self.buffer, group)  # collective: maps every peer's buffer and signal pad
        self.group_name = group.group_name
        self.ops = torch.ops.symm_mem

    def _slot(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.buffer[: tensor.numel() * tensor.element_size()].view(tensor.dtype)

    def one_shot_(self, tensor: torch.Tensor) -> None:
        # Copy in with its own kernel, not one_shot_all_reduce_copy_out's in-kernel copy: that kernel
        # signals peers with no __syncthreads() after the copy (torch's own "pattern 1" asks for one),
        # so a peer may read a slot a lagging warp has not written yet. The kernel boundary orders it.
        flat, slot = tensor.view(-1), self._slot(tensor)
        slot.copy_(flat)
        self.ops.one_shot_all_reduce_out(slot, "sum", self.group_name, flat)

    def two_shot_(self, tensor: torch.Tensor) -> None:
        flat, slot = tensor.view(-1), self._slot(tensor)
        slot.copy_(flat)
        self.ops.two_shot_all_reduce_out(slot, "sum", self.group_name, flat)


def _local_obstacle(device: torch.device, world_size: int) -> str | None:
    """Why this rank cannot join, or None."""
    if not all(hasattr(torch.ops.symm_mem, op) for op in ("one_shot_all_reduce_out", "two_shot_all_reduce_out")):
        return f"torch {torch.__version__} lacks the symm_mem all-reduce ops"
    return p2p_obstacle(device, world_size)


def p2p_obstacle(device: torch.device, world_size: int) -> str | None:
    """Why this rank cannot map its peers' memory (symmetric memory over P2P), or None."""
    for peer in range(world_size):
        if peer != device.index and not torch.cuda.can_device_access_peer(device.index or 0, peer):
            return f"cuda:{device.index} has no P2P access to cuda:{peer}"
    return None


def agree(group: Any, world_size: int, mine: Any) -> list[Any]:
    everyone: list[Any] = [None] * world_size
    dist.all_gather_object(everyone, mine, group=group)
    return everyone


def build_on_every_rank(ctx: Any, obstacle: str | None, build: Callable[[], T], off: str) -> T | None:
    """Every rank of `ctx` calls this with what keeps it from joining (or None); all get `build()`'s result
    (a symmetric-memory setup, collective over the ranks) or all None, whose reasons rank 0 logs once as
    "`off` (reasons)". One host only: peers map each other's memory over P2P."""
    answers = agree(ctx.step_group, ctx.world_size, (socket.gethostname(), obstacle))
    reasons = [a[1] for a in answers if a[1]]
    if len({a[0] for a in answers}) > 1:
        reasons.append("ranks on several hosts")
    built = None
    if not reasons:
        os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"  # never cuMulticastCreate (module docstring)
        failure = None
        try:
            built = build()
        except Exception as exc:  # an old driver, a container without the IPC socket, ...
            failure = f"symmetric memory setup failed on rank {ctx.rank}: {exc}"
        reasons = [r for r in agree(ctx.step_group, ctx.world_size, failure) if r]
    if reasons:
        if ctx.rank == 0:
            log.warning("%s (%s)", off, "; ".join(reasons))
        return None
    return built


def setup_custom_all_reduce(ctx: Any, max_bytes: int) -> CustomAllReduce | None:
    """Every rank of `ctx` (a ParallelContext on CUDA) calls this after init; all get one or all None.
    None means NCCL for every all-reduce; the reason is logged once, by rank 0."""
    transport = build_on_every_rank(
        ctx,
        _local_obstacle(ctx.device, ctx.world_size),
        lambda: SymmMemTransport(ctx.model_group, ctx.device, max_bytes),
        "custom all-reduce off: NCCL for every all-reduce",
    )
    if transport is None:
        return None
    plan = AllReducePlan.for_world(ctx.world_size, max_bytes)
    if ctx.rank == 0:
        log.info("custom all-reduce on: %s", plan.describe())
    return CustomAllReduce(transport, plan)
