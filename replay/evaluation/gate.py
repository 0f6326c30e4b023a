"""Paired replay of two layouts on held-out sessions, the oracle bound, and the rewrite gate.

The gate passes only when the lower end of the 95% interval of predicted stall saved per
committed token is at least ``threshold`` x the baseline's predicted TPOT, on sessions the plan
did not learn from (by routing content), for the chosen device profile and runtime
configuration, and only when there is enough held-out evidence for a verdict at all; otherwise
it fails or says ``insufficient`` (:mod:`replay.evaluation.evidence`). Its record, ``gate.json``, holds
everything needed to audit the decision, and :func:`recheck` recomputes it from the record.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from containers import __version__, records
from containers.errors import InputError
from containers.layout import Layout

from replay.model.config import RuntimeConfig, pinned_experts
from replay.formats.colipairs import configured_pair_table
from replay.model.coupling import COUPLED_TARGETS, coupling_table
from replay.model.device import ArrayProfile
from replay.evaluation.evidence import (
    DEFAULT_THRESHOLD,
    MIN_SESSIONS,
    Evidence,
    HeldOut,
    Verdict,
    block_evidence,
    evaluation_mask,
    holm,
    judge,
    resampling_method,
    session_evidence,
    split_sessions_by_content,
)
from replay.formats.gatefile import (
    GATE_FORMAT,
    GATE_VERSION,
    BaselineRef,
    Decomposition,
    DeviceRef,
    GateEvidence,
    GateRecord,
    Headroom,
    PinsUsed,
    PlanRef,
    SessionResult,
    Threshold,
    TraceRef,
)
from replay.formats.interval import Interval
from replay.model.figures import LayoutMetrics
from replay.model.metrics import session_sums, summarize
from replay.formats.planfile import Plan
from replay.formats.sweepfile import SweepCell
from replay.model.streaming import replay_steps
from replay.model.routing import TraceSource

SWEEP_ALPHA = 0.025
"""Family-wise level of the sweep's Holm correction (one-sided, as a 95% interval's lower tail)."""


def evaluation_forwards(trace: TraceSource, plans: list[Plan]) -> tuple[np.ndarray, HeldOut]:
    """Decode and verify forwards of the sessions none of ``plans`` trained on (by routing content)."""
    held = split_sessions_by_content(trace, plans)
    return evaluation_mask(trace, held.evaluated), held


def check_trace_matches(trace: TraceSource, plan: Plan) -> None:
    trace.require_rows("replay")
    g = plan.geometry
    if trace.n_experts > g.n_experts:
        raise InputError(trace.source or None, f"trace has expert ids up to {trace.n_experts - 1}; the plan's model has {g.n_experts} per layer")
    extra = sorted(set(trace.layers.tolist()) - set(g.routed_layers))
    if extra:
        raise InputError(trace.source or None, f"trace routes layers {extra[:5]} the plan does not cover")


@dataclass
class LayoutRun:
    name: str
    steps: object
    summary: LayoutMetrics
    sessions: dict


def run_layout(name: str, trace: TraceSource, mask: np.ndarray, layout: Layout, device: ArrayProfile,
               config: RuntimeConfig, pinned: np.ndarray, split=None, *, coupling=None) -> LayoutRun:
    """Replay the forwards of mask ``mask`` through ``layout``, the rows read block by block.

    Parameters
    ----------
    name : the run's label.
    trace, mask : the routing trace and the forwards [F] replayed.
    layout, device, config : the layout, device profile and runtime knobs.
    pinned : [L, E] experts pinned in RAM.
    split : the split state (:meth:`~replay.formats.planfile.Plan.split_state`), or None.
    coupling : the coupled prefetch source's table, or None.

    Returns
    -------
    :class:`LayoutRun`: per-step results, the summary metrics and per-session sums.
    """
    r = replay_steps(trace, mask, layout, device, config, pinned, split, coupling, blocks=trace.row_blocks())
    return LayoutRun(name, r.steps, summarize(r.steps, r.usage, config.other_seconds_per_token),
                     session_sums(r.steps, len(trace.sessions)))


def held_out_evidence(base: LayoutRun, new: LayoutRun | None, units: np.ndarray, seed: int = 0) -> Evidence:
    """Paired held-out evidence of ``base`` against ``new``.

    Parameters
    ----------
    base, new : replays of the same held-out forwards; ``new`` None compares against zero stall,
        so the interval is ``base``'s stall per committed token itself.
    units : the held-out session indices (:attr:`HeldOut.evaluated`).
    seed : the bootstrap's seed.

    Returns
    -------
    :class:`~replay.evaluation.evidence.Evidence` per session, or per step in blocks inside
    sessions, as :func:`~replay.evaluation.evidence.resampling_method` says for ``len(units)``.
    """
    if resampling_method(len(units)) == "session":
        b = base.sessions["stall"][units]
        return session_evidence(b, new.sessions["stall"][units] if new else np.zeros_like(b), base.sessions["committed"][units], seed)
    b = base.steps.stall
    return block_evidence(b, new.steps.stall if new else np.zeros_like(b), base.steps.committed, base.steps.session, seed)


def _training_forwards(trace: TraceSource, plan: Plan, what: str) -> np.ndarray:
    train = split_sessions_by_content(trace, [plan]).training
    if not train:
        raise InputError(trace.source or None, f"{what} needs the plan's training sessions in the trace")
    return trace.session_forward_mask(train)


def training_coupling(trace: TraceSource, plan: Plan) -> tuple[np.ndarray, np.ndarray]:
    """The coupled prefetch source's table, learned from the plan's training sessions."""
    train = _training_forwards(trace, plan, "the coupled prefetch source (its pair table)")
    return coupling_table(trace, train, plan.layout, COUPLED_TARGETS)


def gate_pins(trace: TraceSource, plan: Plan, config: RuntimeConfig) -> tuple[np.ndarray, PinsUsed]:
    """The pinned experts [L, E] both layouts of a comparison replay with, and the record of them.

    Pins name experts, not offsets, so the baseline gets the same set as the plan. The plan's own
    pin set (``relayout placement --plan-out``) when it carries one; otherwise, with
    ``config.pin_bytes`` > 0, the experts of most training-session selections per byte within
    that budget; otherwise none. A plan with pins and ``pin_bytes`` > 0 is refused (two pin
    sets for one replay). The LRU is ``config.ram_bytes`` in every case.
    """
    L, E = len(plan.layout.layers), plan.layout.n_experts
    expert_bytes = plan.layout.expert_bytes()[:, 0]
    if plan.pins is not None:
        p = plan.pins
        if config.pin_bytes > 0:
            raise InputError(plan.path, f"the plan carries its own pin set ({len(p.experts)} experts of arm {p.arm!r}); "
                                        "drop --pin-gb (pin_bytes), which would pin by training heat instead")
        index = {int(layer): li for li, layer in enumerate(plan.layout.layers)}
        pinned = np.zeros((L, E), dtype=bool)
        for layer, e in p.experts:
            pinned[index[layer], e] = True
        source = "plan"
        how = (f"the plan's pin set: arm {p.arm!r} ({p.how}), chosen on {p.device} for {p.ram_bytes} bytes of RAM "
               f"({p.pin_bytes} pinned, {p.lru_bytes} LRU); this replay's LRU is {config.ram_bytes} bytes")
    elif config.pin_bytes > 0:
        train = _training_forwards(trace, plan, "pinning (to rank experts by heat)")
        by_trace_layer = trace.expert_heat(train)
        heat = np.zeros((L, E))
        for li, layer in enumerate(plan.layout.layers):
            t = int(np.searchsorted(trace.layers, layer))
            if t < len(trace.layers) and trace.layers[t] == layer:
                heat[li, :trace.n_experts] = by_trace_layer[t]
        pinned = pinned_experts(heat, expert_bytes, config.pin_bytes)
        source = "heat"
        how = (f"the experts of most selections per byte in the plan's training sessions, within pin_bytes = "
               f"{config.pin_bytes} bytes (--pin-gb); LRU {config.ram_bytes} bytes")
    else:
        pinned = np.zeros((L, E), dtype=bool)
        source, how = "none", f"no pins (the plan carries none and pin_bytes is 0); LRU {config.ram_bytes} bytes"
    return pinned, PinsUsed(source, int(pinned.sum()), int((pinned * expert_bytes[:, None]).sum()), how)


@dataclass(frozen=True)
class TpotParts:
    """Measured per-token compute ``C`` and other time ``O`` (seconds per committed token), and where from."""

    compute_s: float
    other_s: float
    source: str


def compare(plan: Plan, trace: TraceSource, device: ArrayProfile, config: RuntimeConfig,
            baseline: Plan | None = None, threshold: float = DEFAULT_THRESHOLD, seed: int = 0, *,
            min_sessions: int = MIN_SESSIONS, tpot_parts: TpotParts | None = None) -> GateRecord:
    """Replay baseline (stock, or another plan's layout) and the plan; gate; return the gate record.

    Parameters
    ----------
    plan : the plan whose layout is judged.
    trace : routing trace; sessions any of the plans trained on (by routing content) are excluded.
    device, config : the device profile and runtime configuration replayed.
    baseline : another plan's layout to compare against, or None for the stock layout.
    threshold : share of the baseline's TPOT = C + S + O the interval's low end must save; C and
        O from the compute model and ``config.other_seconds_per_token``, or, with ``tpot_parts``,
        as measured.
    seed : the bootstrap's seed.
    min_sessions : held-out sessions a verdict needs.
    tpot_parts : measured compute and other time per token, or None.

    Returns
    -------
    :class:`~replay.formats.gatefile.GateRecord` with the verdict ``pass``, ``fail`` or
    ``insufficient`` (too few held-out sessions or blocks: :mod:`replay.evaluation.evidence`).
    Against the stock layout, a plan that records its repacked stock layout is also replayed
    that way, to split the saving into repacking and ordering.
    """
    if not 0.0 <= threshold <= 1.0:               # NaN included: the record would not recheck
        raise InputError(None, f"the threshold must be a fraction of TPOT from 0 to 1, got {threshold!r}")
    check_trace_matches(trace, plan)
    if baseline is not None and baseline.source_fingerprint != plan.source_fingerprint:
        raise InputError(baseline.path, "baseline plan is for a different container than the plan")
    mask, held = evaluation_forwards(trace, [plan] + ([baseline] if baseline else []))
    evaluated = held.evaluated
    pins, pins_used = gate_pins(trace, plan, config)
    split = plan.split_state()
    plan_config = config
    if split is not None:
        plan_config = replace(config, ram_bytes=max(0, config.ram_bytes - plan.split.ram_bytes))
    base_layout = baseline.layout if baseline is not None else plan.stock
    coupling = (configured_pair_table(config, plan.layout) if config.couple_file else
                training_coupling(trace, plan) if config.prefetch == "coupled" else None)
    base = run_layout("baseline", trace, mask, base_layout, device, config, pins, coupling=coupling)
    new = run_layout("plan", trace, mask, plan.layout, device, plan_config, pins, split, coupling=coupling)
    repack = None
    if baseline is None and plan.repack is not None:
        repack = run_layout("repack", trace, mask, plan.repack, device, plan_config, pins, split, coupling=coupling)

    units = np.array(evaluated)

    def evidence(a: LayoutRun, b: LayoutRun) -> Evidence:
        return held_out_evidence(a, b, units, seed)

    ev = evidence(base, new)
    bm, pm = base.summary, new.summary
    if tpot_parts is None:
        tpot = bm.tpot_s
        tpot_source = ("replay model: C from dense_seconds and compute_bytes_per_second, S predicted, "
                       f"O = other_seconds_per_token = {config.other_seconds_per_token:g} s (--other-ms)")
    else:
        tpot = tpot_parts.compute_s + bm.stall_per_token_s + tpot_parts.other_s
        tpot_source = f"{tpot_parts.source}, S predicted for the baseline"
    need = threshold * tpot
    verdict = judge(ev, need, min_sessions)
    est, low, high = ev.interval()
    headroom = bm.stall_per_token_s - bm.oracle_stall_per_token_s
    reason = _reason(verdict, ev, tpot, threshold, headroom, bm, pm.oracle_stall_per_token_s,
                     o_is_zero=config.other_seconds_per_token == 0 and tpot_parts is None)
    return GateRecord(
        format=GATE_FORMAT, version=GATE_VERSION, verdict=verdict.verdict, reason=reason, tool_version=__version__,
        plan=PlanRef(plan.path, plan.digest, plan.method, plan.source_fingerprint, plan.source_kind),
        baseline=BaselineRef("plan", baseline.path, baseline.digest) if baseline else BaselineRef("stock"),
        trace=TraceRef(trace.source, trace.fingerprint(), [trace.sessions[i] for i in evaluated], sorted(held.excluded),
                       dict(sorted(held.excluded.items())), held.matched_by),
        device=DeviceRef(device.name, device.digest(), device.to_json()),
        runtime=config,
        threshold=Threshold(threshold, need, tpot, tpot_source),
        evidence=records.from_json(GateEvidence, {**ev.to_json(), "sufficient": verdict.sufficient, "sufficiency": verdict.sufficiency,
                                                  "min_sessions": min_sessions, "p_below_threshold": ev.p_below(need)}, None),
        saving_per_token_s=Interval(est, low, high, _unit_name(ev), len(ev.base), ev.method),
        saving_fraction_of_tpot=Interval(est / tpot, low / tpot, high / tpot),
        decomposition=_decomposition(base, repack, new, evidence),
        headroom=Headroom(bm.stall_per_token_s, bm.oracle_stall_per_token_s, pm.oracle_stall_per_token_s, headroom, headroom / tpot),
        baseline_metrics=bm,
        plan_metrics=pm,
        per_session=[SessionResult(trace.sessions[i], int(base.sessions["committed"][i]), float(base.sessions["stall"][i]),
                                   float(new.sessions["stall"][i]), float(base.sessions["oracle"][i])) for i in evaluated],
        pins=pins_used,
    )


def _unit_name(ev: Evidence) -> str:
    if ev.method == "session":
        return "session"
    return f"step (resampled in blocks of {ev.block_steps}; {ev.n_sessions} held-out session(s))"


def _decomposition(base: LayoutRun, repack: LayoutRun | None, new: LayoutRun, evidence) -> Decomposition | None:
    """Saving from repacking (source order, new packing) and from ordering, each with its interval."""
    if repack is None:
        return None
    return Decomposition(Interval(*evidence(base, repack).interval()), Interval(*evidence(repack, new).interval()),
                         repack.summary.stall_per_token_s)


def _reason(verdict: Verdict, ev: Evidence, tpot: float, threshold: float, headroom: float, base: LayoutMetrics,
            plan_oracle: float, *, o_is_zero: bool) -> str:
    ms = 1e3
    est, low, high = ev.interval()
    o = " (O = 0: pass --other-ms or --tpot-from to count other per-token time)" if o_is_zero else ""
    text = (f"predicted saving {est * ms:.3f} ms/token (95% CI {low * ms:.3f} to {high * ms:.3f}; {verdict.sufficiency}) = "
            f"{low / tpot:.1%} of baseline TPOT {tpot * ms:.1f} ms{o} at the interval's low end; the gate needs {threshold:.0%}.")
    if verdict.verdict == "insufficient":
        return f"INSUFFICIENT: {text} Not enough held-out evidence for a verdict: {verdict.sufficiency}."
    if verdict.verdict == "pass":
        return "PASS: " + text
    if headroom < threshold * tpot:
        bound = "" if abs(plan_oracle - base.oracle_stall_per_token_s) < 1e-12 else \
            f" (the plan's own bound is {plan_oracle * ms:.2f} ms/token)"
        return (f"FAIL: {text} No headroom: baseline stall {base.stall_per_token_s * ms:.2f} ms/token is within "
                f"{headroom * ms:.2f} ms of the baseline's oracle bound{bound} ({headroom / tpot:.1%} of TPOT), so no reordering "
                "can reach the threshold here.")
    return f"FAIL: {text} The bound leaves {headroom / tpot:.1%} of TPOT of headroom, but this layout does not capture enough of it."


def sweep(plan: Plan, trace: TraceSource, device: ArrayProfile, config: RuntimeConfig, ram_gb: list[float],
          workers: list[int], threshold: float = DEFAULT_THRESHOLD, baseline: Plan | None = None, *,
          min_sessions: int = MIN_SESSIONS, executor=None) -> list[SweepCell]:
    """The regime map: the gate over RAM budgets x workers x coalescing.

    Many cells test many hypotheses: each cell's one-sided bootstrap p-value of "saving below the
    threshold" is corrected by Holm's procedure at the family-wise level of one cell's test
    (2.5%, the lower tail of a 95% interval); ``holm_significant`` says which cells stay passing.

    Cells are independent: ``executor`` (a :class:`replay.execution.Executor`; default serial, in
    this process) runs one task per cell, with the plan, trace and device shared once. The table
    is the same whichever executor runs it.

    Parameters
    ----------
    plan, trace, device, config, threshold, baseline, min_sessions : as for :func:`compare`.
    ram_gb : RAM budgets, GB (10^9 bytes).
    workers : reader worker counts.
    executor : where the cells run.

    Returns
    -------
    One :class:`replay.formats.sweepfile.SweepCell` per cell (:func:`sweep_cell`), with
    ``holm_significant`` None where the cell's evidence did not suffice.
    """
    from replay.execution import SerialExecutor

    executor = executor or SerialExecutor()
    grid = [(ram, replace(config, ram_bytes=int(ram * 1e9), workers=w, coalesce=co, batched=False))
            for ram in ram_gb for w in workers for co in (False, True)]
    shared = [None if x is None else executor.share(x) for x in (plan, trace, device, baseline)]
    cells = executor.map(sweep_cell, [(*shared, cfg, threshold, min_sessions, ram) for ram, cfg in grid], desc="sweep cells")
    judged = [i for i, c in enumerate(cells) if c.sufficient]
    rejected = holm([cells[i].p_below_threshold for i in judged], SWEEP_ALPHA)
    cells = list(cells)
    for i, r in zip(judged, rejected):
        cells[i] = replace(cells[i], holm_significant=bool(r and cells[i].verdict == "pass"))
    return cells


def sweep_cell(plan: Plan, trace: TraceSource, device: ArrayProfile, baseline: Plan | None, config: RuntimeConfig,
               threshold: float, min_sessions: int, ram_gb: float) -> SweepCell:
    """One cell of :func:`sweep`: the gate at ``config`` (whose RAM budget is ``ram_gb`` GB), as
    the sweep table's row before Holm's correction (``holm_significant`` None)."""
    g = compare(plan, trace, device, config, baseline, threshold, min_sessions=min_sessions)
    return SweepCell(ram_gb=ram_gb, workers=config.workers, coalesce=config.coalesce, verdict=g.verdict,
                     baseline_stall_s=g.baseline_metrics.stall_per_token_s,
                     plan_stall_s=g.plan_metrics.stall_per_token_s,
                     oracle_stall_s=g.headroom.oracle_stall_s,
                     saving=g.saving_per_token_s, saving_fraction_of_tpot=g.saving_fraction_of_tpot,
                     tpot_s=g.threshold.tpot_s, p_below_threshold=g.evidence.p_below_threshold,
                     sufficient=g.evidence.sufficient, pins=g.pins.source, holm_significant=None)
