"""The prompt byte bound (models/prompt_bound.py): sound for the tokenizers it is claimed for (no text of
more than context × L bytes ever encodes to context tokens or fewer, beyond what the normalizer
collapses), absent for the pipelines that may shrink text, and tokenization off the step loop."""

from __future__ import annotations

import asyncio
import json
import random
import threading

import pytest
from tokenizers import Tokenizer

from conduit_engine.engine.async_engine import AsyncEngine
from conduit_engine.engine.request import GenerationRequest
from conduit_engine.errors import InvalidRequestError
from conduit_engine.models.prompt_bound import prompt_bound
from tests.engine.support.harness import greedy, make_engine

pytestmark = pytest.mark.unit

PIECES = [
    "a",
    "the",
    " ",
    "  ",
    "é",
    "日本",
    "😀",
    "\n",
    "\t",
    "<s>",
    "</s>",
    " friend",
    "\x00",
    "xyz",
    "ab ",
]


@pytest.fixture(params=["stories", "llama2"])
def tokenizer(request, stories_path, llama2_tokenizer_path) -> Tokenizer:
    folder = stories_path if request.param == "stories" else llama2_tokenizer_path
    return Tokenizer.from_file(str(folder / "tokenizer.json"))


def test_stories260k_has_a_bound_of_its_context_times_its_longest_piece(stories_path):
    bound = prompt_bound(Tokenizer.from_file(str(stories_path / "tokenizer.json")), 512)
    assert (bound.max_token_bytes, bound.max_bytes, bound.collapsed) == (9, 512 * 9, " ")


def test_no_text_covers_more_bytes_per_token_than_the_bound_says(tokenizer):
    bound = prompt_bound(tokenizer, 512)
    rng = random.Random(7)
    for _ in range(2000):
        text = "".join(rng.choice(PIECES) for _ in range(rng.randint(1, 300)))
        # What the normalizer collapses aside, every token covers at most L bytes.
        counted = len(text.encode()) - sum(text.count(c) for c in bound.collapsed)
        assert counted <= bound.max_token_bytes * len(tokenizer.encode(text).ids), text


def test_text_over_the_bound_is_refused_naming_the_field(stories_path):
    bound = prompt_bound(Tokenizer.from_file(str(stories_path / "tokenizer.json")), 512)
    bound.check("prompt", "x" * bound.max_bytes)
    with pytest.raises(InvalidRequestError) as caught:
        bound.check("prompt", "x" * bound.max_bytes + "é")
    assert str(caught.value) == (
        f"prompt: prompt is {bound.max_bytes + 2} bytes of text, more than the {bound.max_bytes} bytes the "
        "model's context of 512 tokens can hold"
    )


@pytest.mark.parametrize(
    "change",
    [
        {"normalizer": {"type": "NFKC"}},
        {"normalizer": {"type": "Replace", "pattern": {"Regex": "\\s+"}, "content": ""}},
        {"pre_tokenizer": {"type": "Whitespace"}},
        {"truncation": {"max_length": 8, "strategy": "LongestFirst", "stride": 0, "direction": "Right"}},
        {"model": {"byte_fallback": False, "fuse_unk": True}},
    ],
    ids=["nfkc", "regex-strip", "whitespace-split", "truncation", "fused-unknowns"],
)
def test_pipelines_that_may_shrink_text_have_no_bound(stories_path, change):
    spec = json.loads((stories_path / "tokenizer.json").read_text())
    for key, value in change.items():
        spec[key] = spec[key] | value if key == "model" else value
    bound = prompt_bound(Tokenizer.from_str(json.dumps(spec)), 512)
    assert bound.max_bytes == 0 and bound.reason
    bound.check("prompt", "x" * 10_000_000)  # no bound: nothing refused by size


async def test_prompts_are_tokenized_in_the_pool_not_on_the_step_loop(stories_path):
    engine = AsyncEngine(make_engine(stories_path))
    threads: list[str] = []
    tokenize = engine.core.admission.prompt_token_ids

    def spy(req: GenerationRequest) -> list[int]:
        threads.append(threading.current_thread().name)
        return tokenize(req)

    engine.core.admission.prompt_token_ids = spy  # type: ignore[method-assign]
    try:
        outputs = [out async for out in engine.generate(GenerationRequest("t", greedy(3), text="Once"))]
        assert outputs[-1].finished
        with pytest.raises(InvalidRequestError):
            await asyncio.wait_for(
                engine.generate(GenerationRequest("big", greedy(3), text="x" * 10**6)).__anext__(), 10
            )
    finally:
        engine.shutdown()
    assert len(threads) == 2 and all(name.startswith("conduit-tokenize") for name in threads)
