"""A YAML loader that rejects duplicate mapping keys (PyYAML and kubernetes-validate keep the last one)."""

from __future__ import annotations

from typing import Any

import yaml


class DuplicateKeyError(yaml.constructor.ConstructorError):
    """A mapping names the same key twice."""


class StrictLoader(yaml.SafeLoader):
    """SafeLoader that fails on a key written twice in one mapping; `<<` merges may still be overridden."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise DuplicateKeyError(
                    "while constructing a mapping",
                    node.start_mark,
                    f"found duplicate key {key!r}",
                    key_node.start_mark,
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_all(text: str) -> list[Any]:
    """Every non-empty document of a YAML stream, refusing duplicate keys."""
    return [doc for doc in yaml.load_all(text, Loader=StrictLoader) if doc is not None]


def load(text: str) -> Any:
    """One YAML document, refusing duplicate keys."""
    return yaml.load(text, Loader=StrictLoader)
