"""IncrementalDetokenizer against the real Llama 2 tokenizer: exact text, byte runs, stop strings."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from conduit_engine.engine.detokenizer import DetokenizerDelta, IncrementalDetokenizer

pytestmark = pytest.mark.unit

FFFD = "\ufffd"
MULTIBYTE_TEXTS = ["中文字符的日本語한국어", "😀🎉👍🏽🇫🇷", "café naïve Ωμέγα ñ über façade", "€ ¿qué? ⅓ ∑ →"]
PROMPTS = ["", "Once upon a time", "Hello 中", "Hi!\n", "   spaces"]
SETTINGS = settings(
    max_examples=150,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)


@pytest.fixture(scope="module")
def tok(llama2_tokenizer_path) -> Tokenizer:
    return Tokenizer.from_file(str(llama2_tokenizer_path / "tokenizer.json"))


@pytest.fixture(scope="module")
def vocab(tok):
    """Token pools for the property tests, taken from the tokenizer itself."""
    byte_ids = [tok.token_to_id(f"<0x{b:02X}>") for b in range(256)]
    assert all(i is not None for i in byte_ids)
    curated = sorted({i for text in MULTIBYTE_TEXTS for i in tok.encode(text, add_special_tokens=False).ids})
    # Whole characters spelled as byte-fallback runs (2, 3 and 4 bytes), the way the model emits rare ones.
    runs = [[byte_ids[b] for b in ch.encode()] for ch in "é€中😀🎉ж"]
    prompts = [tok.encode(p).ids for p in PROMPTS] + [[], [1], [1, 29871]]
    return {"bytes": byte_ids, "curated": curated, "runs": runs, "prompts": prompts}


def text_ids(tok: Tokenizer, text: str) -> list[int]:
    """Pieces of " word word…" as a model emits them mid-text: "▁word" carries the space."""
    assert text.startswith(" ")
    return tok.encode(text[1:], add_special_tokens=False).ids  # SentencePiece prepends the "▁" itself


def reference(tok: Tokenizer, prompt: Sequence[int], out: Sequence[int], skip: bool) -> str:
    """What the output adds to the prompt's text, by whole decodes (independent of the implementation)."""
    specials = {0, 1, 2}
    context = [i for i in prompt if i not in specials]
    while context and tok.id_to_token(context[-1]).startswith("<0x"):
        context.pop()  # a trailing prompt byte run is not context: its bytes would merge with the output's
    if not context:
        return tok.decode(list(out), skip_special_tokens=skip)
    before = tok.decode(context, skip_special_tokens=skip)
    full = tok.decode(context + list(out), skip_special_tokens=skip)
    assert full.startswith(before)
    return full[len(before) :]


def run(tok, prompt, out, *, skip=True, stop=(), include=False, finish=True):
    detok = IncrementalDetokenizer(
        tok, prompt, skip_special_tokens=skip, stop=stop, include_stop_str_in_output=include
    )
    deltas = [detok.step([t]) for t in out]
    tail = detok.finish() if finish else None
    return detok, deltas, tail


def token_lists(data, vocab, max_chunks: int = 24) -> list[int]:
    token = st.one_of(
        st.integers(0, 31999), st.sampled_from(vocab["bytes"]), st.sampled_from(vocab["curated"])
    )
    chunk = st.one_of(token.map(lambda t: [t]), st.sampled_from(vocab["runs"]))
    return [t for c in data.draw(st.lists(chunk, max_size=max_chunks)) for t in c]


# ----- properties ------------------------------------------------------------------------------------


@SETTINGS
@given(data=st.data())
def test_every_prefix_decodes_exactly(tok, vocab, data):
    out = token_lists(data, vocab)
    prompt = data.draw(st.sampled_from(vocab["prompts"]))
    skip = data.draw(st.booleans())
    expected = [reference(tok, prompt, out[:k], skip) for k in range(len(out) + 1)]
    final = expected[-1]

    # One stream: what is released after k tokens never changes in any longer output's decode.
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    released = ""
    for k, token_id in enumerate(out, start=1):
        delta = detok.step([token_id])
        assert delta.stop_string is None
        released += delta.text
        assert detok.output_text == released
        for j in range(k, len(out) + 1):
            assert expected[j].startswith(released), (k, j)
        # No U+FFFD is released where the final decode has a real character.
        assert all(final[i] == FFFD for i, ch in enumerate(released) if ch == FFFD)

    # Every prefix: released deltas + finish() is the whole decode of that prefix.
    for k in range(len(out) + 1):
        _, deltas, tail = run(tok, prompt, out[:k], skip=skip)
        assert "".join(d.text for d in deltas) + tail == expected[k], k


