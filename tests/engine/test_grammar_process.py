"""The grammar process (structured output's matchers off the engine's GIL): its masks and accept outcomes are a
local matcher's, token by token; replays and reasoning gates run there; dropped matchers are freed; a dead
process is an error, not a hang. An engine with it gives the in-process engine's tokens, overlapped or under
speculative decoding, and is freed when dropped."""

from __future__ import annotations

import gc
import json
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
import xgrammar as xgr

from pagedserve.services.engine.model_runner import StepResult
from pagedserve.services.engine.models.base import CausalLM
from pagedserve.services.engine.sampling_params import SamplingParams
from pagedserve.services.engine.structured.compiler import GrammarCompilerPool
from pagedserve.services.engine.structured.grammar_process import GrammarProcess, GrammarProcessError
from pagedserve.services.engine.structured.mask_worker import MaskWorker
from pagedserve.services.engine.structured.reasoning_gate import ReasoningGate
from pagedserve.services.engine.structured.state import GrammarState, RemoteGrammarState, accept_all
from pagedserve.shared.grammar_spec import GrammarSpec
from pagedserve.shared.tokenizer_loader import load_tokenizer
from tests.engine.engine_helpers import make_request
from tests.engine.test_structured import PERSON, make_engine, output_text

VOCAB = 49152  # SmolLM2's
EOS = 2
SPECS = [GrammarSpec.json_schema(PERSON), GrammarSpec("regex", r"[0-9]{3}"), GrammarSpec.choice(["yes", "no"])]
COMPLETIONS = ['{"name":"Ann","age":41}', "123", "no"]


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path) -> Any:
    return load_tokenizer(smollm2_dir)


@pytest.fixture(scope="module")
def pool(tokenizer: Any) -> GrammarCompilerPool:
    return GrammarCompilerPool(tokenizer, VOCAB, [EOS])


@pytest.fixture(scope="module", params=[1, 2], ids=["one process", "two processes"])
def process(pool: GrammarCompilerPool, request: pytest.FixtureRequest) -> Iterator[GrammarProcess]:
    """One process, and two that share the matchers (by id: consecutive grammars land in different ones)."""
    process = GrammarProcess(pool.tokenizer_info, VOCAB, max_rows=8, pin=False, num_children=request.param)
    yield process
    process.shutdown()


def local(pool: GrammarCompilerPool, spec: GrammarSpec, gate: ReasoningGate | None = None) -> GrammarState:
    state = GrammarState(pool.submit(spec), gate)
    pool.submit(spec).result()
    assert state.is_ready
    return state


def remote(
    pool: GrammarCompilerPool, process: GrammarProcess, spec: GrammarSpec, gate: ReasoningGate | None = None
) -> RemoteGrammarState:
    state = RemoteGrammarState(pool.submit(spec), gate, spec, process)
    pool.submit(spec).result()
    assert state.is_ready and state.matcher_id >= 0
    return state


def local_mask(state: GrammarState) -> torch.Tensor:
    bitmask = xgr.allocate_token_bitmask(1, VOCAB)
    state.fill_bitmask(bitmask, 0)
    return bitmask[0]


def remote_masks(process: GrammarProcess, rows: list[tuple[int, RemoteGrammarState]]) -> dict[int, torch.Tensor]:
    """The masks the grammar processes fill for these (row, grammar)s, by row (slot 1)."""
    num_rows = process.fill(1, [(row, grammar.matcher_id) for row, grammar in rows])
    return {int(row): process.masks[1][i].clone() for i, row in enumerate(process.rows[1][:num_rows])}


def all_allowed(masks: dict[int, torch.Tensor]) -> bool:
    return bool(masks) and all(bool((mask == -1).all()) for mask in masks.values())


