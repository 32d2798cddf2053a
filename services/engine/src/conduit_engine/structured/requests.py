"""The engine's side of structured outputs: one grammar compiler, and the grammar state of each new choice.

The compiler (and with it the grammar backend, whose import costs seconds) is built on the first
constrained request, so an engine that never sees one never loads it. Compiling happens off the step
loop: `AsyncEngine` awaits `compile` before it submits the request, so a request waits for its grammar
without holding up the others; a direct caller of `LLMEngine.add_request` compiles synchronously.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

from tokenizers import Tokenizer

from conduit_engine.errors import InvalidRequestError
from conduit_engine.structured.spec import StructuredSpec

if TYPE_CHECKING:
    from conduit_engine.structured.compiler import CompiledStructure, StructuredCompiler
    from conduit_engine.structured.state import GrammarState

# How much of the prompt's end is read to see whether it already closes the `after` section (a chat
# template that renders an empty "<think>\n\n</think>" when thinking is off).
_PROMPT_TAIL_TOKENS = 32


class StructuredOutputs:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos_token_ids = tuple(eos_token_ids)
        self._compiler: StructuredCompiler | None = None
        self._lock = threading.Lock()

    @property
    def compiler(self) -> StructuredCompiler:
        with self._lock:
            if self._compiler is None:
                from conduit_engine.structured.compiler import StructuredCompiler
                from conduit_engine.structured.vocabulary import GrammarVocab

                try:
                    vocab = GrammarVocab.from_tokenizer(
                        self._tokenizer, self._vocab_size, self._eos_token_ids
                    )
                except ValueError as exc:
                    raise InvalidRequestError(
                        "sampling.structured", f"this model cannot take structured outputs: {exc}"
                    ) from exc
                self._compiler = StructuredCompiler(vocab)
            return self._compiler

    async def compile(self, spec: StructuredSpec) -> CompiledStructure:
        """The compiled structure, from the cache or a worker thread; raises InvalidRequestError naming
        the field when the spec does not compile."""
        return await self.compiler.compiled(spec)

    def compile_now(self, spec: StructuredSpec) -> CompiledStructure:
        return self.compiler.submit(spec).result()

    def states(
        self, spec: StructuredSpec, compiled: CompiledStructure, prompt: Sequence[int], n: int
    ) -> list[GrammarState]:
        """One fresh state per choice. When the prompt itself already ends with the `after` text, the
        structure applies from the first output token (the model will not write the tag again)."""
        after = spec.after
        if after and self._prompt_closes(prompt, after):
            after = None
        return [compiled.new_state(after) for _ in range(n)]

    def _prompt_closes(self, prompt: Sequence[int], after: str) -> bool:
        tail = self._tokenizer.decode(list(prompt[-_PROMPT_TAIL_TOKENS:]), skip_special_tokens=False)
        return tail.rstrip().endswith(after.strip())

    def shutdown(self) -> None:
        with self._lock:
            if self._compiler is not None:
                self._compiler.shutdown()
