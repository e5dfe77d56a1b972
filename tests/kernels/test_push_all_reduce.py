"""The fused all-reduce's push protocol (kernels/all_reduce_norm.py) run by real concurrent ranks on CPU: one
process per rank, each mapping every rank's buffer from shared memory (as symmetric memory maps its peers'),
the kernel under the Triton interpreter. Call after call over both halves, every rank must get the same bits,
the reference's sum exactly, and leave its inboxes empty (bit-for-bit against the CUDA reference runs on 2 GPUs:
bench/custom_all_reduce.py)."""

from __future__ import annotations

import multiprocessing as mp
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from pagedserve.kernels.all_reduce_norm import EMPTY_BYTE, all_reduce_add_rms_norm_reference

# The compiled kernel is checked on GPUs, bit for bit against the CUDA reference (bench/custom_all_reduce.py, 2 H200s:
# bench/results/fused_push_h200x2_2026-11-28/). There the machines' Triton (3.6) interprets `range(pid, ...)` with
# a one-element array and fails, so this interpreter test is CPU CI's (Triton >= 3.7, as pyproject requires).
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's test; GPUs run the compiled check")
ROWS, HIDDEN, CALLS = 3, 64, 3  # halves 0, 1, 0: a half's inbox is reused after it was emptied


def _half_bytes() -> int:
    return 256 * -(-(ROWS * HIDDEN * 4) // 256)


def _inputs(world: int, dtype: torch.dtype, call: int) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(call)
    parts = [torch.randn(ROWS, HIDDEN, generator=gen).to(dtype) for _ in range(world)]
    parts[0][0, :4] = -0.0  # a partial's -0.0 travels as itself
    residual = torch.randn(ROWS, HIDDEN, generator=gen).to(dtype)
    weight = torch.randn(HIDDEN, generator=gen).to(dtype)
    return parts, residual, weight


def _rank(rank: int, world: int, files: list[str], dtype: torch.dtype, results: Any) -> None:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton: this process runs the kernel on CPU
    from pagedserve.kernels.all_reduce_norm import push_all_reduce_add_rms_norm

    half = _half_bytes()
    size = 2 * half * (1 + world)
    buffers = [torch.from_file(f, shared=True, size=size, dtype=torch.uint8) for f in files]
    ptrs = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64)
    itemsize = torch.empty((), dtype=dtype).element_size()
    got = []
    for call in range(CALLS):
        h = call % 2
        parts, residual, weight = _inputs(world, dtype, call)
        buffers[rank][h * half : h * half + parts[rank].numel() * itemsize].view(dtype).view(ROWS, HIDDEN).copy_(
            parts[rank]
        )
        out = push_all_reduce_add_rms_norm(
            ptrs,
            rank,
            world,
            residual,
            weight,
            1e-5,
            offset=h * half // itemsize,
            inbox=(2 + h * world) * half // itemsize,
            slot=half // itemsize,
        )
        got.append((_bytes(out), _bytes(residual)))
    results.put((rank, got, bool((buffers[rank][2 * half :] == 0xFF).all())))


def _bytes(x: torch.Tensor) -> bytes:  # plain bytes through the queue: a tensor would travel as a shared handle
    return x.contiguous().view(torch.uint8).numpy().tobytes()


# Not bf16: the interpreter rounds float32 -> bf16 by truncation (the GPU check runs bf16, bit for bit).
@pytest.mark.parametrize(("world", "dtype"), [(2, torch.float16), (4, torch.float32)])
def test_every_rank_gets_the_reference_and_empties_its_inbox(
    world: int, dtype: torch.dtype, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    half = _half_bytes()
    files = []
    for rank in range(world):
        buffer = torch.zeros(2 * half * (1 + world), dtype=torch.uint8)
        buffer[2 * half :] = EMPTY_BYTE  # what SymmetricPartials.allocate does before any rank pushes
        path = tmp_path / f"rank{rank}.bin"
        path.write_bytes(buffer.numpy().tobytes())
        files.append(str(path))
    # Spawned ranks import this module (and the kernel) afresh: on a CUDA machine too they must interpret.
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    spawn = mp.get_context("spawn")
    results = spawn.Queue()
    ranks = [spawn.Process(target=_rank, args=(r, world, files, dtype, results)) for r in range(world)]
    for process in ranks:
        process.start()
    outcome = {}
    for _ in ranks:
        rank, got, emptied = results.get(timeout=120)
        outcome[rank] = (got, emptied)
    for process in ranks:
        process.join(timeout=30)
    for call in range(CALLS):
        parts, residual, weight = _inputs(world, dtype, call)
        want, want_residual = all_reduce_add_rms_norm_reference(parts, residual.clone(), weight, 1e-5)
        outs = {outcome[rank][0][call][0] for rank in range(world)}
        assert len(outs) == 1, call  # every rank the same bits (the sum in rank order)
        for rank in range(world):
            out, new_residual = outcome[rank][0][call]
            assert new_residual == _bytes(want_residual), (call, rank)  # the rounded sum + residual, exactly
            got = torch.frombuffer(bytearray(out), dtype=dtype).view(ROWS, HIDDEN)
            torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)  # the norm: numpy's rsqrt vs torch's
    assert all(emptied for _, emptied in outcome.values())
