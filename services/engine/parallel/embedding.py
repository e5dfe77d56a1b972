"""Vocabulary-parallel embedding and LM head: each rank holds ceil(vocab / world) rows.

    rank r rows [r * per_rank, (r + 1) * per_rank) of the vocabulary; the last rank's tail past
    vocab_size is zero padding, cut off again after the logits are gathered.

Embedding: rows outside the rank's range look up row 0 and are zeroed, then one all-reduce sums the
ranks' (disjoint) contributions. Logits: each rank computes its slice, one all-gather joins them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.services.engine.parallel.linear import ReadSlice
from pagedserve.services.engine.parallel.state import ParallelContext


class VocabParallelEmbedding(nn.Module):
    """Also the LM head's weight holder (`compute_logits` reads `.weight`, tied or not)."""

    def __init__(self, vocab_size: int, hidden_size: int, ctx: ParallelContext) -> None:
        super().__init__()
        self.ctx = ctx
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.num_rows = -(-vocab_size // ctx.world_size)
        self.vocab_start = ctx.rank * self.num_rows
        self.num_real_rows = max(0, min(vocab_size - self.vocab_start, self.num_rows))
        self.weight = nn.Parameter(torch.empty(self.num_rows, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [num_tokens] -> [num_tokens, hidden]
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_real_rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.ctx.all_reduce(out)

    def full_pieces(self, param_name: str) -> list[tuple[str | None, tuple[int, ...]]]:
        return [(None, (self.vocab_size, self.hidden_size))]

    def load_piece(self, param_name: str, shard_id: str | None, read: ReadSlice) -> None:
        self.weight.data.zero_()
        if self.num_real_rows:
            self.weight.data[: self.num_real_rows].copy_(read(0, self.vocab_start, self.num_real_rows))


class LogitsGather:
    """Joins the ranks' vocabulary slices of the logits (called by `DecoderLM.compute_logits`)."""

    def __init__(self, vocab_size: int, ctx: ParallelContext) -> None:
        self.vocab_size, self.ctx = vocab_size, ctx

    def __call__(self, local_logits: torch.Tensor) -> torch.Tensor:  # [n, per_rank] -> [n, vocab_size]
        return self.ctx.all_gather_last_dim(local_logits)[:, : self.vocab_size]
