"""The custom all-reduce on CPU: its plan (which algorithm a message takes, how two-shot splits it) and
its buffer protocol (host_all_reduce: the steps of torch's symm-mem kernels on shared host tensors) in
forked ranks over gloo, against a torch reference and gloo's own all-reduce.

Every rank regenerates every rank's input from (case, rank) seeds, so the reference is the sum in rank
order in the message's dtype: the protocol must match it bit for bit, on every rank."""

from __future__ import annotations

import itertools
import socket
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pagedserve.services.engine.parallel.all_reduce_plan import (
    Algorithm,
    AllReducePlan,
    default_one_shot_max_bytes,
    two_shot_chunk,
)
from pagedserve.services.engine.parallel.custom_all_reduce import CustomAllReduce, build_on_every_rank
from pagedserve.services.engine.parallel.host_all_reduce import HostSymmetricMemory
from pagedserve.services.engine.parallel.state import ParallelContext

BUFFER_BYTES = 4096
PLAN_LIMITS = dict(max_bytes=2048, one_shot_max_bytes=256)  # small, so a few KB cover all three algorithms


# ---- the plan ---------------------------------------------------------------------------------------------


def test_plan_picks_one_shot_then_two_shot_then_nccl() -> None:
    plan = AllReducePlan(world_size=2, **PLAN_LIMITS)
    assert plan.choose(16, torch.bfloat16, 4096) is Algorithm.ONE_SHOT
    assert plan.choose(256, torch.float32, 4096) is Algorithm.ONE_SHOT
    assert plan.choose(272, torch.float32, 4096) is Algorithm.TWO_SHOT
    assert plan.choose(2048, torch.bfloat16, 4096) is Algorithm.TWO_SHOT
    assert plan.choose(2064, torch.bfloat16, 4096) is Algorithm.NCCL  # above max_bytes


def test_plan_sends_what_the_kernels_cannot_take_to_nccl() -> None:
    plan = AllReducePlan(world_size=2, **PLAN_LIMITS)
    assert plan.choose(64, torch.float16, 4096) is Algorithm.NCCL  # the kernels have bf16 and fp32 only
    assert plan.choose(0, torch.float32, 4096) is Algorithm.NCCL
    assert plan.choose(40, torch.bfloat16, 4096) is Algorithm.NCCL  # not whole 16-byte vectors
    assert plan.choose(64, torch.bfloat16, 4098) is Algorithm.NCCL  # misaligned start
    assert plan.choose(64, torch.bfloat16, 4096, contiguous=False) is Algorithm.NCCL
    # two_shot_all_reduce_out exists for 2, 4 and 8 ranks only: medium messages of 3 ranks go to NCCL
    assert AllReducePlan(world_size=3, **PLAN_LIMITS).choose(512, torch.float32, 0) is Algorithm.NCCL
    assert AllReducePlan(world_size=4, **PLAN_LIMITS).choose(512, torch.float32, 0) is Algorithm.TWO_SHOT


def test_default_plan_is_one_shot_for_two_ranks_up_to_the_limit() -> None:
    plan = AllReducePlan.for_world(2, 8 << 20)
    assert plan.choose(8 << 20, torch.bfloat16, 0) is Algorithm.ONE_SHOT
    assert plan.choose((8 << 20) + 16, torch.bfloat16, 0) is Algorithm.NCCL
    assert default_one_shot_max_bytes(4) > default_one_shot_max_bytes(8)
    assert AllReducePlan.for_world(8, 8 << 20).choose(1 << 20, torch.bfloat16, 0) is Algorithm.TWO_SHOT


