"""EAGLE-3 drafting: a one-layer head reads the target's own hidden states and chains k greedy drafts.

The target keeps the residual stream entering three of its layers (`aux_hidden_layers`) in every step; the
runner hands them here (`take_hidden`), fused by the head's `fc` at once, and they wait per sequence until
its next draft. The head's entry at position j reads the token at j + 1 and the target's hidden state at j,
and predicts the token at j + 2 (the shift of vLLM's eagle.py):

    tokens   t0 t1 ... t(n-2) t(n-1)        (t(n-1): the last token, not computed by the target yet)
    head     j = p0..n-2: (t(j+1), h_j)  ->  d0 from the entry at n-2
             j = n-1 ...: (d(i-1), the head's own pre-norm output at j-1)  ->  d1 .. d(k-1)

p0 is where the head stopped last time (n - 1 then); the chained entries past it were written from drafts
and are simply overwritten by the next catch-up, as rejected draft slots are in the target's cache.

The head's K/V lives in a cache of its own with the target's block layout, addressed by the target's block
tables: the entry for position j sits in the slot of the target's token j, so prefix-cache hits and
preemption need nothing extra (a shared block's head entries were written by the sequence that filled it;
at a block's last position that entry read the next token of *that* sequence, which only costs acceptance).
The chain's slots past the last token are reserved before drafting (`reserve_slots`); with no room for
them a sequence drafts fewer tokens. Drafts are the head's argmax mapped to target ids through d2t: a
point mass, so the rejection sampler's one-hot draft distribution keeps sampling exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pagedserve.services.engine.attention import AttentionMetadata
from pagedserve.services.engine.kv_cache_manager import KVCacheManager
from pagedserve.services.engine.request import Request
from pagedserve.services.engine.scheduler import ScheduledRequest
from pagedserve.services.engine.spec_decode.eagle3_head import Eagle3Head


@dataclass(slots=True)
class _Pending:
    """A sequence's fused target hidden states the head has not read yet: positions start .. start + len - 1."""

    request: Request
    start: int
    hidden: torch.Tensor  # [num_positions, head hidden]


