"""1,000 requests through a KV cache that holds about 5% of them (tiny random model, so it is fast)."""

from __future__ import annotations

import random

import pytest

from pagedserve.services.engine.engine import Engine
from pagedserve.services.engine.models.base import CausalLM
from pagedserve.services.engine.sampling_params import SamplingParams
from pagedserve.shared.config import Config

NUM_REQUESTS = 1000
BLOCK_SIZE = 4


def workload(rng: random.Random) -> list[tuple[list[int], SamplingParams]]:
    shared_prefix = [rng.randrange(3, 256) for _ in range(8)]  # some requests share it: cache hits
    requests = []
    for _ in range(NUM_REQUESTS):
        prompt = [rng.randrange(3, 256) for _ in range(rng.randint(1, 12))]
        if rng.random() < 0.3:
            prompt = shared_prefix + prompt
        params = SamplingParams(
            temperature=rng.choice([0.0, 0.8, 1.0]), max_tokens=rng.randint(1, 12), ignore_eos=rng.random() < 0.5
        )
        requests.append((prompt, params))
    return requests


@pytest.mark.parametrize("abort_half", [False, True], ids=["all-finish", "half-aborted"])
def test_thousand_requests_in_a_small_cache(tiny_model: CausalLM, tiny_model_dir, abort_half: bool) -> None:
    rng = random.Random(1)
    requests = workload(rng)
    blocks_needed = sum(-(-(len(p) + (s.max_tokens or 0)) // BLOCK_SIZE) for p, s in requests)
    num_blocks = blocks_needed // 20  # ~5% of what all requests would hold at once
    engine = Engine(
        Config.of(model=str(tiny_model_dir), num_kv_blocks=num_blocks, block_size=BLOCK_SIZE), model=tiny_model
    )
    idle = engine.stats().num_free_blocks
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(f"r{i}", prompt, params)

    tokens: dict[str, list[int]] = {}
    finish: dict[str, str] = {}
    aborted: set[str] = set()
    num_steps = 0
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id not in finish, "output after the final one"
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finish_reason is not None:
                finish[out.request_id] = out.finish_reason
        engine.kv_cache.check_invariants()
        num_steps += 1
        if abort_half and len(finish) >= NUM_REQUESTS // 4 and not aborted:
            aborted = {f"r{i}" for i in range(0, NUM_REQUESTS, 2) if f"r{i}" not in finish}
            engine.abort(f"r{i}" for i in range(0, NUM_REQUESTS, 2))  # finished ones are ignored
        assert num_steps < 20 * NUM_REQUESTS, "no progress"

    assert len(finish) == NUM_REQUESTS
    assert engine.stats().num_free_blocks == idle and engine.stats().num_running == 0
    assert engine.stats().num_preemptions > 0 and engine.stats().num_prefix_cache_hit_tokens > 0
    for i, (_, params) in enumerate(requests):
        rid, max_tokens = f"r{i}", params.max_tokens or 0
        produced = tokens.get(rid, [])
        if rid in aborted:
            assert finish[rid] == "abort"
            continue
        assert finish[rid] in ("stop", "length")
        assert 1 <= len(produced) <= max_tokens
        if params.ignore_eos or finish[rid] == "length":
            assert len(produced) == max_tokens
        else:
            assert produced[-1] == 2  # EOS finished it
    if abort_half:
        assert len(aborted) > NUM_REQUESTS // 4