@pytest.mark.parametrize("world_size", [2, 3, 4, 8])
@pytest.mark.parametrize("numel", [1, 7, 8, 37, 64, 1000, 4099])
def test_two_shot_chunks_tile_the_message_like_the_kernel(world_size: int, numel: int) -> None:
    vec = 8  # bf16 elements per 16-byte vector
    chunks = [two_shot_chunk(numel, world_size, r, vec) for r in range(world_size)]
    assert chunks[0][0] == 0 and chunks[-1][1] == numel
    assert all(a[1] == b[0] for a, b in itertools.pairwise(chunks))  # contiguous, no overlap
    per_rank = -(-numel // (vec * world_size)) * vec  # torch: round_up(numel, vec * world) / world
    assert all(end - start <= per_rank and (start % vec == 0 or start == end) for start, end in chunks)


# ---- the protocol, in forked ranks ----------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _inputs(case: int, numel: int, dtype: torch.dtype, world_size: int) -> list[torch.Tensor]:
    # Values of mixed magnitude: bf16 sums then depend on the order of the additions.
    gens = [torch.Generator().manual_seed(1000 * case + r) for r in range(world_size)]
    scales = [10.0 ** torch.randint(-2, 3, (numel,), generator=g) for g in gens]
    return [(torch.randn(numel, generator=g) * s).to(dtype) for g, s in zip(gens, scales)]


def _rank_order_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    acc = parts[0].clone()
    for part in parts[1:]:
        acc += part
    return acc


def _same_on_every_rank(result: torch.Tensor, world_size: int) -> bool:
    everyone = [torch.empty_like(result) for _ in range(world_size)]
    dist.all_gather(everyone, result)
    return all(torch.equal(everyone[0], other) for other in everyone[1:])


def _rank(
    rank: int, world_size: int, port: int, buffers: list[torch.Tensor], flags: torch.Tensor, body: Callable
) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        body(rank, world_size, HostSymmetricMemory(buffers, flags, rank))
    finally:
        dist.destroy_process_group()


def _run_ranks(world_size: int, body: Callable) -> None:
    buffers, flags = HostSymmetricMemory.allocate(world_size, BUFFER_BYTES)
    mp.start_processes(
        _rank, args=(world_size, _free_port(), buffers, flags, body), nprocs=world_size, start_method="fork"
    )


CASES = [  # (numel, dtype): one-shot, two-shot and NCCL sizes under PLAN_LIMITS, each dtype, an odd tail
    (8, torch.bfloat16),
    (64, torch.float32),
    (128, torch.bfloat16),
    (72, torch.float32),  # 288 bytes: two-shot, chunks of 36 and 36 elements
    (1000, torch.bfloat16),  # two-shot, 2000 bytes
    (200, torch.float32),  # two-shot, 800 bytes: chunks of 100 + 100
    (1024, torch.float32),  # 4096 bytes: NCCL (gloo here)
    (20, torch.float16),  # fp16: NCCL
    (21, torch.bfloat16),  # 42 bytes: not whole vectors, NCCL
]


def _through_parallel_context(rank: int, world_size: int, host: HostSymmetricMemory) -> None:
    custom = CustomAllReduce(host, AllReducePlan(world_size=world_size, **PLAN_LIMITS))
    ctx = ParallelContext(rank, world_size, torch.device("cpu"), dist.group.WORLD, custom_all_reduce=custom)
    for case, (numel, dtype) in enumerate(CASES * 2):  # twice: the barriers' flags are reused
        parts = _inputs(case, numel, dtype, world_size)
        mine = parts[rank].clone().view(numel // 4, 4) if numel % 4 == 0 else parts[rank].clone()
        result = ctx.all_reduce(mine)
        assert result is mine  # in place, whichever path took it
        algorithm = custom.plan.choose_for(mine)
        if algorithm is not Algorithm.NCCL:
            assert torch.equal(result.view(-1), _rank_order_sum(parts)), (case, numel, dtype, algorithm)
        assert _same_on_every_rank(result, world_size)
        gloo = parts[rank].clone()
        dist.all_reduce(gloo)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(result.view(-1).float(), gloo.float(), rtol=tol, atol=tol)
    assert custom.calls == {Algorithm.ONE_SHOT: 6, Algorithm.TWO_SHOT: 6, Algorithm.NCCL: 6}


def test_parallel_context_all_reduce_takes_the_custom_path_on_two_ranks() -> None:
    _run_ranks(2, _through_parallel_context)


def _protocol_directly(rank: int, world_size: int, host: HostSymmetricMemory) -> None:
    for case, numel in enumerate([1, 5, 37, 48, 1001]):  # sizes the plan refuses: the protocol still holds
        for dtype in (torch.bfloat16, torch.float32):
            parts = _inputs(case, numel, dtype, world_size)
            expected = _rank_order_sum(parts)
            for reduce_ in (host.one_shot_, host.two_shot_):
                mine = parts[rank].clone()
                reduce_(mine)
                assert torch.equal(mine, expected), (numel, dtype, reduce_.__name__)
                assert _same_on_every_rank(mine, world_size)


def test_one_shot_and_two_shot_protocols_on_three_ranks_with_uneven_chunks() -> None:
    _run_ranks(3, _protocol_directly)


def test_bf16_rank_order_matters_so_the_reference_is_meaningful() -> None:
    parts = _inputs(7, 4096, torch.bfloat16, 3)
    reversed_order = _rank_order_sum(parts[::-1])
    assert not torch.equal(_rank_order_sum(parts), reversed_order)


def _every_rank_or_none(rank: int, world_size: int, host: HostSymmetricMemory) -> None:
    ctx = SimpleNamespace(rank=rank, world_size=world_size, step_group=dist.group.WORLD)

    def fails_on_rank_0() -> int:
        if rank == 0:
            raise RuntimeError("no IPC socket")
        return rank

    assert build_on_every_rank(ctx, None, lambda: rank * 10, "off") == rank * 10
    assert build_on_every_rank(ctx, "no P2P" if rank == 1 else None, lambda: rank, "off") is None
    assert build_on_every_rank(ctx, None, fails_on_rank_0, "off") is None  # rank 1 built, yet gets None too


def test_symmetric_memory_setups_start_on_every_rank_or_on_none() -> None:
    _run_ranks(2, _every_rank_or_none)
