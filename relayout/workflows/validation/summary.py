"""A validation's verdict and the counts behind it: the ``summary`` of a ``validation.json`` record.

:func:`summarize_validation` turns the judged cells and savings (each with its ``agreement``,
:mod:`.rules`) into the verdict (``holds``, ``does not hold``, ``insufficient`` or
``inconclusive``), the counts it rests on (:class:`Tally`), the diagnoses' summaries
(:func:`harness_compute`, :func:`drive_reads_check`, :func:`page_cache_waits`, the runs at their
own and their neighbours' speed) and the text saying so (:mod:`.summary_text`). Pure functions of
the record's cells and comparisons; S in seconds per committed token.
"""

from __future__ import annotations

from dataclasses import dataclass

from replay.evaluation.stats import chance_misses

from .rules import (FIRST_READ_SLOW, PREFETCH_TOLERANCE, READS_AGREE, TOLERANCE, VERDICT_REPS, in_band, placement_bound,
                    resolves_tolerance)
from .summary_text import summary_lines


@dataclass(frozen=True)
class Tally:
    """The judgements a verdict counts: the cells' predicted/measured ratios (``ratios``, their
    range ``lo``-``hi`` and largest distance from 1, ``within``), and the cells, layout savings
    (``M`` of them) and prefetch savings (``P``) by agreement; ``allowed``: the misses of a 95%
    interval chance gives a correct model in 95% of runs; ``reps``: the fewest repetitions of a
    cell; ``verdict`` and ``holds``."""

    cells: int
    ratios: list
    lo: float | None
    hi: float | None
    within: float | None
    cells_out: int
    cells_open: int
    decided: list
    sign_wrong: list
    wrong: list
    placed: list
    gate_diff: list
    gate_placed: list
    inside: list
    outside: list
    contradicted: list
    pf_close: list
    pf_precise: list
    pf_out: list
    pf_wrong: list
    chance: list
    missed: int
    M: int
    P: int
    allowed: int
    spread: float | None
    ratio_ok: bool
    ruled_out: bool
    reps: int
    few: bool
    holds: bool
    verdict: str


def tally(cells: list[dict], comparisons: list[dict], prefetch_comparisons: list[dict]) -> Tally:
    """Count the judged cells and savings and decide the verdict (``docs/VALIDATION.md``, "The verdict"):
    ``"does not hold"`` when a measurement rules a prediction out (or no cell measured any stall);
    else ``"insufficient"`` with fewer than :data:`.rules.VERDICT_REPS` repetitions per cell;
    ``"holds"`` when every cell is within :data:`.rules.TOLERANCE`, the savings missing their 95%
    interval are no more than chance allows and the gate decides alike; else ``"inconclusive"``."""
    ratios = [c["ratio"] for c in cells if c["ratio"] is not None]
    lo, hi = (min(ratios), max(ratios)) if ratios else (None, None)
    within = max(abs(r - 1) for r in ratios) if ratios else None
    states = [c["agreement"] for c in cells]
    cells_out, cells_open = states.count("disagrees"), states.count("unresolved")
    decided = [c for c in comparisons if c["sign_agrees"] is not None]
    sign_wrong = [c for c in decided if not c["sign_agrees"]]
    wrong = [c for c in sign_wrong if c["agreement"] == "disagrees"]
    placed = [c for c in comparisons if c["agreement"] == "within placement"]
    gate_diff = [c for c in comparisons if not c["gate"]["same_decision"] and c["agreement"] != "within placement"]
    gate_placed = [c for c in comparisons if not c["gate"]["same_decision"] and c["agreement"] == "within placement"]
    inside = [c for c in comparisons if c["predicted_inside_measured"]]
    outside = [c for c in comparisons if c["agreement"] == "disagrees" and c["sign_agrees"] is not False]
    contradicted = [c for c in comparisons if c["agreement"] == "disagrees" and "CONTRADICTS" in c["words"]]
    pf_close = [c for c in prefetch_comparisons if c["within_tolerance"]]
    pf_precise = [c for c in prefetch_comparisons if resolves_tolerance(c["measured_saving"], PREFETCH_TOLERANCE)]
    pf_out = [c for c in prefetch_comparisons if c["agreement"] == "disagrees"]
    pf_wrong = [c for c in pf_out if c["sign_agrees"] is False]
    chance = [c for c in [*comparisons, *prefetch_comparisons] if c["agreement"] == "unresolved"]
    missed = len(chance) + len(placed)           # savings outside their 95% interval, not ruled out
    M, P = len(comparisons), len(prefetch_comparisons)
    allowed = chance_misses(M + P) if M + P else 0
    spreads = [(max(c["measured_stall_per_token_s"]["repetitions"]) - min(c["measured_stall_per_token_s"]["repetitions"]))
               / c["measured_stall_per_token_s"]["mean"] for c in cells
               if c.get("measured_stall_per_token_s") and c["measured_stall_per_token_s"]["mean"] > 0]
    spread = max(spreads) if spreads else None
    ratio_ok = within is not None and within <= TOLERANCE
    ruled_out = bool(cells_out or wrong or outside or pf_out or not ratios)
    reps = min((len(c["measured_stall_per_token_s"]["repetitions"]) for c in cells
                if c.get("measured_stall_per_token_s")), default=0)
    few = reps < VERDICT_REPS
    holds = ratio_ok and not cells_open and not ruled_out and not gate_diff and missed <= allowed and not few
    verdict = ("holds" if holds else "does not hold" if ruled_out else "insufficient" if few else "inconclusive")
    return Tally(cells=len(cells), ratios=ratios, lo=lo, hi=hi, within=within, cells_out=cells_out,
                 cells_open=cells_open, decided=decided, sign_wrong=sign_wrong, wrong=wrong, placed=placed,
                 gate_diff=gate_diff, gate_placed=gate_placed, inside=inside, outside=outside,
                 contradicted=contradicted, pf_close=pf_close, pf_precise=pf_precise, pf_out=pf_out,
                 pf_wrong=pf_wrong, chance=chance, missed=missed, M=M, P=P, allowed=allowed, spread=spread,
                 ratio_ok=ratio_ok, ruled_out=ruled_out, reps=reps, few=few, holds=holds, verdict=verdict)


