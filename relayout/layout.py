"""Physical layouts: where every routed expert's six tensors sit (file, offset, bytes), and the
packer that builds a new layout from per-layer orders.

A :class:`Layout` is what the replay model reads and what a rewrite writes. The source layout
comes from a real container (:func:`layout_from_container`) or, for planning without the bytes,
from the converter rules for a geometry (:func:`layout_from_geometry`, the layout
``relayout synth container`` would write). :func:`pack_layout` produces a new one:

* experts of a layer in the planned order, each expert's three weight tensors byte-adjacent
  (down, gate, up) with the block aligned (4096 default, or a RAID chunk size);
* no expert straddles files: files are cut only between blocks, at about ``shard_bytes``;
* scales either together per layer (the converter's habit) or right after their expert's
  weights (``scales_with_weights``);
* non-expert tensors kept, in their source order, in the first files; MTP layers in
  ``out-mtp-NNNNN`` files; at most 512 files, unique names.

Offsets are computed with the same :func:`containers.safetensors_io.plan_shard` the rewriter uses,
so the plan's offsets are the offsets the new container will have.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from containers.container import MAX_FILES, Container, expert_tensor_name
from containers.errors import InputError
from containers.geometry import PROJECTIONS, Geometry
from containers.hashing import digest_of
from containers.safetensors_io import DTYPE_SIZES, TensorSpec, plan_shard
from containers.synth import converter_order, cut_shards, source_units

SLOTS = tuple(f"{p}.weight" for p in PROJECTIONS) + tuple(f"{p}.scales" for p in PROJECTIONS)
"""The six tensors of an expert, in ``expert_loc`` slot order."""
WEIGHT_SLOTS = (0, 1, 2)
SCALE_SLOTS = (3, 4, 5)


@dataclass
class Layout:
    """Placement of routed experts. ``expert_loc[l, e, slot] = (file, offset, nbytes)``."""

    files: list[str]
    file_sizes: list[int]
    layers: list[int]
    n_experts: int
    expert_loc: np.ndarray                     # int64 [L, E, 6, 3]
    alignment: int = 1
    other_tensors: list[list] = field(default_factory=list)   # [name, file, offset, nbytes]
    file_metadata: list[dict] = field(default_factory=list)
    segments: dict = field(default_factory=dict)                # original name -> SegmentSpec JSON
    segment_tensors: list[list] = field(default_factory=list)  # [name, file, offset, nbytes]

    @property
    def segmented(self) -> bool:
        """Experts are stored as vertical split segments; ``expert_loc`` then describes each expert's
        segment blocks as contiguous logical extents (for the replay model), and the real tensors
        are ``segment_tensors``."""
        return bool(self.segments)

    def layer_index(self, layer: int) -> int:
        try:
            return self.layers.index(layer)
        except ValueError:
            raise InputError(None, f"layer {layer} is not a routed layer of this layout") from None

    def expert_bytes(self) -> np.ndarray:
        """Bytes of each expert [L, E] (weights plus scales)."""
        return self.expert_loc[:, :, :, 2].sum(axis=2)

    def weight_extents(self, li: int, e: int) -> list[tuple[int, int, int]]:
        """The reads that fetch an expert's weights: one when byte-adjacent in one file, else three."""
        loc = self.expert_loc[li, e, list(WEIGHT_SLOTS)]
        if len(set(loc[:, 0].tolist())) == 1:
            srt = loc[np.argsort(loc[:, 1])]
            if all(srt[i, 1] + srt[i, 2] == srt[i + 1, 1] for i in range(2)):
                return [(int(srt[0, 0]), int(srt[0, 1]), int(srt[:, 2].sum()))]
        return [tuple(int(x) for x in row) for row in loc]

    def fast_path_fraction(self) -> float:
        n = sum(len(self.weight_extents(li, e)) == 1 for li in range(len(self.layers)) for e in range(self.n_experts))
        return n / (len(self.layers) * self.n_experts)

    def physical_order(self, li: int) -> np.ndarray:
        """Expert ids of a layer sorted by where their first weight byte sits (file, offset)."""
        loc = self.expert_loc[li, :, list(WEIGHT_SLOTS)]           # [3, E, 3]
        first = np.argmin(loc[:, :, 0] * (1 << 44) + loc[:, :, 1], axis=0)
        f = loc[first, np.arange(self.n_experts), 0]
        o = loc[first, np.arange(self.n_experts), 1]
        return np.lexsort((o, f))

    def to_json(self) -> dict:
        return {
            "alignment": self.alignment,
            "files": [{"name": n, "size": s, **({"metadata": m} if m else {})}
                      for n, s, m in zip(self.files, self.file_sizes, self.file_metadata or [{}] * len(self.files))],
            "layers": self.layers,
            "n_experts": self.n_experts,
            "experts": {str(l): self.expert_loc[i].reshape(self.n_experts, 18).tolist() for i, l in enumerate(self.layers)},
            "other_tensors": self.other_tensors,
            **({"segments": self.segments, "segment_tensors": self.segment_tensors} if self.segments else {}),
        }

    @classmethod
    def from_json(cls, obj: dict, where: str) -> "Layout":
        """Parse a layout strictly: every count an integer (never a bool or float), every offset and
        size non-negative, every file index in range, names and metadata strings; one
        :class:`InputError` naming the first problem."""
        try:
            return cls._from_json(obj)
        except KeyError as exc:
            raise InputError(where, f"malformed layout (lacks {exc})") from None
        except (ValueError, TypeError, AttributeError) as exc:
            raise InputError(where, f"malformed layout ({exc})") from None

    @classmethod
    def _from_json(cls, obj: dict) -> "Layout":
        if not isinstance(obj, dict):
            raise TypeError("not an object")
        files = _require(obj["files"], list, "files")
        names, sizes, metas = [], [], []
        for f in files:
            _require(f, dict, "a file entry")
            name = _require(f["name"], str, "a file name")
            names.append(name)
            sizes.append(_count(f["size"], f"size of {name!r}"))
            meta = _require(f.get("metadata", {}), dict, f"metadata of {name!r}")
            if not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
                raise TypeError(f"metadata of {name!r} does not map strings to strings")
            metas.append(meta)
        layers = [_count(x, "a layer number") for x in _require(obj["layers"], list, "layers")]
        E = _count(obj["n_experts"], "n_experts")
        if not 1 <= E <= MAX_EXPERTS:
            raise ValueError(f"n_experts {E} is outside 1..{MAX_EXPERTS}")
        experts = _require(obj["experts"], dict, "experts")
        rows = [_require(experts[str(l)], list, f"experts of layer {l}") for l in layers]
        loc = _int_array(rows, "expert locations").reshape(len(layers), E, 6, 3)
        alignment = _count(obj.get("alignment", 1), "alignment")
        if alignment < 1:
            raise ValueError("alignment must be at least 1")
        other = [_placed(t, len(files)) for t in _require(obj.get("other_tensors", []), list, "other_tensors")]
        seg_tensors = [_placed(t, len(files)) for t in _require(obj.get("segment_tensors", []), list, "segment_tensors")]
        segments = _require(obj.get("segments", {}), dict, "segments")
        for orig, spec in segments.items():
            _require(spec, dict, f"segment spec of {orig!r}")
            for key in ("rows", "row_bytes"):
                _count(spec[key], f"{key} of {orig!r}")
            if spec["kind"] not in ("rows", "columns", "shared"):
                raise ValueError(f"segment kind of {orig!r} is {spec['kind']!r}")
            if spec["split"] is not None:
                _count(spec["split"], f"split of {orig!r}")
            for part in ("top", "bottom"):
                _require(spec[part], str, f"{part} segment name of {orig!r}")
        if len(loc) and (loc[..., 0] >= len(files)).any():
            raise ValueError("an expert is placed in a file the layout does not have")
        return cls(files=names, file_sizes=sizes, layers=layers, n_experts=E, expert_loc=loc, alignment=alignment,
                   other_tensors=other, file_metadata=metas, segments=segments, segment_tensors=seg_tensors)


