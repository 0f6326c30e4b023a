"""Apply a plan: check it against the container and the gate, rewrite, verify.

The rewrite refuses unless a passing ``gate.json`` for this plan and this container exists;
``force`` overrides that, and the override is recorded in the new container's manifest. A gate
whose interval or verdict does not recompute from its own evidence is refused even with ``force``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from containers.container import MANIFEST_NAME, Container
from containers.split_destination import check_new_destinations, split_directories
from containers.errors import InputError
from containers.hashing import digest_of
from containers.layout import SLOTS, slot_name
from containers.manifest import build_manifest, load_manifest
from containers.output_files import Derived, OutputFile
from containers.rewrite import rewrite_container
from containers.segments import PARTS, SegmentSpec
from containers.verify import verify_containers
from replay.evaluation.evidence import recheck_fields
from replay.formats.gatefile import GateRecord
from replay.formats.planfile import Plan

from relayout import __version__


def output_files(plan: Plan) -> list[OutputFile]:
    """The plan's new layout as the rewriter's per-file tensor lists (split segments derived)."""
    lay = plan.layout
    per_file: list[list[tuple[str, int]]] = [[] for _ in lay.files]
    derived: dict[str, Derived] = {}
    if lay.segmented:
        for name, f, off, _ in lay.segment_tensors:
            per_file[f].append((name, off))
        for orig, spec in lay.segments.items():
            s = SegmentSpec(spec["kind"], spec["rows"], spec["row_bytes"], spec["split"])
            for part in PARTS:
                derived[spec[part]] = Derived(orig, part, s)
    else:
        for li, layer in enumerate(lay.layers):
            for e in range(lay.n_experts):
                for slot in range(len(SLOTS)):
                    f, off, _ = lay.expert_loc[li, e, slot].tolist()
                    per_file[f].append((slot_name(layer, e, slot), off))
    for name, f, off, _ in lay.other_tensors:
        per_file[f].append((name, off))
    return [OutputFile(n, dict(m), sorted(t, key=lambda x: x[1]), s, lay.alignment,
                       {name: derived[name] for name, _ in t if name in derived})
            for n, m, t, s in zip(lay.files, lay.file_metadata, per_file, lay.file_sizes)]


def source_manifest(src: Container, manifest_path: str | os.PathLike | None) -> dict:
    """The source's manifest: the recorded one when present (names and sizes re-checked), else hashed now."""
    path = Path(manifest_path) if manifest_path else src.root / MANIFEST_NAME
    if path.exists():
        m = load_manifest(path)
        recorded = {f["name"]: f["size"] for f in m["files"]}
        actual = {p.name: p.stat().st_size for p in list(src.files) + list(src.other_files)}
        if recorded != actual:
            raise InputError(path, "manifest does not match the container's files (re-run relayout manifest)")
        return m
    return build_manifest(src)


def check_gate(gate: GateRecord | None, plan: Plan, fingerprint: str, force: bool, where: str | None = None) -> dict:
    """Provenance for the new manifest; raises unless a passing gate for this plan exists or ``force``.

    A given gate is first recomputed from the evidence it stores (:func:`replay.evaluation.evidence.recheck_fields`,
    what ``relayout gate --recheck`` does); a record that does not recompute is refused, with or
    without ``force``, naming the field. ``where`` names the gate file in that error.
    """
    if gate is not None:
        differ = recheck_fields(gate, where or "gate record")
        if differ:
            fields = ", ".join(dict.fromkeys(f for f, _ in differ))
            raise InputError(where, f"rewrite refused: the gate record's {fields} does not recompute from the evidence it "
                                    f"stores ({'; '.join(p for _, p in differ)}); it was edited or damaged: run relayout "
                                    "replay again")
    problem = None
    if gate is None:
        problem = "no gate.json given (run relayout replay ... -o gate.json first)"
    elif gate.plan.digest != plan.digest:
        problem = "the gate was run for a different plan"
    elif gate.plan.source_fingerprint != fingerprint:
        problem = "the gate was run for a different container"
    elif gate.verdict == "insufficient":
        problem = f"the gate had too little held-out evidence for a verdict: {gate.reason}"
    elif gate.verdict != "pass":
        problem = f"the gate failed: {gate.reason}"
    if problem and not force:
        raise InputError(None, f"rewrite refused: {problem}; pass --force to override (recorded in the new manifest)")
    return {
        "tool_version": __version__,
        "plan_digest": plan.digest,
        "plan_method": plan.method,
        "gate_digest": digest_of(json.dumps(gate.to_json(), sort_keys=True, separators=(",", ":")).encode()) if gate else None,
        "gate_verdict": gate.verdict if gate else None,
        "forced": bool(problem),
        "override_reason": problem,
    }


