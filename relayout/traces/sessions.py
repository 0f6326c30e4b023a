"""What every trace importer shares: one session's rows before assembly, the limits an imported
id, layer and position must keep, and the checks and array helpers the importers apply alike.

Ranges are checked on the parsed 64-bit (or Python) integers, before any narrowing to the
trace's int16/int32 arrays. With a geometry, ids must be below its experts per layer and layers
among its routed layers; without one, ids are capped at ``DEFAULT_MAX_EXPERTS - 1`` and layers at
``DEFAULT_MAX_LAYER`` (see :mod:`replay.model.routing`). Every allocation sized by a file's values
is bounded by those limits and by the file's own size.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from containers.errors import InputError
from replay.model.routing import DEFAULT_MAX_EXPERTS, DEFAULT_MAX_LAYER, FORWARD_KINDS, MAX_EXPERTS, MAX_LAYER

KIND = {name: i for i, name in enumerate(FORWARD_KINDS)}
"""Forward kind name -> its index in :data:`replay.model.routing.FORWARD_KINDS`."""
INT_RE = re.compile(rb"-?[0-9]+")
"""A plain ASCII decimal integer, as the text formats write ids, layers and counts."""


@dataclass
class SessionRows:
    """One session's rows in file order, before assembly."""

    name: str
    forward: np.ndarray   # local forward index per row
    layer: np.ndarray
    position: np.ndarray
    experts: np.ndarray   # [R, k]
    gates: np.ndarray     # [R, k]
    fwd_kind: np.ndarray
    fwd_evaluated: np.ndarray
    fwd_committed: np.ndarray
    fwd_assumed: np.ndarray | None = None   # bool [F]: committed count assumed (acceptance unknown)
    counts: dict | None = None              # how the counts were found (ROUTE_TRACE: MTP layer, runtime output)


@dataclass(frozen=True)
class Limits:
    """What an imported id, layer and position may be: from a geometry, or the default caps."""

    n_experts: int                      # ids must be < n_experts
    layers: frozenset | None = None     # a geometry's routed layers (None: any up to max_layer)
    max_layer: int = DEFAULT_MAX_LAYER
    geometry: str | None = None
    mtp_layers: frozenset = frozenset()  # the geometry's MTP (multi-token prediction) head layers

    @classmethod
    def make(cls, n_experts: int | None, geometry: str = "inferred", routed_layers=None, mtp_layers=None) -> Limits:
        if n_experts is None:
            return cls(DEFAULT_MAX_EXPERTS)
        if mtp_layers is None and routed_layers is None:
            mtp_layers = _shipped_mtp_layers(geometry, n_experts)
        mtp = frozenset(int(x) for x in (mtp_layers or ()))
        if isinstance(n_experts, bool) or not isinstance(n_experts, (int, np.integer)) or not 1 <= n_experts <= MAX_EXPERTS:
            raise InputError(None, f"geometry {geometry} has {n_experts!r} experts per layer; a trace holds 1..{MAX_EXPERTS}")
        if routed_layers is None:
            routed_layers = _shipped_routed_layers(geometry, int(n_experts))
        if routed_layers is not None:
            routed_layers = frozenset(int(x) for x in routed_layers)
            if not routed_layers or min(routed_layers) < 0 or max(routed_layers) > MAX_LAYER:
                raise InputError(None, f"geometry {geometry}'s routed layers do not fit a trace (0..{MAX_LAYER})")
            return cls(int(n_experts), routed_layers, max(routed_layers), geometry, mtp & routed_layers)
        return cls(int(n_experts), None, MAX_LAYER, geometry, mtp)

    def expert_problem(self, e: int) -> str:
        if e < 0:
            return f"expert id {e} is negative"
        if self.geometry:
            return f"expert id {e} >= {self.n_experts} (the geometry's experts per layer, {self.geometry})"
        return (f"expert id {e} is above {self.n_experts - 1} (without --geometry at most "
                f"{self.n_experts} experts per layer are accepted)")

    def layer_problem(self, layer: int) -> str:
        if layer < 0:
            return f"layer {layer} is negative"
        if self.layers is not None:
            lo, hi = min(self.layers), max(self.layers)
            return f"layer {layer} is not a routed layer of geometry {self.geometry} ({lo}-{hi}): wrong geometry?"
        if self.geometry:
            return f"layer {layer} is above {self.max_layer}"
        return f"layer {layer} is above {self.max_layer} (without --geometry layers up to {self.max_layer} are accepted)"

    def bad_layer(self, layers: np.ndarray) -> np.ndarray:
        """Mask of layers outside the limits (vectorised)."""
        out = (layers < 0) | (layers > self.max_layer)
        if self.layers is not None:
            out |= ~np.isin(layers, np.fromiter(self.layers, dtype=np.int64))
        return out

    def layer_ok(self, layer: int) -> bool:
        return 0 <= layer <= self.max_layer and (self.layers is None or layer in self.layers)


