"""Engine API semantics on a tiny random Llama (fast): stops, aborts, continuations, n, seeds."""

from __future__ import annotations

import random

import pytest

from pagedserve.services.engine.engine import Engine
from pagedserve.services.engine.models.base import CausalLM
from pagedserve.services.engine.sampling_params import SamplingParams
from pagedserve.shared.config import Config
from tests.engine.engine_helpers import run, tokens_of

EOS = 2
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def test_eos_min_tokens_stop_ids_ignore_eos_max_tokens(engine: Engine) -> None:
    force_eos = {EOS: 50.0}
    cases = {
        "eos": SamplingParams(logit_bias=force_eos),
        "min_tokens": SamplingParams(logit_bias=force_eos, min_tokens=4),
        "stop_id": SamplingParams(logit_bias={77: 50.0}, stop_token_ids=[77]),
        "ignore_eos": SamplingParams(logit_bias=force_eos, ignore_eos=True, max_tokens=5),
        "max_tokens": SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
    }
    for request_id, params in cases.items():
        engine.add_request(request_id, [5, 6, 7], params)
    results = run(engine)
    finals = {rid: outs[-1] for (rid, _), outs in results.items()}
    assert tokens_of(results["eos", 0]) == [EOS] and finals["eos"].finish_reason == "stop"
    min_tokens = tokens_of(results["min_tokens", 0])
    assert len(min_tokens) == 5 and EOS not in min_tokens[:4] and min_tokens[4] == EOS  # 4 before EOS
    assert tokens_of(results["stop_id", 0]) == [77] and finals["stop_id"].finish_reason == "stop"
    assert tokens_of(results["ignore_eos", 0]) == [EOS] * 5 and finals["ignore_eos"].finish_reason == "length"
    assert len(tokens_of(results["max_tokens", 0])) == 7 and finals["max_tokens"].finish_reason == "length"
    assert all(out.finish_reason is None for outs in results.values() for out in outs[:-1])


def test_abort_is_idempotent_and_frees_blocks(engine: Engine) -> None:
    idle = engine.stats().num_free_blocks
    engine.add_request("keep", [5, 6, 7], GREEDY)
    engine.add_request("drop", [8, 9, 10, 11, 12], GREEDY)
    engine.step()
    engine.abort(["drop", "unknown"])
    engine.abort(["drop"])
    outputs = engine.step()
    dropped = [out for out in outputs if out.request_id == "drop"]
    assert len(dropped) == 1 and dropped[0].finish_reason == "abort" and dropped[0].new_token_ids == []
    results = run(engine)
    assert ("drop", 0) not in results and results["keep", 0][-1].finish_reason == "length"
    assert engine.stats().num_free_blocks == idle


def test_abort_alone_is_still_reported(engine: Engine) -> None:
    engine.add_request("only", [5, 6, 7], GREEDY)
    engine.abort(["only"])
    assert engine.has_unfinished()  # the abort output is still to be sent
    assert [out.finish_reason for out in engine.step()] == ["abort"]
    assert not engine.has_unfinished()


def test_abort_choices_ends_only_those(engine: Engine) -> None:
    engine.add_request("n3", [5, 6, 7], SamplingParams(n=3, temperature=1.0, max_tokens=6, ignore_eos=True))
    engine.step()
    engine.abort_choices("n3", [1, 7])  # 7 does not exist: ignored
    engine.abort_choices("n3", [1])
    results = run(engine)
    assert [o.finish_reason for o in results["n3", 1]] == ["abort"]
    assert all(results["n3", i][-1].finish_reason == "length" for i in (0, 2))
    assert len(tokens_of(results["n3", 0])) == 5  # the first token came before run()
    engine.abort_choices("n3", [0])  # finished: nothing happens
    assert not engine.has_unfinished() and engine.stats().num_free_blocks == engine.stats().num_total_blocks


def test_continuation_emits_only_new_tokens(engine: Engine) -> None:
    full = engine.generate([[5, 6, 7]], GREEDY)[0].token_ids
    engine.add_request("cont", [5, 6, 7], GREEDY, output_token_ids=full[:4])
    outputs = run(engine)["cont", 0]
    assert tokens_of(outputs) == full[4:]
    assert outputs[-1].num_output_tokens == 10 and outputs[-1].finish_reason == "length"


