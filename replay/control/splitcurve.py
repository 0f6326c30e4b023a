"""S versus RAM for whole experts and for vertically split experts (experiment E3, hypothesis H3b).

**Whole experts.** At each RAM budget ``R`` (bytes) the runtime's default placement: no pins, the
per-layer LRU holds whole experts in all of ``R``.

**Split experts** (MoEpic-style: a resident top segment per chosen expert, its bottom fetched on a
miss). At each ``R`` the search replays, on the plan's training sessions, every candidate of

* a split ratio ``r`` from ``ratios`` (the FFN share of the top segment, rounded to whole
  quantisation groups by :func:`segment_sizes`; ``r = 0`` is no split), and
* a top share ``t`` from ``top_shares``: ``t x R`` bytes hold resident tops, the LRU holds whole
  experts in the remaining ``(1 - t) x R``;

with the tops chosen by stall value per byte: the replay of the training sessions with whole
experts and the LRU at ``(1 - t) x R`` gives each expert's wait right before its matmul
(``expert_wait``, seconds), a resident top removes the top's share of it, so the value of a top
is ``wait x top share / top bytes``, and tops are taken best value first across all layers while
they fit. The per-layer top budgets are what that global ranking gives each layer, not an even
split (MoEpic tunes per-layer budgets; here they follow the replayed value). The point of the
split curve at ``R`` is the candidate with the lowest training S, the whole-expert point (``r =
0``) included, so on the training sessions the split curve is never above the whole-expert curve
and, searched over ``r = 0`` alone, it *is* the whole-expert curve. Every chosen point is then
replayed on the held-out sessions: S with its 95% interval, the RAM hit rate beside it.

Accounting: a resident top costs its bytes (weights and scales, :class:`SegmentSizes`); a
resident-top expert that misses reads its bottom segment only, and its top matmul runs at once
(:mod:`replay.model.engine`). The same expert may also sit whole in the LRU; its top bytes are then
held twice, as the runtime change in ``docs/SPLIT_SEGMENTS.md`` would hold them.

References
----------
MoEpic: vertical expert splitting with a cached top segment.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from containers import records
from containers.errors import InputError
from containers.geometry import ExpertFormat

from replay.model.config import RuntimeConfig
from replay.model.device import ArrayProfile
from replay.model.engine import SplitState
from replay.evaluation.evidence import MIN_SESSIONS, sufficiency
from replay.evaluation.gate import (
    check_trace_matches,
    evaluation_forwards,
    held_out_evidence,
    run_layout,
    training_coupling,
)
from replay.formats.interval import Interval
from replay.model.metrics import summarize
from replay.control.placement import training_forwards
from replay.formats.planfile import Plan
from replay.control.splitsizes import segment_sizes, tops_by_wait
from replay.model.streaming import replay_steps
from replay.model.routing import RoutingTrace

RATIOS = (0.125, 0.25, 0.375, 0.5)
"""Split ratios the search replays by default (besides r = 0, always a candidate)."""
TOP_SHARES = (0.25, 0.5, 0.75, 1.0)
"""Shares of the RAM budget for resident tops the search replays by default."""
SPLIT_CURVE_FORMAT = "relayout.split-curve"


@dataclass(frozen=True)
class CurvePoint:
    """One point of a curve: the RAM budget and how it is used (bytes), the split ratio (0 = whole
    experts) and FFN rows of a top, the resident tops, S on the training sessions, and on the
    held-out sessions S with its 95% interval (seconds per committed token) and the RAM hit rate
    (union lookups served whole from RAM: pins or LRU; a resident top alone is not a hit); in memory
    only, ``resident`` [L, E] marks the experts whose tops are resident (None for whole experts)."""

    ram_bytes: int
    ratio: float
    top_rows: list[int]
    top_bytes: int
    lru_bytes: int
    resident_tops: int
    train_stall_per_token_s: float
    stall_per_token_s: Interval
    ram_hit_rate: float
    resident: np.ndarray | None = records.not_written()


@dataclass(frozen=True)
class SplitCurve:
    """The whole-expert and split-expert curves over the same RAM budgets, and the search behind them.

    Its JSON (``relayout split-curve --json``) is ``format`` then these fields, in this order."""

    device: str
    ratios: tuple[float, ...]
    top_shares: tuple[float, ...]
    training_sessions: int
    held_out_sessions: int
    sufficient: bool
    sufficiency: str
    candidate_replays: int
    whole: list[CurvePoint]
    split: list[CurvePoint]

    def to_json(self) -> dict:
        return {"format": SPLIT_CURVE_FORMAT, **records.to_json(self)}


@dataclass(frozen=True)
class _Candidate:
    ratio: float
    top_rows: list[int]
    top_bytes: int
    lru_bytes: int
    state: SplitState | None
    train_stall: float
    wait: np.ndarray


def split_curve(plan: Plan, trace: RoutingTrace, device: ArrayProfile, config: RuntimeConfig, ram_bytes: list[int],
                ratios: tuple[float, ...] = RATIOS, top_shares: tuple[float, ...] = TOP_SHARES, *, seed: int = 0,
                min_sessions: int = MIN_SESSIONS) -> SplitCurve:
    """Both curves at every budget of ``ram_bytes`` through the plan's (unsplit) layout (module doc).

    Parameters
    ----------
    plan : a plan without a split; its training sessions drive the search.
    trace : routing trace with the plan's training sessions and held-out ones.
    device : the device profile replayed.
    config : every other runtime knob (its RAM budgets are replaced).
    ram_bytes : RAM budgets, bytes (each above 0).
    ratios : split ratios to search, each in [0, 1) (0, no split, is always searched).
    top_shares : shares of the budget for resident tops to search, each in (0, 1].
    seed : the bootstrap's seed.
    min_sessions : held-out sessions a comparison needs.

    Returns
    -------
    :class:`SplitCurve`: the whole-expert and split-expert points at every budget.
    """
    if plan.split:
        raise InputError(plan.path, "the split curve searches splits itself; give a plan without --split-ratio")
    if not ram_bytes or any(r <= 0 for r in ram_bytes):
        raise InputError(None, "the split curve needs RAM budgets above 0")
    if any(not 0 <= r < 1 for r in ratios):
        raise InputError(None, f"split ratios must be in [0, 1) (got {list(ratios)})")
    if not top_shares or any(not 0 < t <= 1 for t in top_shares):
        raise InputError(None, f"top shares must be in (0, 1] (got {list(top_shares)})")
    check_trace_matches(trace, plan)
    layout, g = plan.layout, plan.geometry
    train = training_forwards(trace, plan)
    held_mask, held = evaluation_forwards(trace, [plan])
    units = np.array(held.evaluated)
    coupling = training_coupling(trace, plan) if config.prefetch == "coupled" else None
    ffn = g.moe_intermediate_size
    fmts = [ExpertFormat.parse(g.expert_formats[layer]) for layer in layout.layers]
    L, E = len(layout.layers), layout.n_experts
    replays = 0

    def train_run(lru_bytes: int, state: SplitState | None):
        nonlocal replays
        replays += 1
        cfg = replace(config, ram_bytes=lru_bytes, pin_bytes=0)
        r = replay_steps(trace, train, layout, device, cfg, None, state, coupling)
        return summarize(r.steps, r.usage, cfg.other_seconds_per_token).stall_per_token_s, r.expert_wait

    def held_point(R: int, c: _Candidate):
        run = run_layout("split" if c.state is not None else "whole", trace, held_mask, layout, device,
                         replace(config, ram_bytes=c.lru_bytes, pin_bytes=0), np.zeros((L, E), dtype=bool), c.state, coupling=coupling)
        ev = held_out_evidence(run, None, units, seed)
        return CurvePoint(ram_bytes=R, ratio=c.ratio, top_rows=c.top_rows, top_bytes=c.top_bytes, lru_bytes=c.lru_bytes,
                          resident_tops=0 if c.state is None else int(c.state.resident.sum()),
                          train_stall_per_token_s=c.train_stall, stall_per_token_s=Interval(*ev.interval()),
                          ram_hit_rate=run.summary.ram_hit_rate,
                          resident=None if c.state is None else c.state.resident), ev

    sizes = {r: [segment_sizes(f, g.hidden_size, ffn, r) for f in fmts] for r in sorted(set(ratios) - {0.0})}
    whole_pts, split_pts = [], []
    for R in ram_bytes:
        s0, w0 = train_run(R, None)
        whole = _Candidate(0.0, [0] * L, 0, R, None, s0, w0)
        best = whole
        for t in top_shares:
            budget = int(t * R)
            s_lru, wait = (s0, w0) if budget == 0 else train_run(R - budget, None)
            for r, sz in sizes.items():
                top = np.array([s.top_bytes for s in sz], dtype=np.float64)
                frac = np.array([s.top_rows / ffn for s in sz])
                resident = tops_by_wait(wait, frac, top, budget)
                if not resident.any():
                    continue
                used = int((resident.sum(axis=1) * top).sum())
                state = SplitState(resident, frac)
                s, _ = train_run(R - budget, state)
                cand = _Candidate(r, [x.top_rows for x in sz], used, R - budget, state, s, wait)
                if s < best.train_stall:
                    best = cand
        point, probe = held_point(R, whole)
        whole_pts.append(point)
        split_pts.append(point if best is whole else held_point(R, best)[0])
    ok, why = sufficiency(probe, min_sessions, verdict=False)
    n_train = len(np.unique(trace.fwd_session[train]))
    return SplitCurve(device=device.name, ratios=tuple(ratios), top_shares=tuple(top_shares), training_sessions=n_train,
                      held_out_sessions=len(units), sufficient=ok, sufficiency=why, candidate_replays=replays,
                      whole=whole_pts, split=split_pts)


__all__ = ["CurvePoint", "RATIOS", "SPLIT_CURVE_FORMAT", "SplitCurve", "TOP_SHARES", "split_curve"]
