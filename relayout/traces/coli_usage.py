"""The ``.coli_usage`` importer: colibrì's learning-cache history, per-(layer, expert) counts only.

A header line ``-1 <n_layers> <n_experts>``, then ``<layer> <expert> <count>`` lines (``-2`` lines
are skipped). The result is a heat-only trace: co-activation, clustering and replay need
per-token routing and refuse it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from containers.errors import InputError
from containers.jsonfile import read_bytes
from replay.model.routing import MAX_LAYER, MAX_LAYER_EXPERT_CELLS

from .sessions import INT_RE, Limits

MAX_COUNT = 1 << 36
"""Largest ``.coli_usage`` count (sums over every cell stay far inside int64)."""


def read_coli_usage(path: Path, limits: Limits | None = None) -> tuple[np.ndarray, np.ndarray, int]:
    """Parse a ``.coli_usage`` file.

    The header's expert count must be plausible (the geometry's, or at most
    ``DEFAULT_MAX_EXPERTS``) and the heat table is sized by it and by the layers actually listed,
    so a lying header cannot make a large allocation. A (layer, expert) listed twice is an error.

    Parameters
    ----------
    path : Path
        The ``.coli_usage`` file.
    limits : Limits, optional
        What ids and layers may be.

    Returns
    -------
    (ndarray, ndarray, int)
        The listed layers (sorted), the counts per (layer index, expert) ``[L, E]`` int64, and
        the experts per layer.
    """
    limits = limits or Limits.make(None)
    text = read_bytes(path).decode("utf-8", errors="replace")
    n_experts = None
    entries, seen = [], {}
    for lineno, line in enumerate(text.splitlines(), 1):
        parts = line.split()
        if not parts:
            continue
        where = f"{path}:{lineno}"
        if not all(INT_RE.fullmatch(x.encode()) for x in parts):
            raise InputError(where, "expected integers")
        if any(len(x.lstrip("-")) > 18 for x in parts):
            raise InputError(where, "a number is out of range (more than 18 digits)")
        nums = [int(x) for x in parts]
        if nums[0] == -1:
            if len(nums) != 3:
                raise InputError(where, "expected '-1 <n_layers> <n_experts>'")
            n_layers, e = nums[1], nums[2]
            if not 1 <= n_layers <= MAX_LAYER + 1:
                raise InputError(where, f"header says {n_layers} layers (expected 1..{MAX_LAYER + 1})")
            if limits.geometry and e != limits.n_experts:
                raise InputError(where, f"header says {e} experts per layer; geometry {limits.geometry} has {limits.n_experts}")
            if not 1 <= e <= limits.n_experts:
                raise InputError(where, f"header says {e} experts per layer (expected 1..{limits.n_experts}; "
                                        "pass --geometry for a larger model)")
            if n_experts is not None and e != n_experts:
                raise InputError(where, f"a second header says {e} experts per layer, the first said {n_experts}")
            n_experts = e
        elif nums[0] == -2:
            continue
        else:
            if len(nums) != 3 or min(nums) < 0:
                raise InputError(where, "expected '<layer> <expert> <count>'")
            layer, expert, count = nums
            if not limits.layer_ok(layer):
                raise InputError(where, limits.layer_problem(layer))
            if expert >= (n_experts or limits.n_experts):
                raise InputError(where, f"expert {expert} >= n_experts {n_experts}" if n_experts else limits.expert_problem(expert))
            if count > MAX_COUNT:
                raise InputError(where, f"count {count} is implausibly large (at most {MAX_COUNT})")
            if (layer, expert) in seen:
                raise InputError(where, f"layer {layer} expert {expert} is listed twice (first at line {seen[layer, expert]})")
            seen[layer, expert] = lineno
            entries.append(nums)
    if n_experts is None:
        raise InputError(path, "missing '-1 <n_layers> <n_experts>' header")
    if not entries:
        raise InputError(path, "no usage counts")
    arr = np.array(entries, dtype=np.int64)
    if int(arr[:, 1].max()) >= n_experts:
        bad = next(i for i, e in enumerate(entries) if e[1] >= n_experts)
        raise InputError(path, f"expert {entries[bad][1]} >= n_experts {n_experts} (listed before the header)")
    layers = np.unique(arr[:, 0])
    if len(layers) * n_experts > MAX_LAYER_EXPERT_CELLS:
        raise InputError(path, f"{len(layers)} layers x {n_experts} experts is more than {MAX_LAYER_EXPERT_CELLS:,} cells")
    heat = np.zeros((len(layers), n_experts), dtype=np.int64)
    np.add.at(heat, (np.searchsorted(layers, arr[:, 0]), arr[:, 1]), arr[:, 2])
    return layers, heat, n_experts
