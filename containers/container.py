"""The container model: a directory of safetensors shards plus ``config.json``.

Opening a container parses every shard header (strictly), indexes every tensor by name, groups
routed experts by ``(layer, expert)`` with their six tensors, infers each expert's quantisation
format from its byte counts, and records whether its three weight tensors are byte-adjacent in
one file (the runtime's one-read fast path), and collects colibrì's format stamps of every shard
(refusing, as the runtime does, a malformed or conflicting stamp map; :mod:`containers.shard_metadata`).
Nothing is ever written to the container.

``config.json`` is read strictly (integers that are integers, within :data:`CONFIG_BOUNDS`), and
the work done is linear in the tensors present, whatever the numbers in it say. An expert stored
as vertical split segments (``docs/SPLIT_SEGMENTS.md``) is complete and consistent but needs a
runtime that reads segments: :meth:`Container.report` counts such experts (``split_experts``,
``needs_split_runtime``).
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from .errors import InputError
from .geometry import PROJECTIONS, ExpertFormat, LayerNumbering, projection_shape
from .jsonfile import parse_json
from .safetensors_io import ShardHeader, TensorEntry, read_header
from .shard_metadata import container_stamps

MAX_FILES = 512
"""The runtime globs at most this many ``*.safetensors`` files."""

MANIFEST_NAME = "relayout.manifest.json"
EXPERT_TENSOR_RE = re.compile(
    r"model\.layers\.(0|[1-9][0-9]{0,8})\.mlp\.experts\.(0|[1-9][0-9]{0,8})\.(gate|up|down)_proj\.weight(\.qs)?(?:\.(top|bottom))?"
)
"""An expert tensor (use ``fullmatch``); the optional ``.top``/``.bottom`` suffix marks a vertical split segment.

Numbers are ASCII decimal without leading zeros (``layers.03`` is not layer 3 to the runtime's
name lookup), so two spellings never land on the same expert."""

CONFIG_MAX_BYTES = 16 * 1024 * 1024
"""A larger ``config.json`` is refused rather than read."""

CONFIG_BOUNDS = {
    # field: (smallest, largest) plausible value
    "hidden_size": (1, 1 << 17),
    "moe_intermediate_size": (1, 1 << 17),
    "n_routed_experts": (1, 4096),
    "num_experts_per_tok": (1, 4096),
    "num_hidden_layers": (1, 4096),
    "first_moe_layer": (0, 4096),
    "mtp_layers": (0, 64),
}
"""Bounds on the ``config.json`` numbers relayout uses; outside them the file is refused, so a
typo such as ``num_hidden_layers: 1e12`` cannot make relayout allocate or loop without bound."""


def expert_tensor_name(layer: int, expert: int, proj: str, scales: bool = False) -> str:
    """The runtime's name of one routed-expert tensor."""
    return f"model.layers.{layer}.mlp.experts.{expert}.{proj}_proj.weight" + (".qs" if scales else "")


@dataclass(frozen=True)
class TensorRef:
    """A tensor located in a container: the shard file (by index into ``Container.files``)."""

    file: int
    entry: TensorEntry

    @property
    def nbytes(self) -> int:
        return self.entry.nbytes


