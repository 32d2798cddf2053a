"""The real engine (subprocess, stories260K) behind the real gateway (subprocess, CLI), driven with the
openai SDK: greedy output equals transformers, finish reasons, usage, n, seeds, errors, disconnects.

Every test runs twice: against one colocated engine (the shared stack of conftest), and against a prefill
engine and a decode engine behind a disaggregating gateway (--prefill-engine/--decode-engine), which must
pass the same checks."""

from __future__ import annotations

import grpc
import httpx
import openai
import pytest

from conduit.engine.v1 import engine_pb2, engine_pb2_grpc
from tests.gateway.sse import parse_events
from tests.support.polling import wait_for
from tests.support.processes import require_shared, start_engine, start_gateway
from tests.support.stories import KNOWN_STORY, KNOWN_STORY_TOKENS, MODEL, PROMPT, PROMPT_IDS

pytestmark = pytest.mark.integration

STORY = PROMPT
MESSAGES = [
    {"role": "system", "content": "You tell stories."},
    {"role": "user", "content": "Tell me a story"},
]


@pytest.fixture(scope="module")
def model_path():
    return require_shared(f"models/{MODEL}")


ENGINE_ARGS = ("--max-num-seqs", "8")  # read by the stories_engine fixture (conftest)


@pytest.fixture(scope="module", params=["colocated", "disaggregated"])
def topology(request, model_path):
    """(the engine processes, the gateway's engine flags, the gateway) of one topology."""
    if request.param == "colocated":
        engine = request.getfixturevalue("stories_engine")
        yield [engine], (engine.address,), request.getfixturevalue("stories_gateway")
        return
    with (
        start_engine(model_path, *ENGINE_ARGS, "--role", "prefill") as prefill,
        start_engine(model_path, *ENGINE_ARGS, "--role", "decode") as decode,
    ):
        flags = ("", "--prefill-engine", prefill.address, "--decode-engine", decode.address)
        with start_gateway(*flags) as gateway:
            yield [prefill, decode], flags, gateway


@pytest.fixture(scope="module")
def gateway(topology):
    return topology[2]


@pytest.fixture(scope="module")
def sdk(gateway):
    with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0) as client:
        yield client


@pytest.fixture(scope="module")
def load(topology):
    """GetLoad summed over the topology's engines."""
    channels = [grpc.insecure_channel(engine.address) for engine in topology[0]]
    stubs = [engine_pb2_grpc.EngineStub(channel) for channel in channels]

    def total() -> engine_pb2.GetLoadResponse:
        summed = engine_pb2.GetLoadResponse()
        for stub in stubs:
            reply = stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=10)
            for name in ("running_requests", "waiting_requests", "kv_blocks_used", "generated_tokens"):
                setattr(summed, name, getattr(summed, name) + getattr(reply, name))
        return summed

    yield total
    for channel in channels:
        channel.close()


class Reference:
    """Greedy continuations by Hugging Face transformers on the same folder."""

    def __init__(self, path) -> None:
        import torch
        import transformers

        self.torch = torch
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(path)
        self.model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.eos = self.model.generation_config.eos_token_id

    def prompt_ids(self, text: str | None = None, messages: list | None = None) -> list[int]:
        if messages is not None:
            # The engine renders chat_template.jinja the HF way (messages, add_generation_prompt=True).
            rendered = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            return list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
        return self.tokenizer(text)["input_ids"]

    def greedy(self, prompt_ids: list[int], max_tokens: int) -> tuple[str, str, list[int]]:
        """(text, finish_reason, generated ids) of a greedy run."""
        with self.torch.no_grad():
            out = self.model.generate(
                self.torch.tensor([prompt_ids]), max_new_tokens=max_tokens, do_sample=False, pad_token_id=0
            )
        new = out[0, len(prompt_ids) :].tolist()
        finish = "length"
        if new and new[-1] == self.eos:
            new, finish = new[:-1], "stop"
        # Text as a continuation of the prompt (what incremental detokenization streams): a leading
        # "▁word" keeps its space, which decoding the new ids alone would strip.
        prompt_text = self.tokenizer.decode(prompt_ids, skip_special_tokens=True)
        full_text = self.tokenizer.decode(prompt_ids + new, skip_special_tokens=True)
        assert full_text.startswith(prompt_text)
        return full_text[len(prompt_text) :], finish, new


@pytest.fixture(scope="module")
def reference(model_path):
    return Reference(model_path)


def stream_text(chunks) -> tuple[dict[int, str], dict[int, str]]:
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            piece = choice.delta.content if hasattr(choice, "delta") else choice.text
            texts[choice.index] = texts.get(choice.index, "") + (piece or "")
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    return texts, finishes


