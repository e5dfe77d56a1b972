"""An engine replica killed (SIGKILL) while it generates n=2 requests: every choice of every request goes
on on the other replica with no token lost or repeated.

Greedy requests must reproduce, choice for choice, the answers of a healthy run. Sampled requests (a seed,
so the two choices differ) cannot be compared with a healthy run (a continuation restarts the choice's
random stream), so they are checked structurally: each choice streams exactly max_tokens tokens (one lost
token makes one fewer, one repeated token one more), its text is exactly its tokens' bytes (less the special
tokens, which ignore_eos lets a sampled choice draw and the text skips), and usage agrees.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import openai
import redis
from transformers import AutoTokenizer

from pagedserve.shared import streams
from pagedserve.shared.protocol import EngineHeartbeat, decode_as
from tests.conftest import E2E_MAX_MODEL_LEN, RunningServices, start_service, stop_all
from tests.e2e.checks import wait_nothing_pending

GREEDY_PROMPTS = [f"Write a long story about a {thing}." for thing in ("lighthouse", "violin", "glacier")]
SAMPLED_PROMPTS = [f"Describe a day in the life of a {who}." for who in ("baker", "pilot", "beekeeper")]
MAX_TOKENS = 40
REPLICA_ID = "eng-doomed-n2"


@dataclass
class Answer:
    texts: list[str] = field(default_factory=lambda: ["", ""])
    token_bytes: list[bytes] = field(default_factory=lambda: [b"", b""])  # of the tokens the text shows
    num_tokens: list[int] = field(default_factory=lambda: [0, 0])
    finish_reasons: list[str | None] = field(default_factory=lambda: [None, None])
    completion_tokens: int = -1


async def ask(
    client: openai.AsyncOpenAI, model: str, prompt: str, temperature: float, salt: str, special: set[str]
) -> Answer:
    answer = Answer()
    stream = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        n=2,
        temperature=temperature,
        seed=7,
        max_tokens=MAX_TOKENS,
        logprobs=True,
        stream=True,
        stream_options={"include_usage": True},
        # each run its own prefix-cache salt: the cache-aware router would otherwise send every prompt to the
        # engine that served them in the reference run, and the extra replica would get none to lose
        extra_body={"ignore_eos": True, "cache_salt": salt},
    )
    async for chunk in stream:
        if chunk.usage is not None:
            answer.completion_tokens = chunk.usage.completion_tokens
        for choice in chunk.choices:
            i = choice.index
            answer.texts[i] += choice.delta.content or ""
            for token in (choice.logprobs.content or []) if choice.logprobs else []:
                if token.token not in special:  # EOS drawn under ignore_eos: counted, never shown
                    answer.token_bytes[i] += bytes(token.bytes or [])
                answer.num_tokens[i] += 1
            answer.finish_reasons[i] = choice.finish_reason or answer.finish_reasons[i]
    return answer


def _heartbeat(r: redis.Redis, model: str) -> EngineHeartbeat | None:
    raw = r.get(streams.engine_key(model, REPLICA_ID))
    return None if raw is None else decode_as(raw, EngineHeartbeat)


def _num_moves(services: RunningServices) -> int:
    return (services.log_dir / "gateway.log").read_text().count(" is gone; ")


def test_every_choice_of_an_n2_request_survives_a_killed_replica(services: RunningServices, smollm2_dir: Path) -> None:
    special = set(AutoTokenizer.from_pretrained(smollm2_dir).all_special_tokens)

    async def run(salt: str) -> tuple[list[Answer], list[Answer]]:
        async with openai.AsyncOpenAI(
            base_url=f"{services.base_url}/v1", api_key="x", max_retries=0, timeout=300
        ) as client:
            greedy = [ask(client, services.model, p, 0.0, salt, special) for p in GREEDY_PROMPTS]
            sampled = [ask(client, services.model, p, 0.9, salt, special) for p in SAMPLED_PROMPTS]
            answers = await asyncio.gather(*greedy, *sampled)
            return list(answers[: len(greedy)]), list(answers[len(greedy) :])

    expected_greedy, _ = asyncio.run(run("reference"))  # one healthy engine
    assert all(a.texts[0] == a.texts[1] for a in expected_greedy)

    r = redis.Redis.from_url(services.redis_url)
    replica = start_service(
        "doomed-engine-n2",
        [
            "engine",
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--cpu-threads",
            "1",
            "--max-model-len",
            str(E2E_MAX_MODEL_LEN),
            "--engine-id",
            REPLICA_ID,
            "--heartbeat-ttl-s",
            "3",
        ],
        {**os.environ, "PAGEDSERVE_REDIS_URL": services.redis_url},
        services.log_dir,
    )
    try:
        deadline = time.monotonic() + 120
        while _heartbeat(r, services.model) is None:
            assert replica.poll() is None and time.monotonic() < deadline, "the extra replica did not start"
            time.sleep(0.2)
        moves_before = _num_moves(services)

        async def kill_when_busy() -> None:
            while True:  # the replica is generating (both choices of its requests): let tokens flow, then kill
                beat = _heartbeat(r, services.model)
                if beat is not None and beat.num_running >= 2:
                    await asyncio.sleep(1.0)
                    replica.send_signal(signal.SIGKILL)
                    return
                await asyncio.sleep(0.05)

        async def scenario() -> tuple[list[Answer], list[Answer]]:
            killer = asyncio.create_task(kill_when_busy())
            answers = await run("fault")
            await asyncio.wait_for(killer, timeout=5)
            return answers

        greedy, sampled = asyncio.run(scenario())
        assert replica.wait(timeout=40) == -signal.SIGKILL
        assert _num_moves(services) > moves_before, "no request was moved: the scenario did not test failover"

        assert [a.texts for a in greedy] == [a.texts for a in expected_greedy]
        for answer in [*greedy, *sampled]:
            assert answer.num_tokens == [MAX_TOKENS, MAX_TOKENS]
            assert answer.finish_reasons == ["length", "length"]
            assert answer.completion_tokens == 2 * MAX_TOKENS
            assert [b.decode() for b in answer.token_bytes] == answer.texts
        assert any(a.texts[0] != a.texts[1] for a in sampled)  # the seed made the choices differ

        wait_nothing_pending(services.redis_url, services.model)  # the dead consumer's entries are claimed
    finally:
        stop_all({"doomed-engine-n2": replica})
        r.close()

    with openai.OpenAI(base_url=f"{services.base_url}/v1", api_key="x", max_retries=0, timeout=120) as client:
        reply = client.chat.completions.create(
            model=services.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4
        )
    assert reply.choices[0].finish_reason in ("length", "stop")
