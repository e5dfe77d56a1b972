"""Chat messages as the OpenAI API sends them, validated strictly, and turned into chat-template input.

Only text is supported. An assistant message echoed back from one of our own responses (with
`refusal: null`, ...) is accepted, with its `tool_calls`; `tool` messages carry the results.
Images and audio are refused with a clear error rather than dropped.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Strict(BaseModel):
    """Unknown fields are errors (the gateway may drop them first: validation.py); no type coercion
    ("1" is not a number)."""

    model_config = ConfigDict(extra="forbid", strict=True)


class TextPart(Strict):
    type: Literal["text"]
    text: str


class FunctionCall(Strict):
    name: str = Field(min_length=1)
    arguments: str


class ToolCall(Strict):
    id: str
    type: Literal["function"]
    function: FunctionCall

    def as_template_input(self) -> dict[str, Any]:
        # Chat templates (HF's convention) expect the arguments as a mapping, not a JSON string.
        try:
            arguments: Any = json.loads(self.function.arguments)
        except ValueError:
            arguments = self.function.arguments
        return {"id": self.id, "type": "function", "function": {"name": self.function.name, "arguments": arguments}}


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]  # function: legacy tool result
    content: str | list[TextPart] | None = None
    name: str | None = Field(default=None, min_length=1)
    tool_call_id: str | None = None
    # Fields of an assistant message as we return it; accepted only when empty.
    refusal: None = None
    tool_calls: list[ToolCall] | None = None
    function_call: FunctionCall | None = None  # a legacy assistant call (before tool_calls)
    audio: None = None
    annotations: list[Any] | None = Field(default=None, max_length=0)

    @model_validator(mode="after")
    def _content_required(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        if (self.tool_calls or self.function_call) and self.role != "assistant":
            raise ValueError("only assistant messages have tool_calls")
        if self.role == "function" and not self.name:
            raise ValueError("a function message names its function (name)")
        return self

    def as_template_input(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        # Legacy function calling as today's templates know it: a function result is a tool message.
        message: dict[str, Any] = {"role": "tool" if self.role == "function" else self.role, "content": content or ""}
        if self.name:
            message["name"] = self.name
        if self.tool_call_id:
            message["tool_call_id"] = self.tool_call_id
        calls = list(self.tool_calls or [])
        if self.function_call is not None:
            calls.append(ToolCall(id="call_0", type="function", function=self.function_call))
        if calls:
            message["tool_calls"] = [call.as_template_input() for call in calls]
        return message
