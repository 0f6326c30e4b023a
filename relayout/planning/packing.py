"""The packer: a new physical layout from per-layer expert orders.

:func:`pack_layout` places every tensor in new files:

* experts of a layer in the planned order, each expert's three weight tensors byte-adjacent
  (down, gate, up) with the block aligned (:data:`DEFAULT_ALIGNMENT` bytes, or a RAID chunk size);
* no expert straddles files: files are cut only between blocks, at about ``shard_bytes``;
* scales either together per layer (the converter's habit) or right after their expert's
  weights (``scales_with_weights``);
* non-expert tensors kept, in their source order, in the first files; MTP layers in
  ``out-mtp-NNNNN`` files, each series numbered from 0 as colibrì's converter numbers it; at most
  512 files, unique names;
* each file's ``__metadata__``: the given keys plus colibrì's format stamps of the tensors it holds
  (:func:`containers.shard_metadata.place_stamps`).

Offsets are computed with the same :func:`containers.safetensors_io.plan_shard` the rewriter uses,
so the plan's offsets are the offsets the new container will have.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from containers.container import MAX_FILES
from containers.errors import InputError
from containers.geometry import PROJECTIONS
from containers.hashing import digest_of
from containers.layout import SCALE_SLOTS, Layout, TensorInfo, shard_name, slot_name
from containers.safetensors_io import DTYPE_SIZES, TensorSpec, plan_shard
from containers.shard_metadata import place_stamps, with_stamps

DEFAULT_ALIGNMENT = 4096
"""Default alignment of expert blocks in new shards, bytes (``--alignment``): one 4 KiB disk block."""


class _Sized:
    """A byte source that only knows its size (planning never reads bytes)."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes

    def chunks(self):
        raise AssertionError("a planning placeholder has no bytes")

    def describe(self) -> str:
        return "planning placeholder"


def _spec(t: TensorInfo, alignment: int | None = None) -> TensorSpec:
    return TensorSpec(t.name, t.dtype, t.shape, _Sized(t.nbytes), alignment)


@dataclass(frozen=True)
class PackOptions:
    """How a new container is cut and aligned. Sizes in bytes."""

    shard_bytes: int = 4_000_000_000
    alignment: int = DEFAULT_ALIGNMENT
    scales_with_weights: bool = False
    mtp_files: bool = True


