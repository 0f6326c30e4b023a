"""What a validation measures on: the source container, the synthesised trace, the plans and their rewrites.

:func:`prepare` takes a container on the disk (``--container``, only ever read) or builds a
synthetic GLM-5.2 int4-row one with full-size 18.9 MB experts (:func:`synthetic_geometry`) in the
work directory, synthesises a routing trace for it (:func:`validation_trace`), plans each layout
and rewrites the plans into containers next to it, all at once (one thread each), with one more
rewrite of the stock plan as the placement control (:data:`PLACEMENT_COPY`).
:func:`read_each_once` then reads every container once before anything is measured;
:func:`calibration_target` and :func:`probe_target` name the file the disk is calibrated and
probed on. Sizes in bytes unless a name says GB (10^9 bytes).
"""

from __future__ import annotations

import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from containers.progress import progress_bar

from containers.container import MANIFEST_NAME, Container
from containers.errors import InputError
from containers.geometry import load_geometry
from containers.manifest import build_manifest, write_manifest
from containers.synth import synth_container

from ..workdir import WorkDir
from .options import DEFAULT_TOKENS, HELD_OUT_SESSIONS, SESSION_TOKENS, TRACE_SESSIONS, TRAIN_FRACTION, ValidateOptions

SYNTH_GEOMETRY = "glm-5.2-int4-row"
SYNTH_EXPERTS = 32
PLACEMENT_COPY = "stock-copy"
"""A second rewrite of the stock plan, byte for byte the stock container's weights in the same order,
measured beside stock as a negative control: what the disk's placement of a file alone changes."""


def synthetic_geometry(gigabytes: float):
    """GLM-5.2 int4-row with :data:`SYNTH_EXPERTS` full-size (18.9 MB) experts per layer and as
    many MoE layers as make about ``gigabytes`` GB (10^9 bytes) of routed experts (at least one)."""
    g = load_geometry(SYNTH_GEOMETRY)
    per_layer = SYNTH_EXPERTS * g.expert_bytes(g.moe_layers[0])
    layers = max(1, round(gigabytes * 1e9 / per_layer))
    return g.scaled(moe_layers=layers, experts=SYNTH_EXPERTS, vocab=4096, shard_bytes=500_000_000)


@dataclass
class Layouts:
    """What the cells are measured on: per method its container directory, replay layout and plan."""

    dirs: dict
    layouts: dict
    plans: dict


