"""Triton prefill attention: this step's new keys/values read contiguously, any cached prefix paged.

The paged kernel (kernels/paged_attention.py) gathers every key through the block table, which costs
address math and registers on every tile and keeps its tiles small. In a prefill step the new tokens'
keys and values already sit in the qkv projection's output (`k`, `v`: [num_tokens, num_kv_heads,
head_dim], token stride q_size + 2 * kv_size) once the fused rotary has run, so this kernel reads them
as plain 2-D tiles, like FlashAttention-2/3 on a contiguous batch:

    keys of sequence s:  [0, ctx_len)                 paged cache, through the block table (a prefix hit,
                                                      an earlier chunk; none for a fresh prompt)
                         [ctx_len, ctx_len + q_len)   key/value rows q_start .. q_start + q_len - 1

One program = BLOCK_M query rows x one head group. Rows are (token, head) pairs as in the paged
kernel: with HEADS_PER_PROGRAM = GROUP the query heads that share a KV head ride in one tile (a decode
in a mixed batch then loads each K/V tile once, not GROUP times); with 1, a program is one head's
BLOCK_M tokens (FlashAttention's layout). Off-diagonal tiles run without a mask; only the diagonal and
ragged ends pay for one. New K/V tiles come from pointer loads, a host TMA descriptor over the whole
batch, or a per-sequence device TMA descriptor (KV_LOAD), so the GPU sweep can compare them.

Softmax runs in base 2 with the scale folded into one FMA; the output is stored row-masked, so a
block that runs past its sequence never writes the next sequence's rows.

Attention features, constexpr switches as in the paged kernel (same conventions, same torch oracle):
- HAS_WINDOW (Mistral / Gemma / gpt-oss local layers): a query at position p sees keys (p - window, p].
  Key tiles wholly before the block's first row's window are never loaded, cached-prefix and new-key tiles
  alike; tiles the window cuts for some row take the mask; the rest run unmasked as without a window.
- HAS_SINKS (gpt-oss): the head's learned logit seeds the running max/sum, a key whose value is zero.
- SOFTCAP (Gemma 2): each scaled logit becomes cap * tanh(logit / cap) before the mask.
"""

from __future__ import annotations

from functools import cache

import torch
import triton
import triton.language as tl

from pagedserve.kernels.launch_config import KV_LOADS, PrefillConfig, next_power_of_2
from pagedserve.kernels.paged_attention import LOG2_E, find_seq, soft_cap

__all__ = ["KV_LOADS", "PrefillConfig", "prefill_attention", "tma_compatible"]


