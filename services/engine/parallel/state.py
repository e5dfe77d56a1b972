"""The process groups of one tensor-parallel replica, and the collectives the sharded layers call.

Two groups:
  model  NCCL on CUDA, gloo on CPU, with the configured timeout: the all-reduces and all-gathers
         inside the forward pass (and the input-id broadcast of overlapped steps). A rank that dies
         mid-step makes the others fail within the timeout instead of hanging. On CUDA, small
         all-reduces may skip NCCL for the custom all-reduce over symmetric memory (custom_all_reduce.py),
         and row-parallel outputs for a sum inside the next RMSNorm (partial_sums.py).
  steps  gloo (host tensors), no practical timeout: rank 0 broadcasts each step's inputs on it, and
         an idle replica may wait there for hours. A dead peer still ends the wait (closed socket),
         and the workers also watch their parent process.
The symmetric-memory kernels (custom all-reduce, fused all-reduce + RMSNorm) spin on their peers' flags
with no timeout: a rank that dies mid-step leaves the others spinning until the process watchers (rank 0
for its workers, each worker for its parent) end the replica.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from pagedserve.services.engine.parallel.custom_all_reduce import CustomAllReduce, setup_custom_all_reduce
from pagedserve.services.engine.parallel.partial_sums import SymmetricPartials, setup_partials

if TYPE_CHECKING:
    from pagedserve.shared.config import ParallelConfig

_IDLE_TIMEOUT = datetime.timedelta(days=365)


@dataclass(slots=True)
class ParallelContext:
    rank: int
    world_size: int
    device: torch.device
    model_group: Any = None  # a ProcessGroup (None when world_size == 1)
    step_group: Any = None
    custom_all_reduce: CustomAllReduce | None = None  # small messages on one host; NCCL/gloo when None
    partials: SymmetricPartials | None = None  # row-parallel outputs summed inside the next RMSNorm

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum in place over the ranks (a no-op on one rank). Every rank must pass the same shape and
        dtype in the same order: the custom all-reduce's choice of algorithm depends on them."""
        if self.world_size == 1:
            return tensor
        if self.custom_all_reduce is None or not self.custom_all_reduce.reduce_(tensor):
            dist.all_reduce(tensor, group=self.model_group)
        return tensor

    def all_gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor:
        """[..., n] on each rank -> [..., world_size * n], rank order."""
        if self.world_size == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.model_group)
        return torch.cat(parts, dim=-1)

    def broadcast_from_driver(self, tensor: torch.Tensor) -> None:
        """Rank 0's `tensor` (on the model device) into every rank's, in place."""
        if self.world_size > 1:
            dist.broadcast(tensor, src=0, group=self.model_group)

    def agree_min(self, value: int) -> int:
        """The smallest of every rank's value (e.g. the KV blocks that fit on every GPU)."""
        if self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.step_group)
        return int(t.item())


def single_rank(device: torch.device) -> ParallelContext:
    return ParallelContext(0, 1, device)


def init_parallel(
    rank: int,
    world_size: int,
    init_method: str,
    device: torch.device,
    timeout_s: float,
    custom_all_reduce_max_bytes: int = 0,
    fused_all_reduce_max_bytes: int = 0,
    fused_all_reduce_push: bool = False,
) -> ParallelContext:
    """Join the replica's process groups (every rank calls this, in the same order). On CUDA with
    custom_all_reduce_max_bytes > 0, all-reduces up to that size take the custom all-reduce where the
    ranks allow it (one host, P2P between every pair); with fused_all_reduce_max_bytes > 0, Llama-family
    row-parallel outputs up to that size are summed inside the next RMSNorm (partial_sums.py)."""
    if device.type == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        init_method=init_method,
        world_size=world_size,
        rank=rank,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    step_group = dist.new_group(backend="gloo", timeout=_IDLE_TIMEOUT)
    ctx = ParallelContext(rank, world_size, device, dist.group.WORLD, step_group)
    # The first collective sets the communicator up; it must not happen inside a CUDA graph capture.
    warm = torch.ones(1, device=device)
    ctx.all_reduce(warm)
    assert int(warm.item()) == world_size, "tensor-parallel all-reduce check failed"
    if device.type == "cuda" and world_size > 1 and custom_all_reduce_max_bytes > 0:
        ctx.custom_all_reduce = setup_custom_all_reduce(ctx, custom_all_reduce_max_bytes)
    if device.type == "cuda" and world_size > 1 and fused_all_reduce_max_bytes > 0:
        ctx.partials = setup_partials(ctx, fused_all_reduce_max_bytes, fused_all_reduce_push)
    return ctx


def all_reduce_limits(parallel: ParallelConfig) -> tuple[int, int, bool]:
    """init_parallel's (custom_all_reduce_max_bytes, fused_all_reduce_max_bytes, fused_all_reduce_push) from the
    configuration (0: off); --disable-custom-all-reduce turns both off."""
    if parallel.disable_custom_all_reduce:
        return 0, 0, parallel.fused_all_reduce_push
    return parallel.custom_all_reduce_max_bytes, parallel.fused_all_reduce_max_bytes, parallel.fused_all_reduce_push


def shutdown_parallel() -> None:
    """Leave the groups. NCCL groups are left to process exit: destroying a communicator whose
    collectives were captured in CUDA graphs can hang (pytorch/pytorch#115388), and a tensor-parallel
    replica ends with its processes anyway."""
    if dist.is_initialized() and dist.get_backend() == "gloo":
        dist.destroy_process_group()
