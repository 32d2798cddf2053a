"""POST /v1/completions: prompts → GenerateRequest.text or .token_ids (one stream per prompt), choices shaped
as text completions with the legacy logprobs layout."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from conduit.engine.v1 import engine_pb2
from conduit_gateway.errors import invalid_param
from conduit_gateway.handlers import fields
from conduit_gateway.handlers.base import ChunkedHandler
from conduit_gateway.handlers.choices import (
    ChoiceState,
    UsageTotals,
    safe_logprob,
    token_offsets,
    token_text_json,
)
from conduit_gateway.handlers.sampling import sampling_params
from conduit_gateway.http.sse import RawJson, json_string
from conduit_gateway.prompt_limits import MAX_PROMPTS, PromptLimit, prompt_limit, prompt_param
from conduit_gateway.schemas.completions import (
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
)
from conduit_gateway.structured.constraints import request_constraint


class CompletionsHandler(ChunkedHandler):
    endpoint = "completions"
    id_prefix = "cmpl"
    chunk_object = "text_completion"
    body: CompletionRequest
    prompts: list[str | list[int]]  # set by build_inputs
    absent_prompt_logprobs = {"choices": {"__all__": {"prompt_logprobs"}}}

    def build_inputs(self) -> list[engine_pb2.GenerateRequest]:
        body = self.body
        if body.suffix:
            raise invalid_param("suffix", "is not supported by this server")
        if body.best_of is not None and body.best_of != self.n:
            raise invalid_param("best_of", f"must equal n ({self.n}): best-of sampling is not supported")
        self.prompts = self._prompts()
        self._check_prompts()
        # A lone prompt is named `prompt` in errors, one of a list `prompt[i]`.
        single = isinstance(body.prompt, str) or _is_token_list(body.prompt)
        requests = [
            _request("prompt" if single else f"prompt[{index}]", prompt)
            for index, prompt in enumerate(self.prompts)
        ]
        if body.echo:
            if body.logprobs is not None:
                raise invalid_param("echo", "cannot be combined with logprobs on this server")
            if not all(isinstance(prompt, str) for prompt in self.prompts):
                raise invalid_param("echo", "is only supported for string prompts")
        return requests

    def check_prompt_sizes(self, limit: PromptLimit, requests: list[engine_pb2.GenerateRequest]) -> None:
        """Done by build_inputs, on the prompts themselves, before any protobuf copies them."""

    def _check_prompts(self) -> None:
        limit = prompt_limit(self.ctx.pool, self.body.model)
        if limit is None:
            return
        for index, prompt in enumerate(self.prompts):
            param = prompt_param(index, len(self.prompts))
            if isinstance(prompt, str):
                limit.check_texts(param, (prompt,))
            else:
                limit.check_tokens(param, len(prompt))

    def _prompts(self) -> list[str | list[int]]:
        prompt = self.body.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise invalid_param("prompt", "must not be empty")
        if _is_token_list(prompt):
            return [prompt]  # type: ignore[list-item]
        if len(prompt) > MAX_PROMPTS:
            raise invalid_param("prompt", f"at most {MAX_PROMPTS} prompts per request, got {len(prompt)}")
        return list(prompt)  # type: ignore[arg-type]

    def build_sampling(self) -> engine_pb2.SamplingParams:
        params = sampling_params(
            self.body,
            max_tokens=("max_tokens", self.body.max_tokens),
            logprobs=("logprobs", self.body.logprobs),
        )
        self.constraint = request_constraint(self.body)
        if self.constraint is not None:
            self.constraint.apply(params)
        return params

    def param_aliases(self) -> dict[str, str]:
        return {"text": "prompt", "token_ids": "prompt", "input": "prompt"}

    def new_choice(self, index: int, prompt_index: int) -> ChoiceState:
        choice = ChoiceState(index)
        if self.body.echo:
            choice.prefix = str(self.prompts[prompt_index])
        return choice

    def delta_choice(
        self, choice: ChoiceState, text: str, logprobs: Sequence[engine_pb2.PositionLogprobs]
    ) -> RawJson:
        prefix = _unsent_prefix(choice)
        shaped = "null"
        if self.body.logprobs is not None:
            shaped = _logprobs_json(logprobs, choice.chars + len(prefix), text)
        text = prefix + text
        choice.chars += len(text)
        before, after = _text_parts(choice.index, shaped)
        return RawJson(f"{before}{json_string(text)}{after}")

    def text_delta(self, choice: ChoiceState) -> tuple[str, str] | None:
        # Once the echoed prompt is out and without logprobs (`chars` only counts for their offsets).
        if self.body.logprobs is not None or not choice.prefix_sent:
            return None
        return _text_parts(choice.index, "null")

    def finish_choice(self, choice: ChoiceState) -> dict[str, Any]:
        # A prompt echoed into a choice that produced no text at all still has to reach the client.
        text = _unsent_prefix(choice)
        return {"index": choice.index, "text": text, "logprobs": None, "finish_reason": choice.finish_reason}

    def response(self, choices: list[ChoiceState], usage: UsageTotals) -> Completion:
        return Completion(
            **self.response_fields(usage),
            choices=[
                CompletionChoice(
                    index=choice.index,
                    text=choice.text(),
                    logprobs=CompletionLogprobs.model_validate(_logprobs(choice.logprobs, choice.offsets))
                    if self.body.logprobs is not None
                    else None,
                    finish_reason=choice.finish_reason,
                    prompt_logprobs=self._prompt_logprobs(choice.index // self.n),
                )
                for choice in choices
            ],
        )


def _request(name: str, prompt: str | list[int]) -> engine_pb2.GenerateRequest:
    if isinstance(prompt, str):
        return engine_pb2.GenerateRequest(text=fields.text(name, prompt))
    return engine_pb2.GenerateRequest(token_ids=engine_pb2.TokenIds(ids=fields.token_ids(name, prompt)))


def _text_parts(index: int, logprobs_json: str) -> tuple[str, str]:
    """{"index", "text", "logprobs", "finish_reason": null}, written by hand: before and after the text."""
    return f'{{"index":{index},"text":', f',"logprobs":{logprobs_json},"finish_reason":null}}'


def _unsent_prefix(choice: ChoiceState) -> str:
    if choice.prefix_sent:
        return ""
    choice.prefix_sent = True
    return choice.prefix


def _is_token_list(prompt: object) -> bool:
    return isinstance(prompt, list) and bool(prompt) and all(isinstance(item, int) for item in prompt)


def _logprobs_json(logprobs: Sequence[engine_pb2.PositionLogprobs], start: int, text: str) -> str:
    """`json_value(_logprobs(logprobs, token_offsets(start, text, logprobs)))`, written by hand."""
    tokens: list[str] = []
    token_logprobs: list[str] = []
    top_logprobs: list[str] = []
    for position in logprobs:
        token = position.token
        tokens.append(token_text_json(token.text)[0])
        token_logprobs.append(float.__repr__(safe_logprob(token.logprob)))
        top = {alternative.text: alternative.logprob for alternative in position.top}
        top.setdefault(token.text, token.logprob)
        entries = [
            f"{token_text_json(key)[0]}:{float.__repr__(safe_logprob(value))}" for key, value in top.items()
        ]
        top_logprobs.append(f"{{{','.join(entries)}}}")
    offsets = ",".join(map(str, token_offsets(start, text, logprobs)))
    return (
        f'{{"tokens":[{",".join(tokens)}],"token_logprobs":[{",".join(token_logprobs)}],'
        f'"top_logprobs":[{",".join(top_logprobs)}],"text_offset":[{offsets}]}}'
    )


def _logprobs(logprobs: Sequence[engine_pb2.PositionLogprobs], offsets: Sequence[int]) -> dict[str, Any]:
    """The legacy layout: parallel lists, top alternatives as {text: logprob} including the chosen token."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    for position in logprobs:
        token = position.token
        tokens.append(token.text)
        token_logprobs.append(safe_logprob(token.logprob))
        top = {alternative.text: safe_logprob(alternative.logprob) for alternative in position.top}
        top.setdefault(token.text, safe_logprob(token.logprob))
        top_logprobs.append(top)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": list(offsets),
    }
