"""Constrained decoding in the engine, on the real SmolLM2 weights (CPU): grammars compile off the
step loop, masks hold under sampling, preemption, continuation and async steps, and batches without
a grammar never touch the grammar library."""

from __future__ import annotations

import json
import sys
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch

from pagedserve.services.engine.engine import Engine
from pagedserve.services.engine.models.base import CausalLM
from pagedserve.services.engine.sampling_metadata import build_sampling_metadata
from pagedserve.services.engine.sampling_params import SamplingParams
from pagedserve.services.engine.structured.bitmask import build_token_bitmask
from pagedserve.services.engine.structured.compiler import compile_spec
from pagedserve.shared.config import Config
from pagedserve.shared.grammar_spec import GrammarSpec
from tests.engine.engine_helpers import make_request

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def prompt(tokenizer: Any) -> list[int]:
    messages = [{"role": "user", "content": "Describe a person as JSON with a name and an age."}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


def make_engine(smollm2_dir: Path, model: CausalLM, **changes: Any) -> Engine:
    settings: dict[str, Any] = dict(model=str(smollm2_dir), num_kv_blocks=256, max_num_seqs=16, seed=1)
    return Engine(Config.of(**{**settings, **changes}), model=model)


def json_params(seed: int, max_tokens: int = 64) -> SamplingParams:
    return SamplingParams(
        temperature=1.0, seed=seed, max_tokens=max_tokens, structured_output=GrammarSpec.json_schema(PERSON)
    )


def output_text(tokenizer: Any, token_ids: list[int]) -> str:
    return str(tokenizer.decode(token_ids, skip_special_tokens=True))


def test_json_schema_outputs_validate_under_sampling(
    smollm2_dir: Path, smol_model: CausalLM, tokenizer: Any, prompt: list[int]
) -> None:
    engine = make_engine(smollm2_dir, smol_model)
    results = engine.generate([prompt] * 4, [json_params(seed) for seed in range(4)])
    for result in results:
        assert result.finish_reason == "stop"
        jsonschema.validate(json.loads(output_text(tokenizer, result.token_ids)), PERSON)


def test_choice_and_regex(smollm2_dir: Path, smol_model: CausalLM, tokenizer: Any, prompt: list[int]) -> None:
    engine = make_engine(smollm2_dir, smol_model)
    choice = SamplingParams(
        temperature=1.5, n=6, seed=3, max_tokens=16, structured_output=GrammarSpec.choice(["yes", "no", "maybe later"])
    )
    regex = SamplingParams(
        temperature=1.5, n=4, seed=4, max_tokens=16, structured_output=GrammarSpec("regex", r"[0-9]{3}-[a-z]{2}")
    )
    by_choice, by_regex = engine.generate([prompt, prompt], [choice, regex])
    assert {output_text(tokenizer, t) for c in by_choice.choices for t in [c.token_ids]} <= {"yes", "no", "maybe later"}
    for token_ids in (c.token_ids for c in by_regex.choices):
        text = output_text(tokenizer, token_ids)
        assert len(text) == 6 and text[:3].isdigit() and text[3] == "-" and text[4:].isalpha(), text


class SlowPool:
    """The real compiler behind futures the test completes when it chooses."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.pending: list[tuple[Future[Any], GrammarSpec]] = []

    def submit(self, spec: GrammarSpec) -> Future[Any]:
        future: Future[Any] = Future()
        self.pending.append((future, spec))
        return future

    def release(self) -> None:
        for future, spec in self.pending:
            future.set_result(compile_spec(self.real._compiler, spec))


def test_compiling_grammar_does_not_stall_the_batch(
    smollm2_dir: Path, smol_model: CausalLM, tokenizer: Any, prompt: list[int]
) -> None:
    engine = make_engine(smollm2_dir, smol_model)
    slow = SlowPool(engine.grammars.pool)
    engine.grammars._pool = slow
    engine.add_request("json", prompt, json_params(0))
    engine.add_request("plain", prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    finished: dict[str, list[int]] = {"json": [], "plain": []}
    reasons: dict[str, str | None] = {}
    for _ in range(20):
        for out in engine.step():
            finished[out.request_id] += out.new_token_ids
            reasons[out.request_id] = out.finish_reason or reasons.get(out.request_id)
        if reasons.get("plain"):
            break
    assert reasons.get("plain") == "length" and len(finished["plain"]) == 8  # ran to the end meanwhile
    assert finished["json"] == [] and len(engine.grammars) == 1  # still held, never scheduled
    slow.release()
    while engine.has_unfinished():
        for out in engine.step():
            finished[out.request_id] += out.new_token_ids
            reasons[out.request_id] = out.finish_reason or reasons.get(out.request_id)
    assert reasons["json"] == "stop"
    jsonschema.validate(json.loads(output_text(tokenizer, finished["json"])), PERSON)


def test_grammar_survives_preemption_and_async_steps(
    smollm2_dir: Path, smol_model: CausalLM, tokenizer: Any, prompt: list[int]
) -> None:
    # 8 distinct sequences of ~60 tokens (4 blocks of 16 each) in 14 blocks: some must be preempted.
    engine = make_engine(smollm2_dir, smol_model, num_kv_blocks=14, async_scheduling=True)
    params = [json_params(seed, max_tokens=40) for seed in range(8)]
    prompts = [[*prompt[:-5], 100 + seed, *prompt[-5:]] for seed in range(8)]
    launch, hooked = engine.runner.launch, []

    def spy(*args: Any, **kwargs: Any) -> Any:  # args: scheduled, block_tables, pending_rows, previous handle
        hooked.append(kwargs.get("grammar_masks") is not None and args[3] is not None)
        return launch(*args, **kwargs)

    engine.runner.launch = spy  # type: ignore[method-assign]
    results = engine.generate(prompts, params)
    assert engine.stats().num_preemptions > 0
    # Grammar steps still overlap: the next step launches first, its masks wait for the tokens (on the worker).
    assert sum(hooked) > len(hooked) // 2
    for result in results:
        if result.finish_reason == "stop":
            jsonschema.validate(json.loads(output_text(tokenizer, result.token_ids)), PERSON)
    assert sum(r.finish_reason == "stop" for r in results) >= 6


def test_continuation_replays_tokens_into_the_grammar(
    smollm2_dir: Path, smol_model: CausalLM, tokenizer: Any, prompt: list[int]
) -> None:
    engine = make_engine(smollm2_dir, smol_model)
    prefix = tokenizer.encode('{"name":"Zed","age":', add_special_tokens=False)
    engine.add_request("cont", prompt, json_params(5), output_token_ids=prefix)
    new_tokens: list[int] = []
    while engine.has_unfinished():
        new_tokens += [t for out in engine.step() for t in out.new_token_ids]
    value = json.loads(output_text(tokenizer, prefix + new_tokens))
    assert value["name"] == "Zed" and 0 <= value["age"] <= 120


def test_plain_batches_never_touch_the_grammar_library(
    smollm2_dir: Path, smol_model: CausalLM, monkeypatch: pytest.MonkeyPatch, prompt: list[int]
) -> None:
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # any `import xgrammar` now raises ImportError
    requests = [make_request([1, 2, 3]), make_request([4, 5], SamplingParams(temperature=0.5, top_p=0.9))]
    assert build_token_bitmask(requests, 49152, torch.device("cpu")) is None
    build_sampling_metadata(requests, 49152, torch.device("cpu"))
    engine = make_engine(smollm2_dir, smol_model)
    result = engine.generate([prompt], SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, seed=0))
    assert len(result[0].token_ids) == 6 and engine.grammars._pool is None


def test_bitmask_is_applied_in_the_sampler(
    smollm2_dir: Path, smol_model: CausalLM, tokenizer: Any, prompt: list[int]
) -> None:
    """Rows with a grammar get -inf outside it (so even their top logprobs are allowed tokens); others do not."""
    engine = make_engine(smollm2_dir, smol_model)
    spec = GrammarSpec.choice(["yes", "no"])
    grammar_params = SamplingParams(temperature=1.0, max_tokens=4, logprobs=5, structured_output=spec, seed=0)
    plain_params = SamplingParams(temperature=1.0, max_tokens=4, logprobs=5, seed=0)
    constrained, plain = engine.generate([prompt, prompt], [grammar_params, plain_params])
    assert constrained.logprobs is not None and plain.logprobs is not None
    first = constrained.logprobs[0]
    allowed = [t for t, lp in first.top_logprobs if lp > float("-inf")]
    assert first.token_id in allowed
    assert all(any(word.startswith(tokenizer.decode([t])) for word in ("yes", "no")) for t in allowed)
    assert all(lp > float("-inf") for _, lp in plain.logprobs[0].top_logprobs)


def test_a_reasoning_gate_holds_the_grammar_until_the_end_marker(
    smollm2_dir: Path, smol_model: CausalLM, tokenizer: Any, prompt: list[int]
) -> None:
    """vLLM's default under a reasoning parser: free text until the reasoning's end marker, the grammar after.
    The 'end marker' here is the model's own first two greedy tokens, so the gate opens after them."""
    engine = make_engine(smollm2_dir, smol_model)
    free = engine.generate([prompt], [SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)])[0].token_ids
    digits = GrammarSpec("regex", r"[0-9]{3}")
    gated = SamplingParams(temperature=0.0, max_tokens=16, structured_output=digits, reasoning_end_ids=[free[:2]])
    closed_in_prompt = SamplingParams(  # the prompt closed the block (Qwen3's enable_thinking=false): no gate
        temperature=0.0,
        max_tokens=16,
        structured_output=digits,
        reasoning_start_ids=[prompt[-3:-2]],
        reasoning_end_ids=[prompt[-2:-1]],
    )
    plain = SamplingParams(temperature=0.0, max_tokens=16, structured_output=digits)
    by_gate, by_prompt, by_grammar = engine.generate([prompt] * 3, [gated, closed_in_prompt, plain])
    assert by_gate.token_ids[:2] == free[:2]  # the reasoning ran free: the unconstrained greedy tokens
    assert output_text(tokenizer, by_gate.token_ids[2:]).isdigit()  # the answer under the grammar
    assert len(output_text(tokenizer, by_gate.token_ids[2:])) == 3 and by_gate.finish_reason == "stop"
    assert not output_text(tokenizer, free[:2]).strip().isdigit()  # (so the grammar would have changed them)
    assert by_prompt.token_ids == by_grammar.token_ids  # a closed block in the prompt: the grammar from token 1
    assert output_text(tokenizer, by_grammar.token_ids).isdigit()