def test_completion_greedy_equals_transformers(sdk, reference):
    ids = reference.prompt_ids(STORY)
    assert ids == list(PROMPT_IDS)
    text, finish, generated = reference.greedy(ids, 40)
    result = sdk.completions.create(model=MODEL, prompt=STORY, max_tokens=40, temperature=0)
    assert result.choices[0].text == text
    assert result.choices[0].finish_reason == finish
    assert result.usage.prompt_tokens == 5
    assert result.usage.completion_tokens == len(generated) + (finish == "stop")
    streamed, finishes = stream_text(
        sdk.completions.create(model=MODEL, prompt=STORY, max_tokens=40, temperature=0, stream=True)
    )
    assert streamed == {0: text} and finishes == {0: finish}
    by_ids = sdk.completions.create(model=MODEL, prompt=ids, max_tokens=40, temperature=0)
    assert by_ids.choices[0].text == text


def test_known_story_from_bos(sdk):
    result = sdk.completions.create(model=MODEL, prompt=[1], max_tokens=KNOWN_STORY_TOKENS, temperature=0)
    assert result.choices[0].text.strip() == KNOWN_STORY


def test_chat_greedy_equals_transformers(sdk, reference):
    ids = reference.prompt_ids(messages=MESSAGES)
    text, finish, _ = reference.greedy(ids, 48)
    result = sdk.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=48, temperature=0)
    assert result.choices[0].message.content == text
    assert result.choices[0].message.role == "assistant"
    assert result.choices[0].finish_reason == finish
    assert result.usage.prompt_tokens == len(ids)
    chunks = list(
        sdk.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=48, temperature=0, stream=True)
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed, finishes = stream_text(chunks)
    assert streamed == {0: text} and finishes == {0: finish}


def test_finish_reason_stop_on_stop_string(sdk, reference):
    text, _, _ = reference.greedy(reference.prompt_ids(STORY), 40)
    assert " Lily" in text
    expected = text[: text.index(" Lily")]
    for stream in (False, True):
        response = sdk.completions.create(
            model=MODEL, prompt=STORY, max_tokens=40, temperature=0, stop=[" Lily"], stream=stream
        )
        texts, finishes = stream_text(response) if stream else ({0: response.choices[0].text}, {0: "stop"})
        assert texts == {0: expected}
        if not stream:
            assert response.choices[0].finish_reason == "stop"
        assert finishes == {0: "stop"}


def test_finish_reason_length(sdk):
    result = sdk.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_completion_tokens=3, temperature=0
    )
    assert result.choices[0].finish_reason == "length"
    assert result.usage.completion_tokens == 3


def test_include_usage_chunk(sdk, reference):
    chunks = list(
        sdk.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=7,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert len(chunks) == 10  # the role, seven tokens, the finish reason, the usage
    assert all(chunk.usage is None for chunk in chunks[:-1])
    last = chunks[-1]
    assert last.choices == []
    prompt_tokens = len(reference.prompt_ids(messages=MESSAGES))
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (prompt_tokens, 7)
    assert last.usage.total_tokens == prompt_tokens + 7


def test_n2_choices_are_indexed(sdk):
    result = sdk.completions.create(model=MODEL, prompt=STORY, max_tokens=10, n=2, temperature=1.0, seed=11)
    assert [c.index for c in result.choices] == [0, 1]
    assert all(c.finish_reason == "length" and c.text for c in result.choices)
    assert result.usage.completion_tokens == 20
    texts, finishes = stream_text(
        sdk.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=10, n=2, temperature=1.0, seed=11, stream=True
        )
    )
    assert sorted(texts) == [0, 1] and finishes == {0: "length", 1: "length"}


def test_seed_reproducibility(sdk):
    def sample(stream: bool) -> str:
        kwargs = dict(model=MODEL, prompt=STORY, max_tokens=30, temperature=1.0, top_p=0.95, seed=1234)
        if stream:
            return stream_text(sdk.completions.create(**kwargs, stream=True))[0][0]
        return sdk.completions.create(**kwargs).choices[0].text

    first = sample(False)
    assert sample(False) == first
    assert sample(True) == first


def test_prompt_list_matches_single_prompts(sdk):
    prompts = [STORY, "The dog"]
    batched = sdk.completions.create(model=MODEL, prompt=prompts, max_tokens=12, temperature=0)
    singles = [sdk.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0) for p in prompts]
    assert [c.text for c in batched.choices] == [s.choices[0].text for s in singles]
    assert batched.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)


def test_models_endpoint(sdk):
    models = sdk.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert sdk.models.retrieve(MODEL).id == MODEL


