"""A /v1/responses stream, read by the openai SDK's own stream state: reasoning, text and a tool call, in random
chunkings, give the response a non-streamed run of the same text gives."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator
from typing import Any

from openai import omit
from openai.lib.streaming.responses import ResponseStreamState
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

from pagedserve.services.gateway import responses_api
from pagedserve.services.gateway.frontend import ChoiceUpdate
from pagedserve.services.gateway.reasoning import PARSERS
from pagedserve.services.gateway.responses_api import ResponsesRequest
from pagedserve.services.gateway.tool_calls import tool_call_states

THOUGHT = "The user wants <weather>; call the tool."
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
OUTPUT = f"<think>{THOUGHT}</think>Checking.<tool_call>{CALL}</tool_call>"
EVENT: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)


class _Characters:
    """A tokenizer whose tokens are characters."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(map(chr, token_ids))


class _Choice:
    def __init__(self) -> None:
        self.tokenizer, self.token_ids = _Characters(), [ord(c) for c in OUTPUT]


class _Generation:
    """What the Responses API reads of a Generation, with the text coming in the given pieces."""

    request_id, model, served_model, choices = "resp-abc", "m", "m", [_Choice()]

    def __init__(self, pieces: list[str]) -> None:
        self.pieces, self.finish_reasons = pieces, dict[int, str]()

    async def updates(self) -> AsyncIterator[ChoiceUpdate]:
        for i, piece in enumerate(self.pieces):
            finish = "stop" if i == len(self.pieces) - 1 else None
            if finish:
                self.finish_reasons[0] = finish
            yield ChoiceUpdate(0, piece, [], None, finish)

    def usage(self) -> dict[str, Any]:
        return {"prompt_tokens": 9, "completion_tokens": len(OUTPUT), "total_tokens": 9 + len(OUTPUT)} | {
            "prompt_tokens_details": {"cached_tokens": 0}
        }


def _run(pieces: list[str]) -> Any:
    req = ResponsesRequest.model_validate({"model": "m", "input": "Weather in Paris?", "store": False})
    gen: Any = _Generation(pieces)
    return responses_api._Run(req, gen, PARSERS["qwen3"], tool_call_states("auto", None, "hermes", 1)[0])  # type: ignore[index]


def _read_with_the_sdk(run: Any) -> tuple[list[str], Any]:
    async def sse() -> bytes:
        return b"".join([chunk async for chunk in responses_api._events(run, store=None, saved=None)])

    state: ResponseStreamState[Any] = ResponseStreamState(input_tools=omit, text_format=omit)
    kinds: list[str] = []
    final = None
    for block in asyncio.run(sse()).split(b"\n\n"):
        data = next((line[6:] for line in block.split(b"\n") if line.startswith(b"data: ")), None)
        if data is not None:
            for event in state.handle_event(EVENT.validate_python(json.loads(data))):
                kinds.append(event.type)
                final = getattr(event, "response", final)
    return kinds, final


def _without_ids(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in items]


def test_random_chunkings_stream_the_response_made_whole() -> None:
    whole = _run([OUTPUT])
    whole.add_whole(OUTPUT)
    expected = whole.response(done=True)
    reasoning, message, call = expected["output"]
    assert reasoning["content"] == [{"type": "reasoning_text", "text": THOUGHT}]
    assert message["content"][0]["text"] == "Checking."
    assert (call["name"], json.loads(call["arguments"])) == ("get_weather", {"city": "Paris"})
    assert expected["usage"]["output_tokens_details"]["reasoning_tokens"] == len(f"<think>{THOUGHT}</think>")

    rng = random.Random(7)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(OUTPUT)), rng.randint(1, 30)))
        pieces = [OUTPUT[a:b] for a, b in zip([0, *cuts], [*cuts, len(OUTPUT)])]
        kinds, final = _read_with_the_sdk(_run(pieces))
        assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
        assert "response.reasoning_text.delta" in kinds and "response.function_call_arguments.delta" in kinds
        streamed = final.model_dump(exclude_none=True)
        assert _without_ids(streamed["output"]) == _without_ids(expected["output"]), pieces
        assert final.output_text == "Checking." and streamed["usage"] == expected["usage"]
