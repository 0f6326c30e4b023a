"""The text of measurements: a calibrated device profile, a STALL_TRACE report and comparison, a harness run."""

from __future__ import annotations


def small_page_warning(profile: dict) -> str | None:
    """The sentence saying that buffers of scattered pages reach the calibrated device in smaller
    requests than the profile assumes (:func:`replay.physical.request_limits.small_page_request_limit`), or None
    when they do not, the system does not say, or the calibration read into such buffers itself
    (``calibration.buffers.kind`` ``engine``; a profile that does not say read into huge pages)."""
    cal = profile.get("calibration", {})
    d, small = profile["drive"], cal.get("small_page_request_limit")
    if cal.get("buffers", {}).get("kind", "huge-pages") != "huge-pages":
        return None
    if not small or not d.get("max_request_bytes") or small["bytes"] >= d["max_request_bytes"]:
        return None
    return (f"read into buffers of scattered {small['page_bytes'] // 1024} KiB pages, a request here is at most "
            f"{small['bytes'] // 1024} KiB ({small['max_segments']} segments), not {d['max_request_bytes'] // 1024} KiB: "
            "this calibration read into huge pages, a runtime that does not ask for them (colibri's buffers: "
            "posix_memalign, no MADV_HUGEPAGE) gets them only with transparent_hugepage=always (here: "
            f"{small['transparent_hugepage'] or 'unknown'}), and may then read slower, and unevenly from run to run, "
            "than this profile predicts")


def buffers_sentence(profile: dict) -> str | None:
    """Which read buffers the calibration read into and the request limit that gave its fit
    (:func:`replay.physical.request_limits.buffer_request_limit`), in words; None for a profile that
    does not say."""
    cal = profile.get("calibration", {})
    b, limit = cal.get("buffers"), cal.get("request_limit")
    if not b or not limit:
        return None
    size = f"{limit['bytes'] // 1024} KiB" if limit["bytes"] else "unlimited"
    return f"read buffers: {b['kind']}, {b['what']}; requests of at most {size}: {limit['reason']}"


def copy_sentence(profile: dict) -> str | None:
    """The page-cache copy rates (:func:`replay.physical.copy_rate.page_cache_copy`) in words: one
    thread's (the profile's ``memory_bandwidth``), several threads' together, against the cores,
    and one thread's for reads off the cache line (``unaligned_memory_bandwidth``); None when not
    measured."""
    c = profile.get("calibration", {}).get("page_cache_copy")
    if not c:
        return None
    first, *more = c["rates"]
    text = (f"page-cache hits ({c['read_bytes'] / 2**20:g} MiB buffered reads over {c['region_bytes'] / 2**20:g} MiB held "
            f"in the page cache) copied at {first['bytes_per_second'] / 1e9:.2f} GB/s on {first['threads']} thread"
            f"{'s' if first['threads'] != 1 else ''} (memory_bandwidth)")
    if more:
        text += "; together " + ", ".join(
            f"{r['threads']} threads {r['bytes_per_second'] / 1e9:.2f} GB/s (x{r['bytes_per_second'] / first['bytes_per_second']:.2f})"
            for r in more)
    if c.get("cores"):
        text += f", on {c['cores']} core{'s' if c['cores'] != 1 else ''}"
    if c.get("unaligned_bytes_per_second"):
        u = c["unaligned_bytes_per_second"]
        text += (f"; reads starting {c['unaligned_shift']} B into a cache line {u / 1e9:.2f} GB/s on 1 thread "
                 f"(x{u / first['bytes_per_second']:.2f}: unaligned_memory_bandwidth)")
        ratios = c.get("unaligned_ratios")
        if ratios:
            told = min(ratios) > 1.0 or max(ratios) < 1.0
            text += (f", {len(ratios)} paired trials x{min(ratios):.2f}-x{max(ratios):.2f}"
                     + ("" if told else ": no difference told apart from their noise, so none given"))
    if c.get("resident_fraction") is not None and c["resident_fraction"] < 1:
        text += (f"; only {c['resident_fraction']:.0%} of the region was in the page cache afterwards: some reads "
                 "waited for the drive, so these rates are low")
    return text


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
    size = f"{m['size'] / 2**20:g} MiB" if m["size"] % 2**20 == 0 else f"{m['size'] / 1024:g} KiB"
    head = (f"merging two back-to-back {size} reads into one saved {saved * us:.0f} us "
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
    buffers = buffers_sentence(profile)
    if buffers:
        lines.append(buffers)
    warning = small_page_warning(profile)
    if warning:
        lines.append(warning)
    copy = copy_sentence(profile)
    if copy:
        lines.append(copy)
    spread = completion_sentence(profile)
    if spread:
        lines.append(spread[0])
    merge = merge_sentence(profile)
    if merge:
        lines.append(merge[0])
    handoff = profile.get("calibration", {}).get("loader_handoff")
    if handoff and handoff["seconds"]:
        lines.append("handing a block of loads to colibrì's PIPE=1 loader pool on the compute thread's core took "
                     + ", ".join(f"{s * 1e6:.0f} us for {n}" for n, s in zip(handoff["workers"], handoff["seconds"]))
                     + " loaders (the profile's loader_handoff)")
    elif handoff:
        lines.append(f"the loader pool's handoff was not measured ({handoff.get('error', 'no reason given')}): the model "
                     "counts none for PIPE=1")
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
                     + (f"[95% CI {s['low'] / 1e6:.3f}, {s['high'] / 1e6:.3f}], effect size d = {'n/a' if d is None else f'{d:.2f}'}"
                        if x["pairs"] >= 2 else
                        "[interval: insufficient, one paired repetition: put each configuration's repetitions in its "
                        "file (runs of one configuration concatenated, e.g. cat run1.jsonl run2.jsonl > arm.jsonl)]"))
    for w in c.get("warnings", []):
        lines.append(f"warning: {w}")
    return "\n".join(lines)


def format_measure(result) -> str:
    """One line about a measured run (:class:`replay.physical.measure.MeasureResult`)."""
    s = result.stall_ns / max(result.committed, 1) / 1e6
    return (f"{result.steps} steps, {result.committed} committed tokens in {result.wall_seconds:.2f} s; "
            f"S = {s:.3f} ms/token; {result.cold}; weights read {'with O_DIRECT' if result.direct else 'buffered'}")