def preflight(src_dir: str | os.PathLike, plan: Plan, dst: str | os.PathLike,
              manifest_path: str | os.PathLike | None = None, split: list[tuple[str, list[str]]] = ()) -> tuple[Container, dict]:
    """What a rewrite of ``src_dir`` into ``dst`` would refuse, checked before any long work.

    Returns the opened source and its manifest; raises :class:`InputError` naming the file when
    the plan was made for a geometry or another container (saying which), the source is not
    clean, or ``dst`` (or a directory of ``split``, as :func:`rewrite_container` takes it) exists
    or is not apart from the source. Writes nothing.
    """
    if plan.source_kind != "container":
        raise InputError(plan.path, "this plan was made for a geometry, not a container; plan against the container to rewrite it")
    src = Container.open(src_dir)
    src.require_clean()
    manifest = source_manifest(src, manifest_path)
    if manifest["fingerprint"] != plan.source_fingerprint:
        made_for = plan.source.name or "another container"
        raise InputError(src_dir, f"this is not the container the plan was made for: the plan is for {made_for} "
                                  f"(fingerprint {str(plan.source_fingerprint)[:12]}...), this one is "
                                  f"{manifest['fingerprint'][:12]}...")
    check_new_destinations(dst, split_directories(list(split), plan.layout.files), src.root)
    return src, manifest


def apply_plan(src_dir: str | os.PathLike, plan: Plan, dst: str | os.PathLike, gate: GateRecord | None = None,
               force: bool = False, manifest_path: str | os.PathLike | None = None, progress: bool = True,
               notify=None, *, gate_path: str | os.PathLike | None = None,
               checked: tuple[Container, dict] | None = None, split: list[tuple[str, list[str]]] = ()) -> dict:
    """Check everything, rewrite ``src_dir`` into ``dst`` following ``plan``; returns the new manifest.

    ``gate_path`` names the gate's file in errors (the gate is rechecked before any byte is
    written). ``checked`` is what :func:`preflight` returned for the same arguments, when the
    caller ran it before long work (the source is then not hashed twice). ``split``: shards
    written into other directories (:func:`split_of_storage`), as :func:`rewrite_container` takes it.
    """
    src, manifest = checked if checked is not None else preflight(src_dir, plan, dst, manifest_path, split)
    provenance = check_gate(gate, plan, manifest["fingerprint"], force, None if gate_path is None else str(gate_path))
    return rewrite_container(src, output_files(plan), dst, manifest, provenance, progress, notify, plan.path, split)


def split_of_storage(storage, plan: Plan, dirs: list[str], where: str | os.PathLike | None = None) -> list[tuple[str, list[str]]]:
    """The shards of each split directory after the primary, from a storage description.

    Parameters
    ----------
    storage
        A :class:`replay.model.storage.StorageRecord` (``relayout drives --out``): its ``dirs``,
        the primary first, name the shards each directory holds.
    plan
        The plan being written; every file of its layout must be in exactly one of ``storage.dirs``.
    dirs
        The directories of ``storage.dirs[1:]``, in that order (the value of ``COLI_MODEL_DIRS``).
    where
        The description's file, named in errors.

    Returns
    -------
    list of (directory, shard names)
        For :func:`apply_plan`'s ``split``; the shards of ``storage.dirs[0]`` stay in the primary.
    """
    if len(dirs) != len(storage.dirs) - 1:
        raise InputError(where, f"splits the shards over {len(storage.dirs)} directories: give the {len(storage.dirs) - 1} "
                                f"after the primary with --dirs (got {len(dirs)})")
    listed = [s for d in storage.dirs for s in d.shards]
    files = set(plan.layout.files)
    twice = sorted({s for s in listed if listed.count(s) > 1})
    if twice:
        raise InputError(where, f"places shard {twice[0]} in two directories")
    missing = sorted(files - set(listed))
    if missing:
        raise InputError(where, f"places no shard {missing[0]} of the plan (made for another layout?)")
    extra = sorted(set(listed) - files)
    if extra:
        raise InputError(where, f"places shard {extra[0]}, which the plan does not write (made for another layout?)")
    return [(d, list(spec.shards)) for d, spec in zip(dirs, storage.dirs[1:])]


def verify(src_dir, dst_dir, full: bool = False, progress: bool = True, dirs: list[str] | None = None) -> tuple[list[str], dict]:
    """:func:`containers.verify.verify_containers`, with the rewrite's provenance in the summary."""
    problems, summary = verify_containers(src_dir, dst_dir, full, progress, dirs)
    rec = Path(dst_dir) / MANIFEST_NAME
    if rec.exists():
        m = load_manifest(rec)
        if "rewrite" in m:
            summary["rewrite"] = m["rewrite"]
    return problems, summary


__all__ = ["apply_plan", "check_gate", "output_files", "preflight", "source_manifest", "split_of_storage", "verify"]
