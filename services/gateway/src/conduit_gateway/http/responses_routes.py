"""The Responses API endpoints: create, retrieve (or resume its event stream), delete, cancel and the
listing of a response's input items."""

from __future__ import annotations

import asyncio
from typing import Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response

from conduit_gateway.errors import OpenAIError, invalid_param
from conduit_gateway.handlers.responses import ResponsesHandler, sse_stream
from conduit_gateway.http.request_body import GatewayRoute
from conduit_gateway.http.routes import _api_key, _ctx, _until_disconnect
from conduit_gateway.http.sse import EventStreamResponse
from conduit_gateway.responses.service import ResponsesService
from conduit_gateway.responses.store import (
    TERMINAL_STATUSES,
    StoredResponse,
    StoreUnavailable,
    unavailable_error,
)
from conduit_gateway.schemas.common import error_responses
from conduit_gateway.schemas.responses import ResponsesRequest

router = APIRouter(route_class=GatewayRoute)

# How long POST /cancel waits for the running replica to record the cancellation.
_CANCEL_WAIT_S = 30.0
_SSE = {"text/event-stream": {"schema": {"type": "string", "description": "event: TYPE / data: {json}"}}}


def _service(request: Request) -> ResponsesService:
    return request.app.state.responses


def _not_found(response_id: str) -> OpenAIError:
    return OpenAIError(
        404, f"Response with id '{response_id}' not found.", param="response_id", code="not_found"
    )


async def _record(request: Request, response_id: str) -> StoredResponse:
    service = _service(request)
    if service.store is None:
        raise OpenAIError(
            404, "This gateway runs without a response store (--response-store none).", code="not_found"
        )
    key = getattr(request.state, "api_key", None)
    try:
        record = await service.get(response_id, key.name if key is not None else None)
    except StoreUnavailable as exc:
        raise unavailable_error(str(exc)) from None
    if record is None:
        raise _not_found(response_id)
    return record


@router.post(
    "/v1/responses",
    responses={200: {"content": _SSE, "description": "With stream: Responses events."}}
    | error_responses(400, 401, 404, 413, 429, 503),
)
async def create_response(body: ResponsesRequest, request: Request) -> Response:
    handler = ResponsesHandler(
        _ctx(request), _service(request), body, request.state.request_id, _api_key(request)
    )
    if body.background:
        return await handler.handle()  # runs on after the client leaves
    return await _until_disconnect(request, handler.handle())


@router.post("/v1/responses/input_tokens", responses=error_responses(400, 401, 404, 503))
async def count_input_tokens(body: ResponsesRequest, request: Request) -> Response:
    handler = ResponsesHandler(
        _ctx(request), _service(request), body, request.state.request_id, _api_key(request)
    )
    return await handler.count_input_tokens()


@router.get("/v1/responses/{response_id}", responses=error_responses(400, 401, 404, 503))
async def retrieve_response(
    response_id: str,
    request: Request,
    stream: bool = False,
    starting_after: int | None = None,
    include: list[str] | None = Query(None, alias="include[]"),
) -> Response:
    record = await _record(request, response_id)
    if not stream:
        if starting_after is not None:
            raise invalid_param("starting_after", "only allowed with stream=true")
        return JSONResponse(record.response)
    if not record.response.get("background"):
        raise invalid_param("stream", "only responses created with background=true can be streamed again")
    after = -1 if starting_after is None else starting_after
    return EventStreamResponse(sse_stream(_service(request).follow(response_id, after)))


@router.delete("/v1/responses/{response_id}", responses=error_responses(401, 404, 503))
async def delete_response(response_id: str, request: Request) -> JSONResponse:
    await _record(request, response_id)
    try:
        await _service(request).delete(response_id)
    except StoreUnavailable as exc:
        raise unavailable_error(str(exc)) from None
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})


@router.post("/v1/responses/{response_id}/cancel", responses=error_responses(400, 401, 404, 503))
async def cancel_response(response_id: str, request: Request) -> JSONResponse:
    record = await _record(request, response_id)
    if not record.response.get("background"):
        raise invalid_param("response_id", "only responses created with background=true can be cancelled")
    if record.response["status"] in TERMINAL_STATUSES:
        return JSONResponse(record.response)
    service = _service(request)
    try:
        if not await service.request_cancel(record):
            # No replica runs it any more (its gateway went away): record the cancellation here.
            record.response["status"] = "cancelled"
            await service.put(record)
            return JSONResponse(record.response)
        async with asyncio.timeout(_CANCEL_WAIT_S):
            async for _ in service.follow(response_id, 1 << 62):
                pass
        record = await _record(request, response_id)
    except StoreUnavailable as exc:
        raise unavailable_error(str(exc)) from None
    except TimeoutError:
        raise OpenAIError(
            504, "The response did not stop in time; retry the cancel.", type="server_error", code="timeout"
        ) from None
    return JSONResponse(record.response)


@router.get("/v1/responses/{response_id}/input_items", responses=error_responses(400, 401, 404, 503))
async def list_input_items(
    response_id: str,
    request: Request,
    limit: int = 20,
    order: Literal["asc", "desc"] = "desc",
    after: str | None = None,
    before: str | None = None,
    include: list[str] | None = Query(None, alias="include[]"),
) -> JSONResponse:
    if not 1 <= limit <= 100:
        raise invalid_param("limit", f"must be in [1, 100], got {limit}")
    record = await _record(request, response_id)
    items: list[dict[str, Any]] = list(record.input_items)
    if order == "desc":
        items.reverse()
    ids = [item["id"] for item in items]
    for name, cursor in (("after", after), ("before", before)):
        if cursor is not None and cursor not in ids:
            raise invalid_param(name, f"no input item {cursor!r} in response {response_id}")
    start = ids.index(after) + 1 if after is not None else 0
    end = ids.index(before) if before is not None else len(items)
    window = items[start:end]
    page = window[:limit]
    return JSONResponse(
        {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(window) > limit,
        }
    )
