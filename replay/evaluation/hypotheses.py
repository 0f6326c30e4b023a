"""The hypotheses H2, H3a, H3b and H5 as tables: arms on the same held-out steps, a verdict each.

Every arm of one experiment is run (replayed, or measured by the harness) on the *same* steps, so
arms are compared pairwise, step for step. For each hypothesis the table gives each arm's S
(seconds of foreground stall per committed token) with its 95% bootstrap interval, the figures
each claim needs beside it, the paired comparisons the claim rests on, and a verdict:

* ``supported``: every comparison the claim needs holds: at family-wise level 2.5% one-sided
  (Holm's procedure over the comparisons; the lower tail of a 95% interval), and by at least
  :data:`MATERIAL_SHARE` of the other arm's TPOT (C + S + O per committed token; of its S where
  compute is not known), so a host that is compute-bound, where every saving is a sliver of the
  token's time, supports nothing;
* ``not supported``: the evidence suffices and at least one comparison does not hold; the
  falsifier's wording is printed with it, as a result, not an error;
* ``insufficient``: too few held-out sessions (or blocks) to decide.

The claims (their wording and falsifiers: :data:`HYPOTHESES`):

* **H2** (E2): stall-valued admission (``stall-value``) yields lower S and higher eta_stall than
  probability-only admission (``probability``, ``per-byte``) and deadline-only admission
  (``deadline``) at equal byte and queue budgets. ``eta_stall = (S_0 - S_policy) / B_spec``
  (S_0 is the arm without prefetch, ``none``; B_spec speculative bytes per committed token), in
  seconds per byte.
* **H3a** (E3): stall-valued placement (``stall-value``) lowers S relative to raw frequency and the
  other simpler placements at equal RAM, even when its hit-rate gain is small.
* **H3b** (E3): splitting shifts the S-versus-RAM curve toward lower memory: at some RAM budget
  split experts stall less than whole ones, and at none more.
* **H5** (E5): queue-aware budgets and cancellation reduce p99 step stall (per committed token)
  without materially increasing the median: the median may rise by at most
  :data:`MEDIAN_TOLERANCE` of the default arm's.

Units are resampled as :mod:`replay.evaluation.evidence` does: held-out sessions when there are at least
:data:`replay.evaluation.evidence.SESSION_UNITS`, else moving blocks of steps inside sessions.

References
----------
S. Holm, "A simple sequentially rejective multiple test procedure", Scand. J. Statist. 6 (1979).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

import numpy as np

from containers import records
from containers.errors import InputError

from replay.evaluation import evidence
from replay.evaluation.evidence import (
    MIN_SESSIONS,
    block_evidence,
    holm,
    resampling_method,
    session_evidence,
)
from replay.evaluation.stats import LEVEL, RESAMPLES
from replay.formats.interval import Interval

ALPHA = 0.025
"""Family-wise level of one hypothesis's comparisons (one-sided)."""
MATERIAL_SHARE = 0.01
"""The smallest saving, as a share of the other arm's TPOT, a comparison counts as an improvement."""
MEDIAN_TOLERANCE = 0.05
"""H5: the largest rise of the median step stall, as a share of the default arm's, that is not "material"."""
SUPPORTED, NOT_SUPPORTED, INSUFFICIENT = "supported", "not supported", "insufficient"


@dataclass(frozen=True)
class Hypothesis:
    """A claim of the seed, the arm that tests it, the arms it must beat, and its falsifier."""

    key: str
    claim: str
    falsifier: str
    test_arm: str
    comparators: tuple[str, ...]


HYPOTHESES = {
    "H2": Hypothesis(
        "H2", "Stall-valued admission yields lower S and higher eta_stall than probability-only admission "
              "(at equal speculative-byte and queue-slot budgets, demand reads first).",
        "If probability-only or deadline-only policies match the stall-valued controller across all regimes, "
        "the additional cost modeling is not justified on this runtime.",
        "stall-value", ("probability", "per-byte", "deadline")),
    "H3a": Hypothesis(
        "H3a", "Stall-valued placement lowers S relative to raw frequency at equal RAM, even when hit-rate "
               "improvement is small.",
        "If stall-valued placement cannot outperform simpler policies, the mechanism is not advanced to composition.",
        "stall-value", ("frequency", "lru", "hybrid", "probability-per-byte")),
    "H3b": Hypothesis(
        "H3b", "Splitting shifts the S-versus-RAM curve toward lower memory without changing output.",
        "If split experts do not stall less than whole experts at any RAM budget, splitting is not advanced to composition.",
        "split", ("whole",)),
    "H5": Hypothesis(
        "H5", "Queue-aware budgets and cancellation reduce p99 stall without materially increasing median stall "
              "or changing output tokens.",
        "If tail reductions merely shift waiting into compute or other overhead, or materially reduce median "
        "throughput, the policy is not retained.",
        "tail-control", ("default",)),
}