@triton.jit
def _softmax_step(
    acc,  # [BLOCK_M, HEAD_DIM_PADDED] fp32, unnormalised output
    m_i,  # [BLOCK_M] fp32, running max of the log2-scaled scores
    l_i,  # [BLOCK_M] fp32, running sum of exp2(score - m_i)
    q,  # [BLOCK_M, HEAD_DIM_PADDED]
    k,  # [BLOCK_N, HEAD_DIM_PADDED]
    v,  # [BLOCK_N, HEAD_DIM_PADDED]; rows that no row may see must be finite (zero)
    s_scale,  # softmax scale * log2(e) (* k_scale for an fp8 cache)
    p_scale,  # v_scale for an fp8 cache's V (used only with SCALE_P)
    visible,  # [BLOCK_M, BLOCK_N] bool (used only with IS_MASKED)
    softcap,  # the logit cap * log2(e) (used only with SOFTCAP)
    IS_MASKED: tl.constexpr,
    SCALE_P: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    if SOFTCAP:
        # cap * tanh(logit / cap) on the scaled logit, before the mask (as the paged kernel and HF's Gemma 2).
        s = soft_cap(s * s_scale, softcap)
        if IS_MASKED:
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_ref = m_new
        p = tl.math.exp2(s - m_ref[:, None])
    elif IS_MASKED:
        s = tl.where(visible, s * s_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that sees no key yet keeps exp2 away from -inf - -inf.
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_ref[:, None])
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1) * s_scale)
        m_ref = m_new
        p = tl.math.exp2(s * s_scale - m_ref[:, None])  # one FMA per score
    alpha = tl.math.exp2(m_i - m_ref)
    l_i = l_i * alpha + tl.sum(p, 1)
    if SCALE_P:
        p = p * p_scale
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _load_cached_kv(
    key_cache_ptr,
    value_cache_ptr,
    block_table_ptr,  # this sequence's row of the block table
    tile_start,
    ctx_len,  # cached keys at positions >= ctx_len are never read
    kv_head_offset,
    stride_cache_block,
    stride_cache_slot,
    dtype: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    IS_MASKED: tl.constexpr,
):
    offs_n = tile_start + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM_PADDED)
    key_valid = offs_n < ctx_len
    if IS_MASKED:
        block_ids = tl.load(block_table_ptr + offs_n // BLOCK_SIZE, mask=key_valid, other=0)
    else:
        block_ids = tl.load(block_table_ptr + offs_n // BLOCK_SIZE)
    offs = (
        block_ids.to(tl.int64)[:, None] * stride_cache_block
        + (offs_n % BLOCK_SIZE)[:, None] * stride_cache_slot
        + kv_head_offset
        + offs_d[None, :]
    )  # [BLOCK_N, HEAD_DIM_PADDED] int64
    mask = (offs_d < HEAD_DIM)[None, :]
    if IS_MASKED:
        mask = mask & key_valid[:, None]
    k = tl.load(key_cache_ptr + offs, mask=mask, other=0.0)
    v = tl.load(value_cache_ptr + offs, mask=mask, other=0.0)
    return k.to(dtype), v.to(dtype)  # an fp8 cache: its scales are applied by the caller


@triton.jit
def _load_new_kv(
    key_ptr,
    value_ptr,
    key_desc,
    value_desc,
    q_start,  # the sequence's first token row
    tile_start,  # first key of the tile, relative to q_start
    q_len,
    kv_col,  # kv_head * HEAD_DIM: the tile's column in a [num_tokens, num_kv_heads * head_dim] view
    stride_k_token,
    stride_v_token,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    KV_LOAD: tl.constexpr,
    IS_MASKED: tl.constexpr,
):
    offs_n = tile_start + tl.arange(0, BLOCK_N)
    if KV_LOAD == 1:  # host descriptor over the whole batch: rows past q_len are the next sequence's
        k = key_desc.load([q_start + tile_start, kv_col])
        v = value_desc.load([q_start + tile_start, kv_col])
        if IS_MASKED:  # p is 0 there, but 0 * NaN is not: padding rows must not reach the P @ V sum
            v = tl.where((offs_n < q_len)[:, None], v, 0.0)
    elif KV_LOAD == 2:  # per-sequence descriptor: TMA fills rows past q_len with zeros
        k = key_desc.load([tile_start, kv_col])
        v = value_desc.load([tile_start, kv_col])
    else:
        offs_d = tl.arange(0, HEAD_DIM_PADDED)
        rows = (q_start + offs_n).to(tl.int64)[:, None]
        mask = (offs_d < HEAD_DIM)[None, :]
        if IS_MASKED:
            mask = mask & (offs_n < q_len)[:, None]
        k = tl.load(key_ptr + rows * stride_k_token + kv_col + offs_d[None, :], mask=mask, other=0.0)
        v = tl.load(value_ptr + rows * stride_v_token + kv_col + offs_d[None, :], mask=mask, other=0.0)
    return k, v


@triton.jit
def _attend_cached_tile(
    acc,
    m_i,
    l_i,
    q,
    q_pos,  # [BLOCK_M] absolute position of each row's query token
    key_cache_ptr,
    value_cache_ptr,
    block_table_ptr,
    tile_start,
    ctx_len,
    window,
    kv_head_offset,
    stride_cache_block,
    stride_cache_slot,
    s_scale,
    p_scale,
    softcap,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    MASK: tl.constexpr,  # 0: every row sees the tile; 1: the window cuts it; 2: the prefix's ragged end (+ window)
    HAS_WINDOW: tl.constexpr,
    SCALE_P: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """One tile of the cached prefix: positions [tile_start, tile_start + BLOCK_N)."""
    k, v = _load_cached_kv(
        key_cache_ptr,
        value_cache_ptr,
        block_table_ptr,
        tile_start,
        ctx_len,
        kv_head_offset,
        stride_cache_block,
        stride_cache_slot,
        q.dtype,
        BLOCK_SIZE,
        BLOCK_N,
        HEAD_DIM,
        HEAD_DIM_PADDED,
        MASK == 2,
    )
    key_pos = tile_start + tl.arange(0, BLOCK_N)
    if MASK == 0:
        visible = None
    elif HAS_WINDOW:
        visible = (key_pos < ctx_len)[None, :] & (key_pos[None, :] > (q_pos - window)[:, None])
    else:
        visible = (key_pos < ctx_len)[None, :]
    return _softmax_step(
        acc, m_i, l_i, q, k, v, s_scale, p_scale, visible, softcap, MASK != 0, SCALE_P, DOT_PRECISION, SOFTCAP
    )


@triton.jit
def _attend_new_tile(
    acc,
    m_i,
    l_i,
    q,
    q_idx,  # [BLOCK_M] each row's query token, numbered from the sequence's first new token
    key_ptr,
    value_ptr,
    key_desc,
    value_desc,
    q_start,
    tile_start,  # relative to q_start, like q_idx
    q_len,
    window,
    kv_col,
    stride_k_token,
    stride_v_token,
    s_scale,
    softcap,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    KV_LOAD: tl.constexpr,
    MASK: tl.constexpr,  # 0: every row sees the tile; 1: the window cuts it; 2: the diagonal / ragged end (+ window)
    HAS_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """One tile of this step's keys: new-token rows [tile_start, tile_start + BLOCK_N)."""
    k, v = _load_new_kv(
        key_ptr,
        value_ptr,
        key_desc,
        value_desc,
        q_start,
        tile_start,
        q_len,
        kv_col,
        stride_k_token,
        stride_v_token,
        BLOCK_N,
        HEAD_DIM,
        HEAD_DIM_PADDED,
        KV_LOAD,
        MASK == 2,
    )
    key_idx = tile_start + tl.arange(0, BLOCK_N)
    if MASK == 2:
        visible = (key_idx[None, :] <= q_idx[:, None]) & (key_idx < q_len)[None, :]
        if HAS_WINDOW:
            visible = visible & (key_idx[None, :] > (q_idx - window)[:, None])
    elif MASK == 1:
        visible = key_idx[None, :] > (q_idx - window)[:, None]
    else:
        visible = None
    return _softmax_step(
        acc, m_i, l_i, q, k, v, s_scale, 1.0, visible, softcap, MASK != 0, False, DOT_PRECISION, SOFTCAP
    )


@triton.jit(do_not_specialize=["num_seqs"])
def _prefill_attention_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    query_ptr,  # [num_tokens, num_heads, head_dim]
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]: this step's keys (rotated), token rows like query
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    key_desc,  # KV_LOAD == 1: TensorDescriptor over key as [num_tokens, num_kv_heads * head_dim]; else unused
    value_desc,
    key_cache_ptr,  # [num_blocks, BLOCK_SIZE, num_kv_heads, head_dim]: the cached prefixes
    value_cache_ptr,
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens_ptr,  # [num_seqs] int32
    query_start_loc_ptr,  # [num_seqs + 1] int32
    sinks_ptr,  # [num_heads] learned sink logits (HAS_SINKS)
    qk_scale,  # softmax scale * log2(e)
    cache_qk_scale,  # qk_scale * k_scale: an fp8 cache holds K / k_scale
    cache_v_scale,  # an fp8 cache holds V / v_scale
    softcap,  # SOFTCAP: the logit cap * log2(e) (capping in the log2 domain)
    window,  # HAS_WINDOW: a query at position p sees keys in (p - window, p]
    num_seqs,
    stride_q_token,
    stride_q_head,
    stride_k_token,
    stride_v_token,
    stride_out_token,
    stride_out_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_bt_seq,
    NUM_KV_HEADS: tl.constexpr,
    NUM_HEAD_GROUPS: tl.constexpr,  # num_heads // HEADS_PER_PROGRAM
    GROUP: tl.constexpr,  # query heads per KV head
    HEADS_PER_PROGRAM: tl.constexpr,  # GROUP (packed GQA) or 1
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,  # query tokens per program
    BLOCK_N: tl.constexpr,
    KV_LOAD: tl.constexpr,  # 0 pointers, 1 host TMA descriptor, 2 device TMA descriptor
    WARP_SPECIALIZE: tl.constexpr,
    SCALE_CACHED_V: tl.constexpr,  # the cache is fp8 (cache_v_scale applies to cached values)
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 (engine runs fp32 models on GPU too), else unused
    HAS_WINDOW: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    # One grid axis (no 65535 limit on query blocks), head groups varying fastest: the programs running
    # together share one query block's K/V in L2.
    head_group = tl.program_id(0) % NUM_HEAD_GROUPS
    q_block_id = tl.program_id(0) // NUM_HEAD_GROUPS
    seq = find_seq(query_start_loc_ptr, q_block_id, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_block = q_block_id - (q_start // BLOCK_Q + seq)
    if q_block * BLOCK_Q >= q_len:
        return
    # The last query block sees the most keys: start it first so each sequence ends on light work.
    q_block = tl.cdiv(q_len, BLOCK_Q) - 1 - q_block
    ctx_len = tl.load(seq_lens_ptr + seq) - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PADDED)
    q_lo = q_block * BLOCK_Q
    q_idx = q_lo + offs_m // HEADS_PER_PROGRAM  # [BLOCK_M] query row within the sequence's new tokens
    head = head_group * HEADS_PER_PROGRAM + offs_m % HEADS_PER_PROGRAM  # [BLOCK_M]
    kv_head = (head_group * HEADS_PER_PROGRAM) // GROUP
    row_valid = (offs_m < BLOCK_Q * HEADS_PER_PROGRAM) & (q_idx < q_len)
    d_valid = offs_d < HEAD_DIM
    token = (q_start + q_idx).to(tl.int64)
    q = tl.load(
        query_ptr + token[:, None] * stride_q_token + head[:, None] * stride_q_head + offs_d[None, :],
        mask=row_valid[:, None] & d_valid[None, :],
        other=0.0,
    )  # [BLOCK_M, HEAD_DIM_PADDED]

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PADDED], dtype=tl.float32)
    if HAS_SINKS:
        # The head's sink logit starts the softmax as a key whose value is zero: exp(sink) joins the denominator.
        m_i = tl.load(sinks_ptr + head, mask=row_valid, other=0.0).to(tl.float32) * 1.4426950408889634  # log2(e)
        l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)

    # Which keys the block's rows see, in positions of the whole sequence (cached prefix, then new keys):
    #
    #   0          first_key          full_key                  ctx_len + q_lo     ctx_len + q_end
    #   |  skipped  |  window cuts them  |  every row sees them   |     diagonal     |
    #
    # Without a window first_key = full_key = 0. Tiles wholly before first_key are never loaded; tiles that
    # reach below full_key or past the diagonal's start take a mask; the rest run unmasked.
    q_end = tl.minimum(q_lo + BLOCK_Q, q_len)  # one past the block's last row
    q_pos = ctx_len + q_idx  # [BLOCK_M] absolute positions
    if HAS_WINDOW:
        first_key = tl.maximum(ctx_len + q_lo - window + 1, 0)  # the first row's window starts here
        full_key = tl.maximum(ctx_len + q_end - window, 0)  # the last row's window starts here

    # 1. The cached prefix, positions [0, ctx_len): the window may cut it; its ragged end needs a mask.
    block_table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    kv_head_offset = kv_head.to(tl.int64) * stride_cache_head
    num_full_cached = ctx_len // BLOCK_N
    if HAS_WINDOW:
        cached_lo = first_key // BLOCK_N
        cached_cut = tl.maximum(tl.minimum(tl.cdiv(full_key, BLOCK_N), num_full_cached), cached_lo)
        for t in range(cached_lo, cached_cut):
            acc, m_i, l_i = _attend_cached_tile(
                acc,
                m_i,
                l_i,
                q,
                q_pos,
                key_cache_ptr,
                value_cache_ptr,
                block_table_ptr,
                t * BLOCK_N,
                ctx_len,
                window,
                kv_head_offset,
                stride_cache_block,
                stride_cache_slot,
                cache_qk_scale,
                cache_v_scale,
                softcap,
                BLOCK_SIZE,
                BLOCK_N,
                HEAD_DIM,
                HEAD_DIM_PADDED,
                1,
                HAS_WINDOW,
                SCALE_CACHED_V,
                DOT_PRECISION,
                SOFTCAP,
            )
    else:
        cached_lo = 0
        cached_cut = 0
    for t in range(cached_cut, num_full_cached):
        acc, m_i, l_i = _attend_cached_tile(
            acc,
            m_i,
            l_i,
            q,
            q_pos,
            key_cache_ptr,
            value_cache_ptr,
            block_table_ptr,
            t * BLOCK_N,
            ctx_len,
            window,
            kv_head_offset,
            stride_cache_block,
            stride_cache_slot,
            cache_qk_scale,
            cache_v_scale,
            softcap,
            BLOCK_SIZE,
            BLOCK_N,
            HEAD_DIM,
            HEAD_DIM_PADDED,
            0,
            HAS_WINDOW,
            SCALE_CACHED_V,
            DOT_PRECISION,
            SOFTCAP,
        )
    if (num_full_cached * BLOCK_N < ctx_len) & (num_full_cached >= cached_lo):
        acc, m_i, l_i = _attend_cached_tile(
            acc,
            m_i,
            l_i,
            q,
            q_pos,
            key_cache_ptr,
            value_cache_ptr,
            block_table_ptr,
            num_full_cached * BLOCK_N,
            ctx_len,
            window,
            kv_head_offset,
            stride_cache_block,
            stride_cache_slot,
            cache_qk_scale,
            cache_v_scale,
            softcap,
            BLOCK_SIZE,
            BLOCK_N,
            HEAD_DIM,
            HEAD_DIM_PADDED,
            2,
            HAS_WINDOW,
            SCALE_CACHED_V,
            DOT_PRECISION,
            SOFTCAP,
        )

    # 2. This step's keys, numbered from the sequence's first new token: tiles before the block's first row
    #    are causally visible to every row (the window may still cut them); the diagonal (and the ragged end)
    #    is masked.
    kv_col = kv_head * HEAD_DIM
    if KV_LOAD == 2:
        key_desc = tl.make_tensor_descriptor(
            key_ptr + q_start.to(tl.int64) * stride_k_token,
            shape=[q_len, NUM_KV_HEADS * HEAD_DIM],
            strides=[stride_k_token, 1],
            block_shape=[BLOCK_N, HEAD_DIM],
        )
        value_desc = tl.make_tensor_descriptor(
            value_ptr + q_start.to(tl.int64) * stride_v_token,
            shape=[q_len, NUM_KV_HEADS * HEAD_DIM],
            strides=[stride_v_token, 1],
            block_shape=[BLOCK_N, HEAD_DIM],
        )
    num_full_new = (q_lo + 1) // BLOCK_N
    num_new = tl.cdiv(q_end, BLOCK_N)
    if HAS_WINDOW:
        new_lo = tl.maximum(first_key - ctx_len, 0) // BLOCK_N  # <= num_full_new: a row sees its own key
        new_cut = tl.maximum(tl.minimum(tl.cdiv(tl.maximum(full_key - ctx_len, 0), BLOCK_N), num_full_new), new_lo)
        for t in range(new_lo, new_cut):
            acc, m_i, l_i = _attend_new_tile(
                acc,
                m_i,
                l_i,
                q,
                q_idx,
                key_ptr,
                value_ptr,
                key_desc,
                value_desc,
                q_start,
                t * BLOCK_N,
                q_len,
                window,
                kv_col,
                stride_k_token,
                stride_v_token,
                qk_scale,
                softcap,
                BLOCK_N,
                HEAD_DIM,
                HEAD_DIM_PADDED,
                KV_LOAD,
                1,
                HAS_WINDOW,
                DOT_PRECISION,
                SOFTCAP,
            )
        diagonal_lo = tl.maximum(num_full_new, new_lo)
    else:
        new_cut = 0
        diagonal_lo = num_full_new
    for t in tl.range(new_cut, num_full_new, warp_specialize=WARP_SPECIALIZE):
        acc, m_i, l_i = _attend_new_tile(
            acc,
            m_i,
            l_i,
            q,
            q_idx,
            key_ptr,
            value_ptr,
            key_desc,
            value_desc,
            q_start,
            t * BLOCK_N,
            q_len,
            window,
            kv_col,
            stride_k_token,
            stride_v_token,
            qk_scale,
            softcap,
            BLOCK_N,
            HEAD_DIM,
            HEAD_DIM_PADDED,
            KV_LOAD,
            0,
            HAS_WINDOW,
            DOT_PRECISION,
            SOFTCAP,
        )
    for t in range(diagonal_lo, num_new):
        acc, m_i, l_i = _attend_new_tile(
            acc,
            m_i,
            l_i,
            q,
            q_idx,
            key_ptr,
            value_ptr,
            key_desc,
            value_desc,
            q_start,
            t * BLOCK_N,
            q_len,
            window,
            kv_col,
            stride_k_token,
            stride_v_token,
            qk_scale,
            softcap,
            BLOCK_N,
            HEAD_DIM,
            HEAD_DIM_PADDED,
            KV_LOAD,
            2,
            HAS_WINDOW,
            DOT_PRECISION,
            SOFTCAP,
        )

    out = acc / l_i[:, None]
    out_offs = token[:, None] * stride_out_token + head[:, None] * stride_out_head + offs_d[None, :]
    tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & d_valid[None, :])


