"""Predicted stall over several independent drives: a drive-level estimate for comparing placements.

Per forward and MoE layer, every expert the forward routes (its union over positions) that is
not pinned in RAM is loaded; :meth:`replay.model.storage.Storage.expert_reads` says which drive serves
each of its reads. A drive serving ``n`` reads of ``b`` bytes in all takes

    t_d = max(s / X_d(s, 1), b / X_d(s, min(W, n)))                     [s]

with ``s = b / n`` their mean size, ``W`` the reader workers and ``X_d`` the drive's steady rate
(:meth:`replay.model.device.ArrayProfile.steady_rate`'s formula: its queue model, its members, its host
link), and the layer waits for its slowest drive: ``T = max_d t_d``. Stall per committed token is
the sum of ``T`` over a session's layers over its committed tokens. The drives work in parallel;
nothing overlaps the demand loads (no prefetch, no compute overlap) and the page cache serves no
read, so the figure ranks placements over the same drives; the compiled timing model
(:mod:`replay.model.instance`) remains the one for a single array. Seconds, bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from containers.layout import Layout

from replay.model.device import queue_throughput
from replay.model.storage import Storage


@dataclass(frozen=True)
class ExpertTable:
    """Per expert and drive: ``bytes`` and ``reads`` [L, E, D] one load of it causes."""

    bytes: np.ndarray
    reads: np.ndarray


def expert_table(storage: Storage, layout: Layout) -> ExpertTable:
    """Where every expert's load lands (:meth:`Storage.expert_reads` for each)."""
    L, E, D = len(layout.layers), layout.n_experts, len(storage.drives)
    b = np.zeros((L, E, D), dtype=np.int64)
    n = np.zeros((L, E, D), dtype=np.int64)
    for li, layer in enumerate(layout.layers):
        for e in range(E):
            for d, size in storage.expert_reads(layer, e, layout.expert_loc[li, e]):
                b[li, e, d] += size
                n[li, e, d] += 1
    return ExpertTable(b, n)


def _rate(profile, size, depth):
    """:meth:`ArrayProfile.steady_rate` over arrays of sizes and depths (bytes/s)."""
    d = profile.drive
    per = queue_throughput(d.request_seconds, d.request_bandwidth, d.bandwidth, d.queue_slots, size / profile.members,
                           depth, d.max_request, shared=d.service == "shared",
                           request_channel_seconds=d.request_channel_seconds)
    return np.minimum(profile.members * per, profile.host_bandwidth)


def drive_seconds(profile, nbytes: np.ndarray, nreads: np.ndarray, workers: int) -> np.ndarray:
    """``t_d`` (the module docstring) for arrays of bytes and read counts; 0 where no read."""
    out = np.zeros(len(nbytes))
    some = nreads > 0
    if some.any():
        n = nreads[some].astype(float)
        b = nbytes[some].astype(float)
        s = b / n
        out[some] = np.maximum(s / _rate(profile, s, 1.0), b / _rate(profile, s, np.minimum(workers, n)))
    return out


@dataclass(frozen=True)
class SessionStall:
    """Per session [S]: ``stall_seconds`` summed over its forwards and layers, ``tokens`` committed."""

    sessions: list[str]
    stall_seconds: np.ndarray
    tokens: np.ndarray

    @property
    def per_token(self) -> float:
        """Stall per committed token over all sessions (s)."""
        return float(self.stall_seconds.sum() / max(self.tokens.sum(), 1))


