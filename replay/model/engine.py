"""The timing model's Python driver: a replay of routing through a layout on a device, and its results.

:class:`Replay` holds what the compiled loop (:mod:`replay.model.instance`) carries from chunk to
chunk and feeds it consecutive chunks of whole forwards; :func:`simulate` replays a trace with
results per instance; :func:`layout_arrays`, :func:`read_policy` and :func:`device_numbers` turn a
layout, a configuration and a device into the compiled model's inputs; the result dataclasses
declare every output once (:func:`output`). docs/MODEL.md ("The timing model") specifies the
model. Units: bytes, seconds, bytes/s.
"""

from __future__ import annotations

from collections import namedtuple
from dataclasses import dataclass, field, fields

import numpy as np

from containers.layout import SCALE_SLOTS, WEIGHT_SLOTS, Layout

from replay.model.config import ADMISSION_POLICIES, RuntimeConfig, lru_capacities, source_index
from replay.model.controller import prefetcher_inputs
from replay.model.device import SPLIT_RULES, ArrayProfile
from replay.model.instance import simulate_instances
from replay.model.jit import compile_notice
from replay.model.pagecache import PageCache, new_page_cache
from replay.model.predictors import RELIABILITY_BINS
from replay.model.runtime import new_heat, new_lru
from replay.model.state import PREFETCH_SLOTS, Device, LayoutArrays, RamTiers, ReadPolicy, new_work
from replay.model.storage import StorageProfile
from replay.model.routing import RoutingTrace
from replay.model.unions import (
    DEFAULT_CHUNK_FORWARDS,
    Instances,
    chunk_instances,
    whole_forward_blocks,
)

UNDO_READS = PREFETCH_SLOTS * 6
"""Preads one undo-logged stretch of the page cache may hold: the prefetch thread's loads
queued at one routing, at most three weight and three scale preads each (:func:`replay.model.readplan.plan_layer`;
:func:`replay.model.pagecache.new_page_cache`)."""

FILE_ALIGNMENT = 1 << 20
"""Files are assumed to start at 1 MiB boundaries of the array's address space, in file order."""

AXES = {"I": "instances", "L": "layout layers", "E": "experts", "M": "array members",
        "R": "reliability bins (replay.model.predictors.RELIABILITY_BINS)", "A": "the array as a whole (one value)"}
"""The axes an output's shape is written in (see :func:`output`)."""


def output(shape: str, dtype: type = np.float64):
    """Declare a field of a result dataclass as an output of the compiled model.

    ``shape`` spells its axes (:data:`AXES`: ``"I"`` per instance, ``"LE"`` per layout layer and
    expert, ``"M"`` per array member), ``dtype`` its element type. :func:`new_results` allocates
    it zeroed, :func:`replay.model.instance.simulate_instances` fills it in place under the same name
    (``out.instance.<name>``, ``out.prefetch.<name>``, ``out.device.<name>``), and
    :func:`simulate` hands it over under that name: a new metric is one such field plus the
    line of the compiled model that fills it.
    """
    return field(metadata={"shape": shape, "dtype": np.dtype(dtype)})


@dataclass
class PrefetchResult:
    """Per instance [I], when a prefetch source runs. Bytes and seconds.

    ``loads``, ``issued``: experts and bytes the prefetcher loaded while the instance ran (for the
    next layer).
    ``required``: bytes of the instance's experts not already in RAM (misses and prefetched ones).
    ``timely``: of those, the bytes ready before the compute thread needed them (a
    prefetch, or a demand load that finished early), as the STALL_TRACE analysis counts them.
    ``timely_n``, ``slack``: the timely prefetches and the sum of their lead slack (s).
    ``unused``: bytes prefetched for this layer that it did not select.
    ``rejected``, ``capped``, ``cancelled``, ``demand_done``, ``barrier`` and the late-need reliability
    sums (``late_*``, [R], totals over the replay): see the fields and :mod:`replay.model.admission`.
    """

    loads: np.ndarray = output("I", np.int64)
    issued: np.ndarray = output("I")           # bytes
    required: np.ndarray = output("I")         # bytes
    timely: np.ndarray = output("I")           # bytes
    timely_n: np.ndarray = output("I", np.int64)
    slack: np.ndarray = output("I")            # s
    unused: np.ndarray = output("I")           # bytes
    rejected: np.ndarray = output("I", np.int64)   # candidates the admission policy did not admit (replay.model.admission), capped ones apart
    capped: np.ndarray = output("I", np.int64)     # candidates a per-source cap skipped (replay.model.admission)
    cancelled: np.ndarray = output("I", np.int64)  # admitted loads dropped (not started by the routing) or cut (cancel_stale)
    demand_done: np.ndarray = output("I")      # s after routing, when the instance's last demand load completed
    barrier: np.ndarray = output("I")          # s the layer waited, whole, for the prefetch loads in flight on it (layer_barrier: other time, not stall)
    late_n: np.ndarray = output("R")           # policy observe: candidates per late-need probability bin
    late_p: np.ndarray = output("R")           # their summed q
    late_y: np.ndarray = output("R")           # of them, needed and not otherwise ready in time
    late_sq: np.ndarray = output("R")          # their summed (q - outcome)^2