def test_grammar_rows_beside_plain_rows_under_async_steps(
    smollm2_dir: Path, smol_model: CausalLM, tokenizer: Any, prompt: list[int]
) -> None:
    """A batch mixing grammar and plain rows, masks filled on the worker thread while steps overlap: the grammar
    rows give valid JSON, the same greedy tokens as the synchronous path, and the plain rows the same tokens as
    a batch with no grammar at all."""
    prompts = [[*prompt[:-5], 200 + i, *prompt[-5:]] for i in range(6)]
    plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    constrained = SamplingParams(temperature=0.0, max_tokens=64, structured_output=GrammarSpec.json_schema(PERSON))
    mixed = [constrained if i % 2 else plain for i in range(6)]

    def run(params: list[SamplingParams], is_async: bool) -> list[list[int]]:
        engine = make_engine(smollm2_dir, smol_model, async_scheduling=is_async)
        assert engine.is_async == is_async
        results = engine.generate(prompts[: len(params)], params)
        for result, p in zip(results, params):
            if p.structured_output is not None:
                assert result.finish_reason == "stop"
                jsonschema.validate(json.loads(output_text(tokenizer, result.token_ids)), PERSON)
        return [r.token_ids for r in results]

    overlapped = run(mixed, is_async=True)
    assert overlapped[1::2] == run(mixed, is_async=False)[1::2]  # grammar rows: as without overlap
    all_plain = run([plain] * 6, is_async=True)
    assert overlapped[0::2] == all_plain[0::2]  # plain rows: untouched by their neighbours' masks
