"""Reasoning parsers on recorded-style outputs, at every split (tags cut across deltas), alone and in
front of a tool-call parser (which only sees the content part)."""

from __future__ import annotations

import pytest

from conduit_gateway.parsers.chat_output import ChatOutputParser
from conduit_gateway.parsers.reasoning import reasoning_parser_class, reasoning_parser_names
from conduit_gateway.parsers.tool_calls import tool_call_parser_class
from tests.gateway.parsed_output import every_split, run_pieces

pytestmark = pytest.mark.unit

QWEN3 = "<think>\nThe user asks for 2 + 2. That is 4.\n</think>\n\nThe answer is 4."
R1 = "Okay, 2 + 2: add them, 4.\n</think>\n\nThe answer is **4**."

# (parser, output, reasoning, content)
CASES = [
    ("qwen3", QWEN3, "\nThe user asks for 2 + 2. That is 4.\n", "\n\nThe answer is 4."),
    ("deepseek_r1", QWEN3, "\nThe user asks for 2 + 2. That is 4.\n", "\n\nThe answer is 4."),
    # The R1 template writes <think> into the prompt: the output starts inside the reasoning.
    ("deepseek_r1", R1, "Okay, 2 + 2: add them, 4.\n", "\n\nThe answer is **4**."),
    # Qwen3 with thinking disabled writes no tags: all content (deepseek_r1 would call it reasoning).
    ("qwen3", "The answer is 4.", "", "The answer is 4."),
    ("deepseek_r1", "Still thinking about", "Still thinking about", ""),
    # Cut short inside the reasoning.
    ("qwen3", "<think>Let me see. 2 + 2 is", "Let me see. 2 + 2 is", ""),
    # Whitespace before the opening tag is dropped; a lone "<" or a partial end tag is text.
    ("qwen3", "\n<think>a < b</thin</think>ok", "a < b</thin", "ok"),
    # Only the first end tag ends the reasoning.
    ("qwen3", "<think>x</think>y</think>z", "x", "y</think>z"),
    ("qwen3", "<thin", "", "<thin"),
    ("deepseek_r1", "", "", ""),
]


def test_registered_parsers():
    assert reasoning_parser_names() == ("deepseek_r1", "qwen3")
    assert reasoning_parser_class("qwen3").end_tag == "</think>"


@pytest.mark.parametrize(("parser", "text", "reasoning", "content"), CASES)
def test_reasoning_split_is_the_same_at_every_split(parser, text, reasoning, content):
    for pieces in every_split(text):
        output = ChatOutputParser(reasoning=reasoning_parser_class(parser)())
        parsed = run_pieces(output, pieces)
        assert parsed == {"reasoning": reasoning, "content": content, "tool_calls": []}, pieces


def test_tool_calls_are_parsed_in_the_content_only():
    thought = 'Maybe <tool_call>{"name": "no", "arguments": {}}</tool_call>? The user wants the weather.'
    text = (
        f"<think>{thought}</think>\n\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    )
    for pieces in every_split(text):
        output = ChatOutputParser(
            reasoning=reasoning_parser_class("qwen3")(), tools=tool_call_parser_class("hermes")()
        )
        assert run_pieces(output, pieces) == {
            "reasoning": thought,
            "content": "",
            "tool_calls": [{"name": "get_weather", "arguments": '{"city": "Paris"}'}],
        }
