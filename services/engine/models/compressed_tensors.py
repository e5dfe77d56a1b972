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

Which linears are quantized is the config's to say, as compressed-tensors (and vLLM) read it: a linear is
quantized when a config group's `targets` names it (the class name "Linear", "re:<regex>" re.match-ed against its
full module name, or its exact module name) and `ignore` does not (matched the same way). Linears no group targets
stay in full precision, like ignored ones. Groups may target different linears but must share one weight scheme:
a mixture (e.g. FP8 attention with W4A16 MLPs) is refused when the config is read, naming its groups.
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
    targets: tuple[str, ...] = ("Linear",)  # the linears its config groups quantize, matched as `ignore` is


# The class names an nn.Linear answers to: compressed-tensors matches a target against every class of a module's MRO.
_LINEAR_CLASSES = ("Linear", "Module")


def weight_groups(qc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """A compressed-tensors config's groups that quantize weights, by name (groups of activations or nothing: left
    out, they change no weight)."""
    groups = qc.get("config_groups") or {}
    return {str(name): group for name, group in groups.items() if isinstance(group, dict) and group.get("weights")}


def weight_scheme(weights: dict[str, Any]) -> tuple[Any, ...]:
    """What of a group's `weights` decides how its tensors read (observers and the like do not)."""
    strategy = weights.get("strategy")
    return (
        weights.get("type", "int"),
        weights.get("num_bits"),
        strategy,
        weights.get("group_size") if strategy == "group" else None,
        weights.get("block_structure") if strategy == "block" else None,
        bool(weights.get("symmetric", True)),
        bool(weights.get("dynamic")),
        group_act_order(weights),
    )


def group_act_order(weights: dict[str, Any]) -> bool:
    """Whether the weights hold a `weight_g_idx` (actorder "group", alias "dynamic"; True in older configs)."""
    return weights.get("actorder") in ("group", "dynamic", True)


def describe_groups(groups: dict[str, dict[str, Any]]) -> str:
    """`group_0 (targets [...]: int 4-bit group 128), ...`: for messages."""

    def scheme(weights: dict[str, Any]) -> str:
        size = f" {weights.get('group_size')}" if weights.get("strategy") == "group" else ""
        symmetric = "" if weights.get("symmetric", True) else " asymmetric"
        return f"{weights.get('type', 'int')} {weights.get('num_bits')}-bit {weights.get('strategy')}{size}{symmetric}"

    return ", ".join(
        f"{name} (targets {group.get('targets')}: {scheme(group['weights'])})" for name, group in groups.items()
    )


def refuse_mixed_schemes(groups: dict[str, dict[str, Any]]) -> None:
    """Config groups quantizing their linears' weights differently: one layer type for all is what loads."""
    if len({weight_scheme(group["weights"]) for group in groups.values()}) > 1:
        raise ValueError(
            f"quantization: compressed-tensors config groups with different weight schemes are not supported: "
            f"{describe_groups(groups)}; supported: one weight scheme shared by every group (int 4-bit "
            "pack-quantized, int 8-bit, or float 8-bit), the groups targeting any linears"
        )


def pack_quantized_format(cfg: dict[str, Any]) -> PackQuantized | None:
    """The scheme of a compressed-tensors checkpoint with integer weights, or None (not compressed-tensors,
    or float weights: fp8.py's); raises ValueError naming what is supported for anything else (config groups
    with different weight schemes, float and int included)."""
    qc = cfg.get("quantization_config") or {}
    if qc.get("quant_method") != METHOD:
        return None
    groups = weight_groups(qc)
    types = {group["weights"].get("type", "int") for group in groups.values()}
    if not groups or types == {"float"}:
        return None  # nothing quantised, or float (fp8) weights: not ours
    refuse_mixed_schemes(groups)  # before fp8.py's readers, which would take a float group's config for all
    weights = next(iter(groups.values()))["weights"]
    if types != {"int"}:
        return None  # unknown type: the loader refuses it (_refuse_unread_weights)
    if weights.get("num_bits") == 8:
        return None  # 8-bit int weights: compressed_int8.py's
    supported = "4-bit int weights, pack-quantized, group or channel strategy, no activation quantization; 8-bit int"
    formats = {g.get("format") or qc.get("format") for g in groups.values()}
    all_groups = [g for g in (qc.get("config_groups") or {}).values() if isinstance(g, dict)]
    untargeted = [name for name, g in groups.items() if not g.get("targets")]
    problems = [
        f"format {sorted(map(str, formats))}" if formats != {"pack-quantized"} else "",
        f"{weights.get('num_bits')}-bit weights" if weights.get("num_bits") != 4 else "",
        f"strategy {weights.get('strategy')!r}" if weights.get("strategy") not in ("group", "channel") else "",
        "activation quantization" if any(g.get("input_activations") for g in all_groups) else "",
        f"config groups without targets {untargeted}" if untargeted else "",
        "dynamic weights" if weights.get("dynamic") else "",
    ]
    if problem := ", ".join(p for p in problems if p):
        raise ValueError(f"quantization: compressed-tensors with {problem} is not supported ({supported})")
    group_size = int(weights.get("group_size") or 0) if weights["strategy"] == "group" else 0
    if weights["strategy"] == "group" and group_size <= 0:
        raise ValueError(f"quantization: compressed-tensors group strategy with group_size {group_size}")
    targets = tuple(dict.fromkeys(str(t) for g in groups.values() for t in g["targets"]))
    return PackQuantized(group_size, bool(weights.get("symmetric", True)), tuple(qc.get("ignore") or ()), targets)


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
    A linear's tensors must agree on its (outputs, inputs), weight_shape included, and the config must quantize
    it (`ignored`): else a ValueError names them."""
    seen: dict[str, dict[str, tuple[int, str]]] = {}  # linear -> dimension -> (size, the tensor that said so)
    keep = ignored(scheme)
    for name, tensor in tensors:
        base, _, suffix = name.rpartition(".")
        if suffix not in _SUFFIXES:
            yield name, tensor
            continue
        if base not in seen and keep(_ours(base)):  # else its tensors reach a full-precision linear: a KeyError
            raise ValueError(
                f"{name}: the checkpoint quantizes {base}, but its quantization_config leaves {_ours(base)} in "
                f"full precision (targets {list(scheme.targets)}, ignore {list(scheme.ignore)}); a fused linear's "
                "parts must all be quantized or all not"
            )
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
    """Whether one of our linears (by module name) stays full precision: the checkpoint's `ignore` names it (or, for
    a fused one, qkv_proj / gate_up_proj, any of its parts), or no config group targets it (nor all of its parts):
    as compressed-tensors decides which linears it quantizes."""
    in_ignore = any_part(lambda name: matches(name, scheme.ignore))

    def targeted(name: str) -> bool:
        return matches(name, scheme.targets) or all(matches(part, scheme.targets) for part in checkpoint_parts(name))

    return lambda name: in_ignore(name) or not targeted(name)


def matches(name: str, patterns: Iterable[str]) -> bool:
    """compressed-tensors' match of a linear's module name against a config's targets or ignore: "re:<regex>"
    re.match-es the name, any other pattern is the name itself or one of nn.Linear's class names."""
    return any(
        re.match(pattern[3:], name) is not None
        if pattern.startswith("re:")
        else pattern == name or pattern in _LINEAR_CLASSES
        for pattern in patterns
    )


