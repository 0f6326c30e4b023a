"""``relayout trace import``: the routing traces people already have, into one routing trace.

Formats (:data:`TRACE_FORMATS`, told apart by :func:`sniff_format`): ``route``, colibrì's
ROUTE_TRACE text (:mod:`relayout.traces.route`); ``stall``, a measured run's STALL_TRACE JSONL
(:mod:`relayout.traces.stall`); ``mblt``, mbolt's binary log (:mod:`relayout.traces.mblt`);
``coli_usage``, colibrì's per-(layer, expert) counts (:mod:`relayout.traces.coli_usage`). Each
input file is one session, in the order given (a ROUTE_TRACE may be cut into several); the
sessions are assembled into one trace with rows sorted by (forward, layer, position), and what
the counts rest on (assumed acceptance, a runtime output's counts) is recorded in its meta.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from containers.errors import InputError
from containers.jsonfile import ZSTD_MAGIC
from replay.model.routing import INT32_MAX, RoutingTrace

from .coli_usage import read_coli_usage
from .mblt import MBLT_MAGIC, read_mblt
from .route import read_route_sessions
from .sessions import KIND, Limits, SessionRows, check_padding, joined, padded
from .stall import read_stall_trace

TRACE_FORMATS = ("route", "stall", "mblt", "coli_usage")
"""Input formats (see the module doc); :func:`sniff_format` tells them apart."""


def sniff_format(path: Path) -> str:
    """Guess the format of ``path`` from its first bytes."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(4096)
    except OSError as exc:
        raise InputError(path, exc.strerror or str(exc)) from None
    if len(head) >= 4 and struct.unpack("<I", head[:4])[0] == MBLT_MAGIC:
        return "mblt"
    if head[:4] == ZSTD_MAGIC:
        return "stall"
    text = head.lstrip()
    if text.startswith(b"{"):
        return "stall"
    if text.startswith(b"-1 ") or text.startswith(b"-2 "):
        return "coli_usage"
    lines = [ln.strip() for ln in text.split(b"\n")]
    first = next((ln for ln in lines if ln and not ln.startswith(b"#")), b"")
    if b":" in first:
        return "route"
    raise InputError(path, f"cannot tell the trace format; pass --format {'|'.join(TRACE_FORMATS)}")


