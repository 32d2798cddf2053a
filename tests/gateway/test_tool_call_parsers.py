"""Each tool-call parser on recorded-style model outputs: the exact content and calls, the same for every
split of the text into deltas (each single cut, one character at a time, random splits)."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conduit_gateway.parsers.chat_output import ChatOutputParser
from conduit_gateway.parsers.tool_calls import tool_call_parser_class, tool_call_parser_names
from conduit_gateway.parsers.tool_calls.forced import ForcedToolCallParser
from tests.gateway.parsed_output import every_split, run_pieces

pytestmark = pytest.mark.unit

WEATHER_SF = '{"location": "San Francisco, CA, USA", "unit": "celsius"}'
WEATHER_DATE = '{"location": "San Francisco, CA, USA", "date": "2024-10-01", "unit": "celsius"}'

# (parser, model output, expected content, expected [(name, arguments)])
CASES = [
    # Qwen2.5 / Hermes: two calls, each in its own tags, one per line.
    (
        "hermes",
        f'<tool_call>\n{{"name": "get_current_temperature", "arguments": {WEATHER_SF}}}\n</tool_call>\n'
        f'<tool_call>\n{{"name": "get_temperature_date", "arguments": {WEATHER_DATE}}}\n</tool_call>',
        "",
        [("get_current_temperature", WEATHER_SF), ("get_temperature_date", WEATHER_DATE)],
    ),
    # Text before the call; escapes and non-ASCII in the arguments stay exactly as written.
    (
        "hermes",
        "I'll look that up for you.\n\n"
        '<tool_call>\n{"name": "search", "arguments": '
        '{"query": "caf\\u00e9 \\"Le Procope\\" Paris — hours"}}\n</tool_call>',
        "I'll look that up for you.",
        [("search", '{"query": "caf\\u00e9 \\"Le Procope\\" Paris — hours"}')],
    ),
    # A plain answer: untouched, trailing newline included.
    ("hermes", "The capital of France is Paris.\n", "The capital of France is Paris.\n", []),
    # Text between and after calls is content; whitespace next to calls is not.
    (
        "hermes",
        '<tool_call>{"name": "a", "arguments": {}}</tool_call>\nThen:\n<tool_call>{"name": "b", "arguments": '
        '{"n": [1, -2.5e3, true, null]}}</tool_call>\nDone.\n',
        "Then:Done.",
        [("a", "{}"), ("b", '{"n": [1, -2.5e3, true, null]}')],
    ),
    # Python-style dict instead of JSON: not a call, the whole output is content.
    (
        "hermes",
        "<tool_call>\n{'name': 'get_weather', 'arguments': {'city': 'Paris'}}\n</tool_call>",
        "<tool_call>\n{'name': 'get_weather', 'arguments': {'city': 'Paris'}}\n</tool_call>",
        [],
    ),
    # JSON without a name is not a call either (the whitespace before the tag comes back too).
    (
        "hermes",
        'Sure. <tool_call>{"arguments": {"x": 1}}</tool_call>',
        'Sure. <tool_call>{"arguments": {"x": 1}}</tool_call>',
        [],
    ),
    # The first call stands; the malformed second one and all after it are content.
    (
        "hermes",
        '<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>\n<tool_call>{"name": get_b}</tool_call>',
        '<tool_call>{"name": get_b}</tool_call>',
        [("a", '{"x": 1}')],
    ),
    # Broken after the name: the call keeps the arguments read so far, the rest is content.
    (
        "hermes",
        '<tool_call>{"name": "f", "arguments": {"city": Paris}}</tool_call>',
        "Paris}}</tool_call>",
        [("f", '{"city": ')],
    ),
    # Cut short by max_tokens inside the arguments: what was written is kept.
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"city": "Par', "", [("f", '{"city": "Par')]),
    # Cut short before the name was complete: content.
    ("hermes", '<tool_call>\n{"name": "get_wea', '<tool_call>\n{"name": "get_wea', []),
    # Arguments given as a JSON string are decoded.
    (
        "hermes",
        '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>',
        "",
        [("f", '{"a": 1}')],
    ),
    # Llama 3.1 with <|python_tag|> (special tokens kept).
    (
        "llama3_json",
        '<|python_tag|>{"name": "get_current_conditions", "parameters": {"location": "San Francisco, CA", '
        '"unit": "Fahrenheit"}}',
        "",
        [("get_current_conditions", '{"location": "San Francisco, CA", "unit": "Fahrenheit"}')],
    ),
    # Llama 3.2 JSON mode: bare objects separated by ";".
    (
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": '
        '{"tz": "Europe/Paris"}}',
        "",
        [("get_weather", '{"city": "Paris"}'), ("get_time", '{"tz": "Europe/Paris"}')],
    ),
    # An answer that is not a call; a JSON answer that is not a call stays content too.
    ("llama3_json", "It is sunny in Paris today.", "It is sunny in Paris today.", []),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),
    # Text after the calls is content.
    (
        "llama3_json",
        '{"name": "f", "parameters": {}}\nI called f.',
        "I called f.",
        [("f", "{}")],
    ),
    # Mistral 7B v0.3: [TOOL_CALLS] then a JSON array.
    (
        "mistral",
        '[TOOL_CALLS] [{"name": "get_current_weather", "arguments": {"location": "Paris, France", '
        '"format": "celsius"}}, {"name": "get_current_weather", "arguments": {"location": "Lyon, France", '
        '"format": "celsius"}}]',
        "",
        [
            ("get_current_weather", '{"location": "Paris, France", "format": "celsius"}'),
            ("get_current_weather", '{"location": "Lyon, France", "format": "celsius"}'),
        ],
    ),
    (
        "mistral",
        'Let me check.[TOOL_CALLS][{"name": "f", "arguments": {"q": "[x]"}}]',
        "Let me check.",
        [("f", '{"q": "[x]"}')],
    ),
    ("mistral", "[TOOL_CALLS] [{name: f}]", "[TOOL_CALLS] [{name: f}]", []),
    ("mistral", "No tools needed: 2 + 2 = 4.", "No tools needed: 2 + 2 = 4.", []),
]


def parse(parser_name: str, pieces: list[str]) -> dict:
    return run_pieces(ChatOutputParser(tools=tool_call_parser_class(parser_name)()), pieces)


def expected(content: str, calls: list[tuple[str, str]]) -> dict:
    return {
        "reasoning": "",
        "content": content,
        "tool_calls": [{"name": name, "arguments": arguments} for name, arguments in calls],
    }


def test_registered_parsers():
    assert tool_call_parser_names() == ("hermes", "llama3_json", "mistral")


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_recorded_outputs_parse_the_same_at_every_split(parser, text, content, calls):
    want = expected(content, calls)
    for pieces in every_split(text):
        assert parse(parser, pieces) == want, pieces


@settings(max_examples=300, deadline=None, derandomize=True)
@given(case=st.sampled_from(CASES), cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=30))
def test_random_splits_parse_the_same(case, cuts):
    parser, text, content, calls = case
    points = sorted({cut % (len(text) + 1) for cut in cuts})
    pieces = [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]
    assert parse(parser, pieces) == expected(content, calls)


def test_arguments_stream_before_the_call_ends():
    output = ChatOutputParser(tools=tool_call_parser_class("hermes")())
    assert output.feed('<tool_call>{"name": "get_wea').tool_calls == []  # the name may go on
    first = output.feed('ther", "arguments": {"city": "Pa')
    assert [(call.index, call.name, call.arguments) for call in first.tool_calls] == [
        (0, "get_weather", ""),
        (0, None, '{"city": "Pa'),
    ]
    assert re.fullmatch(r"call_[0-9a-f]{24}", first.tool_calls[0].id)
    assert [call.arguments for call in output.feed('ris"}}</tool_call>').tool_calls] == ['ris"}']


def test_mistral_ids_are_nine_letters_or_digits():
    output = ChatOutputParser(tools=tool_call_parser_class("mistral")())
    delta = output.feed('[TOOL_CALLS][{"name": "f", "arguments": {}}]')
    assert re.fullmatch(r"[A-Za-z0-9]{9}", delta.tool_calls[0].id)
    assert tool_call_parser_class("mistral").needs_special_tokens


def test_parallel_tool_calls_false_keeps_the_first_call():
    call = '<tool_call>{{"name": "{}", "arguments": {{}}}}</tool_call>'
    text = call.format("a") + call.format("b")
    output = ChatOutputParser(tools=tool_call_parser_class("hermes")(), max_calls=1)
    assert run_pieces(output, [text])["tool_calls"] == [{"name": "a", "arguments": "{}"}]


FORCED_CASES = [
    ('{"name": "get_weather", "arguments": {"city": "Paris"}}', [("get_weather", '{"city": "Paris"}')]),
    (
        '[{"name": "a", "arguments": {"x": [1, {"y": "}"}]}}, {"name": "b", "arguments": {}}]',
        [("a", '{"x": [1, {"y": "}"}]}'), ("b", "{}")],
    ),
]


@pytest.mark.parametrize(("text", "calls"), FORCED_CASES)
def test_forced_output_is_read_from_the_first_character(text, calls):
    for pieces in every_split(text):
        parsed = run_pieces(ChatOutputParser(tools=ForcedToolCallParser()), pieces)
        assert parsed == expected("", calls)
        for call in parsed["tool_calls"]:
            json.loads(call["arguments"])


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    arguments=st.dictionaries(st.text(max_size=8), JSON_VALUES, max_size=4),
    ascii_only=st.booleans(),
    cuts=st.lists(st.integers(min_value=0, max_value=2000), max_size=20),
)
def test_any_json_arguments_come_back_exactly(arguments, ascii_only, cuts):
    written = json.dumps(arguments, ensure_ascii=ascii_only)
    text = f'Calling.<tool_call>{{"name": "f", "arguments": {written}}}</tool_call>'
    points = sorted({cut % (len(text) + 1) for cut in cuts})
    pieces = [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]
    parsed = parse("hermes", pieces)
    assert parsed == expected("Calling.", [("f", written)])
    assert json.loads(parsed["tool_calls"][0]["arguments"]) == arguments
