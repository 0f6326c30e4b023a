"""The prefetch controller's state and feedback in the compiled model, and what a replay's admission did.

:func:`prefetcher_inputs` builds what the compiled prefetcher reads and keeps (:data:`Prefetcher`:
the prediction source, the controller's :data:`Control`, the sources' :data:`Fusion` and caps);
:func:`load_seconds` estimates an expert's load time; :func:`record_demand` and
:func:`record_outcome` update the controller's running measurements (lambda, rho, the
stall-conversion) from each instance, and :func:`backed_off` applies backoff;
:func:`admission_counts` reduces a replay's step table to what a policy did per committed token.
The admission policies themselves are :mod:`replay.model.admission`. Units: bytes, seconds.
"""

from __future__ import annotations

from collections import namedtuple
from dataclasses import dataclass

import numpy as np
from numba import njit

from containers.errors import InputError
from containers.layout import Layout

from replay.model.config import ADMISSION_POLICIES, MAX_SOURCES, RuntimeConfig
from replay.model.device import copy_seconds
from replay.model.jit import HELPER
from replay.model.pagecache import scales_cached, scales_settled
from replay.model.predictors import CALIBRATION_BINS, FusedModel, SourceModel, prediction_source
from replay.model.state import WARM_BUCKETS

TOP_K, PROBABILITY, PER_BYTE, DEADLINE, STALL_VALUE, ORACLE_POLICY, OBSERVE = (
    ADMISSION_POLICIES.index(x) for x in ("top-k", "probability", "per-byte", "deadline", "stall-value", "oracle", "observe"))

FEEDBACK_WEIGHT = 0.1
"""Weight of a new instance in the controller's running (exponentially weighted) measurements."""

BACKOFF_PROBE = 16
"""With backoff, a layer that stopped prefetching still prefetches once every this many forwards,
so its measured stall-conversion can recover."""

MAX_CANDIDATES = 64
"""The most candidates a policy chooses among (``RuntimeConfig.prefetch_candidates`` is 1-64)."""


Control = namedtuple("Control", "late_frac cost_ratio gain probes cand key need svc order q_pending q_for waited "
                                "pool pool_p svc_min svc_max bytes_min")
"""The controller's state (:func:`new_control`). Per layer [L]: ``late_frac`` (lambda, the running
share of demand misses that made the compute thread wait), ``cost_ratio`` (rho, running stall per
late miss over its estimated load time), ``gain`` (running stall-conversion, s per instance, for
backoff), ``probes`` (instances skipped by backoff); ``svc_min``, ``svc_max`` (s) and
``bytes_min``: the shortest and longest estimated load time of one of the layer's experts, its
scales read or not (:func:`load_seconds`), and the fewest bytes of one, NaN until the layer's
first stall-valued admission (:func:`replay.model.admission._load_range`). Scratch [64] over the candidates: ``cand``,
``key``, ``need`` (estimated need time, s), ``svc`` (estimated load time, s), ``order``. For scoring q (policy
``observe``): ``q_pending`` [E] (q of the layer being predicted), ``q_for`` [1] (its instance, -1
none), ``waited`` [E] (scratch: the miss made the compute thread wait). Scratch [E] over the
experts a policy considers: ``pool`` and their probabilities ``pool_p``."""

Prefetcher = namedtuple("Prefetcher", "source control sources fusion charge")
"""What the compiled prefetcher reads and keeps: ``source``, the
:data:`replay.model.predictors.PredictionSource` the policy reads its probabilities from (with several
sources, the holder of their fused probability); the :data:`Control`; ``sources``, a tuple of
:data:`replay.model.config.MAX_SOURCES` sources, the ones that run first (one source:
``(source, ...)``), the rest empty sources that observe nothing; the :data:`Fusion`; ``charge``:
the same :data:`Fusion` (``charge.charged`` says whether loads are charged to sources: caps, or
several sources). Every configuration passes the compiled loop arguments of one type, so the
loop is compiled once, whatever the prefetch sources and caps."""

