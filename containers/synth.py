"""Synthetic containers: real safetensors files with the runtime's tensor names, laid out the way
the colibrì converter lays them out, filled with deterministic pseudo-random bytes.

Layout rules (the colibrì converter's): tensors are taken in source-checkpoint order (layer by
layer, expert by expert) and cut into shards by size, each source tensor's weight and scales together;
inside a shard the official writer's order applies (F32 first, then by name, contiguous), so
scales sit together far from the weights and an expert cut by a shard boundary straddles files.
The MTP layer's tensors go to their own ``out-mtp-NNNNN`` shards.

A *sparse* synthetic container (``sparse=True``) has the same headers, names, sizes and offsets,
but each tensor is a short seeded stamp (:data:`STAMP_BYTES`, so tensors stay distinguishable)
followed by zeros that are never written: the files are sparse, so a full-size container (429 GB
logical for GLM-5.2 int4-g64) takes well under 1% of that on disk.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from .progress import progress_bar

from .atomic import TEMP_NAME, fsync_dir, make_dirs, write_bytes_atomic, write_json_atomic
from .destination import rename_noreplace
from .container import expert_tensor_name
from .errors import InputError
from .geometry import PROJECTIONS, ExpertFormat, Geometry, projection_shape
from .safetensors_io import DTYPE_SIZES, TensorSpec, write_shard
from .shard_metadata import with_stamps
from .sources import SeededBytes, SeededScales, Stamped

STAMP_BYTES = 4096
"""Seeded bytes at the start of each tensor of a sparse synthetic container; the rest are holes."""

SYNTH_MARKER = ".relayout-synth"
"""Marks an unfinished synthetic container's directory as ours (so a rerun may remove it)."""


COLIBRI_FORMAT_NAMES = {(8, None): "int8-row", (4, None): "int4-row"}
"""colibrì's format names (``colibri.fmt`` stamps) of the quantised formats; int4 with group scales
is ``int4-grouped`` whatever the group size."""


def colibri_format_name(fmt: ExpertFormat) -> str | None:
    """The name colibrì stamps a tensor of format ``fmt`` with (None when it has no name for it)."""
    if fmt.bits == 4 and fmt.group is not None:
        return "int4-grouped"
    return COLIBRI_FORMAT_NAMES.get((fmt.bits, fmt.group))


@dataclass(frozen=True)
class SourceUnit:
    """One tensor of the source checkpoint: after conversion, one or two output tensors.

    ``stamp``: the colibrì format name of a quantised tensor that is not a routed expert (what
    colibrì's repack tool stamps), else None.
    """

    specs: tuple[TensorSpec, ...]
    mtp: bool
    stamp: str | None = None

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.specs)