def test_masks_and_outcomes_follow_a_local_matcher(
    pool: GrammarCompilerPool, process: GrammarProcess, tokenizer: Any
) -> None:
    """Three grammars stepped together, one batched accept a step: after every token each row's mask is the
    local matcher's; each completes at its stop token, and a finished row is no longer filled."""
    locals_ = [local(pool, spec) for spec in SPECS]
    remotes = [remote(pool, process, spec) for spec in SPECS]
    streams = [[*tokenizer.encode(text, add_special_tokens=False), EOS] for text in COMPLETIONS]
    rows = [(row, grammar) for row, grammar in zip([5, 0, 3], remotes)]
    for step in range(max(map(len, streams))):
        live = [i for i in range(3) if step < len(streams[i])]
        masks = remote_masks(process, [rows[i] for i in live if remotes[i].constrains_next])
        for i in live:
            assert torch.equal(masks[rows[i][0]], local_mask(locals_[i])), (SPECS[i].kind, step)
        tokens = [streams[i][step] for i in live]
        assert accept_all([remotes[i] for i in live], tokens) == accept_all([locals_[i] for i in live], tokens)
        for i in live:
            assert remotes[i].is_terminated == locals_[i].is_terminated
    assert all(g.is_terminated and g.error is None for g in remotes)
    assert all_allowed(remote_masks(process, rows))  # an ended grammar masks nothing


def test_a_rejected_token_ends_the_grammar_with_the_local_error(
    pool: GrammarCompilerPool, process: GrammarProcess, tokenizer: Any
) -> None:
    letter = tokenizer.encode("x", add_special_tokens=False)[0]
    here, there = local(pool, SPECS[1]), remote(pool, process, SPECS[1])
    assert here.accept(letter) is False and there.accept(letter) is False
    assert there.error == here.error == f"the grammar rejected token {letter}"
    assert all_allowed(remote_masks(process, [(0, there)]))  # ended: no mask, and no more accepts
    assert there.accept(letter) is False


def test_replays_and_reasoning_gates_run_in_the_child(
    pool: GrammarCompilerPool, process: GrammarProcess, tokenizer: Any
) -> None:
    """A continuation's tokens reach one matcher several times in one message; behind a gate they pass free
    until the end marker, and the row gets no mask until then."""
    marker = tokenizer.encode("</think>", add_special_tokens=False)
    thinking = tokenizer.encode("hmm, digits", add_special_tokens=False)
    digits = tokenizer.encode("12", add_special_tokens=False)
    here = local(pool, SPECS[1], ReasoningGate([marker]))
    there = remote(pool, process, SPECS[1], ReasoningGate([marker]))
    here.replay(thinking)
    there.replay(thinking)
    assert all_allowed(remote_masks(process, [(2, there)]))  # still reasoning
    here.replay([*marker, *digits])
    there.replay([*marker, *digits])
    assert torch.equal(remote_masks(process, [(2, there)])[2], local_mask(here))
    assert there.error is None and not there.is_terminated


def test_dropped_matchers_are_freed(pool: GrammarCompilerPool, process: GrammarProcess) -> None:
    before = process.num_matchers()
    grammars = [remote(pool, process, SPECS[2]) for _ in range(3)]
    assert process.num_matchers() == before + 3
    del grammars
    gc.collect()
    assert process.num_matchers() == before


def test_a_dead_process_is_an_error(pool: GrammarCompilerPool) -> None:
    process = GrammarProcess(pool.tokenizer_info, VOCAB, max_rows=2, pin=False, num_children=2)
    grammar = remote(pool, process, SPECS[2])
    process._children[1].kill()  # not the one holding the grammar: every request goes to both
    process._children[1].wait()
    with pytest.raises(GrammarProcessError, match="gone"):
        grammar.accept(EOS)
    process.shutdown()


PROMPT_TEXT = "Describe a person as JSON with a name and an age."


