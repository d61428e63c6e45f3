"""JSON values checked against a dataclass's field types, by field name.

A config read from ``adapter_config.json`` is plain JSON: ``"share_lm_head": "no"`` is a truthy
string and ``"tree": "abc"`` a sequence of characters, so handing them to the config class would
read the first as true and fail later, far from the cause, on the second. :func:`check_fields`
compares every value with the annotation of the field of that name (``int``, ``float``, ``bool``,
``str``, ``None``, ``Sequence[...]``, ``Mapping``, unions of these) and names the field and what it
expects. Annotations it does not know (``object``, classes) accept anything: the config class
checks those itself.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import types
import typing
from typing import Any, Mapping

from .schema import AdapterError

_NAMES = {int: "an int", float: "a number", bool: "true or false", str: "a string", type(None): "null"}


def _options(annotation) -> tuple:
    """The members of a union annotation (``X | Y`` or ``Optional``), else ``(annotation,)``."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return typing.get_args(annotation)
    return (annotation,)


def _sequence(annotation) -> bool:
    origin = typing.get_origin(annotation) or annotation
    return isinstance(origin, type) and issubclass(origin, collections.abc.Sequence) and origin is not str


def _mapping(annotation) -> bool:
    origin = typing.get_origin(annotation) or annotation
    return isinstance(origin, type) and issubclass(origin, collections.abc.Mapping)


def _known(annotation) -> bool:
    """Whether :func:`matches` can check ``annotation`` (every member of a union)."""
    options = _options(annotation)
    return all(option in _NAMES or _sequence(option) or _mapping(option) for option in options)


def matches(value: Any, annotation) -> bool:
    """Whether the JSON ``value`` fits ``annotation`` (an int is a number; a bool is not an int)."""
    for option in _options(annotation):
        if option is type(None) and value is None:
            return True
        if option is bool and isinstance(value, bool):
            return True
        if option is int and isinstance(value, int) and not isinstance(value, bool):
            return True
        if option is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return True
        if option is str and isinstance(value, str):
            return True
        if _mapping(option) and isinstance(value, dict):
            return True
        if _sequence(option) and isinstance(value, (list, tuple)):
            inner = typing.get_args(option)
            if not inner or inner[0] is Any or not _known(inner[0]) or all(matches(item, inner[0]) for item in value):
                return True
    return False


_PLURALS = {int: "ints", float: "numbers", bool: "booleans", str: "strings", type(None): "nulls"}


def _plural(annotation) -> str:
    """``annotation`` as the items of a list: ``int`` -> ``ints``, ``Sequence[int]`` -> ``lists of ints``."""
    options = _options(annotation)
    if len(options) > 1:
        return " or ".join(_plural(option) for option in options)
    if annotation in _PLURALS:
        return _PLURALS[annotation]
    if _mapping(annotation):
        return "objects"
    inner = typing.get_args(annotation)
    return f"lists of {_plural(inner[0])}" if inner and _known(inner[0]) else "lists"


def describe(annotation) -> str:
    """``annotation`` in words: ``Sequence[Sequence[int]] | int | None`` -> ``an int, a list of
    lists of ints or null`` (scalars first, null last)."""
    words = []
    for option in sorted(_options(annotation), key=lambda option: (option is type(None),
                                                                    _sequence(option) or _mapping(option))):
        if option in _NAMES:
            words.append(_NAMES[option])
        elif _mapping(option):
            words.append("an object")
        else:
            inner = typing.get_args(option)
            words.append(f"a list of {_plural(inner[0])}" if inner and _known(inner[0]) else "a list")
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]


def field_types(config_class: type) -> dict[str, Any]:
    """``{field name: resolved annotation}`` of a dataclass (postponed annotations evaluated)."""
    hints = typing.get_type_hints(config_class)
    return {field.name: hints.get(field.name, Any) for field in dataclasses.fields(config_class)}


def check_fields(config_class: type, values: Mapping[str, Any], where: str, block: str) -> None:
    """:class:`AdapterError` naming ``block.field`` for the first value in ``values`` whose JSON type
    does not fit the annotation of ``config_class``'s field of that name (unknown names are left to
    the class, which refuses them)."""
    types_by_name = field_types(config_class)
    for name, value in values.items():
        annotation = types_by_name.get(name)
        if annotation is None or not _known(annotation):
            continue
        if not matches(value, annotation):
            shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
            raise AdapterError(f"{where}: {block}.{name} must be {describe(annotation)}; got {shown} "
                               f"({type(value).__name__})")
