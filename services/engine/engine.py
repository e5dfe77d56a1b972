"""The engine: requests in, one scheduled step at a time, token deltas out. No Redis, no HTTP.

    engine = Engine(Config.of(model=str(...)))
    engine.add_request("r1", prompt_token_ids, SamplingParams(max_tokens=32))
    while engine.has_unfinished():
        for out in engine.step(): ...           # RequestOutput deltas

or offline: `engine.generate(prompts, params)`; an engine in pooling mode (--runner pooling, pooling_config.py)
serves embeddings instead: `add_embedding_request` / `engine.embed(prompts)` (pooler.py). Not thread-safe:
call it from one thread (the engine service feeds it from a queue).

A sequence finishes with "stop" when it samples an EOS id of the model (unless ignore_eos) or one
of its stop_token_ids (either only after min_tokens), with "length" at max_tokens or the context
limit, with "abort" after `abort()`. The finishing token is part of `new_token_ids`.

With `async_scheduling` (the CUDA default) a step's tokens come back from the next call of `step()`,
which has launched the following step before waiting for them (see async_steps.py).
"""

from __future__ import annotations

import atexit
import functools
import gc
import itertools
import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from pagedserve.services.engine.async_steps import (
    PLACEHOLDER_TOKEN_ID,
    InflightStep,
    KnownTokensKVCacheManager,
    Placeholders,
    is_stop_token,
)
from pagedserve.services.engine.config import is_async_scheduling, model_dir, torch_device
from pagedserve.services.engine.executor import make_executor
from pagedserve.services.engine.hybrid_kv_cache import HybridKVCacheManager
from pagedserve.services.engine.input_batch import eager_token_bucket
from pagedserve.services.engine.kv_cache_groups import is_hybrid
from pagedserve.services.engine.kv_offload import HostKVTier
from pagedserve.services.engine.lora.manager import UnknownAdapterError
from pagedserve.services.engine.model_runner import StepResult
from pagedserve.services.engine.models.base import CausalLM
from pagedserve.services.engine.offline import generate
from pagedserve.services.engine.outputs import EngineStats, GenerationResult, RequestOutput
from pagedserve.services.engine.pooling_config import PoolingParams, resolve_pooling
from pagedserve.services.engine.prompt_logprobs import accumulate
from pagedserve.services.engine.request import Request, RequestStatus
from pagedserve.services.engine.sampling_params import SamplingParams
from pagedserve.services.engine.scheduler import Scheduler, SchedulerCounters, SchedulerOutput
from pagedserve.services.engine.spec_decode.proposers import make_speculative_decoding
from pagedserve.services.engine.step_profile import StepProfile
from pagedserve.services.engine.structured import bitmask
from pagedserve.services.engine.structured.admission import GrammarAdmission
from pagedserve.services.engine.structured.mask_worker import MaskWorker, StepGrammarTask
from pagedserve.services.engine.structured.state import accept_all
from pagedserve.services.engine.token_chars import TokenChars
from pagedserve.shared.config import Config

log = logging.getLogger(__name__)
atexit.register(gc.unfreeze)  # Engine freezes the start-up heap (see __init__); shutdown collects it as usual
_WAITING_WHEN_FULL = 8  # requests an engine with every sequence slot busy still takes (the next to start)