@dataclass(frozen=True)
class ArmSteps:
    """One arm on the experiment's steps, in step order: ``stall`` (s) and ``committed`` (tokens)
    per step [N], ``session`` (unit id per step [N]); ``speculative_bytes`` (prefetched bytes in
    all, for eta_stall; 0 without prefetch), and, where known, the RAM hit rate (share of union
    lookups served from RAM), timely required-byte recall (0-1), unused speculative bytes per
    committed token, the mean drive queue depth (requests), ``compute`` (s per step of
    everything but stall: matmuls, dense work, other overhead) and the prefetch candidates a
    per-source cap skipped per committed token (:mod:`replay.model.admission`)."""

    name: str
    stall: np.ndarray
    committed: np.ndarray
    session: np.ndarray
    speculative_bytes: float = 0.0
    ram_hit_rate: float | None = None
    timely_recall: float | None = None
    unused_bytes_per_token: float | None = None
    queue_depth: float | None = None
    compute: np.ndarray | None = None
    capped_per_token: float | None = None

    @property
    def stall_per_token_s(self) -> float:
        return float(self.stall.sum() / max(self.committed.sum(), 1e-12))

    @property
    def tpot_s(self) -> float | None:
        """C + S + O per committed token (s), when compute is known."""
        if self.compute is None:
            return None
        return float((self.stall.sum() + self.compute.sum()) / max(self.committed.sum(), 1e-12))

    def material(self) -> float:
        """The smallest saving against this arm that counts (s per committed token)."""
        return MATERIAL_SHARE * (self.tpot_s if self.tpot_s is not None else self.stall_per_token_s)

    @property
    def speculative_bytes_per_token(self) -> float:
        return float(self.speculative_bytes / max(self.committed.sum(), 1e-12))

    def step_stall_per_token(self) -> np.ndarray:
        """s_j: each step's stall per committed token (s)."""
        return self.stall / np.maximum(self.committed, 1e-12)


def arm_from_run(run, name: str | None = None) -> ArmSteps:
    """An arm from a replay (:class:`replay.evaluation.gate.LayoutRun`)."""
    s, m = run.steps, run.summary
    pf = m.prefetch
    spec = float(s.prefetch["issued"].sum()) if s.prefetch is not None else 0.0
    depth = float(np.mean(m.drive_queue_depth)) if m.drive_queue_depth else None
    committed = np.asarray(s.committed, float)
    return ArmSteps(name or run.name, np.asarray(s.stall, float), committed, np.asarray(s.session),
                    spec, m.ram_hit_rate, None if pf is None else pf.timely_required_byte_recall,
                    None if pf is None else pf.unused_prefetched_bytes_per_token, depth,
                    np.asarray(s.compute, float) + m.other_per_token_s * committed,
                    None if s.prefetch is None else float(s.prefetch["capped"].sum() / max(committed.sum(), 1e-12)))


def arm_from_measured(run, name: str | None = None) -> ArmSteps:
    """An arm from a measured STALL_TRACE run (:class:`replay.physical.stalltrace.RunMetrics`): steps in
    (request, step) order, requests as units."""
    _, session = np.unique(np.array([str(k[0]) for k in run.step_keys]), return_inverse=True)
    fig = run.to_json()
    c, o = fig.get("compute_per_committed_token_ns"), fig.get("other_per_committed_token_ns")
    committed = np.asarray(run.step_committed, float)
    compute = None if c is None or o is None else committed * (c + o) / 1e9
    return ArmSteps(name or run.configuration or run.run_id, np.asarray(run.step_stall, float) / 1e9,
                    committed, session, float(run.speculative_bytes), compute=compute)


