"""The text of a validation's summary: the verdict's sentence, then one labelled line per aspect behind it.

:func:`summary_lines` words what :mod:`.summary` counted (a :class:`.summary.Tally` and the
:class:`.summary.Speeds`): the verdict and why on the first line, with what the harness's compute
or the disk's drift explains of a gap; then layout savings, prefetch savings, the judgements, the
misses chance allows, contradictions, scattered repetitions, the disk's drift, the runs at their
own speed, the harness's compute, drive reads, waits for the page cache, slow first reads, the
drive, the per-read cost and the placement control. S in ms/token in the text.
"""

from __future__ import annotations

import math

from replay.evaluation.stats import family_widening, student_t_quantile

from .rules import (CLOSE_BAND, GATE_THRESHOLD, HARNESS_EXCESS, PREFETCH_TOLERANCE, READS_AGREE, TOLERANCE, VERDICT_REPS, in_band,
                    placement_bound)


def verdict_sentence(t) -> str:
    """The verdict and why (``t``: a :class:`.summary.Tally`)."""
    lo, hi, ratios, within, verdict, reps = t.lo, t.hi, t.ratios, t.within, t.verdict, t.reps
    cells_out, cells_open, wrong, outside, pf_wrong, pf_out = t.cells_out, t.cells_open, t.wrong, t.outside, t.pf_wrong, t.pf_out
    M, P, ratio_ok, gate_diff, missed, allowed, placed, chance = t.M, t.P, t.ratio_ok, t.gate_diff, t.missed, t.allowed, t.placed, t.chance
    span = f"predicted/measured S {lo:.2f}-{hi:.2f} over {len(ratios)} cells" if ratios else "no cell measured any stall"
    open_cells = (f"{cells_open} of {t.cells} cell(s) are beyond +/-{TOLERANCE:.0%} but inside their measured family "
                  "interval widened by it")
    if verdict == "holds":
        head = f"the model holds on this disk within {math.ceil(round(within * 100, 6))}% ({span})"
    elif verdict == "insufficient":
        reach = (f"over {reps}, a 95% interval reaches {student_t_quantile(0.975, reps):.1f} standard errors either "
                 "side, so an agreement confirms little, and " if reps >= 2 else "")
        head = (f"INSUFFICIENT on this disk: {reps} repetition(s) per cell, where a verdict needs {VERDICT_REPS} "
                f"({reach}no measurement here rules the model out); rerun with --reps {VERDICT_REPS} or a larger "
                f"--minutes ({span})")
    elif verdict == "does not hold":
        why = []
        if not ratios:
            why.append(span)
        if cells_out:
            why.append(f"in {cells_out} of {t.cells} cell(s) the predicted S lies outside the measured family "
                       f"interval widened by +/-{TOLERANCE:.0%}")
        if wrong:
            why.append(f"the layout saving's sign is wrong beyond the measured family interval and placement in "
                       f"{len(wrong)} of {M} comparison(s)")
        if outside:
            why.append(f"the predicted layout saving lies beyond the measured family interval and placement in "
                       f"{len(outside)} of {M}")
        if pf_wrong:
            why.append(f"the prefetch saving's sign is wrong beyond the measured family interval in {len(pf_wrong)} of {P}")
        if len(pf_out) > len(pf_wrong):
            why.append(f"the predicted prefetch saving lies beyond the measured family interval widened by "
                       f"+/-{PREFETCH_TOLERANCE:.0%} in {len(pf_out) - len(pf_wrong)} of {P}")
        if cells_open:
            why.append(open_cells)
        head = "the model does NOT hold on this disk: " + "; ".join(why) + (f" ({span})" if ratios else "")
    else:
        why = []
        if not ratio_ok and not cells_open:
            why.append(f"predicted/measured S is beyond +/-{TOLERANCE:.0%} in some cell")
        if cells_open:
            why.append(open_cells)
        if gate_diff:
            why.append(f"the gate would decide differently in {len(gate_diff)} of {M}")
        if missed > allowed:
            why.append(f"{missed} of {M + P} saving(s) lie outside their measured 95% interval, more than the {allowed} "
                       "chance gives a correct model in 95% of runs, though none is ruled out"
                       + (f" ({len(placed)} of them beyond their family interval by no more than placement alone does)"
                          if placed else ""))
        advice = []
        if cells_open or gate_diff or len(chance) > allowed:
            advice.append("the measured runs scatter too widely to decide: rerun with more --reps on an idle disk")
        if placed and missed > allowed:
            advice.append("more repetitions do not separate a layout saving from placement: on this disk a layout "
                          "saving smaller than the placement control's difference cannot be measured")
        head = (f"INCONCLUSIVE on this disk: no measurement rules the model out, but it is not confirmed ({span}): "
                + "; ".join(why) + (". " + "; ".join(advice)[0].upper() + "; ".join(advice)[1:] if advice else ""))
    return head