class Engine:
    def __init__(self, config: Config, model: CausalLM | None = None) -> None:
        self.config = config
        self.model_dir = model_dir(config)
        self.device = torch_device(config)
        self.profile = StepProfile(enabled=config.runner.profile_steps)
        self.executor = make_executor(config, model, self.profile)  # loads the model, sizes the KV cache
        self.runner = self.executor.runner
        spec = self.runner.model.spec
        num_blocks = self.runner.num_blocks
        self.max_model_len = self.runner.max_model_len
        self.eos_token_ids = frozenset(spec.eos_token_ids)
        # Every id that may end some sequence (EOS, any request's stop ids; only grows): a sampled token
        # outside it skips the per-request stop check.
        self._stop_token_ids: set[int] = set(self.eos_token_ids)
        self.vocab_size = spec.vocab_size
        self.hidden_size = spec.hidden_size
        # None: the engine generates; else it only pools prompts into embeddings (pooling_config.py)
        self.pooling: PoolingParams | None = resolve_pooling(config.model, self.model_dir)
        self.placeholders = Placeholders()
        host_kv = self.runner.host_kv  # None without --kv-offload-gb
        groups = self.runner.kv_groups
        self.kv_cache: KnownTokensKVCacheManager
        if is_hybrid(groups):  # global and sliding layers: blocks of their own for each (kv_cache_groups.py)
            self.kv_cache = HybridKVCacheManager(
                groups,
                num_blocks,
                config.cache.block_size,
                config.cache.enable_prefix_caching,
                self.placeholders.num_known_tokens,
            )
        else:
            self.kv_cache = KnownTokensKVCacheManager(
                num_blocks,
                config.cache.block_size,
                config.cache.enable_prefix_caching,
                self.placeholders.num_known_tokens,
                HostKVTier(host_kv.num_slots) if host_kv is not None else None,
                groups[0].window,
            )
        self.scheduler = Scheduler(
            self.kv_cache,
            config.scheduler.max_num_seqs,
            config.scheduler.max_num_batched_tokens,
            self.max_model_len,
            config.scheduler.scheduling_policy,
        )
        self.speculative = make_speculative_decoding(
            config, self.runner, self.kv_cache
        )  # None without --speculative-config
        self.is_async = is_async_scheduling(config) and self.speculative is None  # a verify step cannot overlap
        self._requests: dict[str, list[Request]] = {}  # request id -> its choices, until all finish
        self._pending: list[RequestOutput] = []  # outputs made between steps (aborts), sent by step()
        self._inflight: InflightStep | None = None  # launched, its tokens not applied yet
        self._arrival = itertools.count()
        self._warned_priority = False
        self.lora = self.runner.lora  # None without --enable-lora
        self._lora_waiting: list[Request] = []  # their adapter waits for a slot (every slot pinned by others)
        self.grammars = GrammarAdmission(
            config.model.tokenizer or self.model_dir,
            self.vocab_size,
            sorted(self.eos_token_ids),
            max_rows=config.scheduler.max_num_seqs,
            num_processes=config.runner.grammar_processes,
            pin_masks=self.device.type == "cuda",
        )
        grammars = self.grammars  # (not self: a cycle through the engine would outlive gc.freeze() below)
        self.mask_worker = MaskWorker(
            self.vocab_size, config.scheduler.max_num_seqs, self.device, lambda: grammars.process
        )
        self.token_chars = TokenChars(config.model.tokenizer or self.model_dir, self.vocab_size)
        if self.device.type == "cuda" and config.runner.warm_up:
            self._warm_up()
        # Everything alive now (torch, the model, tokenizers: ~400k objects) lives as long as the engine:
        # move it out of the collector's view, or each full collection walks it all (~0.1-0.5 s, mid-step).
        gc.freeze()
        log.info(
            "engine ready: %d KV blocks of %d tokens, max_model_len %d",
            num_blocks,
            config.cache.block_size,
            self.max_model_len,
        )

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        output_token_ids: Sequence[int] = (),
        choice_output_token_ids: Mapping[int, Sequence[int]] | None = None,
        lora_name: str | None = None,
    ) -> None:
        """Queue a request (n choices). `output_token_ids` continue a request another replica began:
        they count towards max_tokens, min_tokens and penalties and are never emitted again.
        `choice_output_token_ids` continue some choices of an n > 1 request the same way (original
        choice index -> its tokens so far): only those choices run, under their original indexes.
        `lora_name` runs it with that LoRA adapter (UnknownAdapterError when not served).
        Raises ValueError (naming the parameter) for input the engine cannot serve."""
        if request_id in self._requests:
            raise ValueError(f"request_id: {request_id!r} is already running")
        if self.pooling is not None:
            raise ValueError("model: this engine serves embeddings (--runner pooling); it does not generate text")
        params.validate(self.vocab_size)
        if lora_name is not None and (self.lora is None or not self.lora.has(lora_name)):
            raise UnknownAdapterError(f"model: the LoRA adapter {lora_name!r} does not exist")
        if params.priority and not self._warned_priority and self.config.scheduler.scheduling_policy == "fcfs":
            self._warned_priority = True  # vLLM answers 400 here; we serve the request, in arrival order
            log.warning(
                "request %s has priority %d, which only --scheduling-policy priority honours; serving it "
                "in arrival order (logged once)",
                request_id,
                params.priority,
            )
        prompt = list(prompt_token_ids)
        resumed = _choices_to_run(params.n, list(output_token_ids), choice_output_token_ids)
        if not prompt:
            raise ValueError("prompt: must not be empty")
        if any(not 0 <= t < self.vocab_size for t in prompt + [t for ts in resumed.values() for t in ts]):
            raise ValueError(f"prompt: token ids must be in [0, {self.vocab_size})")
        if (output_token_ids or choice_output_token_ids) and params.prompt_logprobs is not None:
            params = replace(params, prompt_logprobs=None)  # sent by the replica that began it
        num_context = len(prompt) + max(len(ts) for ts in resumed.values())
        if num_context >= self.max_model_len:
            raise ValueError(f"prompt: {num_context} tokens leave no room in the context of {self.max_model_len}")
        max_tokens = self.max_model_len - len(prompt) if params.max_tokens is None else params.max_tokens
        if len(prompt) + max_tokens > self.max_model_len:
            raise ValueError(
                f"max_tokens: prompt ({len(prompt)}) + max_tokens ({max_tokens}) exceed the "
                f"context of {self.max_model_len}"
            )
        arrival = next(self._arrival)
        self._stop_token_ids.update(params.stop_token_ids)
        choices = [
            Request.create(
                request_id,
                index,
                prompt,
                outputs,
                params.for_choice(index),
                max_tokens,
                self.eos_token_ids,
                arrival,
                self.device,
            )
            for index, outputs in resumed.items()
        ]
        if params.min_characters:
            try:
                lengths = self.token_chars.lengths
            except Exception as exc:  # a model directory without tokenizer files
                raise ValueError(f"min_characters: the model's tokenizer could not be loaded ({exc})") from None
            for request in choices:
                request.token_chars = lengths
        self._requests[request_id] = choices
        for request in choices:
            request.lora_name = lora_name
            if request.num_output_tokens >= max_tokens:  # a continuation that was already complete
                self.scheduler.finish([request], "length")
                self._pending.append(_output(request, [], None))
            elif lora_name is not None and (self._lora_waiting or not self._pin_adapter(request)):
                self._lora_waiting.append(request)  # in arrival order, behind those already waiting
            else:
                self._queue(request)
        self._forget_if_done(request_id)

    def add_embedding_request(
        self, request_id: str, prompt_token_ids: Sequence[int], dimensions: int | None = None
    ) -> None:
        """Queue a prompt to pool (a pooling engine only): it runs its forward pass, nothing is sampled, and its
        one RequestOutput carries the `embedding`. Raises ValueError (naming the parameter) for bad input."""
        if self.pooling is None:
            raise ValueError(
                "model: this engine generates text; embeddings need an engine started with --runner pooling"
            )
        if request_id in self._requests:
            raise ValueError(f"request_id: {request_id!r} is already running")
        pooling = replace(self.pooling, dimensions=dimensions)
        pooling.validate(self.hidden_size)
        prompt = list(prompt_token_ids)
        if not prompt:
            raise ValueError("input: must not be empty")
        if any(not 0 <= t < self.vocab_size for t in prompt):
            raise ValueError(f"input: token ids must be in [0, {self.vocab_size})")
        if len(prompt) >= self.max_model_len:
            raise ValueError(f"input: {len(prompt)} tokens exceed the context of {self.max_model_len}")
        params = SamplingParams(max_tokens=1)
        request = Request.create(
            request_id, 0, prompt, [], params, 1, self.eos_token_ids, next(self._arrival), self.device
        )
        request.pooling = pooling
        self._requests[request_id] = [request]
        self.scheduler.add(request)

    def embed(self, prompts: Sequence[Sequence[int]], dimensions: int | None = None) -> list[list[float]]:
        """Offline: each prompt's embedding, in order (a pooling engine only)."""
        request_ids = [f"embed-{next(self._arrival)}" for _ in prompts]
        for request_id, prompt in zip(request_ids, prompts):
            self.add_embedding_request(request_id, prompt, dimensions)
        vectors: dict[str, list[float]] = {}
        while self.has_unfinished():
            vectors.update((out.request_id, out.embedding) for out in self.step() if out.embedding is not None)
        return [vectors[request_id] for request_id in request_ids]

    def _queue(self, request: Request) -> None:
        if request.params.structured_output is not None:
            self.grammars.attach(request)  # the scheduler gets it once its grammar compiled
        else:
            self.scheduler.add(request)

    def _pin_adapter(self, request: Request) -> bool:
        """Put the request's adapter in a slot it pins until it ends; False while no slot can be had."""
        assert self.lora is not None and request.lora_name is not None
        slot = self.lora.acquire(request.lora_name)
        if slot is None:
            return False
        request.lora_slot = slot
        return True

    def _unpin_adapters(self, choices: Iterable[Request]) -> None:
        for request in choices:
            if request.lora_slot >= 0:
                assert self.lora is not None
                self.lora.release(request.lora_slot)
                request.lora_slot = -1

    def _admit_lora_waiting(self) -> list[RequestOutput]:
        """Queue the requests whose adapter now has a slot, in arrival order (the first that waits stops it);
        end those whose adapter was unloaded while they waited."""
        assert self.lora is not None
        outputs, waiting = [], []
        for request in self._lora_waiting:
            if request.is_finished:  # aborted while waiting
                continue
            if request.lora_name is not None and not self.lora.has(request.lora_name):
                log.warning("request %s: its LoRA adapter %r was unloaded", request.request_id, request.lora_name)
                self.scheduler.finish([request], "abort")
                outputs.append(_output(request, [], None))
                self._forget_if_done(request.request_id)
                continue
            waiting.append(request)
        while waiting and self._pin_adapter(waiting[0]):
            self._queue(waiting.pop(0))
        self._lora_waiting = waiting
        return outputs

    def add_lora(self, name: str, path: str) -> None:
        """Serve one more adapter (LoRAAdapterError, a ValueError, names why not)."""
        if self.lora is None:
            raise ValueError("lora_name: LoRA adapters are not enabled (--enable-lora)")
        self.lora.add(name, path)

    def remove_lora(self, name: str) -> bool:
        """Stop serving an adapter (requests running with it finish); False if it was not served."""
        return self.lora is not None and self.lora.remove(name)

    @property
    def lora_names(self) -> list[str]:
        return [] if self.lora is None else self.lora.names

    def abort(self, request_ids: Iterable[str]) -> None:
        """End requests now (idempotent; unknown ids ignored); step() reports them as "abort"."""
        for request_id in request_ids:
            choices = self._requests.pop(request_id, None)
            if choices is None:
                continue
            self._abort_choices(choices)
            self._unpin_adapters(choices)

    def abort_choices(self, request_id: str, indexes: Iterable[int]) -> None:
        """End some choices of an n > 1 request (a stop string hit one); idempotent, like abort()."""
        choices = self._requests.get(request_id)
        if choices is None:
            return
        wanted = set(indexes)
        self._abort_choices([r for r in choices if r.index in wanted])
        self._forget_if_done(request_id)

    def _abort_choices(self, choices: list[Request]) -> None:
        # A choice the scheduler ended at a launch whose tokens were not reported yet still counts as live.
        live = [
            r
            for r in choices
            if r.finish_reason != "abort" and (not r.is_finished or self.placeholders.has_unreported(r))
        ]
        self.scheduler.finish(live, "abort")
        for request in live:
            request.finish_reason = "abort"  # also over a length limit found at launch
        self._pending.extend(_output(r, [], None) for r in live)

    def step(self) -> list[RequestOutput]:
        """Schedule and launch a step; return the new tokens of the step before it (async
        scheduling) or of this one, and outputs of aborts made since the last call."""
        if self.speculative is not None:
            return self._step_speculative()
        profile = self.profile
        profile.start()
        outputs, self._pending = self._pending, []
        if self.grammars.compiling:
            outputs += self._admit_compiled()
        if self._lora_waiting:
            outputs += self._admit_lora_waiting()
        previous, self._inflight = self._inflight, None
        if previous is not None and previous.needs_tokens:
            outputs += self._finish(previous)
            previous = None
        scheduled = self.scheduler.schedule()
        profile.mark("schedule")
        if scheduled.is_empty and previous is None and self.grammars.compiling:
            self.grammars.wait(0.005)  # only compiles are left: no busy loop
        kind = "eager" if previous is None else previous.handle.kind
        if not scheduled.is_empty:
            current = self._launch(scheduled, previous)
            kind = current.handle.kind
            if self.is_async:
                self._inflight = current
            else:
                outputs += self._finish(current)
        if previous is not None:
            outputs += self._finish(previous)
        profile.end_call(kind)
        return outputs

    def _launch(self, scheduled: SchedulerOutput, previous: InflightStep | None) -> InflightStep:
        """Enqueue a step on the device, then tell the scheduler its sampling sequences got a
        (placeholder) token, so the next step can be scheduled before this one's tokens arrive."""
        requests = [s.request for s in scheduled.scheduled]
        block_tables = self.kv_cache.block_tables(requests)
        grammar_task = self._submit_grammar_work(scheduled, previous) if self.grammars.is_used else None
        try:
            handle = self.runner.launch(
                scheduled.scheduled,
                block_tables,
                previous.pending_rows() if previous is not None else None,
                previous.handle if previous is not None else None,
                grammar_masks=grammar_task.masks if grammar_task is not None else None,
                kv_transfers=self.kv_cache.drain_transfers(),
                group_tables=self._group_tables(requests),
            )
        except BaseException:
            # Blocks published for this step were never filled: their cache entries would be wrong.
            self.kv_cache.reset_prefix_cache()
            raise
        num_sampling = sum(1 for s in scheduled.scheduled if s.is_sampling)
        updated = self.scheduler.update(scheduled, [PLACEHOLDER_TOKEN_ID] * num_sampling)
        positions = self.placeholders.add_last(updated)
        self.profile.mark("update")
        needs_tokens = has_grammar_rows = False
        for r in updated:  # one pass over the step's rows (a per-step cost at hundreds of rows)
            needs_tokens = needs_tokens or r.reads_output_tokens
            has_grammar_rows = has_grammar_rows or r.grammar is not None
        return InflightStep(scheduled, handle, updated, positions, needs_tokens, has_grammar_rows)

    def _submit_grammar_work(self, scheduled: SchedulerOutput, previous: InflightStep | None) -> StepGrammarTask | None:
        """Hand the launch's grammar work to the worker thread: advance the grammars by the previous step's
        tokens (when it is still in flight), then fill the masks of this step's grammar rows. The rows to
        advance are chosen here, as the engine thread sees them now."""
        sampling = (s.request for s in scheduled.scheduled if s.is_sampling)
        fill = [(row, r.grammar) for row, r in enumerate(sampling) if r.grammar is not None]
        if self.grammars.process is not None:  # the matchers are in the grammar process: one message a step
            if previous is not None and previous.has_grammar_rows:
                previous.grammar_task = self.mask_worker.submit_remote(previous.handle, _grammar_rows(previous), fill)
                return previous.grammar_task
            return self.mask_worker.submit_remote(None, [], fill) if fill else None
        if previous is not None and previous.has_grammar_rows:
            accept_rows = _grammar_rows(previous)
            handle = previous.handle

            def accept() -> tuple[StepResult, list[bool]]:
                result = handle.result()  # waits (without the GIL) for the previous step's tokens
                return result, _grammar_ends_of(accept_rows, result.sampled_token_ids, len(result.sampled_token_ids))

            previous.grammar_task = self.mask_worker.submit(accept, fill)
            return previous.grammar_task
        return self.mask_worker.submit(None, fill) if fill else None

    def _finish(self, step: InflightStep) -> list[RequestOutput]:
        """Wait for a step's tokens, put them in place of its placeholders, apply stop tokens."""
        result = self._result(step)
        self.profile.mark("wait")
        grammar_ends = self._advance_grammars(step) if step.has_grammar_rows else itertools.repeat(False)
        self.profile.count_step(step.handle.kind, step.handle.num_tokens, step.handle.marks)
        for part in result.prompt_logprobs:
            accumulate(part.request.prompt_logprobs, part)
        outputs = self._pooled_outputs(result.pooled) if result.pooled else []
        assert len(result.sampled_token_ids) == len(result.logprobs) == len(step.requests)
        resolve, block_size, maybe_stops = self.placeholders.resolve, self.config.cache.block_size, self._stop_token_ids
        for request, position, token_id, logprob, ends in zip(
            step.requests, step.positions, result.sampled_token_ids, result.logprobs, grammar_ends
        ):
            resolve(request, position)
            tokens = request.all_token_ids
            if request.finish_reason == "abort" or position >= len(tokens):
                continue  # aborted, or a stop token one step earlier ended it: drop the token
            tokens[position] = token_id
            if (token_id in maybe_stops and is_stop_token(request, token_id, position)) or ends:
                del tokens[position + 1 :]  # a placeholder scheduled after it
                if request.is_finished:  # by a length limit found at a later launch
                    request.finish_reason = "stop"
                else:
                    self.scheduler.finish([request], "stop")
            elif (position + 1) % block_size == 0 and not request.is_finished:
                self.kv_cache.publish_known(request)  # the token completed a block: it can be shared now
            is_last = request.is_finished and position == len(tokens) - 1
            num_prompt = len(request.prompt_token_ids)
            new_logprobs = [logprob] if logprob is not None else [] if request.params.logprobs is not None else None
            output = RequestOutput(
                request.request_id,
                request.index,
                [token_id],
                new_logprobs,
                request.finish_reason if is_last else None,
                num_prompt,
                position + 1 - num_prompt,
                max(request.num_cached_tokens, 0),
            )
            if position == num_prompt and request.params.prompt_logprobs is not None:
                output.prompt_logprobs = list(request.prompt_logprobs)  # with the first output token
            outputs.append(output)
            if is_last:
                self._forget_if_done(request.request_id)
        self.profile.mark("output")
        return outputs

    def _pooled_outputs(self, pooled: list[tuple[Request, list[float]]]) -> list[RequestOutput]:
        """The outputs of pooling requests whose prompt ended in a step: finished ("stop"), with their vector."""
        outputs = []
        for request, vector in pooled:
            output = _output(request, [], None, 0)
            output.embedding = vector
            outputs.append(output)
            self._forget_if_done(request.request_id)
        return outputs

    def _step_speculative(self) -> list[RequestOutput]:
        """Draft, schedule, verify the drafts in one forward, apply (spec_decode/__init__.py); never overlapped."""
        speculative, profile = self.speculative, self.profile
        assert speculative is not None
        profile.start()
        outputs, self._pending = self._pending, []
        if self.grammars.compiling:
            outputs += self._admit_compiled()
        if self._lora_waiting:
            outputs += self._admit_lora_waiting()
        speculative.draft(self.scheduler.running)
        scheduled = self.scheduler.schedule()
        profile.mark("schedule")
        if scheduled.is_empty:
            if self.grammars.compiling:
                self.grammars.wait(0.005)
            profile.end_call("eager")
            return outputs
        grammar_masks = None
        if self.grammars.is_used:  # a step without drafts samples as usual: its grammar rows' masks, filled here
            sampling = [s.request for s in scheduled.scheduled if s.is_sampling]
            grammar_masks = functools.partial(bitmask.build_token_bitmask, sampling, self.vocab_size, self.device)
        try:
            requests = [s.request for s in scheduled.scheduled]
            handle = self.runner.launch(
                scheduled.scheduled,
                self.kv_cache.block_tables(requests),
                grammar_masks=grammar_masks,
                kv_transfers=self.kv_cache.drain_transfers(),
                group_tables=self._group_tables(requests),
            )
            result = handle.result()
        except BaseException:
            self.kv_cache.reset_prefix_cache()  # blocks published for this step were never filled
            raise
        profile.mark("wait")
        profile.count_step(handle.kind, handle.num_tokens, handle.marks)
        for part in result.prompt_logprobs:
            accumulate(part.request.prompt_logprobs, part)
        if result.pooled:  # a pooling request beside the drafted ones
            outputs += self._pooled_outputs(result.pooled)
        if handle.verified is None:  # nobody had drafts: one token each
            token_ids = [[t] for t in result.sampled_token_ids]
            logprobs = [None if lp is None else [lp] for lp in result.logprobs]
        else:
            speculative.record(handle.verified)
            token_ids, logprobs = handle.verified.token_ids, handle.verified.logprobs
        sampling = [s.request for s in scheduled.scheduled if s.is_sampling]
        num_before = [r.num_tokens for r in sampling]
        self.scheduler.update_verified(scheduled, token_ids)
        for request, start, row_logprobs in zip(sampling, num_before, logprobs, strict=True):
            new_ids = request.all_token_ids[start:]  # cut at a stop token or a length limit
            if new_ids and _grammar_ends(request, new_ids[-1]) and not request.is_finished:
                self.scheduler.finish([request], "stop")
            output = _output(request, new_ids, None if row_logprobs is None else row_logprobs[: len(new_ids)])
            if start == request.num_prompt_tokens and request.params.prompt_logprobs is not None:
                output.prompt_logprobs = list(request.prompt_logprobs)  # with the first output token
            outputs.append(output)
            if request.is_finished:
                self._forget_if_done(request.request_id)
        profile.mark("output")
        profile.end_call(handle.kind)
        return outputs

    def shutdown(self) -> None:
        """Stop the executor's worker ranks (no-op on one process); the engine is unusable after."""
        self.mask_worker.shutdown()
        self.grammars.shutdown()
        self.executor.shutdown()

    def is_admitted(self, request_id: str) -> bool:
        """Whether a request left the waiting queue (any choice scheduled once), or is gone."""
        choices = self._requests.get(request_id)
        return choices is None or any(r.num_cached_tokens >= 0 for r in choices)

    def _result(self, step: InflightStep) -> StepResult:
        """Wait for a step's results (once; the grammar worker may have waited for them already)."""
        if step.result is None:
            try:
                if step.grammar_task is not None:  # the worker took the tokens and advanced the grammars
                    step.result, step.grammar_ends = step.grammar_task.join()[0]
                else:
                    step.result = step.handle.result()
            except BaseException:
                self.kv_cache.reset_prefix_cache()
                raise
        return step.result

    def _advance_grammars(self, step: InflightStep) -> list[bool]:
        """Feed a step's tokens to its grammar rows (once, here unless the worker did), before the next
        step's masks are filled: per row, whether the grammar ended the sequence."""
        tokens = self._result(step).sampled_token_ids
        if step.grammar_ends is None:
            step.grammar_ends = _grammar_ends_of(_grammar_rows(step), tokens, len(tokens))
        return step.grammar_ends

    def has_unfinished(self) -> bool:
        return (
            self.scheduler.has_unfinished()
            or bool(self._pending)
            or self._inflight is not None
            or bool(self.grammars.compiling)
            or bool(self._lora_waiting)
        )

    def _admit_compiled(self) -> list[RequestOutput]:
        """Hand sequences whose grammar is ready to the scheduler; end those whose grammar failed."""
        outputs = []
        for request in self.grammars.pop_ready():
            assert request.grammar is not None
            if request.grammar.error is None:
                self.scheduler.add(request)
                continue
            log.error("request %s: %s", request.request_id, request.grammar.error)
            self.scheduler.finish([request], "abort")
            outputs.append(_output(request, [], None))
            self._forget_if_done(request.request_id)
        return outputs

    def _group_tables(self, requests: list[Request]) -> list[list[list[int]]]:
        """Per group after the first of a hybrid KV cache, the requests' block tables (none otherwise)."""
        kv_cache = self.kv_cache
        return kv_cache.group_block_tables(requests) if isinstance(kv_cache, HybridKVCacheManager) else []

    def has_room(self) -> bool:
        """Whether to take more work (see `num_wanted`)."""
        return self.num_wanted() > 0

    def num_wanted(self) -> int:
        """How many more requests to take now: up to the waiting queue's cap while KV blocks are free,
        but once (nearly) every sequence slot is busy only a few may wait, so that a replica does not
        hoard work that an idle replica could start at once (work is pulled, not pushed)."""
        watermark = int(self.kv_cache.num_blocks * self.config.scheduler.watermark_fraction)
        if self.kv_cache.num_free_blocks <= watermark:
            return 0
        waiting, running = len(self.scheduler.waiting) + len(self._lora_waiting), len(self.scheduler.running)
        queue_room = self.config.scheduler.num_max_waiting - waiting
        slot_room = self.config.scheduler.max_num_seqs + _WAITING_WHEN_FULL - running - waiting
        return max(0, min(queue_room, slot_room))

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
            num_prompt_tokens=counters.num_prompt_tokens,
            num_finished_by_reason=dict(counters.num_finished_by_reason),
            num_prefix_cache_host_hit_tokens=counters.num_prefix_cache_host_hit_tokens,
            num_host_cached_blocks=self.kv_cache.host.num_cached if self.kv_cache.host is not None else 0,
            **self._spec_stats(),
        )

    def _spec_stats(self) -> dict[str, Any]:
        if self.speculative is None:
            return {}
        spec = self.speculative.counters
        return {
            "num_spec_drafts": spec.num_drafts,
            "num_spec_draft_tokens": spec.num_draft_tokens,
            "num_spec_accepted_tokens": spec.num_accepted_tokens,
            "num_spec_accepted_tokens_per_pos": tuple(spec.num_accepted_tokens_per_pos),
        }

    def generate(
        self,
        prompts: Sequence[Sequence[int]] | Sequence[str],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[GenerationResult]:
        """Run prompts (token ids, or text: then the tokenizer is loaded once) to completion."""
        return generate(self, prompts, params, use_tqdm)

    def _warm_up(self) -> None:
        """Compile every kernel variant a step can need and capture the decode graphs, so that the
        first requests run at full speed; then forget the warm-up's requests, cache and counters."""
        start = time.perf_counter()
        self.runner.capture_graphs()
        bitmask.warm_up(self.vocab_size, self.device)
        longest = min(100, self.max_model_len - 3)
        # A prefill-sized and a short-query mix, and a long query among decodes (the paged kernel's prefill
        # tiles: the prefill kernel takes only steps of long queries on average). Offsets keep the prompts
        # from sharing cached blocks, which would shorten their steps.
        mixes = ((longest, 1), (min(8, longest), 1), (min(64, longest), 1, 1, 1, 1))
        for offset, lengths in enumerate(mixes):
            prompts = [[(17 * offset + i) % self.vocab_size for i in range(n)] for n in lengths]
            self._warm_run(prompts, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
        # Every eager token bucket up to 2,048 once, so that a first prompt of any usual length finds cuBLAS's
        # algorithm choices cached (input_batch.eager_token_bucket); bigger steps come under load.
        limit = min(2048, self.config.scheduler.max_num_batched_tokens, self.max_model_len - 1)
        sizes = sorted(b for b in {eager_token_bucket(n) for n in range(1, limit + 1)} if b <= limit)
        one_token = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        for size in sizes:  # prompts that share no block: a prefix-cache hit would shrink the step
            self._warm_run([[(size + i) % self.vocab_size for i in range(size)]], one_token)
        self.kv_cache.reset_prefix_cache()
        self.scheduler.counters = SchedulerCounters()
        self.profile.reset()
        log.info("warm-up done in %.1f s", time.perf_counter() - start)

    def _warm_run(self, prompts: list[list[int]], params: SamplingParams) -> None:
        if self.pooling is not None:  # a pooling engine runs the same prompt steps, without sampling
            self.embed(prompts)
        else:
            self.generate(prompts, params)

    def _forget_if_done(self, request_id: str) -> None:
        choices = self._requests.get(request_id)
        if choices is not None and all(r.status is RequestStatus.FINISHED for r in choices):
            del self._requests[request_id]
            self._unpin_adapters(choices)


def _grammar_rows(step: InflightStep) -> list[tuple[int, Request]]:
    """The step's rows whose token its grammar takes: not aborted, not dropped after an earlier stop."""
    return [
        (row, request)
        for row, (request, position) in enumerate(zip(step.requests, step.positions))
        if request.grammar is not None and request.finish_reason != "abort" and position < len(request.all_token_ids)
    ]


def _grammar_ends_of(rows: list[tuple[int, Request]], token_ids: list[int], num_rows: int) -> list[bool]:
    """`_grammar_ends` for each of a step's rows with a grammar (one batched matcher call): per row of the step."""
    ends = [False] * num_rows
    grammars = [request.grammar for _, request in rows if request.grammar is not None]
    assert len(grammars) == len(rows)
    accepted = accept_all(grammars, [token_ids[row] for row, _ in rows])
    for (row, request), grammar, ok in zip(rows, grammars, accepted):
        if not ok:
            log.error("request %s: %s", request.request_id, grammar.error)
        ends[row] = not ok or grammar.is_terminated
    return ends


def _grammar_ends(request: Request, token_id: int) -> bool:
    """Advance the sequence's grammar by its token: True once it is complete (its stop token
    accepted) or it rejected the token (cannot happen under the mask; the sequence ends anyway)."""
    grammar = request.grammar
    if grammar is None:
        return False
    if not grammar.accept(token_id):
        log.error("request %s: %s", request.request_id, grammar.error)
        return True
    return grammar.is_terminated


def _output(
    request: Request,
    new_token_ids: list[int],
    logprobs: list | None,
    num_output_tokens: int | None = None,
    is_last: bool = True,  # False: the token of a step before the one that finished the sequence
) -> RequestOutput:
    if logprobs is None and request.params.logprobs is not None:
        logprobs = []
    return RequestOutput(
        request_id=request.request_id,
        index=request.index,
        new_token_ids=new_token_ids,
        new_logprobs=logprobs,
        finish_reason=request.finish_reason if is_last else None,
        num_prompt_tokens=request.num_prompt_tokens,
        num_output_tokens=request.num_output_tokens if num_output_tokens is None else num_output_tokens,
        num_cached_tokens=max(request.num_cached_tokens, 0),
    )


def _choices_to_run(
    n: int, output_token_ids: list[int], choice_output_token_ids: Mapping[int, Sequence[int]] | None
) -> dict[int, list[int]]:
    """Choice index -> the output tokens it starts from, in index order."""
    if choice_output_token_ids is None:
        if output_token_ids and n != 1:
            raise ValueError("n: an n > 1 continuation gives each choice's tokens (choice_output_token_ids)")
        return {index: output_token_ids for index in range(n)}
    if output_token_ids:
        raise ValueError("output_token_ids: give either output_token_ids or choice_output_token_ids")
    if not choice_output_token_ids or any(not 0 <= i < n for i in choice_output_token_ids):
        raise ValueError(f"n: a continuation resumes one or more of the choices 0..{n - 1}")
    return {index: list(choice_output_token_ids[index]) for index in sorted(choice_output_token_ids)}
