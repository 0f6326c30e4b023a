"""The timing model: replays routing through a layout on a device and measures stall.

**Instances.** A (forward, layer) *instance* starts when the layer is routed. With demand loads
only (colibrì's default) a layer cannot finish before every expert it needs has arrived, so when
it ends the drives are idle and each instance is a small queueing problem of its own. The
compiled loop in :mod:`replay.instance` walks the instances in time order and keeps the state
that does carry over: the RAM tiers (pinned store, per-layer LRU, :mod:`replay.runtime`), which
scale pages the OS already caches, and, with a prefetch source, the drives.

**One instance.** Time 0 is when routing is known. Every missing expert becomes a *job* for the
reader pool (with ``coalesce``, experts contiguous in one file share a job): its weight read(s)
(one pread when the three weight tensors are byte-adjacent, three when not; O_DIRECT widens them
to 4 KiB) and its three buffered scale preads, executed in order by one worker. Workers take jobs
in issue order (physical order); at each step the worker that is free earliest performs its next
read, so reads reach the drives in time order. A read is split over the array's members
(:func:`replay.device.split_read`); a member overlaps the per-request cost of up to
``queue_slots`` requests but transfers large reads one at a time; small reads (up to
``SMALL_READ_BYTES``) queue among themselves beside the large ones and delay them by their own
transfer time; the host link caps the aggregate rate the same way.

The compute thread first runs the resident experts' matmuls, then, in issue order, waits for
each missing expert and runs its matmul. Stall is the time it waits, measured on that critical
path, never summed per expert. With a split plan, a missing expert whose top segment is resident
runs its top part at once and waits only for its bottom segment.

**Prefetch** (``config.prefetch``, sources in :mod:`replay.prefetch`). When layer L is routed,
the prefetcher predicts up to K experts of layer L+1 and, once L's demand loads are done
(demand reads before prefetch), loads those not in RAM one at a time on its own thread, until
L+1 is routed: L+1 is routed when L's compute ends plus the dense time. A load not started by
then is dropped, one in flight completes, and its drive time delays L+1's demand reads. Loads
that completed enter L+1's LRU (or, with no cache, wait for L+1 alone); an expert still in
flight makes L+1's compute thread wait for it instead of reading it again. A wrong prediction
costs drive time and, with a cache, an LRU slot.

The **oracle** replaces the drives by a stream at the array's full bandwidth with no per-request
cost: the lower bound on stall that no layout can beat (for the misses left after prefetch).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from containers.errors import InputError
from containers.layout import SCALE_SLOTS, WEIGHT_SLOTS, Layout

from .config import PREFETCH_SOURCES, RuntimeConfig, lru_capacities
from .device import SPLIT_RULES, ArrayProfile
from .instance import Array, LayoutArrays, ReadPolicy, Results, simulate_instances
from .jit import compile_notice
from .runtime import new_lru
from .trace import RoutingTrace
from .unions import trace_instances

FILE_ALIGNMENT = 1 << 20
"""Files are assumed to start at 1 MiB boundaries of the array's address space, in file order."""


@dataclass
class InstanceResult:
    """Per (forward, layer) instance, arrays [I]."""

    forward: np.ndarray
    layer: np.ndarray          # layout layer index
    stall: np.ndarray          # s
    compute: np.ndarray        # s, dense + matmuls
    oracle_stall: np.ndarray   # s
    union_experts: np.ndarray
    union_bytes: np.ndarray
    hits: np.ndarray
    misses: np.ndarray
    reads: np.ndarray
    read_bytes: np.ndarray
    expert_wait: np.ndarray    # [L, E] s the compute thread waited right before each expert's matmul
    prefetch: "PrefetchResult | None" = None


@dataclass
class PrefetchResult:
    """Per instance [I], when a prefetch source runs. Bytes and seconds.

    ``loads``, ``issued``: experts and bytes the prefetcher loaded while the instance ran (for the
    next layer).
    ``required``: bytes of the instance's experts not already in RAM (misses and prefetched ones).
    ``timely``: of those, the bytes ready before the compute thread needed them (seed 4.3: a
    prefetch, or a demand load that finished early), as the STALL_TRACE analysis counts them.
    ``timely_n``, ``slack``: the timely prefetches and the sum of their lead slack.
    ``unused``: bytes prefetched for this layer that it did not select.
    """

    loads: np.ndarray
    issued: np.ndarray
    required: np.ndarray
    timely: np.ndarray
    timely_n: np.ndarray
    slack: np.ndarray
    unused: np.ndarray


@dataclass
class DeviceUsage:
    """Totals over the whole replay, per member: busy transfer seconds, requests, residence seconds."""

    transfer_seconds: np.ndarray
    requests: np.ndarray
    residence_seconds: np.ndarray


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