Fusion = namedtuple("Fusion", "coef credit caps charged limits tally")
"""Several sources and their caps (module doc). ``coef`` [S + 1]: the fusion's weights
(:class:`replay.model.predictors.FusedModel`; S sources run); ``credit`` [E]: the source each expert
of the layer being predicted is charged to (0 with one source); ``caps`` (bool: the caps apply);
``charged`` (bool: loads are charged to sources, caps or several sources);
``limits`` [4, S] per source: the most loads (floor(c_s Q)) and bytes (c_s B; inf without a
byte budget) it may take per layer, then what the layer being predicted charged it so far
(rows :data:`CAP_SLOTS`, :data:`CAP_BYTES`, :data:`USED_SLOTS`, :data:`USED_BYTES`);
``tally`` [3, S] int64, totals over the replay per source while loads are charged to
sources (caps, or several sources; ``Prefetcher.charge``): candidates a policy chose among
credited to it, loads admitted, candidates skipped by its cap (rows :data:`CREDITED`,
:data:`ADMITTED`, :data:`CAPPED`)."""

CAP_SLOTS, CAP_BYTES, USED_SLOTS, USED_BYTES = range(4)
CREDITED, ADMITTED, CAPPED = range(3)

LoadCosts = namedtuple("LoadCosts", "pages lay pol dev")
"""What an expert's estimated load time depends on (:func:`load_seconds`, :func:`scales_in_cache`):
the scale reads' page cache (:class:`replay.model.pagecache.PageCache`), the
:class:`replay.model.state.LayoutArrays`, the :class:`replay.model.state.ReadPolicy` and the
:class:`replay.model.state.Device`."""


def prefetcher_inputs(config: RuntimeConfig, layout: Layout, learned) -> Prefetcher:
    """The :data:`Prefetcher` of a replay under ``config``: ``learned`` is the source learned on
    training sessions (a :class:`replay.model.predictors.SourceModel`; for several sources, their
    :class:`replay.model.predictors.FusedModel`), or, for ``coupled`` under ``top-k`` and for
    ``pilot`` with COUPLE (``config.couple_file``), its ``(targets, counts)`` pair table, or None
    for ``none``, ``oracle`` and ``pilot`` alone."""
    L, E = len(layout.layers), layout.n_experts
    kind = config.prefetch
    names = config.sources
    if len(names) > 1:
        if not isinstance(learned, FusedModel):
            raise InputError(None, f"the prefetch sources {kind!r} need their fused probability learned from training "
                                   f"sessions (replay.control.sources.learn_fused)")
        if learned.names != names:
            raise InputError(None, f"the learned sources are {learned.name!r}, the configuration asks for {kind!r}")
        sources = _padded([prediction_source(m, layout) for m in learned.sources], layout)
        holder = prediction_source(None, layout, "fused")
        fusion = new_fusion(config, E, learned.coef, charged=True)
        return Prefetcher(source=holder, control=new_control(L, E), sources=sources, fusion=fusion, charge=fusion)
    if kind == "pilot" and config.couple_file:   # COUPLE's table, as colibrì read it from its file
        if not isinstance(learned, tuple):
            raise InputError(config.couple_file, "COUPLE's pair table is not given: read it with "
                                                 "replay.formats.colipairs.read_coli_pairs and pass it as the coupling")
        targets, counts = learned
        model = SourceModel(name="pilot", targets=np.asarray(targets), counts=np.asarray(counts),
                            selections=np.zeros((L, E)), heat=np.zeros((L, E)), calib=np.zeros((L, CALIBRATION_BINS)))
    elif kind in ("none", "oracle", "pilot"):     # they learn nothing: whatever was learned is not theirs
        model = None
    elif isinstance(learned, SourceModel):
        if learned.name != kind:
            raise InputError(None, f"the learned source is {learned.name!r}, the configuration asks for {kind!r}")
        model = learned
    elif kind == "coupled" and learned is not None and config.admission == "top-k":
        targets, counts = learned
        model = SourceModel(name="coupled", targets=np.asarray(targets), counts=np.asarray(counts),
                            selections=np.zeros((L, E)), heat=np.zeros((L, E)), calib=np.zeros((L, CALIBRATION_BINS)))
    elif kind == "coupled" and learned is None:
        raise InputError(None, "the coupled prefetch source needs a coupling table learned from training sessions")
    else:
        raise InputError(None, f"the {kind} prefetch source under admission {config.admission!r} needs its probabilities "
                               f"learned from training sessions (replay.control.sources.learn_source)")
    source = prediction_source(model, layout, kind)
    fusion = new_fusion(config, E, np.array([0.0, 1.0]), charged=bool(config.source_caps))
    return Prefetcher(source=source, control=new_control(L, E), sources=_padded([source], layout), fusion=fusion,
                      charge=fusion)