@SETTINGS
@given(data=st.data())
def test_empty_prompt_equals_plain_decode(tok, vocab, data):
    out = token_lists(data, vocab)
    skip = data.draw(st.booleans())
    for k in range(len(out) + 1):
        detok, deltas, tail = run(tok, [], out[:k], skip=skip)
        assert "".join(d.text for d in deltas) + tail == tok.decode(out[:k], skip_special_tokens=skip)
        assert detok.output_text == tok.decode(out[:k], skip_special_tokens=skip)


@SETTINGS
@given(data=st.data())
def test_stop_strings_cut_at_the_first_completed_match(tok, vocab, data):
    out = token_lists(data, vocab, max_chunks=16) + text_ids(tok, " and then the end")
    prompt = data.draw(st.sampled_from(vocab["prompts"]))
    full = reference(tok, prompt, out, True)
    # Stop strings taken from the text (so they do match, often across tokens) plus one that may not.
    stops = []
    for _ in range(data.draw(st.integers(1, 3))):
        start = data.draw(st.integers(0, len(full) - 1))
        stops.append(full[start : start + data.draw(st.integers(1, 6))])
    stops.append(data.draw(st.text(min_size=1, max_size=4)))
    include = data.draw(st.booleans())

    detok = IncrementalDetokenizer(
        tok, prompt, skip_special_tokens=True, stop=stops, include_stop_str_in_output=include
    )
    texts, matched = [], None
    for token_id in out:
        delta = detok.step([token_id])
        texts.append(delta.text)
        if delta.stop_string is not None:
            matched = delta.stop_string
            break
    texts.append(detok.finish())

    ends = [(full.find(s) + len(s), full.find(s), s) for s in stops if s in full]
    end, start, stop = min(ends, key=lambda e: e[:2])
    assert matched == stop or (matched is None and detok.stop_string == stop)
    assert "".join(texts) == full[: end if include else start]
    assert detok.output_text == "".join(texts)


def byte_level_tokenizer() -> Tokenizer:
    """A GPT-2 style byte-level tokenizer (one token per byte, 3 specials): the other decoder family."""
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    return tok


@SETTINGS
@given(data=st.data())
def test_byte_level_tokenizer_every_prefix(data):
    tok = byte_level_tokenizer()
    utf8 = [tok.encode(ch, add_special_tokens=False).ids for ch in "é中😀a "]
    chunk = st.one_of(st.integers(0, tok.get_vocab_size() - 1).map(lambda t: [t]), st.sampled_from(utf8))
    out = [t for c in data.draw(st.lists(chunk, max_size=20)) for t in c]
    skip = data.draw(st.booleans())
    expected = [tok.decode(out[:k], skip_special_tokens=skip) for k in range(len(out) + 1)]
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=skip)
    released = ""
    for k, token_id in enumerate(out, start=1):
        released += detok.step([token_id]).text
        assert all(e.startswith(released) for e in expected[k:]), k
    for k in range(len(out) + 1):
        _, deltas, tail = run(tok, [], out[:k], skip=skip)
        assert "".join(d.text for d in deltas) + tail == expected[k], k


# ----- explicit cases --------------------------------------------------------------------------------


def test_emoji_split_across_byte_tokens(tok):
    emoji = [tok.token_to_id(f"<0x{b:02X}>") for b in "😀".encode()]
    out = text_ids(tok, " hi") + emoji + text_ids(tok, " there")
    _, deltas, tail = run(tok, [1], out)
    # The four bytes release nothing until a non-byte token ends the run.
    assert [d.text for d in deltas] == ["hi", "", "", "", "", "😀 there"]
    assert tail == ""
    # Cut inside the run: finish() gives what decode gives, replacement characters included.
    _, deltas, tail = run(tok, [1], out[:3])
    assert "".join(d.text for d in deltas) == "hi"
    assert tail == FFFD * 2 == tok.decode(emoji[:2])[-2:]
    # An emoji followed by a stray continuation byte decodes as five U+FFFD: nothing was released early.
    stray = out[:5] + [tok.token_to_id("<0x80>")]
    _, deltas, tail = run(tok, [1], stray)
    assert "".join(d.text for d in deltas) + tail == "hi" + FFFD * 5 == tok.decode(stray)


