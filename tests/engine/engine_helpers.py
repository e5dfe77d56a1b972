"""Small builders shared by the engine tests (no model needed)."""

from __future__ import annotations

import itertools

import pytest
import safetensors
import torch

from pagedserve.services.engine.engine import Engine
from pagedserve.services.engine.outputs import RequestOutput
from pagedserve.services.engine.request import Request
from pagedserve.services.engine.sampling_params import SamplingParams

_arrivals = itertools.count()


def make_request(
    prompt_token_ids: list[int],
    params: SamplingParams | None = None,
    request_id: str | None = None,
    max_tokens: int = 16,
    eos_token_ids: frozenset[int] = frozenset({2}),
) -> Request:
    arrival = next(_arrivals)
    params = params or SamplingParams(max_tokens=max_tokens)
    return Request.create(
        request_id or f"req-{arrival}",
        0,
        prompt_token_ids,
        [],
        params,
        params.max_tokens or max_tokens,
        eos_token_ids,
        arrival,
        torch.device("cpu"),
    )


def run(engine: Engine) -> dict[tuple[str, int], list[RequestOutput]]:
    by_choice: dict[tuple[str, int], list[RequestOutput]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            by_choice.setdefault((out.request_id, out.index), []).append(out)
    return by_choice


def tokens_of(outputs: list[RequestOutput]) -> list[int]:
    return [t for out in outputs for t in out.new_token_ids]


class WholeReads:
    """safe_open, recording the tensors read whole (get_tensor) rather than sliced."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.names: list[str] = []
        real_safe_open, names = safetensors.safe_open, self.names

        class Handle:
            def __init__(self, *args: object, **kwargs: object) -> None:
                self._handle = real_safe_open(*args, **kwargs)

            def keys(self) -> list[str]:
                return list(self._handle.keys())

            def get_slice(self, name: str) -> object:
                return self._handle.get_slice(name)

            def get_tensor(self, name: str) -> torch.Tensor:
                names.append(name)
                return self._handle.get_tensor(name)

        monkeypatch.setattr("pagedserve.services.engine.parallel.loading.safe_open", Handle)
