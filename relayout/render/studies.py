"""The text of the policy studies: placement arms, split curves, prediction sources' reliability, hypotheses."""

from __future__ import annotations

from .units import human_bytes


def format_placement(study) -> str:
    """``relayout placement``: each arm's RAM split, S on training and held-out sessions (ms per
    committed token, 95% interval), the RAM hit rate beside it and the saving against frequency pins."""
    ms = 1e3
    lines = [f"placement arms at {human_bytes(study.ram_bytes)} of RAM on {study.device}: pins + LRU = RAM in every arm; "
             f"{study.training_sessions} training / {study.held_out_sessions} held-out sessions ({study.sufficiency})",
             "",
             f"{'arm':<21}{'pins':>10}{'LRU':>10}{'train S':>9}{'held-out S (95% CI)':>26}{'RAM hits':>9}"
             f"{'saved vs frequency (95% CI)':>31}"]
    for a in study.arms:
        s, v = a.stall_per_token_s, a.saving_vs_frequency_s
        saved = "" if v is None else f"{v.estimate * ms:+8.3f} [{v.low * ms:+7.3f},{v.high * ms:+7.3f}]"
        lines.append(f"{a.pins.arm:<21}{human_bytes(a.pins.pin_bytes):>10}{human_bytes(a.pins.lru_bytes):>10}"
                     f"{a.train_stall_per_token_s * ms:9.3f}{s.estimate * ms:10.3f} [{s.low * ms:6.3f},{s.high * ms:6.3f}]"
                     f"{a.ram_hit_rate:9.1%}{saved:>31}")
    lines.append("")
    lines += [f"  {a.pins.arm}: {a.pins.how}" for a in study.arms]
    lines.append("S = modelled stall per committed token, ms; RAM hits = batch-union lookups served by a pin or the LRU "
                 "(held-out); the stall-value arm is the best of its replayed candidates on the training sessions, so its "
                 f"training S is never above the LRU-only or frequency arm's ({study.stall_value_replays} candidate replays)")
    if not study.sufficient:
        lines.append("INSUFFICIENT evidence for a comparison: " + study.sufficiency)
    return "\n".join(lines)


def format_split_curve(curve) -> str:
    """``relayout split-curve``: S against RAM for whole experts and for the best split found at each
    budget (ms per committed token on held-out sessions, 95% interval), the hit rate beside S."""
    ms = 1e3
    lines = [f"S versus RAM on {curve.device}: whole experts (LRU only) and split experts (ratio and top budget "
             f"searched by replayed stall on {curve.training_sessions} training sessions; {curve.candidate_replays} "
             f"replays); held out: {curve.held_out_sessions} sessions ({curve.sufficiency})", "",
             f"{'RAM':>10} | {'whole experts S (95% CI)':>26}{'hits':>7} | {'split S (95% CI)':>26}{'hits':>7}"
             f"{'ratio':>7}{'tops':>11}{'LRU':>11}"]
    for w, s in zip(curve.whole, curve.split):
        a, b = w.stall_per_token_s, s.stall_per_token_s
        lines.append(f"{human_bytes(w.ram_bytes):>10} | {a.estimate * ms:9.3f} [{a.low * ms:6.3f},{a.high * ms:6.3f}]  "
                     f"{w.ram_hit_rate:6.1%} | {b.estimate * ms:9.3f} [{b.low * ms:6.3f},{b.high * ms:6.3f}]  {s.ram_hit_rate:6.1%}"
                     f"{s.ratio:7.3f}{human_bytes(s.top_bytes):>11}{human_bytes(s.lru_bytes):>11}")
    lines.append("S = modelled stall per committed token, ms; hits = batch-union lookups served whole from RAM (a resident "
                 "top is not a hit: its bottom is still read); ratio 0 = no split was better on the training sessions")
    for s in curve.split:
        if s.ratio > 0:
            lines.append(f"  to write the {human_bytes(s.ram_bytes)} point: relayout plan ... --split-ratio {s.ratio:g} "
                         f"--split-ram-gb {s.top_bytes / 1e9:.6g} --split-rule replay --cache-gb {s.lru_bytes / 1e9:.6g} "
                         f"--split-device {curve.device} (then rewrite, and relayout measure --layout that plan)")
    if not curve.sufficient:
        lines.append("INSUFFICIENT evidence for a comparison: " + curve.sufficiency)
    return "\n".join(lines)


def format_reliability(scores) -> str:
    """Prediction sources on held-out sessions (:class:`replay.control.sources.Reliability`): each
    one's candidates, base rate, Brier score and expected calibration error, beside the Brier score
    of a constant forecast at the base rate (a source below it has skill)."""
    lines = [f"  {'source':<28}{'candidates':>12}{'base rate':>11}{'Brier':>10}{'ECE':>9}{'Brier at base rate':>20}"]
    for r in scores:
        if r.brier is None:
            lines.append(f"  {r.source:<28}{0:>12}  nothing scored (no held-out candidate)")
            continue
        lines.append(f"  {r.source:<28}{r.candidates:>12,}{r.base_rate:>11.4f}{r.brier:>10.5f}{r.ece:>9.5f}"
                     f"{r.base_rate * (1 - r.base_rate):>20.5f}")
    bins = len(scores[0].bin_count) if scores else 0
    lines.append("  candidates: every expert of every predicted layer of the held-out forwards; ECE over "
                 f"{bins} equal-width probability bins")
    return "\n".join(lines)


def format_hypotheses(tables) -> str:
    """``replay --policy`` and ``report --hypothesis``: one table per hypothesis and regime
    (:class:`replay.evaluation.hypotheses.HypothesisTable`): each arm's S with its 95% interval and the
    figures each claim needs beside it (ms per committed token; speculative and unused MB per committed token;
    eta_stall in ms of stall removed per MB speculated), the comparisons, the verdict in words."""
    def opt(x, fmt, scale=1.0):
        return "n/a" if x is None else format(x * scale, fmt)

    from replay.evaluation.hypotheses import HYPOTHESES

    out = []
    for t in tables:
        h = t.hypothesis
        judged = "" if h.test_arm == HYPOTHESES[h.key].test_arm else f", arm judged: {h.test_arm}"
        out += [f"{h.key} at {t.regime}{judged}: {t.verdict.upper()} ({t.sufficiency})", f"  claim: {h.claim}",
                f"  {'arm':<22}{'S ms/token (95% CI)':>28}{'p50':>8}{'p99':>8}{'spec MB':>9}{'eta ms/MB':>10}"
                f"{'RAM hits':>9}{'timely':>8}{'unused MB':>10}{'QD':>6}"]
        for r in t.rows:
            s = r.stall_per_token_s
            ci = f"{s.estimate * 1e3:.3f} [{s.low * 1e3:.3f}, {s.high * 1e3:.3f}]"
            out.append(f"  {r.arm:<22}{ci:>28}{r.p50_step_stall_s * 1e3:>8.3f}{r.p99_step_stall_s * 1e3:>8.3f}"
                       f"{r.speculative_bytes_per_token / 1e6:>9.2f}{opt(r.eta_stall_s_per_byte, '.4f', 1e9):>10}"
                       f"{opt(r.ram_hit_rate, '.1%'):>9}{opt(r.timely_required_byte_recall, '.1%'):>8}"
                       f"{opt(r.unused_bytes_per_token, '.2f', 1e-6):>10}{opt(r.queue_depth, '.2f'):>6}")
        out += [f"  - {c.words}" for c in t.comparisons]
        out += [f"  note: {n}" for n in t.notes]
        out += [f"  {t.reason}", ""]
    return "\n".join(out).rstrip()
