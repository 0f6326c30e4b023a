"""Typed JSON records: dataclasses that cross a package boundary, read back from JSON strictly.

A record is a (frozen) dataclass whose fields are ``str``, ``int``, ``float``, ``bool``, another
record, ``list[...]``, ``tuple[...]`` (a JSON list of fixed length), ``dict[str, ...]``,
``dict[int, ...]`` (a JSON object keyed by decimal integers, such as layer numbers) or
``X | None``. :func:`to_json` turns it into plain JSON values (field names as keys, in field
order; a field declared with :func:`omitted_when_none` is left out while it is None, one declared
with :func:`not_written` always);
:func:`from_json` builds it from parsed JSON, checking every type on the way (an ``int`` is never
a ``bool``, a ``float`` is finite), so a consumer reads attributes, never another package's dict
by key.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing

from .errors import InputError


def is_int(x) -> bool:
    """A JSON integer: an ``int`` that is not a ``bool``."""
    return isinstance(x, int) and not isinstance(x, bool)


def is_text(s: str) -> bool:
    """``s`` encodes as strict UTF-8 (a JSON ``\\udXXX`` escape can leave a lone surrogate that does not)."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


OMIT_NONE = "omit_none"


def omitted_when_none():
    """A field that defaults to None and is left out of :func:`to_json`'s object while it is None.

    >>> @dataclasses.dataclass(frozen=True)
    ... class Point:
    ...     x: int
    ...     label: str | None = omitted_when_none()
    >>> to_json(Point(1)), to_json(Point(1, "a"))
    ({'x': 1}, {'x': 1, 'label': 'a'})
    """
    return dataclasses.field(default=None, metadata={OMIT_NONE: True})


NOT_WRITTEN = "not_written"


def not_written():
    """A field held in memory only (an array a later step reuses): never in :func:`to_json`'s
    object, and its default, None, when :func:`from_json` builds the record.

    >>> @dataclasses.dataclass(frozen=True)
    ... class Point:
    ...     x: int
    ...     cache: list | None = not_written()
    >>> to_json(Point(1, [2, 3]))
    {'x': 1}
    """
    return dataclasses.field(default=None, metadata={NOT_WRITTEN: True})


def to_json(record) -> dict:
    """The record as JSON-ready values (nested records become objects, tuples lists, integer keys strings)."""
    return {f.name: _dump(getattr(record, f.name)) for f in dataclasses.fields(record)
            if not f.metadata.get(NOT_WRITTEN)
            and not (f.metadata.get(OMIT_NONE) and getattr(record, f.name) is None)}


def _dump(value):
    if dataclasses.is_dataclass(value):
        return to_json(value)
    if isinstance(value, (list, tuple)):
        return [_dump(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _dump(v) for k, v in value.items()}
    return value


def from_json(cls, obj, where: str | None, what: str = "record"):
    """Build ``cls`` from ``obj``; one :class:`InputError` naming the first bad field."""
    try:
        return _load(cls, obj, what)
    except (TypeError, ValueError, KeyError) as exc:
        raise InputError(where, f"malformed {what}: {exc}") from None


def _int_key(key: str, path: str) -> int:
    if not (key.isascii() and key.isdigit()) or (len(key) > 1 and key[0] == "0"):
        raise ValueError(f"{path} has key {key[:40]!r}, not a decimal integer")
    return int(key)


def _load(tp, obj, path: str):
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if obj is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _load(arg, obj, path)
            except (TypeError, ValueError, KeyError) as exc:
                errors.append(str(exc))
        raise TypeError(errors[0] if len(errors) == 1 else f"{path} matches none of its types")
    if dataclasses.is_dataclass(tp):
        if not isinstance(obj, dict):
            raise TypeError(f"{path} is not an object")
        hints = typing.get_type_hints(tp)
        kwargs = {}
        for f in dataclasses.fields(tp):
            if f.metadata.get(NOT_WRITTEN):
                continue
            if f.name not in obj:
                if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING:
                    continue
                raise KeyError(f"{path} lacks {f.name!r}")
            kwargs[f.name] = _load(hints[f.name], obj[f.name], f"{path}.{f.name}")
        return tp(**kwargs)
    if origin is list:
        if not isinstance(obj, list):
            raise TypeError(f"{path} is not a list")
        (item,) = typing.get_args(tp)
        return [_load(item, v, f"{path}[{i}]") for i, v in enumerate(obj)]
    if origin is tuple:
        items = typing.get_args(tp)
        if not isinstance(obj, list) or len(obj) != len(items):
            raise TypeError(f"{path} is not a list of {len(items)}")
        return tuple(_load(item, v, f"{path}[{i}]") for i, (item, v) in enumerate(zip(items, obj)))
    if origin is dict:
        if not isinstance(obj, dict):
            raise TypeError(f"{path} is not an object")
        key, item = typing.get_args(tp)
        if key is int:
            return {_int_key(k, path): _load(item, v, f"{path}.{k}") for k, v in obj.items()}
        return {str(k): _load(item, v, f"{path}.{k}") for k, v in obj.items()}
    if tp is typing.Any:
        return obj
    if tp is bool:
        if not isinstance(obj, bool):
            raise TypeError(f"{path} is {obj!r}, not true or false")
        return obj
    if tp is int:
        if not is_int(obj):
            raise TypeError(f"{path} is {obj!r}, not an integer")
        return obj
    if tp is float:
        if not isinstance(obj, (int, float)) or isinstance(obj, bool) or not math.isfinite(obj):
            raise TypeError(f"{path} is {obj!r}, not a finite number")
        return float(obj)
    if tp is str:
        if not isinstance(obj, str):
            raise TypeError(f"{path} is {obj!r}, not a string")
        return obj
    raise TypeError(f"{path}: unsupported field type {tp!r}")


__all__ = ["from_json", "is_int", "is_text", "not_written", "omitted_when_none", "to_json"]
