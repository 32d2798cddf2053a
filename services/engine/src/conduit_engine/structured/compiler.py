"""Compiles structured-output specs off the step loop, on a worker thread, cached by spec.

`StructuredCompiler.submit(spec)` returns a `concurrent.futures.Future` at once; the compile runs on
the compiler's own thread pool (the backend releases the GIL while compiling, so the step thread keeps
running). Futures are cached by `spec.cache_key` in a bounded LRU, so concurrent requests with one spec
share one compile and later ones get the same `CompiledStructure` object; a failed compile is not kept.
A spec that does not compile fails its future with `InvalidRequestError` naming the request field and
the backend's reason (→ INVALID_ARGUMENT); so does a JSON schema using a keyword the backend would
silently ignore (`schema_support`), one with no finite instance (`schema_instances`: a required `$ref`
cycle), and any spec whose compiled grammar lets no token begin the output (`{"$ref": "#"}`,
`root ::= root`): those compile, but every request with them would fail at its first token.

JSON whitespace: `any_whitespace=False` (the default) compiles with the backend's
`any_whitespace=False`, as vLLM's `disable_any_whitespace`: exactly one space after `,` and `:`, no
newlines or indentation, so a weak model cannot loop on whitespace; `any_whitespace=True` allows any
JSON whitespace between tokens. `json_object` is the schema `{"type": "object"}` under the same rule.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from conduit_common.schema_instances import infinite_instance_problem
from conduit_engine.errors import InvalidRequestError
from conduit_engine.structured.backend import reason
from conduit_engine.structured.backend import xgrammar as xgr
from conduit_engine.structured.schema_support import string_patterns, unenforced_keyword
from conduit_engine.structured.spec import StructuredKind, StructuredSpec
from conduit_engine.structured.state import GrammarState
from conduit_engine.structured.vocabulary import GrammarVocab

_JSON_OBJECT_SCHEMA = '{"type": "object"}'


@dataclass(frozen=True, eq=False)
class CompiledStructure:
    """A compiled grammar, shared by every sequence whose spec has the same cache key."""

    grammar: xgr.CompiledGrammar
    vocab: GrammarVocab

    def new_state(self, after: str | None = None) -> GrammarState:
        """A fresh per-sequence state; `after` is the spec's gate text (not part of the cache key)."""
        return GrammarState(self.grammar, self.vocab, after)


class StructuredCompiler:
    """cache_size: compiled structures kept (least recently used dropped first); workers: compile
    threads; backend_threads: threads the backend itself uses inside one compile."""

    def __init__(
        self, vocab: GrammarVocab, *, cache_size: int = 256, workers: int = 1, backend_threads: int = 1
    ) -> None:
        if cache_size < 1 or workers < 1 or backend_threads < 1:
            raise ValueError("cache_size, workers and backend_threads must be at least 1")
        self.vocab = vocab
        self.cache_size = cache_size
        # The backend's own cache stays off: one bounded cache, ours, keyed by the whole spec.
        self._backend = xgr.GrammarCompiler(vocab.info, max_threads=backend_threads, cache_enabled=False)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="conduit-grammar")
        self._cache: OrderedDict[str, Future[CompiledStructure]] = OrderedDict()
        self._lock = threading.Lock()

    def submit(self, spec: StructuredSpec) -> Future[CompiledStructure]:
        """The compiled structure of `spec`, now (cached) or later (compiling on a worker thread)."""
        key = spec.cache_key
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = self._pool.submit(self._compile, spec)
            self._cache[key] = future
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)  # waiters keep their future; only the cache forgets it
        future.add_done_callback(lambda done: self._forget_failure(key, done))
        return future

    async def compiled(self, spec: StructuredSpec) -> CompiledStructure:
        """`submit` for asyncio callers: awaits the compile without blocking the event loop. A caller
        cancelled while waiting (client gone) leaves the shared compile running for the others."""
        return await asyncio.shield(asyncio.wrap_future(self.submit(spec)))

    def cached(self, spec: StructuredSpec) -> bool:
        """Whether the cache holds (or is compiling) this spec."""
        with self._lock:
            return spec.cache_key in self._cache

    def shutdown(self) -> None:
        """Stop the worker threads once running compiles end; queued ones are cancelled."""
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _forget_failure(self, key: str, future: Future[CompiledStructure]) -> None:
        if future.cancelled() or future.exception() is not None:
            with self._lock:
                if self._cache.get(key) is future:
                    del self._cache[key]

    def _compile(self, spec: StructuredSpec) -> CompiledStructure:
        schema = json.loads(spec.text) if spec.kind is StructuredKind.JSON_SCHEMA else None
        if schema is not None:
            try:
                problem = unenforced_keyword(schema) or infinite_instance_problem(schema)
            except RecursionError:
                problem = "is nested too deeply"
            if problem is not None:
                raise InvalidRequestError(spec.field, problem)
        try:
            grammar = self._compile_grammar(spec)
        except (RuntimeError, ValueError) as exc:  # what xgrammar raises for a bad spec
            raise InvalidRequestError(spec.field, f"does not compile: {reason(exc)}") from None
        if not _can_start(grammar, self.vocab):
            hint = " (a $ref cycle that never reaches a value has no instance)" if spec.kind.is_json else ""
            raise InvalidRequestError(spec.field, f"admits no output: no token can begin it{hint}")
        if schema is not None:
            self._check_patterns(spec, schema)
        return CompiledStructure(grammar=grammar, vocab=self.vocab)

    def _check_patterns(self, spec: StructuredSpec, schema: object) -> None:
        """A string `pattern` no string can begin (`[^\\s\\S]`) would stop the output at its opening
        quote, mid-document: refused like a grammar no token can begin."""
        for path, pattern in string_patterns(schema):
            try:
                grammar = self._backend.compile_regex(pattern)
            except (RuntimeError, ValueError):
                continue  # the schema compiled, so the backend read the pattern its own way
            if not _can_start(grammar, self.vocab):
                raise InvalidRequestError(spec.field, f"pattern {pattern!r} (at {path}) matches no string")

    def _compile_grammar(self, spec: StructuredSpec) -> xgr.CompiledGrammar:
        kind = spec.kind
        if kind.is_json:
            schema = spec.text if kind is StructuredKind.JSON_SCHEMA else _JSON_OBJECT_SCHEMA
            return self._backend.compile_json_schema(schema, any_whitespace=spec.any_whitespace)
        if kind is StructuredKind.REGEX:
            return self._backend.compile_regex(spec.text)
        if kind is StructuredKind.CHOICE:
            return self._backend.compile_grammar(choice_grammar(spec.choices))
        return self._backend.compile_grammar(spec.text)


def _can_start(grammar: xgr.CompiledGrammar, vocab: GrammarVocab) -> bool:
    """Whether some token (EOS included, where the grammar takes the empty output) may come first. A
    grammar whose start allows none (`root ::= root`, a JSON schema `{"$ref": "#"}`) compiles, but every
    request with it would fail at its first token."""
    matcher = xgr.GrammarMatcher(grammar)
    row = torch.zeros((1, vocab.words), dtype=torch.int32)
    matcher.fill_next_token_bitmask(row)
    return matcher.is_completed() or bool(row.any())


def choice_grammar(choices: tuple[str, ...]) -> str:
    """An EBNF grammar matching exactly one of `choices`. JSON string escapes are valid EBNF string
    literal escapes in xgrammar's dialect, so any text (quotes, backslashes, newlines) is safe."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