def assemble(sessions: list[SessionRows], n_experts: int | None, geometry: str, source: str, meta: dict) -> RoutingTrace:
    """Concatenate sessions into one trace with rows sorted by (forward, layer, position).

    Every value has been range-checked by its reader; the narrowing casts below cannot wrap.
    """
    k = max(s.experts.shape[1] for s in sessions)
    n_rows = sum(len(s.forward) for s in sessions)
    n_fwd = sum(len(s.fwd_kind) for s in sessions)
    check_padding(source or None, n_rows, k, sum(int((s.experts >= 0).sum()) for s in sessions))
    if n_rows > INT32_MAX or n_fwd > INT32_MAX:
        raise InputError(source or None, f"{n_rows:,} rows in {n_fwd:,} forwards: more than the trace format holds")
    fwd_offset = 0
    parts = {key: [] for key in ("forward", "layer", "position", "experts", "gates")}
    fwd = {key: [] for key in ("session", "kind", "evaluated", "committed")}
    names = []
    for i, s in enumerate(sessions):
        name = s.name if s.name not in names else f"{s.name}#{i}"
        names.append(name)
        parts["forward"].append(s.forward + fwd_offset)
        parts["layer"].append(s.layer)
        parts["position"].append(s.position)
        parts["experts"].append(s.experts)
        parts["gates"].append(s.gates)
        n = len(s.fwd_kind)
        fwd["session"].append(np.full(n, i))
        fwd["kind"].append(s.fwd_kind)
        fwd["evaluated"].append(s.fwd_evaluated)
        fwd["committed"].append(s.fwd_committed)
        fwd_offset += n
    meta = dict(meta)
    assumed = {}
    for name, s in zip(names, sessions):
        if s.fwd_assumed is not None and s.fwd_assumed.any():
            assumed[name] = s
    meta.pop("committed_assumed", None)
    counted = {name: s.counts for name, s in zip(names, sessions) if s.counts}
    if counted:
        meta["session_counts"] = counted
    from_runtime = [name for name, c in counted.items() if "tokens" in c]
    if from_runtime:
        meta["committed_from_runtime_output"] = from_runtime
    if assumed:
        by_kind = all(np.array_equal(s.fwd_assumed, s.fwd_kind == KIND["verify"]) for s in sessions if s.fwd_assumed is not None)
        reason = ("speculative (verify) forwards whose acceptance the trace does not carry: committed = 1, "
                  "the minimum, is assumed; S and every per-token figure over them depend on it")
        if any(name in from_runtime for name in assumed):
            reason = ("speculative (verify) forwards whose acceptance the trace does not carry: their session's tokens are "
                      "the runtime output's, shared among them in proportion to their drafts"
                      + ("" if all(name in from_runtime for name in assumed) else
                         "; in sessions without runtime output committed = 1, the minimum, is assumed"))
        info = {"forwards": int(sum(int(s.fwd_assumed.sum()) for s in assumed.values())),
                "tokens": int(sum(int(s.fwd_committed[s.fwd_assumed].sum()) for s in assumed.values())),
                "reason": reason}
        if by_kind:
            info["kinds"] = ["verify"]
        else:
            info["session_forwards"] = {name: np.flatnonzero(s.fwd_assumed).tolist() for name, s in assumed.items()}
        meta["committed_assumed"] = info
    cat = {key: joined(v) for key, v in parts.items() if key not in ("experts", "gates")}
    cat["experts"], cat["gates"] = padded(parts.pop("experts"), k, -1), padded(parts.pop("gates"), k, np.nan)
    del parts
    f, la, po = cat["forward"], cat["layer"], cat["position"]
    df, dl = np.diff(f), np.diff(la.astype(np.int32))
    if ((df < 0) | ((df == 0) & ((dl < 0) | ((dl == 0) & (np.diff(po) <= 0))))).any():
        order = np.lexsort((po, la, f))
        cat = {key: v[order] for key, v in cat.items()}
    del df, dl
    experts = cat["experts"]
    max_id = int(experts.max()) if experts.size else -1
    if n_experts is None:
        n_experts = max_id + 1
    trace = RoutingTrace(
        layers=np.unique(cat["layer"]).astype(np.int16),
        n_experts=int(n_experts),
        top_k=int(k),
        geometry=geometry,
        sessions=names,
        row_forward=cat.pop("forward").astype(np.int32),
        row_layer=cat.pop("layer").astype(np.int16, copy=False),
        row_position=cat.pop("position").astype(np.int32, copy=False),
        experts=cat.pop("experts").astype(np.int16, copy=False),
        gates=cat.pop("gates").astype(np.float32, copy=False),
        fwd_session=np.concatenate(fwd["session"]).astype(np.int32),
        fwd_kind=np.concatenate(fwd["kind"]).astype(np.int8),
        fwd_evaluated=np.concatenate(fwd["evaluated"]).astype(np.int32),
        fwd_committed=np.concatenate(fwd["committed"]).astype(np.int32),
        source=source,
        meta=meta,
    )
    trace.validate()
    return trace