def simulate(
    trace: RoutingTrace,
    forwards: np.ndarray,
    layout: Layout,
    device: ArrayProfile,
    config: RuntimeConfig,
    pinned: np.ndarray | None = None,
    split: SplitState | None = None,
    coupling: np.ndarray | None = None,
) -> tuple[InstanceResult, DeviceUsage]:
    """Replay the forwards selected by mask ``forwards`` [F] through ``layout`` on ``device``.

    ``coupling`` is the coupled prefetch source's ``(targets, counts)`` table
    (:func:`replay.prefetch.coupling_table`, learned from training sessions), needed when
    ``config.prefetch == "coupled"``.
    """
    L, E = len(layout.layers), layout.n_experts
    inst = trace_instances(trace, forwards, layout)
    I = len(inst)
    if config.prefetch == "coupled" and coupling is None:
        raise InputError(None, "the coupled prefetch source needs a coupling table learned from training sessions")
    targets, counts = coupling if config.prefetch == "coupled" else (np.full((1, 1, 1), -1), np.zeros((1, 1, 1)))
    out = _zero_results(I, L, E, device.members)
    with compile_notice():
        simulate_instances(inst.forward, inst.layer, inst.session, inst.sel_start, inst.sel_e, inst.sel_mult,
                           np.asarray(pinned if pinned is not None else np.zeros((L, E)), dtype=bool),
                           new_lru(lru_capacities(config.ram_bytes, layout.expert_bytes()[:, 0]), E),
                           np.ascontiguousarray(targets, dtype=np.int32), np.ascontiguousarray(counts, dtype=np.int32),
                           layout_arrays(layout, config, split),
                           read_policy(config, device), device_numbers(device), out)
    usage = DeviceUsage(out.member_bytes / device.drive.bandwidth, out.member_requests, out.residence)
    prefetch = None
    if config.prefetch != "none":
        prefetch = PrefetchResult(out.pf_loads, out.pf_bytes, out.pf_required, out.pf_timely, out.pf_timely_n, out.pf_slack,
                                  out.pf_unused)
    return InstanceResult(inst.forward, inst.layer, out.stall, config.dense_seconds + out.matmul, out.oracle,
                          out.union_experts, out.union_bytes, out.hits, out.misses, out.reads, out.read_bytes,
                          out.expert_wait, prefetch), usage


def _zero_results(I: int, L: int, E: int, M: int) -> Results:
    """Zeroed outputs: [L, E] for the waits, [M] per member, [I] per instance (counts as int64)."""
    counts = {"union_experts", "hits", "misses", "reads", "pf_loads", "pf_timely_n", "member_bytes", "member_requests"}
    shapes = {"expert_wait": (L, E), "member_bytes": M, "member_requests": M, "residence": M}
    return Results(*(np.zeros(shapes.get(name, I), dtype=np.int64 if name in counts else np.float64) for name in Results._fields))


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
        rank, _adjacent(wloc), pos_file, pos_off, wbytes, layout.expert_bytes().astype(np.int64),
        wbytes / float(config.compute_bytes_per_second),
        split.resident.astype(bool) if split is not None else np.zeros((L, E), dtype=bool),
        np.asarray(split.top_fraction if split is not None else np.zeros(L), dtype=np.float64),
        wloc, np.ascontiguousarray(layout.expert_loc[:, :, list(SCALE_SLOTS)], dtype=np.int64), file_bases(layout))


def read_policy(config: RuntimeConfig, device: ArrayProfile) -> ReadPolicy:
    return ReadPolicy(bool(config.coalesce), int(config.coalesce_gap_bytes), int(config.coalesce_max_bytes),
                      bool(config.direct), int(device.direct_alignment), int(config.in_flight),
                      float(device.page_cache_fraction), float(config.dense_seconds),
                      PREFETCH_SOURCES.index(config.prefetch), int(config.prefetch_experts))


def device_numbers(device: ArrayProfile) -> Array:
    d = device.drive
    return Array(int(device.members), int(device.chunk_bytes), SPLIT_RULES.index(device.split_rule),
                 float(d.request_seconds), float(d.bandwidth), int(d.queue_slots), float(device.host_bandwidth),
                 float(device.full_bandwidth))


def _adjacent(wloc: np.ndarray) -> np.ndarray:
    """[L, E]: the three weight tensors are byte-adjacent in one file."""
    order = np.argsort(wloc[:, :, :, 1], axis=2)
    s = np.take_along_axis(wloc, order[..., None], axis=2)
    same_file = (s[:, :, 0, 0] == s[:, :, 1, 0]) & (s[:, :, 1, 0] == s[:, :, 2, 0])
    touching = (s[:, :, 0, 1] + s[:, :, 0, 2] == s[:, :, 1, 1]) & (s[:, :, 1, 1] + s[:, :, 1, 2] == s[:, :, 2, 1])
    return same_file & touching
