"""Every --tool-call-parser family on recorded outputs in its model's format: parsed whole, and streamed in many
random chunkings (seeded), the stream must give what the whole parse gives, in OpenAI's delta shape, with no
markup in the content. Broken markup comes back as content; parallel_tool_calls false keeps one call."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

import pytest

from pagedserve.services.gateway.detokenizer import TextOptions
from pagedserve.services.gateway.tool_calls import ChoiceToolCalls, finish_reason, text_options
from pagedserve.services.gateway.tool_parsers import PARSER_NAMES, keeps_special_tokens
from pagedserve.services.gateway.tool_parsers.arguments import typed_value
from pagedserve.services.gateway.tool_parsers.bodies import JsonCalls
from pagedserve.services.gateway.tool_parsers.calls import CallSink
from pagedserve.services.gateway.tool_parsers.families import FORMATS
from pagedserve.services.gateway.tool_parsers.harmony import HarmonyParser
from pagedserve.services.gateway.tool_parsers.markers import MarkerSplitter, partial_suffix
from pagedserve.services.gateway.tool_parsers.pythonic import parse_call
from pagedserve.services.gateway.tool_parsers.tagged import TaggedParser
from pagedserve.shared.config import TOOL_CALL_PARSERS

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "note": {"type": "string"}, "days": {"type": "integer"}},
            },
        },
    },
    {"type": "function", "function": {"name": "get_time", "parameters": {"properties": {"zone": {"type": "string"}}}}},
]
NOTE = 'a } and a "quote" {x} ✓'  # braces, quotes and unicode inside an argument
WEATHER = {"city": "São Paulo", "note": NOTE}
WEATHER_JSON = json.dumps(WEATHER, ensure_ascii=False)
WEATHER_PY = f"get_weather(city=\"São Paulo\", note='{NOTE}')"
TIME = {"zone": "UTC"}
BOTH = [("get_weather", WEATHER), ("get_time", TIME)]
INTRO = "Let me look that up ✓ {not a call}."
DS_CALL = "<｜tool▁call▁begin｜>"
DS_END = "<｜tool▁call▁end｜>"
KIMI_ARG = "<|tool_call_argument_begin|>"
QWEN_WEATHER = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nSão Paulo\n</parameter>\n"
    f"<parameter=note>\n{NOTE}\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
)
GLM_WEATHER = (
    "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>São Paulo</arg_value>\n"
    f"<arg_key>note</arg_key>\n<arg_value>{NOTE}</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n"
    "</tool_call>"
)
WEATHER_3_DAYS = {**WEATHER, "days": 3}


@dataclass
class Case:
    parser: str
    text: str  # as the model writes it (special tokens kept)
    content: str | None
    calls: list[tuple[str, dict[str, Any]]]


CASES = [
    Case(
        "hermes",
        f"{INTRO}\n<tool_call>\n"
        + json.dumps({"name": "get_weather", "arguments": WEATHER}, ensure_ascii=False)
        + '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>',
        INTRO,
        BOTH,
    ),
    Case(
        "llama3_json",
        f' {{"name": "get_weather", "parameters": {WEATHER_JSON}}}; '
        '{"name": "get_time", "parameters": {"zone": "UTC"}}',
        None,
        BOTH,
    ),
    Case(
        "llama3_json", f'{INTRO}<|python_tag|>{{"name": "get_time", "parameters": {{"zone": "UTC"}}}}', INTRO, BOTH[1:]
    ),
    Case("pythonic", f'[{WEATHER_PY}, get_time(zone="UTC")]', None, BOTH),
    Case("llama4_pythonic", f'{INTRO}<|python_start|>[{WEATHER_PY}, get_time(zone="UTC")]<|python_end|>', INTRO, BOTH),
    Case("llama4_pythonic", f'[{WEATHER_PY}, get_time(zone="UTC")]', None, BOTH),
    Case(
        "mistral",
        f'{INTRO}[TOOL_CALLS]get_weather[ARGS]{WEATHER_JSON}[TOOL_CALLS]get_time[ARGS]{{"zone": "UTC"}}',
        INTRO,
        BOTH,
    ),
    Case("mistral", f'[TOOL_CALLS]get_weather{WEATHER_JSON}[TOOL_CALLS]get_time{{"zone": "UTC"}}', None, BOTH),
    Case(
        "mistral",
        f'[TOOL_CALLS] [{{"name": "get_weather", "arguments": {WEATHER_JSON}}}, '
        '{"name": "get_time", "arguments": {"zone": "UTC"}}]',
        None,
        BOTH,
    ),
    Case(
        "qwen3_coder",
        f"{INTRO}\n{QWEN_WEATHER}\n<tool_call>\n<function=get_time>\n<parameter=zone>\nUTC\n</parameter>\n</function>\n"
        "</tool_call>",
        INTRO,
        [("get_weather", WEATHER_3_DAYS), ("get_time", TIME)],
    ),
    Case(
        "deepseek_v3",
        f"{INTRO}<｜tool▁calls▁begin｜>{DS_CALL}function<｜tool▁sep｜>get_weather\n```json\n{WEATHER_JSON}\n```{DS_END}\n"
        f'{DS_CALL}function<｜tool▁sep｜>get_time\n```json\n{{"zone": "UTC"}}\n```{DS_END}<｜tool▁calls▁end｜>',
        INTRO,
        BOTH,
    ),
    Case(
        "deepseek_v31",
        f"{INTRO}<｜tool▁calls▁begin｜>{DS_CALL}get_weather<｜tool▁sep｜>{WEATHER_JSON}{DS_END}"
        f'{DS_CALL}get_time<｜tool▁sep｜>{{"zone": "UTC"}}{DS_END}<｜tool▁calls▁end｜>',
        INTRO,
        BOTH,
    ),
    Case(
        "granite",
        f'<|tool_call|>[{{"name": "get_weather", "arguments": {WEATHER_JSON}}}, '
        '{"name": "get_time", "arguments": {"zone": "UTC"}}]',
        None,
        BOTH,
    ),
    Case("granite", f'{INTRO}<tool_call>[{{"name": "get_time", "arguments": {{"zone": "UTC"}}}}]', INTRO, BOTH[1:]),
    Case(
        "phi4_mini_json",
        f'{INTRO}functools[{{"name": "get_weather", "arguments": {WEATHER_JSON}}}, '
        '{"name": "get_time", "arguments": {"zone": "UTC"}}]',
        INTRO,
        BOTH,
    ),
    Case(
        "glm45",
        f"{INTRO}\n{GLM_WEATHER}\n<tool_call>get_time\n<arg_key>zone</arg_key>\n<arg_value>UTC</arg_value>\n</tool_call>",
        INTRO,
        [("get_weather", WEATHER_3_DAYS), ("get_time", TIME)],
    ),
    Case(
        "kimi_k2",
        f"{INTRO}<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0{KIMI_ARG}{WEATHER_JSON}"
        f'<|tool_call_end|><|tool_call_begin|>functions.get_time:1{KIMI_ARG}{{"zone": "UTC"}}<|tool_call_end|>'
        "<|tool_calls_section_end|>",
        INTRO,
        BOTH,
    ),
    Case(  # gpt-oss: reasoning, a preamble, then one call, cut at its <|call|> stop token
        "openai",
        "<|channel|>analysis<|message|>The user wants {weather}.<|end|>"
        f"<|start|>assistant<|channel|>commentary<|message|>{INTRO}<|end|>"
        f"<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{WEATHER_JSON}",
        INTRO,
        BOTH[:1],
    ),
    Case(
        "openai",
        "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant to=functions.get_time<|channel|>commentary json"
        '<|message|>{"zone": "UTC"}<|call|>',
        None,
        BOTH[1:],
    ),
]
MARKUP = ("<|", "<｜", "[TOOL_CALLS]", "[ARGS]", "<tool_call>", "<function=", "<arg_", "functools[", "get_time(")


def chunks(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), k=rng.randint(1, min(len(text) - 1, 40))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def stream(state: ChoiceToolCalls, pieces: list[str]) -> tuple[str, dict[int, dict[str, str]]]:
    """(content, calls by index) as a client assembles them, checking OpenAI's delta shape on the way."""
    content, calls = "", dict[int, dict[str, str]]()
    deltas: list[dict[str, Any]] = []
    for piece in pieces:
        text, more = state.feed(piece)
        content, deltas = content + text, deltas + more
    text, more = state.finish()
    for delta in deltas + more:
        call = calls.setdefault(delta["index"], {"id": "", "name": "", "arguments": ""})
        if "id" in delta:
            assert not call["id"], "id, type and name come once, in the call's first delta"
            assert delta["type"] == "function" and delta["function"] == {
                "name": delta["function"]["name"],
                "arguments": "",
            }
            call["id"], call["name"] = delta["id"], delta["function"]["name"]
        else:
            assert call["id"], "a call's header comes before its arguments"
            assert set(delta) == {"index", "function"} and set(delta["function"]) == {"arguments"}
            call["arguments"] += delta["function"]["arguments"]
    assert sorted(calls) == list(range(len(calls)))
    return content + text, calls


