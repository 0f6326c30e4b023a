"""Argument types for the command line: every numeric option parsed and range-checked in one place.

Each factory returns a function for ``argparse``'s ``type=``: it turns the option's text into a
finite ``float`` or an ``int`` within the bounds given, or raises
:class:`argparse.ArgumentTypeError` with a message that says what was expected (argparse names
the option; :class:`OneLineParser` prints it as one line and exits with status 2). Lists
(``"0,64,128"``) are checked item by item.
"""

from __future__ import annotations

import argparse
import math
import sys

GB_MAX = 1e6
"""The largest RAM, cache or container size an option takes, GB (a petabyte)."""
MB_MAX = 1e9
"""The largest size in MB an option takes (a petabyte)."""
MS_MAX = 3.6e6
"""The largest time in ms an option takes (an hour)."""
RATE_MAX = 1e6
"""The largest rate in GB/s an option takes (a petabyte per second)."""
COUNT_MAX = 2**31 - 1
"""The largest count (tokens, sessions, layers, experts) an option takes."""
SEED_MAX = 2**32 - 1
"""The largest seed an option takes."""


def _text(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else f"{x:g}"


def _bounds(lo, hi, lo_open: bool) -> str:
    if hi is None:
        return f"{'>' if lo_open else '>='} {_text(lo)}"
    return f"above {_text(lo)} and at most {_text(hi)}" if lo_open else f"from {_text(lo)} to {_text(hi)}"


def _check(value: float, lo: float, hi: float | None, lo_open: bool, what: str, text: str):
    if not math.isfinite(value) or (value <= lo if lo_open else value < lo) or (hi is not None and value > hi):
        raise argparse.ArgumentTypeError(f"{text!r} is not {what} {_bounds(lo, hi, lo_open)}")
    return value


def number(lo: float, hi: float | None, lo_open: bool = False):
    """A finite number in ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``; no upper bound when ``hi`` is None)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        return _check(value, lo, hi, lo_open, "a number", text)

    parse.__name__ = "number"
    return parse


def integer(lo: int, hi: int | None):
    """A whole number (written without a point or exponent) in ``[lo, hi]``."""

    def parse(text: str) -> int:
        try:
            value = int(text.strip(), 10)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        return _check(value, lo, hi, False, "a whole number", text)

    parse.__name__ = "integer"
    return parse


def numbers(lo: float, hi: float | None, whole: bool = False):
    """Comma-separated numbers (whole numbers with ``whole``), each in ``[lo, hi]``, at least one: a tuple."""
    one = integer(lo, hi) if whole else number(lo, hi)

    def parse(text: str) -> tuple:
        items = tuple(one(x) for x in text.split(",") if x.strip())
        if not items:
            raise argparse.ArgumentTypeError(f"{text!r} lists no number")
        return items

    parse.__name__ = "list"
    return parse


gigabytes = number(0.0, GB_MAX)
"""A size in GB, 0 to :data:`GB_MAX`."""
positive_gigabytes = number(0.0, GB_MAX, lo_open=True)
megabytes = number(0.0, MB_MAX)
positive_megabytes = number(0.0, MB_MAX, lo_open=True)
milliseconds = number(0.0, MS_MAX)
rate_gbps = number(0.0, RATE_MAX, lo_open=True)
fraction = number(0.0, 1.0)
"""A share from 0 to 1."""
count = integer(0, COUNT_MAX)
positive_count = integer(1, COUNT_MAX)
seed = integer(0, SEED_MAX)


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line on stderr (``relayout: error: ...``) and
    exit status 2, like every other bad input; ``--help`` shows the usage."""

    def error(self, message: str):
        print(f"{self.prog.split()[0]}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)
