"""Typed JSON records: what to_json writes, from_json reads back, and nothing looser."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from containers.errors import InputError
from containers.records import from_json, omitted_when_none, to_json


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


@dataclass(frozen=True)
class Keyed:
    pairs: list[tuple[int, int]]
    by_layer: dict[int, str]
    label: str | None = omitted_when_none()


def test_tuples_integer_keys_and_omitted_fields_round_trip_as_plain_json():
    rec = Keyed([(3, 4)], {10: "a", 2: "b"})
    obj = to_json(rec)
    assert obj == {"pairs": [[3, 4]], "by_layer": {"10": "a", "2": "b"}}             # no "label": it is None
    assert list(obj["by_layer"]) == ["10", "2"]                                        # insertion order kept
    assert from_json(Keyed, obj, "r") == rec
    assert to_json(Keyed([], {}, "x"))["label"] == "x"


@pytest.mark.parametrize("obj, words", [
    ({"pairs": [[1, 2, 3]], "by_layer": {}}, r"pairs\[0\] is not a list of 2"),
    ({"pairs": [], "by_layer": {"01": "a"}}, "not a decimal integer"),
    ({"pairs": [], "by_layer": {"-1": "a"}}, "not a decimal integer"),
    ({"pairs": [], "by_layer": {"x": "a"}}, "not a decimal integer"),
])
def test_a_bad_tuple_or_integer_key_is_one_named_error(obj, words):
    with pytest.raises(InputError, match=words):
        from_json(Keyed, obj, "r")


def test_an_interval_writes_only_what_it_knows():
    from replay.formats.interval import Interval

    assert list(Interval(1.0, 0.5, 2.0).to_json()) == ["estimate", "low", "high"]
    full = Interval(1.0, 0.5, 2.0, "session", 6, "session")
    assert list(full.to_json()) == ["estimate", "low", "high", "unit", "n_units", "method"]
    assert Interval.from_json(full.to_json(), "r") == full