class Eagle3Proposer:
    def __init__(
        self,
        head: Eagle3Head,
        kv_cache: KVCacheManager,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.head = head
        self.kv_cache_manager = kv_cache
        self.block_size = block_size
        self.device = device
        cfg = head.cfg
        self.kv_cache = torch.zeros(
            (2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim), dtype=dtype, device=device
        )
        self._pending: dict[str, _Pending] = {}  # seq_id -> what the head reads next

    def take_hidden(self, scheduled: Sequence[ScheduledRequest], aux: list[torch.Tensor]) -> None:
        """The runner's hook after each target forward: keep each sequence's fused hidden states by position."""
        num_rows = sum(s.num_new_tokens for s in scheduled)
        fused = self.head.fc(torch.cat(aux, dim=-1)[:num_rows])  # [num_rows, head hidden]
        row = 0
        for s in scheduled:
            rows, row = fused[row : row + s.num_new_tokens], row + s.num_new_tokens
            if s.request.grammar is None:  # grammar sequences never draft: keep nothing for them
                self._keep(s.request, s.num_computed_tokens, rows)

    def _keep(self, request: Request, start: int, rows: torch.Tensor) -> None:
        pending = self._pending.get(request.seq_id)
        if pending is None or not pending.start < start <= pending.start + pending.hidden.shape[0]:
            # First rows, a recompute from before them (preemption), or (never expected) a gap: start afresh.
            self._pending[request.seq_id] = _Pending(request, start, rows)
            return
        # Rows from `start` on replace what was there (the target's rows for rejected drafts, a recompute).
        pending.hidden = torch.cat([pending.hidden[: start - pending.start], rows])

    @torch.inference_mode()
    def propose(self, requests: Sequence[Request], max_num_tokens: Sequence[int]) -> list[list[int]]:
        for seq_id in [s for s, p in self._pending.items() if p.request.is_finished]:
            del self._pending[seq_id]
        drafts: list[list[int]] = [[] for _ in requests]
        rows, ks, catch_up = [], [], []
        for i, (request, k) in enumerate(zip(requests, max_num_tokens, strict=True)):
            pending = self._pending.pop(request.seq_id, None)
            num_tokens = request.num_tokens
            # Positions start .. n - 2 are the target's computed tokens the head has not read.
            if pending is None or not pending.start <= num_tokens - 2 < pending.start + pending.hidden.shape[0]:
                continue  # positions without hidden states (not expected): no drafts this time
            rows.append(i)
            ks.append(self._room_for(request, k))
            catch_up.append((request, pending.start, pending.hidden[: num_tokens - 1 - pending.start]))
        if not rows:
            return drafts

        # Step 0: catch up on the target's new positions; the last entry of each sequence drafts d0.
        tables = [self.kv_cache_manager.block_ids(r) for r, _, _ in catch_up]
        input_ids = torch.tensor(
            [t for r, start, _ in catch_up for t in r.all_token_ids[start + 1 :]], dtype=torch.int64
        ).to(self.device)
        starts = [start for _, start, _ in catch_up]
        counts = [r.num_tokens - 1 - start for r, start, _ in catch_up]
        hidden = torch.cat([h for _, _, h in catch_up])
        positions, meta = self._metadata(starts, counts, tables)
        prenorm = self.head(input_ids, positions, hidden, self.kv_cache, meta)
        last = torch.tensor(np.cumsum(counts) - 1, device=self.device)
        hidden, tokens = prenorm[last], self.head.greedy_target_ids(prenorm[last])
        active = list(range(len(rows)))
        for step in range(max(ks)):
            for j, token in zip(active, tokens.tolist()):
                drafts[rows[j]].append(token)
            keep = [a for a, j in enumerate(active) if ks[j] > step + 1]
            if not keep:
                break
            active = [active[a] for a in keep]
            keep_index = torch.tensor(keep, device=self.device)
            hidden, input_ids = hidden[keep_index], tokens[keep_index]
            # Step i: each sequence's previous draft at the position after the last one written.
            ends = [catch_up[j][0].num_tokens - 1 + step for j in active]
            positions, meta = self._metadata(ends, [1] * len(active), [tables[j] for j in active])
            hidden = self.head(input_ids, positions, hidden, self.kv_cache, meta)
            tokens = self.head.greedy_target_ids(hidden)
        return drafts

    def _room_for(self, request: Request, k: int) -> int:
        """Drafts the sequence can chain: entry n - 2 + i (i >= 1) needs a slot past its last token."""
        num_slots = request.num_tokens + k - 2
        if k == 1 or self.kv_cache_manager.reserve_slots(request, num_slots):
            return k
        held = len(self.kv_cache_manager.block_ids(request)) * self.block_size
        return max(1, min(k, held - request.num_tokens + 2))

    def _metadata(
        self, starts: Sequence[int], counts: Sequence[int], tables: Sequence[Sequence[int]]
    ) -> tuple[torch.Tensor, AttentionMetadata]:
        """Positions and attention metadata for `counts[i]` new entries of sequence i from position `starts[i]`."""
        counts_np = np.asarray(counts, dtype=np.int64)
        seq_starts = np.asarray(starts, dtype=np.int64)
        query_start_loc = np.zeros(len(counts) + 1, dtype=np.int64)
        np.cumsum(counts_np, out=query_start_loc[1:])
        seq_of_row = np.repeat(np.arange(len(counts)), counts_np)
        positions = np.arange(int(query_start_loc[-1])) - query_start_loc[:-1][seq_of_row] + seq_starts[seq_of_row]
        seq_lens = seq_starts + counts_np
        width = int(-(-seq_lens.max() // self.block_size))
        block_tables = np.zeros((len(counts), width), dtype=np.int32)
        for i, table in enumerate(tables):
            used = table[:width]
            block_tables[i, : len(used)] = used
        slots = block_tables[seq_of_row, positions // self.block_size].astype(np.int64) * self.block_size
        slots += positions % self.block_size

        def tensor(array: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(array).to(self.device)

        meta = AttentionMetadata(
            tensor(slots),
            tensor(query_start_loc.astype(np.int32)),
            tensor(seq_lens.astype(np.int32)),
            tensor(block_tables),
            int(counts_np.max()),
            int(seq_lens.max()),
        )
        return tensor(positions), meta
