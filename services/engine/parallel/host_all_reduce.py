"""The symmetric-memory all-reduce protocol on host tensors: what torch's CUDA kernels do, step for step,
in processes that share CPU memory. The CPU tests run it against gloo's all-reduce; the engine on CUDA
runs torch's kernels (custom_all_reduce.SymmMemTransport) on the same plan.

    buffers   one byte buffer per rank, every rank sees all of them (on CUDA: symm_mem.empty + rendezvous)
    pads      flags[w, w] int32: flags[r, p] is rank p's signal to rank r (on CUDA: the signal pads)

A barrier is torch's sync_remote_blocks: every rank raises its flag at each peer (after that flag was
consumed), then waits for each peer's flag to it and lowers it. Each flag has one raiser and one
lowerer, so plain stores suffice here; the kernels use atomics because many blocks share the pads.
"""

from __future__ import annotations

import os
import time

import torch

from pagedserve.services.engine.parallel.all_reduce_plan import VECTOR_BYTES, two_shot_chunk

_BARRIER_TIMEOUT_S = 30.0


class HostSymmetricMemory:
    def __init__(self, buffers: list[torch.Tensor], flags: torch.Tensor, rank: int) -> None:
        assert flags.shape == (len(buffers), len(buffers)) and flags.dtype == torch.int32
        self.buffers, self.flags, self.rank = buffers, flags, rank
        self.world_size = len(buffers)

    @staticmethod
    def allocate(world_size: int, nbytes: int) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Shared buffers and flags for `world_size` ranks (pass them to the ranks' processes)."""
        buffers = [torch.zeros(nbytes, dtype=torch.uint8).share_memory_() for _ in range(world_size)]
        return buffers, torch.zeros(world_size, world_size, dtype=torch.int32).share_memory_()

    def slot(self, rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        nbytes = numel * dtype.itemsize
        return self.buffers[rank][:nbytes].view(dtype)

    def barrier(self) -> None:
        deadline = time.monotonic() + _BARRIER_TIMEOUT_S
        for peer in range(self.world_size):
            if peer != self.rank:
                self._await(self.flags[peer, self.rank], 0, deadline)  # the previous signal was consumed
                self.flags[peer, self.rank] = 1
        for peer in range(self.world_size):
            if peer != self.rank:
                self._await(self.flags[self.rank, peer], 1, deadline)
                self.flags[self.rank, peer] = 0

    @staticmethod
    def _await(flag: torch.Tensor, value: int, deadline: float) -> None:
        while int(flag) != value:
            if time.monotonic() > deadline:
                raise TimeoutError("host all-reduce barrier: a peer did not arrive")
            os.sched_yield()

    def _sum_in_rank_order(self, numel: int, dtype: torch.dtype, start: int, end: int) -> torch.Tensor:
        acc = self.slot(0, numel, dtype)[start:end].clone()
        for peer in range(1, self.world_size):
            acc += self.slot(peer, numel, dtype)[start:end]  # rounded to dtype at each add, as the kernel
        return acc

    def one_shot_(self, tensor: torch.Tensor) -> None:
        flat, numel = tensor.view(-1), tensor.numel()
        self.slot(self.rank, numel, tensor.dtype).copy_(flat)
        self.barrier()  # every slot written
        flat.copy_(self._sum_in_rank_order(numel, tensor.dtype, 0, numel))
        self.barrier()  # no rank overwrites its slot while a peer still reads it

    def two_shot_(self, tensor: torch.Tensor) -> None:
        flat, numel, dtype = tensor.view(-1), tensor.numel(), tensor.dtype
        elems_per_vector = VECTOR_BYTES // tensor.element_size()
        self.slot(self.rank, numel, dtype).copy_(flat)
        self.barrier()
        start, end = two_shot_chunk(numel, self.world_size, self.rank, elems_per_vector)
        self.slot(self.rank, numel, dtype)[start:end] = self._sum_in_rank_order(numel, dtype, start, end)
        self.barrier()  # every chunk reduced
        for owner in range(self.world_size):
            start, end = two_shot_chunk(numel, self.world_size, owner, elems_per_vector)
            flat[start:end] = self.slot(owner, numel, dtype)[start:end]
        self.barrier()