MAX_EXPERTS = 65536


def _require(value, kind: type, what: str):
    if not isinstance(value, kind):
        raise TypeError(f"{what} is not a{'n' if kind.__name__[0] in 'aeiou' else ''} {kind.__name__}")
    return value


def _count(value, what: str) -> int:
    """A non-negative integer (bools and floats refused)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0 or value >= 2**62:
        raise ValueError(f"{what} is {value!r}, not a non-negative integer")
    return value


def _int_array(rows: list, what: str) -> np.ndarray:
    """Nested lists of non-negative integers as int64 (bools and floats refused)."""
    arr = np.array(rows, dtype=object)
    flat = arr.reshape(-1)
    if not all(type(x) is int for x in flat):
        raise ValueError(f"{what} are not all integers")
    out = arr.astype(np.int64)
    if (out < 0).any():
        raise ValueError(f"{what} contain a negative number")
    return out


def _placed(t, n_files: int) -> list:
    """``[name, file index, offset, nbytes]`` checked."""
    if not (isinstance(t, list) and len(t) == 4 and isinstance(t[0], str)):
        raise TypeError(f"tensor entry {t!r} is not [name, file, offset, nbytes]")
    f, off, n = (_count(x, f"a position of {t[0]!r}") for x in t[1:])
    if f >= n_files:
        raise ValueError(f"{t[0]!r} is placed in file {f}, which the layout does not have")
    return [t[0], f, off, n]


def _slot_name(layer: int, e: int, slot: int) -> str:
    proj = PROJECTIONS[slot % 3]
    return expert_tensor_name(layer, e, proj, scales=slot >= 3)


def layout_from_container(c: Container) -> Layout:
    """The physical layout of an opened container (its stock layout)."""
    layers = c.routed_layers
    E = c.config.n_routed_experts
    if any(e.segments for e in c.experts.values()):
        raise InputError(c.root, "this container stores experts as split segments; plan and measure against the unsplit source")
    loc = np.zeros((len(layers), E, 6, 3), dtype=np.int64)
    for li, layer in enumerate(layers):
        for e in range(E):
            ex = c.experts.get((layer, e))
            if ex is None:
                raise InputError(c.root, f"expert {layer}.{e} is missing")
            for slot in range(6):
                ref = (ex.weights if slot < 3 else ex.scales)[PROJECTIONS[slot % 3]]
                loc[li, e, slot] = (ref.file, ref.entry.begin, ref.entry.nbytes)
    expert_names = {_slot_name(l, e, s) for l in layers for e in range(E) for s in range(6)}
    others = sorted(
        ([n, r.file, r.entry.begin, r.entry.nbytes] for n, r in c.tensors.items() if n not in expert_names),
        key=lambda t: (t[1], t[2]),
    )
    return Layout([p.name for p in c.files], [h.file_size for h in c.headers], layers, E, loc, 1, others,
                  [h.metadata for h in c.headers])


@dataclass(frozen=True)
class TensorInfo:
    """Name, dtype, shape and size of a tensor to be placed (bytes not needed to plan)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


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


