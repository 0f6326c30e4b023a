"""The text of ``trace stats``: heat entropy, lift, cross-layer lift and reuse distance per layer."""

from __future__ import annotations


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


def _cell(x) -> str:
    return "n/a" if x is None else str(x)