def test_an_engine_with_the_process_gives_the_in_process_tokens(
    smollm2_dir: Path, smol_model: CausalLM, tokenizer: Any
) -> None:
    """Grammar rows beside plain ones under overlapped steps, one behind a reasoning gate, one continuing a
    partial answer: the same greedy tokens with the matchers in the grammar process as in the engine's; then
    the same with speculative decoding (its synchronous mask path) and two grammar processes."""
    chat = [{"role": "user", "content": PROMPT_TEXT}]
    prompt = list(tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False))
    spec = GrammarSpec.json_schema(PERSON)
    constrained = SamplingParams(temperature=0.0, max_tokens=40, structured_output=spec)
    plain = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    prompts = [[*prompt[:-5], 300 + i, *prompt[-5:]] for i in range(5)]
    # the gate's end marker: the row's own first two free tokens, so the grammar starts mid-answer
    first = make_engine(smollm2_dir, smol_model).generate([prompts[2]], SamplingParams(temperature=0.0, max_tokens=2))
    free = first[0].token_ids
    gated = SamplingParams(temperature=0.0, max_tokens=40, structured_output=spec, reasoning_end_ids=[free])
    params = [constrained, plain, gated, constrained, plain]
    partial = tokenizer.encode('{"name":"Zed","age":', add_special_tokens=False)

    def run(**settings: Any) -> list[list[int]]:
        engine = make_engine(smollm2_dir, smol_model, **settings)
        tokens: dict[str, list[int]] = {"cont": []}
        engine.add_request("cont", prompt, constrained, output_token_ids=partial)
        for i, (row_prompt, row_params) in enumerate(zip(prompts, params)):
            engine.add_request(str(i), row_prompt, row_params)
            tokens[str(i)] = []
        while engine.has_unfinished():
            for out in engine.step():
                tokens[out.request_id] += out.new_token_ids
        assert (engine.grammars.process is not None) == bool(settings["grammar_processes"])
        engine.shutdown()
        freed = weakref.ref(engine)
        del engine  # by its reference count: gc.freeze() at its start keeps a cycle through it for good
        assert freed() is None
        return [tokens[str(i)] for i in range(len(params))] + [tokens["cont"]]

    in_process = run(grammar_processes=0, async_scheduling=True)
    assert run(grammar_processes=1, async_scheduling=True) == in_process
    assert in_process[2][:2] == free
    for tokens in [in_process[0], in_process[2][2:], in_process[3], partial + in_process[-1]]:
        jsonschema.validate(json.loads(output_text(tokenizer, tokens)), PERSON)
    ngram = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 2}'
    assert run(grammar_processes=2, speculative_config=ngram) == in_process


def test_a_step_reply_waits_for_its_collector(
    pool: GrammarCompilerPool, process: GrammarProcess, tokenizer: Any
) -> None:
    """A step posted (by the mask worker) and collected later (by the engine thread): calls made in between get
    their own replies, and the step's accept and fill arrive intact."""
    here, there = local(pool, SPECS[1]), remote(pool, process, SPECS[1])
    seven = tokenizer.encode("7", add_special_tokens=False)[0]
    ticket = process.post_step([there.matcher_id], [seven], 0, [(4, there.matcher_id)], time.monotonic())
    count = process.num_matchers()  # reads past the step's reply, which waits for its ticket
    assert count >= 1
    assert process.collect_step(ticket) == {} and here.accept(seven)
    assert process.rows[0][0] == 4 and torch.equal(process.masks[0][0], local_mask(here))
    timings = process.step_timings()
    assert set(timings) == {"handover_ms", "post_to_start_ms", "work_ms"} and timings["work_ms"] > 0


class CopyEvent:
    """A step's copy to the host, done or still running (its `synchronize` waits it out)."""

    def __init__(self, done: bool) -> None:
        self.done = done

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


class LaunchedStep:
    """A launched step as the mask worker sees it: `ready`, and `result()` (which notes the thread it ran on)."""

    def __init__(self, tokens: list[int], done: bool) -> None:
        self.ready = CopyEvent(done)
        self.tokens = tokens
        self.waited_on = ""

    def result(self) -> StepResult:
        self.ready.synchronize()
        self.waited_on = threading.current_thread().name
        return StepResult(list(self.tokens), [None] * len(self.tokens))


