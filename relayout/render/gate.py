"""The gate's answer in words: the gate record as a table and a reason, the sweep's table, the
held-out sessions a verdict will rest on, and the bottom line with the next command.

Each function takes a record the replay returned (:class:`replay.formats.gatefile.GateRecord`, sweep
rows, :class:`replay.evaluation.evidence.HeldOut`) and returns text; nothing here computes a figure.
"""

from __future__ import annotations

from replay.colibri.describe import describe as describe_read_path

from relayout.render.units import human_bytes


def format_gate(g) -> str:
    """A :class:`replay.formats.gatefile.GateRecord` as the verdict, the reason and a side-by-side table."""
    ms = 1e3
    b, p = g.baseline_metrics, g.plan_metrics
    rt = g.runtime
    lines = [
        f"verdict: {g.verdict.upper()}",
        g.reason,
        "",
        f"{'':28}{'baseline':>12}{'plan':>12}",
        f"{'stall S (ms/token)':28}{b.stall_per_token_s * ms:12.3f}{p.stall_per_token_s * ms:12.3f}",
        f"{'TPOT estimate (ms)':28}{b.tpot_s * ms:12.2f}{p.tpot_s * ms:12.2f}",
        f"{'oracle bound (ms/token)':28}{b.oracle_stall_per_token_s * ms:12.3f}{p.oracle_stall_per_token_s * ms:12.3f}",
        f"{'preads/token (drive+cache)':28}{b.reads_per_token:12.1f}{p.reads_per_token:12.1f}",
        f"{'drive requests/token':28}{sum(b.drive_requests_per_token):12.1f}{sum(p.drive_requests_per_token):12.1f}",
        f"{'pread MB/token (drive+cache)':28}{b.read_bytes_per_token / 1e6:12.2f}{p.read_bytes_per_token / 1e6:12.2f}",
        f"{'union MB/committed token':28}{b.union_bytes_per_token / 1e6:12.2f}{p.union_bytes_per_token / 1e6:12.2f}",
        f"{'RAM hit rate':28}{b.ram_hit_rate:12.3f}{p.ram_hit_rate:12.3f}",
        f"{'step stall p50/p99 (ms)':28}{b.step_stall_s.p50 * ms:6.2f}/{b.step_stall_s.p99 * ms:<5.2f}"
        f"{p.step_stall_s.p50 * ms:6.2f}/{p.step_stall_s.p99 * ms:.2f}",
        f"{'drive utilisation':28}{max(b.drive_utilisation):12.2f}{max(p.drive_utilisation):12.2f}",
        "",
        *_decomposition_lines(g.decomposition),
        _evidence_line(g.evidence),
        f"threshold {g.threshold.fraction_of_tpot:.0%} of TPOT {g.threshold.tpot_s * ms:.2f} ms ({g.threshold.tpot_source})",
        f"held-out sessions: {len(g.trace.sessions_evaluated)} evaluated, {len(g.trace.sessions_excluded_as_training)} excluded "
        f"as training (matched by {g.trace.held_out_by}); device {g.device.name}; RAM {rt.ram_bytes / 1e9:g} GB, workers "
        f"{rt.workers}{' (batched)' if rt.batched else ''}, coalesce {'on' if rt.coalesce else 'off'}",
        f"read path: {describe_read_path(rt)}",
        _prefetch_line(rt, b.prefetch, p.prefetch),
    ]
    if g.pins is not None:
        lines.append(f"pins: {g.pins.experts} experts, {human_bytes(g.pins.bytes)}: {g.pins.how}")
    return "\n".join(lines)


def _decomposition_lines(d) -> list[str]:
    if d is None:
        return []
    ms = 1e3
    return [f"saving from repacking (source order, new packing): {d.repacking.estimate * ms:.3f} ms/token "
            f"[{d.repacking.low * ms:.3f}, {d.repacking.high * ms:.3f}]; from ordering: "
            f"{d.ordering.estimate * ms:.3f} [{d.ordering.low * ms:.3f}, {d.ordering.high * ms:.3f}]"]


def _evidence_line(ev) -> str:
    how = ("paired bootstrap over sessions" if ev.method == "session" else
           f"moving-block bootstrap over steps, blocks of {ev.block_steps}")
    return (f"evidence: {how}, {ev.resamples} resamples, seed {ev.seed}; {ev.sufficiency}"
            + ("" if ev.sufficient else " -> no verdict"))


def _prefetch_line(runtime, b, p) -> str:
    if b is None:
        return "prefetch: none (demand reads only), so timely recall, unused prefetched bytes and lead slack do not apply"

    def one(m):
        recall = "n/a" if m.timely_required_byte_recall is None else f"{m.timely_required_byte_recall:.1%}"
        slack = "n/a" if m.mean_lead_slack_s is None else f"{m.mean_lead_slack_s * 1e3:.2f} ms"
        return (f"timely recall {recall}, {m.prefetched_bytes_per_token / 1e6:.1f} MB/token prefetched, "
                f"{m.unused_prefetched_bytes_per_token / 1e6:.1f} MB/token unused, lead slack {slack}")

    return (f"prefetch: {runtime.prefetch} source, K={runtime.prefetch_experts} per layer\n"
            f"  baseline: {one(b)}\n  plan:     {one(p)}")


