"""Chat tools on the request side: the definitions checked and serialized for the chat template
(ChatInput.tools_json), `tool_choice` resolved, and for `required` or a named function the JSON schema the
engine's grammar enforces so that the output is calls whose arguments validate.

The forced output is `{"name": ..., "arguments": {...}}`, or an array of at least one such object when
`required` allows parallel calls; `name` is an enum of the allowed tools and each tool's `arguments` is
its own parameters schema, its local `$ref`s re-pointed to where that schema now sits.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from conduit_gateway.errors import invalid_param
from conduit_gateway.handlers import fields
from conduit_gateway.schemas.structured import NamedToolChoice, ToolDefinition
from conduit_gateway.structured import validation
from conduit_gateway.structured.constraints import Constraint

# Arguments of a tool that declares no parameters: an object.
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """What a request's tools mean: `mode` is "none" (no calls parsed), "auto" (calls parsed from the
    text by --tool-call-parser) or "forced" (required or named: `constraint` makes the output calls)."""

    mode: str
    tools_json: str | None = None
    constraint: Constraint | None = None
    parallel: bool = True


def plan_tools(
    tools: list[ToolDefinition] | None,
    tool_choice: str | NamedToolChoice | None,
    parallel_tool_calls: bool | None,
    parser: str | None,
) -> ToolPlan:
    """Check the tool fields of a chat request; `parser` is the gateway's --tool-call-parser."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise invalid_param("tool_choice", "needs tools: the request defines none")
        return ToolPlan("none")
    names = _check_tools(tools)
    # Names and descriptions are free text: a lone surrogate (JSON carries it, protobuf cannot) is a 400.
    tools_json = fields.text(
        "tools", json.dumps([tool.model_dump(exclude_none=True) for tool in tools], ensure_ascii=False)
    )
    parallel = parallel_tool_calls is not False
    choice = tool_choice or "auto"
    if choice == "none":
        return ToolPlan("none", tools_json)
    if choice == "auto":
        if parser is None:
            raise invalid_param(
                "tool_choice",
                "'auto' needs a tool-call parser and this gateway runs without --tool-call-parser; "
                "use 'required', a named function or 'none'",
            )
        return ToolPlan("auto", tools_json, parallel=parallel)
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise invalid_param(
                "tool_choice",
                f"function {choice.function.name!r} is not one of the tools ({', '.join(names)})",
            )
        position = names.index(choice.function.name)
        schema = calls_schema([tools[position]], parallel=False)
    else:  # required
        position = 0 if len(tools) == 1 else None
        schema = calls_schema(tools, parallel=parallel)
    text = json.dumps(schema, ensure_ascii=False, separators=(",", ":"))
    validation.check_size("tools", text, "the tool-call schema built from the tools")
    # What the engine finds wrong with the forced schema is in a tool's parameters (the wrapper is ours):
    # with one tool in it, its errors name that tool's parameters.
    param = "tool_choice" if position is None else f"tools[{position}].function.parameters"
    return ToolPlan("forced", tools_json, Constraint(param, "json_schema", text), parallel)


def _check_tools(tools: list[ToolDefinition]) -> list[str]:
    names: list[str] = []
    for position, tool in enumerate(tools):
        where = f"tools[{position}].function"
        name = tool.function.name
        if not name:
            raise invalid_param(f"{where}.name", "must not be empty")
        if name in names:
            raise invalid_param(f"{where}.name", f"{name!r} is defined twice")
        names.append(name)
        if tool.function.parameters is not None:
            validation.check_json_schema(f"{where}.parameters", tool.function.parameters)
    return names


def calls_schema(tools: list[ToolDefinition], parallel: bool) -> dict[str, Any]:
    """The JSON schema of the forced output: one call, or an array of at least one when `parallel`."""
    at = "/items" if parallel else ""
    if len(tools) == 1:
        call = _call_schema(tools[0], f"{at}/properties/arguments")
    else:
        call = {
            "anyOf": [
                _call_schema(tool, f"{at}/anyOf/{position}/properties/arguments")
                for position, tool in enumerate(tools)
            ]
        }
    return {"type": "array", "minItems": 1, "items": call} if parallel else call


def _call_schema(tool: ToolDefinition, pointer: str) -> dict[str, Any]:
    parameters = tool.function.parameters
    arguments = _NO_PARAMETERS if parameters is None else _repoint_refs(parameters, pointer)
    return {
        "type": "object",
        "properties": {"name": {"type": "string", "enum": [tool.function.name]}, "arguments": arguments},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _repoint_refs(node: Any, pointer: str) -> Any:
    """A copy of a parameters schema whose local `$ref`s ("#/...") work from `pointer` in the new root."""
    if isinstance(node, dict):
        return {
            key: (
                f"#{pointer}{value[1:]}"
                if key == "$ref" and isinstance(value, str) and value.startswith("#")
                else value
                if key in validation.DATA_KEYS
                else _repoint_refs(value, pointer)
            )
            for key, value in node.items()
        }
    if isinstance(node, list):
        return [_repoint_refs(item, pointer) for item in node]
    return node