def whole(case: Case, **kw: Any) -> tuple[str | None, list[dict[str, Any]]]:
    state = ChoiceToolCalls(case.parser, tools=TOOLS, **kw)
    state.feed(case.text)
    return state.message()


@pytest.mark.parametrize("case", CASES, ids=[f"{c.parser}-{i}" for i, c in enumerate(CASES)])
def test_whole_and_streamed_parses_agree(case: Case) -> None:
    content, calls = whole(case)
    assert content == case.content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == case.calls
    assert all(c["type"] == "function" and c["id"] for c in calls)
    rng = random.Random(f"{case.parser}:{case.text}")
    for pieces in [list(case.text), [case.text]] + [chunks(case.text, rng) for _ in range(25)]:
        state = ChoiceToolCalls(case.parser, tools=TOOLS)
        streamed, streamed_calls = stream(state, pieces)
        assert (streamed.strip() or None) == content, pieces
        assert not any(m in streamed for m in MARKUP), streamed
        assert [(c["name"], c["arguments"]) for c in streamed_calls.values()] == [
            (c["function"]["name"], c["function"]["arguments"]) for c in calls
        ], pieces
        assert finish_reason(state, "stop") == "tool_calls" and finish_reason(state, "length") == "length"


def test_kimi_and_mistral_ids_follow_their_templates() -> None:
    kimi = next(c for c in CASES if c.parser == "kimi_k2")
    assert [c["id"] for c in whole(kimi)[1]] == ["functions.get_weather:0", "functions.get_time:1"]
    mistral = next(c for c in CASES if c.parser == "mistral")
    assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in whole(mistral)[1])