@dataclass(frozen=True)
class Speeds:
    """The cells' predicted/measured S at the disk's probed speed (``probed``, with its largest
    distance from 1, ``probed_within``, when the disk was probed), at each run's own speed
    (``at_run``, ``run_within``, the speed factors ``scales``) and at its neighbours' (``at_near``);
    and the layout and prefetch savings judged at equal disk speed (``run_savings``, ``run_pf``)."""

    probed: list
    probed_within: float | None
    at_run: list
    run_within: float | None
    scales: list
    at_near: list
    run_savings: list
    run_pf: list


def speeds(cells: list[dict], comparisons: list[dict], prefetch_comparisons: list[dict], drift: float | None) -> Speeds:
    """The cells and savings predicted at the disk's speed (:class:`Speeds`)."""
    probed = [c["at_probed_speed"]["ratio"] for c in cells if c.get("at_probed_speed") and c["at_probed_speed"]["ratio"]]
    at_run = [c["at_run_speed"]["ratio"] for c in cells if c.get("at_run_speed") and c["at_run_speed"]["ratio"]]
    return Speeds(
        probed=probed, probed_within=max(abs(r - 1) for r in probed) if drift is not None and probed else None,
        at_run=at_run, run_within=max(abs(r - 1) for r in at_run) if at_run else None,
        scales=[f for c in cells if c.get("at_run_speed") for f in c["at_run_speed"]["scales"]],
        at_near=[c["at_neighbour_speed"]["ratio"] for c in cells
                 if c.get("at_neighbour_speed") and c["at_neighbour_speed"]["ratio"]],
        run_savings=[c["at_run_speed"] for c in comparisons if c.get("at_run_speed")],
        run_pf=[c["at_run_speed"] for c in prefetch_comparisons if c.get("at_run_speed")])


