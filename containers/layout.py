"""Physical layouts: where every routed expert's six tensors sit (file, offset, bytes).

A :class:`Layout` is what the replay model reads, what a plan records and what a rewrite
writes. The source layout comes from a real container (:func:`layout_from_container`) or, for
planning without the bytes, from the converter rules for a geometry (:func:`layout_from_geometry`,
the layout ``relayout synth container`` would write); the planner's packer
(:mod:`relayout.planning.packing`) builds new ones. :func:`check_runtime_constraints` states what the
runtime requires of any layout.

Slot order: ``expert_loc[layer index, expert, slot] = (file index, offset, nbytes)`` with slots
gate, up, down weights then gate, up, down scales (:data:`SLOTS`). The layer index is the
position in ``layers`` (routed layers in ascending absolute number), not the absolute layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .container import MAX_FILES, Container, expert_tensor_name
from .errors import InputError
from .geometry import PROJECTIONS, Geometry
from .safetensors_io import plan_shard
from .synth import converter_order, cut_shards, shard_name, source_units

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

    def weight_bytes(self) -> np.ndarray:
        """Bytes of each expert's weights [L, E] (its scales not included)."""
        return self.expert_loc[:, :, list(WEIGHT_SLOTS), 2].sum(axis=2)

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
    if not all(type(x) is int and 0 <= x < 2**62 for x in flat):
        raise ValueError(f"{what} are not all non-negative integers below 2^62")
    return arr.astype(np.int64)


def _placed(t, n_files: int) -> list:
    """``[name, file index, offset, nbytes]`` checked."""
    if not (isinstance(t, list) and len(t) == 4 and isinstance(t[0], str)):
        raise TypeError(f"tensor entry {t!r} is not [name, file, offset, nbytes]")
    f, off, n = (_count(x, f"a position of {t[0]!r}") for x in t[1:])
    if f >= n_files:
        raise ValueError(f"{t[0]!r} is placed in file {f}, which the layout does not have")
    return [t[0], f, off, n]


def slot_name(layer: int, e: int, slot: int) -> str:
    """The tensor name of an expert's slot (:data:`SLOTS` order)."""
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
    expert_names = {slot_name(l, e, s) for l in layers for e in range(E) for s in range(6)}
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


def layout_from_geometry(g: Geometry, seed: int = 0) -> tuple[Layout, list[TensorInfo]]:
    """The layout ``relayout synth container`` writes for ``g`` and ``seed``, without writing it.

    Also returns every tensor (in source order) for packing a new layout.
    """
    units = source_units(g, seed)
    files, sizes, placed, metas = [], [], {}, []
    main = cut_shards([u for u in units if not u.mtp], g.shard_bytes, seed)
    mtp = cut_shards([u for u in units if u.mtp], g.shard_bytes, seed + 1)
    for prefix, shards in (("out", main), ("out-mtp", mtp)):
        for i, specs in enumerate(shards):
            lay = plan_shard(converter_order(specs), alignment=1, metadata={"format": "pt"})
            fi = len(files)
            files.append(shard_name(prefix, i))
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
                loc[li, e, slot] = placed[slot_name(layer, e, slot)]
    expert_names = {slot_name(l, e, s) for l in layers for e in range(E) for s in range(6)}
    others = sorted(([n, *placed[n]] for n in placed if n not in expert_names), key=lambda t: (t[1], t[2]))
    tensors = [TensorInfo(s.name, s.dtype, s.shape, s.nbytes) for u in units for s in u.specs]
    return Layout(files, sizes, layers, E, loc, 1, others, metas), tensors


def tensors_of_container(c: Container) -> list[TensorInfo]:
    """Every tensor of a container, in physical order (file, offset)."""
    refs = sorted(c.tensors.values(), key=lambda r: (r.file, r.entry.begin))
    return [TensorInfo(r.entry.name, r.entry.dtype, r.entry.shape, r.entry.nbytes) for r in refs]


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
