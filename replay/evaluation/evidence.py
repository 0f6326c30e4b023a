"""What a gate verdict rests on: held-out sessions chosen by content, the resampling units, the
interval, and whether there is enough of it for a verdict at all.

Held out by content
    A plan records a fingerprint of each training session's routing
    (:meth:`replay.model.routing.TraceSource.session_fingerprints`, the same from memory or from the
    file). A session of the evaluated trace whose fingerprint matches one of them is excluded
    whatever it is called; names are labels only. A plan without fingerprints is matched by
    session name, and the record says so.

Units and interval
    With at least :data:`SESSION_UNITS` held-out sessions the unit of resampling is the session:
    a paired bootstrap over sessions of ``dS = (sum W_base - sum W_new) / sum A``. With fewer, the
    units are contiguous blocks of steps inside sessions (a moving-block bootstrap; block length
    ``round(n ** (1/3))`` steps, Hall, Horowitz and Jing 1995, capped by the shortest session), so
    the dependence between neighbouring steps is kept.

Enough evidence or no verdict
    Fewer held-out sessions than ``min_sessions`` (default :data:`MIN_SESSIONS`, five
    paired repetitions), or fewer than :data:`MIN_BLOCKS` blocks, gives the verdict
    ``insufficient``: no pass, no fail. The record keeps every unit's values, the seed, the
    resample count, the method and the block length, so :func:`recheck` recomputes the
    interval and the verdict from the record alone.

References
    P. Hall, J. L. Horowitz, B.-Y. Jing, "On blocking rules for the bootstrap with dependent
    data", Biometrika 82 (1995). S. Holm, "A simple sequentially rejective multiple test
    procedure", Scand. J. Statist. 6 (1979).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from containers.errors import InputError

from replay.evaluation.stats import LEVEL, RESAMPLES
from replay.formats.gatefile import GateEvidence, GateRecord
from replay.formats.planfile import Plan
from replay.model.routing import FORWARD_KINDS, TraceSource

SESSION_UNITS = 5
"""Held-out sessions from which the session is the unit of resampling."""
MIN_SESSIONS = 5
"""Default held-out sessions a verdict needs (``--min-sessions``): at least five paired repetitions."""
DEFAULT_THRESHOLD = 0.05
"""Default share of the baseline's TPOT the gate's interval must save at its low end (``--threshold``)."""
MIN_BLOCKS = 10
"""Blocks of steps a block-bootstrap verdict needs."""
MAX_RESAMPLES = 10**6
"""The most bootstrap resamples a stored record may ask for."""
MAX_DRAWS = 50_000_000
"""The most units all resamples of a stored record may draw together (each draw is an index in memory)."""
MAX_UNIT_SECONDS = 1e12
"""The largest stall (s) one stored unit may hold."""


@dataclass(frozen=True)
class HeldOut:
    """Which sessions of a trace are evaluated, which trained the plan, and why each exclusion."""

    evaluated: list[int]
    training: list[int]
    excluded: dict[str, str]
    matched_by: str                  # "content" or "name"


def split_sessions_by_content(trace: TraceSource, plans: list[Plan]) -> HeldOut:
    """Sessions of ``trace`` that trained any of ``plans`` (by routing content) and the rest.

    Parameters
    ----------
    trace : the evaluated routing trace.
    plans : the plans whose training sessions are excluded.

    Returns
    -------
    :class:`HeldOut`: evaluated and training session indices, and why each exclusion.
    """
    fps = trace.session_fingerprints()
    training: set[int] = set()
    excluded: dict[str, str] = {}
    by_name = False
    for plan in plans:
        known = plan.training_fingerprints
        if known is None:
            by_name = True
            names = set(plan.training_sessions)
            for i, s in enumerate(trace.sessions):
                if s in names:
                    training.add(i)
                    excluded[s] = "named like a training session (the plan has no content fingerprints: re-plan to check by content)"
            continue
        first = {}
        for name, fp in zip(plan.training_sessions, known):
            first.setdefault(fp, name)
        for i, fp in enumerate(fps):
            if fp in first:
                training.add(i)
                excluded[trace.sessions[i]] = f"same routing as training session {first[fp]!r}"
    evaluated = [i for i in range(len(trace.sessions)) if i not in training]
    return HeldOut(evaluated, sorted(training), excluded, "name" if by_name else "content")


def evaluation_mask(trace: TraceSource, sessions: list[int]) -> np.ndarray:
    """Decode and verify forwards of ``sessions`` (prefill excluded).

    Parameters
    ----------
    trace : the routing trace.
    sessions : session indices (:attr:`HeldOut.evaluated`).

    Returns
    -------
    Boolean mask [F] over the trace's forwards; a one-line :class:`InputError` when empty.
    """
    if not sessions:
        raise InputError(trace.source or None, "every session of this trace has the routing of a session the plan was "
                         "trained on; replay needs held-out sessions (record more, or plan with a smaller --train-fraction)")
    mask = trace.session_forward_mask(sessions) & (trace.fwd_kind != FORWARD_KINDS.index("prefill"))
    if not mask.any():
        raise InputError(trace.source or None, "held-out sessions contain no decode steps")
    return mask


@dataclass
class Evidence:
    """Paired per-unit totals and how they are resampled. Seconds and committed tokens.

    ``method`` is ``"session"`` (one unit per held-out session) or ``"moving-block"`` (one unit
    per step, resampled in blocks of ``block_steps`` that never cross ``unit_session``).
    """

    method: str
    base: np.ndarray
    new: np.ndarray
    tokens: np.ndarray
    n_sessions: int
    seed: int = 0
    resamples: int = RESAMPLES
    block_steps: int | None = None
    unit_session: np.ndarray | None = None
    _replicates: np.ndarray | None = field(default=None, repr=False)

    @property
    def n_blocks(self) -> int:
        """Blocks one resample draws (sessions for the session method)."""
        if self.method == "session":
            return len(self.base)
        return int(np.ceil(len(self.base) / self.block_steps))

    def estimate(self) -> float:
        return float((self.base.sum() - self.new.sum()) / self.tokens.sum())

    def replicates(self) -> np.ndarray:
        """The bootstrap replicates of the saving (computed once; deterministic given the seed)."""
        if self._replicates is None:
            rng = np.random.default_rng(self.seed)
            if self.method == "session":
                n = len(self.base)
                idx = rng.integers(0, n, size=(self.resamples, n))
                b, p, a = self.base[idx].sum(axis=1), self.new[idx].sum(axis=1), self.tokens[idx].sum(axis=1)
            else:
                b, p, a = self._block_sums(rng)
            self._replicates = (b - p) / np.maximum(a, 1e-12)
        return self._replicates

    def _block_sums(self, rng) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        ell = self.block_steps
        starts = self.block_starts()
        draws = rng.choice(starts, size=(self.resamples, self.n_blocks), replace=True)
        out = []
        for x in (self.base, self.new, self.tokens):
            cs = np.concatenate([[0.0], np.cumsum(x)])
            out.append((cs[draws + ell] - cs[draws]).sum(axis=1))
        return out[0], out[1], out[2]

    def block_starts(self) -> np.ndarray:
        """Steps a moving block may start at: step ``i`` when steps ``i .. i + block_steps - 1`` are in one session."""
        ell, n, session = self.block_steps, len(self.base), self.unit_session
        same = np.zeros(n, dtype=bool)
        if n >= ell:
            same[: n - ell + 1] = session[ell - 1:] == session[: n - ell + 1]
        return np.flatnonzero(same)

    def interval(self) -> tuple[float, float, float]:
        """(estimate, low, high): the 95% percentile interval of the replicates."""
        lo, hi = np.percentile(self.replicates(), [50 * (1 - LEVEL), 100 - 50 * (1 - LEVEL)])
        return self.estimate(), float(lo), float(hi)

    def p_below(self, need: float) -> float:
        """One-sided bootstrap p-value of "saving < need" (the share of replicates below ``need``)."""
        return float((self.replicates() < need).mean())

    def to_json(self) -> dict:
        out = {"method": self.method, "seed": self.seed, "resamples": self.resamples, "level": LEVEL,
               "n_sessions": self.n_sessions, "block_steps": self.block_steps,
               "units": {"baseline_stall_s": self.base.tolist(), "plan_stall_s": self.new.tolist(),
                         "committed_tokens": self.tokens.tolist()}}
        if self.unit_session is not None:
            out["units"]["session"] = self.unit_session.tolist()
        return out

    @classmethod
    def from_record(cls, rec: GateEvidence, where: str) -> "Evidence":
        """The evidence a gate record stores (typed by :class:`~replay.formats.gatefile.GateEvidence`),
        range-checked before anything is allocated: unit values finite (stalls within
        :data:`MAX_UNIT_SECONDS`, committed tokens positive), the seed of 0 to 2^63 - 1,
        ``resamples`` 1 to :data:`MAX_RESAMPLES` and at most :data:`MAX_DRAWS` draws in all, a
        moving-block record's block length within its units and its session ids of 0 to 2^31 - 1."""
        try:
            u = rec.units
            arrays = [np.asarray(x, dtype=np.float64) for x in (u.baseline_stall_s, u.plan_stall_s, u.committed_tokens)]
            if len({len(a) for a in arrays}) != 1 or not len(arrays[0]) or not all(np.isfinite(a).all() for a in arrays):
                raise ValueError("unit arrays differ in length, are empty or hold non-finite numbers")
            n = len(arrays[0])
            if (np.abs(arrays[0]) > MAX_UNIT_SECONDS).any() or (np.abs(arrays[1]) > MAX_UNIT_SECONDS).any():
                raise ValueError(f"a unit's stall is beyond {MAX_UNIT_SECONDS:g} s")
            if not (arrays[2] > 0).all():
                raise ValueError("every unit must commit a positive number of tokens")
            method, ell = rec.method, rec.block_steps
            if method not in ("session", "moving-block"):
                raise ValueError(f"unknown method {method!r}")
            for name, v, lo, hi in (("seed", rec.seed, 0, 2**63 - 1), ("resamples", rec.resamples, 1, MAX_RESAMPLES),
                                    ("n_sessions", rec.n_sessions, 1, n)):
                if not lo <= v <= hi:
                    raise ValueError(f"{name} is {v!r}, not an integer of {lo} to {hi}"[:160])
            session = None
            if method == "moving-block":
                ids = u.session
                if ids is None or len(ids) != n or not all(0 <= x < 2**31 for x in ids):
                    raise ValueError("a moving-block record needs a session id (an integer of 0 to 2^31 - 1) per step")
                session = np.asarray(ids, dtype=np.int64)
                if ell is None or not 1 <= ell <= n:
                    raise ValueError(f"block_steps is {ell!r}, not an integer of 1 to the {n} units"[:160])
                if n - ell + 1 > 0 and not (session[ell - 1:] == session[: n - ell + 1]).any():
                    raise ValueError(f"no block of {ell} steps lies within one session")
            draws = rec.resamples * (n if method == "session" else -(-n // ell))
            if draws > MAX_DRAWS:
                raise ValueError(f"{rec.resamples} resamples of {draws // rec.resamples} units draw {draws:,} units; at most "
                                 f"{MAX_DRAWS:,} are drawn")
            return cls(method, *arrays, rec.n_sessions, rec.seed, rec.resamples, ell if method == "moving-block" else None, session)
        except (TypeError, ValueError, OverflowError) as exc:
            raise InputError(where, f"gate record's evidence is malformed ({exc})") from None


def session_evidence(base: np.ndarray, new: np.ndarray, tokens: np.ndarray, seed: int = 0) -> Evidence:
    """Session units: one (baseline stall, plan stall, committed tokens) per held-out session.

    Parameters
    ----------
    base, new : per-session stall of the two layouts, seconds.
    tokens : per-session committed tokens.
    seed : the bootstrap's seed.

    Returns
    -------
    :class:`Evidence` with method ``session``.
    """
    return Evidence("session", *(np.asarray(x, dtype=np.float64) for x in (base, new, tokens)), len(base), seed)


def block_evidence(base: np.ndarray, new: np.ndarray, tokens: np.ndarray, session: np.ndarray, seed: int = 0) -> Evidence:
    """Step units resampled in contiguous blocks inside sessions (steps in time order).

    Parameters
    ----------
    base, new : per-step stall of the two layouts, seconds.
    tokens : per-step committed tokens.
    session : per-step session id.
    seed : the bootstrap's seed.

    Returns
    -------
    :class:`Evidence` with method ``moving-block`` and block length ``round(n ** (1/3))`` steps,
    capped by the shortest session.
    """
    session = np.asarray(session, dtype=np.int64)
    lengths = np.bincount(np.unique(session, return_inverse=True)[1])
    ell = int(max(1, min(round(len(session) ** (1 / 3)), lengths.min())))
    return Evidence("moving-block", *(np.asarray(x, dtype=np.float64) for x in (base, new, tokens)), len(lengths), seed,
                    block_steps=ell, unit_session=session)


@dataclass(frozen=True)
class Verdict:
    """``pass``, ``fail`` or ``insufficient``, and why (``sufficiency`` says what was missing)."""

    verdict: str
    sufficient: bool
    sufficiency: str


def resampling_method(n_sessions: int) -> str:
    """How held-out evidence over ``n_sessions`` sessions is resampled: ``"session"`` from
    :data:`SESSION_UNITS` sessions on, else ``"moving-block"`` (blocks of steps inside sessions).

    >>> resampling_method(SESSION_UNITS), resampling_method(SESSION_UNITS - 1)
    ('session', 'moving-block')
    """
    return "session" if n_sessions >= SESSION_UNITS else "moving-block"


def sufficiency(ev: Evidence, min_sessions: int = MIN_SESSIONS, *, verdict: bool = True) -> tuple[bool, str]:
    """Whether ``ev`` holds enough held-out evidence, and in words.

    Parameters
    ----------
    ev : the paired evidence.
    min_sessions : held-out sessions needed (``--min-sessions``).
    verdict : True for a verdict (also at least :data:`MIN_BLOCKS` blocks for block evidence);
        False for a comparison table that gives no verdict (sessions only).

    Returns
    -------
    ``(sufficient, words)``: the words say what was missing, or what the evidence is.
    """
    if ev.n_sessions < min_sessions:
        if not verdict:
            return False, f"only {ev.n_sessions} held-out session(s); a comparison needs at least {min_sessions}"
        return False, f"only {ev.n_sessions} held-out session(s); a verdict needs at least {min_sessions} (--min-sessions)"
    if verdict and ev.method == "moving-block" and ev.n_blocks < MIN_BLOCKS:
        return False, f"only {ev.n_blocks} blocks of {ev.block_steps} steps; a verdict needs at least {MIN_BLOCKS}"
    return True, (f"{ev.n_sessions} held-out sessions" if ev.method == "session" else
                  f"{ev.n_sessions} held-out session(s) in {ev.n_blocks} blocks of {ev.block_steps} steps")


def judge(ev: Evidence, need: float, min_sessions: int = MIN_SESSIONS) -> Verdict:
    """The verdict the evidence supports for a required saving of ``need`` seconds per token.

    Parameters
    ----------
    ev : the paired evidence.
    need : the saving the lower end of the 95% interval must reach, seconds per committed token.
    min_sessions : held-out sessions a verdict needs.

    Returns
    -------
    :class:`Verdict`: ``insufficient`` when :func:`sufficiency` says so, else ``pass`` when the
    interval's low end is at least ``need``, else ``fail``.
    """
    sufficient, how = sufficiency(ev, min_sessions)
    if not sufficient:
        return Verdict("insufficient", False, how)
    _, low, _ = ev.interval()
    return Verdict("pass" if low >= need else "fail", True, how)


def holm(p_values: list[float], alpha: float) -> list[bool]:
    """Holm's step-down procedure: which hypotheses are rejected at family-wise level ``alpha``.

    Parameters
    ----------
    p_values : one p-value per hypothesis.
    alpha : the family-wise error level.

    Returns
    -------
    One boolean per hypothesis, in the order given: True where it is rejected.

    >>> holm([0.01, 0.04, 0.03], 0.05)
    [True, False, False]
    >>> holm([0.01, 0.02], 0.05)
    [True, True]
    """
    order = np.argsort(p_values, kind="stable")
    m = len(p_values)
    out = [False] * m
    for rank, i in enumerate(order):
        if p_values[i] > alpha / (m - rank):
            break
        out[i] = True
    return out


__all__ = ["DEFAULT_THRESHOLD", "Evidence", "HeldOut", "MIN_BLOCKS", "MIN_SESSIONS", "SESSION_UNITS", "Verdict", "block_evidence",
           "evaluation_mask", "holm", "judge", "recheck", "recheck_fields", "resampling_method", "session_evidence", "split_sessions_by_content",
           "sufficiency"]


def recheck_fields(gate: GateRecord, where: str) -> list[tuple[str, str]]:
    """Recompute a gate record's interval and verdict from its stored evidence.

    Parameters
    ----------
    gate : the record.
    where : the record's file, for errors.

    Returns
    -------
    ``(field, difference)`` pairs, empty when the record is consistent: same interval (the
    bootstrap is deterministic given the stored seed and resample count) and same verdict for
    the stored threshold. ``field`` is the record's field that does not recompute
    (``saving_per_token_s`` or ``verdict``).
    """
    ev = Evidence.from_record(gate.evidence, where)
    got = ev.interval()
    verdict = judge(ev, gate.threshold.seconds_per_token, gate.evidence.min_sessions).verdict
    s = gate.saving_per_token_s
    stored = (s.estimate, s.low, s.high)
    problems = []
    if not np.allclose(got, stored, rtol=1e-9, atol=1e-15):
        problems.append(("saving_per_token_s",
                         f"interval recomputed from the units is {got[0]:.6g} [{got[1]:.6g}, {got[2]:.6g}] s/token, the "
                         f"record says {stored[0]:.6g} [{stored[1]:.6g}, {stored[2]:.6g}]"))
    if verdict != gate.verdict:
        problems.append(("verdict", f"verdict recomputed is {verdict!r}, the record says {gate.verdict!r}"))
    return problems


def recheck(gate: GateRecord, where: str) -> list[str]:
    """The differences of :func:`recheck_fields`, as sentences.

    Parameters
    ----------
    gate : the record.
    where : the record's file, for errors.

    Returns
    -------
    One sentence per field that does not recompute; empty when the record is consistent.
    """
    return [problem for _, problem in recheck_fields(gate, where)]