def harness_note(t, harness: dict | None) -> str:
    """What the harness's own compute explains of a gap, appended to the verdict's sentence ("" when nothing)."""
    verdict, pf_out = t.verdict, t.pf_out
    head = ""
    if (verdict != "holds" and harness and harness["excess_max"] > HARNESS_EXCESS and not pf_out
            and 0 < harness["cells_within_band"] == harness["cells"] and not harness["savings_ruled_out"]):
        head += (f". The measuring harness's own work lengthened its compute by up to {harness['excess_max']:.0%} of the "
                 f"model's, and at each run's speed with the compute it ran every cell's S is within "
                 f"{math.ceil(round(harness['within'] * 100, 6))}% of measurement"
                 + (f" and no layout saving is ruled out (inside the measured interval: {harness['savings_inside']} of "
                    f"{harness['savings']})" if harness["savings"] else "")
                 + ": the gap is the harness's more than the model's")
    return head


def drift_note(t, s, drift: float | None) -> str:
    """What the disk's probed drift explains of a gap, appended to the verdict's sentence ("" when nothing)."""
    verdict, cells_out, cells_open, ratio_ok, ratios = t.verdict, t.cells_out, t.cells_open, t.ratio_ok, t.ratios
    probed, probed_within = s.probed, s.probed_within
    head = ""
    if (verdict != "holds" and (cells_out or cells_open or not ratio_ok) and probed_within is not None
            and in_band(probed) == len(probed) > in_band(ratios)):
        head += (f". The disk's own speed moved by {drift:.0%} during the run, and at its probed speed every cell's S is "
                 f"within {math.ceil(round(probed_within * 100, 6))}% of measurement: the gap on the profile is the disk's "
                 "speed more than the model")
    return head


def summary_lines(t, s, cells: list[dict], *, drift: float | None, harness: dict | None, reads: dict | None,
                  waits: dict | None, slow: list, sharing: tuple | None, merge: tuple | None, placement: list | None,
                  hidden: int | None) -> list[str]:
    """The summary's text, line by line (``t``: a :class:`.summary.Tally`, ``s``: the :class:`.summary.Speeds`;
    the rest as :func:`.summary.summarize_validation` found them): the verdict's sentence, then
    ``"  label: sentence"`` per aspect."""
    lines = [verdict_sentence(t) + harness_note(t, harness) + drift_note(t, s, drift)]

    def line(label: str, sentence: str) -> None:
        lines.append(f"  {label}: {sentence}")

    judgement_lines(line, t, cells)
    speed_lines(line, t, s, cells, drift)
    if harness:
        harness_line(line, harness)
    if reads:
        reads_line(line, reads)
    if waits and max(hi for _, hi in waits["by_layout"].values()) > 0:
        waits_line(line, waits)
    disk_lines(line, t, slow=slow, sharing=sharing, merge=merge, placement=placement, hidden=hidden)
    return lines


