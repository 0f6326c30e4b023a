"""Cross-layer coupling: which experts of layer L+dL follow an expert of layer L.

For the same (forward, position), expert ``e`` selected at layer L and expert ``f`` at layer
L+dL count one co-occurrence. The replay's coupled prefetch source (:mod:`replay.prefetch`)
learns its pair table from these counts, like colibrì's ``COUPLE`` reading ``.coli_pairs``
(exported by :func:`relayout.coactivation.write_coli_pairs` from the same counts).
"""

from __future__ import annotations

import numpy as np

from containers.errors import InputError

from .trace import RoutingTrace


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


def cross_layer_counts(trace: RoutingTrace, layer: int, dl: int, forwards: np.ndarray | None = None) -> np.ndarray:
    """Counts [E, E]: expert e at ``layer`` with expert f at ``layer + dl`` in the same position."""
    E, k = trace.n_experts, trace.top_k
    ra, rb = aligned_rows(trace, layer, layer + dl, forwards)
    A = trace.experts[ra].astype(np.int64)
    B = trace.experts[rb].astype(np.int64)
    out = np.zeros(E * E, dtype=np.int64)
    for a in range(k):
        for b in range(k):
            i, j = A[:, a], B[:, b]
            ok = (i >= 0) & (j >= 0)
            out += np.bincount(i[ok] * E + j[ok], minlength=E * E)
    return out.reshape(E, E)


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
