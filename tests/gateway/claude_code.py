"""A Claude-Code-shaped session for the Messages API tests: the request Claude Code sends (system text
blocks with cache_control, its tool set with draft-07 input schemas, metadata.user_id, system reminders
in the first user turn) and the tool results a session feeds back, made here (no captured traffic).

One change to the real tool schemas: strings and arrays have a maxLength / maxItems and numbers are bounded
integers, so that the tiny test model's calls, forced to match the schema, end within a turn's max_tokens."""

from __future__ import annotations

import json
from typing import Any

SYSTEM = [
    {"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude."},
    {
        "type": "text",
        "text": (
            "You are an interactive CLI tool that helps users with software engineering tasks. Use the "
            "instructions below and the tools available to you to assist the user.\n\n"
            "# Tone and style\nYou should be concise, direct, and to the point.\n\n"
            "# Following conventions\nWhen making changes to files, first understand the file's code "
            "conventions. Mimic code style, use existing libraries and utilities, and follow existing "
            "patterns.\n\n# Doing tasks\n- Use the available search tools to understand the codebase.\n"
            "- Implement the solution using all tools available to you.\n"
            "- Verify the solution with tests.\n\n"
            "# Tool usage policy\n- You have the capability to call multiple tools in a single response.\n"
            "\n<env>\nWorking directory: /home/user/project\nIs directory a git repo: Yes\nPlatform: linux\n"
            "</env>"
        ),
        "cache_control": {"type": "ephemeral"},
    },
]

_DRAFT7 = "http://json-schema.org/draft-07/schema#"


def _tool(name: str, description: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {
        "name": name,
        "description": description,
        "input_schema": {
            "type": "object",
            "properties": properties,
            "required": required,
            "additionalProperties": False,
            "$schema": _DRAFT7,
        },
    }


_PATH = {"type": "string", "description": "The absolute path", "maxLength": 40}
_SHORT = {"type": "string", "maxLength": 40}
_COUNT = {"type": "integer", "minimum": 0, "maximum": 2000}

TOOLS = [
    _tool(
        "Bash",
        "Executes a given bash command in a persistent shell session.",
        {
            "command": {**_SHORT, "description": "The command to execute"},
            "timeout": {
                "type": "number",
                "description": "Optional timeout in milliseconds",
                "maximum": 600000,
            },
            "description": {**_SHORT, "description": "Clear, concise description of what this command does"},
            "run_in_background": {"type": "boolean"},
        },
        ["command"],
    ),
    _tool(
        "Glob",
        "Fast file pattern matching tool that works with any codebase size.",
        {"pattern": _SHORT, "path": _PATH},
        ["pattern"],
    ),
    _tool(
        "Grep",
        "A powerful search tool built on ripgrep.",
        {
            "pattern": _SHORT,
            "path": _PATH,
            "glob": _SHORT,
            "output_mode": {"type": "string", "enum": ["content", "files_with_matches", "count"]},
            "-i": {"type": "boolean"},
            "head_limit": _COUNT,
        },
        ["pattern"],
    ),
    _tool(
        "Read",
        "Reads a file from the local filesystem.",
        {"file_path": _PATH, "offset": _COUNT, "limit": _COUNT},
        ["file_path"],
    ),
    _tool(
        "Edit",
        "Performs exact string replacements in files.",
        {"file_path": _PATH, "old_string": _SHORT, "new_string": _SHORT, "replace_all": {"type": "boolean"}},
        ["file_path", "old_string", "new_string"],
    ),
    _tool(
        "Write",
        "Writes a file to the local filesystem.",
        {"file_path": _PATH, "content": _SHORT},
        ["file_path", "content"],
    ),
    _tool(
        "TodoWrite",
        "Use this tool to create and manage a structured task list for your current coding session.",
        {
            "todos": {
                "type": "array",
                "maxItems": 2,
                "items": {
                    "type": "object",
                    "properties": {
                        "content": {"type": "string", "minLength": 1, "maxLength": 30},
                        "status": {"type": "string", "enum": ["pending", "in_progress", "completed"]},
                        "activeForm": {"type": "string", "minLength": 1, "maxLength": 30},
                    },
                    "required": ["content", "status", "activeForm"],
                    "additionalProperties": False,
                },
            }
        },
        ["todos"],
    ),
    _tool(
        "WebFetch",
        "Fetches content from a specified URL and processes it using an AI model.",
        {"url": _SHORT, "prompt": _SHORT},
        ["url", "prompt"],
    ),
    _tool(
        "Task",
        "Launch a new agent to handle complex, multi-step tasks autonomously.",
        {"description": _SHORT, "prompt": _SHORT, "subagent_type": _SHORT},
        ["description", "prompt", "subagent_type"],
    ),
    _tool("ExitPlanMode", "Prompts the user to exit plan mode.", {"plan": _SHORT}, ["plan"]),
]

FIRST_TURN = {
    "role": "user",
    "content": [
        {
            "type": "text",
            "text": "<system-reminder>\nAs you answer the user's questions, you can use the following "
            "context:\n# important-instruction-reminders\nDo what has been asked; nothing more, nothing "
            "less.\n</system-reminder>\n",
        },
        {
            "type": "text",
            "text": "Tell me a story about the tests in this project, then fix the failing one.",
            "cache_control": {"type": "ephemeral"},
        },
    ],
}

METADATA = {"user_id": "user_0123456789abcdef_account__session_5b6c7d8e"}


def tool_result(tool_use: dict[str, Any], turn: int) -> dict[str, Any]:
    """What the session's tool run answers: a file listing, a file's lines, or a command's output."""
    name = tool_use["name"]
    if name in ("Read", "Grep"):
        lines = "\n".join(
            f"{n:>6}\tdef test_case_{turn}_{n}(): assert run({n}) == {n * 2}" for n in range(1, 13)
        )
        content: Any = [{"type": "text", "text": lines}]
    elif name in ("Glob", "Bash"):
        content = "\n".join(f"tests/test_module_{turn}_{n}.py" for n in range(10)) + "\nexit code 0"
    else:
        content = f"{name} done: {json.dumps(tool_use['input'])[:80]}"
    return {"type": "tool_result", "tool_use_id": tool_use["id"], "content": content, "is_error": turn == 3}