def measured_arms(runs, names: dict[str, str] | None = None) -> dict[str, ArmSteps]:
    """Arms from measured STALL_TRACE runs (:class:`replay.physical.stalltrace.RunMetrics`): a run belongs
    to the arm its ``configuration`` (else its run id) names, renamed by ``names`` (configuration
    -> arm); an arm's repetitions are concatenated in file order, each (repetition, request) one
    unit, so arms measured with the same prompts and repetitions pair step for step."""
    grouped: dict[str, list] = {}
    for run in runs:
        label = run.configuration or run.run_id
        grouped.setdefault((names or {}).get(label, label), []).append(run)
    arms = {}
    for name, group in grouped.items():
        parts = [arm_from_measured(r, name) for r in group]
        offset, sessions = 0, []
        for a in parts:
            sessions.append(a.session + offset)
            offset += int(a.session.max()) + 1 if len(a.session) else 0
        compute = None if any(a.compute is None for a in parts) else np.concatenate([a.compute for a in parts])
        arms[name] = ArmSteps(name, np.concatenate([a.stall for a in parts]), np.concatenate([a.committed for a in parts]),
                              np.concatenate(sessions), float(sum(a.speculative_bytes for a in parts)), compute=compute)
    return arms


SPLIT_ARM = re.compile(r"(whole|split)@(\d+(?:\.\d+)?)$")
"""H3b's measured arm names: ``whole@GB`` or ``split@GB``, the run's layout at a RAM budget in GB."""


def measured_curve(arms: dict[str, ArmSteps]) -> dict[int, tuple[ArmSteps, ArmSteps]]:
    """H3b's ``{ram_bytes: (whole, split)}`` from measured arms named ``whole@GB`` and
    ``split@GB`` (:data:`SPLIT_ARM`); every budget needs both arms."""
    points: dict[int, dict[str, ArmSteps]] = {}
    for name, arm in arms.items():
        m = SPLIT_ARM.match(name)
        if m is None:
            raise InputError(None, f"H3b arm {name!r} is not whole@GB or split@GB (name it with --arm whole@16=CONFIGURATION)")
        points.setdefault(round(float(m.group(2)) * 1e9), {})[m.group(1)] = arm
    for ram, pair in sorted(points.items()):
        missing = {"whole", "split"} - set(pair)
        if missing:
            raise InputError(None, f"H3b at {ram / 1e9:.3g} GB has no {missing.pop()}@ run to compare with")
    return {ram: (pair["whole"], pair["split"]) for ram, pair in points.items()}


def measured_table(key: str, runs, names: dict[str, str] | None = None, min_sessions: int = MIN_SESSIONS,
                   seed: int = 0) -> HypothesisTable:
    """Hypothesis ``key`` (H2, H3a, H3b or H5) from measured runs (:func:`measured_arms`): the same
    table, comparisons and verdict as from a replay. H3b's arms are named ``whole@GB`` and
    ``split@GB`` (:func:`measured_curve`): runs of the whole-expert and the split container at
    each RAM budget, measured with the same prompts and repetitions.

    Parameters
    ----------
    key : the hypothesis.
    runs : the measured runs (:func:`measured_arms`).
    names : arm names by run, or None for the runs' own.
    min_sessions : units a verdict needs.
    seed : the bootstrap's seed.

    Returns
    -------
    :class:`HypothesisTable`.
    """
    arms = measured_arms(runs, names)
    regime = "measured runs: " + ", ".join(f"{n} ({len(np.unique(a.session))} units)" for n, a in arms.items())
    if key == "H2":
        return admission_table(arms, regime, min_sessions, seed)
    if key == "H3a":
        return placement_table(arms, regime, min_sessions, seed)
    if key == "H5":
        return tail_table(arms, regime, min_sessions, seed)
    if key == "H3b":
        return split_table(measured_curve(arms), regime, min_sessions, seed)
    raise InputError(None, f"unknown hypothesis {key!r} (choose H2, H3a, H3b, H5)")


@dataclass(frozen=True)
class ArmRow:
    """One arm's line of a table: S with its 95% interval (s per committed token), p50 and p99 of
    the step stall per committed token (s), eta_stall (s per byte, against the ``none`` arm), and
    the figures of :class:`ArmSteps`."""

    arm: str
    stall_per_token_s: Interval
    p50_step_stall_s: float
    p99_step_stall_s: float
    speculative_bytes_per_token: float
    eta_stall_s_per_byte: float | None
    ram_hit_rate: float | None
    timely_required_byte_recall: float | None
    unused_bytes_per_token: float | None
    queue_depth: float | None


