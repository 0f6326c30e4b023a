"""Typed JSON records: what to_json writes, from_json reads back, and nothing looser."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from containers.errors import InputError
from containers.records import from_json, to_json


@dataclass(frozen=True)
class Inner:
    n: int
    x: float


@dataclass(frozen=True)
class Outer:
    name: str
    flag: bool
    inner: Inner
    items: list[Inner]
    table: dict[str, float]
    maybe: Inner | None
    note: str | None = None


finite = st.floats(allow_nan=False, allow_infinity=False)
inners = st.builds(Inner, st.integers(-10**18, 10**18), finite)
outers = st.builds(Outer, st.text(max_size=5), st.booleans(), inners, st.lists(inners, max_size=3),
                   st.dictionaries(st.text(max_size=3), finite, max_size=3), st.none() | inners, st.none() | st.text(max_size=3))


@given(outers)
def test_round_trip(record):
    assert from_json(Outer, to_json(record), "r") == record


@pytest.mark.parametrize("edit, words", [
    (lambda d: d["inner"].__setitem__("n", True), "inner.n is True, not an integer"),
    (lambda d: d["inner"].__setitem__("n", 1.0), "inner.n is 1.0, not an integer"),
    (lambda d: d["inner"].__setitem__("x", float("nan")), "inner.x is nan, not a finite number"),
    (lambda d: d.__setitem__("flag", 1), "flag is 1, not true or false"),
    (lambda d: d["items"].append("x"), r"items\[1\] is not an object"),
    (lambda d: d.pop("inner"), "lacks 'inner'"),
    (lambda d: d["table"].__setitem__("k", "1"), "table.k is '1', not a finite number"),
])
def test_loose_values_are_one_named_error(edit, words):
    d = to_json(Outer("a", True, Inner(1, 2.0), [Inner(3, 4.0)], {"k": 1.0}, None))
    edit(d)
    with pytest.raises(InputError, match=words):
        from_json(Outer, d, "rec.json", "thing")
    d = to_json(Outer("a", True, Inner(1, 2.0), [], {}, None))
    d.pop("note")                                  # a field with a default may be absent
    assert from_json(Outer, d, "r").note is None