def _padded(sources: list, layout: Layout) -> tuple:
    """``sources`` followed by empty sources (which observe nothing) up to :data:`MAX_SOURCES`."""
    return tuple(sources + [prediction_source(None, layout, "none") for _ in range(MAX_SOURCES - len(sources))])


def new_fusion(config: RuntimeConfig, E: int, coef: np.ndarray, charged: bool) -> Fusion:
    """A fresh :data:`Fusion` for ``config``'s sources (weights ``coef``) and caps; ``charged``:
    loads are charged to sources."""
    S = max(len(config.sources), 1)
    shares = np.asarray(config.source_caps or (1.0,) * S, dtype=np.float64)
    slots = np.floor(shares * config.prefetch_experts + 1e-9).astype(np.int64)
    nbytes = shares * config.prefetch_bytes if config.prefetch_bytes > 0 else np.full(S, np.inf)
    return Fusion(coef=np.ascontiguousarray(coef, dtype=np.float64), credit=np.zeros(E, dtype=np.int64),
                  caps=bool(config.source_caps), charged=bool(charged),
                  limits=np.stack([slots.astype(np.float64), nbytes, np.zeros(S), np.zeros(S)]),
                  tally=np.zeros((3, S), dtype=np.int64))


def new_control(L: int, E: int) -> Control:
    """A fresh controller for ``L`` layers of ``E`` experts: lambda = rho = 1 (every miss is
    assumed late and to cost its load time until measured), gain slightly positive."""
    C = MAX_CANDIDATES
    return Control(late_frac=np.ones(L), cost_ratio=np.ones(L), gain=np.full(L, 1e-9), probes=np.zeros(L, dtype=np.int64),
                   cand=np.empty(C, dtype=np.int64), key=np.empty(C), need=np.empty(C), svc=np.empty(C),
                   order=np.empty(C, dtype=np.int64), q_pending=np.zeros(E), q_for=np.full(1, -1, dtype=np.int64),
                   waited=np.zeros(E, dtype=np.bool_), pool=np.empty(E, dtype=np.int64), pool_p=np.empty(E),
                   svc_min=np.full(L, np.nan), svc_max=np.full(L, np.nan), bytes_min=np.full(L, np.nan))


@njit(**HELPER)
def scales_in_cache(pc, nl, e, lay):
    """The page cache ``pc`` holds every scale page of expert ``e`` of layer ``nl``."""
    return scales_settled(pc, nl, e) or scales_cached(pc, lay.sloc[nl, e])