def pack_layout(
    tensors: list[TensorInfo],
    layers: list[int],
    n_experts: int,
    orders: dict[int, np.ndarray],
    mtp_layers: set[int],
    options: PackOptions = PackOptions(),
    *,
    metadata: dict[str, str] | None = None,
    segments: dict[int, dict] | None = None,
    stamps: dict[str, str] | None = None,
) -> Layout:
    """Place every tensor in new files following ``orders`` (see module doc for the rules).

    With ``segments`` (layer -> ``{(proj, is_scale): SegmentSpec}``, a vertical split plan), each
    expert tensor is stored as its ``.top`` and ``.bottom`` segments: the six weight segments form
    one block (tops first), the six scale segments another (``docs/SPLIT_SEGMENTS.md``).
    ``stamps`` (``{tensor name: format name}``, the source's ``colibri.fmt`` stamps) are written
    into the ``__metadata__`` of the file holding each tensor.
    """
    segments = segments or {}
    by_name = {t.name: t for t in tensors}
    expert_names = set()
    for layer in layers:
        order = np.asarray(orders[layer])
        if sorted(order.tolist()) != list(range(n_experts)):
            raise InputError(None, f"order for layer {layer} is not a permutation of 0..{n_experts - 1}")
        for e in range(n_experts):
            for slot in range(6):
                name = slot_name(layer, e, slot)
                if name not in by_name:
                    raise InputError(None, f"tensor {name} is missing from the source")
                expert_names.add(name)
    al = options.alignment

    def layer_of(name: str) -> int | None:
        parts = name.split(".")
        return int(parts[2]) if len(parts) > 2 and parts[0] == "model" and parts[1] == "layers" and parts[2].isdigit() else None

    # blocks: lists of (TensorInfo, alignment) that must stay in one file, in order
    series: dict[str, list[list[tuple[TensorInfo, int | None]]]] = {"out": [], "out-mtp": []}
    for t in tensors:
        if t.name in expert_names:
            continue
        target = "out-mtp" if options.mtp_files and layer_of(t.name) in mtp_layers else "out"
        series[target].append([(t, None)])
    seg_infos: dict[str, TensorInfo] = {}
    seg_map: dict[str, dict] = {}

    def pieces(layer: int, e: int, slots) -> list[TensorInfo]:
        """The tensors stored for these slots: the originals, or their top then bottom segments."""
        if layer not in segments:
            return [by_name[slot_name(layer, e, s)] for s in slots]
        out = []
        for part in ("top", "bottom"):
            for s in slots:
                orig = by_name[slot_name(layer, e, s)]
                spec = segments[layer][(PROJECTIONS[s % 3], s >= 3)]
                if spec.rows * spec.row_bytes != orig.nbytes:
                    raise InputError(None, f"{orig.name}: {orig.nbytes} bytes do not fit the split geometry")
                n = spec.nbytes(part)
                info = TensorInfo(f"{orig.name}.{part}", orig.dtype, (n // DTYPE_SIZES[orig.dtype],), n)
                seg_infos[info.name] = info
                seg_map[orig.name] = {**spec.to_json(), "top": f"{orig.name}.top", "bottom": f"{orig.name}.bottom"}
                out.append(info)
        return out

    weight_order = (2, 0, 1)  # down, gate, up: the converter's name order
    for layer in layers:
        target = "out-mtp" if options.mtp_files and layer in mtp_layers else "out"
        order = [int(e) for e in orders[layer]]
        if not options.scales_with_weights:
            for e in order:
                ts = pieces(layer, e, SCALE_SLOTS)
                series[target].append([(t, None if i == 0 else 1) for i, t in enumerate(ts)])
        for e in order:
            ts = pieces(layer, e, weight_order)
            if options.scales_with_weights:
                ts += pieces(layer, e, SCALE_SLOTS)
            series[target].append([(t, None if i == 0 else 1) for i, t in enumerate(ts)])

    files: list[tuple[str, list[TensorSpec]]] = []
    for prefix, blocks in series.items():
        cur: list[TensorSpec] = []
        size = 0
        n = 0
        for block in blocks:
            bsize = sum(t.nbytes for t, _ in block) + al
            if cur and size + bsize > options.shard_bytes:
                files.append((shard_name(prefix, n), cur))
                n += 1
                cur, size = [], 0
            cur += [_spec(t, a) for t, a in block]
            size += bsize
        if cur:
            files.append((shard_name(prefix, n), cur))
    if len(files) > MAX_FILES:
        raise InputError(None, f"the layout needs {len(files)} files, more than the runtime's {MAX_FILES}; raise the shard size")

    placeholder = {**(metadata or {}), "relayout.layout": "0" * 32}
    per_file = place_stamps(stamps or {}, [[s.name for s in specs] for _, specs in files],
                            {n: n.rsplit(".", 1)[0] for n in seg_infos})
    layouts = [plan_shard(specs, al, with_stamps(placeholder, st)) for (_, specs), st in zip(files, per_file)]
    digest = digest_of(repr([(name, [(s.name, b) for s, b in lay.placements]) for (name, _), lay in zip(files, layouts)]).encode())
    metas = [with_stamps({**placeholder, "relayout.layout": digest}, st) for st in per_file]
    final = [plan_shard(specs, al, m) for (_, specs), m in zip(files, metas)]
    assert [l.placements[-1][1] for l in final] == [l.placements[-1][1] for l in layouts], "metadata changed offsets"

    placed = {}
    for fi, lay in enumerate(final):
        for spec, begin in lay.placements:
            placed[spec.name] = (fi, begin, spec.nbytes)
    loc = np.zeros((len(layers), n_experts, 6, 3), dtype=np.int64)
    for li, layer in enumerate(layers):
        for e in range(n_experts):
            if layer not in segments:
                for slot in range(6):
                    loc[li, e, slot] = placed[slot_name(layer, e, slot)]
                continue
            # logical extents: each original tensor's size, laid contiguously from its block's start
            for slots in (weight_order, SCALE_SLOTS):
                first = f"{slot_name(layer, e, slots[0])}.top"
                f, pos, _ = placed[first]
                for slot in sorted(slots):
                    n = by_name[slot_name(layer, e, slot)].nbytes
                    loc[li, e, slot] = (f, pos, n)
                    pos += n
    names_stored = set(seg_infos)
    others = sorted(([n, *placed[n]] for n in placed if n not in expert_names and n not in names_stored), key=lambda t: (t[1], t[2]))
    segs = sorted(([n, *placed[n]] for n in names_stored), key=lambda t: (t[1], t[2]))
    return Layout([n for n, _ in files], [l.file_size for l in final], list(layers), n_experts, loc, al, others,
                  metas, dict(sorted(seg_map.items())), segs)


def pack_groups(
    tensors: list[TensorInfo],
    layers: list[int],
    n_experts: int,
    groups: list[list[tuple[int, int]]],
    shard_bytes: int,
    alignment: int = DEFAULT_ALIGNMENT,
    metadata: dict[str, str] | None = None,
    stamps: dict[str, str] | None = None,
) -> tuple[Layout, list[list[int]]]:
    """Place every tensor in new files, each file holding experts of one group only.

    Files are named as the converter names them (``out-00000``...); ``stamps`` (the source's
    ``colibri.fmt`` stamps) go into the ``__metadata__`` of the file holding each tensor.

    ``groups``: lists of (absolute layer, expert id), each expert in exactly one group. The
    non-expert tensors come first, in their source order, in files of their own; then each group's
    experts in the given order, each expert one block (down, gate, up weights byte-adjacent and
    aligned, then its three scales), files cut between blocks at about ``shard_bytes``. Returns
    the layout and, per group, the indices of its files (the non-expert files belong to no group).
    """
    by_name = {t.name: t for t in tensors}
    members = [x for g in groups for x in g]
    want = {(l, e) for l in layers for e in range(n_experts)}
    if len(members) != len(set(members)) or set(members) != want:
        raise InputError(None, "the groups must hold every expert of every layer exactly once")
    expert_names = {slot_name(l, e, s) for l, e in want for s in range(6)}
    blocks = [[[(t, None)] for t in tensors if t.name not in expert_names]]
    for g in groups:
        blocks.append([[(by_name[slot_name(l, e, s)], None if i == 0 else 1) for i, s in enumerate((2, 0, 1, *SCALE_SLOTS))]
                       for l, e in g])
    files: list[tuple[str, list[TensorSpec]]] = []
    owner: list[list[int]] = [[] for _ in groups]
    for gi, series in enumerate(blocks):
        cur: list[TensorSpec] = []
        size = 0
        for block in series:
            bsize = sum(t.nbytes for t, _ in block) + alignment
            if cur and size + bsize > shard_bytes:
                files.append((shard_name("out", len(files)), cur))
                if gi:
                    owner[gi - 1].append(len(files) - 1)
                cur, size = [], 0
            cur += [_spec(t, a) for t, a in block]
            size += bsize
        if cur:
            files.append((shard_name("out", len(files)), cur))
            if gi:
                owner[gi - 1].append(len(files) - 1)
    if len(files) > MAX_FILES:
        raise InputError(None, f"the layout needs {len(files)} files, more than the runtime's {MAX_FILES}; raise the shard size")
    placeholder = {**(metadata or {}), "relayout.layout": "0" * 32}
    per_file = place_stamps(stamps or {}, [[s.name for s in specs] for _, specs in files])
    layouts = [plan_shard(specs, alignment, with_stamps(placeholder, st)) for (_, specs), st in zip(files, per_file)]
    digest = digest_of(repr([(name, [(s.name, b) for s, b in lay.placements]) for (name, _), lay in zip(files, layouts)]).encode())
    metas = [with_stamps({**placeholder, "relayout.layout": digest}, st) for st in per_file]
    final = [plan_shard(specs, alignment, m) for (_, specs), m in zip(files, metas)]
    placed = {spec.name: (fi, begin, spec.nbytes) for fi, lay in enumerate(final) for spec, begin in lay.placements}
    loc = np.zeros((len(layers), n_experts, 6, 3), dtype=np.int64)
    for li, layer in enumerate(layers):
        for e in range(n_experts):
            for slot in range(6):
                loc[li, e, slot] = placed[slot_name(layer, e, slot)]
    others = sorted(([n, *placed[n]] for n in placed if n not in expert_names), key=lambda t: (t[1], t[2]))
    layout = Layout([n for n, _ in files], [l.file_size for l in final], list(layers), n_experts, loc, alignment, others,
                    metas)
    return layout, owner