@dataclass
class InstanceResult:
    """Per (forward, layer) instance, arrays [I]. Seconds and bytes."""

    forward: np.ndarray        # the instance's forward (index into the trace's forwards)
    layer: np.ndarray          # layout layer index
    stall: np.ndarray = output("I")            # s the compute thread waited for expert bytes
    compute: np.ndarray = output("I")          # s, dense + matmuls of all positions
    oracle_stall: np.ndarray = output("I")     # s, the same wait with bytes at full bandwidth, no request cost
    union_experts: np.ndarray = output("I", np.int64)   # distinct experts the positions select
    union_bytes: np.ndarray = output("I")      # bytes of those experts (weights and scales)
    hits: np.ndarray = output("I", np.int64)   # union experts served from RAM
    misses: np.ndarray = output("I", np.int64)  # union experts loaded (or waited for in flight)
    reads: np.ndarray = output("I", np.int64)  # preads issued, prefetch included
    drive_reads: np.ndarray = output("I", np.int64)  # demand preads that reach the drives (not the page cache)
    read_bytes: np.ndarray = output("I")       # bytes read (O_DIRECT-widened), prefetch included
    expert_wait: np.ndarray = output("LE")     # [L, E] s the compute thread waited right before each expert's matmul
    prefetch: "PrefetchResult | None" = None


@dataclass
class DeviceUsage:
    """Totals over the whole replay, per member [M]: busy transfer seconds, requests, residence
    seconds; and [A] ``busy_seconds``, the time the array had at least one drive read outstanding
    (s), as a measured run's drive time is read off its STALL_TRACE (:mod:`relayout.workflows.validation`)."""

    transfer_seconds: np.ndarray = output("M")
    requests: np.ndarray = output("M", np.int64)
    residence_seconds: np.ndarray = output("M")
    busy_seconds: np.ndarray = output("A")


def _outputs(cls) -> list:
    return [f for f in fields(cls) if "shape" in f.metadata]


InstanceOutputs = namedtuple("InstanceOutputs", [f.name for f in _outputs(InstanceResult)])
"""The :class:`InstanceResult` outputs the compiled model fills (declared there with :func:`output`)."""
PrefetchOutputs = namedtuple("PrefetchOutputs", [f.name for f in _outputs(PrefetchResult)])
"""The :class:`PrefetchResult` outputs (filled whatever the source; handed over when one runs)."""
DeviceOutputs = namedtuple("DeviceOutputs", [f.name for f in _outputs(DeviceUsage)])
"""The :class:`DeviceUsage` outputs."""
Results = namedtuple("Results", "instance prefetch device")
"""Every output of one replay, zeroed by :func:`new_results` and filled in place by
:func:`replay.model.instance.simulate_instances`: :class:`InstanceOutputs`, :class:`PrefetchOutputs`,
:class:`DeviceOutputs`."""


def new_results(I: int, L: int, E: int, M: int, keep: Results | None = None) -> Results:
    """Zeroed outputs for ``I`` instances, ``L`` layout layers of ``E`` experts and ``M`` members,
    each shaped and typed as its result field declares. With ``keep`` (an earlier chunk's
    results), the outputs not per instance (no ``"I"`` axis: totals over the replay) are
    ``keep``'s arrays, so they go on accumulating."""
    sizes = dict(zip(AXES, (I, L, E, M, RELIABILITY_BINS, 1)))

    def zeros(kind, cls, kept):
        return kind(*(getattr(kept, f.name) if kept is not None and "I" not in f.metadata["shape"] else
                      np.zeros(tuple(sizes[a] for a in f.metadata["shape"]), dtype=f.metadata["dtype"])
                      for f in _outputs(cls)))

    k = keep if keep is not None else Results(None, None, None)
    return Results(zeros(InstanceOutputs, InstanceResult, k.instance), zeros(PrefetchOutputs, PrefetchResult, k.prefetch),
                   zeros(DeviceOutputs, DeviceUsage, k.device))


