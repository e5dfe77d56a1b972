"""Which all-reduce a message takes, and how two-shot splits it: pure arithmetic, no devices.

    one-shot   every rank copies its input into its symmetric buffer; barrier; every rank reads all
               peers' buffers and sums them. One remote read of the whole message per peer, two
               barriers: the least latency, for small messages.
    two-shot   copy in; barrier; rank r sums chunk r of every peer's buffer and writes it back into its
               own buffer (reduce-scatter); barrier; every rank reads chunk s from rank s (all-gather).
               Each rank reads 2 (W-1)/W of the message instead of (W-1) messages: for medium sizes.
    nccl       everything else: large messages, dtypes or alignments the kernels do not take.

Both custom algorithms sum in rank order 0, 1, ..., W-1 on every rank (torch's `load_and_reduce` indexes
peers by rank, not by distance), so every rank gets the same bits.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

# torch's symm-mem kernels dispatch on these only (AT_DISPATCH_FLOAT_AND_BFLOAT16); fp16 goes to NCCL.
CUSTOM_DTYPES = (torch.float32, torch.bfloat16)
# two_shot_all_reduce_out is compiled for these world sizes only (DISPATCH_WORLD_SIZES_NO_DEFAULT).
TWO_SHOT_WORLD_SIZES = (2, 4, 8)
# The kernels move 16 bytes per thread per step; 16-byte aligned pointers and sizes keep every
# buffer (input, symmetric slot, output) on that one vector width.
VECTOR_BYTES = 16


class Algorithm(enum.Enum):
    ONE_SHOT = "one_shot"
    TWO_SHOT = "two_shot"
    NCCL = "nccl"


def default_one_shot_max_bytes(world_size: int) -> int:
    """Where two-shot starts paying (vLLM's custom all-reduce measurements: with 2 ranks both read
    the same bytes, so one-shot's single barrier wins at every size)."""
    if world_size <= 2:
        return 1 << 62
    return 512 << 10 if world_size <= 4 else 256 << 10


@dataclass(frozen=True, slots=True)
class AllReducePlan:
    world_size: int
    max_bytes: int  # larger messages: NCCL
    one_shot_max_bytes: int  # larger (up to max_bytes): two-shot where the world size has it

    @classmethod
    def for_world(cls, world_size: int, max_bytes: int) -> AllReducePlan:
        return cls(world_size, max_bytes, default_one_shot_max_bytes(world_size))

    def describe(self) -> str:
        one_shot = min(self.one_shot_max_bytes, self.max_bytes)
        if one_shot == self.max_bytes or self.world_size not in TWO_SHOT_WORLD_SIZES:
            return f"one-shot up to {one_shot} bytes, NCCL above"
        return f"one-shot up to {one_shot} bytes, two-shot up to {self.max_bytes}, NCCL above"

    def choose(self, nbytes: int, dtype: torch.dtype, address: int, contiguous: bool = True) -> Algorithm:
        if (
            nbytes == 0
            or nbytes > self.max_bytes
            or dtype not in CUSTOM_DTYPES
            or not contiguous
            or nbytes % VECTOR_BYTES
            or address % VECTOR_BYTES
        ):
            return Algorithm.NCCL
        if nbytes <= self.one_shot_max_bytes:
            return Algorithm.ONE_SHOT
        return Algorithm.TWO_SHOT if self.world_size in TWO_SHOT_WORLD_SIZES else Algorithm.NCCL

    def choose_for(self, tensor: torch.Tensor) -> Algorithm:
        return self.choose(
            tensor.numel() * tensor.element_size(), tensor.dtype, tensor.data_ptr(), tensor.is_contiguous()
        )


def two_shot_chunk(numel: int, world_size: int, rank: int, elems_per_vector: int) -> tuple[int, int]:
    """[start, end) of the elements rank `rank` reduces in two-shot: torch's two_shot_all_reduce_kernel
    rounds the message up to whole vectors per rank, so the last ranks' chunks may be short or empty."""
    per_rank = -(-numel // (elems_per_vector * world_size)) * elems_per_vector
    start = min(per_rank * rank, numel)
    return start, min(start + per_rank, numel)