def judgement_lines(line, t, cells: list[dict]) -> None:
    """Layout savings, prefetch savings, the judgements a verdict rests on, chance, contradictions, scattered repetitions."""
    M, P, inside, placed, sign_wrong, decided, wrong = t.M, t.P, t.inside, t.placed, t.sign_wrong, t.decided, t.wrong
    gate_diff, gate_placed, pf_close, pf_out, pf_precise, reps = t.gate_diff, t.gate_placed, t.pf_close, t.pf_out, t.pf_precise, t.reps
    missed, allowed, contradicted, spread, verdict = t.missed, t.allowed, t.contradicted, t.spread, t.verdict
    if M:
        line("layout savings", f"the predicted saving lies inside the measured 95% interval in {len(inside)} of {M} "
             f"comparison(s)" + (f", beyond its family interval by no more than placement alone does in {len(placed)}"
                                 if placed else "")
             + f"; the sign is wrong in {len(sign_wrong)} of {len(decided)} where the measured 95% interval excludes "
             f"zero ({len(wrong)} of them ruled out); the gate (low end >= {GATE_THRESHOLD:.0%} of TPOT) decides "
             f"differently in {len(gate_diff)} of {M}" + (f" and in {len(gate_placed)} more whose prediction is off by no "
                                                       "more than placement" if gate_placed else ""))
    if P:
        line("prefetch savings", f"the predicted prefetch saving is within +/-{PREFETCH_TOLERANCE:.0%} of the measured "
             f"one in {len(pf_close)} of {P} and ruled out by the measurement in {len(pf_out)} of {P}; the measurement "
             f"itself resolves +/-{PREFETCH_TOLERANCE:.0%} (its 95% interval's half-width within that fraction of the "
             f"measured saving) in {len(pf_precise)} of {P}, and there the prediction is within it in "
             f"{sum(c['within_tolerance'] for c in pf_precise)}")
    family = next((c["measured_stall_per_token_s"]["family"] for c in cells
                   if c.get("measured_stall_per_token_s", {}).get("family")), None)
    if family:
        line("judgements", f"this verdict rests on {family['judgements']} (each cell's S, each layout's and each "
             f"prefetch source's saving); a prediction is ruled out only beyond its {family['level']:.2%} interval, "
             "so that a correct model is ruled out by chance in at most 5% of runs"
             + (f"; over {reps} repetitions that interval is {family_widening(family['level'], reps):.1f} times as wide "
                "as the 95% one" if reps > 1 else ""))
    if missed:
        line("chance", f"{missed} of {M + P} saving(s) lie outside their measured 95% interval without being ruled "
             f"out; up to {allowed} such are what chance gives a correct model in 95% of runs")
    if contradicted:
        line("contradicted", f"measurement CONTRADICTS the prediction in {len(contradicted)} comparison(s): "
             + "; ".join(f"{c['layout']} at RAM {c['ram_fraction']:g}, prefetch {c['prefetch']}" for c in contradicted))
    if spread is not None and spread > TOLERANCE:
        line("repetitions", f"those of one cell differ by up to {spread:.0%} of their mean: the disk was not steady "
             "(other I/O?)" + ("" if verdict == "inconclusive" else
                               ", so rerun on an idle machine or with more --reps before reading the savings"))


