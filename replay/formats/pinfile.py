"""colibrì's ``PIN`` file: the pin set in the form the runtime loads, and plan.json's record of it.

colibrì pins experts at start-up from ``PIN=<file>`` with ``PIN_GB=<g>``: the file is text, one
``<layer> <expert> <count>`` record per line (its ``STATS``/``.coli_usage`` histogram format,
absolute layer numbers), and the runtime ranks the records by count, highest first (ties by
layer, then expert), and pins the first ``floor(PIN_GB * 1e9 / expert_bytes)`` of them; records
of layers it does not route (or, in the GLM engine, layers at or above ``num_hidden_layers``, the
MTP layer) are skipped. Reading stops at the first line that is not three integers, so the file
carries no comments.

To make the runtime pin exactly a chosen set, :func:`write_pin_file` writes only the chosen
experts, and writes as ``count`` the rank weight ``N - i`` of the ``i``-th expert of the arm's
ranking (best first), not a selection count: with ``PIN_GB`` at least the set's size
(:func:`pin_gb_for`) the runtime pins the whole set, and with less it pins the arm's best prefix.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from containers.atomic import atomic_output
from containers import records
from containers.records import is_int


@dataclass(frozen=True)
class PinRecord:
    """A pin set as plan.json stores it: the arm that chose it, the RAM split (bytes), the device it
    was chosen on, how, and the pinned experts as (absolute layer, expert) pairs, best first."""

    arm: str
    ram_bytes: int
    pin_bytes: int
    lru_bytes: int
    device: str
    how: str
    experts: list[tuple[int, int]]

    def to_json(self) -> dict:
        return records.to_json(self)

    @classmethod
    def from_json(cls, obj, where: str | None) -> "PinRecord":
        """A ``pins`` field as a record (check its ranges with :func:`pin_record_problems` first)."""
        return records.from_json(cls, obj, where, "pin record")


def pin_file_text(experts: list[tuple[int, int]]) -> str:
    """The PIN file's text for ``experts`` ((absolute layer, expert), best first)."""
    n = len(experts)
    return "".join(f"{layer} {e} {n - i}\n" for i, (layer, e) in enumerate(experts))


def write_pin_file(path: str | os.PathLike, experts: list[tuple[int, int]]) -> None:
    """Write the PIN file crash-safely (temp + fsync + rename)."""
    with atomic_output(path, "w") as fh:
        fh.write(pin_file_text(experts))


def pin_gb_for(pin_bytes: int) -> float:
    """A ``PIN_GB`` that admits the whole set: its bytes in GB (10^9), rounded up to 0.01, plus 0.01."""
    return math.ceil(pin_bytes / 1e7) / 100 + 0.01


def runtime_pins(path: str | os.PathLike, pin_gb: float, expert_bytes: int, routed_layers: set[int]) -> list[tuple[int, int]]:
    """The experts colibrì pins from ``path`` with ``PIN_GB=pin_gb`` (its ranking, as in the module
    doc): records ranked by count, highest first, ties by layer then expert, the first
    ``floor(pin_gb * 1e9 / expert_bytes)`` of those in ``routed_layers``."""
    records = []
    for line in Path(path).read_text().splitlines():
        parts = line.split()
        if len(parts) != 3 or not all(p.lstrip("-").isdigit() for p in parts):
            break
        layer, e, count = map(int, parts)
        if layer in routed_layers and e >= 0 and count > 0:
            records.append((layer, e, count))
    records.sort(key=lambda r: (-r[2], r[0], r[1]))
    return [(layer, e) for layer, e, _ in records[: int(pin_gb * 1e9 / expert_bytes)]]


def pin_record_problems(pins, geometry: dict) -> list[str]:
    """Problems of plan.json's ``pins`` field (empty when none; None is a plan without pins)."""
    if pins is None:
        return []
    if not isinstance(pins, dict):
        return ["'pins' is not an object or null"]
    problems = []
    for key in ("arm", "device", "how"):
        if not isinstance(pins.get(key), str):
            problems.append(f"pins {key} is not a string")
    for key in ("ram_bytes", "pin_bytes", "lru_bytes"):
        if not is_int(pins.get(key)) or pins[key] < 0:
            problems.append(f"pins {key} is not a byte count")
    experts = pins.get("experts")
    if not isinstance(experts, list) or not all(isinstance(p, list) and len(p) == 2 and all(is_int(x) for x in p) for p in experts):
        return problems + ["pins experts is not a list of [layer, expert] pairs"]
    routed, E = set(geometry["routed_layers"]), geometry["n_experts"]
    bad = [p for p in experts if p[0] not in routed or not 0 <= p[1] < E]
    if bad:
        problems.append(f"pins name {len(bad)} expert(s) the geometry does not have, e.g. {bad[0]}")
    if len({tuple(p) for p in experts}) != len(experts):
        problems.append("pins repeat an expert")
    if not problems:
        size = sum(int(geometry["expert_bytes"][str(layer)]) for layer, _ in experts)
        if size != pins["pin_bytes"]:
            problems.append(f"pins pin_bytes {pins['pin_bytes']} is not the {size} bytes of the pinned experts")
        if pins["pin_bytes"] + pins["lru_bytes"] != pins["ram_bytes"]:
            problems.append("pins pin_bytes + lru_bytes is not ram_bytes")
    return problems


__all__ = ["PinRecord", "pin_file_text", "pin_gb_for", "pin_record_problems", "runtime_pins", "write_pin_file"]
