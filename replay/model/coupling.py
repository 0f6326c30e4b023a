"""Cross-layer coupling: which experts of layer L+dL follow an expert of layer L.

For the same (forward, position), expert ``e`` selected at layer L and expert ``f`` at layer
L+dL count one co-occurrence. The replay's coupled prefetch source (:mod:`replay.model.prefetch`)
learns its pair table from these counts, like colibrì's ``COUPLE`` reading ``.coli_pairs``
(exported by :func:`relayout.planning.coactivation.write_coli_pairs` from the same counts).

:func:`coupling_table` counts every consecutive layer pair in one pass over the rows, block by
block of whole forwards (:meth:`replay.model.routing.TraceSource.column_blocks`), so a trace streamed
from its file gives the table a trace in memory gives.
"""

from __future__ import annotations

import numpy as np

from containers.errors import InputError
from containers.layout import Layout

from replay.model.routing import RoutingTrace, TraceSource

COUPLED_TARGETS = 16
"""Successors kept per expert, as in the ``.coli_pairs`` file relayout exports for colibrì."""


def aligned_rows(trace: RoutingTrace, layer_a: int, layer_b: int, forwards: np.ndarray | None = None,
                 rows_a: np.ndarray | None = None, rows_b: np.ndarray | None = None):
    """Rows of ``layer_a`` and ``layer_b`` for the same (forward, position): two index arrays.

    ``rows_a``/``rows_b`` may pass the layers' row indices (ascending) when already known.
    """
    ra = trace.layer_rows(layer_a, forwards) if rows_a is None else rows_a
    rb = trace.layer_rows(layer_b, forwards) if rows_b is None else rows_b
    P = int(trace.row_position.max()) + 1 if trace.n_rows else 1
    ka = trace.row_forward[ra].astype(np.int64) * P + trace.row_position[ra]
    kb = trace.row_forward[rb].astype(np.int64) * P + trace.row_position[rb]
    # rows are sorted by (forward, layer, position), so a layer's keys rise strictly unless a
    # (forward, layer, position) is repeated, which RoutingTrace.validate refuses
    if (len(ka) > 1 and (np.diff(ka) <= 0).any()) or (len(kb) > 1 and (np.diff(kb) <= 0).any()):
        raise InputError(trace.source or None, "a (forward, layer, position) row appears twice or out of order")
    common, ia, ib = np.intersect1d(ka, kb, assume_unique=True, return_indices=True)
    return ra[ia], rb[ib]


def top_targets(X: np.ndarray, max_targets: int) -> tuple[np.ndarray, np.ndarray]:
    """Each row's ``max_targets`` largest non-zero counts of ``X`` [E, E], by count (descending)
    then id: ``(targets, counts)``, int64 [E, max_targets], padded with -1 and 0."""
    E = X.shape[0]
    order = np.lexsort((np.tile(np.arange(X.shape[1]), (E, 1)), -X), axis=1)[:, :max_targets]
    counts = np.take_along_axis(X, order, axis=1).astype(np.int64)
    targets = np.where(counts > 0, order, -1).astype(np.int64)
    pad = max_targets - targets.shape[1]       # fewer experts than targets asked for
    if pad > 0:
        targets = np.pad(targets, ((0, 0), (0, pad)), constant_values=-1)
        counts = np.pad(counts, ((0, 0), (0, pad)))
    return targets, counts


def layer_pair_counts(trace: TraceSource, forwards: np.ndarray, pairs: list[tuple[int, int]], n_experts: int) -> np.ndarray:
    """Counts [P, E, E] for each ``(layer_a, layer_b)`` of ``pairs``: expert e at ``layer_a`` with
    expert f at ``layer_b`` in the same (forward, position), over the rows of forward mask
    ``forwards`` [F], read once in blocks of whole forwards. ``n_experts``: E, at least the trace's."""
    E = n_experts
    out = np.zeros((len(pairs), E * E), dtype=np.int64)
    if not pairs:
        return out.reshape(0, E, E)
    names = ("row_forward", "row_layer", "row_position", "experts")
    for rf, rl, rp, ex in trace.column_blocks(names, whole_forwards=True):
        keep = forwards[rf]
        if not keep.any():
            continue
        rf, rl, rp, ex = rf[keep], rl[keep], rp[keep], ex[keep]
        # a layer's rows in (forward, position) order: a stable sort by layer keeps the trace's order
        by_layer = np.argsort(rl, kind="stable")
        sorted_layers = rl[by_layer]
        key = rf.astype(np.int64) * (int(rp.max()) + 1) + rp
        for i, (a, b) in enumerate(pairs):
            ra, rb = (by_layer[np.searchsorted(sorted_layers, x):np.searchsorted(sorted_layers, x, side="right")] for x in (a, b))
            _, ia, ib = np.intersect1d(key[ra], key[rb], assume_unique=True, return_indices=True)
            A = ex[ra[ia]].astype(np.int64)[:, :, None]
            B = ex[rb[ib]].astype(np.int64)[:, None, :]
            ok = (A >= 0) & (B >= 0)
            out[i] += np.bincount((A * E + B)[ok], minlength=E * E)
    return out.reshape(len(pairs), E, E)


def coupling_table(trace: TraceSource, forwards: np.ndarray, layout: Layout,
                   max_targets: int = COUPLED_TARGETS) -> tuple[np.ndarray, np.ndarray]:
    """The coupled prefetch source's table from the forwards of mask ``forwards`` (training sessions).

    Returns ``(targets, counts)``, int32 [L, E, max_targets]: for layout layer ``l`` and expert
    ``e``, the experts of layer ``l + 1`` that most often served the same position
    (:func:`layer_pair_counts`), best first (:func:`top_targets`), padded with -1 and 0; zero
    for a layer the trace does not route; one pass over the rows, in memory or streamed.
    """
    L, E = len(layout.layers), layout.n_experts
    targets = np.full((L, E, max_targets), -1, dtype=np.int32)
    counts = np.zeros((L, E, max_targets), dtype=np.int32)
    present = {int(x) for x in trace.layers}
    pairs = [(li, int(layout.layers[li]), int(layout.layers[li + 1])) for li in range(L - 1)
             if int(layout.layers[li]) in present and int(layout.layers[li + 1]) in present]
    X = layer_pair_counts(trace, forwards, [(a, b) for _, a, b in pairs], E)
    for (li, _, _), x in zip(pairs, X):
        targets[li], counts[li] = top_targets(x, max_targets)
    return targets, counts
