"""Text rendering of results for the terminal: one place for every table and summary line.

Each function takes the JSON-ready record a library function returned (a container report,
trace statistics, a calibration profile, a STALL_TRACE report or comparison, a validation) and
returns lines to print; nothing here computes a figure. The gate's answer is in
:mod:`relayout.render.gate`.
"""

from __future__ import annotations

import numpy as np


def human_bytes(n: float) -> str:
    """``1234567`` -> ``'1.23 MB'`` (decimal units, as drive vendors use)."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")

def format_inspect(r: dict) -> str:
    lines = [
        f"container      {r['root']}",
        f"files          {r['files']} safetensors + {len(r['other_files'])} other ({', '.join(r['other_files'])})",
        f"tensors        {r['tensors']}",
        f"total size     {human_bytes(r['total_bytes'])}",
        f"MoE layers     {_ranges(r['moe_layers'])}" + (f"   MTP layers {_ranges(r['mtp_layers'])}" if r["mtp_layers"] else ""),
        f"experts/layer  {_per_layer(r['experts_per_layer'])}",
        f"routed         {r['routed_experts']} experts, {human_bytes(r['routed_bytes'])}",
    ]
    for fmt, sizes in r["bytes_per_expert"].items():
        for size, n in sizes.items():
            lines.append(f"  {fmt:<12} {n} experts x {int(size):,} B")
    lines.append(f"fast path      {r['fast_path_experts']} experts in one read, {r['off_fast_path_experts']} need more than one")
    if r["off_fast_path_examples"]:
        lines.append(f"  off the fast path: {', '.join(r['off_fast_path_examples'])}" + (" ..." if r["off_fast_path_experts"] > 20 else ""))
    if r.get("needs_split_runtime"):
        lines.append(f"runtime        NEEDS A SPLIT-AWARE RUNTIME: {r['split_experts']} experts are stored as split segments "
                     "(docs/SPLIT_SEGMENTS.md); stock colibrì cannot load this container")
    if r.get("format_stamps"):
        lines.append(f"format stamps  {r['format_stamps']} tensors (colibri.fmt)")
    lines.append(f"problems       {len(r['problems']) or 'none'}")
    lines += [f"  - {p}" for p in r["problems"]]
    return "\n".join(lines)

def _ranges(xs: list[int]) -> str:
    if not xs:
        return "none"
    out, start, prev = [], xs[0], xs[0]
    for x in xs[1:] + [None]:
        if x is not None and x == prev + 1:
            prev = x
            continue
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
        if x is not None:
            start = prev = x
    return ", ".join(out)

def _per_layer(d: dict) -> str:
    counts = sorted(set(d.values()))
    return str(counts[0]) if len(counts) == 1 else ", ".join(f"L{k}:{v}" for k, v in d.items())

def _cell(x) -> str:
    return "n/a" if x is None else str(x)


def format_stats(s: dict) -> str:
    lines = [
        f"trace      {s['source']}  (geometry {s['geometry']})",
        f"sessions   {s['sessions']}, forwards {s['forwards']} ("
        + ", ".join(f"{n} {kind}" for kind, n in s["forwards_by_kind"].items()) + f"), committed tokens {s['committed_tokens']}",
        f"selections {s['selections']:,} in {s['rows']:,} rows, {s['n_experts']} experts, top-{s['top_k']}",
    ]
    if "decode_forwards" in s and not s["heat_only"]:
        known = s.get("committed_from_runtime_output", 0)
        lines.append(f"engine     {s['decode_forwards']} decode forwards (colibrì's count: the prefill excluded) per "
                     f"{s['committed_tokens']} tokens; tokens " + (f"from runtime output in {known} of {s['sessions']} sessions"
                                                                    if known else "from the trace alone (no runtime output)")
                     + (f"; MTP head at layer {', '.join(map(str, s['mtp_layers']))}" if s.get("mtp_layers") else ""))
    assumed = s.get("committed_assumed")
    if assumed:
        lines.append(f"assumed    {assumed['tokens']} of {s['committed_tokens']} committed tokens ({assumed['forwards']} forwards): "
                     f"{assumed['reason']}")
    if s["heat_only"]:
        lines.append("heat only (.coli_usage): no co-activation, cross-layer or reuse statistics can be computed")
    if "summary" in s:
        m = s["summary"]
        lines += [
            f"heat entropy (median over layers) {m['heat_entropy_bits_median']} bits of {m['max_entropy_bits']} max",
            f"within-layer lift (pairs >= 5 co-selections): median {m['lift_median']}, p90 {m['lift_p90']}, p99 {m['lift_p99']}",
            f"cross-layer lift L->L+1: median {m['cross_layer_lift_median']}, p99 {m['cross_layer_lift_p99']}",
            f"reuse distance (forwards): median {m['reuse_distance_median']}",
        ]
    lines.append("")
    lines.append("layer  rows  sessions  entropy  lift-med  lift-p90  lift-p99  xlift-med  reuse-med")
    for l in s["layers"]:
        if s["heat_only"]:
            lines.append(f"{l['layer']:>5}  selections {l['selections']}  entropy {l['heat_entropy_bits']}")
            continue
        x = l.get("cross_layer_lift", {}).get("median")
        lines.append(f"{l['layer']:>5} {l['rows']:>5} {l['sessions']:>9} {l['heat_entropy_bits']:>8} "
                     f"{_cell(l['lift']['median']):>9} {_cell(l['lift']['p90']):>9} {_cell(l['lift']['p99']):>9} "
                     f"{_cell(x):>10} {_cell(l['reuse_distance']['median']):>10}")
    lines.append("n/a: not defined for that layer (no pair with enough co-selections, no next layer, or no reuse)")
    return "\n".join(lines)

def small_page_warning(profile: dict) -> str | None:
    """The sentence saying that buffers of scattered pages reach the calibrated device in smaller
    requests than the profile assumes (:func:`replay.physical.calibrate.small_page_request_limit`), or None
    when they do not, or the system does not say."""
    d, small = profile["drive"], profile.get("calibration", {}).get("small_page_request_limit")
    if not small or not d.get("max_request_bytes") or small["bytes"] >= d["max_request_bytes"]:
        return None
    return (f"read into buffers of scattered {small['page_bytes'] // 1024} KiB pages, a request here is at most "
            f"{small['bytes'] // 1024} KiB ({small['max_segments']} segments), not {d['max_request_bytes'] // 1024} KiB: "
            "this calibration read into huge pages, a runtime that does not ask for them (colibri's buffers: "
            "posix_memalign, no MADV_HUGEPAGE) gets them only with transparent_hugepage=always (here: "
            f"{small['transparent_hugepage'] or 'unknown'}), and may then read slower, and unevenly from run to run, "
            "than this profile predicts")


MERGE_AGREES = 0.25
"""A measured merge saving within this fraction of the predicted one agrees with the profile."""


def merge_sentence(profile: dict) -> tuple[str, float | None] | None:
    """What merging two reads saved in the calibration (:func:`replay.physical.calibrate.merge_saving`)
    against what the profile predicts, in words, and predicted / measured (None when the measured
    saving's median is not above zero); None when not measured. The prediction agrees when it lies
    inside the measured 95% interval or within :data:`MERGE_AGREES` of its median. This checks
    pairs of reads in isolation; a layout's coalescing saving, in the runtime's sequence of
    reads, can differ from it (docs/BENCHMARKS.md, "Request channel time")."""
    m = profile.get("calibration", {}).get("merge")
    if not m:
        return None
    us = 1e6
    saved, low, high, predicted = (m["saving_seconds"], m["saving_low_seconds"], m["saving_high_seconds"],
                                   m["predicted_saving_seconds"])
    head = (f"merging two back-to-back {m['size'] / 2**20:g} MiB reads into one saved {saved * us:.0f} us "
            f"[{low * us:.0f}, {high * us:.0f}] (median of {m['pairs']} pairs), the profile predicts {predicted * us:.0f} us")
    ratio = predicted / saved if saved > 0 else None
    if high <= 0:
        return head + ": on this disk a merged read was then no cheaper than the two it replaces", ratio
    if low <= predicted <= high or (ratio is not None and abs(ratio - 1) <= MERGE_AGREES):
        return head + f": the model's saving per merged read agrees with it (inside its interval or within " \
                      f"{MERGE_AGREES:.0%})", ratio
    if low <= 0:
        return head + ": merging was not measurably cheaper here (its interval reaches zero)", ratio
    if ratio > 1:
        return (head + f": the model puts the saving per merged read at {ratio:.2f} times what this disk saved "
                "(the fit infers a read's cost mostly from small reads)"), ratio
    return head + f": the model puts the saving per merged read at {ratio:.2f} times what this disk saved", ratio


def completion_sentence(profile: dict) -> tuple[str, bool] | None:
    """How the calibrated device served concurrent reads (:func:`replay.physical.calibrate.completion_spread`)
    in words, with how the profile's drive serves them (its ``service``), and whether the drive
    shares itself among them; None when not measured."""
    c = profile.get("calibration", {}).get("completion_spread")
    if not c:
        return None
    n, mib, r = c["depth"], c["size"] / 2**20, c["first_over_last"]
    modelled = profile.get("drive", {}).get("service", "in-order")
    head = (f"{n} concurrent {mib:g} MiB reads: the first completed after {r:.2f} of the time the last took "
            f"(a drive serving them in arrival order: about {c['in_order']:.2f})")
    if r < (1 + c["in_order"]) / 2:
        if modelled == "in-order":
            return head + ", in order, as the profile's drive serves them", False
        return (head + ", in order, but this profile's drive is shared: it completes a layer's demand reads together, "
                "so it under-predicts how much compute overlaps them (S over-predicted)"), False
    shared = "this drive shares itself among concurrent reads (a later read slows those in flight)"
    if modelled == "shared":
        return head + f"; {shared}, and the profile's drive does the same (service: shared)", True
    return (head + f"; {shared}, which this profile's in-order drive does not do: it lets compute overlap a layer's "
            "later demand reads, which here arrive together with the first (S under-predicted), and misjudges what a "
            "prefetch load costs the reads beside it", True)


def format_calibration(profile: dict) -> str:
    """A calibration: each (size, queue depth) cell measured and as the fitted queue model gives it."""
    d = profile["drive"]
    cal = profile["calibration"]
    lines = [f"{'size':>10}{'QD':>5}{'latency us':>12}{'MB/s':>10}{'IOPS':>10}{'fitted MB/s':>13}{'fit error':>11}"]
    for c in cal["cells"]:
        fitted = c.get("fitted_Bps")
        err = c.get("error")
        lines.append(f"{c['size']:>10}{c['depth']:>5}{c['mean_latency_s'] * 1e6:>12.1f}{c['throughput_Bps'] / 1e6:>10.1f}"
                     f"{c['iops']:>10.0f}{'n/a' if fitted is None else f'{fitted / 1e6:.1f}':>13}"
                     f"{'n/a' if err is None else f'{err:+.0%}':>11}")
    b1 = d.get("stream_bandwidth", d["bandwidth"])
    lines.append(f"fit ({d.get('service', 'in-order')} drive): request cost {d['request_seconds'] * 1e6:.1f} us, one request reads at {b1 / 1e9:.2f} GB/s, the drive at "
                 f"most {d['bandwidth'] / 1e9:.2f} GB/s, queue slots {d['queue_slots']}, each request holds its channel "
                 f"{d.get('request_channel_seconds', 0.0) * 1e6:.1f} us beyond its bytes; "
                 + (f"the system splits reads into requests of at most {d['max_request_bytes'] // 1024} KiB; "
                    if d.get("max_request_bytes") else "reads taken as unsplit (the system does not say its request limit); ")
                 + cal['cache_control'])
    fit = cal.get("fit")
    if fit:
        w = fit["worst_cell"]
        lines.append(f"fit error |log(fitted/measured)|: RMS {fit['rms_log_error']:.2f}, worst {fit['max_abs_log_error']:.2f} "
                     f"({w['size']} B at QD {w['depth']}: {w['error']:+.0%})")
    warning = small_page_warning(profile)
    if warning:
        lines.append(warning)
    spread = completion_sentence(profile)
    if spread:
        lines.append(spread[0])
    merge = merge_sentence(profile)
    if merge:
        lines.append(merge[0])
    return "\n".join(lines)


def format_report(r: dict) -> str:
    """A STALL_TRACE report (``Report.to_json()``): a row per run, S pooled per configuration,
    the supporting figures each run's records support, and every warning."""
    ms = 1e6
    w = max([24] + [len(m["run_id"]) + 2 for m in r["runs"]])
    lines = [f"{'run':<{w}}{'steps':>7}{'tokens':>8}{'S (ms/token)':>14}{'p99 step (ms)':>15}{'recall':>20}{'union MB/tok':>14}"]
    for m in r["runs"]:
        rec = m["timely_required_byte_recall"]
        recall = "n/a (no prefetch)" if not m.get("prefetch") else ("n/a" if rec is None else f"{rec:.3f}")
        lines.append(f"{m['run_id']:<{w}}{m['steps']:>7}{m['committed_tokens']:>8}{m['stall_per_committed_token_ns'] / ms:>14.3f}"
                     f"{m['step_stall_ns']['p99'] / ms:>15.3f}{recall:>20}"
                     f"{m['union_bytes_per_committed_token'] / 1e6:>14.2f}")
    for m in r["runs"]:
        extra = []
        if m.get("tpot_ns") is not None:
            parts = [f"TPOT {m['tpot_ns'] / ms:.3f}"]
            if m.get("compute_per_committed_token_ns") is not None:
                parts.append(f"C_tok {m['compute_per_committed_token_ns'] / ms:.3f}")
            parts.append(f"S {m['stall_per_committed_token_ns'] / ms:.3f}")
            if m.get("other_per_committed_token_ns") is not None:
                parts.append(f"O_tok {m['other_per_committed_token_ns'] / ms:.3f}")
            extra.append(", ".join(parts) + " ms/token")
        if m.get("barrier_stall_per_committed_token_ns") is not None:
            extra.append(f"barrier-join stall {m['barrier_stall_per_committed_token_ns'] / ms:.3f} ms/token")
        if m.get("tiers"):
            extra.append("served by tier: " + ", ".join(f"{t} {v['share']:.1%} ({v['records']} records)" for t, v in m["tiers"].items()))
        for prio, d in (m.get("reads") or {}).items():
            s = (f"{prio} reads: {d['drive_requests']} drive requests ({d['drive_bytes'] / 1e6:.1f} MB, "
                 f"{d['drive_requests_per_committed_token']:.1f}/token), {d['page_cache_requests']} page-cache hits "
                 f"({d['page_cache_bytes'] / 1e6:.1f} MB)")
            if d.get("unclassified_requests"):
                s += f", {d['unclassified_requests']} buffered reads not classified ({d['unclassified_bytes'] / 1e6:.1f} MB)"
            extra.append(s)
        for key, name in (("queue_depth", "queue depth"), ("worker_occupancy", "worker occupancy")):
            q = m.get(key)
            if q:
                extra.append(f"{name} mean {q['mean']:.2f}, p95 {q['p95']:.0f}, max {q['max']:.0f}")
        if m.get("committed_tokens_assumed"):
            extra.append(f"{m['committed_tokens_assumed']} of {m['committed_tokens']} committed tokens assumed (not recorded)")
        if extra:
            lines.append(f"  {m['run_id']}: " + "; ".join(extra))
    for g in r["pooled"]:
        what = g["source"] + (f" [{g['configuration']}]" if g.get("configuration") else "")
        assumed = f" ({g['committed_tokens_assumed']} assumed)" if g.get("committed_tokens_assumed") else ""
        lines.append(f"pooled S ({what}: {len(g['runs'])} run{'s' if len(g['runs']) != 1 else ''}) = "
                     f"{g['stall_per_committed_token_ns'] / ms:.3f} ms per committed token over {g['committed_tokens']} tokens{assumed}")
    for w in r.get("warnings", []):
        lines.append(f"warning: {w}")
    return "\n".join(lines)

def format_compare(c: dict) -> str:
    lines = []
    for f in c["correctness_failures"]:
        lines.append(f"CORRECTNESS FAILURE: {f}")
    for x in c["comparisons"]:
        s = x["saving_ns"]
        d = x["effect_size_d"]
        a0, a1 = sum(x["control_committed_tokens"]), sum(x["treatment_committed_tokens"])
        lines.append(f"{x['treatment']} vs {c['control']} ({x['pairs']} paired repetitions, {a0} vs {a1} committed tokens): "
                     f"S {x['control_stall_per_committed_token_ns'] / 1e6:.3f} -> "
                     f"{x['treatment_stall_per_committed_token_ns'] / 1e6:.3f} ms/token; saved {s['estimate'] / 1e6:.3f} ms "
                     f"[95% CI {s['low'] / 1e6:.3f}, {s['high'] / 1e6:.3f}], effect size d = {'n/a' if d is None else f'{d:.2f}'}")
    for w in c.get("warnings", []):
        lines.append(f"warning: {w}")
    return "\n".join(lines)


def plan_summary(plan: dict) -> list[str]:
    """Human-readable lines about a plan."""
    layers = plan["layers"]
    runs = [v["train_runs_per_token"] for v in layers.values() if v["train_runs_per_token"] is not None]
    stock = [v["stock_train_runs_per_token"] for v in layers.values() if v["stock_train_runs_per_token"] is not None]
    mods = [v["modularity"] for v in layers.values() if v["modularity"] is not None]
    lay = plan["layout"]
    lines = [
        f"method {plan['method']}: {len(layers)} layers, trained on {len(plan['training']['sessions'])} sessions "
        f"({plan['training']['forwards']} forwards), {len(plan['training']['held_out_sessions'])} held out",
        f"layout: {len(lay['files'])} files, alignment {lay['alignment']} B, every expert one read",
    ]
    if runs:
        lines.append(f"training runs/token (mean over layers): plan {np.mean(runs):.3f}, stock {np.mean(stock):.3f}")
    if mods:
        lines.append(f"modularity: mean {np.mean(mods):.3f} over {len(mods)} layers")
    if plan.get("split"):
        s = plan["split"]
        n = sum(len(v) for v in s["resident"].values())
        lines.append(f"split r={s['ratio']}: {n} resident tops ({s['resident_bytes'] / 1e9:.2f} GB, rule {s['rule']})")
    return lines


VERIFY_LISTED = 20
"""Problems ``verify`` prints before it counts the rest."""


def format_verify(src, dst, problems: list[str], summary: dict, full: bool) -> str:
    """The first :data:`VERIFY_LISTED` problems verify found and how many more, or the one-line
    proof of equality (and the split-runtime note)."""
    if problems:
        more = len(problems) - VERIFY_LISTED
        return "\n".join(problems[:VERIFY_LISTED] + ([f"... and {more} more problem(s) (--json lists every one)"] if more > 0 else []))
    how = "byte for byte and by xxh3-128" if full else "by xxh3-128"
    split = f", {summary['split_tensors']} split tensors reassembled exactly from their segments" if summary["split_tensors"] else ""
    lines = [f"verified {dst}: {summary['tensors']} tensors identical to {src} {how}{split}; runtime constraints hold"]
    if summary.get("format_stamps"):
        lines.append(f"format stamps: all {summary['format_stamps']} of {src} in {dst}, each in the shard holding its tensor")
    lines += [f"note: {n}" for n in summary.get("runtime_file_notes", [])]
    if summary.get("needs_split_runtime"):
        lines.append(f"note: {summary['split_experts']} experts of {dst} are stored as split segments; only a split-aware "
                     "runtime can load it (docs/SPLIT_SEGMENTS.md), stock colibrì exits at its first expert load")
    return "\n".join(lines)


def format_rewrite_files(manifest: dict, stamps: int, index: bool) -> list[str]:
    """What a rewrite did with the files around the tensors: stamps, the index, each runtime file."""
    lines = []
    if stamps:
        lines.append(f"format stamps (colibri.fmt): {stamps} carried, each to the shard now holding its tensor")
    if index:
        lines.append("model.safetensors.index.json: regenerated for the new shards")
    for r in manifest.get("runtime_files", []):
        lines.append(f"{r['name']}: {r['action']} ({r['reason']})")
    return lines


def format_measure(result) -> str:
    """One line about a measured run (:class:`replay.physical.measure.MeasureResult`)."""
    s = result.stall_ns / max(result.committed, 1) / 1e6
    return (f"{result.steps} steps, {result.committed} committed tokens in {result.wall_seconds:.2f} s; "
            f"S = {s:.3f} ms/token; {result.cold}; weights read {'with O_DIRECT' if result.direct else 'buffered'}")



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
            out.append(f"  {r.name:<22}{ci:>28}{r.p50_step_stall_s * 1e3:>8.3f}{r.p99_step_stall_s * 1e3:>8.3f}"
                       f"{r.speculative_bytes_per_token / 1e6:>9.2f}{opt(r.eta_stall_s_per_byte, '.4f', 1e9):>10}"
                       f"{opt(r.ram_hit_rate, '.1%'):>9}{opt(r.timely_recall, '.1%'):>8}"
                       f"{opt(r.unused_bytes_per_token, '.2f', 1e-6):>10}{opt(r.queue_depth, '.2f'):>6}")
        out += [f"  - {c.words}" for c in t.comparisons]
        out += [f"  note: {n}" for n in t.notes]
        out += [f"  {t.reason}", ""]
    return "\n".join(out).rstrip()