@dataclass(frozen=True)
class ModelConfig(LayerNumbering):
    """What relayout needs from ``config.json`` (GLM and Qwen3 key spellings accepted)."""

    hidden_size: int
    moe_intermediate_size: int
    n_routed_experts: int
    num_experts_per_tok: int
    num_hidden_layers: int
    first_moe_layer: int
    mtp_layers: int

    @classmethod
    def load(cls, path: Path) -> "ModelConfig":
        """Read ``config.json`` strictly: each number a JSON integer (not a bool or float) in
        :data:`CONFIG_BOUNDS`, top-k at most the expert count, the first MoE layer within the layers."""
        try:
            if not path.is_file():
                raise InputError(path, "missing (a container needs config.json)")
            size = path.stat().st_size
            if size > CONFIG_MAX_BYTES:
                raise InputError(path, f"{size} bytes; a config.json over {CONFIG_MAX_BYTES} bytes is refused")
            obj = parse_json(path.read_bytes().decode("utf-8"))
        except OSError as exc:
            raise InputError(path, f"cannot read ({exc.strerror or exc})") from None
        except RecursionError:
            raise InputError(path, "not valid JSON (nested too deeply)") from None
        except ValueError as exc:  # UnicodeDecodeError and JSONDecodeError included
            raise InputError(path, f"not valid JSON ({str(exc).splitlines()[0][:120]})") from None
        if not isinstance(obj, dict):
            raise InputError(path, "not a JSON object")

        def pick(field, *keys, default=None):
            lo, hi = CONFIG_BOUNDS[field]
            present = [k for k in keys if k in obj]
            if len(present) > 1 and any(obj[k] != obj[present[0]] or type(obj[k]) is not type(obj[present[0]]) for k in present):
                raise InputError(path, f"{' and '.join(present)} disagree (the runtime reads one of them)")
            for k in keys:
                if k in obj:
                    v = obj[k]
                    if not (isinstance(v, int) and not isinstance(v, bool)):
                        raise InputError(path, f"{k} must be an integer, not {_json_type(v)}")
                    if not lo <= v <= hi:
                        shown = v if abs(v) < 10**20 else ("-" if v < 0 else "") + "a number of more than 20 digits"
                        raise InputError(path, f"{k} is {shown}; expected {lo}..{hi}")
                    return v
            if default is None:
                raise InputError(path, f"missing {' or '.join(keys)}")
            return default

        cfg = cls(
            hidden_size=pick("hidden_size", "hidden_size"),
            moe_intermediate_size=pick("moe_intermediate_size", "moe_intermediate_size"),
            n_routed_experts=pick("n_routed_experts", "n_routed_experts", "num_experts", "num_local_experts"),
            num_experts_per_tok=pick("num_experts_per_tok", "num_experts_per_tok"),
            num_hidden_layers=pick("num_hidden_layers", "num_hidden_layers"),
            first_moe_layer=pick("first_moe_layer", "first_k_dense_replace", default=0),
            mtp_layers=pick("mtp_layers", "num_nextn_predict_layers", default=0),
        )
        if cfg.num_experts_per_tok > cfg.n_routed_experts:
            raise InputError(path, f"num_experts_per_tok {cfg.num_experts_per_tok} exceeds the {cfg.n_routed_experts} routed experts")
        if cfg.first_moe_layer > cfg.num_hidden_layers:
            raise InputError(path, f"first_k_dense_replace {cfg.first_moe_layer} exceeds num_hidden_layers {cfg.num_hidden_layers}")
        return cfg

    def is_moe_layer(self, layer: int) -> bool:
        return self.first_moe_layer <= layer < self.num_hidden_layers

    def is_mtp_layer(self, layer: int) -> bool:
        return self.num_hidden_layers <= layer < self.num_hidden_layers + self.mtp_layers


def _json_type(v) -> str:
    if v is None:
        return "null"
    return {bool: "a boolean", float: "a number with a fraction or exponent", str: "a string", list: "an array",
            dict: "an object"}.get(type(v), type(v).__name__)


@dataclass(frozen=True)
class Expert:
    """One routed expert: its three weight tensors and three scale tensors, by projection."""

    layer: int
    expert: int
    weights: dict[str, TensorRef]
    scales: dict[str, TensorRef]
    format: str | None             # "split" for an expert stored as split segments
    segments: dict | None = None   # (proj, is_scale, part) -> TensorRef for a split expert
    base_format: str | None = None  # the quantisation format (of the reassembled tensors, when split)

    @property
    def split(self) -> bool:
        """Stored as ``.top``/``.bottom`` segments: only a runtime that reads split segments can load it."""
        return bool(self.segments)

    @property
    def nbytes(self) -> int:
        if self.segments:
            return sum(t.nbytes for t in self.segments.values())
        return sum(t.nbytes for t in self.weights.values()) + sum(t.nbytes for t in self.scales.values())

    @property
    def weight_bytes(self) -> int:
        if self.segments:
            return sum(t.nbytes for (_, scale, _), t in self.segments.items() if not scale)
        return sum(t.nbytes for t in self.weights.values())

    @property
    def fast_path(self) -> bool:
        """True when the weight tensors (or, split, all six weight segments) are byte-adjacent in one file."""
        if self.segments:
            refs = sorted((t for (_, scale, _), t in self.segments.items() if not scale), key=lambda r: r.entry.begin)
        else:
            refs = sorted(self.weights.values(), key=lambda r: r.entry.begin)
        if len({r.file for r in refs}) != 1:
            return False
        return all(a.entry.end == b.entry.begin for a, b in zip(refs, refs[1:]))


