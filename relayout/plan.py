"""Layout plans: from a routing trace and a container (or a geometry) to ``plan.json``.

A plan records everything replay and rewrite need, so that replay runs far from the container:
the container's fingerprints and geometry, the training sessions (held-out discipline), the
method and its parameters, the per-layer expert order, the source's physical layout (the stock
baseline, straddling experts included), the new layout (files, offsets, alignment) and an
optional vertical split plan. Schema: ``manifests/schemas/plan.schema.json``.
"""

from __future__ import annotations

import gc
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from containers.atomic import write_json_atomic
from containers.container import MANIFEST_NAME, MAX_FILES, Container, expert_tensor_name
from containers.errors import InputError
from containers.geometry import ExpertFormat, Geometry
from containers.hashing import digest_of
from containers.jsonfile import read_document
from containers.manifest import build_manifest, load_manifest
from containers.output_files import MAX_LISTED, output_name_problem
from containers.segments import expert_segment_specs

from . import __version__
from .layout import Layout, PackOptions, TensorInfo, layout_from_container, layout_from_geometry, pack_layout, tensors_of_container
from .ordering import METHODS, LayerOrder, greedy_modularity_order, heat_order, louvain_order, random_order, runs_per_token
from .split import RULES, choose_resident, choose_resident_by_wait, segment_sizes
from .trace import FORWARD_KINDS, RoutingTrace

PLAN_FORMAT = "relayout.plan"
PLAN_VERSION = 1


@dataclass
class PlanSource:
    """What a plan is made for: a real container or a geometry's synthetic converter layout."""

    kind: str                      # "container" | "geometry"
    name: str                      # path or geometry name
    geometry: dict
    stock: Layout
    tensors: list[TensorInfo]
    fingerprint: str | None
    content_fingerprint: str | None

    @property
    def mtp_layers(self) -> set[int]:
        return set(self.geometry["mtp_layers"])


def _geometry_dict(hidden, ffn, E, k, routed, mtp, formats, expert_bytes) -> dict:
    return {
        "hidden_size": hidden, "moe_intermediate_size": ffn, "n_experts": E, "top_k": k,
        "routed_layers": routed, "mtp_layers": mtp,
        "expert_formats": {str(l): f for l, f in formats.items()},
        "expert_bytes": {str(l): b for l, b in expert_bytes.items()},
    }


def source_from_container(root: str | os.PathLike, manifest_path: str | os.PathLike | None = None) -> PlanSource:
    """Open a container; its fingerprints come from its manifest (hashed now if there is none)."""
    c = Container.open(root)
    c.require_clean()
    mpath = Path(manifest_path) if manifest_path else Path(root) / MANIFEST_NAME
    if mpath.exists():
        manifest = load_manifest(mpath)
        recorded = {f["name"]: f["size"] for f in manifest["files"] if f["kind"] == "safetensors"}
        actual = {p.name: h.file_size for p, h in zip(c.files, c.headers)}
        if recorded != actual:
            raise InputError(mpath, "manifest does not match the container's files (re-run relayout manifest)")
    else:
        manifest = build_manifest(c)
    stock = layout_from_container(c)
    formats = {l: c.experts[(l, 0)].format for l in stock.layers}
    sizes = {l: c.experts[(l, 0)].nbytes for l in stock.layers}
    cfg = c.config
    geometry = _geometry_dict(cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts, cfg.num_experts_per_tok,
                              stock.layers, [l for l in stock.layers if l >= cfg.num_hidden_layers], formats, sizes)
    return PlanSource("container", str(root), geometry, stock, tensors_of_container(c),
                      manifest["fingerprint"], manifest["content_fingerprint"])


def source_from_geometry(g: Geometry, seed: int = 0) -> PlanSource:
    """Plan against the layout ``relayout synth container`` would write for ``g`` and ``seed``."""
    stock, tensors = layout_from_geometry(g, seed)
    formats = {l: g.format_of_layer(l).name for l in stock.layers}
    sizes = {l: g.expert_bytes(l) for l in stock.layers}
    geometry = _geometry_dict(g.hidden_size, g.moe_intermediate_size, g.n_routed_experts, g.num_experts_per_tok,
                              stock.layers, g.mtp_layer_ids, formats, sizes)
    geometry["name"] = g.name
    geometry["synth_seed"] = seed
    return PlanSource("geometry", g.name, geometry, stock, tensors, None, None)