def any_part(match: Callable[[str], bool]) -> Callable[[str], bool]:
    """`match` of a checkpoint's module names, for our module names: a linear matches when its name does or, for
    a fused one (qkv_proj, gate_up_proj), any of the checkpoint's parts it holds does (Llama's checkpoints name the
    parts; Phi-3's name the fused linears themselves)."""

    def match_ours(name: str) -> bool:
        return match(name) or any(match(part) for part in checkpoint_parts(name))

    return match_ours


def checkpoint_parts(name: str) -> list[str]:
    """The checkpoint's module names of our linear `name`: q_proj/k_proj/v_proj of a qkv_proj, else itself."""
    prefix, dot, leaf = name.rpartition(".")
    return [f"{prefix}{dot}{hf}" for hf, (ours, _) in PACKED_PROJECTIONS.items() if ours == leaf] or [name]


def _ours(name: str) -> str:
    """Our module name of a checkpoint's linear: a part of a fused one (q_proj) -> the fused one (qkv_proj)."""
    prefix, dot, leaf = name.rpartition(".")
    return f"{prefix}{dot}{PACKED_PROJECTIONS[leaf][0]}" if leaf in PACKED_PROJECTIONS else name


def _int32(tensor: torch.Tensor, suffix: str) -> torch.Tensor:
    if tensor.dtype != torch.int32:
        raise ValueError(f"{suffix} is {tensor.dtype}, expected torch.int32")
    return tensor