def infer_format(
    weight_bytes: dict[str, int], scale_bytes: dict[str, int], hidden: int, ffn: int
) -> str | None:
    """The expert format whose byte counts match, or None.

    int4 and int8 are told apart by weight bytes; per-row vs group-G scales by the scale count
    (G is the power of two, 16..1024, consistent with all three projections).
    """
    for bits in (4, 8):
        candidates = [ExpertFormat(bits, None)] + [ExpertFormat(bits, 1 << k) for k in range(4, 11)]
        for fmt in candidates:
            ok = True
            for proj in PROJECTIONS:
                rows, cols = projection_shape(proj, hidden, ffn)
                if weight_bytes[proj] != fmt.weight_bytes(rows, cols):
                    ok = False
                    break
                if scale_bytes[proj] != 4 * fmt.scale_count(rows, cols):
                    ok = False
                    break
            if ok:
                return fmt.name
    return None


def infer_split_format(segments: dict, hidden: int, ffn: int) -> str | None:
    """The format of a split expert's reassembled tensors, from its segments' byte counts.

    Weights and gate/up scales are ``top + bottom``; down's scales are ``top + bottom`` when split
    by columns (group scales) or one copy when shared (per-row scales), so both readings are tried.
    """
    weights = {p: segments[(p, False, "top")].nbytes + segments[(p, False, "bottom")].nbytes for p in PROJECTIONS}
    scales = {p: segments[(p, True, "top")].nbytes + segments[(p, True, "bottom")].nbytes for p in PROJECTIONS}
    top, bottom = segments[("down", True, "top")].nbytes, segments[("down", True, "bottom")].nbytes
    readings = [scales] + ([{**scales, "down": top}] if top == bottom else [])
    for reading in readings[::-1]:
        fmt = infer_format(weights, reading, hidden, ffn)
        if fmt is not None:
            return fmt
    return None


