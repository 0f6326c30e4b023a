"""``relayout trace stats``: the routing structure a layout can exploit, with its sample sizes.
Per layer: heat entropy (bits; log2(E) means uniform), the within-layer lift distribution of pairs
seen at least ``min_count`` times, the lift from layer L to L+1 for the same position, and the
reuse distance (forwards between two uses of the same expert at the same layer). Bounded for any
trace :func:`replay.formats.trace.load_trace` accepts: pair statistics are sparse (memory grows
with the rows, not with the square of the experts per layer), one layer's rows are worked on at a
time (found by a pass over the row layers, so nothing is as large as the whole trace's rows but
the trace itself, whose gates stay in the file), and arrays indexed by expert are O(experts per
layer).
"""

from __future__ import annotations

import numpy as np

from replay.model.routing import FORWARD_KINDS, RoutingTrace

from relayout.planning.coactivation import aligned_rows, cross_layer_items, heat_of, pair_count_items
from .synth import entropy_bits


def _q(x: np.ndarray, qs=(50, 90, 99)) -> dict:
    if not len(x):
        return {f"p{q}" if q != 50 else "median": None for q in qs}
    v = np.percentile(x, qs)
    return {("median" if q == 50 else f"p{q}"): round(float(val), 4) for q, val in zip(qs, v)}


def reuse_distances(trace: RoutingTrace, layer: int, rows: np.ndarray | None = None) -> np.ndarray:
    """Forwards between consecutive uses of the same expert at ``layer`` (within a session).

    ``rows`` may pass the layer's row indices when already known.
    """
    if rows is None:
        rows = trace.layer_rows(layer)
    ex = trace.experts[rows].astype(np.int64)
    fw = np.repeat(trace.row_forward[rows].astype(np.int64), ex.shape[1])
    ss = trace.fwd_session[fw]
    e = ex.ravel()
    ok = e >= 0
    e, fw, ss = e[ok], fw[ok], ss[ok]
    order = np.lexsort((fw, e, ss))
    e, fw, ss = e[order], fw[order], ss[order]
    same = (e[1:] == e[:-1]) & (ss[1:] == ss[:-1])
    d = fw[1:] - fw[:-1]
    return d[same & (d > 0)]


def layer_rows_in_turn(trace: RoutingTrace):
    """``(layer, rows, next layer's rows or None)`` for every layer of ``trace`` in order, the row
    indices ascending; at most two layers' indices exist at a time (one pass over ``row_layer``
    per layer, instead of a sort index as large as the trace's rows)."""
    layers = trace.layers.tolist()
    rows = trace.layer_rows(layers[0]) if layers else None
    for i, layer in enumerate(layers):
        following = trace.layer_rows(layers[i + 1]) if i + 1 < len(layers) else None
        yield layer, rows, following if i + 1 < len(layers) and layers[i + 1] == layer + 1 else None
        rows = following


PAIR_BLOCK_ROWS = 1 << 16
"""Rows counted at a time for pair statistics: their working arrays grow with k^2 per row, so a
layer's rows are counted in blocks and the sparse counts merged."""