def harness_compute(cells: list[dict], comparisons: list[dict]) -> dict | None:
    """How far the measuring harness's compute ran from the model's, and the model with it.

    Per cell, the measured compute per committed token (the time between waits, from the step
    records) against the model's (``predicted_compute_per_token_s``); and the predictions at
    each run's speed with the compute it ran (:func:`.diagnoses.at_harness_compute`). Returns
    ``excess_min``/``excess_max`` (fractions of the model's compute) and
    ``excess_min_s``/``excess_max_s`` (s/token), ``layout_spread_s`` (the largest difference in
    excess between layouts measured with the same RAM budget and prefetch source, s/token),
    ``ratio_min``/``ratio_max``/``within``/``cells_within_band`` of predicted/measured S with that
    compute over ``cells`` cells, and over the layout comparisons judged with it (``savings``), how
    many lie inside their measured interval and how many are ruled out. None when no cell carries
    both computes.
    """
    rows = [c for c in cells if c.get("measured_compute_per_token_s") and c.get("predicted_compute_per_token_s")]
    if not rows:
        return None
    excess = [c["measured_compute_per_token_s"]["mean"] - c["predicted_compute_per_token_s"] for c in rows]
    frac = [e / c["predicted_compute_per_token_s"] for e, c in zip(excess, rows)]
    groups = {}
    for e, c in zip(excess, rows):
        groups.setdefault((c["ram_fraction"], c["prefetch"]), []).append(e)
    ratios = [c["at_harness_compute"]["ratio"] for c in rows
              if c.get("at_harness_compute") and c["at_harness_compute"]["ratio"] is not None]
    judged = [x["at_harness_compute"] for x in comparisons if x.get("at_harness_compute")]
    return {"excess_min": min(frac), "excess_max": max(frac), "excess_min_s": min(excess), "excess_max_s": max(excess),
            "layout_spread_s": max(max(g) - min(g) for g in groups.values()),
            "cells": len(ratios), "ratio_min": min(ratios, default=None), "ratio_max": max(ratios, default=None),
            "within": max((abs(r - 1) for r in ratios), default=None), "cells_within_band": in_band(ratios),
            "savings": len(judged), "savings_inside": sum(x["predicted_inside_measured"] for x in judged),
            "savings_ruled_out": sum(x["agreement"] == "disagrees" for x in judged)}


def drive_reads_check(cells: list[dict]) -> dict | None:
    """Whether the model and the harness agree on which demand reads reach the drive: per cell
    the model's demand preads that do (``predicted_drive_reads_per_token``) over the harness's
    (the records' ``drive_requests``, one per pread; ``measured_drive_reads_per_token``, None
    where a run could not read weights with O_DIRECT and the page cache may have served them).
    Returns ``ratio_min``/``ratio_max`` over the ``cells`` cells where the harness read from the
    drive, how many are within :data:`.rules.READS_AGREE` (``within``), and ``unmeasured``: cells
    where the model read from the drive and the harness did not; None when no cell has both."""
    rows = [c for c in cells if c.get("measured_drive_reads_per_token")]
    ratios = [c["predicted_drive_reads_per_token"] / c["measured_drive_reads_per_token"]["mean"] for c in rows
              if c["measured_drive_reads_per_token"]["mean"] > 0]
    unmeasured = sum(c["measured_drive_reads_per_token"]["mean"] <= 0 < c["predicted_drive_reads_per_token"] for c in rows)
    if not ratios and not unmeasured:
        return None
    return {"cells": len(ratios), "ratio_min": min(ratios, default=None), "ratio_max": max(ratios, default=None),
            "within": sum(abs(r - 1) <= READS_AGREE for r in ratios), "unmeasured": unmeasured}


def page_cache_waits(cells: list[dict], comparisons: list[dict]) -> dict | None:
    """What the harness's waits for experts whose own reads the page cache served (the cells'
    ``measured_page_cache_wait_per_token_s``, :func:`replay.physical.stalltrace.page_cache_wait`) come to,
    and the layout savings at equal disk speed less them. Returns per layout the smallest and
    largest mean wait over its cells (``by_layout``, s/token), and over the layout comparisons
    judged that way (``savings``) how many lie inside their measured interval and how many are
    ruled out. None when no cell carries the waits (runs whose records have no I/O counts)."""
    rows = [c for c in cells if c.get("measured_page_cache_wait_per_token_s")]
    if not rows:
        return None
    by_layout = {}
    for c in rows:
        by_layout.setdefault(c["layout"], []).append(c["measured_page_cache_wait_per_token_s"]["mean"])
    judged = [x for x in comparisons if x.get("less_page_cache_waits")]
    return {"by_layout": {m: (min(w), max(w)) for m, w in by_layout.items()}, "savings": len(judged),
            "savings_inside": sum(x["less_page_cache_waits"]["predicted_inside_measured"] for x in judged),
            "savings_ruled_out": sum(x["less_page_cache_waits"]["agreement"] == "disagrees" for x in judged)}


