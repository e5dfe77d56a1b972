"""The engine: requests in, one scheduled step at a time, token deltas out. No Redis, no HTTP.

    engine = Engine(EngineConfig(model_dir=...))
    engine.add_request("r1", prompt_token_ids, SamplingParams(max_tokens=32))
    while engine.has_unfinished():
        for out in engine.step(): ...           # RequestOutput deltas

or offline: `engine.generate(prompts, params)`. Not thread-safe: call it from one thread (the
engine service feeds it from a queue).

A sequence finishes with "stop" when it samples an EOS id of the model (unless ignore_eos) or one
of its stop_token_ids (either only after min_tokens), with "length" at max_tokens or the context
limit, with "abort" after `abort()`. The finishing token is part of `new_token_ids`.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable, Sequence

import torch

from services.engine import attention
from services.engine.config import EngineConfig
from services.engine.kv_cache_manager import KVCacheManager
from services.engine.model_runner import ModelRunner, num_kv_blocks_for
from services.engine.models.base import CausalLM
from services.engine.offline import generate
from services.engine.outputs import EngineStats, GenerationResult, RequestOutput
from services.engine.request import Request, RequestStatus
from services.engine.sampling_params import SamplingParams
from services.engine.scheduler import Scheduler

log = logging.getLogger(__name__)


class Engine:
    def __init__(self, config: EngineConfig, model: CausalLM | None = None) -> None:
        self.config = config
        self.device = config.torch_device
        if model is None:
            from services.engine.models import load_model

            model = load_model(config.model_dir, config.dtype, self.device, max_model_len=config.max_model_len,
                               show_progress=False)
        _select_attention_backend(self.device)
        spec = model.spec
        num_blocks = num_kv_blocks_for(model, config, spec.max_model_len)
        self.max_model_len = _fit_max_model_len(config, spec.max_model_len, num_blocks)
        self.eos_token_ids = frozenset(spec.eos_token_ids)
        self.vocab_size = spec.vocab_size
        self.kv_cache = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.kv_cache, config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len
        )
        self.runner = ModelRunner(model, num_blocks, config.block_size, self.device, config.seed)
        self._requests: dict[str, list[Request]] = {}  # request id -> its choices, until all finish
        self._pending: list[RequestOutput] = []  # outputs made between steps (aborts), sent by step()
        self._arrival = itertools.count()
        log.info("engine ready: %d KV blocks of %d tokens, max_model_len %d", num_blocks, config.block_size,
                 self.max_model_len)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        output_token_ids: Sequence[int] = (),
    ) -> None:
        """Queue a request (n choices). `output_token_ids` continue a request another replica began:
        they count towards max_tokens, min_tokens and penalties and are never emitted again.
        Raises ValueError (naming the parameter) for input the engine cannot serve."""
        if request_id in self._requests:
            raise ValueError(f"request_id: {request_id!r} is already running")
        params.validate(self.vocab_size)
        prompt, outputs = list(prompt_token_ids), list(output_token_ids)
        if not prompt:
            raise ValueError("prompt: must not be empty")
        if any(not 0 <= t < self.vocab_size for t in prompt + outputs):
            raise ValueError(f"prompt: token ids must be in [0, {self.vocab_size})")
        if outputs and params.n != 1:
            raise ValueError("n: a continuation must have n == 1")
        if len(prompt) + len(outputs) >= self.max_model_len:
            raise ValueError(f"prompt: {len(prompt) + len(outputs)} tokens leave no room in the context "
                             f"of {self.max_model_len}")
        max_tokens = self.max_model_len - len(prompt) if params.max_tokens is None else params.max_tokens
        if len(prompt) + max_tokens > self.max_model_len:
            raise ValueError(f"max_tokens: prompt ({len(prompt)}) + max_tokens ({max_tokens}) exceed the "
                             f"context of {self.max_model_len}")
        arrival = next(self._arrival)
        choices = [
            Request.create(request_id, index, prompt, outputs, params.for_choice(index), max_tokens,
                           self.eos_token_ids, arrival, self.device)
            for index in range(params.n)
        ]
        self._requests[request_id] = choices
        for request in choices:
            if request.num_output_tokens >= max_tokens:  # a continuation that was already complete
                self.scheduler.finish([request], "length")
                self._pending.append(_output(request, [], None))
            else:
                self.scheduler.add(request)
        self._forget_if_done(request_id)

    def abort(self, request_ids: Iterable[str]) -> None:
        """End requests now (idempotent; unknown ids ignored); step() reports them as "abort"."""
        for request_id in request_ids:
            choices = self._requests.pop(request_id, None)
            if choices is None:
                continue
            live = [r for r in choices if not r.is_finished]
            self.scheduler.finish(live, "abort")
            self._pending.extend(_output(r, [], None) for r in live)

    def abort_choices(self, request_id: str, indexes: Iterable[int]) -> None:
        """End some choices of an n > 1 request (a stop string hit one); idempotent, like abort()."""
        choices = self._requests.get(request_id)
        if choices is None:
            return
        wanted = set(indexes)
        live = [r for r in choices if r.index in wanted and not r.is_finished]
        self.scheduler.finish(live, "abort")
        self._pending.extend(_output(r, [], None) for r in live)
        self._forget_if_done(request_id)

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, sample, and return every sequence's new tokens."""
        outputs, self._pending = self._pending, []
        scheduled = self.scheduler.schedule()
        if scheduled.is_empty:
            return outputs
        block_tables = [self.kv_cache.block_ids(s.request) for s in scheduled.scheduled]
        try:
            result = self.runner.execute(scheduled.scheduled, block_tables)
        except BaseException:
            # Blocks published for this step were never filled: their cache entries would be wrong.
            self.kv_cache.reset_prefix_cache()
            raise
        updated = self.scheduler.update(scheduled, result.sampled_token_ids)
        for request, logprob in zip(updated, result.logprobs, strict=True):
            outputs.append(_output(request, [request.all_token_ids[-1]], None if logprob is None else [logprob]))
            if request.is_finished:
                self._forget_if_done(request.request_id)
        return outputs

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending)

    def has_room(self) -> bool:
        """Whether to take more work: a short waiting queue and some free KV blocks."""
        watermark = int(self.kv_cache.num_blocks * self.config.watermark_fraction)
        return (len(self.scheduler.waiting) < self.config.num_max_waiting
                and self.kv_cache.num_free_blocks > watermark)

    def stats(self) -> EngineStats:
        counters = self.scheduler.counters
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_free_blocks=self.kv_cache.num_free_blocks,
            num_total_blocks=self.kv_cache.num_blocks,
            num_preemptions=counters.num_preemptions,
            num_prefix_cache_query_tokens=counters.num_prefix_cache_query_tokens,
            num_prefix_cache_hit_tokens=counters.num_prefix_cache_hit_tokens,
            num_computed_tokens=counters.num_computed_tokens,
            num_generated_tokens=counters.num_generated_tokens,
            num_steps=counters.num_steps,
        )

    def generate(
        self,
        prompts: Sequence[Sequence[int]] | Sequence[str],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[GenerationResult]:
        """Run prompts (token ids, or text: then the tokenizer is loaded once) to completion."""
        return generate(self, prompts, params, use_tqdm)

    def _forget_if_done(self, request_id: str) -> None:
        choices = self._requests.get(request_id)
        if choices is not None and all(r.status is RequestStatus.FINISHED for r in choices):
            del self._requests[request_id]


def _output(request: Request, new_token_ids: list[int], logprobs: list | None) -> RequestOutput:
    if logprobs is None and request.params.logprobs is not None:
        logprobs = []
    return RequestOutput(
        request_id=request.request_id,
        index=request.index,
        new_token_ids=new_token_ids,
        new_logprobs=logprobs,
        finish_reason=request.finish_reason,
        num_prompt_tokens=request.num_prompt_tokens,
        num_output_tokens=request.num_output_tokens,
        num_cached_tokens=max(request.num_cached_tokens, 0),
    )


def _fit_max_model_len(config: EngineConfig, model_max_len: int, num_blocks: int) -> int:
    """The context limit: the model's, but never more than the KV cache holds (a lone sequence must fit)."""
    capacity = num_blocks * config.block_size
    if config.max_model_len is not None and config.max_model_len > capacity:
        raise ValueError(f"max_model_len: {config.max_model_len} exceeds the KV cache ({num_blocks} blocks of "
                         f"{config.block_size} = {capacity} tokens)")
    if model_max_len > capacity:
        log.warning("max_model_len lowered from %d to %d: the KV cache holds no more", model_max_len, capacity)
    return min(model_max_len, capacity)


def _select_attention_backend(device: torch.device) -> None:
    name = attention.default_backend(device)
    try:
        attention.use_backend(name)
    except ImportError:
        log.warning("attention backend %r unavailable; using the torch reference", name)
        attention.use_backend("torch")