def speed_lines(line, t, s, cells: list[dict], drift: float | None) -> None:
    """The disk's drift; the cells at each run's speed and at its neighbours'; the savings at equal disk speed."""
    ratios = t.ratios
    probed, probed_within, at_run, at_near, run_savings, run_pf = s.probed, s.probed_within, s.at_run, s.at_near, s.run_savings, s.run_pf
    if probed_within is not None:
        line("the disk's drift", f"its probed rate moved by {drift:.0%} during the run; predicting each repetition at "
             f"its probed speed gives predicted/measured S {min(probed):.2f}-{max(probed):.2f} "
             f"({in_band(probed)} of {len(probed)} cells within +/-{CLOSE_BAND:.0%}, "
             f"against {in_band(ratios)} of {len(ratios)} on the profile as calibrated)")
    if at_run:
        scales = s.scales
        sentence = (f"the speed each run's disk served its reads at (the run's drive bytes over the time the drive was "
                    f"busy, {min(scales):.2f}-{max(scales):.2f} times the profile's) gives predicted/measured S "
                    f"{min(at_run):.2f}-{max(at_run):.2f} ({in_band(at_run)} of {len(at_run)} cells within "
                    f"+/-{CLOSE_BAND:.0%}): this tests the read path, queueing and overlap with compute, not a forecast of "
                    "the disk's speed")
        compute = max((c["predicted_tpot_s"] - c["predicted_stall_per_token_s"]) / c["predicted_stall_per_token_s"]
                      for c in cells if c["predicted_stall_per_token_s"] > 0)
        if compute < TOLERANCE:
            sentence += (f", and with compute at most {compute:.0%} of S here, S is mostly drive time and this check is "
                         "close to an identity: what it shows is that the gap on the profile is the disk's speed")
        line("at each run's speed", sentence)
        if at_near:
            line("at the neighbours' speed", f"the speed of the runs interleaved with each run (read off those runs, "
                 f"not the run itself: a test of the prediction with the disk's drift followed) gives predicted/measured S "
                 f"{min(at_near):.2f}-{max(at_near):.2f} ({in_band(at_near)} of {len(at_near)} cells within "
                 f"+/-{CLOSE_BAND:.0%})")
        for what, xs in (("layout", run_savings), ("prefetch", run_pf)):
            if xs:
                width = max((x["measured"]["high_s"] - x["measured"]["low_s"]) / 2 for x in xs) * 1e3
                close = (f", within +/-{PREFETCH_TOLERANCE:.0%} of it in {sum(x['within_tolerance'] for x in xs)}"
                         if what == "prefetch" else "")
                line(f"{what} savings at equal disk speed", f"the predicted {what} saving lies inside the measured "
                     f"interval in {sum(x['predicted_inside_measured'] for x in xs)} of {len(xs)} (half-widths up to "
                     f"{width:.2f} ms/token){close}, ruled out in {sum(x['agreement'] == 'disagrees' for x in xs)}")


def harness_line(line, harness: dict) -> None:
    """The harness's compute against the model's (:func:`.summary.harness_compute`)."""
    line("the harness's compute", f"the measuring harness computed {harness['excess_min']:+.0%} to "
         f"{harness['excess_max']:+.0%} more than the model's compute ({harness['excess_min_s'] * 1e3:+.2f} to "
         f"{harness['excess_max_s'] * 1e3:+.2f} ms/token; in that excess, layouts of one RAM budget and prefetch "
         f"source differ by up to {harness['layout_spread_s'] * 1e3:.2f} ms/token): its own Python work beyond the "
         "emulated compute. Counted as compute between a layer's reads, that work overlaps them and hides stall the "
         "runtime would show, the more so for layouts issuing more reads; relayout's harness times its waits in the "
         "compute model's time, so an excess that is large or differs between layouts marks a record measured before "
         "it did"
         + (f"; at each run's speed with the compute it ran, the model gives predicted/measured S "
            f"{harness['ratio_min']:.2f}-{harness['ratio_max']:.2f} ({harness['cells_within_band']} of "
            f"{harness['cells']} cells within +/-{CLOSE_BAND:.0%})" if harness["cells"] else "")
         + (f", and at equal disk speed and compute the predicted layout saving lies inside the measured interval "
            f"in {harness['savings_inside']} of {harness['savings']}, ruled out in {harness['savings_ruled_out']}"
            if harness["savings"] else ""))