@dataclass(frozen=True)
class Comparison:
    """``test`` against ``against`` on ``what`` (``"S"``, ``"p99"``, ``"median rise"``): the paired
    difference (``against - test`` for S and p99, ``test - against`` for the median's rise; seconds
    per committed token), its one-sided p-value of "no improvement", and whether it holds."""

    test: str
    against: str
    what: str
    difference: Interval
    p_value: float
    holds: bool
    words: str


@dataclass(frozen=True)
class HypothesisTable:
    hypothesis: Hypothesis
    regime: str
    rows: list[ArmRow]
    comparisons: list[Comparison]
    verdict: str
    sufficiency: str
    reason: str
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        h = self.hypothesis
        return records.to_json(HypothesisTableRecord(
            hypothesis=h.key, claim=h.claim, falsifier=h.falsifier, regime=self.regime, verdict=self.verdict,
            sufficiency=self.sufficiency, reason=self.reason, notes=self.notes, arms=self.rows,
            comparisons=self.comparisons))


@dataclass(frozen=True)
class HypothesisTableRecord:
    """A :class:`HypothesisTable` as JSON writes it: the hypothesis's key, claim and falsifier, then
    the table's regime, verdict and reasons, its arms' rows and its comparisons."""

    hypothesis: str
    claim: str
    falsifier: str
    regime: str
    verdict: str
    sufficiency: str
    reason: str
    notes: list[str]
    arms: list[ArmRow]
    comparisons: list[Comparison]


# ------------------------------------------------------------------------------- resampling

def _units(arm: ArmSteps) -> tuple[str, list[np.ndarray], int]:
    """How steps are resampled: ``("session", [step indices per session], n_sessions)`` or
    ``("moving-block", [step indices per block start], n_sessions)``."""
    sessions, inverse = np.unique(arm.session, return_inverse=True)
    if resampling_method(len(sessions)) == "session":
        return "session", [np.flatnonzero(inverse == u) for u in range(len(sessions))], len(sessions)
    ev = block_evidence(arm.stall, arm.stall, arm.committed, arm.session)
    return "moving-block", [np.arange(s, s + ev.block_steps) for s in ev.block_starts()], len(sessions)


def _draws(units: list[np.ndarray], n_draw: int, rng, resamples: int) -> list[np.ndarray]:
    picks = rng.integers(0, len(units), size=(resamples, n_draw))
    return [np.concatenate([units[j] for j in row]) for row in picks]


def _mean_evidence(base: ArmSteps, new: ArmSteps, seed: int):
    if resampling_method(len(np.unique(base.session))) == "session":
        _, inv = np.unique(base.session, return_inverse=True)
        return session_evidence(np.bincount(inv, base.stall), np.bincount(inv, new.stall), np.bincount(inv, base.committed), seed)
    return block_evidence(base.stall, new.stall, base.committed, base.session, seed)


def sufficiency(arm: ArmSteps, min_sessions: int = MIN_SESSIONS) -> tuple[bool, str]:
    """Whether the steps of ``arm`` hold enough units for a verdict, and in words
    (:func:`replay.evaluation.evidence.sufficiency` of its units)."""
    return evidence.sufficiency(_mean_evidence(arm, arm, 0), min_sessions)


def stall_interval(arm: ArmSteps, seed: int = 0) -> Interval:
    """S of ``arm`` with its 95% bootstrap interval (s per committed token)."""
    ev = _mean_evidence(arm, ArmSteps(arm.name, np.zeros_like(arm.stall), arm.committed, arm.session), seed)
    est, lo, hi = ev.interval()
    return Interval(est, lo, hi, ev.method, len(ev.base))


def saving(base: ArmSteps, new: ArmSteps, seed: int = 0) -> tuple[Interval, float]:
    """S(base) - S(new) with its 95% interval, and the one-sided p-value of "no saving"."""
    ev = _mean_evidence(base, new, seed)
    est, lo, hi = ev.interval()
    return Interval(est, lo, hi, ev.method, len(ev.base)), float((ev.replicates() <= 0).mean())


