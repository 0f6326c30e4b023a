"""Placement over several drives: which experts go in which shards, which shards on which drive,
and which shards to mirror, so that predicted stall is least (docs/MULTI_DRIVE.md).

From the training sessions' routing: ``p[l, e]``, the loads of expert ``e`` of layer ``l`` per
committed token, and ``P[l, e, e']``, the loads of both together per token. Reading an expert
costs its bytes over a drive's rate, so an expert's stall value per byte is ``p``.

* **Mirror** (a mirror drive and a budget in bytes): the experts whose mirroring shortens a
  layer's expected load time most per byte (:func:`choose_mirrored`: no more of a layer than
  balances its two copies' drives) go into shards of their
  own, which the mirror holds; the engine then routes and stripes their reads over both copies
  (:mod:`replay.model.storage`).
* **Split** (``COLI_MODEL_DIRS``): experts are assigned to the split drives hottest first; each
  goes to the drive where a layer's expected load time grows least, counting its own loads and
  those of the experts already there that fire with it,
  ``(load[l, d] + p b + sum_{e' on d} P[e, e'] b) / X_d`` (``X_d`` the drive's rate for
  expert-sized reads at the workers' depth), within each drive's capacity: a layer's loads then
  spread over the drives in proportion to their speed, co-activated experts apart.
* Each drive's experts are packed into its own shards (:func:`relayout.planning.packing.pack_groups`);
  the non-expert tensors go in the primary directory's first shards.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from containers.errors import InputError
from containers.layout import Layout, TensorInfo
from containers.shard_metadata import carried_metadata, container_stamps
from replay.model.device import ArrayProfile
from replay.model.storage import DirectorySpec, DriveSpec, Storage, StorageRecord

from relayout.planning.packing import DEFAULT_ALIGNMENT, pack_groups

EXPERT_READ_BYTES = 19 << 20
"""The read size a drive's rate is taken at for placement (bytes): about one expert's weights."""


@dataclass(frozen=True)
class Routing:
    """The training sessions' loads per committed token: ``p`` [L, E], ``pairs`` [L, E, E]."""

    p: np.ndarray
    pairs: np.ndarray


def training_routing(trace, forwards: np.ndarray, layout: Layout) -> Routing:
    """:class:`Routing` of the forwards ``forwards`` (bool [F]), each (forward, layer)'s union of experts."""
    L, E = len(layout.layers), layout.n_experts
    lmap = np.full(max(layout.layers) + 1, -1, dtype=np.int64)
    for i, l in enumerate(layout.layers):
        lmap[l] = i
    rows = forwards[trace.row_forward]
    li = lmap[trace.row_layer[rows].astype(np.int64)]
    ex = trace.experts[rows].astype(np.int64)
    key = (trace.row_forward[rows].astype(np.int64) * L + li)[:, None] * E + ex
    keys = np.unique(key[(ex >= 0) & (li[:, None] >= 0)])
    g, e = keys // E, keys % E
    tokens = max(float(trace.fwd_committed[forwards].sum()), 1.0)
    p = np.bincount((g % L) * E + e, minlength=L * E).reshape(L, E) / tokens
    pairs = np.zeros((L, E, E), dtype=np.float32)
    groups, start = np.unique(g, return_index=True)
    bounds = np.append(start, len(g))
    for i in range(len(groups)):
        es = e[bounds[i]:bounds[i + 1]]
        pairs[groups[i] % L][np.ix_(es, es)] += 1.0
    for li_ in range(L):
        np.fill_diagonal(pairs[li_], 0.0)
    return Routing(p, pairs / np.float32(tokens))


@dataclass(frozen=True)
class DrivePlan:
    """A packing (``layout``) and where its shards go (``storage``); ``mirrored`` [L, E] the experts in mirrored shards."""

    layout: Layout
    storage: StorageRecord
    mirrored: np.ndarray


