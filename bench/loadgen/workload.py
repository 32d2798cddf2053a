"""Synthetic workloads: seeded length distributions and prompts of about the asked token length.

A length is given as a spec string:

    128 | fixed:128            always 128
    uniform:16,256            integers in [16, 256]
    normal:128,32[,LO,HI]     rounded, clipped to [LO, HI] (default [1, mean + 4 std])
    lognormal:128,0.5[,LO,HI] median 128, sigma 0.5 of the log, rounded, clipped (default [1, 8 x median])

Prompts are windows of real English text (the Python reference manual that every CPython ships in
pydoc_data), so tokenizers split them as they split user text. With a tokenizer.json the window is cut to
the exact token count (including the BOS token the server adds); without one, words stand in for tokens
at 0.75 word per token, the usual ratio of Llama-family vocabularies on English.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

WORDS_PER_TOKEN = 0.75
KINDS = ("fixed", "uniform", "normal", "lognormal")


@dataclass(frozen=True)
class LengthDist:
    """A distribution of positive integer lengths; `sample` is reproducible for one random.Random seed."""

    kind: str
    a: float
    b: float = 0.0
    lo: int = 1
    hi: int = 0

    @classmethod
    def parse(cls, spec: str) -> LengthDist:
        kind, _, rest = spec.partition(":") if ":" in spec else ("fixed", "", spec)
        if kind not in KINDS:
            raise ValueError(f"length spec {spec!r}: kind must be one of {', '.join(KINDS)}")
        try:
            args = [float(x) for x in rest.split(",")]
        except ValueError:
            raise ValueError(f"length spec {spec!r}: arguments must be numbers") from None
        wanted = {"fixed": (1,), "uniform": (2,), "normal": (2, 4), "lognormal": (2, 4)}[kind]
        if len(args) not in wanted:
            raise ValueError(f"length spec {spec!r}: {kind} takes {' or '.join(map(str, wanted))} numbers")
        if kind == "fixed":
            dist = cls(kind, args[0], lo=int(args[0]), hi=int(args[0]))
        elif kind == "uniform":
            dist = cls(kind, args[0], args[1], lo=int(args[0]), hi=int(args[1]))
        else:
            default_hi = args[0] + 4 * args[1] if kind == "normal" else 8 * args[0]
            lo, hi = (args[2], args[3]) if len(args) == 4 else (1, default_hi)
            dist = cls(kind, args[0], args[1], lo=int(lo), hi=int(hi))
        if dist.lo < 1 or dist.hi < dist.lo or dist.a <= 0 or dist.b < 0:
            raise ValueError(f"length spec {spec!r}: lengths must be >= 1 with LO <= HI, spreads >= 0")
        return dist

    def sample(self, n: int, rng: random.Random) -> list[int]:
        return [self._one(rng) for _ in range(n)]

    def _one(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return self.lo
        if self.kind == "uniform":
            return rng.randint(self.lo, self.hi)
        if self.kind == "normal":
            value = rng.gauss(self.a, self.b)
        else:
            value = math.exp(rng.gauss(math.log(self.a), self.b))
        return min(self.hi, max(self.lo, round(value)))

    def describe(self) -> str:
        if self.kind == "fixed":
            return str(self.lo)
        if self.kind == "uniform":
            return f"uniform[{self.lo},{self.hi}]"
        return f"{self.kind}({self.a:g},{self.b:g}) in [{self.lo},{self.hi}]"


@dataclass(frozen=True)
class RequestSpec:
    """One request of a workload: its prompt text, its prompt tokens if known, and its max_tokens."""

    prompt: str
    prompt_tokens: int | None
    max_tokens: int


@cache
def corpus_text() -> str:
    """English prose from the Python reference manual, with rule lines and runs of spaces removed."""
    from pydoc_data.topics import topics

    text = " ".join(topics[key] for key in sorted(topics))
    text = re.sub(r"[*=\-^~]{3,}", " ", text)
    return re.sub(r"\s+", " ", text).strip()


class PromptBuilder:
    """Cuts prompts out of the corpus at seeded random offsets, so requests share no prefix."""

    def __init__(self, tokenizer_path: Path | None = None, corpus: str | None = None) -> None:
        self._text = corpus if corpus is not None else corpus_text()
        self._tokenizer = None
        if tokenizer_path is not None:
            from tokenizers import Tokenizer

            path = tokenizer_path / "tokenizer.json" if tokenizer_path.is_dir() else tokenizer_path
            self._tokenizer = Tokenizer.from_file(str(path))
            self._ids = self._tokenizer.encode(self._text, add_special_tokens=False).ids
            self._specials = len(self._tokenizer.encode("").ids)  # BOS and the like, added by the server
        else:
            self._words = self._text.split(" ")

    def build(self, length: int, rng: random.Random) -> tuple[str, int | None]:
        """A prompt of `length` tokens (exact with a tokenizer, else about) and its token count if known.

        A prompt has at least one token of text: asking for no more than the tokenizer's special tokens
        gives one token more."""
        if self._tokenizer is None:
            words = max(1, round(length * WORDS_PER_TOKEN))
            start = rng.randrange(0, max(1, len(self._words) - words))
            return " ".join(self._words[start : start + words]), None
        content = max(1, length - self._specials)
        if content > len(self._ids):
            raise ValueError(f"prompt length {length}: longer than the corpus ({len(self._ids)} tokens)")
        start = rng.randrange(0, len(self._ids) - content + 1)
        # Decoding a window and encoding it again may merge or split a token at its edges: correct the
        # window's width once, then slide it a token on, until the count is exact (or keep the closest).
        best: tuple[str, int] | None = None
        for shift in range(16):
            first = min(start + shift, len(self._ids) - content)
            width = content
            for _ in range(2):
                text = self._tokenizer.decode(self._ids[first : first + width]).strip()
                count = len(self._tokenizer.encode(text).ids)
                if count == length:
                    return text, count
                if best is None or abs(count - length) < abs(best[1] - length):
                    best = (text, count)
                width = max(1, min(width + length - count, len(self._ids) - first))
        assert best is not None
        return best

    def workload(
        self, n: int, prompt_len: LengthDist, output_len: LengthDist, seed: int
    ) -> list[RequestSpec]:
        """`n` requests; the same seed and distributions give the same prompts and lengths."""
        rng = random.Random(seed)
        prompt_lens = prompt_len.sample(n, rng)
        output_lens = output_len.sample(n, rng)
        specs = []
        for plen, olen in zip(prompt_lens, output_lens, strict=True):
            text, tokens = self.build(plen, rng)
            specs.append(RequestSpec(text, tokens, olen))
        return specs