def split_sessions(n_sessions: int, train_fraction: float) -> tuple[list[int], list[int]]:
    """Chronological split by session: the first ``train_fraction`` train, the rest are held out.

    At least one session trains; at least one is held out when there are two or more.
    """
    if not 0 < train_fraction <= 1:
        raise InputError(None, "--train-fraction must be in (0, 1]")
    n_train = max(1, int(round(n_sessions * train_fraction)))
    if n_sessions >= 2:
        n_train = min(n_train, n_sessions - 1)
    return list(range(n_train)), list(range(n_train, n_sessions))


def training_rows(trace: RoutingTrace, sessions: list[int]) -> np.ndarray:
    """Forward mask [F] of the decode and verify forwards of ``sessions`` (prefill excluded)."""
    return trace.session_forward_mask(sessions) & (trace.fwd_kind != FORWARD_KINDS.index("prefill"))


def check_trace_fits(trace: RoutingTrace, geometry: dict, where: str) -> None:
    trace.require_rows("planning")
    if trace.n_experts > geometry["n_experts"]:
        raise InputError(where, f"trace has expert ids up to {trace.n_experts - 1}, the container has {geometry['n_experts']} per layer")
    extra = sorted(set(trace.layers.tolist()) - set(geometry["routed_layers"]))
    if extra:
        raise InputError(where, f"trace routes layers {extra[:5]} that are not routed layers of the container")


def order_layer(method: str, rows: np.ndarray, E: int, stock_order: np.ndarray, layer: int, seed: int,
                resolution: float, weight: str, min_support: int) -> LayerOrder:
    if method == "stock" or (len(rows) == 0 and method != "random"):
        return LayerOrder(stock_order, "stock")
    if method == "louvain":
        return louvain_order(rows, E, resolution, seed, weight, min_support)
    if method == "greedy-modularity":
        return greedy_modularity_order(rows, E)
    if method == "heat":
        return heat_order(rows, E)
    if method == "random":
        return random_order(E, seed, layer)
    raise InputError(None, f"unknown method {method!r} (choose {', '.join(METHODS)})")


@dataclass
class SplitOptions:
    """A vertical split: FFN share of the top segment, RAM for resident tops (bytes), the rule that
    ranks experts, the LRU budget it competes with (bytes), and for the ``replay`` rule the device
    profile and reader workers to replay with."""

    ratio: float
    ram_bytes: int
    rule: str = "stall"
    cache_bytes: int = 0
    device: str = "mac-pro-2019-applraid-4x"
    workers: int = 8


