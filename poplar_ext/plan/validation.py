"""`Node`: typed accessors over parsed JSON whose every failure is a `FormatError` naming the field (every
format and the ``poplar`` section read through it). See profiles/README.md."""

from __future__ import annotations

import contextlib
import difflib
import math
from collections.abc import Iterable
from typing import Any

from .errors import FormatError

_MISSING = object()


def describe(value: Any) -> str:
    """A short human description of a JSON value for error messages."""
    if value is _MISSING:
        return "nothing (the field is missing)"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"boolean {str(value).lower()}"
    if isinstance(value, (int, float)):
        return f"number {value!r}"
    if isinstance(value, str):
        shown = value if len(value) <= 60 else value[:57] + "..."
        return f"string {shown!r}"
    if isinstance(value, list):
        return f"a list of {len(value)} items"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


class Node:
    """A position in a JSON document: the value, its source file and its dotted path."""

    def __init__(self, value: Any, source: str, path: str = "") -> None:
        self.value = value
        self.source = source
        self.path = path

    # -- navigation ------------------------------------------------------------------
    def _child_path(self, key: str | int) -> str:
        if isinstance(key, int):
            return f"{self.path}[{key}]"
        return f"{self.path}.{key}" if self.path else key

    def fail(self, expected: str, found: Any = _MISSING, *, raw_found: str | None = None) -> FormatError:
        """Build (not raise) the error for this position."""
        shown = raw_found if raw_found is not None else describe(self.value if found is _MISSING else found)
        return FormatError(self.source, self.path or "(top level)", expected, shown)

    def obj(self) -> Node:
        if not isinstance(self.value, dict):
            raise self.fail("an object")
        return self

    def field(self, key: str) -> Node:
        """The child `key`; an error if it is missing."""
        child = self.child(key)
        if child.value is _MISSING:
            raise child.fail("a value")
        return child

    def child(self, key: str) -> Node:
        """The child `key` whether or not it is there, to report on (a missing one says so)."""
        return Node(self.obj().value.get(key, _MISSING), self.source, self._child_path(key))

    def optional(self, key: str) -> Node | None:
        """The child `key`, or None when it is absent or null."""
        return None if self.obj().value.get(key) is None else self.child(key)

    def items(self, *, min_length: int = 0, max_length: int | None = None) -> list[Node]:
        if not isinstance(self.value, list):
            raise self.fail("a list")
        if len(self.value) < min_length:
            raise self.fail(f"a list of at least {min_length} item(s)")
        if max_length is not None and len(self.value) > max_length:
            raise self.fail(f"a list of at most {max_length} items")
        return [Node(v, self.source, self._child_path(i)) for i, v in enumerate(self.value)]

    def keys_within(self, known: tuple[str, ...] | list[str]) -> Node:
        """This object, checked to hold no key outside `known` (a misspelt key is never ignored)."""
        self.obj()
        for key in self.value:
            if key not in known:
                raise FormatError(
                    self.source, self._child_path(key), _known_keys_text(key, known), f"the unknown key {key!r}"
                )
        return self

    def within_depth(self, limit: int) -> Node:
        """This value, checked to nest lists and objects at most `limit` deep."""
        if json_depth(self.value) > limit:
            raise self.fail(f"JSON nested at most {limit} deep", raw_found="deeper nesting")
        return self

    def entries(self) -> list[tuple[str, Node]]:
        self.obj()
        return [(k, Node(v, self.source, self._child_path(k))) for k, v in self.value.items()]

    # -- scalars -----------------------------------------------------------------------
    def integer(self, *, minimum: int | None = None, maximum: int | None = None) -> int:
        v = self.value
        # bool is an int subclass in Python; true/false is never a count.
        if isinstance(v, bool) or not isinstance(v, int) or not _within(v, minimum, maximum):
            raise self.fail(_range_text("an integer", minimum, maximum))
        return v

    def number(self, *, minimum: float | None = None, maximum: float | None = None, positive: bool = False) -> float:
        v = self.value
        if positive:
            what = "a positive number" if maximum is None else f"a positive number <= {maximum:g}"
        else:
            what = _range_text("a number", minimum, maximum)
        value = math.nan
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            with contextlib.suppress(OverflowError):  # an integer too large for a float
                value = float(v)
        if not math.isfinite(value) or (positive and value <= 0) or not _within(value, minimum, maximum):
            raise self.fail(what)
        return value

    def boolean(self) -> bool:
        if not isinstance(self.value, bool):
            raise self.fail("true or false")
        return self.value

    def string(self, *, choices: tuple[str, ...] | None = None) -> str:
        v = self.value
        if not isinstance(v, str) or not v.strip():
            raise self.fail("a non-empty string" if choices is None else _choices_text(choices))
        if choices is not None and v not in choices:
            raise self.fail(_choices_text(choices), raw_found=describe(v) + did_you_mean(v, choices))
        return v


MAX_JSON_DEPTH = 64
"""Deepest nesting of lists and objects accepted anywhere (the formats need 4)."""


def json_depth(value: Any) -> int:
    """How deep lists and objects nest in `value` (0 for a scalar); iterative, so any depth is safe."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (list, dict)):
            depth += 1
            deepest = max(deepest, depth)
            stack.extend((child, depth) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def _within(value: float, minimum: float | None, maximum: float | None) -> bool:
    return (minimum is None or value >= minimum) and (maximum is None or value <= maximum)


def _range_text(kind: str, minimum: float | None, maximum: float | None) -> str:
    shown = [None if v is None else (f"{v:g}" if isinstance(v, float) else str(v)) for v in (minimum, maximum)]
    if minimum is not None and maximum is not None:
        return f"{kind} from {shown[0]} to {shown[1]}"
    if minimum is not None:
        return f"{kind} >= {shown[0]}"
    if maximum is not None:
        return f"{kind} <= {shown[1]}"
    return kind


def closest(name: str, known: Iterable[str]) -> str | None:
    """The one of `known` that `name` most likely misspells, or None: every "did you mean" of the package."""
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return close[0] if close else None


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for `closest`'s answer, or ''."""
    close = closest(name, known)
    return "" if close is None else f" (did you mean {close!r}?)"


def _known_keys_text(key: str, known: tuple[str, ...] | list[str]) -> str:
    return f"one of the keys {', '.join(map(repr, sorted(known)))}{did_you_mean(key, known)}"


def _choices_text(choices: tuple[str, ...]) -> str:
    return "one of " + ", ".join(repr(c) for c in choices)
