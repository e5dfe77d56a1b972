"""One streaming request to an OpenAI-compatible server, timed chunk by chunk (aiohttp: one event
loop drives thousands of streams).

Times are perf_counter readings of this process; `start_wall` places a request on the wall clock so
that results of several client processes merge onto one timeline.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp

from bench.serve.datasets import BenchRequest


@dataclass(slots=True)
class RequestResult:
    start_wall: float  # time.time() when the request was sent
    prompt_len: int  # the dataset's; usage's prompt_tokens when the server sent usage
    expected_output_len: int
    output_tokens: int = 0  # usage's completion_tokens, else the number of content chunks
    ttft: float = 0.0  # seconds from sending to the first content chunk
    itl: list[float] = field(default_factory=list)  # gaps between content chunks
    latency: float = 0.0  # seconds from sending to the end of the stream
    error: str = ""
    cached_tokens: int = 0  # usage's prompt_tokens_details.cached_tokens: the server's prefix-cache hit
    output_ids: list[int] = field(default_factory=list)  # streamed token_ids, where asked (return_token_ids)

    @property
    def ok(self) -> bool:
        return not self.error

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if k != "output_ids"}


@dataclass(slots=True)
class ClientConfig:
    base_url: str
    model: str
    endpoint: str = "completions"  # or "chat"
    temperature: float = 0.0
    ignore_eos: bool = True
    api_key: str | None = None
    extra_body: dict[str, Any] = field(default_factory=dict)
    timeout_s: float = 3600.0

    @property
    def url(self) -> str:
        path = "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"
        return self.base_url.rstrip("/") + path

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def request_body(config: ClientConfig, request: BenchRequest) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": config.model,
        "max_tokens": request.output_len,
        "temperature": config.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    prompt: str | list[int] = request.prompt_text if request.prompt_text is not None else request.prompt_ids
    if config.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt if isinstance(prompt, str) else str(prompt)}]
    else:
        body["prompt"] = prompt
    if config.ignore_eos:
        body["ignore_eos"] = True  # vLLM's and pagedserve's extra field: exactly max_tokens tokens
    return {**body, **config.extra_body}


def _content(chunk: dict[str, Any], chat: bool) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    if chat:
        return str((choices[0].get("delta") or {}).get("content") or "")
    return str(choices[0].get("text") or "")


async def send(session: aiohttp.ClientSession, config: ClientConfig, request: BenchRequest) -> RequestResult:
    """Stream one request; failures are recorded in the result, never raised."""
    result = RequestResult(time.time(), request.prompt_len, request.output_len)
    chat = config.endpoint == "chat"
    start = last = time.perf_counter()
    num_chunks, done = 0, False
    usage: dict[str, Any] | None = None
    try:
        async with session.post(config.url, json=request_body(config, request), headers=config.headers) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.text())[:300]}"
                return result
            async for raw in response.content:  # one SSE line at a time
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = f"in-stream error: {json.dumps(chunk['error'])[:300]}"
                    break
                now = time.perf_counter()
                new_ids = [i for choice in chunk.get("choices") or [] for i in choice.get("token_ids") or ()]
                result.output_ids.extend(new_ids)
                # a token that decodes to no text (random weights sample special tokens) is still a token
                if _content(chunk, chat) or new_ids:
                    if num_chunks == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    num_chunks += 1
                    last = now
                if chunk.get("usage"):
                    usage = chunk["usage"]
    except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:300]
    result.latency = time.perf_counter() - start
    if usage is not None:
        result.output_tokens = int(usage.get("completion_tokens") or 0)
        result.prompt_len = int(usage.get("prompt_tokens") or result.prompt_len)
        result.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    else:
        result.output_tokens = num_chunks
    if not result.error and not done:
        result.error = "the stream ended without [DONE]"
    if not result.error and num_chunks == 0:
        result.error = "the stream carried no content"
    return result


def new_session(config: ClientConfig, max_connections: int) -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(limit=max_connections, limit_per_host=max_connections, force_close=False)
    timeout = aiohttp.ClientTimeout(total=config.timeout_s, sock_connect=30)
    # read_bufsize: SSE lines of long chunks must fit the reader's line buffer
    return aiohttp.ClientSession(connector=connector, timeout=timeout, read_bufsize=1 << 20)
