"""Reasoning output items through the real stack: the engine on the test-made thinking copy of
stories260K (tests/gateway/thinking_model.py, whose vocabulary spells `</think>`) behind a gateway with
--reasoning-parser deepseek_r1; the Responses output is compared with chat's split of the same text."""

from __future__ import annotations

import openai
import pytest

from tests.gateway.thinking_model import write_thinking_model
from tests.support.gateway_thread import GatewayThread
from tests.support.processes import require_shared, start_engine
from tests.support.stories import MODEL

pytestmark = pytest.mark.integration

THINKING = "stories-thinking"
SAID = "Tell me what he said"  # greedy: `"Hello,"</think> Tom. ...`


@pytest.fixture(scope="module")
def sdk(tmp_path_factory):
    folder = write_thinking_model(require_shared(f"models/{MODEL}"), tmp_path_factory.mktemp("m") / THINKING)
    with (
        start_engine(folder, "--max-num-seqs", "4") as engine,
        GatewayThread([engine.address], reasoning_parser="deepseek_r1") as gateway,
        openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0) as client,
    ):
        yield client


def test_reasoning_becomes_a_reasoning_item_before_the_message(sdk):
    chat = sdk.chat.completions.create(
        model=THINKING, messages=[{"role": "user", "content": SAID}], max_tokens=40, temperature=0
    )
    said = chat.choices[0].message
    response = sdk.responses.create(model=THINKING, input=SAID, max_output_tokens=40, temperature=0)
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_") and reasoning.summary == []
    assert [part.text for part in reasoning.content] == [said.reasoning_content]
    assert message.type == "message" and response.output_text == said.content
    details = response.usage.output_tokens_details
    assert 0 < details.reasoning_tokens < response.usage.output_tokens

    events = list(
        sdk.responses.create(model=THINKING, input=SAID, max_output_tokens=40, temperature=0, stream=True)
    )
    reasoning_deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert "".join(reasoning_deltas) == said.reasoning_content
    (done,) = [e for e in events if e.type == "response.reasoning_text.done"]
    assert done.text == said.reasoning_content and done.output_index == 0
    added = [(e.output_index, e.item.type) for e in events if e.type == "response.output_item.added"]
    assert added == [(0, "reasoning"), (1, "message")]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == said.content

    # A chained turn leaves the reasoning out of the prompt: the earlier answer's text alone follows.
    chained = sdk.responses.create(
        model=THINKING,
        previous_response_id=response.id,
        input="And then?",
        max_output_tokens=4,
        temperature=0,
    )
    plain = sdk.chat.completions.create(
        model=THINKING,
        messages=[
            {"role": "user", "content": SAID},
            {"role": "assistant", "content": said.content},
            {"role": "user", "content": "And then?"},
        ],
        max_tokens=4,
        temperature=0,
    )
    assert chained.usage.input_tokens == plain.usage.prompt_tokens