def _in_blocks(count, n_rows: int, n_experts: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sparse ``(i, j, count)`` sorted by (i, j), summed over ``count(rows)`` of consecutive blocks
    of ``PAIR_BLOCK_ROWS`` row indices 0..n_rows-1 (each returns the same kind of triple)."""
    keys, counts = np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    for r0 in range(0, max(n_rows, 1), PAIR_BLOCK_ROWS):
        i, j, c = count(slice(r0, r0 + PAIR_BLOCK_ROWS))
        keys, inverse = np.unique(np.concatenate([keys, i * n_experts + j]), return_inverse=True)
        counts = np.bincount(inverse, weights=np.concatenate([counts, c]), minlength=len(keys)).astype(np.int64)
    return keys // n_experts, keys % n_experts, counts


def _within_layer_lifts(ex: np.ndarray, n_experts: int, heat: np.ndarray, n_rows: int, min_count: int) -> np.ndarray:
    """Lifts C N / (heat_i heat_j) of the pairs i < j seen at least ``min_count`` times, (i, j) order."""
    i, j, c = _in_blocks(lambda rows: pair_count_items(ex[rows], n_experts), len(ex), n_experts)
    keep = c >= max(min_count, 1)
    h = heat.astype(np.float64)
    return c[keep] * float(n_rows) / (h[i[keep]] * h[j[keep]])


def _cross_layer_lifts(trace: RoutingTrace, layer: int, rows: np.ndarray, next_rows: np.ndarray, min_count: int) -> np.ndarray:
    """:func:`relayout.planning.coactivation.cross_layer_lift` from ``layer`` to the next, counted in blocks."""
    ra, rb = aligned_rows(trace, layer, layer + 1, rows_a=rows, rows_b=next_rows)
    if not len(ra):
        return np.zeros(0)
    e, f, X = _in_blocks(lambda b: cross_layer_items(trace, ra[b], rb[b]), len(ra), trace.n_experts)
    ha = heat_of(trace.experts[ra], trace.n_experts).astype(np.float64)
    hb = heat_of(trace.experts[rb], trace.n_experts).astype(np.float64)
    keep = X >= min_count
    return X[keep] * float(len(ra)) / (ha[e[keep]] * hb[f[keep]])


def trace_stats(trace: RoutingTrace, min_count: int = 5) -> dict:
    """All statistics of ``trace`` as a JSON-ready dict.

    Parameters
    ----------
    trace : RoutingTrace
        The trace (rows read layer by layer; its gates are never read).
    min_count : int
        Pairs seen fewer times are left out of the lift distributions.

    Returns
    -------
    dict
        The trace's counts, ``layers`` (per layer: heat entropy in bits, rows, sessions, experts
        seen, lift quantiles over the pairs supported, cross-layer lift, reuse distance in
        forwards) and, for a trace with rows, their medians in ``summary``.
    """
    kinds = {k: int((trace.fwd_kind == i).sum()) for i, k in enumerate(FORWARD_KINDS)}
    out = {
        "source": trace.source,
        "geometry": trace.geometry,
        "sessions": len(trace.sessions),
        "forwards": trace.n_forwards,
        "forwards_by_kind": {k: v for k, v in kinds.items() if v},
        "committed_tokens": int(trace.fwd_committed.sum()),
        "decode_forwards": int((trace.fwd_kind != FORWARD_KINDS.index("prefill")).sum()),
        "committed_assumed": trace.meta.get("committed_assumed"),
        "committed_from_runtime_output": len(trace.meta.get("committed_from_runtime_output", [])),
        "mtp_layers": sorted({x for c in trace.meta.get("session_counts", {}).values() for x in c.get("mtp_layers", [])}),
        "rows": trace.n_rows,
        "selections": trace.n_selections if not trace.heat_only else int(trace.heat.sum()),
        "n_experts": trace.n_experts,
        "top_k": trace.top_k,
        "heat_only": trace.heat_only,
        "layers": [],
    }
    if trace.heat_only:
        for li, layer in enumerate(trace.layers.tolist()):
            out["layers"].append({"layer": layer,
                                  "heat_entropy_bits": round(float(entropy_bits(trace.heat[li].astype(float))), 4),
                                  "selections": int(trace.heat[li].sum())})
    for layer, rows, next_rows in ([] if trace.heat_only else layer_rows_in_turn(trace)):
        entry = {"layer": layer}
        ex = trace.experts[rows].astype(np.int64)
        heat = heat_of(ex, trace.n_experts)
        lifts = _within_layer_lifts(ex, trace.n_experts, heat, len(rows), min_count)
        entry.update(
            rows=int(len(rows)),
            sessions=int(len(np.unique(trace.fwd_session[trace.row_forward[rows]]))),
            heat_entropy_bits=round(float(entropy_bits(heat.astype(float))), 4),
            experts_seen=int((heat > 0).sum()),
            pairs_supported=int(len(lifts)),
            lift=_q(lifts),
            reuse_distance=_q(reuse_distances(trace, layer, rows).astype(float)),
        )
        if next_rows is not None:
            entry["cross_layer_lift"] = _q(_cross_layer_lifts(trace, layer, rows, next_rows, min_count))
        out["layers"].append(entry)
    if not trace.heat_only and out["layers"]:
        def med(key, sub):
            vals = [l[key][sub] for l in out["layers"] if key in l and l[key][sub] is not None]
            return round(float(np.median(vals)), 4) if vals else None
        out["summary"] = {
            "heat_entropy_bits_median": round(float(np.median([l["heat_entropy_bits"] for l in out["layers"]])), 4),
            "max_entropy_bits": round(float(np.log2(trace.n_experts)), 4),
            "lift_median": med("lift", "median"), "lift_p90": med("lift", "p90"), "lift_p99": med("lift", "p99"),
            "cross_layer_lift_median": med("cross_layer_lift", "median"), "cross_layer_lift_p99": med("cross_layer_lift", "p99"),
            "reuse_distance_median": med("reuse_distance", "median"),
        }
    return out


