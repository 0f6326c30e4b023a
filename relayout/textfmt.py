"""Small helpers for human-readable CLI output."""

from __future__ import annotations


def human_bytes(n: float) -> str:
    """``1234567`` -> ``'1.23 MB'`` (decimal units, as drive vendors and FACTS use)."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def table(rows: list[list[str]], header: list[str]) -> str:
    """A plain left-aligned text table."""
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(header, widths)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(lines)