def session_stall(trace, forwards: np.ndarray, layout: Layout, storage: Storage, table: ExpertTable,
                  pinned: np.ndarray | None = None, workers: int = 8) -> SessionStall:
    """The stall of the forwards ``forwards`` (bool [F]) per session, ``pinned`` [L, E] in RAM."""
    E = layout.n_experts
    lidx = {l: i for i, l in enumerate(layout.layers)}
    rows = forwards[trace.row_forward]
    fwd = trace.row_forward[rows].astype(np.int64)
    lmap = np.full(int(max(layout.layers)) + 1, -1, dtype=np.int64)
    for l, i in lidx.items():
        lmap[l] = i
    li = lmap[trace.row_layer[rows].astype(np.int64)]
    ex = trace.experts[rows].astype(np.int64)
    L = len(layout.layers)
    key = (fwd * L + li)[:, None] * E + ex
    sel = (ex >= 0) & (li[:, None] >= 0)
    keys = np.unique(key[sel])                                   # (forward, layer, expert), each once
    g = keys // E                                                # (forward, layer)
    e = keys % E
    layer = g % L
    if pinned is not None:
        keep = ~pinned[layer, e]
        g, e, layer = g[keep], e[keep], layer[keep]
    groups, inv = np.unique(g, return_inverse=True)
    T = np.zeros(len(groups))
    for d, prof in enumerate(storage.profiles):
        b = np.bincount(inv, weights=table.bytes[layer, e, d], minlength=len(groups))
        n = np.bincount(inv, weights=table.reads[layer, e, d], minlength=len(groups))
        T = np.maximum(T, drive_seconds(prof, b, n, workers))
    session_of = trace.fwd_session[groups // L]
    S = len(trace.sessions)
    stall = np.bincount(session_of, weights=T, minlength=S)
    tokens = np.bincount(trace.fwd_session[forwards], weights=trace.fwd_committed[forwards], minlength=S)
    return SessionStall(list(trace.sessions), stall, tokens)


def paired_interval(a: SessionStall, b: SessionStall, sessions: np.ndarray, draws: int = 2000, seed: int = 0,
                    level: float = 0.95) -> tuple[float, float, float]:
    """Stall per token of ``a`` minus ``b`` over ``sessions`` (indices), with a bootstrap interval
    over sessions (resampled together for both): ``(difference, low, high)``, s per token."""
    rng = np.random.default_rng(seed)
    sa, sb, tk = a.stall_seconds[sessions], b.stall_seconds[sessions], a.tokens[sessions]
    point = (sa.sum() - sb.sum()) / tk.sum()
    idx = rng.integers(0, len(sessions), size=(draws, len(sessions)))
    diffs = (sa[idx].sum(1) - sb[idx].sum(1)) / tk[idx].sum(1)
    lo, hi = np.quantile(diffs, [(1 - level) / 2, (1 + level) / 2])
    return float(point), float(lo), float(hi)


def ratio_interval(base: SessionStall, x: SessionStall, y: SessionStall, sessions: np.ndarray, draws: int = 2000,
                   seed: int = 0, level: float = 0.95) -> tuple[float, float, float]:
    """How many times the stall ``x`` removes from ``base`` exceeds what ``y`` removes, over
    ``sessions``, with a bootstrap interval over sessions: ``(ratio, low, high)``."""
    rng = np.random.default_rng(seed)
    s0, sx, sy = base.stall_seconds[sessions], x.stall_seconds[sessions], y.stall_seconds[sessions]
    point = (s0.sum() - sx.sum()) / (s0.sum() - sy.sum())
    idx = rng.integers(0, len(sessions), size=(draws, len(sessions)))
    r = (s0[idx].sum(1) - sx[idx].sum(1)) / (s0[idx].sum(1) - sy[idx].sum(1))
    lo, hi = np.quantile(r, [(1 - level) / 2, (1 + level) / 2])
    return float(point), float(lo), float(hi)


def speedup_interval(slow: SessionStall, fast: SessionStall, sessions: np.ndarray, draws: int = 2000, seed: int = 0,
                     level: float = 0.95) -> tuple[float, float, float]:
    """Stall per token of ``slow`` over that of ``fast`` on ``sessions``, with a bootstrap
    interval over sessions (resampled together): ``(ratio, low, high)``."""
    rng = np.random.default_rng(seed)
    a, b = slow.stall_seconds[sessions], fast.stall_seconds[sessions]
    idx = rng.integers(0, len(sessions), size=(draws, len(sessions)))
    r = a[idx].sum(1) / b[idx].sum(1)
    lo, hi = np.quantile(r, [(1 - level) / 2, (1 + level) / 2])
    return float(a.sum() / b.sum()), float(lo), float(hi)
