"""The text of ``validate``: predicted against measured, cell by cell and saving by saving, and the verdict."""

from __future__ import annotations

from .units import human_bytes


def _predicted_measured(x: dict) -> str:
    """One validation comparison's predicted and measured saving with their 95% intervals (ms/token)."""
    ms = 1e3
    p, m = x["predicted_saving"], x["measured_saving"]
    return (f"predicted {p['estimate_s'] * ms:+.2f} [{p['low_s'] * ms:+.2f}, {p['high_s'] * ms:+.2f}]  measured "
            f"{m['estimate_s'] * ms:+.2f} [{m['low_s'] * ms:+.2f}, {m['high_s'] * ms:+.2f}]")


def _agreement(x: dict) -> str:
    """How a validation comparison's prediction stands against its measurement, in words."""
    sign = "n/a" if x["sign_agrees"] is None else ("agrees" if x["sign_agrees"] else "WRONG")
    return (f"{'inside' if x['predicted_inside_measured'] else 'outside'}, sign {sign}, "
            f"{'DISAGREES' if x['agreement'] == 'disagrees' else x['agreement']}")


def _diagnoses(x: dict) -> list[str]:
    """A validation comparison's measured saving with each run brought to the model's conditions
    by the model's own sensitivity to them: at equal disk speed (when the runs carried I/O
    counts), and at equal disk speed and compute (each run replayed at its speed with the
    compute its harness ran; records of version 9 on), and at equal disk speed less the
    harness's waits for experts whose own reads the page cache served (version 11 on)."""
    out, ms = [], 1e3
    for key, label in (("at_run_speed", "at equal disk speed"), ("at_harness_compute", "at equal disk speed and compute"),
                       ("less_page_cache_waits", "at equal disk speed, less waits for experts read from the page cache")):
        a = x.get(key)
        if not a:
            continue
        m = a["measured"]
        close = ("" if "within_tolerance" not in a else
                 f"{'within' if a['within_tolerance'] else 'not within'} +/-{x['tolerance']:.0%}, ")
        out.append(f"    {label} (diagnosis): measured {m['estimate_s'] * ms:+.2f} [{m['low_s'] * ms:+.2f}, "
                   f"{m['high_s'] * ms:+.2f}], {close}{_agreement(a)}")
    return out


