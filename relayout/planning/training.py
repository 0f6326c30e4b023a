"""What a plan learns from: the training sessions of one trace, or of many pooled trace files.

A plan learns each layer's order from co-activation counts of *training* rows: the decode and
verify forwards (prefill excluded) of the first ``train_fraction`` of a trace's sessions, in
trace order; the rest are held out for replay. :class:`TrainingSet` holds those counts
(:class:`~relayout.planning.coactivation.PairCounts`) and which sessions they came from (names and routing
fingerprints, which replay uses to keep training sessions out of its evidence).

**Pooling.** Many trace files (a community's sessions from many machines) are pooled by
map-reduce: each file is loaded, split and counted on its own (:func:`count_trace_file`; a task
counts a batch of consecutive files, on a :mod:`replay.execution` executor), and the counts are
merged exactly (:meth:`TrainingSet.merged`), so no machine ever holds more than one trace and
the merged counts. Every file is split by ``train_fraction`` on its own, so each keeps held-out sessions a
replay of that file can be judged on. A pooled plan names its sessions ``<trace path>:<session>``
(two files may both call a session ``s0``).
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from containers.errors import InputError
from replay.formats.planfile import PlanGeometry, PlanTraining
from replay.model.routing import FORWARD_KINDS, RoutingTrace

from relayout.planning.coactivation import PairCounts, count_pairs

TRACE_SUFFIX = ".rt"
"""A directory given as a trace means every ``*.rt`` file directly in it."""


def split_sessions(n_sessions: int, train_fraction: float) -> tuple[list[int], list[int]]:
    """Chronological split by session: the first ``train_fraction`` train, the rest are held out.

    At least one session trains; at least one is held out when there are two or more.
    """
    if not 0 < train_fraction <= 1:
        raise InputError(None, "--train-fraction must be in (0, 1]")
    n_train = max(1, int(round(n_sessions * train_fraction)))
    if n_sessions >= 2:
        n_train = min(n_train, n_sessions - 1)
    return list(range(n_train)), list(range(n_train, n_sessions))


def sessions_needed(train_fraction: float, min_held_out: int) -> int:
    """The fewest sessions a trace needs so that :func:`split_sessions` holds out ``min_held_out``.

    >>> sessions_needed(0.7, 5)
    15
    >>> sessions_needed(0.5, 5)
    9
    """
    n = max(2, min_held_out + 1)
    while len(split_sessions(n, train_fraction)[1]) < min_held_out:
        n += 1
    return n


def held_out_advice(n_sessions: int, train_fraction: float, min_held_out: int) -> str:
    """One sentence for ``plan``: how many sessions train, how many are held out, and how many more
    to record when a verdict would be ``insufficient``."""
    train, held = split_sessions(n_sessions, train_fraction)
    text = (f"learning from the first {len(train)} of {n_sessions} sessions; {len(held)} held out for the "
            f"replay's verdict")
    if len(held) >= min_held_out:
        return text + f" (a verdict needs {min_held_out})"
    need = sessions_needed(train_fraction, min_held_out)
    return (text + f", but a verdict needs {min_held_out} held-out sessions: record {need - n_sessions} more "
            f"({need} in all at --train-fraction {train_fraction:g}), or replay sessions recorded later against this plan")


def training_rows(trace: RoutingTrace, sessions: list[int]) -> np.ndarray:
    """Forward mask [F] of the decode and verify forwards of ``sessions`` (prefill excluded)."""
    return trace.session_forward_mask(sessions) & (trace.fwd_kind != FORWARD_KINDS.index("prefill"))


def check_trace_fits(trace: RoutingTrace, geometry: PlanGeometry, where: str) -> None:
    trace.require_rows("planning")
    if trace.n_experts > geometry.n_experts:
        raise InputError(where, f"trace has expert ids up to {trace.n_experts - 1}, the container has {geometry.n_experts} per layer")
    extra = sorted(set(trace.layers.tolist()) - set(geometry.routed_layers))
    if extra:
        raise InputError(where, f"trace routes layers {extra[:5]} that are not routed layers of the container")


@dataclass
class TrainingSet:
    """Counts of the training rows and where they came from (one trace, or several merged).

    ``traces``/``trace_fingerprints``: the files (content fingerprints); ``sessions``,
    ``session_fingerprints``: the training sessions, in file then trace order;
    ``held_out_sessions``: the others; ``forwards``: training forwards counted.
    """

    counts: PairCounts
    traces: list[str]
    trace_fingerprints: list[str]
    sessions: list[str]
    session_fingerprints: list[str]
    held_out_sessions: list[str]
    forwards: int

    def merged(self, other: "TrainingSet") -> "TrainingSet":
        """Both sets, this one's files first; counts added exactly."""
        return TrainingSet(self.counts.merged(other.counts), self.traces + other.traces,
                           self.trace_fingerprints + other.trace_fingerprints, self.sessions + other.sessions,
                           self.session_fingerprints + other.session_fingerprints,
                           self.held_out_sessions + other.held_out_sessions, self.forwards + other.forwards)

    def to_json(self) -> dict:
        """The plan's ``training`` record (one trace: its path and fingerprint; several: lists)."""
        one = len(self.traces) == 1
        return PlanTraining(trace=self.traces[0] if one else list(self.traces),
                            trace_fingerprint=self.trace_fingerprints[0] if one else list(self.trace_fingerprints),
                            sessions=list(self.sessions), held_out_sessions=list(self.held_out_sessions),
                            session_fingerprints=list(self.session_fingerprints), forwards=int(self.forwards)).to_json()


