"""Co-activation statistics and graphs.

For one layer, a token's selected experts form a set; two experts *co-activate* when they are in
the same set. From the rows of a layer we count:

* ``heat[e]``: rows selecting ``e``;
* ``C[i, j]``: rows selecting both ``i`` and ``j`` (symmetric, zero diagonal).

Edge weights derived from them: ``count`` (C), ``lift`` = C N / (heat_i heat_j) and
``pmi`` = log2(lift). Graphs keep edges with count >= ``min_support``.

Cross-layer coupling counts, for the same (forward, position), expert ``e`` at layer L followed
by expert ``f`` at layer L+dL (:mod:`replay.model.coupling`, which the replay's coupled prefetch source
learns from); :func:`write_coli_pairs` exports them in colibrì's ``.coli_pairs`` format for the
runtime's coupled prefetch.

The dense [E, E] matrices are for planning and export, where E is a container's experts per
layer: :class:`LayerCounts` is one layer's, what ordering reads. Statistics use the sparse forms
(:func:`pair_count_items`, :func:`cross_layer_items`), whose memory grows with the rows, not with
E squared; :class:`PairCounts` is the sparse form of every layer's counts from one trace file (or
a pool of them, merged exactly), what pooled planning moves between machines.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from containers.errors import InputError
from replay.formats.colipairs import write_coli_pairs_lines
from replay.model.coupling import aligned_rows
from replay.model.routing import RoutingTrace

WEIGHTS = ("count", "lift", "pmi")


def pair_counts(experts: np.ndarray, n_experts: int) -> np.ndarray:
    """Symmetric co-activation counts [E, E] (int64) of rows ``experts`` [N, k] (-1 = padding)."""
    N, k = experts.shape
    C = np.zeros(n_experts * n_experts, dtype=np.int64)
    ex = experts.astype(np.int64)
    for a in range(k):
        for b in range(a + 1, k):
            i, j = ex[:, a], ex[:, b]
            ok = (i >= 0) & (j >= 0)
            C += np.bincount(i[ok] * n_experts + j[ok], minlength=n_experts * n_experts)
    C = C.reshape(n_experts, n_experts)
    C = C + C.T
    np.fill_diagonal(C, 0)
    return C


def _pair_items(i: np.ndarray, j: np.ndarray, n_experts: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    keys, counts = np.unique(i * n_experts + j, return_counts=True)
    return keys // n_experts, keys % n_experts, counts.astype(np.int64)


def pair_count_items(experts: np.ndarray, n_experts: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The non-zero upper triangle of :func:`pair_counts`, sparse: ``(i, j, count)`` with i < j,
    sorted by (i, j). Memory is O(rows x k^2) whatever ``n_experts``."""
    N, k = experts.shape
    ex = experts.astype(np.int64)
    ii, jj = [], []
    for a in range(k):
        for b in range(a + 1, k):
            x, y = ex[:, a], ex[:, b]
            ok = (x >= 0) & (y >= 0) & (x != y)
            ii.append(np.minimum(x[ok], y[ok]))
            jj.append(np.maximum(x[ok], y[ok]))
    if not ii:
        z = np.zeros(0, dtype=np.int64)
        return z, z, z
    return _pair_items(np.concatenate(ii), np.concatenate(jj), n_experts)


def heat_of(experts: np.ndarray, n_experts: int) -> np.ndarray:
    ex = experts[experts >= 0].astype(np.int64)
    return np.bincount(ex, minlength=n_experts)


def lift_matrix(C: np.ndarray, heat: np.ndarray, n_rows: int) -> np.ndarray:
    """Lift = P(i,j) / (P(i) P(j)); 0 where undefined."""
    h = heat.astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        L = C * float(n_rows) / np.outer(h, h)
    return np.nan_to_num(L, nan=0.0, posinf=0.0)


@dataclass
class LayerCounts:
    """Co-activation statistics of one layer's rows, all that ordering needs.

    ``pairs`` [E, E] int64: rows selecting both i and j (symmetric, zero diagonal);
    ``heat`` [E] int64: rows selecting each expert; ``rows``: rows counted.
    """

    pairs: np.ndarray
    heat: np.ndarray
    rows: int

    @classmethod
    def of_rows(cls, experts: np.ndarray, n_experts: int) -> "LayerCounts":
        """Counts of rows ``experts`` [N, k] (-1 = padding)."""
        return cls(pair_counts(experts, n_experts), heat_of(experts, n_experts), int(len(experts)))

    @property
    def n_experts(self) -> int:
        return len(self.heat)

    def runs_per_token(self, order: np.ndarray) -> float:
        """Mean contiguous runs per row of the counted rows in ``order``: mean |S| minus the
        co-activation weight of neighbours per row (the identity :mod:`relayout.planning.ordering` states;
        exact because a validated trace never selects an expert twice in a row)."""
        if self.rows == 0:
            return 0.0
        o = np.asarray(order)
        return float((self.heat.sum() - self.pairs[o[:-1], o[1:]].sum()) / self.rows)


