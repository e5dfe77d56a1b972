"""The adapters an engine serves and the device slots that hold them.

    registered (host)   name -> AdapterWeights       every adapter a request may name
    slots (device)      [ "sql" | "chat" | free | "math" ]    max_loras of them, in every LoRALinear
    pins                [  2    |   0    |  0   |   1    ]    live requests using each slot

A request's adapter is put in a slot when it is queued (`acquire`): already there, a free slot, or the least
recently used slot no live request pins, whose adapter is evicted (it stays registered and comes back from
the host copy). When every slot is pinned by other adapters the request waits (`acquire` returns None).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from pagedserve.services.engine.lora.layers import LoRABatch, LoRALinear
from pagedserve.services.engine.lora.weights import AdapterWeights, read_adapter
from pagedserve.services.engine.models.base import CausalLM
from pagedserve.services.engine.models.layers import Attention, GatedMLP
from pagedserve.services.engine.models.llama import LlamaForCausalLM
from pagedserve.services.engine.scheduler import ScheduledRequest
from pagedserve.shared.config import LoRAConfig
from pagedserve.shared.lora_adapters import LoRAAdapterError, inspect_adapter


class UnknownAdapterError(ValueError):
    """A request names an adapter this engine does not serve (the API answers 404 model_not_found)."""


class LoRAManager:
    def __init__(self, model: CausalLM, settings: LoRAConfig, max_num_tokens: int, device: torch.device) -> None:
        if not isinstance(model, LlamaForCausalLM):
            raise ValueError(f"enable_lora: LoRA serves Llama-family models only, not {type(model).__name__}")
        self.max_loras, self.max_rank = settings.max_loras, settings.max_lora_rank
        self.batch = LoRABatch(max_num_tokens, self.max_loras, device)
        self.layers = _attach(model, self.max_loras, self.max_rank, self.batch, device)
        self.batch.allocate_workspace()
        self._adapters: dict[str, AdapterWeights] = {}
        self._slot_names: list[str | None] = [None] * self.max_loras
        self._pins = [0] * self.max_loras
        self._last_used = [0] * self.max_loras
        self._clock = itertools.count(1)
        for name, path in settings.adapters().items():
            self.add(name, path)

    @property
    def names(self) -> list[str]:
        return sorted(self._adapters)

    @property
    def resident(self) -> list[str | None]:
        """The adapter in each slot (None: free)."""
        return list(self._slot_names)

    def paths(self) -> dict[str, str]:
        """Every registered adapter: name -> its folder."""
        return {name: weights.info.path for name, weights in self._adapters.items()}

    def has(self, name: str) -> bool:
        return name in self._adapters

    def add(self, name: str, path: str) -> None:
        """Register an adapter (read to the host; a slot is taken only when a request needs it)."""
        if name in self._adapters:
            raise LoRAAdapterError(f"the LoRA adapter {name!r} is already loaded")
        weights = read_adapter(inspect_adapter(path, self.max_rank))
        for (module, index), (a, b) in weights.slices.items():
            layer = self.layers.get(module)
            if layer is None:
                raise LoRAAdapterError(f"the adapter targets {module}, which this model does not have")
            width = layer.slices[index][1]
            if a.shape[1] != layer.in_features or b.shape[0] != width:
                raise LoRAAdapterError(
                    f"{module}: the adapter's shapes {list(a.shape)} / {list(b.shape)} do not fit this model "
                    f"({layer.in_features} -> {width} features)"
                )
        self._adapters[name] = weights

    def remove(self, name: str) -> bool:
        """Unregister; its slot is freed now, or when the last request using it ends. False if unknown."""
        if self._adapters.pop(name, None) is None:
            return False
        if name in self._slot_names:
            self._slot_names[self._slot_names.index(name)] = None  # pinned rows keep reading its weights
        return True

    def acquire(self, name: str) -> int | None:
        """The slot holding `name`, pinned for one request; None while every slot is pinned by others."""
        weights = self._adapters[name]
        if name in self._slot_names:
            slot = self._slot_names.index(name)
        else:
            free = [s for s in range(self.max_loras) if self._pins[s] == 0]
            if not free:
                return None
            # an empty slot first, else the least recently used
            slot = min(free, key=lambda s: (self._slot_names[s] is not None, self._last_used[s]))
            self._load(slot, name, weights)
        self._pins[slot] += 1
        self._last_used[slot] = next(self._clock)
        return slot

    def release(self, slot: int) -> None:
        assert self._pins[slot] > 0, slot
        self._pins[slot] -= 1

    def prepare(self, scheduled: Sequence[ScheduledRequest], num_tokens: int) -> bool:
        """The step's slot per token (padding rows: none), grouped for the kernels. False, having done nothing
        else, when no request uses an adapter: the step then runs (or replays) the base model only."""
        if all(s.request.lora_slot < 0 for s in scheduled):
            self.batch.skip()
            return False
        slots = np.fromiter((s.request.lora_slot for s in scheduled), dtype=np.int64, count=len(scheduled))
        counts = np.fromiter((s.num_new_tokens for s in scheduled), dtype=np.int64, count=len(scheduled))
        token_slots = np.full(num_tokens, -1, dtype=np.int64)
        per_token = np.repeat(slots, counts)
        token_slots[: per_token.shape[0]] = per_token
        self.batch.prepare(token_slots)
        return True

    def _load(self, slot: int, name: str, weights: AdapterWeights) -> None:
        for layer in self.layers.values():
            layer.clear_slot(slot)
        for (module, index), (a, b) in weights.slices.items():
            self.layers[module].load_slice(slot, index, a, b)
        self._slot_names[slot] = name


def _attach(
    model: LlamaForCausalLM, max_loras: int, max_rank: int, batch: LoRABatch, device: torch.device
) -> dict[str, LoRALinear]:
    """Put a LoRALinear around every q/k/v, o, gate/up and down projection; module path -> it."""
    dtype = model.spec.dtype
    wrapped: dict[str, LoRALinear] = {}

    def wrap(parent: nn.Module, path: str, attr: str, in_features: int, slices: list[tuple[int, int]]) -> None:
        layer = LoRALinear(getattr(parent, attr), in_features, slices, max_loras, max_rank, batch, dtype, device)
        setattr(parent, attr, layer)
        wrapped[f"{path}.{attr}"] = layer

    hidden = model.spec.hidden_size
    for i, decoder in enumerate(model.model.layers):
        attn, mlp = decoder.self_attn, decoder.mlp
        assert isinstance(attn, Attention) and isinstance(mlp, GatedMLP)
        q, kv, inter = attn.q_size, attn.kv_size, mlp.intermediate_size
        prefix = f"model.layers.{i}"
        wrap(attn, f"{prefix}.self_attn", "qkv_proj", hidden, [(0, q), (q, kv), (q + kv, kv)])
        wrap(attn, f"{prefix}.self_attn", "o_proj", q, [(0, hidden)])
        wrap(mlp, f"{prefix}.mlp", "gate_up_proj", hidden, [(0, inter), (inter, inter)])
        wrap(mlp, f"{prefix}.mlp", "down_proj", inter, [(0, hidden)])
    return wrapped
