"""The record of ``relayout validate --engine`` and its judging rules: the model's S against the colibrì engine's.

One cell is a read path and an LRU cap in the engine's own variables (``PIPE=1 CAP=4``); in it
every layout (stock first, the baseline) ran the same held-out prompts, cold, repetitions
interleaved. Per run the engine measured its S (the decode window's expert wait per committed
token, its ``PROFILE:`` line) and the model predicted it from the run's own recorded routing and
printed configuration (:class:`RunResult`). Judged here, all pure functions:

- the model copies page-cache hits at the rate the engine's threads measured in the cell's stock
  runs (their median, :attr:`CellResult.copy_rate`; :func:`replay.colibri.engine_config.engine_copy_rate`,
  :func:`replay.colibri.engine_config.at_engine_copy_rate`), or, in a cell whose runs do not
  measure one (URING=1, DIRECT=1), the median of the other cells' (:attr:`CellResult.copy_rate_source`),
  the same rate for every layout;
- the disk probed around each cell's runs against the profile's rate for the same reads
  (:attr:`CellResult.disk_scale`): a cell whose disk ran beyond the tolerance from the profile
  is named in the summary, and every run is also predicted with the profile's drive rates at
  that speed (:meth:`replay.model.device.ArrayProfile.scaled`; :attr:`ArmResult.ratio_probed`),
  which the summary counts beside the verdict when a cell drifted; the verdict stays the
  profile's own;
- per layout (:class:`ArmResult`): the predicted S (summed predicted wait over summed tokens)
  against the measured S and its 95% interval over runs (Student t), with
  :func:`.rules.cell_agreement` at the ``+/-`` :data:`.rules.TOLERANCE` band: ``agrees``,
  ``unresolved`` or ``disagrees``;
- the placement control (:data:`PLACEMENT_COPY`, the stock plan rewritten: stock's tensors in
  stock's order in fresh files, each expert aligned to 4 KiB as every rewrite aligns it) against
  stock: the model predicts what the alignment changes (page-cache copies that start on a cache
  line are faster); how far the measured saving lies beyond that prediction is how far where a
  file lies moves the engine's S (:func:`placement_bound`);
- per layout against stock (:class:`SavingResult`): the saving with one unit per prompt (its
  repetitions pooled), measured and predicted; the prediction judged against the measured
  interval and the placement bound (:func:`.rules.judge_saving`: ``within placement`` when the
  measurement cannot tell it from placement), and the gate's rule (:func:`replay.evaluation.evidence.judge`
  at :data:`.rules.GATE_THRESHOLD` of the measured stock TPOT) applied once to the predicted
  units (the gate's decision) and once to the measured units (the measured A/B's decision).

S and savings in seconds per committed token in the record; the text shows milliseconds.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from containers import records

from replay.evaluation.evidence import MIN_SESSIONS, judge, session_evidence
from replay.evaluation.stats import repetition_interval
from replay.formats.interval import Interval

from .rules import GATE_THRESHOLD, TOLERANCE, cell_agreement, judge_saving, over_repetitions

ENGINE_VALIDATION_FORMAT = "relayout-engine-validation"
ENGINE_VALIDATION_VERSION = 7
PLACEMENT_COPY = "stock-copy"
"""The placement control's arm: the stock plan rewritten, stock's tensors in stock's order, each expert
aligned to 4 KiB."""


@dataclass(frozen=True)
class RunResult:
    """One engine run and the model's prediction of it: waits in seconds over the decode window."""

    run: str                   # the run's directory
    arm: str                   # the layout it ran
    prompt: int
    repetition: int
    committed_tokens: int
    measured_wait_s: float     # the engine's PROFILE decode wait
    predicted_wait_s: float    # the model's stall over the same forwards
    tpot_s: float              # the engine's decode wall time per committed token
    measured_loads: int        # the engine's expert loads (its [PROF] expert I/O line; -1 when not printed)
    predicted_loads: int       # the model's LRU misses over the decode forwards
    returncode: int
    measured_pilot_loads: int  # the router pilot's completed loads (its PILOT_REAL line, the whole run; -1 when not printed: no PILOT_REAL)
    predicted_pilot_loads: int  # the model's prefetch loads over the decode forwards (-1 when no prefetcher runs)
    measured_drive_bytes: int  # bytes the engine process read from storage, the whole run (-1 when not counted)
    predicted_drive_bytes: int  # bytes the model's reads took from the drives, the whole run (experts only)
    predicted_wait_probed_s: float  # the model's stall with the profile's drive rates at the speed the disk probed around the run's cell (= predicted_wait_s where not probed)


@dataclass(frozen=True)
class ArmResult:
    """One layout in one cell: measured S with its interval over runs, predicted S, and how they stand."""

    arm: str
    runs: int
    measured_s: Interval
    predicted_s: float
    ratio: float               # predicted / measured S
    agreement: str             # agrees, unresolved or disagrees (rules.cell_agreement)
    loads_agree: bool          # the model's expert loads equal the engine's in every run that printed them
    predicted_probed_s: float  # predicted S with the drives at the speed the disk probed around the cell
    ratio_probed: float        # predicted_probed_s / measured S
    agreement_probed: str      # rules.cell_agreement of predicted_probed_s


