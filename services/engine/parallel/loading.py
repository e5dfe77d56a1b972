"""Weights into a sharded model: slices of safetensors tensors, or deterministic random weights.

Checkpoint files: each tensor's name goes through the family's `checkpoint_to_params` with a meta
stand-in first. When the family passes it through unchanged (every Llama-family tensor), the rank
reads only its rows or columns with safetensors `get_slice`; when the family reorders it (GPT-NeoX
and Falcon fused qkv), that one tensor is read whole, reordered, and sliced.

Random weights (`load_random`, benchmarks): every full tensor is generated from (seed, its name,
its shard id) and then sliced, so one GPU and N GPUs hold identical weights. Values are rounded to
bf16 so an fp32 model of the same seed is an exact reference. Quantized layouts get values of their own
format (`random_quantized`), as vLLM's dummy load format gives them: MXFP4 codes and scales, 4-bit codes and
zero points, fp8 weights, and scales that make every format's weights about N(0, 0.02).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from pagedserve.services.engine.models import mxfp4
from pagedserve.services.engine.models.base import CausalLM
from pagedserve.services.engine.models.kv_cache_scales import KVCacheScales
from pagedserve.services.engine.models.layers import ShardedLinear
from pagedserve.services.engine.models.weights import is_extra_zero_bias
from pagedserve.services.engine.parallel.linear import ReadSlice


def _narrow_reader(tensor: torch.Tensor) -> ReadSlice:
    return lambda dim, start, size: tensor.narrow(dim, start, size)


def _broadcast_reader(tensor: torch.Tensor) -> ReadSlice:
    """A one-element tensor (a per-tensor fp8 scale) read as that value on every row it is asked for."""
    return lambda dim, start, size: tensor.reshape(1).expand(size)


def _slice_reader(handle: object, name: str) -> ReadSlice:
    def read(dim: int, start: int, size: int) -> torch.Tensor:
        view = handle.get_slice(name)  # type: ignore[attr-defined]
        return view[start : start + size] if dim == 0 else view[:, start : start + size]

    return read


def _load_param(
    model: CausalLM,
    params: dict[str, torch.nn.Parameter],
    name: str,
    shard_id: str | None,
    read: ReadSlice,
    full_rows: int,
) -> list[str]:
    """Load one parameter's piece; returns the parameters written (a 4-bit qweight also fills a plain g_idx)."""
    if name not in params:
        raise KeyError(f"checkpoint tensor maps to unknown parameter {name!r}")
    module_name, _, param_name = name.rpartition(".")
    module = model.get_submodule(module_name)
    with torch.no_grad():
        if hasattr(module, "load_piece"):
            written = module.load_piece(param_name, shard_id, read)  # type: ignore[operator]
            return [f"{module_name}.{w}" for w in written or [param_name]]
        elif shard_id is not None and isinstance(module, ShardedLinear):
            module.load_shard(param_name, read(0, 0, full_rows), shard_id)
        else:  # replicated (norms, rotary-free parameters): the whole tensor on every rank
            loaded = read(0, 0, full_rows)
            assert params[name].shape == loaded.shape, (name, tuple(params[name].shape), tuple(loaded.shape))
            params[name].copy_(loaded)
    return [name]


def load_sharded(model: CausalLM, files: list[Path], show_progress: bool = True) -> None:
    """Fill a sharded model from checkpoint files, reading only this rank's slices where possible."""
    params = dict(model.named_parameters())
    unwritten = set(params)
    handles = [safe_open(str(f), framework="pt") for f in files]
    total = sum(len(list(h.keys())) for h in handles)
    kv_scales = KVCacheScales()
    with tqdm(total=total, desc="loading weight shards", unit="tensor", disable=not show_progress) as bar:
        for handle in handles:
            for ckpt_name in handle.keys():  # noqa: SIM118 - safe_open handles are not mappings
                if kv_scales.claims(ckpt_name):  # a whole-layer scale: every rank takes it
                    kv_scales.take(ckpt_name, handle.get_tensor(ckpt_name))
                    bar.update(1)
                    continue
                shape = handle.get_slice(ckpt_name).get_shape()
                probe = torch.empty(shape, device="meta")
                full: dict[str, torch.Tensor] | None = None
                for name, piece, shard_id in model.checkpoint_to_params(ckpt_name, probe):
                    if piece is probe:
                        read = _slice_reader(handle, ckpt_name)
                    else:  # the family reorders this tensor: read it whole, once
                        if full is None:
                            tensor = handle.get_tensor(ckpt_name)
                            full = {n: t for n, t, _ in model.checkpoint_to_params(ckpt_name, tensor)}
                        read = _narrow_reader(full[name])
                    _load_param(model, params, name, shard_id, read, int(piece.shape[0]))
                    unwritten.discard(name)
                bar.update(1)
    if unwritten:
        raise ValueError(f"checkpoint in {files[0].parent} lacks parameters: {sorted(unwritten)[:8]}")
    kv_scales.apply(model)


