"""Static KV-cache scales in a checkpoint, set on each layer's attention."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator
from typing import ClassVar

import torch
from torch import nn

log = logging.getLogger(__name__)


class KVCacheScales:
    """Static KV-cache scales a checkpoint may hold beside any weight format (compressed-tensors' kv_cache_scheme:
    `self_attn.k_scale` / `v_scale`; older FP8 exports: `k_proj` / `v_proj.output_scale`, or one `kv_scale`),
    taken out of the weight stream and set on each layer's attention, which an fp8 KV cache divides K and V by
    (vLLM's meaning). A per-head scale becomes the layer's largest: no head overflows e4m3."""

    _NAMES: ClassVar[dict[str, str]] = {
        ".k_scale": "k",
        ".v_scale": "v",
        ".kv_scale": "kv",
        "k_proj.output_scale": "k",
        "v_proj.output_scale": "v",
    }
    _UNUSED = (".q_scale", ".prob_scale")  # fp8 attention math: not done here
    _LAYER = re.compile(r"\.(?:layers|h)\.(\d+)\.")

    def __init__(self) -> None:
        self.by_layer: dict[int, dict[str, float]] = {}

    def claims(self, name: str) -> bool:
        """Whether `name` is a KV-cache scale (to `take`, not to load as a parameter)."""
        return name.endswith((*self._NAMES, *self._UNUSED))

    def take(self, name: str, tensor: torch.Tensor) -> None:
        kind = next((k for suffix, k in self._NAMES.items() if name.endswith(suffix)), None)
        if kind is not None and (layer := self._LAYER.search(name)) is not None:
            self.by_layer.setdefault(int(layer.group(1)), {})[kind] = float(tensor.float().max())

    def taken_from(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """A checkpoint stream without its KV-cache scales, which are kept here."""
        for name, tensor in tensors:
            if self.claims(name):
                self.take(name, tensor)
            else:
                yield name, tensor

    def apply(self, model: nn.Module) -> None:
        if not self.by_layer:
            return
        attentions = [m for m in model.modules() if hasattr(m, "k_scale")]  # every family's attention, in order
        for layer, scales in self.by_layer.items():
            if layer < len(attentions):
                attention = attentions[layer]
                for kind in ("k", "v"):
                    if (scale := scales.get(kind, scales.get("kv"))) is not None:
                        setattr(attention, f"{kind}_scale", scale)
        log.info("static KV-cache scales of %d layers (used by an fp8 KV cache)", len(self.by_layer))