def reads_line(line, reads: dict) -> None:
    """The demand reads that reach the drive, the model's against the harness's (:func:`.summary.drive_reads_check`)."""
    sentence = (f"the model's demand preads that reach the drive are {reads['ratio_min']:.2f}-"
                f"{reads['ratio_max']:.2f} times the harness's per token ({reads['within']} of {reads['cells']} "
                f"cells within +/-{READS_AGREE:.0%})" if reads["cells"] else "")
    if reads["unmeasured"]:
        sentence += (", and " if sentence else "") + (f"in {reads['unmeasured']} cell(s) the model read from the drive "
                                                      "and the harness did not")
    if reads["within"] < reads["cells"] or reads["unmeasured"]:
        sentence += (": the two read the same preads (one read path) and disagree about which of them reach the drive, "
                     "a difference in what is read, not in the drive's speed")
        if reads["cells"] and reads["ratio_min"] > 1 + READS_AGREE:
            sentence += ("; the model's page cache (Linux's readahead at the profile's read_ahead_bytes, each arm alone) "
                         "held fewer scale pages than the kernel's, which arms reading the same container share, or, "
                         "where the harness tested with RWF_NOWAIT (page_cache_test in its runs' configuration), it took "
                         "a scale read whose own readahead had completed before it looked for a page-cache hit")
        elif reads["cells"] and reads["ratio_max"] < 1 - READS_AGREE:
            sentence += ("; the kernel's page cache held fewer scale pages than the model's: a pread that finds its pages "
                         "still being read by an earlier readahead waits for the drive (the harness counts it as a drive "
                         "read, the model as served from the page cache), or the kernel read less ahead than the "
                         "Linux 6.16-6.19 readahead the model follows")
    line("drive reads", sentence)


def waits_line(line, waits: dict) -> None:
    """The harness's waits for experts the page cache served (:func:`.summary.page_cache_waits`)."""
    line("waits for the page cache", "the harness's compute thread waited "
         + ", ".join(f"{lo * 1e3:.2f}-{hi * 1e3:.2f} ms/token in {m}" for m, (lo, hi) in waits["by_layout"].items())
         + " for experts whose own reads the page cache served (a coalesced run's later experts: their weights come "
         "with the run's first read, their scale reads follow as jobs of their own and find their pages cached): "
         "bytes the runtime, in C, has in microseconds, and the model charges memory time for, where a Python "
         "harness's reader thread takes tens of microseconds a job"
         + (f"; at equal disk speed less these waits, the predicted layout saving lies inside the measured interval "
            f"in {waits['savings_inside']} of {waits['savings']}, ruled out in {waits['savings_ruled_out']}"
            if waits["savings"] else ""))


def disk_lines(line, t, *, slow: list, sharing: tuple | None, merge: tuple | None, placement: list | None,
               hidden: int | None) -> None:
    """Slow first reads, a drive that shares itself, the per-read cost, the placement control."""
    M = t.M
    if slow:
        line("first reads", "read once before measuring, " + ", ".join(f"the {m} container ran at {f:.0%}" for m, f in slow)
             + " of the fastest: this disk does not serve every file alike on a first read (a host cache or a lazily "
             "fetched volume below the guest can do this), so every container was read once before any was measured; "
             "runtime measurements of two containers on this disk are comparable only after the same")
    if sharing and sharing[1]:
        line("the drive", "the calibration found that " + sharing[0])
    if merge:
        line("per-read cost", "in the calibration, " + merge[0])
    if placement:
        bound = placement_bound(placement)
        block = max(placement, key=lambda b: placement_bound([b]))
        worst = block["difference"]
        line("placement control", f"two byte-identical copies of stock differed by {worst['estimate_s'] * 1e3:+.2f} "
             f"ms/token [{worst['low_s'] * 1e3:+.2f}, {worst['high_s'] * 1e3:+.2f}] at RAM {block['ram_fraction']:g} "
             f"(the block whose interval reaches farthest): a measured layout saving within {bound * 1e3:.2f} ms/token "
             f"is not separable from where the disk put the files, and {hidden} of {M} are no larger")