def validation_trace(container: Container, seed: int = 0, tokens: int | None = None):
    """The routing trace ``validate`` synthesises for ``container`` (``--seed``, ``--tokens``):
    :data:`TRACE_SESSIONS` sessions of planted co-activation cliques over its routed layers, each
    long enough for ``tokens`` held-out steps (default :data:`DEFAULT_TOKENS`)."""
    from relayout.traces.synth import SynthParams, synth_trace

    cfg = container.config
    layers = [l for l in container.routed_layers if l < cfg.num_hidden_layers]
    per_session = max(SESSION_TOKENS, -(-(tokens or DEFAULT_TOKENS) // HELD_OUT_SESSIONS))
    return synth_trace(layers, cfg.n_routed_experts, cfg.num_experts_per_tok, per_session * TRACE_SESSIONS,
                       TRACE_SESSIONS, seed=seed + 5, params=SynthParams(clique_strength=0.8))


def prepare(o: ValidateOptions, work: WorkDir, notify) -> tuple:
    """Container, manifest path, trace and the layouts (planned, rewritten). Returns
    ``(container dir, manifest dict, trace, Layouts, synthetic)``."""
    from replay.formats.planfile import load_plan, save_plan

    from relayout.workflows.apply import apply_plan
    from relayout.planning.plan import make_plan, source_from_container

    synthetic = o.container is None
    if synthetic:
        geometry = synthetic_geometry(o.gb)
        src = work.path / f"source-{o.gb:g}gb-s{o.seed}"
        if not (src / MANIFEST_NAME).is_file():     # a kept previous source is complete once its manifest is written
            work.claim(src.name, src.name + ".partial")
            notify(f"building a synthetic {geometry.name} container of {len(geometry.moe_layers)} MoE layer(s) x "
                   f"{SYNTH_EXPERTS} experts in {src}")
            synth_container(src, geometry, seed=o.seed)
            write_manifest(build_manifest(Container.open(src)), src / MANIFEST_NAME)
        manifest_path = src / MANIFEST_NAME
    else:
        src = o.container
        Container.open(src).require_clean()
        if os.stat(src).st_dev != os.stat(o.path).st_dev:
            notify(f"warning: {src} is not on the file system of {o.path}: its stock layout is measured where it is, the "
                   "rewritten layouts under PATH")
        manifest_path = src / MANIFEST_NAME
        if not manifest_path.is_file():             # never written into the source: ours, in the work directory
            notify(f"{src} has no {MANIFEST_NAME}: hashing it once (kept in the work directory, the source is not modified)")
            manifest_path = work.claim("source-manifest.json")
            write_manifest(build_manifest(Container.open(src)), manifest_path)
    container = Container.open(src)
    from containers.manifest import load_manifest

    manifest = load_manifest(manifest_path)
    trace = validation_trace(container, o.seed, o.tokens)
    source = source_from_container(src, manifest_path)
    need = sum(p.stat().st_size for p in container.files)

    dirs, lays, plans, writes = {}, {}, {}, []
    for method in o.layouts:
        path = work.claim(f"plan-{method}.json")
        save_plan(make_plan(trace, source, method, train_fraction=TRAIN_FRACTION, seed=o.seed, progress=False), path)
        plan = load_plan(path)
        plans[method] = plan
        if method == "stock" and not synthetic:
            dirs[method], lays[method] = src, plan.stock
            continue
        lays[method] = plan.layout
        writes.append((method, plan))
    writes.append((PLACEMENT_COPY, plans["stock"]))
    free = shutil.disk_usage(work.path).free
    if free < need * len(writes) * 1.05:
        raise InputError(work.path, f"needs {need * len(writes) / 1e9:.1f} GB free for {len(writes)} rewritten containers, "
                                    f"has {free / 1e9:.1f} GB")
    for name, _ in writes:
        dirs[name] = work.claim(f"layout-{name}", f"layout-{name}.partial")
    notify(f"rewriting {src} into {', '.join(name for name, _ in writes)} ({work.path}/layout-*), all at once: on a disk "
           "that serves files by the order they were written, no container is then written before the others")

    def rewrite(job: tuple) -> None:
        name, plan = job
        apply_plan(src, plan, dirs[name], None, force=True, manifest_path=manifest_path, progress=False)

    with ThreadPoolExecutor(len(writes)) as pool:
        list(pool.map(rewrite, writes))
    return src, manifest, trace, Layouts(dirs, lays, plans), synthetic


def calibration_target(container_dir: Path, path: Path) -> Path:
    """What ``validate`` calibrates on: the largest safetensors file of the stock container
    (only read), once every container has been read once, when it lies on the file system of
    ``path`` and holds the calibration's largest reads; else ``path``, where a test file is
    written. The runs then read data the calibration read too, in the same state: a disk may read
    a freshly written test file at other speeds than containers read once before."""
    from replay.physical.calibrate import MIN_FILE_BYTES

    files = sorted(Path(container_dir).glob("*.safetensors"), key=lambda p: p.stat().st_size)
    if files and files[-1].stat().st_size >= MIN_FILE_BYTES and os.stat(files[-1]).st_dev == os.stat(path).st_dev:
        return files[-1]
    return Path(path)


def read_each_once(dirs: dict, progress: bool) -> dict:
    """Read every file of each layout's container once (:func:`replay.physical.calibrate.read_once`),
    before anything is measured, so no layout is measured on blocks read for the first time.
    Returns per layout ``{"bytes", "seconds", "rate_Bps"}``: containers read at very different
    rates show a disk that does not serve every file alike on a first read
    (:func:`.summary.summarize_validation` names the slow ones)."""
    from replay.physical.calibrate import read_once

    files = {m: sorted(p for p in Path(d).iterdir() if p.is_file()) for m, d in dirs.items()}
    total = sum(p.stat().st_size for fs in files.values() for p in fs)
    out = {}
    with progress_bar(total=total, desc="validate: reading each container once", unit="B", unit_scale=True,
                      enabled=progress) as bar:
        for m, fs in files.items():
            n, seconds = read_once(fs, bar.update)
            out[m] = {"bytes": n, "seconds": seconds, "rate_Bps": n / seconds if seconds > 0 else None}
    return out


def probe_target(container_dir: Path, stock) -> tuple[Path | None, int]:
    """The drift probe's file (the container's largest) and read size (bytes): the median
    expert's bytes, aligned up, as the measured forwards read them (at most half the file)."""
    from replay.physical.calibrate import ALIGN

    files = sorted(Path(container_dir).glob("*.safetensors"), key=lambda p: p.stat().st_size)
    expert = -(-int(np.median(stock.expert_bytes())) // ALIGN) * ALIGN
    size = min(expert, files[-1].stat().st_size // 2 // ALIGN * ALIGN) if files else 0
    return (files[-1], size) if size >= ALIGN else (None, 0)


