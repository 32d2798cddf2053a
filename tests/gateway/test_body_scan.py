"""body_scan.top_level_strings: the top-level string fields a full JSON parser would see, or no answer
where it cannot be sure; and prompt_limits.refuse_unfit_completion, which refuses an oversized plain
prompt string by it before the body is parsed."""

from __future__ import annotations

import json

import pytest

from conduit_gateway.errors import OpenAIError
from conduit_gateway.http.body_scan import top_level_strings
from conduit_gateway.prompt_limits import refuse_unfit_completion
from tests.gateway.test_prompt_limits import pool

pytestmark = pytest.mark.unit

KEYS = (b"model", b"prompt")


def strings(body: bytes) -> dict[bytes, bytes | None] | None:
    found = top_level_strings(body, KEYS)
    if found is None:
        return None
    return {key: None if span is None else body[span[0] : span[1]] for key, span in found.items()}


def test_the_wanted_strings_are_found_past_nested_values_and_literals():
    body = json.dumps(
        {
            "logit_bias": {"5": -100, "7": 3},
            "stop": ["]", "}", '"', "\\"],
            "model": "m",
            "n": 2,
            "echo": False,
            "suffix": None,
            "prompt": "Once upon a time",
            "tail": [[1, 2], {"a": [3]}],
        }
    ).encode()
    assert strings(body) == {b"model": b"m", b"prompt": b"Once upon a time"}
    assert json.loads(body)["prompt"] == "Once upon a time"


def test_the_last_of_repeated_keys_counts_as_with_a_full_parser():
    body = b'{"model": "m", "prompt": "' + b"a" * 100 + b'", "prompt": "short"}'
    assert strings(body) == {b"model": b"m", b"prompt": b"short"} and json.loads(body)["prompt"] == "short"
    listed = b'{"prompt": "' + b"a" * 100 + b'", "prompt": ["x", "y"]}'
    assert strings(listed) == {b"prompt": None}


def test_a_value_with_an_escape_is_not_measured_and_a_key_with_one_stops_the_scan():
    assert strings(b'{"prompt": "a\\nb", "model": "m"}') == {b"prompt": None, b"model": b"m"}
    # "pro\u006dpt" is "prompt" to a parser: the scan cannot tell which prompt counts.
    assert strings(b'{"prompt": "long", "pro\\u006dpt": "short"}') is None
    # Backslashes before a quote: an even run leaves it closing the string.
    assert strings(b'{"x": "\\\\", "prompt": "p"}') == {b"prompt": b"p"}
    assert strings(b'{"x": "\\\\\\"", "prompt": "p"}') == {b"prompt": b"p"}


@pytest.mark.parametrize(
    "body",
    [b"", b"[1, 2]", b'{"prompt": "open', b'{"prompt" "x"}', b'{"a": [1, 2', b'{"a": 1', b"{prompt: 1}"],
)
def test_what_is_not_a_complete_object_gets_no_answer(body):
    assert top_level_strings(body, KEYS) is None


def test_many_strings_in_a_nested_value_exceed_the_steps_and_get_no_answer():
    body = json.dumps({"stop": ["s"] * 600, "prompt": "p"}).encode()
    assert top_level_strings(body, KEYS) is None
    assert top_level_strings(body, KEYS, max_steps=2000) == {b"prompt": (len(body) - 3, len(body) - 2)}


POOL = pool(("m", 4608, 512))
BIG = 100_000  # over the scan threshold (64 KiB) and over the bound


def refused(body: bytes) -> OpenAIError | None:
    try:
        refuse_unfit_completion(POOL, body)  # type: ignore[arg-type]
    except OpenAIError as error:
        return error
    return None


def test_an_oversized_plain_prompt_is_refused_as_the_handler_refuses_it():
    error = refused(json.dumps({"model": "m", "prompt": "a" * BIG}).encode())
    assert error is not None and (error.status, error.param) == (400, "prompt")
    assert error.message == (
        f"prompt: prompt is {BIG} bytes of text, more than the 4608 bytes the model's context of 512 "
        "tokens can hold"
    )
    utf8 = json.dumps({"model": "m", "prompt": "é" * BIG}, ensure_ascii=False).encode()
    assert refused(utf8).message.startswith(f"prompt: prompt is {2 * BIG} bytes")  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "fields",
    [
        {"model": "m", "prompt": "a" * 100},  # under the scan threshold: parsed first
        {"model": "m", "prompt": "a" * 4000, "logit_bias": {str(i): 1 for i in range(20000)}},  # fits
        {"model": "other", "prompt": "a" * BIG},  # a model no engine serves: the handler's 404
        {"prompt": "a" * BIG},  # no model: the handler's 400 naming model
        {"model": "m", "prompt": "a" * BIG + "\n"},  # an escape: measured after parsing
        {"model": "m", "prompt": ["a" * BIG]},  # a list: checked prompt by prompt after parsing
    ],
)
def test_what_the_scan_is_not_sure_of_is_left_to_the_handler(fields):
    assert refused(json.dumps(fields).encode()) is None