def plan_drives(layout: Layout, tensors: list[TensorInfo], routing: Routing, drives: list[DriveSpec],
                profiles: dict[str, ArrayProfile], split: list[str], mirror: str | None = None, mirror_bytes: int = 0,
                *, shard_bytes: int = 3_000_000_000, workers: int = 8, alignment: int = DEFAULT_ALIGNMENT) -> DrivePlan:
    """Plan a split over the drives ``split`` (the first holds the primary directory) and, with
    ``mirror``, a mirror of ``mirror_bytes`` at most on that drive (the module docstring)."""
    names = [d.name for d in drives]
    for n in split + ([mirror] if mirror else []):
        if n not in names:
            raise InputError(None, f"unknown drive {n!r} (drives: {', '.join(names)})")
    if not split or len(set(split)) != len(split):
        raise InputError(None, "the split needs one or more distinct drives")
    L, E = len(layout.layers), layout.n_experts
    b = layout.expert_bytes().astype(np.int64) + alignment
    cap = {d.name: (d.capacity_bytes * 0.99 if d.capacity_bytes else np.inf) for d in drives}
    other = sum(int(t[3]) for t in layout.other_tensors)
    cap[split[0]] -= other
    rate = np.array([profiles[n].steady_rate(EXPERT_READ_BYTES, workers) for n in split])

    order = np.argsort(-routing.p, axis=None, kind="stable")
    mirrored = np.zeros((L, E), dtype=bool)
    if mirror:
        budget = min(mirror_bytes, cap[mirror]) * 0.99
        mirrored = choose_mirrored(routing.p, b, budget, rate.sum(), profiles[mirror].steady_rate(EXPERT_READ_BYTES, workers))
        cap[mirror] -= 0 if mirror in split else b[mirrored].sum()

    drive_of = np.full((L, E), -1, dtype=np.int64)
    load = np.zeros((L, len(split)))
    acc = np.zeros((L, len(split), E))
    room = np.array([cap[n] for n in split], dtype=float)
    if mirror in split:
        room[split.index(mirror)] -= b[mirrored].sum()
    for flat in order:
        l, e = divmod(int(flat), E)
        cost = (load[l] + routing.p[l, e] * b[l, e] + acc[l, :, e] * b[l, e]) / rate
        fits = room >= b[l, e]
        if not fits.any():
            raise InputError(None, "the drives' capacities do not hold the model")
        cost[~fits] = np.inf
        d = int(np.argmin(cost))
        drive_of[l, e] = d
        load[l, d] += routing.p[l, e] * b[l, e]
        acc[l, d] += routing.pairs[l, e]
        room[d] -= b[l, e]

    groups, group_drive, group_hot = [], [], []
    for d in range(len(split)):
        for hot in (True, False):
            sel = [(layout.layers[l], e) for l in range(L) for e in range(E) if drive_of[l, e] == d and mirrored[l, e] == hot]
            if sel:
                groups.append(sel)
                group_drive.append(d)
                group_hot.append(hot)
    packed, owner = pack_groups(tensors, layout.layers, E, groups, shard_bytes, alignment,
                                metadata=carried_metadata(layout.file_metadata),
                                stamps=container_stamps(layout.files, layout.file_metadata))
    grouped = {f for fs in owner for f in fs}
    base = [packed.files[f] for f in range(len(packed.files)) if f not in grouped]
    dirs = []
    for d, n in enumerate(split):
        shards = (base if d == 0 else []) + [packed.files[f] for g, fs in enumerate(owner) if group_drive[g] == d for f in fs]
        dirs.append(DirectorySpec(n, shards))
    mirrors = []
    if mirror and mirrored.any():
        mirrors.append(DirectorySpec(mirror, [packed.files[f] for g, fs in enumerate(owner) if group_hot[g] for f in fs]))
    used = {n for n in split} | ({mirror} if mirrors else set())
    rec = StorageRecord([d for d in drives if d.name in used], dirs, mirrors, None)
    if mirrors:
        weights = Storage(rec, profiles, packed).weights
        rec = StorageRecord(rec.drives, dirs, mirrors, [round(w, 3) for w in weights])
    return DrivePlan(packed, rec, mirrored)


def choose_mirrored(p: np.ndarray, nbytes: np.ndarray, budget: float, primary_rate: float, mirror_rate: float) -> np.ndarray:
    """The experts to mirror [L, E] (bool) within ``budget`` bytes: one at a time, the expert whose
    mirroring shortens its layer's expected load time most per byte. A mirrored expert's read is striped in halves over the primary and the
    mirror (O_DIRECT reads of 4 MiB or more); a layer's expected load time is
    ``max(primary bytes / primary_rate, mirror bytes / mirror_rate)`` per token, the split drives
    pooled as one primary. Stops when no expert shortens a layer or none fits."""
    L, E = p.shape
    load = p * nbytes
    prim = load.sum(axis=1)
    mirr = np.zeros(L)
    chosen = np.zeros((L, E), dtype=bool)
    used = 0.0
    while True:
        now = np.maximum(prim / primary_rate, mirr / mirror_rate)[:, None]
        after = np.maximum((prim[:, None] - load / 2) / primary_rate, (mirr[:, None] + load / 2) / mirror_rate)
        gain = np.where(~chosen & (p > 0) & (used + nbytes <= budget), (now - after) / nbytes, -np.inf)
        l, e = np.unravel_index(int(np.argmax(gain)), gain.shape)
        if not gain[l, e] > 0:
            return chosen
        chosen[l, e] = True
        used += nbytes[l, e]
        prim[l] -= load[l, e] / 2
        mirr[l] += load[l, e] / 2


def even_split_by_name(layout: Layout, drives: list[DriveSpec], split: list[str]) -> StorageRecord:
    """The stock shards split by name over ``split``: sorted names cut into equal runs, the first
    run in the primary directory (what a user moving files by hand does)."""
    names = sorted(layout.files)
    k = len(split)
    cuts = [round(i * len(names) / k) for i in range(k + 1)]
    dirs = [DirectorySpec(split[i], names[cuts[i]:cuts[i + 1]]) for i in range(k)]
    return StorageRecord([d for d in drives if d.name in split], dirs)
