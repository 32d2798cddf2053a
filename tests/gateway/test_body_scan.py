"""body_scan.top_level_strings: the top-level string fields a full JSON parser would see, or no answer
where it cannot be sure; and prompt_limits.refuse_unfit_completion, which refuses a prompt certainly
over the context's byte bound by it, before the body is parsed, as the handler would after."""

from __future__ import annotations

import json

import pytest

from conduit_gateway.errors import OpenAIError
from conduit_gateway.http.body_scan import RawString, top_level_strings
from conduit_gateway.prompt_limits import MAX_PROMPTS, refuse_unfit_completion
from tests.gateway.test_prompt_limits import pool

pytestmark = pytest.mark.unit

KEYS = (b"model", b"prompt")


def raw(body: bytes, value: object) -> object:
    """A found value as its raw bytes (an array as a list of them; escaped strings marked)."""
    if isinstance(value, RawString):
        text = body[value.start : value.end]
        return ("escaped", text) if value.escaped else text
    if isinstance(value, tuple):
        return [raw(body, item) for item in value]
    return value


def strings(body: bytes, max_steps: int = 5000) -> dict[bytes, object] | None:
    found = top_level_strings(body, KEYS, max_steps)
    return None if found is None else {key: raw(body, value) for key, value in found.items()}


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


def test_an_array_of_strings_is_found_and_any_other_value_is_none():
    assert strings(b'{"prompt": ["a", "b\\n"]}') == {b"prompt": [b"a", ("escaped", b"b\\n")]}
    assert strings(b'{"prompt": [1, 2], "model": 7}') == {b"prompt": None, b"model": None}
    assert strings(b'{"prompt": ["a", [1]], "model": {"x": "y"}}') == {b"prompt": None, b"model": None}
    assert strings(b'{"prompt": []}') == {b"prompt": []}


def test_the_last_of_repeated_keys_counts_as_with_a_full_parser():
    body = b'{"model": "m", "prompt": "' + b"a" * 100 + b'", "prompt": "short"}'
    assert strings(body) == {b"model": b"m", b"prompt": b"short"} and json.loads(body)["prompt"] == "short"
    assert strings(b'{"prompt": "' + b"a" * 100 + b'", "prompt": 5}') == {b"prompt": None}


def test_escapes_are_marked_and_a_key_with_one_stops_the_walk():
    assert strings(b'{"prompt": "a\\nb", "model": "m"}') == {b"prompt": ("escaped", b"a\\nb"), b"model": b"m"}
    # "pro\u006dpt" is "prompt" to a parser: the walk cannot tell which prompt counts.
    assert strings(b'{"prompt": "long", "pro\\u006dpt": "short"}') is None
    # Backslashes before a quote: an even run leaves it closing the string.
    assert strings(b'{"x": "\\\\", "prompt": "p"}') == {b"prompt": b"p"}
    assert strings(b'{"x": "\\\\\\"", "prompt": "p"}') == {b"prompt": b"p"}


def test_an_escaped_strings_text_is_between_a_sixth_of_its_raw_bytes_and_all_of_them():
    for text in ["\n" * 60, "A" * 60, "é" * 60, "\U0001f600" * 60, "plain" * 12]:
        for ensure_ascii in (True, False):
            body = json.dumps({"prompt": text}, ensure_ascii=ensure_ascii).encode()
            value = top_level_strings(body, KEYS)[b"prompt"]  # type: ignore[index]
            assert isinstance(value, RawString)
            assert value.min_text_bytes <= len(text.encode()) <= value.max_text_bytes


@pytest.mark.parametrize(
    "body",
    [b"", b"[1, 2]", b'{"prompt": "open', b'{"prompt" "x"}', b'{"a": [1, 2', b'{"a": 1', b"{prompt: 1}"],
)
def test_what_is_not_a_complete_object_gets_no_answer(body):
    assert top_level_strings(body, KEYS) is None


def test_more_steps_than_allowed_get_no_answer():
    body = json.dumps({"stop": ["s"] * 600, "prompt": "p"}).encode()
    assert strings(body, max_steps=500) is None
    assert strings(body) == {b"prompt": b"p"}


POOL = pool(("m", 4608, 512))
BIG = 100_000  # over the scan threshold (64 KiB) and over the bound


def refused(fields: dict, ensure_ascii: bool = True) -> OpenAIError | None:
    try:
        refuse_unfit_completion(POOL, json.dumps(fields, ensure_ascii=ensure_ascii).encode())  # type: ignore[arg-type]
    except OpenAIError as error:
        return error
    return None


def too_long(param: str, size: int | str) -> str:
    return (
        f"{param}: prompt is {size} bytes of text, more than the 4608 bytes the model's context of 512 "
        "tokens can hold"
    )


def test_an_oversized_plain_prompt_is_refused_as_the_handler_refuses_it():
    error = refused({"model": "m", "prompt": "a" * BIG})
    assert error is not None and (error.status, error.param, error.message) == (
        400,
        "prompt",
        too_long("prompt", BIG),
    )
    utf8 = refused({"model": "m", "prompt": "é" * BIG}, ensure_ascii=False)
    assert utf8 is not None and utf8.message == too_long("prompt", 2 * BIG)
    alone = refused({"model": "m", "prompt": ["a" * BIG]})  # a list of one is named as one prompt
    assert alone is not None and alone.message == too_long("prompt", BIG)


def test_an_escaped_prompt_is_refused_by_the_least_its_text_can_be():
    error = refused({"model": "m", "prompt": "a" * BIG + "\n"})
    assert error is not None and error.param == "prompt"
    assert error.message == too_long("prompt", f"at least {-(-(BIG + 2) // 6)}")


def test_in_a_list_the_first_prompt_certainly_over_is_refused_when_those_before_it_certainly_fit():
    error = refused({"model": "m", "prompt": ["Once", "b" * 4000, "c" * BIG, "d" * BIG]})
    assert error is not None and error.message == too_long("prompt[2]", BIG)


@pytest.mark.parametrize(
    "fields",
    [
        {"model": "m", "prompt": "a" * 100},  # under the scan threshold: parsed first
        {"model": "m", "prompt": "a" * 4000, "logit_bias": {str(i): 1 for i in range(20000)}},  # fits
        {"model": "other", "prompt": "a" * BIG},  # a model no engine serves: the handler's 404
        {"prompt": "a" * BIG},  # no model: the handler's 400 naming model
        # 6,000 raw bytes, 1,000 to 6,000 of text (3,000): only the decoded text tells whether it fits
        {"model": "m", "prompt": "\n" * 3000, "logit_bias": {str(i): 1 for i in range(20000)}},
        {"model": "m", "prompt": ["\n" * 3000, "a" * BIG]},  # the first may fit: the handler checks it
        {"model": "m", "prompt": ["a"] * MAX_PROMPTS + ["a" * BIG]},  # too many prompts: the handler's
        {"model": "m", "prompt": [[1] * 10, "a" * BIG]},  # not all strings
    ],
)
def test_what_the_walk_is_not_sure_of_is_left_to_the_handler(fields):
    assert refused(fields) is None
