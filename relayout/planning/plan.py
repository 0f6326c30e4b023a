"""Making layout plans: from a routing trace and a container (or a geometry) to ``plan.json``.

:func:`make_plan` learns per-layer expert orders from the training sessions
(:mod:`relayout.planning.ordering`), packs them into a new layout (:mod:`relayout.planning.packing`) and
optionally a vertical split plan (:mod:`relayout.planning.split`). What a plan file records, and how it
is read and validated, is :mod:`replay.formats.planfile`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from containers.progress import progress_bar

from containers.container import MANIFEST_NAME, Container
from containers.errors import InputError
from containers.geometry import ExpertFormat, Geometry
from containers.layout import (
    Layout,
    TensorInfo,
    layout_from_container,
    layout_from_geometry,
    tensors_of_container,
)
from containers.manifest import build_manifest, load_manifest
from containers.segments import expert_segment_specs
from containers.shard_metadata import carried_metadata, container_stamps
from replay.formats.planfile import METHODS, PLAN_FORMAT, PLAN_VERSION, PlanGeometry, PlanSourceRef, SplitPlan, SplitSegment, plan_digest
from replay.model.routing import RoutingTrace

from relayout import __version__
from relayout.planning.coactivation import LayerCounts
from relayout.planning.ordering import (
    LayerOrder,
    greedy_modularity_order,
    heat_order,
    louvain_order,
    random_order,
)
from relayout.planning.packing import PackOptions, pack_layout
from relayout.planning.split import RULES, choose_resident, choose_resident_by_wait, segment_sizes
from relayout.planning.training import TrainingSet, split_sessions, training_of_trace, training_rows


@dataclass
class PlanSource:
    """What a plan is made for: a real container or a geometry's synthetic converter layout."""

    kind: str                      # "container" | "geometry"
    name: str                      # path or geometry name
    geometry: PlanGeometry
    stock: Layout
    tensors: list[TensorInfo]
    fingerprint: str | None
    content_fingerprint: str | None

    @property
    def mtp_layers(self) -> set[int]:
        return set(self.geometry.mtp_layers)


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
    geometry = PlanGeometry(hidden_size=cfg.hidden_size, moe_intermediate_size=cfg.moe_intermediate_size,
                            n_experts=cfg.n_routed_experts, top_k=cfg.num_experts_per_tok, routed_layers=stock.layers,
                            mtp_layers=[l for l in stock.layers if l >= cfg.num_hidden_layers], expert_formats=formats,
                            expert_bytes=sizes)
    return PlanSource("container", str(root), geometry, stock, tensors_of_container(c),
                      manifest["fingerprint"], manifest["content_fingerprint"])


def source_from_geometry(g: Geometry, seed: int = 0) -> PlanSource:
    """Plan against the layout ``relayout synth container`` would write for ``g`` and ``seed``."""
    stock, tensors = layout_from_geometry(g, seed)
    formats = {l: g.format_of_layer(l).name for l in stock.layers}
    sizes = {l: g.expert_bytes(l) for l in stock.layers}
    geometry = PlanGeometry(hidden_size=g.hidden_size, moe_intermediate_size=g.moe_intermediate_size,
                            n_experts=g.n_routed_experts, top_k=g.num_experts_per_tok, routed_layers=stock.layers,
                            mtp_layers=g.mtp_layer_ids, expert_formats=formats, expert_bytes=sizes, name=g.name,
                            synth_seed=seed)
    return PlanSource("geometry", g.name, geometry, stock, tensors, None, None)


def order_layer(method: str, counts: LayerCounts, stock_order: np.ndarray, layer: int, seed: int,
                resolution: float, weight: str, min_support: int) -> LayerOrder:
    if method == "stock" or (counts.rows == 0 and method != "random"):
        return LayerOrder(stock_order, "stock")
    if method == "louvain":
        return louvain_order(counts, resolution, seed, weight, min_support)
    if method == "greedy-modularity":
        return greedy_modularity_order(counts)
    if method == "heat":
        return heat_order(counts)
    if method == "random":
        return random_order(counts.n_experts, seed, layer)
    raise InputError(None, f"unknown method {method!r} (choose {', '.join(METHODS)})")