def file_bases(layout: Layout) -> np.ndarray:
    sizes = -(-np.asarray(layout.file_sizes, dtype=np.int64) // FILE_ALIGNMENT) * FILE_ALIGNMENT
    return np.concatenate([[0], np.cumsum(sizes)[:-1]])


@dataclass
class SplitState:
    """Per layout layer: resident-top mask [L, E] and the top segment's share of the FFN [L].

    A missing expert with a resident top reads the rest of its weights and scales (the bottom
    segment, modelled as one read at the expert's place) and computes its top part at once.
    """

    resident: np.ndarray
    top_fraction: np.ndarray


def split_state(split: dict | None, layout: Layout, ffn: int) -> SplitState | None:
    if not split:
        return None
    L, E = len(layout.layers), layout.n_experts
    resident = np.zeros((L, E), dtype=bool)
    frac = np.zeros(L)
    for li, layer in enumerate(layout.layers):
        resident[li, split["resident"][str(layer)]] = True
        frac[li] = split["segments"][str(layer)]["top_rows"] / ffn
    return SplitState(resident, frac)


class Replay:
    """One replay of ``layout`` on ``device`` under ``config``, fed consecutive chunks of instances.

    Holds what the model carries from instance to instance, and so from chunk to chunk: the RAM
    tiers (pinned store, per-layer LRUs, the page cache under the scale reads), the drives' state and
    the pending prefetches (:func:`replay.model.state.new_work`), and the totals over the replay
    (outputs without an ``"I"`` axis: ``expert_wait`` [L, E], the device usage [M]). Chunks must
    hold whole forwards, in time order (:func:`replay.model.unions.chunk_instances`); the replay is
    then the same, to the bit, whatever the chunks. Memory: the layout's [L, E] arrays and one
    chunk's instances and outputs.

    ``coupling`` is the prediction source learned from training sessions: a
    :class:`replay.model.predictors.SourceModel` (:func:`replay.control.sources.learn_source`), needed by
    every source but ``none`` and ``oracle`` under an admission policy other than ``top-k``; or,
    for ``coupled`` under ``top-k`` (the runtime's rule), just its ``(targets, counts)`` table
    (:func:`replay.model.coupling.coupling_table`).
    """

    def __init__(self, layout: Layout, device: ArrayProfile, config: RuntimeConfig, pinned: np.ndarray | None = None,
                 split: SplitState | None = None, coupling: tuple | None = None):
        L, E = len(layout.layers), layout.n_experts
        self.config = config
        self.lay = layout_arrays(layout, config, split)
        self.ram = RamTiers(
            pinned=np.asarray(pinned if pinned is not None else np.zeros((L, E)), dtype=bool),
            lru=new_lru(lru_capacities(config.ram_bytes, layout.expert_bytes()[:, 0], config.lru_experts), E),
            pages=page_cache(self.lay, layout, device, config),
            heat=new_heat(L, E))
        self.table = prefetcher_inputs(config, layout, coupling)
        self.pol = read_policy(config, device)
        self.dev = device_numbers(device, layout)
        # a batch union holds at most E experts: working arrays for that serve every chunk
        self.work = new_work(max(E, 1), E, self.pol.workers, self.dev.members, self.dev.queue_slots, config.copy_slots,
                             config.pilot_workers)
        self.totals = new_results(0, L, E, device.members)

    def run(self, inst: Instances) -> Results:
        """Replay one chunk (the forwards after the previous chunk's); returns its outputs (per
        instance [I] of the chunk; the totals are the replay's so far)."""
        L, E = self.lay.rank.shape
        out = new_results(len(inst.forward), L, E, self.dev.members, keep=self.totals)
        with compile_notice():
            simulate_instances(inst, self.ram, self.table, self.lay, self.pol, self.dev, self.work, out)
        return out

    @property
    def expert_wait(self) -> np.ndarray:
        """[L, E] s the compute thread waited right before each expert's matmul, so far."""
        return self.totals.instance.expert_wait

    def usage(self) -> DeviceUsage:
        """The device totals so far."""
        return DeviceUsage(**self.totals.device._asdict())


def simulate(
    trace: RoutingTrace,
    forwards: np.ndarray,
    layout: Layout,
    device: ArrayProfile,
    config: RuntimeConfig,
    pinned: np.ndarray | None = None,
    split: SplitState | None = None,
    coupling: np.ndarray | None = None,
    *,
    chunk_forwards: int = DEFAULT_CHUNK_FORWARDS,
) -> tuple[InstanceResult, DeviceUsage]:
    """Replay the forwards selected by mask ``forwards`` [F] through ``layout`` on ``device``,
    with results per instance (memory grows with the instances; :func:`replay.model.streaming.replay_steps`
    keeps per-step sums only).

    Parameters
    ----------
    trace : RoutingTrace
        The routing trace.
    forwards : bool array [F]
        The forwards to replay.
    layout, device, config : Layout, ArrayProfile, RuntimeConfig
        Where the experts are, what reads them, how the runtime reads.
    pinned : bool array [L, E], optional
        The pinned store.
    split : SplitState, optional
        Resident top segments of a split plan.
    coupling : optional
        The learned prediction source (see :class:`Replay`).
    chunk_forwards : int, keyword-only
        Forwards replayed per call of the compiled loop (the results do not depend on it).

    Returns
    -------
    (InstanceResult, DeviceUsage)
        Per (forward, layer) instance, and the device's totals.
    """
    replay = Replay(layout, device, config, pinned, split, coupling)
    parts = [(inst.forward, inst.layer, replay.run(inst))
             for inst in chunk_instances(whole_forward_blocks(trace, chunk_forwards), forwards, trace.fwd_session, layout)]
    if not parts:
        empty = np.zeros(0, dtype=np.int32)
        parts = [(empty, empty, new_results(0, len(layout.layers), layout.n_experts, device.members, keep=replay.totals))]

    def joined(group: str, cls) -> dict:
        return {f.name: np.concatenate([getattr(getattr(p[2], group), f.name) for p in parts])
                if "I" in f.metadata["shape"] else getattr(getattr(replay.totals, group), f.name) for f in _outputs(cls)}

    prefetch = PrefetchResult(**joined("prefetch", PrefetchResult)) if config.prefetch != "none" else None
    return (InstanceResult(np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]),
                           **joined("instance", InstanceResult), prefetch=prefetch),
            replay.usage())