def quantile_difference(base: ArmSteps, new: ArmSteps, q: float, seed: int = 0,
                        resamples: int = RESAMPLES) -> tuple[Interval, np.ndarray]:
    """``quantile_q(s_j of base) - quantile_q(s_j of new)`` over the paired steps (s per committed
    token), with its 95% interval from resampled units, and the replicates."""
    method, units, _ = _units(base)
    b, n = base.step_stall_per_token(), new.step_stall_per_token()
    est = float(np.quantile(b, q) - np.quantile(n, q))
    rng = np.random.default_rng(seed)
    n_draw = len(units) if method == "session" else int(np.ceil(len(b) / len(units[0])))
    reps = np.array([np.quantile(b[i], q) - np.quantile(n[i], q) for i in _draws(units, n_draw, rng, resamples)])
    lo, hi = np.percentile(reps, [50 * (1 - LEVEL), 100 - 50 * (1 - LEVEL)])
    return Interval(est, float(lo), float(hi), method, len(units)), reps


# ------------------------------------------------------------------------------- the tables

def _check_paired(arms: dict[str, ArmSteps]) -> None:
    first = next(iter(arms.values()))
    for a in arms.values():
        if len(a.stall) != len(first.stall) or not np.array_equal(a.committed, first.committed) \
                or not np.array_equal(a.session, first.session):
            raise InputError(None, f"arms {first.name!r} and {a.name!r} are not the same steps: "
                                   "a hypothesis compares arms run on the same held-out steps")


def rows_for(arms: dict[str, ArmSteps], seed: int = 0) -> list[ArmRow]:
    """One :class:`ArmRow` per arm; eta_stall against the ``none`` arm when there is one."""
    none = arms.get("none")
    rows = []
    for name, a in arms.items():
        s = a.step_stall_per_token()
        spec = a.speculative_bytes_per_token
        eta = None
        if none is not None and name != "none" and spec > 0:
            eta = (none.stall_per_token_s - a.stall_per_token_s) / spec
        rows.append(ArmRow(arm=name, stall_per_token_s=stall_interval(a, seed), p50_step_stall_s=float(np.quantile(s, 0.5)),
                           p99_step_stall_s=float(np.quantile(s, 0.99)), speculative_bytes_per_token=spec,
                           eta_stall_s_per_byte=eta, ram_hit_rate=a.ram_hit_rate,
                           timely_required_byte_recall=a.timely_recall, unused_bytes_per_token=a.unused_bytes_per_token,
                           queue_depth=a.queue_depth))
    return rows


def _ms(x: float) -> str:
    return f"{x * 1e3:+.3f}"


def _lower_stall_comparisons(h: Hypothesis, arms: dict[str, ArmSteps], seed: int) -> list[Comparison]:
    test = arms[h.test_arm]
    against = [c for c in h.comparators if c in arms]
    found = [saving(arms[c], test, seed) for c in against]
    held = holm([p for _, p in found], ALPHA) if found else []
    return [_stall_comparison(h.test_arm, c, iv, p, bool(sig), arms[c].material()) for c, (iv, p), sig in zip(against, found, held)]


def _stall_comparison(test: str, against: str, iv: Interval, p: float, significant: bool, material: float) -> Comparison:
    """``test`` stalls less than ``against`` when the saving is significant and material."""
    holds = significant and iv.estimate >= material
    span = f"{_ms(iv.estimate)} ms/token [{_ms(iv.low)}, {_ms(iv.high)}]"
    if holds:
        words = f"{test} stalls less than {against}: {span}"
    elif significant:
        words = (f"{test} stalls less than {against} by only {span}, under {MATERIAL_SHARE:.0%} of {against}'s TPOT "
                 f"({_ms(material)} ms/token)")
    else:
        words = f"{test} does not stall significantly less than {against}: {span}"
    return Comparison(test, against, "S", iv, p, holds, words)


