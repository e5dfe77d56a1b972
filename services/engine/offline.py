"""`generate(engine, prompts, params)`: run a list of prompts to completion and collect whole results
(offline use; `Engine.generate` calls it).

It is a function over anything that steps like an engine (`SteppingEngine`), so this module never imports
engine.py, which imports it.

Text prompts need the tokenizer, which is loaded lazily from the model directory, once; with
token-id prompts the tokenizer is only used, if it loads at all, to fill in `Choice.text`.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from tqdm import tqdm

from pagedserve.services.engine.outputs import Choice, GenerationResult, RequestOutput
from pagedserve.services.engine.sampling_params import SamplingParams
from pagedserve.shared.config import Config
from pagedserve.shared.tokenizer_loader import load_tokenizer

log = logging.getLogger(__name__)
_batch_ids = itertools.count()
_tokenizers: dict[str, Any] = {}


class SteppingEngine(Protocol):
    """What `generate` needs of an engine (pagedserve.services.engine.engine.Engine is one)."""

    config: Config
    model_dir: Path

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams) -> None: ...

    def has_unfinished(self) -> bool: ...

    def step(self) -> list[RequestOutput]: ...


def generate(
    engine: SteppingEngine,
    prompts: Sequence[Sequence[int]] | Sequence[str],
    params: SamplingParams | Sequence[SamplingParams] | None,
    use_tqdm: bool = False,
) -> list[GenerationResult]:
    if params is None:
        params = SamplingParams()
    params_list = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
    if len(params_list) != len(prompts):
        raise ValueError("params: one SamplingParams, or one per prompt")
    has_text = any(isinstance(p, str) for p in prompts)
    tokenizer = cached_tokenizer(engine.config.model.tokenizer or engine.model_dir, required=has_text)
    batch = next(_batch_ids)
    results: dict[str, GenerationResult] = {}
    for i, (prompt, prompt_params) in enumerate(zip(prompts, params_list)):
        token_ids: list[int] = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)  # type: ignore[arg-type]
        request_id = f"generate-{batch}-{i}"
        choices = [
            Choice(index, logprobs=[] if prompt_params.logprobs is not None else None)
            for index in range(prompt_params.n)
        ]
        results[request_id] = GenerationResult(request_id, token_ids, choices)
        engine.add_request(request_id, token_ids, prompt_params)
    progress = _progress(len(results), use_tqdm)
    while engine.has_unfinished():
        for out in engine.step():
            result = results.get(out.request_id)
            if result is None:
                continue  # someone else's request sharing the engine
            choice = result.choices[out.index]
            choice.token_ids.extend(out.new_token_ids)
            if out.new_logprobs and choice.logprobs is not None:
                choice.logprobs.extend(out.new_logprobs)
            result.num_cached_tokens = max(result.num_cached_tokens, out.num_cached_tokens)
            if out.prompt_logprobs is not None:
                result.prompt_logprobs = out.prompt_logprobs
            if out.finish_reason is not None:
                choice.finish_reason = out.finish_reason
                if progress is not None and all(c.finish_reason for c in result.choices):
                    progress.update(1)
    if progress is not None:
        progress.close()
    if tokenizer is not None:
        for result in results.values():
            for choice in result.choices:
                choice.text = tokenizer.decode(choice.token_ids, skip_special_tokens=True)
    return list(results.values())


def cached_tokenizer(model_dir: object, required: bool) -> Any:
    """The model directory's HF tokenizer (cached per directory), or None if it has none and
    none is required."""
    key = str(model_dir)
    if key not in _tokenizers:
        try:
            _tokenizers[key] = load_tokenizer(key)
        except Exception as exc:  # any failure means "no tokenizer" here
            if required:
                raise ValueError(f"prompts: text needs a tokenizer, and {key} has none ({exc})") from exc
            log.info("no tokenizer in %s: results carry token ids only", key)
            _tokenizers[key] = None
    return _tokenizers[key]


def _progress(total: int, enabled: bool) -> Any:
    if not enabled:
        return None
    return tqdm(total=total, desc="generate", unit="req")
