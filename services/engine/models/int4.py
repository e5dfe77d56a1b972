"""4-bit weights with 16-bit activations (W4A16), in the two layouts people download: AWQ and GPTQ.

Both store, per linear with K inputs and N outputs, 4-bit integers q, per-group zeros z and scales s
(a group = `group_size` consecutive input rows), and mean  W[k, n] = (q[k, n] - z[g(k), n]) * s[g(k), n]
with  y = x @ W. They differ in how the nibbles are packed into int32:

    AWQ (AutoAWQ "gemm")  qweight [K, N/8]  eight outputs per int32, nibble i holds column AWQ_ORDER[i]
                          qzeros  [K/G, N/8] packed the same way;  scales [K/G, N];  g(k) = k // G
    GPTQ (AutoGPTQ v1)    qweight [K/8, N]  eight inputs per int32, nibble i holds row 8r + i
                          qzeros  [K/G, N/8] sequential nibbles, stored as z - 1 ("gptq_v2": as z)
                          scales  [K/G, N];  g_idx [K] (act order: any row to any group; else k // G)

`Int4Linear` keeps the packed tensors (4 bits a weight on the device). Once loaded (`finish_loading`), AWQ is
repacked to GPTQ's K-major layout, act order's rows sorted by group, and the rows interleaved in tiles of 128
(models/int4_repack.py). On CUDA a tiled layer multiplies with the Triton GEMV (kernels/w4a16_gemv.py) for
one row (decode at batch 1), the fused dequantise-GEMM up to 256 rows, and above that by dequantising the
weight once for cuBLAS (kernels/w4a16_gemm.py); a layer that cannot be tiled (K not whole tiles of 128,
act order with uneven groups) keeps GPTQ's layout and the GEMM for every M. Elsewhere it dequantises and
uses torch.
Fused q/k/v and gate/up load as output-column shards, like the full-precision layers.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.kernels.expert_quant import pack_int4
from pagedserve.services.engine.models.compressed_tensors import checkpoint_parts
from pagedserve.services.engine.models.int4_repack import (
    can_tile,
    group_sort,
    k_major,
    pack_columns,
    tile_rows,
    tiled_order,
)
from pagedserve.services.engine.models.layers import replace_decoder_linears

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a packed AWQ int32 holds output column AWQ_ORDER[i]
FORMATS = ("awq", "gptq")
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[..., M] int32 -> [..., M, 8] int32: each int32's eight 4-bit values, nibble 0 first."""
    return (packed[..., None] >> _SHIFTS.to(packed.device)) & 0xF


def unpack_columns(packed: torch.Tensor, fmt: str) -> torch.Tensor:
    """[R, N/8] int32 packed along the columns -> [R, N] int32, in column order."""
    values = _nibbles(packed)  # [R, N/8, 8]: nibble order
    if fmt == "awq":  # nibble i is column AWQ_ORDER[i] of its group of eight
        values = values[..., torch.argsort(torch.tensor(AWQ_ORDER))]
    return values.reshape(packed.shape[0], -1)


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """GPTQ's qweight [K/8, N] int32 packed along the rows -> [K, N] int32."""
    return _nibbles(packed).permute(0, 2, 1).reshape(-1, packed.shape[1])


def dequantize(
    fmt: str,  # "awq", "gptq" or "tiled" (models/int4_repack.py)
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    group_size: int,
    zero_offset: int = 0,
) -> torch.Tensor:
    """The weight W [K, N] as `scales`' dtype (the reference the kernel is checked against)."""
    q = unpack_columns(qweight, "awq") if fmt == "awq" else unpack_rows(qweight)
    if fmt == "tiled":  # stored row m holds input tiled_order[m]
        q = q[torch.argsort(tiled_order(q.shape[0]).to(q.device))]
    zeros = unpack_columns(qzeros, "awq" if fmt == "awq" else "gptq") + zero_offset
    groups = g_idx.long() if g_idx is not None else torch.arange(q.shape[0], device=q.device) // group_size
    return ((q - zeros[groups]).to(scales.dtype)) * scales[groups]