def weight_matrix(counts: LayerCounts, weight: str = "count", min_support: int = 1) -> np.ndarray:
    """Edge weights [E, E] (float64, symmetric, zero diagonal) of the co-activation graph.

    Pairs co-selected fewer than ``min_support`` times (at least once) have no edge (weight 0);
    ``weight`` is ``count``, ``lift`` or ``pmi``; non-positive weights (PMI <= 0) are dropped,
    as Louvain needs positive weights.
    """
    if weight not in WEIGHTS:
        raise InputError(None, f"unknown edge weight {weight!r} (choose {', '.join(WEIGHTS)})")
    C = counts.pairs
    keep = C >= max(min_support, 1)
    if weight == "count":
        W = C.astype(np.float64)
    else:
        W = lift_matrix(C, counts.heat, counts.rows)
        if weight == "pmi":
            with np.errstate(divide="ignore"):
                W = np.where(W > 0, np.log2(np.where(W > 0, W, 1.0)), 0.0)
    W = np.where(keep & (W > 0), W, 0.0)
    np.fill_diagonal(W, 0.0)
    return W


def coactivation_graph(counts: LayerCounts, weight: str = "count", min_support: int = 1):
    """``networkx.Graph`` over all experts of a layer, edge attribute ``weight`` from
    :func:`weight_matrix`, node attribute ``heat``; built from the matrix in one call."""
    import networkx as nx  # planning only: the rest of the tool starts without it

    G = nx.from_numpy_array(weight_matrix(counts, weight, min_support))
    nx.set_node_attributes(G, {e: int(h) for e, h in enumerate(counts.heat)}, "heat")
    return G


@dataclass
class PairCounts:
    """Co-activation counts of several layers, sparse: what a trace file contributes to a plan.

    ``layers`` [L] the layers counted (every file of a pool counts the same list), ``rows`` [L]
    rows counted per layer, ``heat`` [L, E] selections per expert, and the non-zero upper
    triangle of every layer's pair counts: ``keys`` [P] (sorted, ``(layer index * E + i) * E + j``
    with i < j) and ``counts`` [P] (> 0). Memory grows with the distinct co-selected pairs, at most
    L x E (E - 1) / 2, whatever the number of rows; :meth:`merged` adds two files' counts.
    """

    layers: np.ndarray
    n_experts: int
    rows: np.ndarray
    heat: np.ndarray
    keys: np.ndarray
    counts: np.ndarray

    def merged(self, other: "PairCounts") -> "PairCounts":
        """The counts of both (the rows of both files), exact."""
        if not np.array_equal(self.layers, other.layers) or self.n_experts != other.n_experts:
            raise ValueError("pair counts of different layers or expert counts cannot be merged")
        keys = np.concatenate([self.keys, other.keys])
        order = np.argsort(keys, kind="stable")  # two sorted runs: a linear merge
        keys = keys[order]
        counts = np.concatenate([self.counts, other.counts])[order]
        first = np.flatnonzero(np.diff(keys, prepend=-1)) if len(keys) else np.zeros(0, dtype=np.int64)
        return PairCounts(self.layers, self.n_experts, self.rows + other.rows, self.heat + other.heat, keys[first],
                          np.add.reduceat(counts, first) if len(first) else counts[:0])

    def layer(self, index: int) -> LayerCounts:
        """Dense counts of the ``index``-th layer counted."""
        E = self.n_experts
        lo, hi = np.searchsorted(self.keys, [index * E * E, (index + 1) * E * E])
        C = np.zeros(E * E, dtype=np.int64)
        C[self.keys[lo:hi] - index * E * E] = self.counts[lo:hi]
        C = C.reshape(E, E)
        return LayerCounts(C + C.T, self.heat[index].copy(), int(self.rows[index]))


