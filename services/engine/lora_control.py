"""Runtime LoRA loads and unloads on an engine replica, and what its heartbeat says about its adapters.

    gateway ──LoRAUpdate──► ps:{model}:ctl ──► every replica: apply() on the compute thread
                            ps:{model}:loras (hash name -> path): replayed by a replica that starts later
    heartbeat ◄── fields(): served adapters, those in device slots, recent failed loads (by update id)

The compute thread writes, the I/O thread reads: each field is replaced whole, never mutated in place.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from pathlib import Path

from pagedserve.services.engine.engine import Engine
from pagedserve.shared.protocol import LoRAUpdate

log = logging.getLogger(__name__)
_MAX_ERRORS = 16  # failed loads remembered for the gateway that asked (it polls heartbeats for its update id)


class LoRAControl:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.max_lora_rank = engine.lora.max_rank if engine.lora is not None else 0
        self.adapters: dict[str, str] = {}
        self.errors: dict[str, str] = {}
        self._errors: OrderedDict[str, str] = OrderedDict()
        self._snapshot()

    def apply(self, update: LoRAUpdate) -> None:
        if update.action == "unload":
            self.engine.remove_lora(update.lora_name)
        elif self.adapters.get(update.lora_name) != str(
            Path(update.lora_path)
        ):  # the same again (a replay) is done already
            try:
                self.engine.add_lora(update.lora_name, update.lora_path)
            except ValueError as exc:
                log.warning("could not load LoRA adapter %r: %s", update.lora_name, exc)
                self._errors[update.update_id] = str(exc)
                while len(self._errors) > _MAX_ERRORS:
                    self._errors.popitem(last=False)
        self._snapshot()

    @property
    def resident(self) -> list[str]:
        lora = self.engine.lora
        return [] if lora is None else [name for name in lora.resident if name is not None]

    def _snapshot(self) -> None:
        lora = self.engine.lora
        self.adapters = {} if lora is None else lora.paths()
        self.errors = dict(self._errors)