def int4_format(cfg: dict[str, Any]) -> tuple[str, int, int] | None:
    """(format, group size (0: per output channel), zero offset) of a 4-bit AWQ/GPTQ checkpoint's config.json, or
    None (8-bit GPTQ too); raises ValueError naming what is not supported (other bit widths, AWQ's gemv/marlin
    packings, per-channel AWQ)."""
    qc = cfg.get("quantization_config") or {}
    method = qc.get("quant_method")
    if method not in FORMATS:
        return None
    bits = qc.get("bits", qc.get("w_bit"))
    if method == "gptq" and bits == 8:
        return None  # models/gptq8.py's
    if bits != 4:
        raise ValueError(f"quantization: {method} with {bits}-bit weights is not supported (4-bit; GPTQ also 8-bit)")
    group_size = int(qc.get("group_size", qc.get("q_group_size", 128)))
    if group_size <= 0 and method == "awq":
        raise ValueError(f"quantization: AWQ group_size {group_size} (per-channel) is not supported (groups of rows)")
    group_size = max(group_size, 0)  # GPTQ's -1: one group of each linear's inputs (per output channel)
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"quantization: AWQ version {version!r} is not supported (gemm only)")
        if qc.get("zero_point") is False:  # symmetric AWQ stores no qzeros
            raise ValueError("quantization: AWQ without zero points (zero_point: false) is not supported")
        if str(qc.get("backend") or "autoawq").lower() != "autoawq":  # llm-awq packs its own way, same shapes
            raise ValueError(f"quantization: AWQ backend {qc['backend']!r} is not supported (autoawq's GEMM packing)")
        return "awq", group_size, 0
    refuse_per_module_overrides(qc)
    return "gptq", group_size, gptq_zero_offset(qc)


def gptq_zero_offset(qc: dict[str, Any]) -> int:
    """1 for GPTQ v1 checkpoints, which store each zero point minus one; 0 for v2. Other packings AutoGPTQ /
    GPTQModel can save (marlin, AutoGPTQ's older `is_marlin_format`, bitblas, ...; codes in int8/int16/int64 words,
    GPTQModel's `pack_dtype`) lay the codes out differently: refused rather than misread."""
    checkpoint_format = qc.get("checkpoint_format") or ("marlin" if qc.get("is_marlin_format") else "gptq")
    if checkpoint_format not in ("gptq", "gptq_v2"):
        raise ValueError(f"quantization: GPTQ checkpoint_format {checkpoint_format!r} is not supported (gptq, gptq_v2)")
    pack_dtype = str(qc.get("pack_dtype") or "int32").removeprefix("torch.")
    if pack_dtype != "int32":
        raise ValueError(f"quantization: GPTQ pack_dtype {pack_dtype!r} is not supported (codes packed in int32)")
    return 0 if checkpoint_format == "gptq_v2" else 1


# GPTQModel `dynamic` override fields that leave a linear's tensors laid out as the base config's: the zero points
# (`sym`) and act order (`desc_act`) are read from the tensors themselves (qzeros; g_idx, see Int4Linear.load_weight),
# the rest only steered the quantizer. bits and group_size size the tensors: they must equal the base config's.
LAYOUT_NEUTRAL_OVERRIDES = frozenset(
    {
        "desc_act",
        "sym",
        "damp_percent",
        "damp_auto_increment",
        "static_groups",
        "true_sequential",
        "mse",
        "act_group_aware",
        "v2",
        "v2_alpha",
        "hyb_act",
    }
)


def refuse_per_module_overrides(qc: dict[str, Any]) -> None:
    """GPTQModel's `dynamic` rules: "-:<regex>" skips modules (`unconverted_linears` keeps them in full
    precision); "+:<regex>" (or a bare regex) overrides settings of the modules it matches. Overrides that leave
    the tensors' layout alone (LAYOUT_NEUTRAL_OVERRIDES, or a value equal to the base config's) are accepted;
    others, such as another bit width or group size, raise ValueError naming the rule and field."""
    for key, rule in (qc.get("dynamic") or {}).items():
        if str(key).startswith("-:"):
            continue
        if not isinstance(rule, dict):
            raise ValueError(f"quantization: GPTQModel's dynamic rule {key!r} is {rule!r}, not a dict of overrides")
        changed = {
            field: value
            for field, value in rule.items()
            if field not in LAYOUT_NEUTRAL_OVERRIDES and not (field in qc and _same_setting(field, value, qc[field]))
        }
        if changed:
            raise ValueError(
                f"quantization: GPTQModel's per-module overrides (dynamic {key!r}: {changed}) are not supported (every "
                f"quantized linear loads with the config's bits {qc.get('bits')} and group size "
                f"{qc.get('group_size')}; overrides of {', '.join(sorted(LAYOUT_NEUTRAL_OVERRIDES))} and '-:' rules "
                "that skip modules are)"
            )


