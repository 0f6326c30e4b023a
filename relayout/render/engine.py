"""The text of ``relayout report`` and ``relayout compare`` of colibrì runs: the engine's own measurements."""

from __future__ import annotations


def _ms(x) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def format_engine_report(r: dict) -> str:
    """One block per arm: S with its interval, TPOT and the other per-token terms, hits, loads, configuration."""
    lines = [f"measured by the colibrì engine: {r['source']}; ms per committed token unless named"]
    for a in r["arms"]:
        iv = a["stall_per_committed_token_ms_interval"]
        hit = "n/a" if a["hit_rate"] is None else f"{a['hit_rate']:.3f}"
        load = "n/a" if a["load_average"] is None else f"{a['load_average']:.2f}"
        name = a["path"] if a["arm"] == a["path"] else f"{a['arm']} ({a['path']})"
        spread = (f"[95% CI over runs {iv['low']:.3f}, {iv['high']:.3f}]" if iv["n_units"] >= 2
                  else "[interval: insufficient, one run]")
        lines += [
            f"{name}: {a['runs']} runs, {a['committed_tokens']} committed tokens, mean 1-min load {load}",
            f"  S (expert wait per committed token) {a['stall_per_committed_token_ms']:.3f} ms {spread}",
            f"  TPOT {_ms(a['tpot_ms'])} | read service {_ms(a['service_ms_per_token'])} (loader threads, overlaps compute) | "
            f"expert matmul {_ms(a['matmul_ms_per_token'])} | attention {_ms(a['attention_ms_per_token'])} | "
            f"other {_ms(a['other_ms_per_token'])}",
            f"  expert cache hit rate {hit} (pins + LRU over requests, mean over runs) | expert loads per committed token "
            f"{_ms(a['loads_per_token'])} | decode forward latency p50 {_ms(a['forward_latency_p50_ms_mean_over_runs'])} "
            f"p99 {_ms(a['forward_latency_p99_ms_mean_over_runs'])} ms (means over runs)",
        ]
        if a.get("pilot_loads_per_token") is not None or a.get("pilot_precision") is not None:
            lines.append(f"  router pilot: {_ms(a.get('pilot_loads_per_token'))} loads and "
                         f"{_ms(a.get('pilot_drops_per_token'))} dropped predictions per committed token (its PILOT_REAL "
                         f"line, whole runs)"
                         + (f" | its prediction held {a['pilot_precision']:.1%} of the next layers' routed experts "
                            f"(LOOKA=1; --pilot-precision for the gate)" if a.get("pilot_precision") is not None else ""))
        if a.get("drive_read_bytes_per_token") is not None:
            lines.append(f"  read from storage {a['drive_read_bytes_per_token'] / 1e6:.2f} MB per committed token (the "
                         "engine process's block input, whole runs: prefill and dense weights too, page-cache hits not)"
                         + (f" | its memory control group left it {a['memory_room_bytes'] / 1e9:.3g} GB"
                            if a.get("memory_room_bytes") is not None else ""))
        lines += [f"  configuration: {c}" for c in a["configurations"]]
        lines += [f"  FAILED RUN (engine exit status non-zero): {f}" for f in a["failed_runs"]]
    return "\n".join(lines)