def page_cache(lay: LayoutArrays, layout: Layout, device: ArrayProfile, config: RuntimeConfig) -> PageCache:
    """The page cache a replay starts each session with (:func:`replay.model.pagecache.new_page_cache`):
    it tracks the experts' scale pages and, when the run reads weights through the page cache
    (buffered, or as COLI_MMAP's mapped views) and gives it memory (``config.page_cache_bytes``),
    their weight pages too, weights and scales then sharing that budget (not for a profile that
    declares a share of weight reads warm, ``page_cache_fraction``: that share stands for it)."""
    weights = (config.mapped_views or not config.direct) and config.page_cache_bytes > 0 and not device.page_cache_fraction
    return new_page_cache(lay.sloc, layout.file_sizes, device.read_ahead_bytes, UNDO_READS,
                          device.readahead_request, wloc=lay.wloc if weights else None,
                          budget_bytes=config.page_cache_bytes if weights else -1, mapped=config.mapped_views)


def layout_arrays(layout: Layout, config: RuntimeConfig, split: SplitState | None) -> LayoutArrays:
    """The per (layer, expert) arrays of a layout that the timing model looks up."""
    L, E = len(layout.layers), layout.n_experts
    wloc = np.ascontiguousarray(layout.expert_loc[:, :, list(WEIGHT_SLOTS)], dtype=np.int64)   # [L, E, 3, 3]
    first_w = np.argmin(wloc[:, :, :, 1] + wloc[:, :, :, 0] * (1 << 44), axis=2)
    pos_file = np.take_along_axis(wloc[:, :, :, 0], first_w[..., None], axis=2)[..., 0]
    pos_off = np.take_along_axis(wloc[:, :, :, 1], first_w[..., None], axis=2)[..., 0]
    # each expert's place in its layer's physical order (file, then offset): the issue order
    rank = np.empty((L, E), dtype=np.int64)
    for li in range(L):
        rank[li, np.lexsort((pos_off[li], pos_file[li]))] = np.arange(E)
    wbytes = wloc[:, :, :, 2].sum(axis=2)
    return LayoutArrays(
        rank=rank, adjacent=_adjacent(wloc), pos_file=pos_file, pos_off=pos_off, wbytes=wbytes,
        ebytes=layout.expert_bytes().astype(np.int64), seconds=wbytes / float(config.compute_bytes_per_second),
        top_resident=split.resident.astype(bool) if split is not None else np.zeros((L, E), dtype=bool),
        top_fraction=np.asarray(split.top_fraction if split is not None else np.zeros(L), dtype=np.float64),
        wloc=wloc, sloc=np.ascontiguousarray(layout.expert_loc[:, :, list(SCALE_SLOTS)], dtype=np.int64),
        bases=file_bases(layout))