def _tma_allocator(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device="cuda")


@cache
def _install_tma_allocator() -> None:
    # Device-side descriptors live in a per-launch global scratch buffer that Triton asks for here.
    triton.set_allocator(_tma_allocator)


def tma_compatible(key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether TMA can read key/value as [num_tokens, num_kv_heads * head_dim] (host metadata only)."""
    head_dim = key.shape[2]
    elem = key.element_size()
    return all(
        t.stride(2) == 1
        and t.stride(1) == head_dim
        and (t.stride(0) * elem) % 16 == 0
        and t.data_ptr() % 16 == 0
        and (head_dim * elem) % 16 == 0
        for t in (key, value)
    ) and head_dim == next_power_of_2(head_dim)


def prefill_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]: this step's keys, rows like query's
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]: read for cached prefixes
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    scale: float,
    config: PrefillConfig,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
    k_scale: float = 1.0,  # an fp8 cache holds K / k_scale and V / v_scale; key/value are unscaled
    v_scale: float = 1.0,
    window: int | None = None,  # sliding window: a query at position p sees keys in (p - window, p]
    sinks: torch.Tensor | None = None,  # [num_heads] learned logit per head in each softmax denominator
    softcap: float | None = None,  # attention-logit soft-capping (Gemma 2): logits -> cap * tanh(logits / cap)
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its cached prefix and themselves; no host sync."""
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    num_seqs = seq_lens.shape[0]
    group = num_heads // num_kv_heads
    assert num_heads == group * num_kv_heads and kv_cache.shape[4] == head_dim
    assert key.shape == value.shape == (key.shape[0], num_kv_heads, head_dim) and key.shape[0] >= num_tokens
    assert query.stride(2) == 1 and key.stride(2) == 1 and value.stride(2) == 1 and key.stride(1) == head_dim
    assert value.stride(1) == head_dim and kv_cache.stride(4) == 1 and block_tables.stride(1) == 1
    assert config.kv_load in KV_LOADS
    assert window is None or window >= 1, "a window holds at least the query's own key"
    assert sinks is None or (sinks.shape == (num_heads,) and sinks.is_contiguous())
    assert softcap is None or softcap > 0, "a logit cap must be positive"
    heads_per_program = config.heads_per_program(group)
    assert config.block_m >= heads_per_program, "a program must hold all query heads it packs"
    if out is None:
        out = torch.empty_like(query)
    kv_load = KV_LOADS.index(config.kv_load)
    if kv_load and not tma_compatible(key, value):
        kv_load = 0
    key_desc: object = key
    value_desc: object = value
    if kv_load == 1:
        from triton.tools.tensor_descriptor import TensorDescriptor

        width = num_kv_heads * head_dim
        key_desc = TensorDescriptor(key, [key.shape[0], width], [key.stride(0), 1], [config.block_n, head_dim])
        value_desc = TensorDescriptor(value, [value.shape[0], width], [value.stride(0), 1], [config.block_n, head_dim])
    elif kv_load == 2 and query.is_cuda:
        _install_tma_allocator()
    block_q = config.block_q(group)
    num_q_blocks = num_tokens // block_q + num_seqs
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    qk_scale = scale * LOG2_E
    num_head_groups = num_heads // heads_per_program
    _prefill_attention_kernel[(num_head_groups * num_q_blocks,)](
        out,
        query,
        key,
        value,
        key_desc,
        value_desc,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        query if sinks is None else sinks,  # any pointer when unused
        qk_scale,
        qk_scale * k_scale,
        v_scale,
        (softcap or 0.0) * LOG2_E,
        window or 0,
        num_seqs,
        query.stride(0),
        query.stride(1),
        key.stride(0),
        value.stride(0),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        block_tables.stride(0),
        NUM_KV_HEADS=num_kv_heads,
        NUM_HEAD_GROUPS=num_head_groups,
        GROUP=group,
        HEADS_PER_PROGRAM=heads_per_program,
        HEAD_DIM=head_dim,
        HEAD_DIM_PADDED=next_power_of_2(head_dim),
        BLOCK_SIZE=block_size,
        BLOCK_M=config.block_m,
        BLOCK_Q=block_q,
        BLOCK_N=config.block_n,
        KV_LOAD=kv_load,
        WARP_SPECIALIZE=config.warp_specialize,
        SCALE_CACHED_V=kv_cache.dtype.itemsize == 1,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        HAS_WINDOW=window is not None,
        HAS_SINKS=sinks is not None,
        SOFTCAP=softcap is not None,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out