@dataclass(frozen=True)
class SavingResult:
    """One layout against stock in one cell, one unit per prompt (its repetitions pooled)."""

    layout: str
    prompts: int
    measured: Interval         # s/token, Student t over prompts
    predicted: Interval        # s/token, Student t over prompts
    agreement: str             # rules.judge_saving: agrees, unresolved, within placement or disagrees
    sign_agrees: bool | None   # None where the measured interval includes zero
    words: str
    need_s: float              # the saving the gate asks for: GATE_THRESHOLD x measured stock TPOT
    gate_decision: str         # pass, fail or insufficient on the predicted units
    measured_decision: str     # the same rule on the measured units
    decisions_agree: bool


@dataclass(frozen=True)
class CellResult:
    """One read path x cap: its engine variables and every layout's figures."""

    name: str
    env: str
    arms: list[ArmResult]
    placement: Interval        # s/token: stock's S less the placement control's, Student t over prompts
    placement_predicted_s: float   # s/token: the model's saving for the placement control (its alignment)
    placement_bound_s: float   # how far placement moves S beyond that prediction here (the interval's farther end)
    savings: list[SavingResult]
    copy_rate: float           # bytes/s per thread: page-cache copies as the engine measured them (median; 0: none said: the device's rates)
    copy_rate_source: str      # whose runs measured copy_rate: "its stock runs", "the median of cells ...", "" (none)
    disk_probe: list[float]    # bytes/s: the disk probed before and after the cell's runs (empty: not probed)
    disk_scale: float          # the probes' mean over the profile's rate for the same reads (0: not probed)
    pilot_precision: float     # PILOT or PILOT_REAL: the router pilot's share of right predictions, from the training runs (0: no pilot)
    pilot_loads: list[int]     # PILOT_REAL: the pilot's loads over the cell's runs, the engine's (whole runs) and the model's (decode); [] without
    drive_bytes: list[float]   # bytes read from storage per run, whole runs: the engine's (-1: not counted) and the model's


@dataclass(frozen=True)
class EngineValidationRecord:
    """``relayout validate --engine``'s record (``validation-engine.json``)."""

    format: str
    version: int
    engine: str
    container: str
    device: str
    device_source: str
    layouts: dict[str, str]            # layout -> the container directory it ran
    training_sessions: list[str]
    prompts: int
    reps: int
    ngen: int
    tolerance: float
    cells: list[CellResult]
    runs: list[RunResult]
    cells_agree: int
    cells_disagree: int
    cells_unresolved: int
    decisions_agree: int
    decisions: int
    verdict: str                       # holds, does not hold, or unresolved
    summary: str

    def to_json(self) -> dict:
        return records.to_json(self)

    @classmethod
    def from_json(cls, obj, where: str = "engine validation record") -> "EngineValidationRecord":
        rec = records.from_json(cls, obj, where)
        if rec.format != ENGINE_VALIDATION_FORMAT or rec.version != ENGINE_VALIDATION_VERSION:
            from containers.errors import InputError

            raise InputError(where, f"not a {ENGINE_VALIDATION_FORMAT} version {ENGINE_VALIDATION_VERSION} record")
        return rec


def arm_result(arm: str, runs: list[RunResult]) -> ArmResult:
    """Measured S (pooled wait over pooled tokens, its interval over the runs' own S) against predicted S."""
    tokens = sum(r.committed_tokens for r in runs)
    measured = sum(r.measured_wait_s for r in runs) / tokens
    iv = repetition_interval([r.measured_wait_s / r.committed_tokens for r in runs], unit="run")
    half = (iv.high - iv.low) / 2
    m = Interval(measured, measured - half, measured + half, "run", len(runs), "Student t")
    predicted = sum(r.predicted_wait_s for r in runs) / tokens
    probed = sum(r.predicted_wait_probed_s for r in runs) / tokens
    loads = all(r.measured_loads == r.predicted_loads for r in runs if r.measured_loads >= 0)
    ratio, ratio_probed = ((s / measured if measured > 0 else float("inf")) for s in (predicted, probed))
    return ArmResult(arm, len(runs), m, predicted, ratio, cell_agreement(predicted, measured, m.low, m.high),
                     loads, probed, ratio_probed, cell_agreement(probed, measured, m.low, m.high))


def _per_prompt(runs: list[RunResult], what: str) -> dict[int, tuple[float, int]]:
    """Per prompt: the runs' summed ``what`` (seconds) and committed tokens, repetitions pooled."""
    out: dict[int, tuple[float, int]] = {}
    for r in runs:
        w, t = out.get(r.prompt, (0.0, 0))
        out[r.prompt] = (w + getattr(r, what), t + r.committed_tokens)
    return out


def _interval(values: list[float]) -> Interval:
    iv = repetition_interval(values, unit="prompt")
    return Interval(iv.estimate, iv.low, iv.high, "prompt", len(values), "Student t")