def format_sweep(cells: list) -> str:
    """The sweep's table (``cells`` :class:`replay.formats.sweepfile.SweepCell`), stall in ms per committed token."""
    ms = 1e3
    head = (f"{'RAM GB':>7} {'workers':>7} {'coalesce':>8} {'stock S':>9} {'plan S':>9} {'oracle':>9} {'saved (95% CI) ms/token':>28} "
            f"{'% TPOT':>7}  verdict (after Holm)")
    lines = [head, "-" * len(head)]
    for c in cells:
        s = c.saving
        lines.append(f"{c.ram_gb:>7g} {c.workers:>7} {'on' if c.coalesce else 'off':>8} "
                     f"{c.baseline_stall_s * ms:9.3f} {c.plan_stall_s * ms:9.3f} {c.oracle_stall_s * ms:9.3f} "
                     f"{s.estimate * ms:9.3f} [{s.low * ms:7.3f},{s.high * ms:7.3f}] "
                     f"{c.saving_fraction_of_tpot.estimate:7.1%}  {_sweep_verdict(c)}")
    lines.append("S in ms per committed token; a pass must also hold after Holm's correction over the sufficient cells "
                 "(family-wise 2.5% one-sided), else it reads 'pass, not after Holm'")
    return "\n".join(lines)

def _sweep_verdict(cell) -> str:
    if cell.verdict != "pass" or cell.holm_significant is None:
        return cell.verdict
    return "pass" if cell.holm_significant else "pass, not after Holm"


def held_out_notice(held, min_sessions: int) -> str:
    """One sentence, before a replay's work, on the held-out sessions its verdict will rest on
    (``held`` a :class:`replay.evaluation.evidence.HeldOut`) and how many more a verdict needs."""
    n = len(held.evaluated)
    text = (f"the verdict will rest on {n} held-out session{'s' if n != 1 else ''} "
            f"({len(held.training)} excluded as the plan's training, matched by {held.matched_by})")
    if n >= min_sessions:
        return text
    return (text + f"; a verdict needs {min_sessions} (--min-sessions), so it will be INSUFFICIENT: record "
                   f"{min_sessions - n} more session{'s' if min_sessions - n != 1 else ''} the plan has not seen "
                   "(one ROUTE_TRACE file each), import them into the trace and replay again")


def bottom_line(g, plan_path: str, gate_path: str | None, container: str | None, out: str | None,
                forced: bool = False) -> str:
    """The replay's answer in words: the saving in ms/token and % of TPOT with its 95% interval,
    the verdict, and the next command to run (``g`` a :class:`replay.formats.gatefile.GateRecord`)."""
    ms = 1e3
    s, f, t = g.saving_per_token_s, g.saving_fraction_of_tpot, g.threshold
    saving = (f"the new layout saves {s.estimate * ms:.2f} ms/token (95% interval {s.low * ms:.2f} to "
              f"{s.high * ms:.2f}), {f.estimate:.1%} of a {t.tpot_s * ms:.1f} ms time per token "
              f"(interval {f.low:.1%} to {f.high:.1%}); the gate needs {t.fraction_of_tpot:.0%} at the interval's low end")
    gate_arg = gate_path or "gate.json"
    if g.verdict == "pass":
        if container and out:
            nxt = (f"the rewrite of {container} goes to {out}; run colibrì with SNAP={out} and the same settings, "
                   "and measure both (relayout measure --engine)")
        else:
            nxt = (f"next: relayout rewrite SRC --layout {plan_path} --gate {gate_arg} --out DST --verify, "
                   "then run colibrì with SNAP=DST and the same settings and measure both")
        return f"Bottom line: PASS: {saving}. {nxt[0].upper() + nxt[1:]}."
    if g.verdict == "insufficient":
        return (f"Bottom line: NO VERDICT (insufficient evidence): {saving}, but on "
                f"{s.n_units} {s.unit.split(' ')[0]}(s), fewer than a verdict needs. Record more sessions the plan "
                "has not seen, import them and replay again" + ("; rewriting anyway (--force)." if forced and out else "."))
    h = g.headroom
    if h.max_saving_fraction_of_tpot < t.fraction_of_tpot:
        why = (f"there is no headroom: even the oracle (every byte at full bandwidth) saves only "
               f"{h.max_saving_s * ms:.2f} ms/token, {h.max_saving_fraction_of_tpot:.1%} of time per token, on this "
               "storage and RAM")
    else:
        why = (f"the oracle leaves {h.max_saving_s * ms:.2f} ms/token ({h.max_saving_fraction_of_tpot:.1%}) of headroom "
               "that this layout does not capture")
    keep = "Rewriting anyway (--force)" if forced and out else "Keep the container as it is"
    return (f"Bottom line: FAIL: {saving}; {why}. {keep}; `relayout replay ... --sweep` shows at which RAM "
            "budgets and read settings a layout would matter.")