def read_policy(config: RuntimeConfig, device: ArrayProfile) -> ReadPolicy:
    """How the runtime reads, as the compiled model takes it."""
    return ReadPolicy(coalesce=bool(config.coalesce), gap_bytes=int(config.coalesce_gap_bytes),
                      span_bytes=int(config.coalesce_max_bytes), direct=bool(config.direct),
                      alignment=int(device.direct_alignment), workers=int(config.in_flight),
                      warm_fraction=float(device.page_cache_fraction), dense_seconds=float(config.dense_seconds),
                      prefetch=source_index(config.prefetch), prefetch_experts=int(config.prefetch_experts),
                      admission=ADMISSION_POLICIES.index(config.admission), prefetch_bytes=int(config.prefetch_bytes),
                      candidates=int(config.prefetch_candidates), min_probability=float(config.prefetch_min_probability),
                      cancel_stale=bool(config.cancel_stale), adaptive_budget=bool(config.adaptive_budget),
                      backoff=bool(config.backoff), blocking=bool(config.blocking), routing_order=bool(config.routing_order),
                      team_held_cores=int(config.team_held_cores), handoff=_handoff_seconds(config, device),
                      copy_cores=int(config.copy_cores), pilot_precision=float(config.pilot_precision),
                      couple_experts=int(config.couple_experts),
                      evict_guard=bool(config.evict_guard), prefetch_hints=bool(config.prefetch_hints),
                      layer_barrier=bool(config.layer_barrier), short_forwards=bool(config.engine_env))


def _handoff_seconds(config: RuntimeConfig, device: ArrayProfile) -> float:
    """What handing each block of demand loads to the loader pool costs (s): the device profile's
    measured handoff for ``config.workers`` loaders when they are parked on the compute thread's
    core (``RuntimeConfig.loaders_on_compute_core``), else 0."""
    if not config.loaders_on_compute_core or device.loader_handoff is None:
        return 0.0
    return device.loader_handoff.for_pool(config.workers)


def device_numbers(device: ArrayProfile, layout: Layout | None = None) -> Device:
    """The device as the compiled model takes it; independent drives
    (:class:`replay.model.storage.StorageProfile`) with their address map for ``layout``."""
    d = device.drive
    M = int(device.members)
    if isinstance(device, StorageProfile):
        drives = [p.drive for p in device.drives]
        per = [np.array(x, dtype=np.float64) for x in zip(*((p.request_seconds, p.bandwidth, p.request_bandwidth,
                                                               p.request_channel_seconds) for p in drives))]
        seg_start, seg_drive = device.address_map(layout, file_bases(layout))
    else:
        per = [np.full(M, float(x)) for x in (d.request_seconds, d.bandwidth, d.request_bandwidth, d.request_channel_seconds)]
        seg_start, seg_drive = np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    return Device(members=M, chunk=int(device.chunk_bytes), rule=SPLIT_RULES.index(device.split_rule),
                  request_seconds=float(d.request_seconds), bandwidth=float(d.bandwidth), queue_slots=int(d.queue_slots),
                  host_bandwidth=float(device.host_bandwidth), full_bandwidth=float(device.full_bandwidth),
                  stream_bandwidth=float(d.request_bandwidth), max_request=int(d.max_request),
                  shared=d.service == "shared", request_channel=float(d.request_channel_seconds),
                  m_request=per[0], m_bandwidth=per[1], m_stream=per[2], m_channel=per[3],
                  seg_start=seg_start, seg_drive=seg_drive, memory_bandwidth=float(device.memory_bandwidth),
                  unaligned_memory_bandwidth=device.unaligned_copy_rate)


def _adjacent(wloc: np.ndarray) -> np.ndarray:
    """[L, E]: the three weight tensors are byte-adjacent in one file."""
    order = np.argsort(wloc[:, :, :, 1], axis=2)
    s = np.take_along_axis(wloc, order[..., None], axis=2)
    same_file = (s[:, :, 0, 0] == s[:, :, 1, 0]) & (s[:, :, 1, 0] == s[:, :, 2, 0])
    touching = (s[:, :, 0, 1] + s[:, :, 0, 2] == s[:, :, 1, 1]) & (s[:, :, 1, 1] + s[:, :, 1, 2] == s[:, :, 2, 1])
    return same_file & touching