def test_completed_continuation_finishes_without_tokens(engine: Engine) -> None:
    engine.add_request("done", [5, 6, 7], SamplingParams(max_tokens=2), output_token_ids=[9, 9])
    outputs = run(engine)["done", 0]
    assert [(o.new_token_ids, o.finish_reason) for o in outputs] == [([], "length")]


def test_n_choices_share_prompt_blocks(engine: Engine) -> None:
    prompt = list(range(10, 30))  # 5 full blocks of 4
    engine.add_request("n3", prompt, SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=6, ignore_eos=True))
    engine.step()
    choices = engine.scheduler.running
    tables = [engine.kv_cache.block_ids(r) for r in choices]
    assert len(choices) == 3 and tables[0][:4] == tables[1][:4] == tables[2][:4]
    assert engine.stats().num_prefix_cache_hit_tokens == 2 * 16  # the last prompt block is recomputed
    results = run(engine)
    texts = [tokens_of(results["n3", i]) for i in range(3)]
    assert all(len(t) == 5 for t in texts)  # 1 token came in the first step
    assert len({tuple(t) for t in texts}) > 1  # distinct seeds per choice


def test_same_seed_same_tokens_with_different_neighbours(engine: Engine) -> None:
    params = SamplingParams(temperature=1.0, seed=42, max_tokens=12, ignore_eos=True)
    prompt = [5, 6, 7, 8, 9]
    alone = engine.generate([prompt], params)[0].token_ids
    rng = random.Random(0)
    others = [[rng.randrange(3, 256) for _ in range(rng.randint(2, 30))] for _ in range(6)]
    mixed = engine.generate(
        [*others[:3], prompt, *others[3:]],
        [SamplingParams(temperature=1.0, max_tokens=9)] * 3
        + [params]
        + [SamplingParams(temperature=0.5, max_tokens=15)] * 3,
    )
    assert mixed[3].token_ids == alone
    other_seed = engine.generate([prompt], SamplingParams(temperature=1.0, seed=43, max_tokens=12, ignore_eos=True))
    assert other_seed[0].token_ids != alone


def test_presence_penalty_avoids_repeats(engine: Engine) -> None:
    plain = engine.generate([[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    penalized = engine.generate(
        [[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, presence_penalty=2.0)
    )
    assert len(set(penalized[0].token_ids)) > len(set(plain[0].token_ids))


def test_add_request_rejects_bad_input(engine: Engine) -> None:
    engine.add_request("dup", [5], GREEDY)
    bad = [
        ("dup", [5], GREEDY, "request_id"),
        ("empty", [], GREEDY, "prompt"),
        ("vocab", [5, 256], GREEDY, "prompt"),
        ("long", [5] * engine.max_model_len, GREEDY, "prompt"),
        ("room", [5] * 10, SamplingParams(max_tokens=engine.max_model_len), "max_tokens"),
        ("temp", [5], SamplingParams(temperature=-1.0), "temperature"),
        ("bias", [5], SamplingParams(logit_bias={999: 1.0}), "logit_bias"),
    ]
    for request_id, prompt, params, name in bad:
        with pytest.raises(ValueError, match=name):
            engine.add_request(request_id, prompt, params)
    assert engine.stats().num_waiting == 1


def test_has_room_tracks_waiting_queue(tiny_model: CausalLM, tiny_model_dir) -> None:
    engine = Engine(
        Config.of(model=str(tiny_model_dir), num_kv_blocks=64, block_size=4, max_num_waiting=2), model=tiny_model
    )
    assert engine.has_room()
    engine.add_request("a", [5], GREEDY)
    engine.add_request("b", [5], GREEDY)
    assert not engine.has_room() and engine.stats().num_waiting == 2
    engine.step()
    assert engine.has_room()


def test_a_full_engine_takes_only_a_few_more(tiny_model: CausalLM, tiny_model_dir) -> None:
    engine = Engine(
        Config.of(model=str(tiny_model_dir), num_kv_blocks=256, block_size=4, max_num_seqs=4, max_num_waiting=64),
        model=tiny_model,
    )
    assert engine.num_wanted() == 4 + 8  # every slot, plus the few that wait for one
    for i in range(4):
        engine.add_request(f"r{i}", [5], GREEDY)
    engine.step()  # all four run
    assert engine.stats().num_running == 4 and engine.num_wanted() == 8
    for i in range(8):
        engine.add_request(f"w{i}", [5], GREEDY)
    assert engine.num_wanted() == 0 and not engine.has_room()