@dataclass
class Container:
    """A colibrì container directory, opened read-only."""

    root: Path
    files: list[Path]
    other_files: list[Path]
    headers: list[ShardHeader]
    tensors: dict[str, TensorRef]
    config: ModelConfig
    experts: dict[tuple[int, int], Expert]
    problems: list[str]
    stamps: dict[str, str] = field(default_factory=dict)
    """colibrì's format stamps of all shards, ``{tensor name: format name}`` (:mod:`containers.shard_metadata`)."""

    @classmethod
    def open(cls, root: str | Path, dirs: list[str | Path] = ()) -> "Container":
        """Parse and index the container at ``root``; raises :class:`InputError` on bad input.

        ``dirs``: a model split over several directories (``COLI_MODEL_DIRS``), ``root`` being the
        primary: the shards are collected as colibrì collects them
        (:func:`containers.multidir.check_split`), the other files from ``root`` only; a shard
        name in two directories or a tensor in two shards is an error.
        """
        root = Path(root)
        if not root.is_dir():
            raise InputError(root, "is not a directory" if root.exists() else "no such directory")
        if dirs:
            from .multidir import check_split

            found = check_split([root, *dirs], content=False)
            if found.problems:
                more = f" (and {len(found.problems) - 1} more)" if len(found.problems) > 1 else ""
                raise InputError(root, f"as split over {len(dirs) + 1} directories: {found.problems[0]}{more}")
            files = sorted(found.shards.values())
        else:
            files = sorted(p for p in root.glob("*.safetensors") if p.is_file())
        if not files:
            raise InputError(root, "no *.safetensors files")
        if len(files) > MAX_FILES:
            raise InputError(root, f"{len(files)} safetensors files; the runtime loads at most {MAX_FILES}")
        config = ModelConfig.load(root / "config.json")
        others = sorted(
            p for p in root.iterdir()
            if p.is_file() and p.suffix != ".safetensors" and p.name != MANIFEST_NAME
            and not p.name.startswith(".")
        )
        headers = [read_header(p) for p in files]
        stamps = container_stamps(files, [h.metadata for h in headers])
        tensors: dict[str, TensorRef] = {}
        for i, h in enumerate(headers):
            for name, entry in h.tensors.items():
                if name in tensors:
                    first = files[tensors[name].file].name
                    raise InputError(
                        root, f"tensor {name!r} appears in both {first} and {files[i].name} (the runtime would silently pick one)"
                    )
                tensors[name] = TensorRef(i, entry)
        experts, problems = _group_experts(tensors, config)
        return cls(root, files, others, headers, tensors, config, experts, problems, stamps)

    def require_clean(self) -> None:
        """Raise the first problem found, for commands that need a sound container."""
        if self.problems:
            more = f" (and {len(self.problems) - 1} more; see relayout inspect)" if len(self.problems) > 1 else ""
            raise InputError(self.root, self.problems[0] + more)

    @property
    def routed_layers(self) -> list[int]:
        return sorted({layer for layer, _ in self.experts})

    def total_bytes(self) -> int:
        return sum(h.file_size for h in self.headers) + sum(p.stat().st_size for p in self.other_files)

    def report(self) -> dict:
        """The ``relayout inspect`` summary (JSON-ready)."""
        per_layer = Counter(layer for layer, _ in self.experts)
        by_format: dict[str, Counter] = defaultdict(Counter)
        for e in self.experts.values():
            by_format[e.format or "unknown"][e.nbytes] += 1
        off_path = [e for e in self.experts.values() if not e.fast_path]
        split = sum(1 for e in self.experts.values() if e.split)
        return {
            "root": str(self.root),
            "files": len(self.files),
            "other_files": [p.name for p in self.other_files],
            "tensors": len(self.tensors),
            "total_bytes": self.total_bytes(),
            "moe_layers": [layer for layer in self.routed_layers if layer < self.config.num_hidden_layers],
            "mtp_layers": [layer for layer in self.routed_layers if layer >= self.config.num_hidden_layers],
            "experts_per_layer": {str(k): v for k, v in sorted(per_layer.items())},
            "routed_experts": len(self.experts),
            "routed_bytes": sum(e.nbytes for e in self.experts.values()),
            "bytes_per_expert": {
                fmt: {str(size): n for size, n in sorted(c.items())} for fmt, c in sorted(by_format.items())
            },
            "fast_path_experts": len(self.experts) - len(off_path),
            "off_fast_path_experts": len(off_path),
            "off_fast_path_examples": [f"{e.layer}.{e.expert}" for e in sorted(off_path, key=lambda e: (e.layer, e.expert))[:20]],
            # experts stored as .top/.bottom segments: the stock colibri loader cannot load them
            # (it looks up the whole tensor names), only a runtime that reads split segments can
            "split_experts": split,
            "format_stamps": len(self.stamps),
            "needs_split_runtime": split > 0,
            "config": {
                "hidden_size": self.config.hidden_size,
                "moe_intermediate_size": self.config.moe_intermediate_size,
                "n_routed_experts": self.config.n_routed_experts,
                "num_experts_per_tok": self.config.num_experts_per_tok,
            },
            "problems": list(self.problems),
        }