def load_sharded_stream(model: CausalLM, tensors: Iterable[tuple[str, torch.Tensor]], source: str) -> None:
    """Fill a sharded model from whole checkpoint tensors as a format's converters stream them (4-bit layouts:
    compressed-tensors' renamed, quantized heads dequantised), each cut to this rank's slice by its module."""
    params = dict(model.named_parameters())
    unwritten = set(params)
    for ckpt_name, tensor in tensors:
        for name, piece, shard_id in model.checkpoint_to_params(ckpt_name, tensor):
            if name not in params and is_extra_zero_bias(name, piece):
                continue
            read = _broadcast_reader(piece) if piece.numel() == 1 else _narrow_reader(piece)
            rows = int(piece.shape[0]) if piece.dim() else 1
            unwritten.difference_update(_load_param(model, params, name, shard_id, read, rows))
    if unwritten:
        raise ValueError(f"checkpoint in {source} lacks parameters: {sorted(unwritten)[:8]}")


def _full_pieces(model: CausalLM) -> Iterator[tuple[str, str | None, tuple[int, ...]]]:
    """(parameter name, shard id, full shape) of every full tensor the model's parameters come from."""
    for module_name, module in model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            name = f"{module_name}.{param_name}" if module_name else param_name
            if hasattr(module, "full_pieces"):
                for shard_id, shape in module.full_pieces(param_name):
                    yield name, shard_id, shape
            elif isinstance(module, ShardedLinear):
                for shard_id, (_, size) in module.shard_offsets.items():
                    yield name, shard_id, (size, *param.shape[1:])
            else:
                yield name, None, tuple(param.shape)


def random_tensor(
    name: str, shard_id: str | None, shape: tuple[int, ...], seed: int, device: torch.device
) -> torch.Tensor:
    """A full tensor that depends only on (seed, name, shard id): norms 1, biases 0, else N(0, 0.02)."""
    leaf = name.rsplit(".", 1)[-1]
    if "norm" in name and leaf == "weight":
        return torch.ones(shape, device=device)
    if leaf == "bias":
        return torch.zeros(shape, device=device)
    values = torch.randn(shape, generator=_generator(name, shard_id, seed, device), device=device) * 0.02
    return values.to(torch.bfloat16)


def _generator(name: str, shard_id: str | None, seed: int, device: torch.device) -> torch.Generator:
    generator = torch.Generator(device=device)
    generator.manual_seed(seed * 1_000_003 + zlib.crc32(f"{name}/{shard_id or ''}".encode()))
    return generator


def load_random(model: CausalLM, seed: int) -> None:
    """Random weights, identical for every tensor-parallel size (see the module docstring)."""
    params = dict(model.named_parameters())
    device = next(iter(params.values())).device
    for name, shard_id, shape in _full_pieces(model):
        generator = _generator(name, shard_id, seed, device)
        tensor = random_quantized(model, name, params[name].dtype, shape, generator)
        if tensor is None:
            tensor = random_tensor(name, shard_id, shape, seed, device)
        _load_param(model, params, name, shard_id, _narrow_reader(tensor), shape[0])
        del tensor


# A quantized weight's scale: 4-bit codes minus zero points have a std of ~6.5 (two uniform 0..15 draws), and
# random fp8 values are drawn with std 0.02 / this, so dequantised weights are about N(0, 0.02) in both.
RANDOM_SCALE = 0.003


def random_quantized(
    model: CausalLM, name: str, dtype: torch.dtype, shape: tuple[int, ...], generator: torch.Generator
) -> torch.Tensor | None:
    """A random tensor in a quantized parameter's own format, or None for a plain floating-point weight. Random
    bf16 values would cast to zeros (integer codes) or to huge weights (a zero point, an N(0, 0.02) scale)."""
    device, leaf = generator.device, name.rsplit(".", 1)[-1]
    if dtype == torch.int32:
        if leaf == "g_idx":  # no act order: each input row's group is k // G (of the full tensor, when sharded)
            module = model.get_submodule(name.rpartition(".")[0])
            return getattr(module, "full_plain_groups", module.plain_groups)().to(device)  # type: ignore[operator]
        # GPTQ / AWQ packed codes or zero points: eight random 4-bit values a word
        return torch.randint(-(2**31), 2**31 - 1, shape, generator=generator, device=device, dtype=torch.int32)
    if dtype == torch.uint8:
        if leaf.endswith("_zeros"):  # int4 experts: one zero point (0..15) a byte
            return torch.randint(0, 16, shape, generator=generator, device=device, dtype=torch.uint8)
        # MXFP4 scales (E8M0) need their own range; codes of MXFP4 or int4 experts are any byte
        return mxfp4.random_flat(shape, leaf.endswith("_scales"), generator)
    if dtype.is_floating_point and dtype.itemsize == 1:  # fp8 weights
        return (torch.randn(shape, generator=generator, device=device) * (0.02 / RANDOM_SCALE)).to(dtype)
    if leaf in ("scales", "weight_scale") or leaf.endswith("_proj_scale"):
        return torch.full(shape, RANDOM_SCALE, device=device) * (
            1 + 0.25 * torch.rand(shape, generator=generator, device=device)
        )
    return None