BROKEN = [
    Case("hermes", '<tool_call>{"name": "get_time", "arguments": {"zone": ', None, []),  # cut off
    Case("hermes", '<tool_call>{"name": "get_time", "arguments": {"zone": UTC}}</tool_call>', None, []),
    Case("llama3_json", '{"zone": "UTC"}', None, []),  # JSON, but no call
    Case("pythonic", "[1, 2, 3] are the first numbers.", None, []),
    Case("pythonic", '[get_time("UTC")]', None, []),  # positional arguments
    Case("llama4_pythonic", '<|python_start|>[get_time(zone="UTC"), get_weather(city=', None, []),
    Case("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Par', None, []),
    Case("qwen3_coder", "<tool_call>\n<function=get_time>\n<parameter=zone>\nUTC\n</parameter>\n", None, []),
    Case("deepseek_v3", f"<｜tool▁calls▁begin｜>{DS_CALL}function<｜tool▁sep｜>get_time\n```json\n{{", None, []),
    Case("deepseek_v31", f"<｜tool▁calls▁begin｜>{DS_CALL}get_time<｜tool▁sep｜>zone=UTC{DS_END}", None, []),
    Case("granite", '<|tool_call|>[{"name": "get_time", "arguments": {"zone": "UTC"}', None, []),
    Case("phi4_mini_json", 'functools[{"name": "get_time", "arguments": [1, 2]}]', None, []),  # not an object
    Case("glm45", "<tool_call>get_time\n<arg_key>zone</arg_key>\n<arg_value>UTC", None, []),
    Case("kimi_k2", f"<|tool_calls_section_begin|><|tool_call_begin|>functions.get_time:0{KIMI_ARG}{{", None, []),
    Case("openai", "<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{zone: UTC}", None, []),
]


@pytest.mark.parametrize("case", BROKEN, ids=[f"{c.parser}-{i}" for i, c in enumerate(BROKEN)])
def test_broken_markup_is_returned_as_content(case: Case) -> None:
    assert whole(case) == (case.text, [])


@pytest.mark.parametrize("parser", sorted(set(PARSER_NAMES)))
def test_plain_answers_pass_through(parser: str) -> None:
    text = "No tools needed: 1 < 2, a {brace} and <tool is not a tag ✓"
    for step in (1, 3, 1000):
        state = ChoiceToolCalls(parser, tools=TOOLS)
        assert stream(state, [text[i : i + step] for i in range(0, len(text), step)]) == (text, {})
        assert state.message() == (text, [])
        assert finish_reason(state, "stop") == "stop"


def test_answers_that_only_looked_like_calls_stream_as_content() -> None:
    for parser, text in [("llama3_json", '{"answer": 42}'), ("pythonic", "[1, 2] and [3]")]:
        assert stream(ChoiceToolCalls(parser), list(text)) == (text, {})


@pytest.mark.parametrize("case", [CASES[0], CASES[3], CASES[6], CASES[11], CASES[16]], ids=lambda c: c.parser)
def test_parallel_tool_calls_false_keeps_the_first_call(case: Case) -> None:
    content, calls = whole(case, max_calls=1)
    assert content == case.content and [c["function"]["name"] for c in calls] == ["get_weather"]
    _, streamed = stream(ChoiceToolCalls(case.parser, tools=TOOLS, max_calls=1), chunks(case.text, random.Random(1)))
    assert list(streamed) == [0] and json.loads(streamed[0]["arguments"]) == case.calls[0][1]


def test_the_registry_is_the_config_choices() -> None:
    assert set(PARSER_NAMES) == set(TOOL_CALL_PARSERS) and len(TOOL_CALL_PARSERS) >= 13
    assert FORMATS["llama3"] is FORMATS["llama3_json"]
    assert keeps_special_tokens("mistral") and keeps_special_tokens("openai") and not keeps_special_tokens("hermes")
    options = TextOptions()
    assert text_options("auto", "kimi_k2", options) == TextOptions(skip_special_tokens=False)
    assert text_options("required", "kimi_k2", options) is options  # the grammar's JSON needs no markers
    assert text_options("auto", "hermes", options) is options


def test_an_unknown_parser_stops_start_up_listing_the_choices(capsys: pytest.CaptureFixture[str]) -> None:
    from pagedserve.services.cli import build_parser
    from pagedserve.shared.config_cli import build_config

    with pytest.raises(SystemExit):  # a flag: argparse's choices
        build_parser().parse_args(["gateway", "--tool-call-parser", "qwen3"])
    assert "invalid choice: 'qwen3'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:  # the environment (or a --config file): the config's own check
        build_config(build_parser().parse_args(["gateway"]), environ={"PAGEDSERVE_TOOL_CALL_PARSER": "qwen3"})
    assert "tool_call_parser: unknown 'qwen3'" in str(exited.value)
    assert all(name in str(exited.value) for name in TOOL_CALL_PARSERS)


def test_markers_split_the_same_however_text_is_cut() -> None:
    assert partial_suffix("abc<tool_", ("<tool_call>",)) == 6 and partial_suffix("abc", ("<tool_call>",)) == 0
    markers = ("abcd", "bc")  # a longer marker may still begin before a shorter complete one
    for pieces in (["abc", "d"], ["abcd"], ["a", "b", "c", "d"]):
        splitter = MarkerSplitter(lambda: markers)
        out = [event for piece in pieces for event in splitter.feed(piece)]
        assert out + list(splitter.feed("", is_last=True)) == [("marker", "abcd")], pieces


def test_argument_pieces() -> None:
    assert typed_value("3", "integer") == 3 and typed_value("3", "string") == "3"
    assert typed_value("True", "boolean") is True and typed_value("[1, 'a']", "array") == [1, "a"]
    assert typed_value("1e999", "number") == "1e999" and typed_value("Paris", None) == "Paris"
    assert parse_call('f(a=1, b={"x": [true, null]})') == ("f", {"a": 1, "b": {"x": [True, None]}})
    assert parse_call("f(1)") is None and parse_call("__import__('os')") is None and parse_call("f(a=g())") is None
    sink = CallSink()
    body = JsonCalls(sink)
    body.feed('{"arguments": {"a": 1}, "name": "f"}')  # arguments before the name
    assert [(c.name, c.arguments, c.is_closed) for c in sink.calls] == [("f", '{"a": 1}', True)]
    assert isinstance(TaggedParser(FORMATS["hermes"]).sink, CallSink) and HarmonyParser().content == ""


def test_auto_calls_are_held_to_the_tools_by_a_structural_tag() -> None:
    from xgrammar.testing import _is_grammar_accept_string as accepts

    from pagedserve.services.gateway import schemas, structured
    from pagedserve.services.gateway.errors import APIError
    from pagedserve.services.gateway.tool_parsers.structural import call_grammar_ebnf
    from pagedserve.services.gateway.validation import validate

    def chat(**fields: Any) -> schemas.ChatCompletionRequest:
        body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": TOOLS, **fields}
        return validate(schemas.ChatCompletionRequest, body)

    spec = structured.auto_tool_grammar(chat(), "hermes")
    assert spec is not None and spec.kind == "grammar"
    call = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    assert accepts(spec.value, "Free text, {braces} and all ✓") and accepts(spec.value, f"Sure. {call} {call}")
    assert not accepts(spec.value, '<tool_call>\n{"name": "get_date", "arguments": {}}\n</tool_call>')  # no such tool
    assert not accepts(spec.value, '<tool_call>\n{"name": "get_weather", "arguments": {"days": "3"}}\n</tool_call>')
    one = structured.auto_tool_grammar(chat(parallel_tool_calls=False), "hermes")
    assert one is not None and accepts(one.value, call) and not accepts(one.value, call + call)
    qwen = call_grammar_ebnf("qwen3_coder", TOOLS, None)
    assert qwen is not None and accepts(qwen, QWEN_WEATHER)
    assert structured.auto_tool_grammar(chat(), "kimi_k2") is None  # special-token markers: parsed, not held
    assert structured.auto_tool_grammar(chat(response_format={"type": "json_object"}), "hermes") is None
    assert structured.auto_tool_grammar(chat(tool_choice="required"), "hermes") is None  # its own grammar
    bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": 3}}}]
    with pytest.raises(APIError) as raised:
        structured.auto_tool_grammar(chat(tools=bad), "hermes")
    assert raised.value.status == 400 and raised.value.param == "tools[0].function.parameters"


@pytest.mark.parametrize(("parser", "grammar", "skips_special"), [("hermes", True, True), ("kimi_k2", False, False)])
def test_the_gateway_sends_the_auto_grammar_and_keeps_marker_tokens(
    monkeypatch: pytest.MonkeyPatch, parser: str, grammar: bool, skips_special: bool
) -> None:
    """What an auto request leaves the gateway with: the family's structural tag on the wire, and the text
    options its markers need (the submit is stubbed: nothing runs)."""
    from starlette.testclient import TestClient

    from pagedserve.services.gateway.app import build_app
    from pagedserve.services.gateway.errors import APIError
    from pagedserve.services.gateway.frontend import Frontend
    from pagedserve.shared.config import Config
    from pagedserve.shared.redis_server import free_port

    seen: list[tuple[Any, TextOptions]] = []

    async def submit(self: Frontend, wire: Any, stop: list[str], n: int, text: TextOptions) -> Any:
        seen.append((wire, text))
        raise APIError(503, "stubbed")

    monkeypatch.setattr(Frontend, "submit", submit)
    config = Config.of(redis_url=f"redis://127.0.0.1:{free_port()}/0", tool_call_parser=parser)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS}
    with TestClient(build_app(config)) as client:
        assert client.post("/v1/chat/completions", json=body).status_code == 503
        assert client.post("/v1/chat/completions", json={**body, "tool_choice": "none"}).status_code == 503
    (wire, text), (plain_wire, plain_text) = seen
    assert ("structured_output" in wire.sampling) == grammar and text.skip_special_tokens == skips_special
    assert grammar is False or wire.sampling["structured_output"]["kind"] == "grammar"
    assert "structured_output" not in plain_wire.sampling and plain_text.skip_special_tokens  # tool_choice none
