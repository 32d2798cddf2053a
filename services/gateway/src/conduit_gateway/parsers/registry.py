"""The registry both parser kinds use: named subclasses of one base, registered by being defined in a
module of the base's package, so adding a format is adding one file."""

from __future__ import annotations

import importlib
import pkgutil
from typing import Generic, TypeVar

Parser = TypeVar("Parser", bound=type)


class ParserRegistry(Generic[Parser]):
    """`option` names the configuration field (and flag) whose values are the registered names."""

    def __init__(self, package: str, option: str) -> None:
        self._package = package
        self._option = option
        self._classes: dict[str, Parser] = {}

    def add(self, name: str, parser: Parser) -> None:
        if self._classes.get(name, parser) is not parser:
            raise TypeError(f"{self._option}: parser {name!r} is defined twice")
        self._classes[name] = parser

    def names(self) -> tuple[str, ...]:
        """Every registered name, sorted."""
        self._import_modules()
        return tuple(sorted(self._classes))

    def get(self, name: str) -> Parser:
        """The parser registered as `name`; ValueError naming the option when it is unknown."""
        self._import_modules()
        parser = self._classes.get(name)
        if parser is None:
            raise ValueError(f"{self._option}: unknown parser {name!r}")
        return parser

    def _import_modules(self) -> None:
        package = importlib.import_module(self._package)
        for module in pkgutil.iter_modules(package.__path__):
            importlib.import_module(f"{self._package}.{module.name}")