def test_cjk_and_accented_pieces(tok):
    prompt = tok.encode("Say").ids
    out = text_ids(tok, " 中文字符 café")
    detok, deltas, tail = run(tok, prompt, out)
    assert "".join(d.text for d in deltas) + tail == " 中文字符 café"
    assert detok.output_text == " 中文字符 café"
    assert all(FFFD not in d.text for d in deltas)


def test_leading_space_kept_with_prompt_context(tok):
    prompt = tok.encode("Once upon a time").ids
    out = text_ids(tok, " there was")
    _, deltas, _ = run(tok, prompt, out)
    assert [d.text for d in deltas] == [" there", " was"]
    # Without prompt text (empty or only BOS) the output reads as decode(output): no leading space.
    for bare in ([], [1]):
        for skip in (True, False):
            _, deltas, tail = run(tok, bare, out, skip=skip)
            assert "".join(d.text for d in deltas) + tail == "there was"
    # A lone "▁" piece first: its space is part of the text of what follows it.
    _, deltas, tail = run(tok, prompt, [29871, *text_ids(tok, " x")])
    assert "".join(d.text for d in deltas) + tail == "  x"


def test_special_tokens_skipped_or_kept(tok):
    prompt = tok.encode("Hi").ids
    out = [*text_ids(tok, " Hello"), 2, *text_ids(tok, " world"), 1]
    _, deltas, tail = run(tok, prompt, out, skip=True)
    assert [d.text for d in deltas] + [tail] == [" Hello", "", " world", "", ""]
    _, deltas, tail = run(tok, prompt, out, skip=False)
    assert "".join(d.text for d in deltas) + tail == " Hello</s> world<s>"
    assert deltas[1].text == "</s>"


def test_skipped_special_token_inside_a_byte_run(tok):
    # decode() drops skipped specials before decoding, so the bytes around one still form a character.
    zh = [tok.token_to_id(f"<0x{b:02X}>") for b in "中".encode()]
    out = [*text_ids(tok, " a"), zh[0], 2, *zh[1:], *text_ids(tok, " b")]
    for skip in (True, False):
        _, deltas, tail = run(tok, [], out, skip=skip)
        assert "".join(d.text for d in deltas) + tail == tok.decode(out, skip_special_tokens=skip)
    assert tok.decode(out, skip_special_tokens=True) == "a中 b"


def test_stop_string_split_across_two_tokens(tok):
    prompt = tok.encode("Once upon a time").ids
    out = text_ids(tok, " there was a little girl")  # ▁there ▁was ▁a ▁little ▁girl
    detok, deltas, tail = run(tok, prompt, out, stop=["re wa"])
    # "re" is held until " was" completes the match; later tokens are ignored.
    assert [d.text for d in deltas] == [" the", "", "", "", ""]
    assert deltas[1].stop_string == "re wa"
    assert tail == ""
    assert detok.output_text == " the"
    assert detok.stop_string == "re wa"


def test_stop_string_split_across_three_tokens(tok):
    prompt = tok.encode("Once upon a time").ids
    out = text_ids(tok, " there was a little girl")
    detok, deltas, _ = run(tok, prompt, out, stop=["ere was a l"])
    assert [d.stop_string for d in deltas[:4]] == [None, None, None, "ere was a l"]
    assert detok.output_text == " th"


def test_stop_string_at_the_start(tok):
    prompt = tok.encode("Once upon a time").ids
    out = text_ids(tok, " there was")
    detok, deltas, tail = run(tok, prompt, out, stop=[" there"])
    assert deltas[0] == DetokenizerDelta("", " there")
    assert deltas[1] == DetokenizerDelta("", None)  # tokens after a stop are ignored
    assert tail == "" and detok.output_text == ""
    detok, deltas, _ = run(tok, prompt, out, stop=[" there"], include=True)
    assert deltas[0] == DetokenizerDelta(" there", " there")
    assert detok.output_text == " there"


