"""Admission: every check a request must pass before it is queued, each made once, when it arrives.

Prompt text is measured before it is tokenized (models/prompt_bound.py): a text that cannot fit the
context is refused at once, whatever its size. `prompt_token_ids` (the tokenization) is thread-safe:
AsyncEngine runs it in its tokenizer pool, off the step loop, and hands the ids to `admit`.

After admission nothing a request carries can fail a step: the prompt and every token id the request
names lie inside the model's vocabulary, max_tokens has its resolved value, and prompt + max_tokens fit
the context and the cache. Each failure raises an EngineError subclass whose message names the field.

Defaults are decided here and nowhere else, on a copy of the request's parameters: the fields the
request left unset take the model's generation defaults (generation_defaults.py), and max_tokens its
default by the kind of input.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Container
from dataclasses import dataclass

from conduit_common.prompt_size import context_message
from conduit_engine.config import SchedulerConfig
from conduit_engine.core.scheduler import Scheduler
from conduit_engine.engine.request import GenerationRequest
from conduit_engine.errors import DuplicateRequestError, InvalidRequestError, QueueFullError
from conduit_engine.models.generation_defaults import GenerationDefaults
from conduit_engine.models.prompt_bound import PromptBound
from conduit_engine.models.tokenizer import ModelTokenizer
from conduit_engine.sampling_params import SamplingParams

# OpenAI's default for completions; chat requests default to "until the context is full".
DEFAULT_MAX_TOKENS = 16


@dataclass(frozen=True, slots=True)
class AdmittedRequest:
    """A validated request: its prompt ids and its parameters with every default resolved."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams  # a copy; the caller's object is never changed
    priority: int


@dataclass(frozen=True, slots=True)
class Limits:
    """The engine's fixed capacities that a request is checked against."""

    vocab_size: int
    max_model_len: int
    num_blocks: int
    block_size: int


class Admission:
    def __init__(
        self,
        tokenizer: ModelTokenizer,
        limits: Limits,
        scheduler: Scheduler,
        config: SchedulerConfig,
        defaults: GenerationDefaults | None = None,
        bound: PromptBound | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.bound = bound or PromptBound(1, limits.max_model_len, 0, reason="none given")
        self.defaults = defaults or GenerationDefaults()
        self.limits = limits
        self.scheduler = scheduler
        self.config = config
        self.max_total_tokens = self._max_total_tokens()

    def _blocks_for(self, total_tokens: int) -> int:
        """KV blocks a sequence of `total_tokens` holds at its peak (fewer with a sliding window)."""
        return self.scheduler.block_manager.blocks_for_sequence(
            total_tokens, self.config.max_num_batched_tokens
        )

    def _max_total_tokens(self) -> int:
        """The most tokens one sequence can ever hold: the context, or what the cache holds if less."""
        limits = self.limits
        if self._blocks_for(limits.max_model_len) <= limits.num_blocks:
            return limits.max_model_len
        return min(limits.max_model_len, limits.num_blocks * limits.block_size)

    def admit(
        self, req: GenerationRequest, live_request_ids: Container[str], prompt: list[int] | None = None
    ) -> AdmittedRequest:
        """Validate `req`; raises InvalidRequestError, DuplicateRequestError or QueueFullError.

        `prompt`: the ids `prompt_token_ids(req)` gave, when the caller tokenized off the step loop."""
        if req.request_id in live_request_ids:
            raise DuplicateRequestError("request_id", f"request {req.request_id!r} is already running")
        req.params.validate(vocab_size=self.limits.vocab_size)
        if prompt is None:
            prompt = self.prompt_token_ids(req)
        params = req.params.with_defaults(self.defaults.sampling)
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = self._default_max_tokens(req.messages is not None, len(prompt))
        self._check_fits(len(prompt), max_tokens)
        self._check_queue(req.num_choices)
        params = dataclasses.replace(params, max_tokens=max_tokens)
        return AdmittedRequest(req.request_id, prompt, params, req.priority)

    def _default_max_tokens(self, is_chat: bool, prompt_len: int) -> int:
        """The model's max_new_tokens, else OpenAI's 16 for completions and the rest of the context for
        chat; never more than the context has left."""
        left = max(1, self.max_total_tokens - prompt_len)
        if self.defaults.max_tokens is not None:
            return min(self.defaults.max_tokens, left)
        return left if is_chat else DEFAULT_MAX_TOKENS

    def prompt_token_ids(self, req: GenerationRequest) -> list[int]:
        """Tokenize the one input of `req` (text over the byte bound is refused first, untokenized) and
        check every id against the model's vocabulary."""
        given = [name for name in ("text", "token_ids", "messages") if getattr(req, name) is not None]
        if len(given) != 1:
            raise InvalidRequestError("input", "exactly one of text, token_ids or messages is required")
        if req.text is not None:
            field = "text"
            self.bound.check("prompt", req.text)
            ids = self.tokenizer.encode(req.text) if req.text else []
        elif req.messages is not None:
            field = "messages"
            text = self.tokenizer.render_chat(
                req.messages, req.add_generation_prompt, req.tools, req.documents
            )
            self.bound.check("prompt", text)
            # As transformers' apply_chat_template: the template places special tokens itself.
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        else:
            field = "token_ids"
            ids = list(req.token_ids or [])
            if len(ids) >= self.limits.max_model_len:
                self._check_fits(len(ids), 0)  # the context error, before any id is looked at
        if not ids:
            raise InvalidRequestError(field, "prompt must not be empty")
        vocab = self.limits.vocab_size
        bad = next((i for i in ids if not 0 <= i < vocab), None)
        if bad is not None:
            # A tokenizer can know more tokens than the model has embeddings for.
            raise InvalidRequestError(field, f"token id {bad} is outside the vocabulary [0, {vocab})")
        return ids

    def _check_fits(self, prompt_len: int, max_tokens: int) -> None:
        limits = self.limits
        if prompt_len >= limits.max_model_len:
            raise InvalidRequestError("prompt", context_message(prompt_len, limits.max_model_len))
        total = prompt_len + max_tokens
        if total > limits.max_model_len:
            raise InvalidRequestError(
                "max_tokens",
                f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) = {total} exceeds the "
                f"model's context of {limits.max_model_len} tokens",
            )
        blocks = self._blocks_for(total)
        if blocks > limits.num_blocks:
            raise InvalidRequestError(
                "max_tokens",
                f"prompt + max_tokens needs {blocks} KV blocks but the cache has {limits.num_blocks}",
            )

    def _check_queue(self, num_new: int) -> None:
        # Sequences that can join the batch at the next step do not count as queued.
        free_slots = max(0, self.config.max_num_seqs - self.scheduler.num_running)
        if self.scheduler.num_waiting + num_new > self.config.max_queued_requests + free_slots:
            raise QueueFullError(
                f"the waiting queue is full ({self.config.max_queued_requests} queued requests); retry later"
            )