def format_engine_compare(c: dict) -> str:
    """Control against each treatment: S both sides, the paired saving with its interval, TPOT."""
    lines = [f"CORRECTNESS FAILURE: {f}" for f in c["correctness_failures"]]
    for x in c["comparisons"]:
        s = x["saving_ms_per_token"]
        rel = "n/a" if x["relative_saving"] is None else f"{100 * x['relative_saving']:.1f}%"
        same = x["treatment_arm"] == c["control_arm"]
        t_name, c_name = (x["treatment"], c["control"]) if same else (x["treatment_arm"], c["control_arm"])
        lines.append(
            f"{t_name} vs {c_name} ({x['pairs']} run pairs by prompt and repetition or order, "
            f"{x['pairs_with_output_tokens']} with output tokens compared): S (expert wait per committed token) "
            f"{x['control_stall_per_committed_token_ms']:.3f} -> {x['treatment_stall_per_committed_token_ms']:.3f} ms; "
            f"saved {s['estimate']:.3f} ms ({rel}) "
            + (f"[95% CI over pairs {s['low']:.3f}, {s['high']:.3f}]; " if s["n_units"] >= 2 else "[interval: insufficient, one pair]; ")
            + f"TPOT {_ms(x['control_tpot_ms'])} -> {_ms(x['treatment_tpot_ms'])} ms")
        for side in ("control", "treatment"):
            lines += [f"  {side} configuration: {k}" for k in x[f"{side}_configurations"]]
    lines += [f"warning: {w}" for w in c["warnings"]]
    return "\n".join(lines)


def format_engine_validation(rec) -> str:
    """``validate --engine``'s table (an :class:`relayout.workflows.validation.engine_record.EngineValidationRecord`):
    per cell and layout the engine's S with its interval against the model's, then each layout's
    saving against stock and the two decisions, then the verdict in words. Milliseconds per
    committed token."""
    ms = 1e3
    lines = [f"the model against the colibrì engine ({rec.engine}) on {rec.container}: {rec.prompts} held-out prompts x "
             f"{rec.reps} repetitions per layout and cell, cold, NGEN={rec.ngen}; device {rec.device} ({rec.device_source})",
             f"plans trained on {len(rec.training_sessions)} recorded session(s) of other prompts",
             "S = the engine's expert wait per committed token (its PROFILE line, decode window); predicted = the model "
             "replaying each run's own routing with the configuration it printed; ms per committed token; at probe = "
             "its ratio with the profile's drive rates at the speed the disk probed around the cell"]
    probes = [f"{c.name} {c.disk_probe[0] / 1e9:.2f} -> {c.disk_probe[1] / 1e9:.2f} ({c.disk_scale:.2f}x)"
              for c in rec.cells if c.disk_probe]
    if probes:
        lines.append("the disk probed before and after each cell (one expert-sized O_DIRECT read at a time, GB/s; "
                     "x the profile's rate for the same reads): " + ", ".join(probes))
    rates = [f"{c.name} {c.copy_rate / 1e9:.2f}" + ("" if c.copy_rate_source == "its stock runs" else
                                                    f" ({c.copy_rate_source}: no rate of its own)")
             for c in rec.cells if c.copy_rate > 0]
    if rates:
        lines.append("page-cache copies as the engine measured them per thread in each cell's stock runs (median of a "
                     "decode load's bytes over its thread time, else of the DISK-CLASS warm reads; a run whose page "
                     "cache could not hold the experts: its warm reads, when at least 4x as fast as its cold ones; "
                     "GB/s; a cell "
                     "whose runs give no rate of their own, as URING=1 and DIRECT=1 time no page-cache load and "
                     "several pilot threads time their waits for each other, takes the median of the cells that copy "
                     "alike; the device's calibrated rates where no cell measured one): " + ", ".join(rates))
    pilots = [f"{c.name} {c.pilot_loads[0] if c.pilot_loads[0] >= 0 else '-'}/{c.pilot_loads[1]}"
              for c in rec.cells if c.pilot_precision > 0]
    if pilots:
        lines.append(f"the router pilot (PILOT=1 or PILOT_REAL=1), its predictions drawn at the precision the training runs printed "
                     f"(LOOKA=1: {max(c.pilot_precision for c in rec.cells):.1%} of the next layers' routed experts); "
                     f"its loads, engine (whole runs; - for hints, which it does not count) / model (decode): " + ", ".join(pilots))
    drives = [f"{c.name} {c.drive_bytes[0] / 1e6:.0f}/{c.drive_bytes[1] / 1e6:.0f}"
              for c in rec.cells if c.drive_bytes and c.drive_bytes[0] >= 0]
    if drives:
        lines.append("bytes read from the drives per run, MB, engine (its process's block input: the dense weights "
                     "too) / model (experts): " + ", ".join(drives))
    lines.append("")
    head = (f"{'cell':26} {'layout':9} {'engine S [95% CI over runs]':>30} {'model S':>8} {'ratio':>6}  judged     "
            f"{'at probe':>8}  loads")
    lines.append(head)
    for c in rec.cells:
        for a in c.arms:
            m = a.measured_s
            lines.append(f"{c.name:26} {a.arm:9} {m.estimate * ms:9.3f} [{m.low * ms:8.3f}, {m.high * ms:8.3f}] "
                         f"{a.predicted_s * ms:8.3f} {a.ratio:6.2f}  {a.agreement:10} {a.ratio_probed:8.2f}  "
                         f"{'equal' if a.loads_agree else 'differ (drawn pilot)' if c.pilot_precision else 'DIFFER'}")
    lines += ["", f"{'cell':26} {'layout':9} {'measured saving [95% CI]':>28} {'predicted':>10}  {'judged':17} "
                  "gate / measured A/B decision"]
    for c in rec.cells:
        p = c.placement
        lines.append(f"{c.name:26} {'placement':9} {p.estimate * ms:+8.3f} [{p.low * ms:+8.3f}, {p.high * ms:+8.3f}] "
                     f"{c.placement_predicted_s * ms:+10.3f}  (stock less its rewrite; beyond the prediction, "
                     f"placement moves S up to {c.placement_bound_s * ms:.3f})")
        for s in c.savings:
            m = s.measured
            both = f"{s.gate_decision} / {s.measured_decision}" + ("" if s.decisions_agree else "  (DIFFER)")
            lines.append(f"{c.name:26} {s.layout:9} {m.estimate * ms:+8.3f} [{m.low * ms:+8.3f}, {m.high * ms:+8.3f}] "
                         f"{s.predicted.estimate * ms:+10.3f}  {s.agreement:17} {both}")
    lines += ["", f"verdict: the model {rec.verdict} against the engine (+/-{rec.tolerance:.0%} on S). {rec.summary}"]
    return "\n".join(lines)