def test_tokens_on_the_host_are_posted_at_once_others_by_the_worker(
    pool: GrammarCompilerPool, process: GrammarProcess, tokenizer: Any
) -> None:
    """Step tokens already on the host go to the grammar process from the engine thread; tokens still being copied
    are waited for on the worker thread. Either way the step's result, its ends and its masks come back."""
    worker = MaskWorker(VOCAB, max_rows=8, device=torch.device("cpu"), process=lambda: process)
    here, there = local(pool, SPECS[1]), remote(pool, process, SPECS[1])
    request = make_request([1, 2, 3])
    request.grammar = there
    for done, text in ((True, "4"), (False, "5")):
        token = tokenizer.encode(text, add_special_tokens=False)[0]
        step = LaunchedStep([EOS, token], done)
        task = worker.submit_remote(step, [(1, request)], [(1, there)])
        accepted, masks = task.join()
        assert accepted is not None and masks is not None
        result, ends = accepted
        assert result.sampled_token_ids == [EOS, token] and ends == [False, False]
        assert step.waited_on == "MainThread" if done else step.waited_on.startswith("grammar-mask")
        assert here.accept(token)
        assert torch.equal(torch.as_tensor(masks.row_ids), torch.tensor([1]))
        assert torch.equal(masks.bitmask[1], local_mask(here))
    completed = remote(pool, process, SPECS[2])  # ended before this step: its row ends, as in the engine's own path
    completed.replay([*tokenizer.encode("no", add_special_tokens=False), EOS])
    assert completed.is_terminated
    finished = make_request([4, 5])
    finished.grammar = completed
    six = tokenizer.encode("6", add_special_tokens=False)[0]
    step = LaunchedStep([EOS, six], done=True)
    accepted, _ = worker.submit_remote(step, [(0, finished), (1, request)], [(1, there)]).join()
    assert accepted is not None and accepted[1] == [True, False]
    worker.shutdown()


def test_a_dead_grammar_process_fails_its_requests_and_is_replaced(
    smollm2_dir: Path, smol_model: CausalLM, tokenizer: Any
) -> None:
    """The step that finds the grammar process gone raises (the engine service then ends the running requests
    with an error); the next grammar request starts a new process and completes. A death that the next grammar
    request finds first ends the running grammar's request and no more."""
    chat = [{"role": "user", "content": PROMPT_TEXT}]
    prompt = list(tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False))
    constrained = SamplingParams(temperature=0.0, max_tokens=40, structured_output=GrammarSpec.json_schema(PERSON))
    engine = make_engine(smollm2_dir, smol_model, grammar_processes=1, async_scheduling=True)
    engine.add_request("before", prompt, constrained)
    for _ in range(3):
        engine.step()
    dead = engine.grammars.process
    assert dead is not None
    dead._children[0].kill()
    dead._children[0].wait()
    with pytest.raises(GrammarProcessError, match="gone"):
        while engine.has_unfinished():
            engine.step()
    engine.abort(["before"])
    result = engine.generate([prompt], constrained)[0]
    assert engine.grammars.process is not None and engine.grammars.process is not dead
    jsonschema.validate(json.loads(output_text(tokenizer, result.token_ids)), PERSON)
    # Dead between steps, found by the next grammar request: the running grammar fails (its request ends), the
    # new one runs in new processes, and neither sees the other's matcher.
    engine.add_request("running", prompt, constrained)
    for _ in range(3):
        engine.step()
    dead = engine.grammars.process
    dead._children[0].kill()
    dead._children[0].wait()
    engine.add_request("new", prompt, constrained)
    tokens: dict[str, list[int]] = {"running": [], "new": []}
    finished: dict[str, str | None] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finish_reason is not None:
                finished[out.request_id] = out.finish_reason
    assert engine.grammars.process is not dead and finished == {"running": "stop", "new": "stop"}
    assert len(tokens["running"]) < len(result.token_ids)  # cut short
    assert tokens["new"] == result.token_ids  # greedy: the same answer as the first new request
    engine.shutdown()
