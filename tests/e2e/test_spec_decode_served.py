"""Speculative decoding served: an engine started with vLLM's --speculative-config answers a copy-heavy chat
exactly as the plain shared server does (greedy), streams several tokens per step, and counts its drafts."""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import openai

from pagedserve.shared.redis_server import free_port
from tests.conftest import RunningServices, running_stack

PASSAGE = (
    "The keeper climbed the stairs at dusk with a tin of oil, polished the lens, trimmed the wick and lit "
    "the flame, and the beam swept over the grey water towards the boats."
)
NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'


def _ask(base_url: str, model: str) -> tuple[str, int]:
    """The streamed answer's text and its number of content chunks."""
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0)
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": f"Repeat this passage exactly:\n\n{PASSAGE}"}],
        max_tokens=24,
        temperature=0,
        stream=True,
    )
    parts = [c.choices[0].delta.content for c in stream if c.choices and c.choices[0].delta.content]
    return "".join(parts), len(parts)


def test_served_ngram_speculation_answers_as_plain_decoding(services: RunningServices, tmp_path: Path) -> None:
    plain_text, _ = _ask(services.base_url, services.model)
    metrics_port = free_port()
    env = {
        **os.environ,
        "PAGEDSERVE_REDIS_URL": services.redis_url.rsplit("/", 1)[0] + "/7",  # streams apart from the shared stack
        "PAGEDSERVE_ENGINE_METRICS_PORT": str(metrics_port),
    }
    with running_stack(env, tmp_path, ["--speculative-config", NGRAM]) as (base_url, _):
        text, num_chunks = _ask(base_url, services.model)
        metrics = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
    assert text == plain_text and PASSAGE[:40] in text  # the model does copy: the drafts are right
    assert num_chunks < 20  # accepted drafts arrive together
    accepted = [line for line in metrics.splitlines() if line.startswith("vllm:spec_decode_num_accepted_tokens_total")]
    assert accepted and float(accepted[0].split()[-1]) > 0, json.dumps(accepted)