@njit(**HELPER)
def load_seconds(nl, e, first, lay, pol, dev):
    """Estimated time (s) to load expert ``e`` of layer ``nl`` alone: its weight bytes (the bottom
    segment when its top is resident) from the drives, or from the page cache when its first
    weight page is warm, plus its scales (three requests when the page cache does not hold all
    of them, ``first``: :func:`replay.model.pagecache.scales_cached`; page-cache time otherwise).
    What the page cache serves is copied at the device's copy rate for where it starts
    (:func:`replay.model.device.copy_seconds`). Each request costs its command and its channel
    time, ``a + c``, beside its bytes at the array's rate."""
    wb = lay.wbytes[nl, e] * (1.0 - lay.top_fraction[nl] if lay.top_resident[nl, e] else 1.0)
    sb = lay.ebytes[nl, e] - lay.wbytes[nl, e]
    rate = min(dev.full_bandwidth, dev.members * dev.stream_bandwidth)
    a = dev.request_seconds + dev.request_channel
    warm = False
    off = lay.pos_off[nl, e]
    if pol.warm_fraction > 0:
        f = lay.pos_file[nl, e]
        if pol.direct:
            off = (lay.bases[f] + off) // pol.alignment * pol.alignment - lay.bases[f]
        warm = (f * 1_000_003 + off // 4096) % WARM_BUCKETS < pol.warm_fraction * WARM_BUCKETS
    s = copy_seconds(wb, off, dev) if warm else a + wb / rate
    if first:
        s += 3 * a + sb / rate
    else:
        s += copy_seconds(sb, lay.sloc[nl, e, 0, 1], dev)
    return s


@njit(**HELPER)
def backed_off(nl, pol, ctl):
    """With backoff, layer ``nl`` skips this prefetch (its stall-conversion is not positive and
    this is not a probe)."""
    if not pol.backoff or ctl.gain[nl] > 0:
        return False
    ctl.probes[nl] += 1
    return ctl.probes[nl] % BACKOFF_PROBE != 0


@njit(**HELPER)
def record_demand(li, late, misses, wait, load_time, ctl):
    """Instance of layer ``li`` had ``misses`` demand misses, ``late`` of them made the compute
    thread wait, ``wait`` s in all, over ``load_time`` s of their estimated load times: update
    lambda and rho."""
    if misses > 0:
        ctl.late_frac[li] += FEEDBACK_WEIGHT * (late / misses - ctl.late_frac[li])
    if late > 0 and load_time > 0:
        ctl.cost_ratio[li] += FEEDBACK_WEIGHT * (wait / load_time - ctl.cost_ratio[li])


@njit(**HELPER)
def record_outcome(li, saved, wasted, ctl):
    """The prefetches made for an instance of layer ``li``: ``saved`` (s, the estimated stall the
    timely used ones removed: rho x their load times) and ``wasted`` (s, drive time unused loads
    still held when the layer was routed). Their difference is the instance's measured
    stall-conversion, whose running mean decides backoff."""
    ctl.gain[li] += FEEDBACK_WEIGHT * ((saved - wasted) - ctl.gain[li])


@dataclass(frozen=True)
class AdmissionCounts:
    """What a policy did, per committed token (:func:`admission_counts`): ``loads`` (prefetch
    loads completed or in flight at routing), ``rejected`` (candidates not admitted, those a
    per-source cap skipped apart), ``capped`` (candidates skipped by a per-source cap),
    ``cancelled`` (admitted loads dropped or cut), ``speculative_bytes`` (bytes the prefetcher
    read, cut loads' reads included) and ``unused_bytes`` (of those loaded, bytes the layer did
    not select); ``cancellation_rate``: cancelled over admitted (loads + cancelled), None when
    nothing was admitted."""

    loads: float
    rejected: float
    capped: float
    cancelled: float
    speculative_bytes: float
    unused_bytes: float
    cancellation_rate: float | None


def admission_counts(steps) -> AdmissionCounts | None:
    """The :class:`AdmissionCounts` of a replay's step table (:class:`replay.model.metrics.StepTable`);
    None when no source ran."""
    p = steps.prefetch
    if p is None:
        return None
    tokens = max(float(steps.committed.sum()), 1e-12)
    loads, cancelled = float(p["loads"].sum()), float(p["cancelled"].sum())
    return AdmissionCounts(loads / tokens, float(p["rejected"].sum()) / tokens, float(p["capped"].sum()) / tokens,
                           cancelled / tokens,
                           float(p["issued"].sum()) / tokens, float(p["unused"].sum()) / tokens,
                           cancelled / (loads + cancelled) if loads + cancelled else None)