def make_plan(
    trace: RoutingTrace,
    source: PlanSource,
    method: str = "louvain",
    train_fraction: float = 0.7,
    seed: int = 0,
    resolution: float = 1.0,
    weight: str = "count",
    min_support: int = 1,
    pack: PackOptions = PackOptions(),
    split: SplitOptions | None = None,
    progress: bool = True,
) -> dict:
    """Build a plan (JSON-ready dict). See the module doc for what it records."""
    check_trace_fits(trace, source.geometry, trace.source)
    if method not in METHODS:
        raise InputError(None, f"unknown method {method!r} (choose {', '.join(METHODS)})")
    train, held = split_sessions(len(trace.sessions), train_fraction)
    fmask = training_rows(trace, train)
    E = source.geometry["n_experts"]
    orders: dict[int, np.ndarray] = {}
    per_layer = {}
    layers = source.stock.layers
    for li, layer in enumerate(tqdm(layers, desc=f"plan ({method})", disable=None if progress else True)):
        stock_order = source.stock.physical_order(li)
        traced = layer in set(trace.layers.tolist())
        rows = trace.experts[trace.layer_rows(layer, fmask)].astype(np.int64) if traced else np.zeros((0, trace.top_k), np.int64)
        lo = order_layer(method, rows, E, stock_order, layer, seed, resolution, weight, min_support)
        gc.collect()  # the co-activation graphs are cyclic garbage; free them now, not 75 layers later
        orders[layer] = np.asarray(lo.order, dtype=np.int64)
        per_layer[str(layer)] = {
            "trained_rows": int(len(rows)),
            "communities": len(lo.communities),
            "modularity": lo.modularity,
            "train_runs_per_token": runs_per_token(rows, orders[layer]) if len(rows) else None,
            "stock_train_runs_per_token": runs_per_token(rows, stock_order) if len(rows) else None,
        }
    split_json = None
    if split is not None:
        unsplit = pack_layout(source.tensors, layers, E, orders, source.mtp_layers, pack) if split.rule == "replay" else None
        split_json = split_plan(trace, source, fmask, split, unsplit)
    segments = None
    if split_json is not None:
        g = source.geometry
        segments = {layer: expert_segment_specs(ExpertFormat.parse(g["expert_formats"][str(layer)]), g["hidden_size"],
                                                g["moe_intermediate_size"], split_json["segments"][str(layer)]["top_rows"])
                    for layer in layers}
    layout = pack_layout(source.tensors, layers, E, orders, source.mtp_layers, pack,
                         metadata={"relayout.version": __version__, "relayout.method": method}, segments=segments)
    plan = {
        "format": PLAN_FORMAT,
        "version": PLAN_VERSION,
        "tool_version": __version__,
        "source": {"kind": source.kind, "name": source.name, "fingerprint": source.fingerprint,
                   "content_fingerprint": source.content_fingerprint},
        "geometry": source.geometry,
        "method": method,
        "parameters": {"seed": seed, "resolution": resolution, "weight": weight, "min_support": min_support,
                       "train_fraction": train_fraction, "shard_bytes": pack.shard_bytes, "alignment": pack.alignment,
                       "scales_with_weights": pack.scales_with_weights},
        "training": {"trace": trace.source, "trace_fingerprint": trace.fingerprint(),
                     "sessions": [trace.sessions[i] for i in train], "held_out_sessions": [trace.sessions[i] for i in held],
                     "forwards": int(fmask.sum())},
        "orders": {str(l): orders[l].tolist() for l in layers},
        "layers": per_layer,
        "split": split_json,
        "source_layout": source.stock.to_json(),
        "layout": layout.to_json(),
    }
    plan["plan_digest"] = plan_digest(plan)
    return plan


def split_plan(trace: RoutingTrace, source: PlanSource, fmask: np.ndarray, opt: SplitOptions,
               layout: Layout | None = None) -> dict:
    g = source.geometry
    layers = source.stock.layers
    sizes, ebytes = [], []
    heat = np.zeros((len(layers), g["n_experts"]), dtype=np.int64)
    for li, layer in enumerate(layers):
        fmt = ExpertFormat.parse(g["expert_formats"][str(layer)])
        sizes.append(segment_sizes(fmt, g["hidden_size"], g["moe_intermediate_size"], opt.ratio))
        ebytes.append(int(g["expert_bytes"][str(layer)]))
        rows = trace.experts[trace.layer_rows(layer, fmask)] if layer in set(trace.layers.tolist()) else np.zeros((0, 1), np.int16)
        heat[li] = np.bincount(rows[rows >= 0].astype(np.int64), minlength=g["n_experts"])
    tokens = int(fmask.sum())
    if opt.rule == "replay":
        from replay.device import load_device
        from replay.engine import simulate
        from replay.runtime import RuntimeConfig

        inst, _ = simulate(trace, fmask, layout, load_device(opt.device), RuntimeConfig(ram_bytes=opt.cache_bytes, workers=opt.workers))
        frac = np.array([s.top_rows / g["moe_intermediate_size"] for s in sizes])
        resident = choose_resident_by_wait(inst.expert_wait, frac, sizes, opt.ram_bytes)
    else:
        resident = choose_resident(heat, tokens, sizes, ebytes, opt.ram_bytes, opt.rule, opt.cache_bytes)
    return {
        "ratio": opt.ratio, "rule": opt.rule, "ram_bytes": opt.ram_bytes, "cache_bytes": opt.cache_bytes,
        **({"device": opt.device, "workers": opt.workers} if opt.rule == "replay" else {}),
        "segments": {str(l): {"top_rows": s.top_rows, "top_bytes": s.top_bytes, "bottom_bytes": s.bottom_bytes}
                     for l, s in zip(layers, sizes)},
        "resident": {str(l): r.tolist() for l, r in zip(layers, resident)},
        "resident_bytes": int(sum(len(r) * s.top_bytes for r, s in zip(resident, sizes))),
    }