def import_traces(paths: list[Path], fmt: str | None = None, n_experts: int | None = None, geometry: str = "inferred",
                  routed_layers=None, mtp_layers=None, runtime_outputs: list[Path] | None = None,
                  split: str | int | None = None) -> tuple[RoutingTrace, list[str]]:
    """Import ``paths`` (one session each, in order) into one trace.

    Parameters
    ----------
    paths : list of Path
        The input files, all of one format.
    fmt : str, optional
        One of :data:`TRACE_FORMATS`; told from the first file's bytes when None.
    n_experts : int, optional
        A geometry's experts per layer: ids must be below it. Without it the default caps of
        :class:`relayout.traces.sessions.Limits` apply.
    geometry : str
        The geometry's name (recorded in the trace).
    routed_layers, mtp_layers : iterable of int, optional
        The layers ids may come from (else the shipped geometry ``geometry``'s, if one has that
        expert count), and the MTP head's layers.
    runtime_outputs : list of Path, optional
        For ROUTE_TRACE inputs, colibrì's saved output of each input's run, in the same order
        (:mod:`relayout.traces.runtime_output`); each session's counts are made its run's.
    split : "prefill" or int, optional
        For ROUTE_TRACE inputs, ``"prefill"`` makes each prompt of a file a session, an int N a
        session of every N committed tokens (:func:`relayout.traces.route.read_route_sessions`).

    Returns
    -------
    (RoutingTrace, list of str)
        The validated trace and the warnings (torn tails dropped, heat-only input).
    """
    warnings: list[str] = []
    formats = [fmt or sniff_format(p) for p in paths]
    if len(set(formats)) > 1:
        raise InputError(None, f"inputs mix formats ({', '.join(sorted(set(formats)))}); import them separately")
    kind = formats[0]
    source = ",".join(p.name for p in paths)
    limits = Limits.make(n_experts, geometry, routed_layers, mtp_layers)
    runtime = [None] * len(paths)
    if split is not None and kind != "route":
        raise InputError(None, f"splitting into sessions is for ROUTE_TRACE inputs, not {kind}")
    if isinstance(split, int) and split < 1:
        raise InputError(None, f"a session of {split} tokens: give at least 1")
    if runtime_outputs:
        if kind != "route":
            raise InputError(None, f"runtime output is read for ROUTE_TRACE inputs only, not {kind}")
        if len(runtime_outputs) != len(paths):
            raise InputError(None, f"{len(runtime_outputs)} runtime outputs for {len(paths)} inputs: give one per input, in order")
        from relayout.traces.runtime_output import read_runtime_output

        runtime = [read_runtime_output(Path(r)) for r in runtime_outputs]
    if kind == "coli_usage":
        if len(paths) != 1:
            raise InputError(None, ".coli_usage holds totals, not sessions: import one file")
        layers, heat, E = read_coli_usage(paths[0], limits)
        warnings.append(f"{paths[0]}: .coli_usage holds heat only; co-activation, clustering and replay need per-token routing")
        empty = np.zeros(0, np.int32)
        trace = RoutingTrace(
            layers=layers.astype(np.int16), n_experts=E, top_k=0, geometry=geometry, sessions=[paths[0].name],
            row_forward=empty, row_layer=empty.astype(np.int16), row_position=empty,
            experts=np.zeros((0, 0), np.int16), gates=np.zeros((0, 0), np.float32),
            fwd_session=empty, fwd_kind=empty.astype(np.int8), fwd_evaluated=empty, fwd_committed=empty,
            heat_only=True, heat=heat, source=source, meta={"format": kind},
        )
        trace.validate()
        return trace, warnings
    sessions: list[SessionRows] = []
    mblt_experts = 0
    for p, run in zip(paths, runtime):
        if kind == "route":
            sessions.extend(read_route_sessions(p, limits=limits, runtime=run, split=split))
        elif kind == "stall":
            sessions.extend(read_stall_trace(p, limits=limits))
        elif kind == "mblt":
            s, header_e = read_mblt(p, warnings, limits)
            mblt_experts = max(mblt_experts, header_e)
            sessions.append(s)
        else:
            raise InputError(p, f"unknown format {kind!r}")
    if kind == "mblt" and n_experts is None:
        n_experts = mblt_experts
    meta = {"format": kind}
    return assemble(sessions, n_experts, geometry, source, meta), warnings
