"""Dockerfiles read with BuildKit's own parser (the `dockerfile` package), split into stages; .dockerignore
matching with the rules BuildKit applies (last matching pattern wins, `!` re-includes, `**` spans folders)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import dockerfile


@dataclass
class Stage:
    """One FROM ... AS name section and its instructions."""

    base: str
    name: str | None
    commands: list[dockerfile.Command] = field(default_factory=list)

    def all(self, instruction: str) -> list[dockerfile.Command]:
        return [c for c in self.commands if c.cmd == instruction]

    def one(self, instruction: str) -> dockerfile.Command:
        found = self.all(instruction)
        assert len(found) == 1, f"stage {self.name}: expected one {instruction}, found {len(found)}"
        return found[0]

    def env(self) -> dict[str, str]:
        pairs: dict[str, str] = {}
        for command in self.all("ENV"):
            pairs.update(zip(command.value[::2], command.value[1::2], strict=True))
        return pairs

    def run_lines(self) -> list[str]:
        """RUN commands with continuation whitespace collapsed."""
        return [" ".join(" ".join(c.value).split()) for c in self.all("RUN")]


@dataclass
class Parsed:
    global_args: dict[str, str | None]
    stages: list[Stage]

    def stage(self, name: str) -> Stage:
        (found,) = [s for s in self.stages if s.name == name]
        return found

    @property
    def final(self) -> Stage:
        return self.stages[-1]


def parse(path: Path) -> Parsed:
    global_args: dict[str, str | None] = {}
    stages: list[Stage] = []
    for command in dockerfile.parse_file(str(path)):
        if command.cmd == "FROM":
            value = command.value
            name = value[2] if len(value) == 3 and value[1].upper() == "AS" else None
            stages.append(Stage(base=value[0], name=name))
        elif stages:
            stages[-1].commands.append(command)
        elif command.cmd == "ARG":
            key, _, default = command.value[0].partition("=")
            global_args[key] = default if "=" in command.value[0] else None
    return Parsed(global_args=global_args, stages=stages)


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out)


def ignore_patterns(path: Path) -> list[str]:
    lines = (line.strip() for line in path.read_text().splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def in_context(relative: str, patterns: list[str]) -> bool:
    """Whether a repository-relative path is sent to the builder under these .dockerignore patterns."""
    parts = relative.strip("/").split("/")
    prefixes = ["/".join(parts[: k + 1]) for k in range(len(parts))]
    excluded = False
    for raw in patterns:
        negate = raw.startswith("!")
        regex = _pattern_regex(raw.removeprefix("!").strip("/"))
        # A pattern matching a parent folder applies to everything inside it.
        if any(regex.fullmatch(prefix) for prefix in prefixes):
            excluded = not negate
    return not excluded
