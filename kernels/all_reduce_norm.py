"""One-shot all-reduce + residual add + RMSNorm in one kernel, over peers' symmetric buffers (tensor parallelism).

Every rank's row-parallel projection (o_proj, down_proj) writes its partial sum straight into its own
symmetric buffer (`buffer_ptrs[rank]`, mapped by every peer). Then, per token row:

    total    = sum over ranks r = 0..W-1 of buffer_r[row]     (fp32, rank order: every rank gets the same bits)
    residual = residual + round(total)                         (rounded to the storage dtype, as NCCL's sum is)
    out      = rmsnorm(residual) * weight                      (HF's rounding, as kernels/fused_norm.py)

This replaces, per all-reduce: a copy into the buffer (or NCCL's kernel), and the add + norm kernel.

Synchronization (torch symmetric memory's signal pads, CUDA-graph safe: every flag goes 0 -> 1 -> 0):
    start   each program signals program `pid` of every peer with release order and waits for theirs
            with acquire: every peer's partial (written by an earlier kernel) is visible.
    end     (END_BARRIER, a single buffer) after all its warps have read (bar.sync), each program signals and
            waits again: when this kernel ends, no peer still reads this rank's buffer, so the next projection
            may overwrite it.
Without the end barrier the caller alternates two halves of the buffer (`offset`), one round trip a call
instead of two: passing call c's start barrier means every peer has ended call c - 1, so when this rank's
projection for call c + 1 overwrites call c - 1's half, nobody reads it any more. Consecutive calls must use
different halves; where they cannot (an odd number of calls in a CUDA graph, replayed back to back),
`barrier` ends every peer's reads (parallel/partial_sums.py keeps that rule).
Only each program's first WORLD threads touch the flags; the block then meets at bar.sync.

The push protocol (`push_all_reduce_add_rms_norm`, opt-in: ParallelConfig.fused_all_reduce_push) needs no flags
and no read across NVLink. On 2 H200s it was no faster where it matters (graphs of 20 calls: 4.53 against 4.87 us
at 1 row, 18.2 against 12.1 at 256 rows, where a program's rows wait one after another; 8B TP=2 ITL 2.587
against 2.590 ms: bench/results/fused_push_h200x2_2026-11-28/), so pull stays the default. Each buffer also
holds, per half, an inbox with a slot per rank. A call:
    push    each rank stores its partial into its slot of every peer's inbox (posted stores: one one-way trip);
    poll    it reads its own inbox (volatile loads, past L1) until no element is EMPTY (all bits set, a NaN
            pattern: a partial's own such NaN is sent as another NaN), so the data is its own flag;
    empty   it sets the slots it read back to EMPTY, then sums in rank order, adds and normalizes as above.
A half's inbox is next written two calls later, by peers that have passed the call between, which needed this
rank's push of it, made after this call ended: so it is empty again by then. Consecutive calls alternate halves
as in the pull protocol (and the same barrier kernel ends an odd count).

No NVLink multicast: peers are read (or written) through plain P2P pointers. World sizes of 2, 4 and 8 (a power
of two: the flag lanes are a tl.arange).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels import pdl
from pagedserve.kernels.fused_norm import rms_norm_row
from pagedserve.kernels.launch_config import next_power_of_2
from pagedserve.kernels.pdl import prologue

MAX_PROGRAMS = 64  # signal-pad slots used: MAX_PROGRAMS * world_size flags (torch's pad holds 2304)

_PUT_RELEASE = """
{
    .reg .u32 %tmp32_<1>;
    .reg .pred %p<1>;
    put_signal:
        atom.global.release.sys.cas.b32 %tmp32_0, [$1], 0, 1;
        setp.eq.u32 %p0, %tmp32_0, 0;
        @!%p0 bra put_signal;
}
"""
_PUT_RELAXED = tl.constexpr(_PUT_RELEASE.replace(".release.", ".relaxed."))
_PUT_RELEASE = tl.constexpr(_PUT_RELEASE)
_WAIT_ACQUIRE = """
{
    .reg .u32 %tmp32_<1>;
    .reg .pred %p<1>;
    wait_signal:
        atom.global.sys.acquire.cas.b32 %tmp32_0, [$1], 1, 0;
        setp.eq.u32 %p0, %tmp32_0, 1;
        @!%p0 bra wait_signal;
}
"""
_WAIT_RELAXED = tl.constexpr(_WAIT_ACQUIRE.replace(".acquire.", ".relaxed."))
_WAIT_ACQUIRE = tl.constexpr(_WAIT_ACQUIRE)


@triton.jit
def _thread_index():
    return tl.inline_asm_elementwise("mov.u32 $0, %tid.x;", "=r", [], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _sync_threads():
    tl.inline_asm_elementwise("bar.sync 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _barrier(signal_pad_ptrs, pid, RANK: tl.constexpr, WORLD: tl.constexpr, ORDERED: tl.constexpr):
    """Program `pid` of every rank meets; ORDERED: release/acquire (peers' earlier writes become visible)."""
    ranks = tl.arange(0, WORLD)
    pads = signal_pad_ptrs.to(tl.pointer_type(tl.uint64))
    peer_pads = tl.load(pads + ranks).to(tl.pointer_type(tl.uint32))
    own_pad = tl.load(pads + RANK).to(tl.pointer_type(tl.uint32))
    send = peer_pads + pid * WORLD + RANK  # my flag in every peer's pad
    wait = own_pad + pid * WORLD + ranks  # every peer's flag in mine
    if _thread_index() < WORLD:
        if ORDERED:
            tl.inline_asm_elementwise(_PUT_RELEASE, "=r, l", [send], dtype=tl.int32, is_pure=False, pack=1)
            tl.inline_asm_elementwise(_WAIT_ACQUIRE, "=r, l", [wait], dtype=tl.int32, is_pure=False, pack=1)
        else:
            tl.inline_asm_elementwise(_PUT_RELAXED, "=r, l", [send], dtype=tl.int32, is_pure=False, pack=1)
            tl.inline_asm_elementwise(_WAIT_RELAXED, "=r, l", [wait], dtype=tl.int32, is_pure=False, pack=1)
    _sync_threads()


@triton.jit
def _add_norm_row(total, residual_ptrs, out_ptrs, mask, w, eps, HIDDEN: tl.constexpr):
    """One row's finish (module docstring): residual += total rounded to its dtype, out = rmsnorm(residual) * w."""
    dtype = residual_ptrs.dtype.element_ty
    res = tl.load(residual_ptrs, mask=mask, other=0.0)
    s = (total.to(dtype).to(tl.float32) + res.to(tl.float32)).to(dtype)
    tl.store(residual_ptrs, s, mask=mask)
    tl.store(out_ptrs, rms_norm_row(s, w, eps, HIDDEN, dtype), mask=mask)


@triton.jit
def _all_reduce_add_rms_norm_kernel(
    buffer_ptrs,  # [WORLD] int64: every rank's symmetric buffer, each holding a [num_rows, HIDDEN] partial
    signal_pad_ptrs,  # [WORLD] int64: every rank's signal pad
    offset,  # elements: where the partials start in every buffer (the same on every rank)
    residual_ptr,  # [num_rows, HIDDEN] in: the residual stream, out: residual + sum
    weight_ptr,  # [HIDDEN]
    out_ptr,  # [num_rows, HIDDEN]: rmsnorm(residual + sum) * weight
    num_rows,
    stride_residual,
    stride_out,
    eps,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    END_BARRIER: tl.constexpr,  # False: the caller alternates buffer halves (module docstring)
    USE_PDL: tl.constexpr,  # programmatic dependent launch (kernels/pdl.py)
):
    prologue(USE_PDL)
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    dtype = residual_ptr.dtype.element_ty
    _barrier(signal_pad_ptrs, pid, RANK, WORLD, True)
    bufs = buffer_ptrs.to(tl.pointer_type(tl.uint64))
    offs = tl.arange(0, BLOCK)
    mask = offs < HIDDEN
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    for row in range(pid, num_rows, num_programs):
        row64 = row.to(tl.int64)  # type: ignore[attr-defined]  # a tensor inside the jit
        total = tl.zeros([BLOCK], dtype=tl.float32)
        for r in tl.static_range(WORLD):
            part = tl.multiple_of(tl.load(bufs + r).to(tl.pointer_type(dtype)), 16) + offset  # page-aligned
            # plain loads: L1 starts every kernel empty, so no stale peer line survives from the last call
            total += tl.load(part + row64 * HIDDEN + offs, mask=mask, other=0.0).to(tl.float32)
        residual_row, out_row = residual_ptr + row64 * stride_residual + offs, out_ptr + row64 * stride_out + offs
        _add_norm_row(total, residual_row, out_row, mask, w, eps, HIDDEN)
    if END_BARRIER:
        # Every warp of this program is done reading the peers before the flag says so (a fast warp holding
        # the flags must not signal while a slower one still reads: the peer would overwrite its buffer).
        _sync_threads()
        _barrier(signal_pad_ptrs, pid, RANK, WORLD, False)


@triton.jit
def _push_all_reduce_add_rms_norm_kernel(
    buffer_ptrs,  # [WORLD] int64: every rank's symmetric buffer
    offset,  # elements: this rank's [num_rows, HIDDEN] partial in its own buffer
    inbox,  # elements: where the peers' copies land in every buffer, rank r's at inbox + r * slot
    slot,  # elements between two ranks' copies
    residual_ptr,
    weight_ptr,
    out_ptr,
    num_rows,
    stride_residual,
    stride_out,
    eps,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    BITS: tl.constexpr,  # the dtype's width: its elements move as ints of that width
    USE_PDL: tl.constexpr,
):
    """The push protocol (module docstring): each rank stores its partial into every peer's inbox, then
    polls its own inbox until no element is EMPTY (all bits set) any more, sums in rank order, and empties
    its inbox again for this half's next call."""
    prologue(USE_PDL)
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    dtype = residual_ptr.dtype.element_ty
    bits = tl.int16 if BITS == 16 else tl.int32
    empty: tl.constexpr = -1  # all bits set: a NaN pattern no partial sends (its NaNs go as NAN)
    nan: tl.constexpr = 0x7FFF if BITS == 16 else 0x7FFFFFFF
    bufs = buffer_ptrs.to(tl.pointer_type(tl.uint64))
    own = tl.load(bufs + RANK).to(tl.pointer_type(bits))
    offs = tl.arange(0, BLOCK)
    mask = offs < HIDDEN
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    for row in range(pid, num_rows, num_programs):
        row64 = row  # offsets stay far below 2**31: a buffer holds at most a few MiB
        mine = tl.load(own + offset + row64 * HIDDEN + offs, mask=mask, other=0)
        mine = tl.where(mine == empty, nan, mine)
        for r in tl.static_range(WORLD):
            if r != RANK:  # posted stores over NVLink: no round trip before the peer sees them
                peer = tl.load(bufs + r).to(tl.pointer_type(bits))
                tl.store(peer + inbox + RANK * slot + row64 * HIDDEN + offs, mine, mask=mask)
        total = tl.zeros([BLOCK], dtype=tl.float32)
        for r in tl.static_range(WORLD):
            if r == RANK:
                got = mine
            else:
                box = own + inbox + r * slot + row64 * HIDDEN + offs
                got = tl.load(box, mask=mask, other=0, volatile=True)
                while tl.max((got == empty).to(tl.int32), axis=0) > 0:  # past L1: the peer's stores land in L2
                    got = tl.load(box, mask=mask, other=0, volatile=True)
                tl.store(box, tl.full([BLOCK], empty, bits), mask=mask)
            total += got.to(dtype, bitcast=True).to(tl.float32)
        residual_row, out_row = residual_ptr + row64 * stride_residual + offs, out_ptr + row64 * stride_out + offs
        _add_norm_row(total, residual_row, out_row, mask, w, eps, HIDDEN)


@triton.jit
def _barrier_kernel(signal_pad_ptrs, RANK: tl.constexpr, WORLD: tl.constexpr, USE_PDL: tl.constexpr):
    """Every peer meets here once its kernels before have ended (and so every read of the buffers)."""
    prologue(USE_PDL)
    _barrier(signal_pad_ptrs, 0, RANK, WORLD, True)


def all_reduce_add_rms_norm(
    buffer_ptrs: torch.Tensor,  # [world] int64 on the device (torch symmetric memory's buffer_ptrs_dev)
    signal_pad_ptrs: torch.Tensor,  # [world] int64 on the device (signal_pad_ptrs_dev)
    rank: int,
    world_size: int,
    residual: torch.Tensor,  # [num_rows, hidden]: updated in place to residual + the sum
    weight: torch.Tensor,  # [hidden]
    eps: float,
    offset: int = 0,  # elements: where every rank's partial starts in its buffer
    end_barrier: bool = True,  # False: the next call's partial goes to the other half (module docstring)
) -> torch.Tensor:  # rmsnorm(residual + sum) * weight, a new tensor
    """Every rank calls this with the same shapes after writing its [num_rows, hidden] partial (residual's
    dtype, contiguous) at `offset` in its symmetric buffer."""
    num_rows, hidden = residual.shape
    assert residual.stride(1) == 1 and weight.shape == (hidden,)
    assert world_size in (2, 4, 8), world_size
    out = torch.empty_like(residual)
    if num_rows == 0:
        return out
    block = next_power_of_2(hidden)
    _all_reduce_add_rms_norm_kernel[(min(num_rows, MAX_PROGRAMS),)](
        buffer_ptrs,
        signal_pad_ptrs,
        offset,
        residual,
        weight,
        out,
        num_rows,
        residual.stride(0),
        out.stride(0),
        eps,
        RANK=rank,
        WORLD=world_size,
        HIDDEN=hidden,
        BLOCK=block,
        num_warps=min(16, max(4, block // 256)),
        END_BARRIER=end_barrier,
        **pdl.launch(residual.device),
    )
    return out


def push_all_reduce_add_rms_norm(
    buffer_ptrs: torch.Tensor,  # [world] int64 on the device
    rank: int,
    world_size: int,
    residual: torch.Tensor,  # [num_rows, hidden]: updated in place to residual + the sum
    weight: torch.Tensor,
    eps: float,
    offset: int,  # elements: this rank's partial in its own buffer
    inbox: int,  # elements: the start of every buffer's inbox for this call (peer r's copy at inbox + r * slot)
    slot: int,  # elements
) -> torch.Tensor:  # rmsnorm(residual + sum) * weight
    """The push protocol's call: every rank with the same shapes, its partial written at `offset`, its inbox
    for this call empty (all bits set), as `EMPTY_BYTE` fills it and each call leaves it."""
    num_rows, hidden = residual.shape
    assert residual.stride(1) == 1 and weight.shape == (hidden,) and residual.element_size() in (2, 4)
    out = torch.empty_like(residual)
    if num_rows == 0:
        return out
    block = next_power_of_2(hidden)
    _push_all_reduce_add_rms_norm_kernel[(min(num_rows, MAX_PROGRAMS),)](
        buffer_ptrs,
        offset,
        inbox,
        slot,
        residual,
        weight,
        out,
        num_rows,
        residual.stride(0),
        out.stride(0),
        eps,
        RANK=rank,
        WORLD=world_size,
        HIDDEN=hidden,
        BLOCK=block,
        BITS=8 * residual.element_size(),
        num_warps=min(16, max(4, block // 256)),
        **pdl.launch(residual.device),
    )
    return out


EMPTY_BYTE = 0xFF  # an inbox's bytes between calls: every element's bits set, whatever its dtype


def barrier(signal_pad_ptrs: torch.Tensor, rank: int, world_size: int, device: torch.device) -> None:
    """Returns at once; on the stream, every rank's kernels after it start once every peer's before it ended."""
    _barrier_kernel[(1,)](signal_pad_ptrs, RANK=rank, WORLD=world_size, num_warps=1, **pdl.launch(device))


def all_reduce_add_rms_norm_reference(
    partials: list[torch.Tensor], residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:  # (normed, new residual): what every rank's kernel computes
    total = torch.zeros(partials[0].shape, dtype=torch.float32, device=partials[0].device)
    for part in partials:  # rank order
        total += part.float()
    s = (total.to(residual.dtype).float() + residual.float()).to(residual.dtype)
    h = s.float()
    normed = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(residual.dtype)
    return (normed.float() * weight.float()).to(residual.dtype), s
