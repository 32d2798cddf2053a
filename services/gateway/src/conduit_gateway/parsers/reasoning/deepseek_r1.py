"""deepseek_r1: DeepSeek-R1 style `<think>…</think>`; its templates open the tag in the prompt, so an
output without the start tag is reasoning up to `</think>` (all reasoning if it never closes)."""

from __future__ import annotations

from conduit_gateway.parsers.reasoning.base import ThinkTagParser


class DeepSeekR1ReasoningParser(ThinkTagParser):
    name = "deepseek_r1"
    opened_by_template = True
