"""Model geometry: the numbers that fix every routed expert's tensors and byte counts.

Geometries are data (``manifests/geometries/*.json``); this module loads them, scales them for
synthetic containers, derives them from a container's ``config.json``, and computes expert
tensor sizes for each quantisation format. All sizes are in bytes.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field, replace

from .errors import InputError
from .jsonfile import load_shipped, shipped_names

PROJECTIONS = ("gate", "up", "down")
"""The three matrices of a SwiGLU expert: gate/up are [ffn, hidden], down is [hidden, ffn]."""

_FORMAT_RE = re.compile(r"^int(4|8)-(row|g(\d+))$")


@dataclass(frozen=True)
class ExpertFormat:
    """A quantisation format: ``bits`` per weight and a scale per row or per group of inputs."""

    bits: int
    group: int | None  # None = one scale per output row

    @classmethod
    def parse(cls, text: str) -> "ExpertFormat":
        m = _FORMAT_RE.match(text)
        if not m:
            raise InputError(None, f"unknown expert format {text!r} (expected int4-row, int4-gNN or int8-row)")
        return cls(int(m.group(1)), int(m.group(3)) if m.group(3) else None)

    @property
    def name(self) -> str:
        return f"int{self.bits}-" + ("row" if self.group is None else f"g{self.group}")

    def weight_bytes(self, rows: int, cols: int) -> int:
        """Packed bytes of a [rows, cols] matrix (row-major, whole bytes per row)."""
        return rows * math.ceil(cols * self.bits / 8)

    def scale_count(self, rows: int, cols: int) -> int:
        """Number of float32 scales of a [rows, cols] matrix."""
        return rows if self.group is None else rows * math.ceil(cols / self.group)


def projection_shape(proj: str, hidden: int, ffn: int) -> tuple[int, int]:
    """Logical [rows, cols] of an expert projection."""
    return (hidden, ffn) if proj == "down" else (ffn, hidden)


class LayerNumbering:
    """Layer numbers from ``first_moe_layer``, ``num_hidden_layers`` and ``mtp_layers``.

    MoE layers are ``first_moe_layer .. num_hidden_layers-1``; MTP layers follow them.
    """

    first_moe_layer: int
    num_hidden_layers: int
    mtp_layers: int

    @property
    def moe_layers(self) -> list[int]:
        return list(range(self.first_moe_layer, self.num_hidden_layers))

    @property
    def mtp_layer_ids(self) -> list[int]:
        return list(range(self.num_hidden_layers, self.num_hidden_layers + self.mtp_layers))


@dataclass(frozen=True)
class Geometry(LayerNumbering):
    """A MoE model's shape. Layers keep the model's absolute numbers.

    MoE layers are ``first_moe_layer .. num_hidden_layers-1``; MTP layers follow them
    (``num_hidden_layers .. num_hidden_layers + mtp_layers - 1``).
    """

    name: str
    model: str
    hidden_size: int
    moe_intermediate_size: int
    dense_intermediate_size: int
    vocab_size: int
    num_hidden_layers: int
    first_moe_layer: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    mtp_layers: int
    expert_format: str
    mtp_expert_format: str
    shard_bytes: int
    config_style: str = "glm"
    description: str = ""
    extra_config: dict = field(default_factory=dict, compare=False)

    @property
    def routed_layers(self) -> list[int]:
        """Every layer holding routed experts: MoE layers then MTP layers."""
        return self.moe_layers + self.mtp_layer_ids

    def format_of_layer(self, layer: int) -> ExpertFormat:
        fmt = self.mtp_expert_format if layer >= self.num_hidden_layers else self.expert_format
        return ExpertFormat.parse(fmt)

    def expert_tensor_bytes(self, layer: int) -> dict[str, tuple[int, int]]:
        """``{proj: (weight bytes, scale bytes)}`` for one expert of ``layer``."""
        fmt = self.format_of_layer(layer)
        out = {}
        for proj in PROJECTIONS:
            rows, cols = projection_shape(proj, self.hidden_size, self.moe_intermediate_size)
            out[proj] = (fmt.weight_bytes(rows, cols), 4 * fmt.scale_count(rows, cols))
        return out

    def expert_bytes(self, layer: int) -> int:
        """Bytes of one routed expert of ``layer`` (weights plus scales)."""
        return sum(w + s for w, s in self.expert_tensor_bytes(layer).values())

    def scaled(
        self,
        moe_layers: int | None = None,
        experts: int | None = None,
        hidden: int | None = None,
        ffn: int | None = None,
        shard_bytes: int | None = None,
        vocab: int | None = None,
    ) -> "Geometry":
        """A smaller (or larger) geometry of the same structure, for tests and benchmarks."""
        g = self
        ffn_ratio = g.dense_intermediate_size / g.moe_intermediate_size
        if moe_layers is not None:
            if moe_layers < 1:
                raise InputError(None, "--moe-layers must be at least 1")
            g = replace(g, num_hidden_layers=g.first_moe_layer + moe_layers)
        if experts is not None:
            if experts < g.num_experts_per_tok:
                raise InputError(None, f"--experts must be at least top-k ({g.num_experts_per_tok})")
            g = replace(g, n_routed_experts=experts)
        if hidden is not None:
            g = replace(g, hidden_size=_positive(hidden, "--hidden"))
        if ffn is not None:
            g = replace(g, moe_intermediate_size=_positive(ffn, "--ffn"),
                        dense_intermediate_size=max(1, round(ffn * ffn_ratio)))
        if shard_bytes is not None:
            g = replace(g, shard_bytes=_positive(shard_bytes, "--shard-mb"))
        if vocab is not None:
            g = replace(g, vocab_size=_positive(vocab, "--vocab"))
        return g

    def to_json(self) -> dict:
        return asdict(self)


def _positive(v: int, flag: str) -> int:
    if v <= 0:
        raise InputError(None, f"{flag} must be positive")
    return v


def geometry_names() -> list[str]:
    """Names of the geometries shipped in ``manifests/geometries``."""
    return shipped_names("geometries")


def load_geometry(name_or_path: str) -> Geometry:
    """Load a shipped geometry by name, or a geometry JSON file by path."""
    obj, where = load_shipped("geometries", name_or_path, "geometry")
    try:
        geometry = Geometry(**obj)
    except TypeError as exc:
        raise InputError(where, f"not a valid geometry ({exc})") from None
    for fmt in (geometry.expert_format, geometry.mtp_expert_format):
        ExpertFormat.parse(fmt)
    return geometry