def _shipped_geometry(geometry: str, n_experts):
    """The shipped geometry of that name and expert count, else None."""
    if not geometry or geometry == "inferred":
        return None
    try:
        from containers.geometry import geometry_names, load_geometry

        if geometry not in geometry_names():
            return None
        g = load_geometry(geometry)
    except InputError:
        return None
    return g if g.n_routed_experts == n_experts else None


def _shipped_routed_layers(geometry: str, n_experts: int):
    """The routed layers of a shipped geometry of that name and expert count, else None."""
    g = _shipped_geometry(geometry, n_experts)
    return g.routed_layers if g is not None else None


def _shipped_mtp_layers(geometry: str, n_experts):
    """The MTP head layers of a shipped geometry of that name and expert count, else None."""
    g = _shipped_geometry(geometry, n_experts)
    return g.mtp_layer_ids if g is not None else None



def check_padding(where, n_rows: int, k: int, n_selections: int) -> None:
    """Refuse rows so uneven that padding them to the widest would cost far more than the data."""
    if n_rows * k > 64 * n_selections + (1 << 20):
        raise InputError(where, f"one row selects {k} experts while {n_rows:,} rows hold {n_selections:,} selections: "
                                "padding every row to that width is refused")


def joined(parts: list[np.ndarray]) -> np.ndarray:
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def padded(parts: list[np.ndarray], k: int, fill) -> np.ndarray:
    """Blocks of rows [n_i, k_i] stacked into one [sum n_i, k] array, padded with ``fill``.

    >>> padded([np.array([[1]]), np.array([[2, 3]])], 2, -1).tolist()
    [[1, -1], [2, 3]]
    """
    if len(parts) == 1 and parts[0].shape[1] == k:
        return parts[0]
    out = np.full((sum(len(p) for p in parts), k), fill, dtype=parts[0].dtype)
    row = 0
    for p in parts:
        out[row:row + len(p), :p.shape[1]] = p
        row += len(p)
    return out


def session_from_rows(name, forward, layers, position, experts, gates, *, committed=None, evaluated=None,
                      kinds=None, assumed=None) -> SessionRows:
    """A session from its rows. Without explicit counts: a prefill forward commits 1 token (its
    first generated one), a decode forward 1, a verify forward 1 *assumed* (acceptance unknown)."""
    n_fwd = int(forward.max()) + 1 if len(forward) else 0
    if evaluated is None:
        evaluated = np.zeros(n_fwd, dtype=np.int64)
        np.maximum.at(evaluated, forward, position + 1)
    if kinds is None:
        kinds = np.where(evaluated == 1, KIND["decode"], KIND["verify"])
        first_decode = np.flatnonzero(evaluated == 1)
        cut = first_decode[0] if len(first_decode) else n_fwd
        kinds[:cut][evaluated[:cut] > 1] = KIND["prefill"]
    if committed is None:
        committed = np.ones(n_fwd, dtype=np.int64)
        if assumed is None:
            assumed = np.asarray(kinds) == KIND["verify"]
    if assumed is None:
        assumed = np.zeros(n_fwd, dtype=bool)
    return SessionRows(
        name, forward.astype(np.int64, copy=False), _narrow(layers, np.int16), _narrow(position, np.int32),
        _narrow(experts, np.int16), gates.astype(np.float32, copy=False),
        np.asarray(kinds, dtype=np.int8), np.asarray(evaluated, dtype=np.int64), np.asarray(committed, dtype=np.int64),
        np.asarray(assumed, dtype=bool),
    )


def _narrow(a: np.ndarray, dtype) -> np.ndarray:
    """``a`` as ``dtype``; its values were range-checked by the reader, and this checks again
    that the cast cannot wrap."""
    info = np.iinfo(dtype)
    if a.size and (int(a.min()) < info.min or int(a.max()) > info.max):
        raise ValueError(f"values outside {np.dtype(dtype).name} reached a narrowing cast")
    return a.astype(dtype, copy=False)
