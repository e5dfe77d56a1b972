"""compressed-tensors "pack-quantized" int4 weights (llm-compressor's W4A16 / GPTQ exports), loaded as GPTQ.

Per linear with K inputs and N outputs the checkpoint holds (compressed_tensors/compressors/pack_quantized):

    weight_packed      [N, K/8] int32  eight inputs per int32, nibble i holds input 8c + i, stored as q + 8
    weight_scale       [N, K/G]        (strategy "channel": [N, 1], one group of all K inputs)
    weight_zero_point  [N/8, K/G] int32  asymmetric only: packed along the OUTPUT dim, stored as z + 8
    weight_g_idx       [K]             actorder "group" (older exports): the group of each input
    weight_shape       [2]             (N, K)

with q and z signed (-8..7) and  W[n, k] = (q[n, k] - z[n, g(k)]) * s[n, g(k)]  (z = 0 when symmetric).
Since q + 8 - (z + 8) = q - z, the stored unsigned values are GPTQ's "v2" nibbles (no minus-one), and
both packings are GPTQ's transposed: weight_packed.T is GPTQ's qweight [K/8, N] and weight_zero_point.T
its qzeros [K/G, N/8]. So each tensor converts on its own as it streams in (`to_gptq`), and Int4Linear
(fmt "gptq", zero offset 0) with its kernel serves it unchanged. Symmetric checkpoints have no zero
point: the scale brings a qzeros of all 8s.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from pagedserve.services.engine.models.llama import PACKED_PROJECTIONS

METHOD = "compressed-tensors"
_SYMMETRIC_ZEROS = -0x77777778  # 0x88888888 as int32: eight nibbles of 8, the stored zero of a signed 0
_SUFFIXES = ("weight_packed", "weight_scale", "weight_zero_point", "weight_g_idx", "weight_shape")


@dataclass(frozen=True)
class PackQuantized:
    group_size: int  # 0: per output channel (each linear is one group of all its inputs)
    symmetric: bool
    ignore: tuple[str, ...]  # linears left in full precision ("re:" prefix: a regex), as the checkpoint says


def pack_quantized_format(cfg: dict[str, Any]) -> PackQuantized | None:
    """The scheme of a compressed-tensors checkpoint with integer weights, or None (not compressed-tensors,
    or float weights: fp8.py's); raises ValueError naming what is supported for anything else."""
    qc = cfg.get("quantization_config") or cfg.get("compression_config") or {}
    if qc.get("quant_method") != METHOD:
        return None
    groups = list((qc.get("config_groups") or {}).values())
    schemes = [g.get("weights") or {} for g in groups]
    if not schemes or any(s.get("type", "int") != "int" for s in schemes):
        return None  # float (fp8) weights, or nothing quantised: not ours
    if all(s.get("num_bits") == 8 for s in schemes):
        return None  # 8-bit int weights: compressed_int8.py's
    supported = "4-bit int weights, pack-quantized, group or channel strategy, no activation quantization; 8-bit int"
    if any(s != schemes[0] for s in schemes):
        raise ValueError(f"quantization: compressed-tensors config groups with different weight schemes ({supported})")
    weights = schemes[0]
    formats = {g.get("format") or qc.get("format") for g in groups}
    problems = [
        f"format {sorted(map(str, formats))}" if formats != {"pack-quantized"} else "",
        f"{weights.get('num_bits')}-bit weights" if weights.get("num_bits") != 4 else "",
        f"strategy {weights.get('strategy')!r}" if weights.get("strategy") not in ("group", "channel") else "",
        "activation quantization" if any(g.get("input_activations") for g in groups) else "",
        f"targets {groups[0].get('targets')}" if any(g.get("targets") != ["Linear"] for g in groups) else "",
        "dynamic weights" if weights.get("dynamic") else "",
    ]
    if problem := ", ".join(p for p in problems if p):
        raise ValueError(f"quantization: compressed-tensors with {problem} is not supported ({supported})")
    group_size = int(weights.get("group_size") or 0) if weights["strategy"] == "group" else 0
    if weights["strategy"] == "group" and group_size <= 0:
        raise ValueError(f"quantization: compressed-tensors group strategy with group_size {group_size}")
    return PackQuantized(group_size, bool(weights.get("symmetric", True)), tuple(qc.get("ignore") or ()))


def to_gptq(suffix: str, tensor: torch.Tensor, scheme: PackQuantized) -> list[tuple[str, torch.Tensor]]:
    """One pack-quantized tensor of a linear -> the GPTQ tensors (Int4Linear's names) it is; [] to drop."""
    if suffix == "weight_packed":  # [N, K/8], nibbles along the inputs -> [K/8, N]
        return [("qweight", _int32(tensor, suffix).t().contiguous())]
    if suffix == "weight_zero_point":  # [N/8, K/G], nibbles along the outputs -> [K/G, N/8]
        if scheme.symmetric:  # older exports keep symmetric (all-zero) zero points: the scale brings ours
            return []
        return [("qzeros", _int32(tensor, suffix).t().contiguous())]
    if suffix == "weight_scale":  # [N, K/G] -> [K/G, N]
        scales = tensor.reshape(tensor.shape[0], -1).t().contiguous()
        if not scheme.symmetric:
            return [("scales", scales)]
        zeros = torch.full((scales.shape[0], scales.shape[1] // 8), _SYMMETRIC_ZEROS, dtype=torch.int32)
        return [("scales", scales), ("qzeros", zeros)]
    if suffix == "weight_g_idx":
        return [("g_idx", tensor.to(torch.int32))]
    return []  # weight_shape: checked against the others (`gptq_stream`), then Int4Linear knows its shape


def gptq_stream(
    tensors: Iterable[tuple[str, torch.Tensor]], scheme: PackQuantized
) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint stream with every pack-quantized tensor renamed and converted to GPTQ's (`to_gptq`).
    A linear's tensors must agree on its (outputs, inputs), weight_shape included: else a ValueError names them."""
    seen: dict[str, dict[str, tuple[int, str]]] = {}  # linear -> dimension -> (size, the tensor that said so)
    for name, tensor in tensors:
        base, _, suffix = name.rpartition(".")
        if suffix not in _SUFFIXES:
            yield name, tensor
            continue
        try:
            dims = _dimensions(suffix, tensor, scheme)
            converted = to_gptq(suffix, tensor, scheme)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from e
        known = seen.setdefault(base, {})
        for dim, size in dims.items():
            size0, source = known.setdefault(dim, (size, name))
            if size0 != size:
                raise ValueError(f"{name}: shape {tuple(tensor.shape)} means {size} {dim}, {source} means {size0}")
        for gptq_name, value in converted:
            yield f"{base}.{gptq_name}", value


def _dimensions(suffix: str, tensor: torch.Tensor, scheme: PackQuantized) -> dict[str, int]:
    """The linear's sizes a tensor implies (what the format's shapes say; see the module docstring)."""
    if suffix == "weight_g_idx":
        return {"inputs": tensor.numel()}
    if suffix == "weight_shape":
        if tensor.numel() != 2:
            raise ValueError(f"shape {tuple(tensor.shape)}, expected [2] (outputs, inputs)")
        return {"outputs": int(tensor[0]), "inputs": int(tensor[1])}
    if tensor.dim() != 2:
        raise ValueError(f"shape {tuple(tensor.shape)}, expected 2 dimensions")
    rows, cols = tensor.shape
    if suffix == "weight_packed":
        return {"outputs": rows, "inputs": cols * 8}
    if suffix == "weight_zero_point":
        return {"outputs": rows * 8, "groups": cols} if not scheme.symmetric else {}
    if scheme.group_size == 0 and cols != 1:  # weight_scale
        raise ValueError(f"shape {tuple(tensor.shape)}: a per-channel scale is [outputs, 1]")
    return {"outputs": rows, "groups": cols} | ({"inputs": cols * scheme.group_size} if scheme.group_size else {})


def ignored(scheme: PackQuantized) -> Callable[[str], bool]:
    """Whether one of our linears (by module name) stays full precision: the checkpoint's `ignore` names it
    or, for a fused one (qkv_proj, gate_up_proj), any of its parts (as compressed-tensors matches)."""

    def matches(name: str) -> bool:
        return any(
            re.match(target[3:], name) is not None if target.startswith("re:") else target == name
            for target in scheme.ignore
        )

    return any_part(matches)


def any_part(matches: Callable[[str], bool]) -> Callable[[str], bool]:
    """`matches` of a checkpoint's module names, for our module names: a fused linear (qkv_proj, gate_up_proj)
    matches when any of the checkpoint's parts it holds does."""

    def match_ours(name: str) -> bool:
        prefix, _, leaf = name.rpartition(".")
        parts = [hf for hf, (ours, _) in PACKED_PROJECTIONS.items() if ours == leaf] or [leaf]
        return any(matches(f"{prefix}.{part}") for part in parts)

    return match_ours


def _int32(tensor: torch.Tensor, suffix: str) -> torch.Tensor:
    if tensor.dtype != torch.int32:
        raise ValueError(f"{suffix} is {tensor.dtype}, expected torch.int32")
    return tensor