def _table(h: Hypothesis, regime: str, arms: dict[str, ArmSteps], comparisons: list[Comparison], min_sessions: int,
           seed: int, extra_fail: list[str] | None = None, notes: list[str] | None = None) -> HypothesisTable:
    ok, why = sufficiency(next(iter(arms.values())), min_sessions)
    rows = rows_for(arms, seed)
    if not ok:
        return HypothesisTable(h, regime, rows, comparisons, INSUFFICIENT, why,
                               f"insufficient: {why}; the table's figures are shown, no verdict is drawn", notes or [])
    failed = [c.words for c in comparisons if not c.holds] + list(extra_fail or [])
    if not comparisons:
        return HypothesisTable(h, regime, rows, comparisons, INSUFFICIENT, why,
                               f"insufficient: no arm to compare {h.test_arm} with", notes or [])
    if failed:
        return HypothesisTable(h, regime, rows, comparisons, NOT_SUPPORTED, why,
                               "not supported: " + "; ".join(failed) + f". Falsifier: {h.falsifier}", notes or [])
    return HypothesisTable(h, regime, rows, comparisons, SUPPORTED, why,
                           "supported: " + "; ".join(c.words for c in comparisons), notes or [])


def _require(h: Hypothesis, arms: dict[str, ArmSteps]) -> None:
    if h.test_arm not in arms:
        raise InputError(None, f"{h.key} needs the {h.test_arm!r} arm (have {', '.join(arms)})")
    _check_paired(arms)


def admission_table(arms: dict[str, ArmSteps], regime: str, min_sessions: int = MIN_SESSIONS,
                    seed: int = 0) -> HypothesisTable:
    """H2 from admission arms (``none``, ``stall-value`` and any of ``probability``, ``per-byte``,
    ``deadline``, ``oracle``) run at equal byte and queue budgets. The oracle is shown as a bound,
    never compared against. Supported when stall-value's S is lower than each probability-only and
    deadline arm's (Holm) and its eta_stall higher than each."""
    h = HYPOTHESES["H2"]
    _require(h, arms)
    if "none" not in arms:
        raise InputError(None, "H2 needs the 'none' arm (no prefetch): eta_stall is measured against it")
    comparisons = _lower_stall_comparisons(h, arms, seed)
    rows = {r.arm: r for r in rows_for(arms, seed)}
    eta_t = rows[h.test_arm].eta_stall_s_per_byte
    extra = []
    for c in comparisons:
        eta_c = rows[c.against].eta_stall_s_per_byte
        if eta_t is None or (eta_c is not None and eta_t <= eta_c):
            extra.append(f"eta_stall of {h.test_arm} ({_eta(eta_t)}) is not above {c.against}'s ({_eta(eta_c)})")
    notes = ["oracle: realized future routing, an upper bound that is not deployable"] if "oracle" in arms else []
    return _table(h, regime, arms, comparisons, min_sessions, seed, extra, notes)


def _eta(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 1e3 * 1e6:.3f} ms per MB"


def placement_table(arms: dict[str, ArmSteps], regime: str, min_sessions: int = MIN_SESSIONS,
                    seed: int = 0) -> HypothesisTable:
    """H3a from placement arms at equal RAM (``stall-value`` and any of ``frequency``, ``lru``,
    ``hybrid``, ``probability-per-byte``): supported when stall-value's S is lower than each's."""
    h = HYPOTHESES["H3a"]
    _require(h, arms)
    comparisons = _lower_stall_comparisons(h, arms, seed)
    notes = []
    t = arms[h.test_arm]
    for c in comparisons:
        a = arms[c.against]
        if t.ram_hit_rate is not None and a.ram_hit_rate is not None:
            notes.append(f"RAM hit rate {h.test_arm} {t.ram_hit_rate:.1%} vs {c.against} {a.ram_hit_rate:.1%} "
                         f"({(t.ram_hit_rate - a.ram_hit_rate) * 100:+.1f} points) beside S {_ms(c.difference.estimate)} ms/token")
    return _table(h, regime, arms, comparisons, min_sessions, seed, notes=notes)


