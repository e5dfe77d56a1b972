"""A minimal paged driver for model tests: block tables, slot mapping and metadata built by hand.

It stands in for the engine's runner so the models can be checked against HF on their own: every
`step` appends some tokens to some sequences (a prompt, a prompt piece, or one decode token each)
and runs them as one flattened, ragged batch through the paged KV cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from pagedserve.services.engine.attention import AttentionMetadata
from pagedserve.services.engine.models import CausalLM


@dataclass(slots=True)
class _Seq:
    num_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)


class PagedDriver:
    def __init__(self, model: CausalLM, num_blocks: int = 256, block_size: int = 4, seed: int = 0) -> None:
        spec = model.spec
        self.model, self.block_size = model, block_size
        self.device = next(model.parameters()).device
        shape = (2, num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=spec.dtype, device=self.device) for _ in range(spec.num_layers)]
        # Hand out blocks in a shuffled order so block tables are never simply contiguous.
        self.free_blocks = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
        self.seqs: dict[int, _Seq] = {}

    def step(self, batch: dict[int, list[int]]) -> list[torch.Tensor]:
        """Run new tokens for several sequences at once; returns each one's logits [n_new, vocab]."""
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start_loc, seq_lens, tables = [0], [], []
        for seq_id, new_ids in batch.items():
            seq = self.seqs.setdefault(seq_id, _Seq())
            for pos in range(seq.num_tokens, seq.num_tokens + len(new_ids)):
                if pos // self.block_size == len(seq.block_ids):
                    seq.block_ids.append(self.free_blocks.pop())
                slots.append(seq.block_ids[pos // self.block_size] * self.block_size + pos % self.block_size)
                positions.append(pos)
            input_ids += new_ids
            seq.num_tokens += len(new_ids)
            query_start_loc.append(len(input_ids))
            seq_lens.append(seq.num_tokens)
            tables.append(seq.block_ids)
        width = max(len(t) for t in tables)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=dev),
            max_query_len=max(len(ids) for ids in batch.values()),
            max_seq_len=max(seq_lens),
        )
        with torch.inference_mode():
            ids_t, pos_t = torch.tensor(input_ids, device=dev), torch.tensor(positions, device=dev)
            hidden = self.model(ids_t, pos_t, self.kv_caches, meta)
            logits = self.model.compute_logits(hidden)
        return list(logits.split([len(ids) for ids in batch.values()]))

    def greedy(self, prompts: list[list[int]], num_new_tokens: int) -> list[list[int]]:
        """Prefill all prompts in one step, then decode them together, argmax each step."""
        base = len(self.seqs)
        logits = self.step({base + i: p for i, p in enumerate(prompts)})
        outputs = [[int(lg[-1].argmax())] for lg in logits]
        for _ in range(num_new_tokens - 1):
            logits = self.step({base + i: [out[-1]] for i, out in enumerate(outputs)})
            for out, lg in zip(outputs, logits):
                out.append(int(lg[-1].argmax()))
        return outputs


def assert_chunked_steps_match_hf(model: CausalLM, hf: torch.nn.Module, prompt_seed: int, driver_seed: int) -> None:
    """A 26-token prompt in two chunks (the second beside a 5-token prompt), then a decode step each, through the
    paged cache: every step's logits equal HF's on the whole sequences (fp32)."""
    _assert_two_chunks_match_hf(model, hf, prompt_seed, driver_seed, long_len=26, first_chunk=10, short_len=5)


def assert_long_prefill_steps_match_hf(
    model: CausalLM, hf: torch.nn.Module, prompt_seed: int, driver_seed: int
) -> None:
    """Prefill-heavy steps (the Triton backend gives them its prefill kernel): a 110-token prompt's first 70
    tokens, then its last 40 after the cached 70 beside a 64-token prompt, then a decode step each; every
    step's logits equal HF's on the whole sequences (fp32)."""
    _assert_two_chunks_match_hf(model, hf, prompt_seed, driver_seed, long_len=110, first_chunk=70, short_len=64)


def _assert_two_chunks_match_hf(
    model: CausalLM,
    hf: torch.nn.Module,
    prompt_seed: int,
    driver_seed: int,
    *,
    long_len: int,
    first_chunk: int,
    short_len: int,
) -> None:
    """A long prompt's first chunk, then the rest beside a short prompt, then a decode step each."""
    gen = torch.Generator().manual_seed(prompt_seed)
    long = torch.randint(3, 256, (long_len,), generator=gen).tolist()
    short = torch.randint(3, 256, (short_len,), generator=gen).tolist()
    driver = PagedDriver(model, seed=driver_seed)
    first = driver.step({0: long[:first_chunk]})
    rest = driver.step({0: long[first_chunk:], 1: short})
    decode = driver.step({0: [7], 1: [9]})
    with torch.inference_mode():
        hf_long = hf(torch.tensor([[*long, 7]])).logits[0]
        hf_short = hf(torch.tensor([[*short, 9]])).logits[0]
    torch.testing.assert_close(torch.cat([first[0], rest[0], decode[0]]), hf_long, atol=1e-4, rtol=0)
    torch.testing.assert_close(torch.cat([rest[1], decode[1]]), hf_short, atol=1e-4, rtol=0)


def spy_on_prefill_kernel(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int | None, bool, float | None]]:
    """Record (window, has sinks, softcap) of each launch the Triton backend hands to its prefill kernel."""
    from pagedserve.kernels import triton_backend

    launches: list[tuple[int | None, bool, float | None]] = []
    prefill = triton_backend.prefill_attention

    def spy(*args: Any, **kwargs: Any) -> torch.Tensor:
        launches.append((kwargs.get("window"), kwargs.get("sinks") is not None, kwargs.get("softcap")))
        return prefill(*args, **kwargs)

    monkeypatch.setattr(triton_backend, "prefill_attention", spy)
    return launches