def _same_setting(field: str, value: Any, base: Any) -> bool:
    if field == "group_size":  # -1 and 0 both mean one group of each linear's inputs
        return max(int(value), 0) == max(int(base), 0)
    return bool(value == base)


def unconverted_linears(cfg: dict[str, Any]) -> Callable[[str], bool] | None:
    """Which of our linears an AWQ / GPTQ checkpoint left in full precision, or None (all are 4-bit):
    `modules_to_not_convert` (AutoAWQ, transformers: a module whose name contains one of them), GPTQModel's
    `dynamic` rules whose key is "-:<regex>" (modules matching it were skipped), and GPTQ's
    `modules_in_block_to_quantize` (lists of names within a decoder layer, e.g. "self_attn.q_proj": the linears
    none of them names were not quantized). A fused linear (qkv_proj, gate_up_proj) follows its checkpoint parts;
    parts that differ raise ValueError (`whole_linears`)."""
    qc = cfg.get("quantization_config") or {}
    contained = [str(key) for key in qc.get("modules_to_not_convert") or ()]
    skipped = [re.compile(key[2:]) for key in qc.get("dynamic") or {} if str(key).startswith("-:")]
    in_block = _modules_in_block(qc)
    if not contained and not skipped and in_block is None:
        return None

    def is_skipped(name: str) -> bool:
        return any(key in name for key in contained) or any(p.match(name) for p in skipped)

    skip = whole_linears(is_skipped, "modules_to_not_convert / dynamic '-:' rules")
    if in_block is None:
        return skip
    listed = in_block

    def is_listed(name: str) -> bool:
        return any(name == entry or name.endswith(f".{entry}") for entry in listed)

    quantized = whole_linears(is_listed, "modules_in_block_to_quantize")
    return lambda name: skip(name) or not quantized(name)


def _modules_in_block(qc: dict[str, Any]) -> list[str] | None:
    """GPTQ's `modules_in_block_to_quantize` flattened (a list of lists of names, or a flat list); None if absent."""
    groups = qc.get("modules_in_block_to_quantize")
    if not groups:
        return None
    names: list[str] = []
    for group in groups:
        names.extend([group] if isinstance(group, str) else group)
    return [str(name).strip(".") for name in names]


def whole_linears(matches: Callable[[str], bool], rule: str) -> Callable[[str], bool]:
    """`matches` of a checkpoint's module names, for ours: a linear we fuse (qkv_proj, gate_up_proj) matches when
    every checkpoint part it holds does (q/k/v_proj, gate/up_proj), or none does but its own name does (a
    checkpoint that stores it fused, Phi-3's); any other linear when its name does. Parts that disagree cannot
    load as one layer: ValueError naming them and `rule`."""

    def match_ours(name: str) -> bool:
        parts = checkpoint_parts(name)
        hits = [part for part in parts if matches(part)]
        if hits and len(hits) != len(parts):
            raise ValueError(
                f"quantization: the checkpoint's {rule} name {hits} but not "
                f"{[part for part in parts if part not in hits]}: the parts of our fused {name} must share one "
                "precision"
            )
        return bool(hits) or matches(name)

    return match_ours