def split_table(curve: dict[int, tuple[ArmSteps, ArmSteps]], regime: str, min_sessions: int = MIN_SESSIONS,
                seed: int = 0) -> HypothesisTable:
    """H3b from ``{ram_bytes: (whole, split)}``: supported when split experts stall significantly
    less at one budget or more (Holm over budgets) and significantly more at none."""
    h = HYPOTHESES["H3b"]
    if not curve:
        raise InputError(None, "H3b needs at least one RAM budget")
    arms, found = {}, []
    for ram, (whole, split) in sorted(curve.items()):
        gb = f"{ram / 1e9:.3g} GB"
        arms[f"whole @ {gb}"] = replace(whole, name=f"whole @ {gb}")
        arms[f"split @ {gb}"] = replace(split, name=f"split @ {gb}")
        found.append((gb, *saving(whole, split, seed), *saving(split, whole, seed)))
    _check_paired(arms)
    better = holm([p for _, _, p, _, _ in found], ALPHA)
    worse = holm([p for _, _, _, _, p in found], ALPHA)
    comparisons = [_stall_comparison(f"split @ {gb}", f"whole @ {gb}", iv, p, bool(b), curve[ram][0].material())
                   for (gb, iv, p, _, _), b, ram in zip(found, better, sorted(curve))]
    ok, why = sufficiency(next(iter(arms.values())), min_sessions)
    rows = rows_for(arms, seed)
    if not ok:
        return HypothesisTable(h, regime, rows, comparisons, INSUFFICIENT, why,
                               f"insufficient: {why}; the table's figures are shown, no verdict is drawn")
    harmed = [f"at {gb} split experts stall MORE: {_ms(-iv.estimate)} ms/token [{_ms(-iv.high)}, {_ms(-iv.low)}]"
              for (gb, iv, _, _, _), w in zip(found, worse) if w]
    if any(c.holds for c in comparisons) and not harmed:
        return HypothesisTable(h, regime, rows, comparisons, SUPPORTED, why,
                               "supported: " + "; ".join(c.words for c in comparisons if c.holds))
    return HypothesisTable(h, regime, rows, comparisons, NOT_SUPPORTED, why,
                           "not supported: " + "; ".join(harmed or [c.words for c in comparisons])
                           + f". Falsifier: {h.falsifier}")


def tail_table(arms: dict[str, ArmSteps], regime: str, min_sessions: int = MIN_SESSIONS, seed: int = 0,
               test_arm: str = "tail-control") -> HypothesisTable:
    """H5 from a ``default`` arm and tail-controlled arms (``test_arm`` is the one judged; others
    are shown): supported when its p99 step stall is lower than the default's (interval above
    zero) and its median rises by no more than :data:`MEDIAN_TOLERANCE` of the default's."""
    base = HYPOTHESES["H5"]
    h = Hypothesis(base.key, base.claim, base.falsifier, test_arm, base.comparators)
    if "default" not in arms:
        raise InputError(None, "H5 needs the 'default' arm (the runtime's unbounded speculative admission)")
    _require(h, arms)
    d, t = arms["default"], arms[test_arm]
    p99, reps99 = quantile_difference(d, t, 0.99, seed)
    p99_p = float((reps99 <= 0).mean())
    ok99 = p99_p <= ALPHA and p99.estimate >= d.material()
    med, _ = quantile_difference(t, d, 0.5, seed)          # rise of the median: test - default
    allowed = MEDIAN_TOLERANCE * float(np.quantile(d.step_stall_per_token(), 0.5))
    ok_med = med.estimate <= allowed
    comparisons = [
        Comparison(test_arm, "default", "p99", p99, p99_p, ok99,
                   f"p99 step stall {'falls' if ok99 else 'does not fall significantly'} with {test_arm}: "
                   f"{_ms(p99.estimate)} ms/token [{_ms(p99.low)}, {_ms(p99.high)}]"),
        Comparison(test_arm, "default", "median rise", med, float("nan"), ok_med,
                   f"median step stall rises by {_ms(med.estimate)} ms/token [{_ms(med.low)}, {_ms(med.high)}] "
                   f"({'within' if ok_med else 'beyond'} the {MEDIAN_TOLERANCE:.0%} tolerance, {_ms(allowed)} ms/token)"),
    ]
    notes = [f"{a.name}: {a.capped_per_token:.2f} prefetch candidates per committed token skipped by a per-source cap"
             for a in arms.values() if a.capped_per_token]
    return _table(h, regime, arms, comparisons, min_sessions, seed, notes=notes)


__all__ = ["ALPHA", "ArmRow", "ArmSteps", "Comparison", "HYPOTHESES", "Hypothesis", "HypothesisTable", "HypothesisTableRecord", "INSUFFICIENT",
           "MATERIAL_SHARE", "MEDIAN_TOLERANCE", "measured_arms", "measured_curve", "measured_table", "SPLIT_ARM", "NOT_SUPPORTED", "SUPPORTED", "admission_table", "arm_from_measured", "arm_from_run",
           "placement_table", "quantile_difference", "rows_for", "saving", "split_table", "stall_interval", "sufficiency",
           "tail_table"]