def _quantised(name: str, rows: int, cols: int, fmt: ExpertFormat, seed: int, mtp: bool, resident: bool = True) -> SourceUnit:
    wbytes = fmt.weight_bytes(rows, cols)
    sbytes = 4 * fmt.scale_count(rows, cols)
    return SourceUnit(
        (
            TensorSpec(name, "U8", (wbytes,), SeededBytes(seed, name, wbytes)),
            TensorSpec(name + ".qs", "F32", (sbytes // 4,), SeededScales(seed, name + ".qs", sbytes)),
        ),
        mtp,
        colibri_format_name(fmt) if resident else None,
    )


def _plain(name: str, dtype: str, shape: tuple[int, ...], seed: int, mtp: bool = False) -> SourceUnit:
    n = DTYPE_SIZES[dtype]
    for d in shape:
        n *= d
    src = SeededScales(seed, name, n) if dtype == "F32" else SeededBytes(seed, name, n)
    return SourceUnit((TensorSpec(name, dtype, shape, src),), mtp)


def source_units(g: Geometry, seed: int) -> list[SourceUnit]:
    """Every tensor of the model in source-checkpoint order."""
    H, F, E = g.hidden_size, g.moe_intermediate_size, g.n_routed_experts
    units = [_plain("model.embed_tokens.weight", "BF16", (g.vocab_size, H), seed)]
    for layer in range(g.num_hidden_layers + g.mtp_layers):
        mtp = layer >= g.num_hidden_layers
        fmt = g.format_of_layer(layer)
        p = f"model.layers.{layer}"
        units.append(_plain(f"{p}.input_layernorm.weight", "F32", (H,), seed, mtp))
        units.append(_plain(f"{p}.post_attention_layernorm.weight", "F32", (H,), seed, mtp))
        for proj in ("q_proj", "o_proj"):
            units.append(_quantised(f"{p}.self_attn.{proj}.weight", H, H, fmt, seed, mtp))
        if layer < g.first_moe_layer:
            for proj in PROJECTIONS:
                rows, cols = projection_shape(proj, H, g.dense_intermediate_size)
                units.append(_quantised(f"{p}.mlp.{proj}_proj.weight", rows, cols, fmt, seed, mtp))
            continue
        units.append(_plain(f"{p}.mlp.gate.weight", "F32", (E, H), seed, mtp))
        if g.config_style == "glm":
            units.append(_plain(f"{p}.mlp.gate.e_score_correction_bias", "F32", (E,), seed, mtp))
        if g.n_shared_experts:
            for proj in PROJECTIONS:
                rows, cols = projection_shape(proj, H, F * g.n_shared_experts)
                units.append(_quantised(f"{p}.mlp.shared_experts.{proj}_proj.weight", rows, cols, fmt, seed, mtp))
        for e in range(E):
            for proj in PROJECTIONS:
                rows, cols = projection_shape(proj, H, F)
                units.append(_quantised(expert_tensor_name(layer, e, proj), rows, cols, fmt, seed, mtp, resident=False))
    units.append(_plain("model.norm.weight", "F32", (H,), seed))
    units.append(_plain("lm_head.weight", "BF16", (g.vocab_size, H), seed))
    return units


def stamped(units: list[SourceUnit]) -> list[SourceUnit]:
    """The same units with each tensor's bytes cut to a :data:`STAMP_BYTES` stamp followed by zeros."""
    out = []
    for u in units:
        specs = tuple(
            replace(s, source=Stamped(replace(s.source, nbytes=min(s.nbytes, STAMP_BYTES)), s.nbytes)) for s in u.specs
        )
        out.append(SourceUnit(specs, u.mtp, u.stamp))
    return out


def cut_shards(units: list[SourceUnit], shard_bytes: int, seed: int = 0) -> list[list[TensorSpec]]:
    """Cut source units into shards in order, each about ``shard_bytes``.

    Source checkpoints' shards vary in size, so each shard's limit is drawn (by seed) from
    0.9-1.1 x ``shard_bytes``; cuts then fall inside some experts, which straddle two files.
    """
    rng = np.random.default_rng(seed)
    shards: list[list[TensorSpec]] = []
    current: list[TensorSpec] = []
    size = 0
    limit = shard_bytes * rng.uniform(0.9, 1.1)
    for u in units:
        if current and size + u.nbytes > limit:
            shards.append(current)
            current, size = [], 0
            limit = shard_bytes * rng.uniform(0.9, 1.1)
        current.extend(u.specs)
        size += u.nbytes
    if current:
        shards.append(current)
    return shards


def converter_order(specs: list[TensorSpec]) -> list[TensorSpec]:
    """The official writer's physical order: larger dtypes first (F32 before U8), then by name."""
    return sorted(specs, key=lambda s: (-DTYPE_SIZES[s.dtype], s.name))


def shard_name(series: str, number: int) -> str:
    """The converter's name of shard ``number`` (counted from 0) of a series (``out``, ``out-mtp``)."""
    return f"{series}-{number:05d}.safetensors"


def config_json(g: Geometry, sparse: bool = False) -> dict:
    """A ``config.json`` matching the geometry, in the model family's key spelling."""
    cfg = dict(g.extra_config)
    cfg.update(
        hidden_size=g.hidden_size,
        intermediate_size=g.dense_intermediate_size,
        moe_intermediate_size=g.moe_intermediate_size,
        num_hidden_layers=g.num_hidden_layers,
        num_experts_per_tok=g.num_experts_per_tok,
        vocab_size=g.vocab_size,
    )
    if g.config_style == "qwen3":
        cfg.update(num_experts=g.n_routed_experts, decoder_sparse_step=1, mlp_only_layers=[])
    else:
        cfg.update(
            n_routed_experts=g.n_routed_experts,
            n_shared_experts=g.n_shared_experts,
            first_k_dense_replace=g.first_moe_layer,
            num_nextn_predict_layers=g.mtp_layers,
        )
    cfg["relayout_synthetic"] = {"geometry": g.name, **({"sparse": True} if sparse else {})}
    return cfg


SYNTH_NAMES = re.compile(r"^(out|out-mtp)-[0-9]{5,}\.safetensors$|^(config|generation_config|tokenizer_config|tokenizer)\.json$")
"""The files synth writes in ``OUT.partial`` (besides its marker and temp files)."""


def _clear_partial(partial: Path) -> None:
    """Remove an interrupted synth's files from ``partial``, then the directory; anything synth does
    not write is refused, and nothing is removed then."""
    names = os.listdir(partial)
    foreign = sorted(n for n in names if n != SYNTH_MARKER and not SYNTH_NAMES.match(n) and not TEMP_NAME.match(n))
    if foreign or any(not (partial / n).is_file() or (partial / n).is_symlink() for n in names):
        raise InputError(partial, f"holds {', '.join(foreign[:5]) or 'a directory or link'}, which relayout synth does not "
                                  "write; remove it or choose another output")
    for n in names:
        if n != SYNTH_MARKER:
            os.unlink(partial / n)
    os.unlink(partial / SYNTH_MARKER)
    os.rmdir(partial)


def synth_container(out: str | os.PathLike, g: Geometry, seed: int = 0, progress: bool = True,
                    sparse: bool = False, stamp: bool = False) -> Path:
    """Write a synthetic container for geometry ``g`` at ``out`` (built in ``out.partial``).

    ``sparse``: tensors are stamps followed by holes (see the module doc). ``stamp``: each shard's
    ``__metadata__["colibri.fmt"]`` names the format of the quantised tensors it holds that are not
    routed experts, as colibrì's repack tool stamps them (the headers grow, so offsets differ from
    :func:`~containers.layout.layout_from_geometry`'s, which is the unstamped container's layout).
    """
    out = Path(out)
    if out.exists() or out.is_symlink():
        raise InputError(out, "already exists; choose a new output directory")
    partial = out.with_name(out.name + ".partial")
    if partial.is_symlink() or (partial.exists() and not (partial / SYNTH_MARKER).is_file()):
        raise InputError(partial, "exists and was not made by relayout synth; remove it or choose another output")
    if partial.exists():
        _clear_partial(partial)     # an interrupted synth's, proved by its marker
    make_dirs(out.parent)
    make_dirs(partial)
    write_bytes_atomic(partial / SYNTH_MARKER, b"")
    units = source_units(g, seed)
    if sparse:
        units = stamped(units)
    main = cut_shards([u for u in units if not u.mtp], g.shard_bytes, seed)
    mtp = cut_shards([u for u in units if u.mtp], g.shard_bytes, seed + 1)
    stamps = {u.specs[0].name: u.stamp for u in units if stamp and u.stamp}
    total = sum(u.nbytes for u in units)
    with progress_bar(total=total, unit="B", unit_scale=True, desc="synth", enabled=progress) as bar:
        for prefix, shards in (("out", main), ("out-mtp", mtp)):
            for i, specs in enumerate(shards):
                write_shard(
                    partial / shard_name(prefix, i),
                    converter_order(specs),
                    alignment=1,
                    metadata=with_stamps({"format": "pt"}, {s.name: stamps[s.name] for s in specs if s.name in stamps}),
                    on_bytes=bar.update,
                    sparse=sparse,
                )
    write_json_atomic(partial / "config.json", config_json(g, sparse))
    write_json_atomic(partial / "generation_config.json", {"do_sample": False, "relayout_synthetic": True})
    write_json_atomic(partial / "tokenizer_config.json", {"model_max_length": 131072, "relayout_synthetic": True})
    vocab = {f"<t{i}>": i for i in range(min(g.vocab_size, 256))}
    write_json_atomic(partial / "tokenizer.json", {"version": "1.0", "model": {"type": "WordLevel", "vocab": vocab}}, indent=None)
    (partial / SYNTH_MARKER).unlink()
    fsync_dir(partial)
    rename_noreplace(partial, out)
    fsync_dir(out.parent)
    return out


__all__ = ["colibri_format_name", "synth_container", "source_units", "stamped", "cut_shards", "converter_order", "config_json", "shard_name"]