def training_of_trace(trace: RoutingTrace, geometry: PlanGeometry, train_fraction: float, name_prefix: str = "") -> tuple[TrainingSet, np.ndarray]:
    """The training set of one trace for a plan of ``geometry``, and its forward mask [F].

    ``name_prefix`` is put before every session name (pooling names sessions by their file).
    """
    check_trace_fits(trace, geometry, trace.source)
    train, held = split_sessions(len(trace.sessions), train_fraction)
    fmask = training_rows(trace, train)
    counts = count_pairs(trace, fmask, list(geometry.routed_layers), geometry.n_experts)
    fingerprints = trace.session_fingerprints()
    training = TrainingSet(counts, [trace.source], [trace.fingerprint()], [name_prefix + trace.sessions[i] for i in train],
                           [fingerprints[i] for i in train], [name_prefix + trace.sessions[i] for i in held], int(fmask.sum()))
    return training, fmask


def count_trace_file(path: str, geometry: PlanGeometry, train_fraction: float) -> TrainingSet:
    """Load one trace file and count its training rows: the map task of pooled planning."""
    from replay.formats.trace import load_trace

    trace = load_trace(path)
    return training_of_trace(trace, geometry, train_fraction, f"{path}:")[0]


def count_trace_files(paths: list[str], geometry: PlanGeometry, train_fraction: float) -> TrainingSet:
    """:func:`count_trace_file` of each file, merged in order, one trace in memory at a time: the
    map task of pooled planning (a batch of files, so fewer partial counts travel to be merged)."""
    total = None
    for path in paths:
        part = count_trace_file(path, geometry, train_fraction)
        total = part if total is None else total.merged(part)
    return total


def merge_training(a: TrainingSet, b: TrainingSet) -> TrainingSet:
    """The reduce step of pooled planning (:meth:`TrainingSet.merged`)."""
    return a.merged(b)


BATCHES_PER_WORKER = 4
"""Pooled counting splits the files into this many consecutive batches per worker (enough to
balance uneven files, few enough that merging partial counts costs little)."""


def pooled_training(paths: list[str], geometry: PlanGeometry, train_fraction: float, executor) -> TrainingSet:
    """Training set of every file in ``paths``, counted in batches of consecutive files, one task
    per batch on ``executor`` (a :class:`replay.execution.Executor`), merged in the order given.
    The result does not depend on the batching (merging is exact and keeps the order)."""
    if not paths:
        raise InputError(None, "no trace files to pool")
    n = min(len(paths), max(1, executor.workers * BATCHES_PER_WORKER))
    bounds = np.linspace(0, len(paths), n + 1).round().astype(int)
    batches = [[str(p) for p in paths[a:b]] for a, b in zip(bounds[:-1], bounds[1:])]
    return executor.map_reduce(count_trace_files, [(batch, geometry, train_fraction) for batch in batches], merge_training,
                               desc="count trace batches")


def trace_paths(specs: list[str | os.PathLike]) -> list[str]:
    """The trace files ``specs`` name, in order: a file, a directory (its ``*.rt`` files, sorted)
    or a glob pattern (its matches, sorted). Each file once; a spec naming nothing is an error."""
    out: list[str] = []
    seen: set[str] = set()
    for spec in specs:
        text = str(spec)
        p = Path(text)
        if p.is_dir():
            found = sorted(str(q) for q in p.iterdir() if q.is_file() and q.suffix == TRACE_SUFFIX)
            if not found:
                raise InputError(p, f"directory holds no {TRACE_SUFFIX} trace files")
        elif p.exists():
            found = [text]
        elif glob.has_magic(text):
            found = sorted(q for q in glob.glob(text) if Path(q).is_file())
            if not found:
                raise InputError(text, "pattern matches no trace files")
        else:
            raise InputError(p, "no such trace file")
        for f in found:
            key = os.path.realpath(f)
            if key in seen:
                raise InputError(f, "trace given twice (its sessions would count twice)")
            seen.add(key)
            out.append(f)
    return out
