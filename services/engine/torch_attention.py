"""Batched paged attention for the CPU path: one SDPA call per layer for the whole ragged batch.

Same function as `pagedserve.kernels.reference.paged_attention` (the oracle, one sequence at a time), but the
batch is gathered into padded tensors so a step costs one fused call instead of a Python loop:

    K, V   [num_seqs, num_kv_heads, max_ctx, head_dim]   gathered through the block tables
    Q      [num_seqs, num_heads, max_query_len, head_dim] query rows scattered into padding
    mask   [num_seqs, 1, max_query_len, max_ctx]          causal with each sequence's offset
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def paged_attention_padded(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    window: int | None = None,  # sliding window: a query sees keys less than `window` positions back
    softcap: float | None = None,  # logits -> softcap * tanh(logits / softcap) (Gemma 2)
    sinks: torch.Tensor | None = None,  # [num_heads]: a learned logit per head that joins each row's softmax
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    num_tokens, num_heads, head_dim = query.shape
    num_seqs = seq_lens.shape[0]
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    num_ctx_blocks = (max_seq_len + block_size - 1) // block_size
    max_ctx = num_ctx_blocks * block_size
    device = query.device

    blocks = block_tables[:, :num_ctx_blocks].long()  # [num_seqs, num_ctx_blocks]
    k = kv_cache[0][blocks].reshape(num_seqs, max_ctx, num_kv_heads, head_dim).transpose(1, 2)
    v = kv_cache[1][blocks].reshape(num_seqs, max_ctx, num_kv_heads, head_dim).transpose(1, 2)
    if kv_cache.dtype.itemsize == 1:  # fp8 cache: dequantise (few ops are defined on float8 tensors)
        k, v = k.float() * k_scale, v.float() * v_scale
    # Slots past a sequence's end hold anything (NaN in a fresh cache): a masked weight of 0 times
    # NaN is still NaN, so zero them.
    is_ctx = torch.arange(max_ctx, device=device)[None, :] < seq_lens.long()[:, None]  # [num_seqs, max_ctx]
    k = torch.where(is_ctx[:, None, :, None], k, 0)
    v = torch.where(is_ctx[:, None, :, None], v, 0)

    starts = query_start_loc[:-1].long()
    query_lens = query_start_loc[1:].long() - starts  # [num_seqs]
    token_seq = torch.repeat_interleave(torch.arange(num_seqs, device=device), query_lens)  # [num_tokens]
    token_row = torch.arange(num_tokens, device=device) - starts[token_seq]  # row within its sequence
    q = query.new_zeros(num_seqs, max_query_len, num_heads, head_dim)
    q[token_seq, token_row] = query
    q = q.transpose(1, 2)  # [num_seqs, num_heads, max_query_len, head_dim]

    # Query row j of sequence i sits at position seq_len - query_len + j and sees keys up to it.
    rows = torch.arange(max_query_len, device=device)
    q_pos = (seq_lens.long() - query_lens)[:, None] + rows[None, :]  # [num_seqs, max_query_len]
    k_pos = torch.arange(max_ctx, device=device)
    mask = k_pos[None, None, :] <= q_pos[:, :, None]  # [num_seqs, max_query_len, max_ctx]
    if window is not None:
        mask &= k_pos[None, None, :] > q_pos[:, :, None] - window
    # Padding rows would be all -inf (NaN): give them key 0 (they are discarded below). Real rows always
    # see their own position, so this never widens a window.
    mask[:, :, 0] |= ~mask.any(-1)
    group = num_heads // num_kv_heads
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    if softcap is None and sinks is None:
        out = F.scaled_dot_product_attention(
            q.float(), k.float(), v.float(), attn_mask=mask[:, None], scale=scale
        )  # [num_seqs, num_heads, max_query_len, head_dim]
    else:  # SDPA has neither soft-capping nor sinks: the same math spelled out
        logits = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        logits = logits.masked_fill(~mask[:, None], float("-inf"))
        if sinks is None:
            weights = logits.softmax(-1)
        else:  # the sink is one more logit in the denominator with no value: softmax over [logits | sink], drop it
            sink_col = sinks.float()[None, :, None, None].expand(num_seqs, num_heads, max_query_len, 1)
            weights = torch.cat([logits, sink_col], dim=-1).softmax(-1)[..., :-1]
        out = torch.matmul(weights, v.float())
    return out.transpose(1, 2)[token_seq, token_row].to(query.dtype)