def saving_result(layout: str, stock: list[RunResult], new: list[RunResult], min_sessions: int = MIN_SESSIONS,
                  placement_s: float | None = None) -> SavingResult:
    """``layout``'s saving against stock over the prompts both ran, measured and predicted.

    Parameters
    ----------
    layout : the layout's name.
    stock, new : the two arms' runs in one cell.
    min_sessions : prompts (held-out sessions) the gate's rule needs for a decision.
    placement_s : the placement bound (s/token, :func:`placement_bound`), or None.

    Returns
    -------
    :class:`SavingResult`; ``need_s`` is :data:`.rules.GATE_THRESHOLD` of the stock arm's measured TPOT.
    """
    prompts = sorted(set(r.prompt for r in stock) & set(r.prompt for r in new))
    tpot = float(np.mean([r.tpot_s for r in stock]))
    need = GATE_THRESHOLD * tpot
    figures = {}
    for what in ("measured_wait_s", "predicted_wait_s"):
        a, b = _per_prompt(stock, what), _per_prompt(new, what)
        tokens = np.array([a[p][1] for p in prompts], dtype=float)
        base = np.array([a[p][0] for p in prompts])
        plan = np.array([b[p][0] / b[p][1] for p in prompts]) * tokens    # the layout's wait at stock's token count
        figures[what] = (list((base - plan) / tokens), judge(session_evidence(base, plan, tokens), need, min_sessions).verdict)
    measured, predicted = _interval(figures["measured_wait_s"][0]), _interval(figures["predicted_wait_s"][0])
    j = judge_saving(predicted.estimate, over_repetitions(figures["measured_wait_s"][0]), placement_s=placement_s)
    gate, meas = figures["predicted_wait_s"][1], figures["measured_wait_s"][1]
    return SavingResult(layout, len(prompts), measured, predicted, j["agreement"], j["sign_agrees"], j["words"], need,
                        gate, meas, gate == meas)


def placement_bound(control: SavingResult) -> float:
    """How far placement moves S beyond what the model predicts for the placement control (s/token):
    the end of the measured interval of stock against the control farther from the control's
    predicted saving, as a distance from it."""
    p = control.predicted.estimate
    return max(abs(control.measured.low - p), abs(control.measured.high - p))


def summarize(cells: list[CellResult]) -> tuple[int, int, int, int, int, str, str]:
    """Counts over every layout of every cell and the verdict: ``(agree, disagree, unresolved,
    decisions agreeing, decisions, verdict, summary in words)``."""
    arms = [a for c in cells for a in c.arms]
    agree = sum(a.agreement == "agrees" for a in arms)
    disagree = sum(a.agreement == "disagrees" for a in arms)
    unresolved = len(arms) - agree - disagree
    savings = [s for c in cells for s in c.savings]
    decided = sum(s.decisions_agree for s in savings)
    placed = sum(s.agreement == "within placement" for s in savings)
    verdict = "does not hold" if disagree else "holds" if agree == len(arms) else "unresolved"
    worst = max(arms, key=lambda a: abs(np.log(a.ratio)) if a.ratio > 0 and np.isfinite(a.ratio) else np.inf)
    sign_cases = [s for s in savings if s.sign_agrees is not None and s.agreement != "within placement"]
    placed_differ = sum(not s.decisions_agree and s.agreement == "within placement" for s in savings)
    summary = (f"the model's S is within +/-{TOLERANCE:.0%} of the engine's in {agree} of {len(arms)} layout-cells "
               f"({disagree} ruled out, {unresolved} unresolved); the farthest is {worst.arm} in "
               f"{next(c.name for c in cells if worst in c.arms)} (predicted/measured {worst.ratio:.2f}). "
               f"The predicted saving has the measured sign in {sum(s.sign_agrees for s in sign_cases)} of the "
               f"{len(sign_cases)} comparisons whose measured interval excludes zero and that placement does not explain "
               f"({placed} of the {len(savings)} measured savings cannot be told from placement: stock and its rewrite "
               f"differ by as much beyond what the model predicts for the rewrite); the gate's decision equals the measured A/B's in {decided} of {len(savings)}"
               + (f" ({placed_differ} of the differing within placement)" if placed_differ else "") + ".")
    drifted = [f"{c.name} ({c.disk_scale:.2f}x)" for c in cells if c.disk_probe and abs(c.disk_scale - 1) > TOLERANCE]
    if drifted:
        probed = sum(a.agreement_probed == "agrees" for a in arms)
        far = max(arms, key=lambda a: abs(np.log(a.ratio_probed)) if a.ratio_probed > 0 and np.isfinite(a.ratio_probed) else np.inf)
        summary += (f" The disk ran beyond +/-{TOLERANCE:.0%} of the profile's speed during {', '.join(drifted)}: "
                    "there a ratio says as much about the disk that day as about the model. With the profile's drive "
                    f"rates at the speed the disk probed around each cell, {probed} of {len(arms)} layout-cells are "
                    f"within +/-{TOLERANCE:.0%} (the farthest {far.arm} in {next(c.name for c in cells if far in c.arms)}, "
                    f"{far.ratio_probed:.2f}).")
    return agree, disagree, unresolved, decided, len(savings), verdict, summary