def plan_digest(plan: dict) -> str:
    body = {k: v for k, v in plan.items() if k != "plan_digest"}
    return digest_of(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


def save_plan(plan: dict, path: str | os.PathLike) -> None:
    write_json_atomic(path, plan, indent=None)


@dataclass
class Plan:
    """A loaded, validated plan."""

    path: str
    raw: dict
    stock: Layout
    layout: Layout
    orders: dict[int, np.ndarray]
    split: dict | None = None
    geometry: dict = field(default_factory=dict)

    @property
    def digest(self) -> str:
        return self.raw["plan_digest"]

    @property
    def training_sessions(self) -> list[str]:
        return list(self.raw["training"]["sessions"])


def load_plan(path: str | os.PathLike) -> Plan:
    """Read and validate ``plan.json``: complete permutations, runtime limits, consistent layouts."""
    path = Path(path)
    where = str(path)
    raw = read_document(path, PLAN_FORMAT, PLAN_VERSION,
                        ("geometry", "orders", "source_layout", "layout", "training", "source", "plan_digest"), "plan",
                        missing="no such plan file")
    if plan_digest(raw) != raw["plan_digest"]:
        raise InputError(path, "plan digest does not match its content (edited or corrupt)")
    problems = plan_field_problems(raw)
    stock = Layout.from_json(raw["source_layout"], where)
    layout = Layout.from_json(raw["layout"], where)
    problems += [p for p in (output_name_problem(n) for n in layout.files) if p]
    if problems:
        shown = "; ".join(problems[:MAX_LISTED]) + (f"; and {len(problems) - MAX_LISTED} more" if len(problems) > MAX_LISTED else "")
        raise InputError(path, f"plan is malformed ({len(problems)} problem(s)): {shown}")
    g = raw["geometry"]
    E = g["n_experts"]
    if stock.layers != g["routed_layers"] or layout.layers != g["routed_layers"]:
        raise InputError(path, "layouts do not cover the geometry's routed layers")
    orders = {}
    for layer in g["routed_layers"]:
        o = raw["orders"].get(str(layer))
        if not _int_list(o) or sorted(o) != list(range(E)):
            raise InputError(path, f"order of layer {layer} is not a complete permutation of 0..{E - 1}")
        orders[layer] = np.asarray(o, dtype=np.int64)
    check_runtime_constraints(layout, where)
    if not np.array_equal(stock.expert_bytes(), layout.expert_bytes()):
        raise InputError(path, "new layout's expert sizes differ from the source's")
    return Plan(where, raw, stock, layout, orders, raw.get("split"), g)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _int_list(x) -> bool:
    return isinstance(x, list) and all(_is_int(v) and v >= 0 for v in x)


def plan_field_problems(raw: dict) -> list[str]:
    """Type and range problems of a plan's fields other than its two layouts (empty when none).

    A plan is a shared file: its digest proves it was not damaged, not that it was not crafted,
    so every field replay or rewrite reads is checked here before it is used.
    """
    problems = []
    src = raw.get("source")
    if not isinstance(src, dict):
        return ["'source' is not an object"]
    if src.get("kind") not in ("container", "geometry"):
        problems.append(f"source kind {src.get('kind')!r} is not 'container' or 'geometry'")
    for key in ("fingerprint", "content_fingerprint"):
        if src.get(key) is not None and not isinstance(src.get(key), str):
            problems.append(f"source {key} is not a string")
    if src.get("kind") == "container" and not isinstance(src.get("fingerprint"), str):
        problems.append("a container plan has no source fingerprint")
    if raw.get("method") not in METHODS:
        problems.append(f"method {raw.get('method')!r} is not one of {', '.join(METHODS)}")
    g = raw.get("geometry")
    if not isinstance(g, dict):
        return problems + ["'geometry' is not an object"]
    for key in ("hidden_size", "moe_intermediate_size", "n_experts", "top_k"):
        if not _is_int(g.get(key)) or not 1 <= g[key] <= 1 << 24:
            problems.append(f"geometry {key} {g.get(key)!r} is not a positive integer")
    for key in ("routed_layers", "mtp_layers"):
        if not _int_list(g.get(key)):
            problems.append(f"geometry {key} is not a list of layer numbers")
    if not isinstance(g.get("expert_formats"), dict) or not all(isinstance(v, str) for v in g["expert_formats"].values()):
        problems.append("geometry expert_formats is not an object of strings")
    if not isinstance(g.get("expert_bytes"), dict) or not all(_is_int(v) and v > 0 for v in g["expert_bytes"].values()):
        problems.append("geometry expert_bytes is not an object of byte counts")
    training = raw.get("training")
    if not isinstance(training, dict) or not all(isinstance(training.get(k), list) and all(isinstance(x, str) for x in training[k])
                                                 for k in ("sessions", "held_out_sessions")):
        problems.append("training sessions are not lists of session names")
    if not isinstance(raw.get("orders"), dict):
        problems.append("'orders' is not an object")
    split = raw.get("split")
    if split is not None and not problems:
        problems += _split_problems(split, g)
    return problems


def _split_problems(split, g: dict) -> list[str]:
    if not isinstance(split, dict):
        return ["'split' is not an object or null"]
    problems = []
    if not _is_int(split.get("ram_bytes")) or split["ram_bytes"] < 0:
        problems.append("split ram_bytes is not a byte count")
    resident, segs = split.get("resident"), split.get("segments")
    if not isinstance(resident, dict) or not isinstance(segs, dict):
        return problems + ["split resident and segments are not objects"]
    for layer in g["routed_layers"]:
        r, seg = resident.get(str(layer)), segs.get(str(layer))
        if not _int_list(r) or any(e >= g["n_experts"] for e in r):
            problems.append(f"split resident experts of layer {layer} are not expert ids")
        if not isinstance(seg, dict) or not _is_int(seg.get("top_rows")) or not 0 <= seg["top_rows"] <= g["moe_intermediate_size"]:
            problems.append(f"split top_rows of layer {layer} is not a row count within the FFN")
    return problems


def check_runtime_constraints(layout: Layout, where: str) -> None:
    """At most 512 unique files; every expert's weights byte-adjacent in one file; no overlaps."""
    if len(layout.files) > MAX_FILES:
        raise InputError(where, f"layout has {len(layout.files)} files; the runtime loads at most {MAX_FILES}")
    if len(set(layout.files)) != len(layout.files):
        raise InputError(where, "layout repeats a file name")
    for li, layer in enumerate(layout.layers):
        for e in range(layout.n_experts):
            if len(layout.weight_extents(li, e)) != 1:
                raise InputError(where, f"expert {layer}.{e}: weights are not byte-adjacent in one file")
    if layout.segmented:
        _check_segment_blocks(layout, where)
        loc = np.array([[t[1], t[2], t[3]] for t in layout.segment_tensors], dtype=np.int64).reshape(-1, 3)
    else:
        loc = layout.expert_loc.reshape(-1, 3)
    other = np.array([[t[1], t[2], t[3]] for t in layout.other_tensors], dtype=np.int64).reshape(-1, 3)
    allx = np.vstack([loc, other])
    allx = allx[np.lexsort((allx[:, 1], allx[:, 0]))]
    same = allx[1:, 0] == allx[:-1, 0]
    if (same & (allx[1:, 1] < allx[:-1, 1] + allx[:-1, 2])).any():
        raise InputError(where, "layout places two tensors over each other")
    sizes = np.asarray(layout.file_sizes)
    if ((allx[:, 1] + allx[:, 2]) > sizes[allx[:, 0]]).any():
        raise InputError(where, "layout places a tensor beyond its file's end")


def _check_segment_blocks(layout: Layout, where: str) -> None:
    """Each expert's six weight segments are byte-adjacent in one file (one read for the expert)."""
    placed = {t[0]: (t[1], t[2], t[3]) for t in layout.segment_tensors}
    for orig, spec in layout.segments.items():
        for part in ("top", "bottom"):
            if spec[part] not in placed:
                raise InputError(where, f"segment {spec[part]} is not placed")
    for layer in layout.layers:
        for e in range(layout.n_experts):
            names = [f"{expert_tensor_name(layer, e, p)}.{part}" for part in ("top", "bottom") for p in ("gate", "up", "down")]
            ext = sorted(placed[n] for n in names if n in placed)
            if len(ext) != 6 or len({f for f, _, _ in ext}) != 1 or any(a[1] + a[2] != b[1] for a, b in zip(ext, ext[1:])):
                raise InputError(where, f"expert {layer}.{e}: weight segments are not byte-adjacent in one file")


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


__all__ = ["RULES", "Plan", "PlanSource", "SplitOptions", "load_plan", "make_plan", "save_plan", "source_from_container",
           "source_from_geometry", "split_sessions", "plan_summary", "training_rows"]
