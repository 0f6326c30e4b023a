"""Units in words: byte counts as a person reads them."""

from __future__ import annotations


def human_bytes(n: float) -> str:
    """``1234567`` -> ``'1.23 MB'`` (decimal units, as drive vendors use)."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")