def test_engine_validation_errors_are_400_with_param(sdk, gateway):
    with pytest.raises(openai.BadRequestError) as caught:
        sdk.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=-1)
    assert caught.value.body["param"] == "temperature"
    assert caught.value.body["message"].startswith("temperature: ")
    with pytest.raises(openai.BadRequestError) as caught:
        sdk.completions.create(model=MODEL, prompt=[1, 600])
    assert caught.value.body["param"] == "prompt"
    response = httpx.post(
        f"{gateway.url}/v1/completions", json={"model": MODEL, "prompt": STORY, "max_tokens": 100000}
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "max_tokens"


def test_unknown_model_is_404(sdk):
    with pytest.raises(openai.NotFoundError) as caught:
        sdk.completions.create(model="llama-70b", prompt=STORY)
    assert caught.value.body["code"] == "model_not_found"


def test_client_disconnect_frees_engine_blocks(gateway, load):
    before = load()
    body = {"model": MODEL, "prompt": STORY, "max_tokens": 500, "ignore_eos": True, "stream": True}
    with (
        httpx.Client(base_url=gateway.url, timeout=60) as raw,
        raw.stream("POST", "/v1/completions", json=body) as r,
    ):
        lines = (line for line in r.iter_lines() if line)
        received = [parse_events(next(lines) + "\n\n")[0] for _ in range(2)]
        assert all(event["choices"][0]["finish_reason"] is None for event in received)
        live = load()
        assert live.running_requests == 1 and live.kv_blocks_used > 0
    wait_for(lambda: load().kv_blocks_used == 0, "the engine to free the request's blocks")
    after = load()
    assert after.running_requests == 0 and after.waiting_requests == 0
    # Cut short: far fewer than the 500 requested tokens were generated.
    assert after.generated_tokens - before.generated_tokens < 500


def test_client_timeout_without_stream_frees_engine_blocks(gateway, load):
    body = {
        "model": MODEL,
        "prompt": STORY,
        "max_tokens": 500,
        "ignore_eos": True,
        "n": 4,
        "temperature": 1.0,
    }
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{gateway.url}/v1/completions", json=body, timeout=httpx.Timeout(60, read=0.2))
    wait_for(
        lambda: load().kv_blocks_used == 0 and load().running_requests == 0, "the engine to drop the request"
    )


def test_completion_logprobs_offsets_follow_the_text(sdk, gateway):
    kwargs = dict(model=MODEL, prompt=STORY, max_tokens=12, temperature=0, logprobs=2)
    result = sdk.completions.create(**kwargs).choices[0]
    logprobs = result.logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.text_offset) == 12
    assert all(len(top) >= 2 for top in logprobs.top_logprobs)
    assert all(lp <= 0 for lp in logprobs.token_logprobs)
    # The offsets index the returned text: each token's text occurs at (or one space after) its offset.
    for token, offset in zip(logprobs.tokens, logprobs.text_offset, strict=True):
        assert result.text[offset:].lstrip(" ").startswith(token.lstrip(" "))
    streamed = [c.choices[0] for c in sdk.completions.create(**kwargs, stream=True) if c.choices[0].logprobs]
    assert [o for c in streamed for o in c.logprobs.text_offset] == logprobs.text_offset


def test_prompt_logprobs_cover_the_prompt(gateway):
    body = {"model": MODEL, "prompt": STORY, "max_tokens": 1, "prompt_logprobs": 1}
    choice = httpx.post(f"{gateway.url}/v1/completions", json=body, timeout=60).json()["choices"][0]
    entries = choice["prompt_logprobs"]
    assert len(entries) == 5 and entries[0] is None
    for entry, token_id in zip(entries[1:], PROMPT_IDS[1:], strict=True):
        assert str(token_id) in entry


@pytest.fixture(scope="module")
def parsing_sdk(topology):
    parsers = ("--tool-call-parser", "hermes", "--reasoning-parser", "qwen3")
    with start_gateway(*topology[1], *parsers) as process:
        with openai.OpenAI(base_url=f"{process.url}/v1", api_key="unused", max_retries=0) as client:
            yield client


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def test_tools_and_parsers_leave_a_plain_story_unchanged(sdk, parsing_sdk):
    """stories260K writes no tags: with tools (auto) and both parsers the answer is the plain one."""
    plain = sdk.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=40, temperature=0)
    parsed = parsing_sdk.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=40, temperature=0, tools=[WEATHER_TOOL]
    )
    (choice,) = parsed.choices
    assert choice.message.content == plain.choices[0].message.content
    assert choice.message.tool_calls is None and choice.finish_reason == plain.choices[0].finish_reason
    assert not hasattr(choice.message, "reasoning_content")
    chunks = list(
        parsing_sdk.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=40, temperature=0, tools=[WEATHER_TOOL], stream=True
        )
    )
    streamed, finishes = stream_text(chunks)
    assert streamed == {0: choice.message.content} and finishes == {0: choice.finish_reason}


def test_tool_call_history_goes_through_the_template(parsing_sdk):
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
    }
    messages = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
    ]
    result = parsing_sdk.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0, tools=[WEATHER_TOOL], tool_choice="none"
    )
    assert result.choices[0].finish_reason == "length" and result.usage.completion_tokens == 8