def layout_from_geometry(g: Geometry, seed: int = 0) -> tuple[Layout, list[TensorInfo]]:
    """The layout ``relayout synth container`` writes for ``g`` and ``seed``, without writing it.

    Also returns every tensor (in source order) for packing a new layout.
    """
    units = source_units(g, seed)
    files, sizes, placed, metas = [], [], {}, []
    main = cut_shards([u for u in units if not u.mtp], g.shard_bytes, seed)
    mtp = cut_shards([u for u in units if u.mtp], g.shard_bytes, seed + 1)
    for prefix, shards in (("out", main), ("out-mtp", mtp)):
        for i, specs in enumerate(shards, 1):
            lay = plan_shard(converter_order(specs), alignment=1, metadata={"format": "pt"})
            fi = len(files)
            files.append(f"{prefix}-{i:05d}.safetensors")
            sizes.append(lay.file_size)
            metas.append({"format": "pt"})
            for spec, begin in lay.placements:
                placed[spec.name] = (fi, begin, spec.nbytes)
    layers = g.routed_layers
    E = g.n_routed_experts
    loc = np.zeros((len(layers), E, 6, 3), dtype=np.int64)
    for li, layer in enumerate(layers):
        for e in range(E):
            for slot in range(6):
                loc[li, e, slot] = placed[_slot_name(layer, e, slot)]
    expert_names = {_slot_name(l, e, s) for l in layers for e in range(E) for s in range(6)}
    others = sorted(([n, *placed[n]] for n in placed if n not in expert_names), key=lambda t: (t[1], t[2]))
    tensors = [TensorInfo(s.name, s.dtype, s.shape, s.nbytes) for u in units for s in u.specs]
    return Layout(files, sizes, layers, E, loc, 1, others, metas), tensors