def _group_experts(tensors: dict[str, TensorRef], config: ModelConfig):
    """Experts by (layer, expert) and the problems found; work is linear in the tensors, whatever
    the numbers in config.json say."""
    parts: dict[tuple[int, int], dict[tuple[str, bool], TensorRef]] = defaultdict(dict)
    segs: dict[tuple[int, int], dict[tuple[str, bool, str], TensorRef]] = defaultdict(dict)
    for name, ref in tensors.items():
        m = EXPERT_TENSOR_RE.fullmatch(name)
        if m:
            key = (int(m.group(1)), int(m.group(2)))
            if m.group(5):
                segs[key][(m.group(3), m.group(4) is not None, m.group(5))] = ref
            else:
                parts[key][(m.group(3), m.group(4) is not None)] = ref
    experts: dict[tuple[int, int], Expert] = {}
    problems: list[str] = []

    def common_checks(layer, expert, refs):
        if not (config.is_moe_layer(layer) or config.is_mtp_layer(layer)):
            problems.append(f"expert {layer}.{expert}: layer {layer} is not a MoE or MTP layer per config.json")
        if expert >= config.n_routed_experts:
            problems.append(f"expert {layer}.{expert}: id beyond n_routed_experts={config.n_routed_experts}")
        bad_dtype = [r.entry.name for scale, r in refs
                     if (r.entry.dtype != "F32" if scale else r.entry.dtype not in ("U8", "I8"))]
        if bad_dtype:
            problems.append(f"expert {layer}.{expert}: unexpected dtype of {bad_dtype[0]}")

    for (layer, expert), found in sorted(segs.items()):
        if (layer, expert) in parts:
            problems.append(f"expert {layer}.{expert} has both whole tensors and split segments")
            continue
        want = [(p, s, part) for part in ("top", "bottom") for p in PROJECTIONS for s in (False, True)]
        missing = [k for k in want if k not in found]
        if missing:
            p, s, part = missing[0]
            problems.append(f"expert {layer}.{expert} is missing segment {expert_tensor_name(layer, expert, p, s)}.{part}")
            continue
        common_checks(layer, expert, [(s, r) for (_, s, _), r in found.items()])
        base = infer_split_format(found, config.hidden_size, config.moe_intermediate_size)
        if base is None:
            problems.append(
                f"expert {layer}.{expert}: split segment byte counts match no known format for hidden={config.hidden_size}, "
                f"ffn={config.moe_intermediate_size}"
            )
        experts[(layer, expert)] = Expert(layer, expert, {p: found[(p, False, "top")] for p in PROJECTIONS},
                                          {p: found[(p, True, "top")] for p in PROJECTIONS}, "split", dict(found), base)
    for (layer, expert), found in sorted(parts.items()):
        if (layer, expert) in segs:
            continue
        missing = [
            expert_tensor_name(layer, expert, p, s) for p in PROJECTIONS for s in (False, True) if (p, s) not in found
        ]
        if missing:
            problems.append(f"expert {layer}.{expert} is missing {missing[0]}" + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))
            continue
        weights = {p: found[(p, False)] for p in PROJECTIONS}
        scales = {p: found[(p, True)] for p in PROJECTIONS}
        common_checks(layer, expert, [(False, r) for r in weights.values()] + [(True, r) for r in scales.values()])
        fmt = infer_format(
            {p: r.nbytes for p, r in weights.items()},
            {p: r.nbytes for p, r in scales.items()},
            config.hidden_size,
            config.moe_intermediate_size,
        )
        if fmt is None:
            problems.append(
                f"expert {layer}.{expert}: byte counts match no known format for hidden={config.hidden_size}, ffn={config.moe_intermediate_size}"
            )
        experts[(layer, expert)] = Expert(layer, expert, weights, scales, fmt, None, fmt)
    per_layer = Counter(layer for layer, _ in experts)
    for layer, n in sorted(per_layer.items()):
        if (config.is_moe_layer(layer) or config.is_mtp_layer(layer)) and n != config.n_routed_experts:
            problems.append(f"layer {layer} has {n} experts, config.json says {config.n_routed_experts}")
    if config.first_moe_layer < config.num_hidden_layers and (config.first_moe_layer, 0) not in experts:
        problems.append(f"probe expert {config.first_moe_layer}.0 (first MoE layer) is missing")
    for layer in sorted(per_layer):
        if config.is_mtp_layer(layer) and (layer, 0) not in experts:
            problems.append(f"probe expert {layer}.0 (MTP layer) is missing")
    formats = Counter(e.format for e in experts.values() if config.is_moe_layer(e.layer))
    if len(formats) > 1:
        problems.append(f"MoE layers mix expert formats: {dict(formats)}")
    return experts, problems