SPLIT_NEEDS_ONE_TRACE = "a vertical split is planned from one trace's rows; plan it from a single --trace"


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
    trace: RoutingTrace | TrainingSet,
    source: PlanSource,
    method: str = "louvain",
    train_fraction: float = 0.7,
    seed: int = 0,
    resolution: float = 1.0,
    weight: str = "count",
    min_support: int = 1,
    *,
    pack: PackOptions = PackOptions(),
    split: SplitOptions | None = None,
    progress: bool = True,
) -> dict:
    """Build a plan (JSON-ready dict). See the module doc for what it records.

    ``trace`` is one routing trace (its first ``train_fraction`` of sessions train), or the
    :class:`~relayout.planning.training.TrainingSet` of many pooled trace files
    (:func:`relayout.planning.training.pooled_training`, whose files were split by ``train_fraction``
    already). A vertical ``split`` is planned from one trace's rows only.
    """
    if method not in METHODS:
        raise InputError(None, f"unknown method {method!r} (choose {', '.join(METHODS)})")
    if isinstance(trace, TrainingSet):
        if split is not None:
            raise InputError(None, SPLIT_NEEDS_ONE_TRACE)
        training, fmask = trace, None
    else:
        training, fmask = training_of_trace(trace, source.geometry, train_fraction)
    E = source.geometry.n_experts
    orders: dict[int, np.ndarray] = {}
    per_layer = {}
    layers = source.stock.layers
    for li, layer in enumerate(progress_bar(layers, desc=f"plan ({method})", enabled=progress)):
        stock_order = source.stock.physical_order(li)
        counts = training.counts.layer(li)
        lo = order_layer(method, counts, stock_order, layer, seed, resolution, weight, min_support)
        orders[layer] = np.asarray(lo.order, dtype=np.int64)
        per_layer[str(layer)] = {
            "trained_rows": counts.rows,
            "communities": len(lo.communities),
            "modularity": lo.modularity,
            "train_runs_per_token": counts.runs_per_token(orders[layer]) if counts.rows else None,
            "stock_train_runs_per_token": counts.runs_per_token(stock_order) if counts.rows else None,
        }
    split_record = None
    if split is not None:
        unsplit = pack_layout(source.tensors, layers, E, orders, source.mtp_layers, pack) if split.rule == "replay" else None
        split_record = split_plan(trace, source, fmask, split, unsplit)
    segments = None
    if split_record is not None:
        g = source.geometry
        segments = {layer: expert_segment_specs(ExpertFormat.parse(g.expert_formats[layer]), g.hidden_size,
                                                g.moe_intermediate_size, split_record.segments[layer].top_rows)
                    for layer in layers}
    # the source's container-wide metadata keys and its format stamps go into the new files
    kept = carried_metadata(source.stock.file_metadata)
    stamps = container_stamps(source.stock.files, source.stock.file_metadata)
    layout = pack_layout(source.tensors, layers, E, orders, source.mtp_layers, pack,
                         metadata={**kept, "relayout.version": __version__, "relayout.method": method}, segments=segments,
                         stamps=stamps)
    # the source's order in the same packing: what repacking alone changes (the gate separates it)
    stock_orders = {layer: source.stock.physical_order(li) for li, layer in enumerate(layers)}
    repack = pack_layout(source.tensors, layers, E, stock_orders, source.mtp_layers, pack,
                         metadata={**kept, "relayout.version": __version__, "relayout.method": "stock"}, segments=segments,
                         stamps=stamps)
    plan = {
        "format": PLAN_FORMAT,
        "version": PLAN_VERSION,
        "tool_version": __version__,
        "source": PlanSourceRef(source.kind, source.name, source.fingerprint, source.content_fingerprint).to_json(),
        "geometry": source.geometry.to_json(),
        "method": method,
        "parameters": {"seed": seed, "resolution": resolution, "weight": weight, "min_support": min_support,
                       "train_fraction": train_fraction, "shard_bytes": pack.shard_bytes, "alignment": pack.alignment,
                       "scales_with_weights": pack.scales_with_weights},
        "training": training.to_json(),
        "orders": {str(l): orders[l].tolist() for l in layers},
        "layers": per_layer,
        "split": None if split_record is None else split_record.to_json(),
        "source_layout": source.stock.to_json(),
        "layout": layout.to_json(),
        "repack_layout": repack.to_json(),
    }
    plan["plan_digest"] = plan_digest(plan)
    return plan


def split_plan(trace: RoutingTrace, source: PlanSource, fmask: np.ndarray, opt: SplitOptions,
               layout: Layout | None = None) -> SplitPlan:
    """The vertical split of ``opt`` for ``source``: segment sizes per layer and the resident tops,
    chosen by ``opt.rule`` from the training forwards ``fmask`` of ``trace`` (``layout``: the
    unsplit packed layout the ``replay`` rule replays)."""
    g = source.geometry
    layers = source.stock.layers
    sizes, ebytes = [], []
    heat = np.zeros((len(layers), g.n_experts), dtype=np.int64)
    for li, layer in enumerate(layers):
        fmt = ExpertFormat.parse(g.expert_formats[layer])
        sizes.append(segment_sizes(fmt, g.hidden_size, g.moe_intermediate_size, opt.ratio))
        ebytes.append(g.expert_bytes[layer])
        rows = trace.experts[trace.layer_rows(layer, fmask)] if layer in set(trace.layers.tolist()) else np.zeros((0, 1), np.int16)
        heat[li] = np.bincount(rows[rows >= 0].astype(np.int64), minlength=g.n_experts)
    tokens = int(fmask.sum())
    if opt.rule == "replay":
        from replay.model.config import RuntimeConfig
        from replay.model.device import load_device
        from replay.model.engine import simulate

        inst, _ = simulate(trace, fmask, layout, load_device(opt.device), RuntimeConfig(ram_bytes=opt.cache_bytes, workers=opt.workers))
        frac = np.array([s.top_rows / g.moe_intermediate_size for s in sizes])
        resident = choose_resident_by_wait(inst.expert_wait, frac, sizes, opt.ram_bytes)
    else:
        resident = choose_resident(heat, tokens, sizes, ebytes, opt.ram_bytes, opt.rule, opt.cache_bytes)
    replayed = opt.rule == "replay"
    return SplitPlan(
        ratio=opt.ratio, rule=opt.rule, ram_bytes=opt.ram_bytes, cache_bytes=opt.cache_bytes,
        device=opt.device if replayed else None, workers=opt.workers if replayed else None,
        segments={l: SplitSegment(s.top_rows, s.top_bytes, s.bottom_bytes) for l, s in zip(layers, sizes)},
        resident={l: r.tolist() for l, r in zip(layers, resident)},
        resident_bytes=int(sum(len(r) * s.top_bytes for r, s in zip(resident, sizes))),
    )


__all__ = ["RULES", "PlanSource", "SplitOptions", "make_plan", "source_from_container", "source_from_geometry",
           "split_sessions", "training_rows"]
