"""Sharding without a process group: head partitions, and each rank's loaded slices of a checkpoint.

Loading touches no collective, so one process can build every rank's shard of a tiny checkpoint
and check it against the full model's weights, and that Llama-family tensors are read with
safetensors `get_slice` only (never whole).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedserve.services.engine.models import load_model
from pagedserve.services.engine.parallel.linear import attention_parts
from pagedserve.services.engine.parallel.state import ParallelContext
from tests.engine.engine_helpers import WholeReads

CPU = torch.device("cpu")


def _ctx(rank: int, world: int) -> ParallelContext:
    return ParallelContext(rank, world, CPU)  # no groups: enough for building and loading


def _heads(num_heads: int, num_kv: int, world: int) -> list[tuple[list[int], list[int]]]:
    """Per rank: (query heads, KV heads) as head indexes."""
    out = []
    for rank in range(world):
        q, kv = attention_parts(num_heads, num_kv, 1, _ctx(rank, world))
        out.append((list(range(q.start, q.start + q.size)), list(range(kv.start, kv.start + kv.size))))
    return out


@pytest.mark.parametrize(
    ("num_heads", "num_kv", "world"),
    [(32, 8, 2), (32, 8, 16), (9, 3, 2), (71, 1, 2), (64, 8, 8), (4, 4, 2), (64, 8, 4)],
)
def test_every_query_head_sits_with_its_kv_head_exactly_once(num_heads: int, num_kv: int, world: int) -> None:
    parts = _heads(num_heads, num_kv, world)
    group = num_heads // num_kv
    assert sorted(h for q, _ in parts for h in q) == list(range(num_heads))  # each query head once
    assert {h for _, kv in parts for h in kv} == set(range(num_kv))  # every KV head somewhere
    for q, kv in parts:
        assert q and kv
        assert {h // group for h in q} <= set(kv)  # a rank holds the KV heads its query heads read
        local_group = len(q) // len(kv)
        assert all(kv[i // local_group] == h // group for i, h in enumerate(q))  # local GQA mapping holds


def test_fewer_kv_heads_than_ranks_replicates_them() -> None:
    parts = _heads(32, 8, 16)
    assert [kv for _, kv in parts] == [[i // 2] for i in range(16)]
    assert all(len(q) == 2 for q, _ in parts)


def test_uneven_kv_split_is_allowed_but_unreplicable_heads_are_refused() -> None:
    assert [len(kv) for _, kv in _heads(32, 8, 3)] == [2, 3, 3]
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        attention_parts(6, 2, 1, _ctx(0, 3))  # 2 KV heads cannot be replicated evenly over 3 ranks
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        attention_parts(2, 1, 1, _ctx(0, 4))  # fewer query heads than ranks


def test_rank_shards_are_slices_of_the_full_weights(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    full = dict(load_model(tiny_model_dir, "float32", CPU, show_progress=False).named_parameters())
    whole = WholeReads(monkeypatch)
    shards = [
        dict(load_model(tiny_model_dir, "float32", CPU, show_progress=False, parallel=_ctx(rank, 2)).named_parameters())
        for rank in range(2)
    ]
    assert whole.names == []  # Llama tensors: get_slice only

    def joined(name: str, dim: int) -> torch.Tensor:
        return torch.cat([s[name] for s in shards], dim=dim)

    layer = "model.layers.1."
    for name in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):  # row-parallel: input columns split
        assert torch.equal(joined(layer + name, 1), full[layer + name])
    qkv = full[layer + "self_attn.qkv_proj.weight"]  # [q 64 | k 32 | v 32] rows, 4 q / 2 kv heads of 16
    q, k, v = qkv.split([64, 32, 32])
    for rank, shard in enumerate(shards):
        rows = shard[layer + "self_attn.qkv_proj.weight"]
        expected = torch.cat(
            [q[rank * 32 : (rank + 1) * 32], k[rank * 16 : (rank + 1) * 16], v[rank * 16 : (rank + 1) * 16]]
        )
        assert torch.equal(rows, expected)
    gate, up = full[layer + "mlp.gate_up_proj.weight"].split(128)
    assert torch.equal(shards[1][layer + "mlp.gate_up_proj.weight"], torch.cat([gate[64:], up[64:]]))
    assert torch.equal(joined("model.embed_tokens.weight", 0), full["model.embed_tokens.weight"])
    assert torch.equal(shards[0]["model.norm.weight"], full["model.norm.weight"])  # replicated
