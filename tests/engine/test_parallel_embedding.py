"""Vocabulary-parallel embedding and logits on small tensors, every rank in this one process: a stand-in
context plays the collectives (the test sums the ranks' embeddings as the all-reduce would, and hands
each rank's logits slice to the all-gather), so ranks' rows, zero padding and the final cut are checked
against the unsharded embedding."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F

from pagedserve.services.engine.parallel.embedding import LogitsGather, VocabParallelEmbedding
from pagedserve.services.engine.parallel.state import single_rank

HIDDEN = 8


@dataclass
class Collectives:
    """A ParallelContext whose all-reduce leaves the rank's part as it is (the test adds the parts up) and
    whose all-gather joins `gathered`, every rank's slice in rank order."""

    rank: int
    world_size: int
    gathered: list[torch.Tensor] = field(default_factory=list)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def all_gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor:
        assert torch.equal(self.gathered[self.rank], tensor)
        return torch.cat(self.gathered, dim=-1)


def full_weight(vocab: int) -> torch.Tensor:
    return torch.randn(vocab, HIDDEN, generator=torch.Generator().manual_seed(vocab))


def load_ranks(vocab: int, world: int) -> tuple[list[VocabParallelEmbedding], list[tuple[int, int, int]]]:
    """Each rank's embedding, loaded from the full weight; and the (dim, start, size) reads it made."""
    weight, reads = full_weight(vocab), []

    def read(dim: int, start: int, size: int) -> torch.Tensor:
        reads.append((dim, start, size))
        return weight.narrow(dim, start, size)

    ranks = []
    for rank in range(world):
        emb = VocabParallelEmbedding(vocab, HIDDEN, Collectives(rank, world))
        emb.weight.data.fill_(float("nan"))  # as torch.empty may leave it: padding must not keep it
        assert emb.full_pieces("weight") == [(None, (vocab, HIDDEN))]  # random weights are made whole
        emb.load_piece("weight", None, read)
        ranks.append(emb)
    return ranks, reads


@pytest.mark.parametrize(("vocab", "world"), [(12, 2), (10, 3), (5, 4), (7, 1)])
def test_each_rank_holds_its_rows_and_zero_padding(vocab: int, world: int) -> None:
    ranks, reads = load_ranks(vocab, world)
    per_rank = -(-vocab // world)
    weight = full_weight(vocab)
    assert all(emb.weight.shape == (per_rank, HIDDEN) for emb in ranks)
    assert reads == [(0, r * per_rank, n) for r, n in enumerate(emb.num_real_rows for emb in ranks) if n]
    assert sum(emb.num_real_rows for emb in ranks) == vocab
    joined = torch.cat([emb.weight.data for emb in ranks])
    assert torch.equal(joined[:vocab], weight)
    assert torch.equal(joined[vocab:], torch.zeros(world * per_rank - vocab, HIDDEN))  # padding, not garbage


@pytest.mark.parametrize(("vocab", "world"), [(12, 2), (10, 3), (5, 4)])
def test_the_ranks_embeddings_sum_to_the_full_lookup(vocab: int, world: int) -> None:
    ranks, _ = load_ranks(vocab, world)
    ids = torch.tensor([0, vocab - 1, 3 % vocab, 1, vocab - 1, 0])
    parts = [emb(ids) for emb in ranks]
    for emb, part in zip(ranks, parts):
        mine = (ids >= emb.vocab_start) & (ids < emb.vocab_start + emb.num_real_rows)
        assert torch.equal(part[~mine], torch.zeros_like(part[~mine]))  # others' tokens: zeros to the sum
    assert torch.equal(sum(parts), F.embedding(ids, full_weight(vocab)))
    assert torch.equal(ids, torch.tensor([0, vocab - 1, 3 % vocab, 1, vocab - 1, 0]))  # input left as it was


@pytest.mark.parametrize(("vocab", "world"), [(12, 2), (10, 3), (5, 4)])
def test_gathered_logits_drop_the_padding_columns(vocab: int, world: int) -> None:
    ranks, _ = load_ranks(vocab, world)
    hidden = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(0))
    slices = [hidden @ emb.weight.T for emb in ranks]  # what each rank's LM head computes
    for rank in range(world):
        ctx = Collectives(rank, world, slices)
        logits = LogitsGather(vocab, ctx)(slices[rank])
        assert logits.shape == (3, vocab)
        torch.testing.assert_close(logits, hidden @ full_weight(vocab).T)


def test_one_rank_is_the_plain_embedding_and_head() -> None:
    ctx = single_rank(torch.device("cpu"))
    emb = VocabParallelEmbedding(6, HIDDEN, ctx)
    emb.load_piece("weight", None, lambda dim, start, size: full_weight(6).narrow(dim, start, size))
    ids = torch.tensor([5, 0, 2])
    assert torch.equal(emb(ids), full_weight(6)[ids])
    logits = torch.randn(2, 6)
    assert torch.equal(LogitsGather(6, ctx)(logits), logits)