def summarize_validation(cells: list[dict], comparisons: list[dict], drift: float | None = None,
                         prefetch_comparisons: list[dict] = (), first_read: dict | None = None,
                         sharing: tuple[str, bool] | None = None, placement: list[dict] | None = None,
                         merge: tuple[str, float | None] | None = None) -> dict:
    """Whether the model holds, with the counts behind it and the text saying so.

    Parameters
    ----------
    cells, comparisons, prefetch_comparisons : the record's judged cells, layout savings and
        prefetch savings (each with its ``agreement``, :func:`.record.judge_record`).
    drift : how far the disk's probed rate moved during the run (largest / smallest probe - 1),
        None when not probed; the text then adds predicted/measured S with each repetition
        predicted at its probed speed (a diagnosis: the verdict stays on the calibrated profile).
    first_read : each layout's read-once rate; one below :data:`.rules.FIRST_READ_SLOW` of the
        fastest is named.
    sharing : how the calibration saw concurrent reads complete
        (:func:`relayout.render.measurements.completion_sentence`), None with a given profile.
    placement : the placement control's blocks (:func:`.rules.placement_difference`).
    merge : what merging two reads saved in the calibration against the profile's prediction
        (:func:`relayout.render.measurements.merge_sentence`: its sentence and predicted / measured).

    Returns
    -------
    The record's ``summary``: ``verdict`` (``"holds"``, ``"does not hold"``, ``"insufficient"``
    or ``"inconclusive"``, :func:`tally`), ``holds``, the counts behind it, the diagnoses'
    summaries, and ``text``: the verdict's sentence on its first line, then one labelled line per
    aspect behind it (:func:`.summary_text.summary_lines`).
    """
    t = tally(cells, comparisons, prefetch_comparisons)
    s = speeds(cells, comparisons, prefetch_comparisons, drift)
    harness = harness_compute(cells, comparisons)
    reads = drive_reads_check(cells)
    waits = page_cache_waits(cells, comparisons)
    slow = slow_first_reads(first_read)
    bound, hidden = None, None
    if placement:
        bound = placement_bound(placement)
        hidden = sum(abs(c["measured_saving"]["estimate_s"]) <= bound for c in comparisons)
    text = "\n".join(summary_lines(t, s, cells, drift=drift, harness=harness, reads=reads, waits=waits, slow=slow,
                                   sharing=sharing, merge=merge, placement=placement, hidden=hidden))
    return {"verdict": t.verdict, "holds": bool(t.holds), "drift": drift, "probed_within": s.probed_within,
            "drive_shares_concurrent_reads": None if sharing is None else sharing[1],
            "merge_saving_predicted_over_measured": None if merge is None else merge[1],
            "placement_bound_s": bound, "savings_no_larger_than_placement": hidden,
            "run_speed_within": s.run_within,
            "run_speed_cells_within_band": in_band(s.at_run) if s.at_run else None,
            "neighbour_speed_within": max(abs(r - 1) for r in s.at_near) if s.at_near else None,
            "neighbour_speed_cells_within_band": in_band(s.at_near) if s.at_near else None,
            "run_speed_savings_inside": sum(x["predicted_inside_measured"] for x in s.run_savings) if s.run_savings else None,
            "run_speed_prefetch_inside": sum(x["predicted_inside_measured"] for x in s.run_pf) if s.run_pf else None,
            "run_speed_prefetch_within_tolerance": sum(x["within_tolerance"] for x in s.run_pf) if s.run_pf else None,
            "first_read_slow": [m for m, _ in slow],
            "harness_compute": harness,
            "page_cache_waits": waits,
            "drive_reads": reads,
            "repetition_spread_max": t.spread, "ratio_min": t.lo, "ratio_max": t.hi, "within": t.within,
            "tolerance": TOLERANCE,
            "cells": len(cells), "cells_disagree": t.cells_out, "cells_unresolved": t.cells_open,
            "comparisons": t.M, "inside_measured": len(t.inside), "outside_measured": len(t.outside),
            "sign_decided": len(t.decided), "sign_wrong": len(t.sign_wrong), "sign_wrong_ruled_out": len(t.wrong),
            "judged_within_placement": len(t.placed), "unresolved_savings": len(t.chance), "chance_allows": t.allowed,
            "gate_disagreements": len(t.gate_diff), "gate_disagreements_within_placement": len(t.gate_placed),
            "contradictions": len(t.contradicted), "prefetch_comparisons": t.P, "prefetch_within_tolerance": len(t.pf_close),
            "prefetch_disagree": len(t.pf_out), "prefetch_resolved": len(t.pf_precise),
            "prefetch_resolved_within_tolerance": sum(c["within_tolerance"] for c in t.pf_precise),
            "prefetch_tolerance": PREFETCH_TOLERANCE, "text": text}


def slow_first_reads(first_read: dict | None) -> list[tuple[str, float]]:
    """The layouts whose container was read once below :data:`.rules.FIRST_READ_SLOW` of the
    fastest one's rate, with that fraction."""
    if not first_read:
        return []
    fastest = max(r["rate_Bps"] or 0.0 for r in first_read.values())
    return [(m, r["rate_Bps"] / fastest) for m, r in first_read.items() if fastest and r["rate_Bps"] is not None
            and r["rate_Bps"] < FIRST_READ_SLOW * fastest]
