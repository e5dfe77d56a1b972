"""Triton paged attention for one whole ragged batch: prompts, cached prefixes, chunks and decodes.

One program = (a block of query tokens of one sequence) x (one KV head) x (one KV segment). The
query heads that share the KV head are packed into the program's rows, so every K/V tile loaded
from the cache feeds a tensor-core `tl.dot` for all of them:

    row r of the tile:  token q_block * BLOCK_Q + r // GROUP,   head kv_head * GROUP + r % GROUP

Keys are walked TILE_N at a time through the block table (a tile may span several cache blocks).
Tiles that every row of the program sees in full skip the causal mask; only the last few
(the diagonal, and the ragged end) pay for it. With NUM_SEGMENTS > 1 (flash-decoding) each program
covers 1/NUM_SEGMENTS of the sequence's tiles and writes an unnormalised partial result that
`split_kv_reduce` combines; segment sizes come from each sequence's own length, inside the kernel.

Softmax runs in base 2 (`qk_scale` = scale * log2(e)); all cache offsets are 64-bit.

Sliding window (HAS_WINDOW, Mistral / Gemma / gpt-oss local layers): a row sees keys (q_pos - window,
q_pos]; tiles before the first row's window are never loaded, tiles the window cuts take the mask.
Sinks (HAS_SINKS, gpt-oss): a learned logit per head joins the softmax denominator; it seeds segment
0's running max/sum as if it were a key with a zero value.
Soft-capping (SOFTCAP, Gemma 2): each scaled logit becomes cap * tanh(logit / cap) before the mask; it is
elementwise on the scores, so tiles, segments and the split-KV reduction are as without it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels import pdl
from pagedserve.kernels.launch_config import AttentionConfig, next_power_of_2
from pagedserve.kernels.pdl import prologue
from pagedserve.kernels.split_kv_reduce import reduce_segments

LOG2_E = 1.4426950408889634


@triton.jit
def find_seq(query_start_loc_ptr, q_block_id, num_seqs, BLOCK_Q: tl.constexpr):
    # Sequence i owns the q blocks [qsl[i] // BLOCK_Q + i, qsl[i + 1] // BLOCK_Q + i + 1): a
    # host-free upper bound on cdiv(query_len, BLOCK_Q); surplus programs exit at once.
    lo: tl.int32 = 0
    hi = lo + num_seqs  # a tensor even when num_seqs is a specialised constant
    while lo < hi:
        mid = (lo + hi) // 2
        first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_block <= q_block_id:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _load_block_ids(
    block_table_ptr,
    tile_start,
    kv_end,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    IS_MASKED: tl.constexpr,
    BT_EVICT: tl.constexpr,
):
    offs_n = tile_start + tl.arange(0, TILE_N)
    if IS_MASKED:
        block_ids = tl.load(
            block_table_ptr + offs_n // BLOCK_SIZE, mask=offs_n < kv_end, other=0, eviction_policy=BT_EVICT
        )
    else:
        block_ids = tl.load(block_table_ptr + offs_n // BLOCK_SIZE, eviction_policy=BT_EVICT)
    return block_ids


@triton.jit
def _load_kv_tile(
    cache_ptr,  # the key or the value cache
    block_ids,  # [TILE_N] cache block of each key of the tile
    tile_start,
    kv_end,
    kv_head_offset,
    stride_cache_block,
    stride_cache_slot,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    IS_MASKED: tl.constexpr,
    KEYS_ONLY_MASK: tl.constexpr,  # mask keys but not head dims: keeps the vector width of full tiles
    KV_EVICT: tl.constexpr,
):
    offs_n = tile_start + tl.arange(0, TILE_N)
    offs_d = tl.arange(0, HEAD_DIM_PADDED)
    kv_offs = (
        block_ids.to(tl.int64)[:, None] * stride_cache_block
        + (offs_n % BLOCK_SIZE)[:, None] * stride_cache_slot
        + kv_head_offset
        + offs_d[None, :]
    )  # [TILE_N, HEAD_DIM_PADDED] int64
    if IS_MASKED and KEYS_ONLY_MASK and HEAD_DIM == HEAD_DIM_PADDED:
        tile = tl.load(cache_ptr + kv_offs, mask=(offs_n < kv_end)[:, None], other=0.0, eviction_policy=KV_EVICT)
    elif IS_MASKED:
        kv_mask = (offs_n < kv_end)[:, None] & (offs_d < HEAD_DIM)[None, :]
        tile = tl.load(cache_ptr + kv_offs, mask=kv_mask, other=0.0, eviction_policy=KV_EVICT)
    elif HEAD_DIM != HEAD_DIM_PADDED:
        tile = tl.load(cache_ptr + kv_offs, mask=(offs_d < HEAD_DIM)[None, :], other=0.0, eviction_policy=KV_EVICT)
    else:
        tile = tl.load(cache_ptr + kv_offs, eviction_policy=KV_EVICT)
    return tile


@triton.jit
def _tanh(x):
    # Triton has no portable tanh. exp2 of -2|x| * log2(e) never overflows: large |x| saturates to +-1
    # (the plain (e^2x - 1) / (e^2x + 1) gives inf / inf = NaN there).
    e = tl.math.exp2(-2.8853900817779268 * tl.abs(x))  # 2 * log2(e)
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def soft_cap(s, cap):
    # Gemma 2's cap * tanh(logit / cap). s and cap are both log2(e) times their natural-scale values, and
    # log2(e) * cap * tanh(s_nat / cap) == cap_log2 * tanh(s_log2 / cap_log2): capping in the log2 domain
    # is the same function, with no conversion back and forth.
    return cap * _tanh(s / cap)


@triton.jit
def _update(
    acc,  # [BLOCK_M, HEAD_DIM_PADDED] fp32, unnormalised output
    m_i,  # [BLOCK_M] fp32, running max of the log2-scaled scores
    l_i,  # [BLOCK_M] fp32, running sum of exp2(score - m_i)
    q,  # [BLOCK_M, HEAD_DIM_PADDED]
    q_pos,  # [BLOCK_M] absolute position of each row's query token
    k_floor,  # [BLOCK_M] keys at positions <= k_floor are out of the row's window (-1: none)
    k,  # [TILE_N, HEAD_DIM_PADDED]
    v,  # [TILE_N, HEAD_DIM_PADDED], or None with LATE_V
    value_cache_ptr,  # LATE_V: V is loaded here, after the scores
    block_ids,
    tile_start,
    kv_end,  # keys at positions >= kv_end are never read
    kv_head_offset,
    stride_cache_block,
    stride_cache_slot,
    qk_scale,
    softcap,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    IS_MASKED: tl.constexpr,
    LATE_V: tl.constexpr,
    USE_DOT: tl.constexpr,
    KV_EVICT: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    offs_n = tile_start + tl.arange(0, TILE_N)
    if USE_DOT:
        k = k.to(q.dtype)  # an fp8 cache: its scale is folded into qk_scale (K) and the output (V)
        if not LATE_V:
            v = v.to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, TILE_N] fp32, log2 domain
    else:
        # A few rows (GQA decode): fp32 multiply-add on CUDA cores instead of a 16-row padded MMA.
        prod = q.to(tl.float32)[:, None, :] * k.to(tl.float32)[None, :, :]
        s = tl.sum(prod, 2) * qk_scale
    if SOFTCAP:  # before the mask, as in HF's Gemma 2: masked keys end at -inf either way
        s = soft_cap(s, softcap)
    if IS_MASKED:
        visible = (
            (offs_n[None, :] <= q_pos[:, None]) & (offs_n[None, :] > k_floor[:, None]) & (offs_n < kv_end)[None, :]
        )
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row may see no key of this tile yet (segments, short rows): keep exp2 away from -inf - -inf.
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_ref = m_new
    p = tl.math.exp2(s - m_ref[:, None])
    alpha = tl.math.exp2(m_i - m_ref)
    l_i = l_i * alpha + tl.sum(p, 1)
    if LATE_V:
        v = _load_kv_tile(
            value_cache_ptr,
            block_ids,
            tile_start,
            kv_end,
            kv_head_offset,
            stride_cache_block,
            stride_cache_slot,
            BLOCK_SIZE,
            TILE_N,
            HEAD_DIM,
            HEAD_DIM_PADDED,
            IS_MASKED,
            False,
            KV_EVICT,
        )
        if USE_DOT:
            v = v.to(q.dtype)
    if USE_DOT:
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    else:
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], 1)
    return acc, m_new, l_i


@triton.jit
def _attend_tile(
    acc,
    m_i,
    l_i,
    q,
    q_pos,
    k_floor,
    key_cache_ptr,
    value_cache_ptr,
    block_ids,
    tile_start,
    kv_end,
    kv_head_offset,
    stride_cache_block,
    stride_cache_slot,
    qk_scale,
    softcap,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    IS_MASKED: tl.constexpr,
    LATE_V: tl.constexpr,
    USE_DOT: tl.constexpr,
    KV_EVICT: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """One key tile whose block ids are known: load K (and V), then the online-softmax update."""
    k = _load_kv_tile(
        key_cache_ptr,
        block_ids,
        tile_start,
        kv_end,
        kv_head_offset,
        stride_cache_block,
        stride_cache_slot,
        BLOCK_SIZE,
        TILE_N,
        HEAD_DIM,
        HEAD_DIM_PADDED,
        IS_MASKED,
        False,
        KV_EVICT,
    )
    v = None
    if not LATE_V:
        v = _load_kv_tile(
            value_cache_ptr,
            block_ids,
            tile_start,
            kv_end,
            kv_head_offset,
            stride_cache_block,
            stride_cache_slot,
            BLOCK_SIZE,
            TILE_N,
            HEAD_DIM,
            HEAD_DIM_PADDED,
            IS_MASKED,
            False,
            KV_EVICT,
        )
    return _update(
        acc,
        m_i,
        l_i,
        q,
        q_pos,
        k_floor,
        k,
        v,
        value_cache_ptr,
        block_ids,
        tile_start,
        kv_end,
        kv_head_offset,
        stride_cache_block,
        stride_cache_slot,
        qk_scale,
        softcap,
        BLOCK_SIZE,
        TILE_N,
        HEAD_DIM,
        HEAD_DIM_PADDED,
        DOT_PRECISION,
        IS_MASKED,
        LATE_V,
        USE_DOT,
        KV_EVICT,
        SOFTCAP,
    )


@triton.jit
def _attend_program(
    out_ptr,
    seg_out_ptr,
    seg_max_ptr,
    seg_sum_ptr,
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    sinks_ptr,
    qk_scale,
    softcap,
    v_scale,
    window,
    seq,
    q_block,
    q_start,
    q_len,
    kv_head,
    segment,
    stride_q_token,
    stride_q_head,
    stride_out_token,
    stride_out_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_bt_seq,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PREFETCH: tl.constexpr,
    LOOP_STAGES: tl.constexpr,
    UNROLL: tl.constexpr,
    KV_EVICT: tl.constexpr,
    BT_EVICT: tl.constexpr,
    LATE_V: tl.constexpr,
    USE_DOT: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """One (query block, KV head, segment) work item whose query block holds at least one token."""
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len  # keys before this step's first query token

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PADDED)
    q_idx = q_block * BLOCK_Q + offs_m // GROUP  # [BLOCK_M] query row within the sequence
    head = kv_head * GROUP + offs_m % GROUP  # [BLOCK_M]
    row_valid = (offs_m < BLOCK_Q * GROUP) & (q_idx < q_len)
    d_valid = offs_d < HEAD_DIM
    token = (q_start + q_idx).to(tl.int64)
    q = tl.load(
        query_ptr + token[:, None] * stride_q_token + head[:, None] * stride_q_head + offs_d[None, :],
        mask=row_valid[:, None] & d_valid[None, :],
        other=0.0,
    )  # [BLOCK_M, HEAD_DIM_PADDED]
    if key_cache_ptr.dtype.element_ty == tl.float8e4nv and q.dtype == tl.bfloat16:
        # e4m3 -> fp16 is one exact conversion instruction, e4m3 -> bf16 takes three: on an fp8 cache the
        # dots run in fp16 (q and the probabilities fit it), or the conversions bound the kernel.
        q = q.to(tl.float16)
    q_pos = ctx_len + q_idx

    # Keys [0, kv_end) are visible to some row here, keys [0, kv_full_end) to every row.
    kv_end = ctx_len + tl.minimum(q_block * BLOCK_Q + BLOCK_Q, q_len)
    kv_full_end = ctx_len + q_block * BLOCK_Q + 1
    num_tiles = tl.cdiv(kv_end, TILE_N)
    if HAS_WINDOW:
        # A row sees keys (q_pos - window, q_pos]: tiles wholly before the first row's window are skipped.
        k_floor = q_pos - window
        tile_first = tl.maximum(ctx_len + q_block * BLOCK_Q - window + 1, 0) // TILE_N
    else:
        k_floor = q_pos * 0 - 1
        tile_first = 0
    if NUM_SEGMENTS > 1:
        tiles_per_segment = tl.cdiv(num_tiles - tile_first, NUM_SEGMENTS)
        tile_lo = tile_first + segment * tiles_per_segment
        tile_hi = tl.minimum(tile_lo + tiles_per_segment, num_tiles)
    else:
        tile_lo = tile_first
        tile_hi = num_tiles
    tile_mid = tl.maximum(tl.minimum(kv_full_end // TILE_N, tile_hi), tile_lo)

    block_table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    kv_head_offset = kv_head.to(tl.int64) * stride_cache_head
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PADDED], dtype=tl.float32)
    if HAS_SINKS:
        # The head's sink logit starts segment 0's softmax as a key whose value is zero: it adds
        # exp(sink) to the denominator once (the split-KV reduction then weighs it like any key).
        sink = tl.load(sinks_ptr + head, mask=row_valid, other=0.0).to(tl.float32) * 1.4426950408889634  # log2(e)
        m_i = tl.where(segment == 0, sink, m_i)
        l_i = tl.where(segment == 0, 1.0, l_i)
    if HAS_WINDOW:
        # Tiles the window cuts for some row come first and pay for the mask; from the first tile every
        # row's window holds whole (start >= kv_end - window) on, the loops below run as without one.
        tile_cut_end = tl.cdiv(tl.maximum(kv_end - window, 0), TILE_N)
        tile_cut_end = tl.minimum(tl.maximum(tile_cut_end, tile_lo), tile_mid)
        for t in range(tile_lo, tile_cut_end):
            block_ids = _load_block_ids(block_table_ptr, t * TILE_N, kv_end, BLOCK_SIZE, TILE_N, True, BT_EVICT)
            acc, m_i, l_i = _attend_tile(
                acc,
                m_i,
                l_i,
                q,
                q_pos,
                k_floor,
                key_cache_ptr,
                value_cache_ptr,
                block_ids,
                t * TILE_N,
                kv_end,
                kv_head_offset,
                stride_cache_block,
                stride_cache_slot,
                qk_scale,
                softcap,
                BLOCK_SIZE,
                TILE_N,
                HEAD_DIM,
                HEAD_DIM_PADDED,
                DOT_PRECISION,
                True,
                LATE_V,
                USE_DOT,
                KV_EVICT,
                SOFTCAP,
            )
        tile_lo = tile_cut_end
    if PREFETCH == 0:
        for t in tl.range(tile_lo, tile_mid, num_stages=LOOP_STAGES, loop_unroll_factor=UNROLL):
            block_ids = _load_block_ids(block_table_ptr, t * TILE_N, kv_end, BLOCK_SIZE, TILE_N, False, BT_EVICT)
            acc, m_i, l_i = _attend_tile(
                acc,
                m_i,
                l_i,
                q,
                q_pos,
                k_floor,
                key_cache_ptr,
                value_cache_ptr,
                block_ids,
                t * TILE_N,
                kv_end,
                kv_head_offset,
                stride_cache_block,
                stride_cache_slot,
                qk_scale,
                softcap,
                BLOCK_SIZE,
                TILE_N,
                HEAD_DIM,
                HEAD_DIM_PADDED,
                DOT_PRECISION,
                False,
                LATE_V,
                USE_DOT,
                KV_EVICT,
                SOFTCAP,
            )
    elif PREFETCH == 1:
        # The next tile's block ids load while this tile's K/V stream in, so a K/V address never
        # waits on a block-table load. Masked: the last prefetch may point past the sequence.
        next_ids = _load_block_ids(block_table_ptr, tile_lo * TILE_N, kv_end, BLOCK_SIZE, TILE_N, True, BT_EVICT)
        for t in tl.range(tile_lo, tile_mid, num_stages=LOOP_STAGES, loop_unroll_factor=UNROLL):
            block_ids = next_ids
            next_ids = _load_block_ids(block_table_ptr, (t + 1) * TILE_N, kv_end, BLOCK_SIZE, TILE_N, True, BT_EVICT)
            acc, m_i, l_i = _attend_tile(
                acc,
                m_i,
                l_i,
                q,
                q_pos,
                k_floor,
                key_cache_ptr,
                value_cache_ptr,
                block_ids,
                t * TILE_N,
                kv_end,
                kv_head_offset,
                stride_cache_block,
                stride_cache_slot,
                qk_scale,
                softcap,
                BLOCK_SIZE,
                TILE_N,
                HEAD_DIM,
                HEAD_DIM_PADDED,
                DOT_PRECISION,
                False,
                LATE_V,
                USE_DOT,
                KV_EVICT,
                SOFTCAP,
            )
    else:
        # A software pipeline in registers: block ids two tiles ahead, K/V one tile ahead. Loads past
        # the full tiles are masked off (kv_lim), so the ragged tail is never fetched twice.
        kv_lim = tile_mid * TILE_N
        ids = _load_block_ids(block_table_ptr, tile_lo * TILE_N, kv_lim, BLOCK_SIZE, TILE_N, True, BT_EVICT)
        k_next = _load_kv_tile(
            key_cache_ptr,
            ids,
            tile_lo * TILE_N,
            kv_lim,
            kv_head_offset,
            stride_cache_block,
            stride_cache_slot,
            BLOCK_SIZE,
            TILE_N,
            HEAD_DIM,
            HEAD_DIM_PADDED,
            True,
            True,
            KV_EVICT,
        )
        v_next = _load_kv_tile(
            value_cache_ptr,
            ids,
            tile_lo * TILE_N,
            kv_lim,
            kv_head_offset,
            stride_cache_block,
            stride_cache_slot,
            BLOCK_SIZE,
            TILE_N,
            HEAD_DIM,
            HEAD_DIM_PADDED,
            True,
            True,
            KV_EVICT,
        )
        ids = _load_block_ids(block_table_ptr, (tile_lo + 1) * TILE_N, kv_lim, BLOCK_SIZE, TILE_N, True, BT_EVICT)
        for t in tl.range(tile_lo, tile_mid, num_stages=LOOP_STAGES, loop_unroll_factor=UNROLL):
            k = k_next
            v = v_next
            k_next = _load_kv_tile(
                key_cache_ptr,
                ids,
                (t + 1) * TILE_N,
                kv_lim,
                kv_head_offset,
                stride_cache_block,
                stride_cache_slot,
                BLOCK_SIZE,
                TILE_N,
                HEAD_DIM,
                HEAD_DIM_PADDED,
                True,
                True,
                KV_EVICT,
            )
            v_next = _load_kv_tile(
                value_cache_ptr,
                ids,
                (t + 1) * TILE_N,
                kv_lim,
                kv_head_offset,
                stride_cache_block,
                stride_cache_slot,
                BLOCK_SIZE,
                TILE_N,
                HEAD_DIM,
                HEAD_DIM_PADDED,
                True,
                True,
                KV_EVICT,
            )
            ids = _load_block_ids(block_table_ptr, (t + 2) * TILE_N, kv_lim, BLOCK_SIZE, TILE_N, True, BT_EVICT)
            acc, m_i, l_i = _update(
                acc,
                m_i,
                l_i,
                q,
                q_pos,
                k_floor,
                k,
                v,
                value_cache_ptr,
                ids,
                t * TILE_N,
                kv_end,
                kv_head_offset,
                stride_cache_block,
                stride_cache_slot,
                qk_scale,
                softcap,
                BLOCK_SIZE,
                TILE_N,
                HEAD_DIM,
                HEAD_DIM_PADDED,
                DOT_PRECISION,
                False,
                False,
                USE_DOT,
                KV_EVICT,
                SOFTCAP,
            )
    for t in range(tile_mid, tile_hi):
        block_ids = _load_block_ids(block_table_ptr, t * TILE_N, kv_end, BLOCK_SIZE, TILE_N, True, BT_EVICT)
        acc, m_i, l_i = _attend_tile(
            acc,
            m_i,
            l_i,
            q,
            q_pos,
            k_floor,
            key_cache_ptr,
            value_cache_ptr,
            block_ids,
            t * TILE_N,
            kv_end,
            kv_head_offset,
            stride_cache_block,
            stride_cache_slot,
            qk_scale,
            softcap,
            BLOCK_SIZE,
            TILE_N,
            HEAD_DIM,
            HEAD_DIM_PADDED,
            DOT_PRECISION,
            True,
            LATE_V,
            USE_DOT,
            KV_EVICT,
            SOFTCAP,
        )

    if NUM_SEGMENTS == 1:
        out = acc * (v_scale / l_i)[:, None]
        out_offs = token[:, None] * stride_out_token + head[:, None] * stride_out_head + offs_d[None, :]
        tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & d_valid[None, :])
    else:
        seg_row = (token * NUM_HEADS + head) * NUM_SEGMENTS + segment  # [BLOCK_M] int64
        tl.store(seg_max_ptr + seg_row, m_i, mask=row_valid)
        tl.store(seg_sum_ptr + seg_row, l_i, mask=row_valid)
        seg_offs = seg_row[:, None] * HEAD_DIM_PADDED + offs_d[None, :]
        tl.store(seg_out_ptr + seg_offs, acc * v_scale, mask=row_valid[:, None])


@triton.jit(do_not_specialize=["num_seqs"])
def _paged_attention_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]                     (NUM_SEGMENTS == 1)
    seg_out_ptr,  # [num_tokens, num_heads, NUM_SEGMENTS, HEAD_DIM_PADDED] fp32 (NUM_SEGMENTS > 1)
    seg_max_ptr,  # [num_tokens, num_heads, NUM_SEGMENTS] fp32
    seg_sum_ptr,  # [num_tokens, num_heads, NUM_SEGMENTS] fp32
    query_ptr,  # [num_tokens, num_heads, head_dim]
    key_cache_ptr,  # [num_blocks, BLOCK_SIZE, num_kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, BLOCK_SIZE, num_kv_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens_ptr,  # [num_seqs] int32
    query_start_loc_ptr,  # [num_seqs + 1] int32
    sinks_ptr,  # [num_heads] learned sink logits (HAS_SINKS)
    qk_scale,  # softmax scale * log2(e) * k_scale
    softcap,  # SOFTCAP: the logit cap * log2(e) (capping in the log2 domain)
    v_scale,  # an fp8 cache stores V / v_scale (1.0 otherwise)
    window,  # sliding window (HAS_WINDOW): a query sees keys less than `window` positions back
    num_seqs,
    stride_q_token,
    stride_q_head,
    stride_out_token,
    stride_out_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_bt_seq,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
    IS_DECODE_ONLY: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 (engine runs fp32 models on GPU too), else unused
    PREFETCH: tl.constexpr,  # this and the rest: the AttentionConfig fields (issue 13 variants)
    LOOP_STAGES: tl.constexpr,  # None: the launch's num_stages
    UNROLL: tl.constexpr,  # None: no unrolling
    KV_EVICT: tl.constexpr,  # eviction policy of K/V loads ("" = default)
    BT_EVICT: tl.constexpr,  # eviction policy of block-table loads
    LATE_V: tl.constexpr,
    USE_DOT: tl.constexpr,
    PERSISTENT_PROGRAMS: tl.constexpr,  # > 0 (decode-only): a grid of this many programs looping over work
    HAS_WINDOW: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    SOFTCAP: tl.constexpr,
    USE_PDL: tl.constexpr,  # programmatic dependent launch (kernels/pdl.py)
):
    prologue(USE_PDL)
    if PERSISTENT_PROGRAMS > 0:
        # Work item = (seq, kv head, segment), seq fastest: the order a plain grid would run them in.
        num_kv_heads: tl.constexpr = NUM_HEADS // GROUP
        num_items = num_seqs * (num_kv_heads * NUM_SEGMENTS)
        for item in range(tl.program_id(0), num_items, PERSISTENT_PROGRAMS):
            seq = item % num_seqs
            kv_head = (item // num_seqs) % num_kv_heads
            segment = item // (num_seqs * num_kv_heads)
            q_start = tl.load(query_start_loc_ptr + seq)
            q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
            if q_len > 0:
                _attend_program(
                    out_ptr,
                    seg_out_ptr,
                    seg_max_ptr,
                    seg_sum_ptr,
                    query_ptr,
                    key_cache_ptr,
                    value_cache_ptr,
                    block_tables_ptr,
                    seq_lens_ptr,
                    sinks_ptr,
                    qk_scale,
                    softcap,
                    v_scale,
                    window,
                    seq,
                    0,
                    q_start,
                    q_len,
                    kv_head,
                    segment,
                    stride_q_token,
                    stride_q_head,
                    stride_out_token,
                    stride_out_head,
                    stride_cache_block,
                    stride_cache_slot,
                    stride_cache_head,
                    stride_bt_seq,
                    NUM_HEADS,
                    GROUP,
                    HEAD_DIM,
                    HEAD_DIM_PADDED,
                    BLOCK_SIZE,
                    BLOCK_M,
                    BLOCK_Q,
                    TILE_N,
                    NUM_SEGMENTS,
                    DOT_PRECISION,
                    PREFETCH,
                    LOOP_STAGES,
                    UNROLL,
                    KV_EVICT,
                    BT_EVICT,
                    LATE_V,
                    USE_DOT,
                    HAS_WINDOW,
                    HAS_SINKS,
                    SOFTCAP,
                )
    else:
        q_block_id = tl.program_id(0)
        kv_head = tl.program_id(1)
        segment = tl.program_id(2)
        if IS_DECODE_ONLY:
            seq = q_block_id
            q_block = 0
        else:
            seq = find_seq(query_start_loc_ptr, q_block_id, num_seqs, BLOCK_Q)
            q_block = q_block_id - (tl.load(query_start_loc_ptr + seq) // BLOCK_Q + seq)
        q_start = tl.load(query_start_loc_ptr + seq)
        q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
        if q_block * BLOCK_Q >= q_len:
            return
        if not IS_DECODE_ONLY:
            # The last query block sees the most keys: start it first so the grid ends on light work.
            q_block = tl.cdiv(q_len, BLOCK_Q) - 1 - q_block
        _attend_program(
            out_ptr,
            seg_out_ptr,
            seg_max_ptr,
            seg_sum_ptr,
            query_ptr,
            key_cache_ptr,
            value_cache_ptr,
            block_tables_ptr,
            seq_lens_ptr,
            sinks_ptr,
            qk_scale,
            softcap,
            v_scale,
            window,
            seq,
            q_block,
            q_start,
            q_len,
            kv_head,
            segment,
            stride_q_token,
            stride_q_head,
            stride_out_token,
            stride_out_head,
            stride_cache_block,
            stride_cache_slot,
            stride_cache_head,
            stride_bt_seq,
            NUM_HEADS,
            GROUP,
            HEAD_DIM,
            HEAD_DIM_PADDED,
            BLOCK_SIZE,
            BLOCK_M,
            BLOCK_Q,
            TILE_N,
            NUM_SEGMENTS,
            DOT_PRECISION,
            PREFETCH,
            LOOP_STAGES,
            UNROLL,
            KV_EVICT,
            BT_EVICT,
            LATE_V,
            USE_DOT,
            HAS_WINDOW,
            HAS_SINKS,
            SOFTCAP,
        )


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    scale: float,
    config: AttentionConfig,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
    k_scale: float = 1.0,  # an fp8 cache holds K / k_scale and V / v_scale
    v_scale: float = 1.0,
    window: int | None = None,  # sliding window: a query sees keys less than `window` positions back
    sinks: torch.Tensor | None = None,  # [num_heads] learned logit per head in each softmax denominator
    softcap: float | None = None,  # attention-logit soft-capping (Gemma 2): logits -> cap * tanh(logits / cap)
) -> torch.Tensor:
    """Launch the kernel (plus the split-KV reduction when config.num_segments > 1); no host sync."""
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    num_seqs = seq_lens.shape[0]
    group = num_heads // num_kv_heads
    assert num_heads == group * num_kv_heads and kv_cache.shape[4] == head_dim
    assert query.stride(2) == 1 and kv_cache.stride(4) == 1 and block_tables.stride(1) == 1
    assert config.block_m >= group, "a program must hold all query heads of its KV head"
    # The no-dot path (CUDA-core FMAs for a few rows) is checked on decode batches only; on a mixed batch it
    # missed the reference on an H100.
    assert config.use_dot or config.is_decode_only, "use_dot=False is for decode-only batches"
    assert sinks is None or (sinks.shape == (num_heads,) and sinks.is_contiguous())
    assert softcap is None or softcap > 0, "a logit cap must be positive"
    if out is None:
        out = torch.empty_like(query)
    head_dim_padded = next_power_of_2(head_dim)
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    block_q = config.block_q(group)
    num_q_blocks = num_seqs if config.is_decode_only else num_tokens // block_q + num_seqs
    num_segments = config.num_segments
    if num_segments > 1:
        seg_out = query.new_empty((num_tokens, num_heads, num_segments, head_dim_padded), dtype=torch.float32)
        seg_max = query.new_empty((num_tokens, num_heads, num_segments), dtype=torch.float32)
        seg_sum = torch.empty_like(seg_max)
    else:
        seg_out = seg_max = seg_sum = out  # unused by the kernel in this mode
    if config.persistent_programs > 0:
        assert config.is_decode_only, "persistent programs walk (seq, kv head, segment) items"
        grid: tuple[int, ...] = (min(config.persistent_programs, num_seqs * num_kv_heads * num_segments),)
    else:
        grid = (num_q_blocks, num_kv_heads, num_segments)
    _paged_attention_kernel[grid](
        out,
        seg_out,
        seg_max,
        seg_sum,
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        query if sinks is None else sinks,  # any pointer when unused
        scale * LOG2_E * k_scale,
        (softcap or 0.0) * LOG2_E,
        v_scale,
        window or 0,
        num_seqs,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        block_tables.stride(0),
        NUM_HEADS=num_heads,
        GROUP=group,
        HEAD_DIM=head_dim,
        HEAD_DIM_PADDED=head_dim_padded,
        BLOCK_SIZE=block_size,
        BLOCK_M=config.block_m,
        BLOCK_Q=block_q,
        TILE_N=config.tile_n,
        NUM_SEGMENTS=num_segments,
        IS_DECODE_ONLY=config.is_decode_only,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        PREFETCH=config.prefetch,
        LOOP_STAGES=config.loop_stages or None,
        UNROLL=config.unroll or None,
        KV_EVICT="evict_first" if config.evict_kv else "",
        BT_EVICT="evict_last" if config.evict_kv else "",
        LATE_V=config.late_v,
        USE_DOT=config.use_dot,
        PERSISTENT_PROGRAMS=config.persistent_programs,
        HAS_WINDOW=window is not None,
        HAS_SINKS=sinks is not None,
        SOFTCAP=softcap is not None,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **pdl.launch(query.device),
    )
    if num_segments > 1:
        reduce_segments(out, seg_out, seg_max, seg_sum)
    return out