def tensors_of_container(c: Container) -> list[TensorInfo]:
    """Every tensor of a container, in physical order (file, offset)."""
    refs = sorted(c.tensors.values(), key=lambda r: (r.file, r.entry.begin))
    return [TensorInfo(r.entry.name, r.entry.dtype, r.entry.shape, r.entry.nbytes) for r in refs]


@dataclass(frozen=True)
class PackOptions:
    """How a new container is cut and aligned. Sizes in bytes."""

    shard_bytes: int = 4_000_000_000
    alignment: int = 4096
    scales_with_weights: bool = False
    mtp_files: bool = True


def pack_layout(
    tensors: list[TensorInfo],
    layers: list[int],
    n_experts: int,
    orders: dict[int, np.ndarray],
    mtp_layers: set[int],
    options: PackOptions = PackOptions(),
    metadata: dict[str, str] | None = None,
    segments: dict[int, dict] | None = None,
) -> Layout:
    """Place every tensor in new files following ``orders`` (see module doc for the rules).

    With ``segments`` (layer -> ``{(proj, is_scale): SegmentSpec}``, a vertical split plan), each
    expert tensor is stored as its ``.top`` and ``.bottom`` segments: the six weight segments form
    one block (tops first), the six scale segments another (``docs/SPLIT_SEGMENTS.md``).
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
                name = _slot_name(layer, e, slot)
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
            return [by_name[_slot_name(layer, e, s)] for s in slots]
        out = []
        for part in ("top", "bottom"):
            for s in slots:
                orig = by_name[_slot_name(layer, e, s)]
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
                n += 1
                files.append((f"{prefix}-{n:05d}.safetensors", cur))
                cur, size = [], 0
            cur += [_spec(t, a) for t, a in block]
            size += bsize
        if cur:
            n += 1
            files.append((f"{prefix}-{n:05d}.safetensors", cur))
    if len(files) > MAX_FILES:
        raise InputError(None, f"the layout needs {len(files)} files, more than the runtime's {MAX_FILES}; raise the shard size")

    placeholder = {**(metadata or {}), "relayout.layout": "0" * 32}
    layouts = [plan_shard(specs, al, placeholder) for _, specs in files]
    digest = digest_of(repr([(name, [(s.name, b) for s, b in lay.placements]) for (name, _), lay in zip(files, layouts)]).encode())
    meta = {**placeholder, "relayout.layout": digest}
    final = [plan_shard(specs, al, meta) for _, specs in files]
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
                    loc[li, e, slot] = placed[_slot_name(layer, e, slot)]
                continue
            # logical extents: each original tensor's size, laid contiguously from its block's start
            for slots in (weight_order, SCALE_SLOTS):
                first = f"{_slot_name(layer, e, slots[0])}.top"
                f, pos, _ = placed[first]
                for slot in sorted(slots):
                    n = by_name[_slot_name(layer, e, slot)].nbytes
                    loc[li, e, slot] = (f, pos, n)
                    pos += n
    names_stored = set(seg_infos)
    others = sorted(([n, *placed[n]] for n in placed if n not in expert_names and n not in names_stored), key=lambda t: (t[1], t[2]))
    segs = sorted(([n, *placed[n]] for n in names_stored), key=lambda t: (t[1], t[2]))
    return Layout([n for n, _ in files], [l.file_size for l in final], list(layers), n_experts, loc, al, others,
                  [dict(meta) for _ in files], dict(sorted(seg_map.items())), segs)