def test_overlapping_stop_strings_first_completed_wins(tok):
    prompt = tok.encode("Once upon a time").ids
    out = text_ids(tok, " there was a little girl")
    # "was a" completes before "a little" although both cover the "a".
    detok, _, _ = run(tok, prompt, out, stop=["a little", "was a"])
    assert (detok.stop_string, detok.output_text) == ("was a", " there ")
    # One inside the other: "here" completes first, inside " there was".
    detok, _, _ = run(tok, prompt, out, stop=["there was", "here"])
    assert (detok.stop_string, detok.output_text) == ("here", " t")
    # Same end: the longer (earlier-starting) one.
    detok, _, _ = run(tok, prompt, out, stop=["s a", "was a"], include=True)
    assert (detok.stop_string, detok.output_text) == ("was a", " there was a")


def test_include_stop_str_cuts_inside_a_token(tok):
    prompt = tok.encode("Once upon a time").ids
    out = text_ids(tok, " there was a little girl")
    detok, deltas, _ = run(tok, prompt, out, stop=["re wa"], include=True)
    assert [d.text for d in deltas[:2]] == [" the", "re wa"]  # the "s" of "▁was" is cut
    assert detok.output_text == " there wa"


def test_text_held_only_while_it_can_begin_a_stop(tok):
    prompt = tok.encode("Once upon a time").ids
    out = text_ids(tok, " there was a little")
    _, deltas, tail = run(tok, prompt, out, stop=["xyz"])
    assert [d.text for d in deltas] == [" there", " was", " a", " little"]
    _, deltas, tail = run(tok, prompt, out, stop=["ere!"])
    assert [d.text for d in deltas] + [tail] == [" th", "ere was", " a", " littl", "e"]
    # finish() releases a held partial match.
    _, deltas, tail = run(tok, prompt, out, stop=["little!"])
    assert [d.text for d in deltas] + [tail] == [" there", " was", " a", " ", "little"]


def test_stop_string_completed_by_a_byte_run(tok):
    emoji = [tok.token_to_id(f"<0x{b:02X}>") for b in "😀".encode()]
    out = text_ids(tok, " ok") + emoji + text_ids(tok, " more")
    detok, deltas, _ = run(tok, [1], out, stop=["k😀"])
    assert detok.stop_string == "k😀"
    assert deltas[-1].stop_string == "k😀"  # known once " more" ends the byte run
    assert detok.output_text == "o"
    # Ending inside the run: finish() still applies the stop string to the final text.
    detok, _, tail = run(tok, [1], out[:5], stop=["k😀"])
    assert tail == "" and detok.output_text == "o" and detok.stop_string == "k😀"


def test_decode_window_stays_small(tok):
    """Each step decodes a few tokens, not the whole output (O(window), not O(length))."""

    class CountingTokenizer:
        def __init__(self, inner: Tokenizer) -> None:
            self.inner = inner
            self.longest = 0

        def decode(self, ids, skip_special_tokens=True):
            self.longest = max(self.longest, len(ids))
            return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)

        def token_to_id(self, token):
            return self.inner.token_to_id(token)

        def get_added_tokens_decoder(self):
            return self.inner.get_added_tokens_decoder()

    counting = CountingTokenizer(tok)
    out = text_ids(tok, " the little girl 中文 café played😀 in the park." * 100)
    detok = IncrementalDetokenizer(counting, tok.encode("Once").ids, skip_special_tokens=True, stop=["zzz"])
    for token_id in out:
        detok.step([token_id])
    detok.finish()
    assert len(out) > 1000
    assert counting.longest <= 12
    assert detok.output_text == reference(tok, tok.encode("Once").ids, out, True)


def test_multi_token_steps_and_finish_contract(tok):
    prompt = tok.encode("Once upon a time").ids
    out = text_ids(tok, " there was a little girl")
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=True)
    assert detok.step(out[:3]).text == " there was a"
    assert detok.step([]).text == ""
    assert detok.step(out[3:]).text == " little girl"
    assert detok.finish() == ""
    assert detok.finish() == ""
    with pytest.raises(RuntimeError):
        detok.step(out[:1])
    with pytest.raises(ValueError, match="stop"):
        IncrementalDetokenizer(tok, prompt, skip_special_tokens=True, stop=[""])