def engine_validation_bottom_line(rec, record_path: str) -> str:
    """``validate --engine``'s answer in words (an :class:`relayout.workflows.validation.engine_record.EngineValidationRecord`):
    the verdict, the read paths whose predictions can be taken as the engine's and those that
    cannot, and where the record is."""
    def read_path(cell) -> str:
        return " ".join(w for w in cell.env.split() if not w.startswith(("CAP=", "CAP_RAISE=", "AUTOPIN=")))

    paths: dict[str, set] = {}
    for c in rec.cells:
        paths.setdefault(read_path(c), set()).update(a.agreement for a in c.arms)
    held = [p for p, a in paths.items() if a == {"agrees"}]
    failed = [p for p, a in paths.items() if "disagrees" in a]
    open_ = [p for p in paths if p not in held and p not in failed]
    parts = [f"Bottom line: the model {rec.verdict} against colibrì on this machine ({rec.cells_agree} of "
             f"{sum(len(c.arms) for c in rec.cells)} layout-cells within +/-{rec.tolerance:.0%})."]
    if held:
        parts.append(f"Its predictions can be taken as the engine's for {', '.join(held)}.")
    if open_:
        parts.append(f"For {', '.join(open_)} the measurement could not tell: more repetitions would.")
    if failed:
        parts.append(f"Do not take them as the engine's for {', '.join(failed)}: there the gate's ms/token are the "
                     "model's, not the engine's, and a rewrite's worth is for relayout measure --engine to show.")
    parts.append(f"The gate's decision equals the measured A/B's in {rec.decisions_agree} of {rec.decisions}. "
                 f"Record: {record_path}.")
    return " ".join(parts)