class Int4Linear(nn.Module):
    """A linear layer with packed 4-bit weights [K, N]; may hold fused output shards (q/k/v, gate/up)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype,
        fmt: str,
        group_size: int,
        zero_offset: int = 0,
        shard_offsets: dict[str, tuple[int, int]] | None = None,
        num_groups: int | None = None,  # scales of more inputs than these (an act-order tensor-parallel shard)
    ) -> None:
        super().__init__()
        if fmt not in FORMATS:
            raise ValueError(f"quantization: {fmt!r} is not one of {', '.join(FORMATS)}")
        if (num_groups is None and in_features % group_size) or out_features % 8 or in_features % 8:
            raise ValueError(
                f"quantization: a {in_features}x{out_features} linear does not split into groups of "
                f"{group_size} inputs and packs of 8"
            )
        self.in_features, self.out_features = in_features, out_features
        self.fmt, self.group_size, self.zero_offset = fmt, group_size, zero_offset
        k, n, groups = in_features, out_features, num_groups or in_features // group_size
        packed_shape = (k, n // 8) if fmt == "awq" else (k // 8, n)
        self.qweight = nn.Parameter(torch.empty(packed_shape, dtype=torch.int32), requires_grad=False)
        self.qzeros = nn.Parameter(torch.empty((groups, n // 8), dtype=torch.int32), requires_grad=False)
        self.scales = nn.Parameter(torch.empty((groups, n), dtype=dtype), requires_grad=False)
        # GPTQ: each input row's group (act order permutes them); filled as k // G unless the checkpoint has one.
        self.g_idx = nn.Parameter(torch.empty(k, dtype=torch.int32), requires_grad=False) if fmt == "gptq" else None
        self.has_act_order = False  # g_idx is not k // G: the kernel reads it
        self.sorts_act_order = num_groups is None  # act order's rows sorted by group at load (scales of these rows)
        self._g_idx_loaded = False
        self.bias = nn.Parameter(torch.empty(n, dtype=dtype), requires_grad=False) if bias else None
        self.shard_offsets = shard_offsets or {}
        self.packed_fmt = fmt  # the tensors' layout: "tiled" (or "gptq") once finish_loading repacked them
        # Act order sorted at load: the stored row i is input row input_perm[i] ([K] int64; None: no gather).
        self.input_perm: torch.Tensor | None
        self.register_buffer("input_perm", None, persistent=False)

    @classmethod
    def like(cls, linear: nn.Linear, fmt: str, group_size: int, zero_offset: int) -> Int4Linear:
        """An empty Int4Linear of `linear`'s shape (same device, e.g. meta)."""
        with linear.weight.device:
            return cls(
                linear.in_features,
                linear.out_features,
                linear.bias is not None,
                linear.weight.dtype,
                fmt,
                group_size,
                zero_offset,
                getattr(linear, "shard_offsets", None),
            )

    @property
    def act_order(self) -> torch.Tensor | None:
        """g_idx when it is not the plain k // G (the kernel then reads a group per row)."""
        return self.g_idx.data if self.g_idx is not None and self.has_act_order else None

    def dequantized(self) -> torch.Tensor:
        """The dequantised weight [K, N] (rows in the checkpoint's input order, however stored)."""
        g_idx = self.act_order
        stored = dequantize(
            self.packed_fmt, self.qweight, self.qzeros, self.scales, g_idx, self.group_size, self.zero_offset
        )
        if self.input_perm is None:
            return stored
        weight = torch.empty_like(stored)
        weight[self.input_perm] = stored
        return weight

    def finish_loading(self) -> None:
        """Repack, once every shard is in, into the kernels' layout (exact): AWQ's column packing becomes GPTQ's
        row packing; act order's rows are sorted by group (x is then gathered); then the rows are interleaved in
        tiles of 128 (models/int4_repack.py) where whole tiles and groups of >= 16 allow it."""
        k, n = self.in_features, self.out_features
        qweight = self.qweight.data
        if qweight.is_cuda:  # the split-K counters (GEMV and GEMM) exist before any CUDA graph is captured
            from pagedserve.kernels.w4a16_gemv import reserve_split_counters

            reserve_split_counters(qweight.device)
        if self.packed_fmt == "awq":
            self.qweight.data = k_major(lambda ks: unpack_columns(qweight[ks.to(qweight.device)], "awq"), k, n)
            self.qzeros.data = pack_columns(unpack_columns(self.qzeros.data, "awq"))
            self.packed_fmt = "gptq"
        elif self.has_act_order and self.g_idx is not None:
            if not self.sorts_act_order:  # g_idx indexes scales beyond these rows': the GEMM reads it as it is
                return
            perm = group_sort(self.g_idx.data, self.group_size)
            if perm is None:  # groups of uneven sizes: the GEMM looks each row's group up
                return
            perm = perm.to(qweight.device)

            def sorted_rows(ks: torch.Tensor) -> torch.Tensor:
                rows = perm[ks.to(qweight.device)]
                return (qweight[rows // 8] >> (4 * (rows % 8)).to(torch.int32)[:, None]) & 0xF

            self.qweight.data = k_major(sorted_rows, k, n)
            self.g_idx.data.copy_(self.plain_groups())
            self.has_act_order = False
            self.input_perm = perm
        if self.packed_fmt == "gptq" and self.act_order is None and can_tile(k, self.group_size):
            self.qweight.data = tile_rows(self.qweight.data)
            self.packed_fmt = "tiled"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.product(x)
        return out if self.bias is None else out + self.bias

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W without the bias (a row-parallel shard adds it once, after the all-reduce)."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if x.is_cuda:
            from pagedserve.kernels.w4a16_gemm import w4a16_matmul  # triton: CUDA machines only
            from pagedserve.kernels.w4a16_gemv import MAX_ROWS, w4a16_gemv

            if self.input_perm is not None:
                x2 = x2.index_select(1, self.input_perm)
            g_idx, fmt = self.act_order, self.packed_fmt
            if x2.shape[0] <= MAX_ROWS and fmt == "tiled":
                out = w4a16_gemv(x2, self.qweight, self.qzeros, self.scales, self.group_size, self.zero_offset)
            else:
                out = w4a16_matmul(
                    x2, self.qweight, self.qzeros, self.scales, g_idx, self.group_size, fmt, self.zero_offset
                )
        else:
            out = x2 @ self.dequantized().to(x.dtype)
        return out.view(*lead, self.out_features)

    def load_weight(self, param_name: str, loaded: torch.Tensor, shard_id: str | None) -> list[str]:
        """Copy a checkpoint tensor (or one fused shard's) in; returns the parameter names written."""
        start, size = self.shard_offsets[shard_id] if shard_id is not None else (0, self.out_features)
        if param_name == "g_idx":
            if self.g_idx is None:
                raise ValueError(f"g_idx: an {self.fmt} linear has no act order")
            self.g_idx.data.copy_(loaded)  # q/k/v (gate/up) see the same inputs: one permutation
            self.has_act_order = not torch.equal(self.g_idx.data.cpu(), self.plain_groups())
            self._g_idx_loaded = True
            return ["g_idx"]
        if param_name == "bias":
            assert self.bias is not None
            self.bias.data[start : start + size].copy_(loaded)
            return ["bias"]
        if param_name not in ("qweight", "qzeros", "scales"):
            raise ValueError(f"{param_name}: not a tensor of a 4-bit {self.fmt} linear")
        target = getattr(self, param_name).data
        packed_columns = param_name == "qzeros" or (param_name == "qweight" and self.fmt == "awq")
        cols = slice(start // 8, (start + size) // 8) if packed_columns else slice(start, start + size)
        if target[:, cols].shape != loaded.shape:
            raise ValueError(
                f"{param_name}: shape {tuple(loaded.shape)} does not fit {tuple(target[:, cols].shape)} "
                f"(a {self.fmt} linear of {self.in_features} inputs, group size {self.group_size})"
            )
        target[:, cols].copy_(loaded)
        if self.g_idx is not None and param_name == "qweight" and not self._g_idx_loaded:
            self.g_idx.data.copy_(self.plain_groups())  # until (unless) the checkpoint's own arrives
            return ["qweight", "g_idx"]
        return [param_name]

    def plain_groups(self) -> torch.Tensor:
        return (torch.arange(self.in_features) // self.group_size).to(torch.int32)


def quantize_linears_int4(
    model: nn.Module,
    fmt: str,
    group_size: int,
    zero_offset: int,
    keep: Callable[[str], bool] | None = None,
) -> int:
    """Swap every nn.Linear inside the decoder layers for an (empty) Int4Linear; returns how many.
    Called on the meta-device model before loading; embeddings, lm_head and MoE routers stay in full precision,
    and so do linears `keep` names (full module names, e.g. model.layers.0.mlp.down_proj). group_size 0: per
    output channel (one group of each linear's inputs)."""

    def make(_: str, linear: nn.Linear) -> Int4Linear:
        return Int4Linear.like(linear, fmt, group_size or linear.in_features, zero_offset)

    return replace_decoder_linears(model, make, keep)


def largest_dequantized_bytes(model: nn.Module) -> int:
    """Bytes of the largest weight the W4A16 GEMM dequantises whole for a prefill-sized step
    (kernels/w4a16_gemm.DEQUANTIZE_ABOVE_ROWS): scratch that a CUDA graph's memory pool keeps."""
    return max(
        (
            m.in_features * m.out_features * m.scales.element_size()
            for m in model.modules()
            if isinstance(m, Int4Linear) and m.packed_fmt == "tiled"
        ),
        default=0,
    )


def linear_reference(x: torch.Tensor, layer: Int4Linear) -> torch.Tensor:
    """What Int4Linear computes, in float32 (for tests and the kernel's check)."""
    return F.linear(x.float(), layer.dequantized().float().t(), None if layer.bias is None else layer.bias.float())


_PACKED = ("qweight", "qzeros", "scales")
HEADS = ("lm_head", "embed_out")  # the LM head's checkpoint names (GPT-NeoX: embed_out); a quantized one is dequantised


def dequantize_experts(
    tensors: Iterable[tuple[str, torch.Tensor]], fmt: str, group_size: int, zero_offset: int, act_order: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    """4-bit MoE checkpoints (Qwen3-30B-A3B-GPTQ-Int4, Mixtral AWQ) quantise the experts too; where ours hold
    them in full precision (off CUDA, or act order: see models/quantized_experts.py), each expert linear's packed
    tensors are dequantised to its `weight` [N, K] as they stream in, in any order. A GPTQ expert waits for its
    g_idx when the checkpoint is act-order (`desc_act`); otherwise its g_idx, plain k // G, is dropped. The loader
    runs every 4-bit checkpoint through this (or `repack_experts`), so a quantized LM head is dequantised here too."""

    def convert(linear: str, parts: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
        return [(f"{linear}.weight", _dequantized_linear(linear, parts, fmt, group_size, zero_offset, act_order))]

    return _each_expert_linear(tensors, fmt, group_size, zero_offset, act_order, convert)


def repack_experts(
    tensors: Iterable[tuple[str, torch.Tensor]], fmt: str, group_size: int, zero_offset: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """Each expert linear's packed tensors -> the fused-MoE kernel's int4 layout (kernels/expert_quant.py), as
    models/quantized_experts.Int4Experts loads it: `weight` uint8 [N, K / 2] (codes along K, the low nibble
    first), `weight_scale` [N, K / G], `weight_zeros` uint8 [N, K / G] (GPTQ v1's stored z - 1 plus one).
    Exact: the same codes, zero points and scales. Act-order experts cannot be repacked (their g_idx is refused).
    A quantized LM head is dequantised to its `weight`."""

    def convert(linear: str, parts: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
        return _repacked_expert(linear, parts, fmt, group_size, zero_offset)

    return _each_expert_linear(tensors, fmt, group_size, zero_offset, False, convert)


def _each_expert_linear(
    tensors: Iterable[tuple[str, torch.Tensor]],
    fmt: str,
    group_size: int,
    zero_offset: int,
    act_order: bool,
    convert: Callable[[str, dict[str, torch.Tensor]], list[tuple[str, torch.Tensor]]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """Gathers each expert linear's qweight/qzeros/scales (and act order's g_idx) in any order, then yields what
    `convert` makes of them; other tensors pass through. A quantized LM head (GPTQModel's `lm_head: true`) is
    gathered the same way and dequantised to its `weight` (our head is a full-precision linear)."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    done: dict[str, int] = {}  # converted expert linears: their number of inputs, to check a late g_idx
    for name, tensor in tensors:
        linear, _, part = name.rpartition(".")
        is_head = linear in HEADS
        if not (is_head or ".experts." in name) or part not in (*_PACKED, "g_idx"):
            yield name, tensor
            continue
        if linear in done:  # a g_idx after its expert was converted with plain groups: it must be plain
            check_plain_g_idx(name, tensor, done[linear], group_size)
            continue
        parts = pending.setdefault(linear, {})
        parts[part] = tensor
        if all(p in parts for p in _PACKED) and (fmt != "gptq" or not act_order or "g_idx" in parts):
            del pending[linear]
            done[linear] = parts["qweight"].shape[0] * (1 if fmt == "awq" else 8)
            if is_head:
                weight = _dequantized_linear(linear, parts, fmt, group_size, zero_offset, act_order)
                yield f"{linear}.weight", weight
            else:
                yield from convert(linear, parts)
    if pending:
        missing = {linear: sorted(set(_PACKED) - set(parts)) or ["g_idx"] for linear, parts in pending.items()}
        raise ValueError(f"4-bit experts lack tensors: {dict(list(missing.items())[:4])}")


def check_plain_g_idx(name: str, g_idx: torch.Tensor, num_inputs: int, group_size: int) -> None:
    """A g_idx the config says is not act order (desc_act false) must be the plain k // G: one that reorders rows
    would be ignored, silently giving wrong weights."""
    plain = torch.arange(num_inputs) // (group_size or num_inputs)
    if g_idx.shape != plain.shape or not torch.equal(g_idx.long().cpu(), plain):
        raise ValueError(f"{name}: rows in act order, but the config's desc_act is false")


def _repacked_expert(
    linear: str, parts: dict[str, torch.Tensor], fmt: str, group_size: int, zero_offset: int
) -> list[tuple[str, torch.Tensor]]:
    qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"]
    q = unpack_columns(qweight, "awq") if fmt == "awq" else unpack_rows(qweight)  # [K, N]
    num_inputs, groups = q.shape[0], q.shape[0] // (group_size or q.shape[0])
    zeros = unpack_columns(qzeros, fmt) + zero_offset  # [K / G, N]
    if zeros.shape != scales.shape or scales.shape != (groups, q.shape[1]) or num_inputs % (group_size or 1):
        raise ValueError(
            f"{linear}: its 4-bit tensors do not fit together (codes {tuple(q.shape)}, zeros {tuple(zeros.shape)}, "
            f"scales {tuple(scales.shape)}, group size {group_size})"
        )
    g_idx = parts.get("g_idx")
    if g_idx is not None and not torch.equal(g_idx.long().cpu(), torch.arange(num_inputs) // (num_inputs // groups)):
        raise ValueError(f"{linear}.g_idx: act-order experts cannot stay 4-bit (load them dequantised)")
    return [
        (f"{linear}.weight", pack_int4(q.t())),
        (f"{linear}.weight_scale", scales.t().contiguous()),
        (f"{linear}.weight_zeros", zeros.t().to(torch.uint8).contiguous()),
    ]


def _dequantized_linear(
    linear: str, parts: dict[str, torch.Tensor], fmt: str, group_size: int, zero_offset: int, act_order: bool
) -> torch.Tensor:
    num_inputs = parts["qweight"].shape[0] * (1 if fmt == "awq" else 8)
    groups = group_size or num_inputs  # 0: per output channel
    _check_group_shapes(linear, parts, fmt, groups)
    g_idx = parts.get("g_idx")
    if g_idx is not None and not act_order:  # plain k // G, or rows the config says are not reordered
        check_plain_g_idx(f"{linear}.g_idx", g_idx, num_inputs, group_size)
        g_idx = None
    try:
        scales = parts["scales"].float()  # fp16 in checkpoints: the products rounded to fp16 would lose bits
        weight = dequantize(fmt, parts["qweight"], parts["qzeros"], scales, g_idx, groups, zero_offset)
    except (RuntimeError, IndexError) as e:  # shapes that do not pack together
        raise ValueError(f"{linear}: its 4-bit tensors do not fit together ({e})") from None
    return weight.t().contiguous()  # [K, N] -> HF's [N, K]


def _check_group_shapes(linear: str, parts: dict[str, torch.Tensor], fmt: str, group_size: int) -> None:
    """scales [K/G, N] and qzeros [K/G, N/8] for the K inputs and N outputs qweight packs: tensors of another group
    size than the config's would still index (wrong groups, silently), so they are refused by name."""
    qweight = parts["qweight"]
    k, n = (qweight.shape[0], qweight.shape[1] * 8) if fmt == "awq" else (qweight.shape[0] * 8, qweight.shape[1])
    want = {"scales": (k // group_size, n), "qzeros": (k // group_size, n // 8)}
    wrong = {part: tuple(parts[part].shape) for part, shape in want.items() if tuple(parts[part].shape) != shape}
    if wrong or k % group_size:
        raise ValueError(
            f"{linear}: its 4-bit tensors do not fit the config's group size {group_size} (qweight "
            f"{tuple(qweight.shape)}: {k} inputs, {n} outputs; want scales {want['scales']}, qzeros {want['qzeros']}; "
            f"got {wrong or 'inputs not whole groups'})"
        )