def format_validation(v: dict) -> str:
    """``relayout validate``'s tables and summary from its ``validation.json`` record (S in ms/token)."""
    ms = 1e3
    lines = [(f"device {v['device']['name']} ({v['device']['source']}); container {v['container']['path']}"
              f"{' (synthetic)' if v['container']['synthetic'] else ''}, {human_bytes(v['container']['routed_bytes'])} routed"),
             (f"{v['config']['tokens']} held-out steps x {v['config']['reps']} repetitions per cell, layouts and prefetch "
              f"sources interleaved; {v['config']['workers']} workers"
              f"{', reads coalesced' if v['config'].get('runtime', {}).get('coalesce') else ''}; {', '.join(v['config']['cache'])}")]
    if v["config"].get("chosen"):
        lines.append(v["config"]["chosen"])
    drift = v.get("drift")
    if drift:
        rates = " ".join(f"{r / 1e9:.2f}" for r in drift["rates_Bps"])
        lines.append(f"disk probe ({drift['probe']['size_bytes'] // 1024} KiB reads, depth {drift['probe']['depth']}), "
                     f"before the first repetition and after each: {rates} GB/s (moved by {drift['change']:.0%})")
    if v.get("first_read"):
        lines.append("each container read once before measuring (a virtual disk may serve a block slower the first time): "
                     + ", ".join(f"{m} {r['rate_Bps'] / 1e9:.2f} GB/s" for m, r in v["first_read"].items() if r["rate_Bps"]))
    run_speeds = any(c.get("at_run_speed") for c in v["cells"])
    harness = any(c.get("at_harness_compute") for c in v["cells"])
    lines += ["", f"{'layout':<9}{'RAM':>6}{'prefetch':>9}{'predicted S':>13}{'measured S [95% over reps] (each rep)':>46}"
                  f"{'pred/meas':>11}{'':<12}" + (f"{'at probed speed':>17}" if drift else "")
                  + (f"{'at run speed':>14}{'at neighbours':>15}" if run_speeds else "")
                  + (f"{'speed+compute':>15}" if harness else "")]
    for c in v["cells"]:
        m = c["measured_stall_per_token_s"]
        each = " ".join(f"{x * ms:.2f}" for x in m["repetitions"])
        ratio = "n/a" if c["ratio"] is None else f"{c['ratio']:.2f}"
        probed = c.get("at_probed_speed")
        at_probe = "" if not drift else f"{'n/a' if not probed or probed['ratio'] is None else format(probed['ratio'], '.2f'):>17}"
        run_speed, near = c.get("at_run_speed"), c.get("at_neighbour_speed")
        at_run = "" if not run_speeds else (
            f"{format(run_speed['ratio'], '.2f') if run_speed and run_speed['ratio'] is not None else 'n/a':>14}"
            f"{format(near['ratio'], '.2f') if near and near['ratio'] is not None else 'n/a':>15}")
        h = c.get("at_harness_compute")
        at_harness = "" if not harness else f"{format(h['ratio'], '.2f') if h and h['ratio'] is not None else 'n/a':>15}"
        measured = f"{m['mean'] * ms:.2f} [{m['low'] * ms:.2f}, {m['high'] * ms:.2f}] ({each})"
        lines.append(f"{c['layout']:<9}{c['ram_fraction']:>6g}{c['prefetch']:>9}{c['predicted_stall_per_token_s'] * ms:>13.2f}"
                     f"  {measured:>44}{ratio:>11}  {c['agreement'].upper() if c['agreement'] == 'disagrees' else c['agreement']:<10}"
                     f"{at_probe}{at_run}{at_harness}")
    family = v["cells"][0]["measured_stall_per_token_s"].get("family") if v["cells"] else None
    lines.append("S in ms per committed token; a cell agrees within +/-"
                 f"{v['config']['tolerance']:.0%}, disagrees when its prediction lies outside the measured "
                 + (f"{family['level']:.2%} interval (each of the run's {family['judgements']} judgements at the coverage "
                    "that makes them hold together 95% of the time)" if family else "interval")
                 + " widened by that much, else is unresolved (the repetitions scatter too widely to tell)")
    if v["comparisons"]:
        lines += ["", ("saving vs stock, ms/token (95% intervals: predicted over held-out steps, measured over repetitions; "
                       f"gate: low end >= {v['config']['gate_threshold']:.0%} of TPOT, predicted/measured)")]
        for x in v["comparisons"]:
            g = x["gate"]
            lines.append(f"  {x['layout']:<8} RAM {x['ram_fraction']:g}, prefetch {x['prefetch']:<8} {_predicted_measured(x)}  "
                         f"{_agreement(x)}, gate "
                         f"{'pass' if g['predicted']['passes'] else 'fail'}/{'pass' if g['measured']['passes'] else 'fail'}"
                         f"{'' if g['same_decision'] else ' DIFFERS'}")
            lines.append(f"    {x['words']}")
            lines += _diagnoses(x)
    if v.get("prefetch_comparisons"):
        lines += ["", "prefetch saving vs no prefetch, same layout and RAM, ms/token (95% intervals as above; agrees "
                      f"inside the measured interval or within +/-{v['prefetch_comparisons'][0]['tolerance']:.0%} of it)"]
        for x in v["prefetch_comparisons"]:
            lines.append(f"  {x['prefetch']:<8} {x['layout']:<8} RAM {x['ram_fraction']:g}  {_predicted_measured(x)}")
            lines.append(f"    {'within' if x['within_tolerance'] else 'not within'} +/-{x['tolerance']:.0%}, "
                         f"{_agreement(x)}; {x['words']}")
            lines += _diagnoses(x)
    lines += ["", v["summary"]["text"]]
    return "\n".join(lines)


VALIDATION_ADVICE = {
    "holds": "the gate's predictions on this profile can be taken as this disk's, within the band above; plan and "
             "replay with it",
    "does not hold": "do not rest a rewrite on the gate's ms/token for this disk: calibrate it again (relayout "
                     "calibrate), and measure a rewrite before trusting it (relayout measure)",
    "insufficient": "too few repetitions to judge: run it again with more (--reps) or longer ones (--minutes); it "
                    "resumes in the same directory",
    "inconclusive": "the measurements could not tell: more repetitions (--reps) or longer ones (--minutes) would",
}
"""What each verdict of ``relayout validate`` means for the user, in words."""


def validation_bottom_line(record: dict, output: str) -> str:
    """``validate``'s answer in words: the verdict, what to do about it, where the record is."""
    verdict = record["summary"]["verdict"]
    return f"Bottom line: the model {verdict} on this disk; {VALIDATION_ADVICE[verdict]}. Record: {output}."
