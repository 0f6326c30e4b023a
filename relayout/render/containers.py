"""The text of container commands: ``inspect``, a plan's summary, ``verify`` and the files a rewrite wrote."""

from __future__ import annotations

import numpy as np

from .units import human_bytes


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
    where = f" (split: {dst} then {', '.join(summary['split_dirs'])}, each tensor once among them)" if summary.get("split_dirs") else ""
    lines = [f"verified {dst}{where}: {summary['tensors']} tensors identical to {src} {how}{split}; runtime constraints hold"]
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
