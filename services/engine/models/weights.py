"""Stream checkpoint tensors from safetensors files straight into a model's parameters."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from pagedserve.services.engine.models.base import CausalLM
from pagedserve.services.engine.models.spec import read_json

log = logging.getLogger(__name__)


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint's files: those the index names when sharded, else every *.safetensors."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(read_json(index)["weight_map"].values()))
        return [model_dir / name for name in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    return files


def iter_checkpoint(files: list[Path], show_progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of every file, one at a time, with a progress bar over tensors."""
    handles = [safe_open(str(f), framework="pt") for f in files]
    total = sum(len(list(h.keys())) for h in handles)
    with tqdm(total=total, desc="loading weights", unit="tensor", disable=not show_progress) as bar:
        for handle in handles:
            for name in handle.keys():  # noqa: SIM118 - safe_open handles are not mappings
                yield name, handle.get_tensor(name)
                bar.update(1)


def load_weights(model: CausalLM, files: list[Path], show_progress: bool = True) -> None:
    """Copy every checkpoint tensor of `files` into its parameter (see `load_tensors`)."""
    load_tensors(model, iter_checkpoint(files, show_progress), str(files[0].parent))


def load_tensors(model: CausalLM, tensors: Iterable[tuple[str, torch.Tensor]], source: str) -> None:
    """Copy every (checkpoint name, tensor) into its parameter (casting dtype and moving device on the way).

    The model translates names (and splits fused tensors) in `checkpoint_to_params`; modules that
    own fused parameters take their piece through `load_shard`. Every parameter must be written; a checkpoint
    tensor without a parameter is an error, except a zero bias of a bias-free linear (`is_extra_zero_bias`).
    """
    params = dict(model.named_parameters())
    unwritten = set(params)
    for ckpt_name, tensor in tensors:
        for name, loaded, shard_id in model.checkpoint_to_params(ckpt_name, tensor):
            if name not in params:
                if is_extra_zero_bias(name, loaded):
                    continue
                raise KeyError(f"checkpoint tensor {ckpt_name!r} maps to unknown parameter {name!r}")
            module_name, _, param_name = name.rpartition(".")
            load_weight = getattr(model.get_submodule(module_name), "load_weight", None)
            if load_weight is not None:  # modules that convert what they load (fp8) say what they wrote
                try:
                    with torch.no_grad():
                        written = load_weight(param_name, loaded, shard_id)
                except ValueError as e:  # name the checkpoint's tensor, not only our converted one
                    raise ValueError(f"checkpoint tensor {ckpt_name!r}: {e}") from e
                unwritten.difference_update(f"{module_name}.{p}" for p in written)
                continue
            with torch.no_grad():
                if shard_id is None:
                    _assign(params[name], loaded, name)
                else:
                    model.get_submodule(module_name).load_shard(param_name, loaded, shard_id)  # type: ignore[operator]
            unwritten.discard(name)
    if unwritten:
        raise ValueError(f"checkpoint in {source} lacks parameters: {sorted(unwritten)[:8]}")


def is_extra_zero_bias(name: str, tensor: torch.Tensor) -> bool:
    """An all-zero `.bias` of a linear that has none: AutoGPTQ (before 0.5) saved one for every linear it quantized
    (TheBloke's GPTQ checkpoints hold them); it adds nothing, so it is skipped, as vLLM skips it. A non-zero one
    would change the outputs: it stays an unknown parameter (an error naming it)."""
    return name.endswith(".bias") and not bool(tensor.any())


def _assign(param: torch.Tensor, loaded: torch.Tensor, name: str) -> None:
    assert param.shape == loaded.shape, (name, tuple(param.shape), tuple(loaded.shape))
    if param.dtype == loaded.dtype and param.device == loaded.device and loaded.is_contiguous():
        param.data = loaded  # already a fresh tensor of the right kind: adopt it, skip a copy
    else:
        param.copy_(loaded)