def count_pairs(trace: RoutingTrace, forwards: np.ndarray, layers: list[int], n_experts: int) -> PairCounts:
    """:class:`PairCounts` of the rows of ``forwards`` [F] (a mask) at each of ``layers``.

    ``n_experts`` may exceed the trace's (a container's experts per layer); layers the trace does
    not route count no rows.
    """
    E = n_experts
    traced = set(trace.layers.tolist())
    rows = np.zeros(len(layers), dtype=np.int64)
    heat = np.zeros((len(layers), E), dtype=np.int64)
    keys, counts = [], []
    for li, layer in enumerate(layers):
        if layer not in traced:
            continue
        ex = trace.experts[trace.layer_rows(layer, forwards)]
        rows[li] = len(ex)
        heat[li] = heat_of(ex, E)
        i, j, c = pair_count_items(ex, E)
        keys.append((li * E + i) * E + j)
        counts.append(c)
    z = np.zeros(0, dtype=np.int64)
    return PairCounts(np.asarray(layers, dtype=np.int64), E, rows, heat,
                      np.concatenate(keys) if keys else z, np.concatenate(counts) if counts else z)


def cross_layer_items(trace: RoutingTrace, ra: np.ndarray, rb: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sparse counts [E, E] of aligned rows ``ra``/``rb``: ``(e, f, count)`` sorted."""
    E, k = trace.n_experts, trace.top_k
    A = trace.experts[ra].astype(np.int64)
    B = trace.experts[rb].astype(np.int64)
    ii, jj = [], []
    for a in range(k):
        for b in range(k):
            i, j = A[:, a], B[:, b]
            ok = (i >= 0) & (j >= 0)
            ii.append(i[ok])
            jj.append(j[ok])
    if not ii:
        z = np.zeros(0, dtype=np.int64)
        return z, z, z
    return _pair_items(np.concatenate(ii), np.concatenate(jj), E)


def cross_layer_lift(trace: RoutingTrace, layer: int, dl: int = 1, min_count: int = 5,
                     rows_a: np.ndarray | None = None, rows_b: np.ndarray | None = None) -> np.ndarray:
    """Lifts of (e at L, f at L+dl) pairs with at least ``min_count`` co-occurrences, in (e, f) order.

    Sparse: memory grows with the aligned rows, not with the square of the experts per layer.
    """
    ra, rb = aligned_rows(trace, layer, layer + dl, rows_a=rows_a, rows_b=rows_b)
    if not len(ra):
        return np.zeros(0)
    e, f, X = cross_layer_items(trace, ra, rb)
    ha = heat_of(trace.experts[ra], trace.n_experts).astype(np.float64)
    hb = heat_of(trace.experts[rb], trace.n_experts).astype(np.float64)
    keep = X >= min_count
    return X[keep] * float(len(ra)) / (ha[e[keep]] * hb[f[keep]])


def write_coli_pairs(trace: RoutingTrace, path: str | os.PathLike, max_targets: int = 16, forwards: np.ndarray | None = None) -> int:
    """Write colibrì's ``.coli_pairs`` coupling table; returns the number of lines.

    Counted sparsely (memory grows with the rows, not with the square of the experts per layer).

    Format (:mod:`replay.formats.colipairs`): ``COLIPAIRS 1 <n_lines>`` then ``<L> <dL> <e> f1:c1
    f2:c2 ...`` with dL in {1, 2}, at most ``max_targets`` targets per line, raw counts, sorted by
    count (descending, then id).
    """
    trace.require_rows("a coupling table")
    layers = set(int(x) for x in trace.layers)
    lines = []
    for layer in sorted(layers):
        for dl in (1, 2):
            if layer + dl not in layers:
                continue
            ra, rb = aligned_rows(trace, layer, layer + dl, forwards)
            e, f, c = cross_layer_items(trace, ra, rb)
            # each source's strongest targets: count descending, then id (as top_targets), sparse
            order = np.lexsort((f, -c, e))
            e, f, c = e[order], f[order], c[order]
            start = np.flatnonzero(np.diff(e, prepend=-1))
            rank = np.arange(len(e)) - np.repeat(start, np.diff(np.append(start, len(e))))
            keep = rank < max_targets
            e, f, c = e[keep].tolist(), f[keep].tolist(), c[keep].tolist()
            i = 0
            while i < len(e):
                j = i
                while j < len(e) and e[j] == e[i]:
                    j += 1
                lines.append((layer, dl, e[i], [(f[t], c[t]) for t in range(i, j)]))
                i = j
    return write_coli_pairs_lines(path, lines)
