"""The timing model: replays routing through a layout on a device and measures stall.

**Instances.** A (forward, layer) *instance* starts when the layer is routed. With demand loads
only (colibrì's default) a layer cannot finish before every expert it needs has arrived, so when
it ends the drives are idle and each instance is a small queueing problem of its own. The
compiled loop in :mod:`replay.model.instance` walks the instances in time order and keeps the state
that does carry over: the RAM tiers (pinned store, per-layer LRU, :mod:`replay.model.runtime`), the
page cache under the buffered scale reads with the kernel's readahead state
(:mod:`replay.model.pagecache`; each session starts with it empty), and, with a prefetch source, the
drives.

**One instance.** Time 0 is when routing is known. Every missing expert becomes a *job* for the
reader pool (with ``coalesce``, experts contiguous in one file share a job, their one read never
over ``coalesce_max_bytes``, as colibrì's COALESCE change reads them: pull request 1398 in
``JustVugg/colibri``, one pread for the experts of a miss batch that are contiguous in the same
shard; a pread returns when its whole span has arrived, so every expert of the span waits for
all of it, and a long span of co-activated experts gives up overlap of compute with reads that
separate reads would have had): its weight read(s) (one pread when the three weight tensors are
byte-adjacent, three when not; O_DIRECT widens them to the device's alignment) and its three
buffered scale preads, executed in order by one worker. A scale pread reaches the drive only
when the page cache cannot serve it, as the readahead the kernel did for earlier ones decides. These reads are planned by
:func:`replay.model.readplan.plan_layer`, the one function the harness (:mod:`replay.physical.measure`) also
plans its real reads with. Workers take jobs
in issue order (physical order); at each step the worker that is free earliest performs its next
read, so reads reach the drives in time order. A read is split over the array's members
(:func:`replay.model.device.split_read`), and each member is a queue (:mod:`replay.model.device`): at most
``Q = queue_slots`` requests at once, a request of ``s`` bytes that gets a slot at ``t0`` done at

    done = max(t0 + a + s / b_1,  max(t0 + a, channel_free) + c + s / B)      [s]

(``a`` request_seconds, ``b_1`` the rate one request streams at, ``B`` the drive's bandwidth,
``c`` the time each request holds the channel beyond its bytes, all per member), so ``q``
outstanding requests get ``X(s, q) = min(min(q, Q) s / (a + max(s / b_1, c + s / B)), s / (c + s / B))``
bytes/s: extra queue depth (more workers, a prefetch thread beside the demand loads) turns into
bandwidth up to the drive's limit, as on real NVMe. Small reads (up to ``SMALL_READ_BYTES``) pass
a channel of their own beside the large ones and delay them by their own channel time; the host
link caps the aggregate rate the same way. That is the ``in-order`` drive. A ``shared`` one (the
profile's ``service``, which ``relayout calibrate`` measures) shares its channel fairly among the
reads in it (about ``C / n`` each of ``n``, counting ``c`` per request as channel work): the reader pool is then an event simulation
(:func:`replay.model.instance._shared_pool`) in which a read issued later slows those in flight, so a
layer's demand reads, released together, complete together.

The compute thread first runs the resident experts' matmuls, then, in issue order, waits for
each missing expert and runs its matmul. Stall is the time it waits, measured on that critical
path, never summed per expert. With a split plan, a missing expert whose top segment is resident
runs its top part at once and waits only for its bottom segment.

**Prefetch** (``config.prefetch``, sources in :mod:`replay.model.prefetch`). When layer L is routed, the
prefetcher predicts up to K experts of layer L+1 and loads those not in RAM one at a time on its
own thread, until L+1 is routed: L+1 is routed when L's compute ends plus the dense time. Under
the runtime's own rule (top-K, no controls: :func:`replay.model.instance.runtime_rule`) it queues them
at once, before L's demand loads, as colibrì does (``couple_prefetch`` right after its router), so
its reads share the drives with L's demand reads in one event order (:func:`replay.model.instance._reader_pool`);
a controlled prefetcher (a byte or adaptive budget, caps, stale cancellation, backoff, or an
admission policy other than top-K) keeps demand's strict priority (seed 5.3) and starts once L's
demand loads are done. A load not started by the time L+1 is routed is dropped, one in flight
completes, and L+1's demand reads are issued only once it has: colibrì's ``moe()`` waits for the
pilot's load in flight on a layer at its start (the ``PILOT_REAL`` barrier on
``g_pilot_inflight``; the harness, :mod:`replay.physical.measure`, does the same). Where colibrì differs:
that wait holds its whole layer, the resident experts' matmuls included, where the model and the
harness hold only the demand reads. Loads that completed
enter L+1's LRU (or, with no cache, wait for L+1 alone); an expert still in flight makes L+1's
compute thread wait for it instead of reading it again. A wrong prediction costs drive time and,
with a cache, an LRU slot.

**colibrì's read paths** (:mod:`replay.colibri.engine_config`; docs/ENGINE_MODEL.md is the specification,
with references into the engine's source). A configuration given in the engine's variables runs
its order: the union is met in routing order (``Instances.sel_order``: positions in order, each
position's experts in the router's order), misses are issued in that order, and the compute
thread runs the resident experts routed before a miss, then waits for it; after the layer the
last ``min(k, cap)`` misses enter the LRU, the last first (``RuntimeConfig.routing_order``).
``PIPE=1`` is the reader pool of ``PIPE_WORKERS`` (at most 16) threads; ``URING=1`` the batched
queue (64 loads in flight); ``PIPE=0``, the engine's Linux default, loads the layer's misses on
the OpenMP team (``workers`` threads, taking them in order) while the compute thread is blocked
(``RuntimeConfig.blocking``): the stall is when the last miss arrives, and every matmul of the
layer runs after it. The LRU holds the engine's cap (``RuntimeConfig.lru_experts``: CAP,
CAP_RAISE, RAM_GB). Buffered weight reads go through a page cache of whole experts
(:mod:`replay.model.weightcache`, ``RuntimeConfig.page_cache_bytes``). Not modelled: COLI_MMAP, the
router pilot and page-cache hints (PILOT, COUPLE without PILOT_REAL), AUTOPIN's history, the
loaders' spin-waits competing with the matmuls for cores, and (under URING) a load's reads
being in flight together rather than one after another.

The **oracle** replaces the drives by a stream at the array's full bandwidth with no per-request
cost: the lower bound on stall that no layout can beat (for the misses left after prefetch).
"""

from __future__ import annotations

from collections import namedtuple
from dataclasses import dataclass, field, fields

import numpy as np

from containers.layout import SCALE_SLOTS, WEIGHT_SLOTS, Layout

from replay.model.admission import prefetcher_inputs
from replay.model.config import ADMISSION_POLICIES, RuntimeConfig, lru_capacities, source_index
from replay.model.device import SPLIT_RULES, ArrayProfile
from replay.model.instance import (
    Device,
    LayoutArrays,
    PREFETCH_SLOTS,
    RamTiers,
    ReadPolicy,
    new_work,
    simulate_instances,
)
from replay.model.jit import compile_notice
from replay.model.pagecache import new_page_cache
from replay.model.predictors import RELIABILITY_BINS
from replay.model.runtime import new_lru
from replay.model.storage import StorageProfile
from replay.model.weightcache import new_weight_cache
from replay.model.routing import RoutingTrace
from replay.model.unions import (
    DEFAULT_CHUNK_FORWARDS,
    Instances,
    chunk_instances,
    whole_forward_blocks,
)

UNDO_READS = PREFETCH_SLOTS * 3
"""Scale preads one undo-logged stretch of the page cache may hold: the prefetch thread's loads
queued at one routing, three scale preads each (:func:`replay.model.readplan.plan_layer`;
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
    ``timely``: of those, the bytes ready before the compute thread needed them (seed 4.3: a
    prefetch, or a demand load that finished early), as the STALL_TRACE analysis counts them.
    ``timely_n``, ``slack``: the timely prefetches and the sum of their lead slack (s).
    ``unused``: bytes prefetched for this layer that it did not select.
    ``rejected``, ``capped``, ``cancelled``, ``demand_done`` and the late-need reliability sums (``late_*``,
    [R], totals over the replay): see the fields and :mod:`replay.model.admission`.
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
    (s), as a measured run's drive time is read off its STALL_TRACE (:mod:`relayout.validate`)."""

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
    the pending prefetches (:func:`replay.model.instance.new_work`), and the totals over the replay
    (outputs without an ``"I"`` axis: ``expert_wait`` [L, E], the device usage [M]). Chunks must
    hold whole forwards, in time order (:func:`replay.model.unions.chunk_instances`); the replay is
    then the same, to the bit, whatever the chunks. Memory: the layout's [L, E] arrays and one
    chunk's instances and outputs.

    ``coupling`` is the prediction source learned from training sessions: a
    :class:`replay.model.predictors.SourceModel` (:func:`replay.model.predictors.learn_source`), needed by
    every source but ``none`` and ``oracle`` under an admission policy other than ``top-k``; or,
    for ``coupled`` under ``top-k`` (the runtime's rule), just its ``(targets, counts)`` table
    (:func:`replay.model.coupling.coupling_table`).
    """

    def __init__(self, layout: Layout, device: ArrayProfile, config: RuntimeConfig, pinned: np.ndarray | None = None,
                 split: SplitState | None = None, coupling: tuple | None = None):
        L, E = len(layout.layers), layout.n_experts
        self.config = config
        self.lay = layout_arrays(layout, config, split)
        self.ram = RamTiers(np.asarray(pinned if pinned is not None else np.zeros((L, E)), dtype=bool),
                            new_lru(lru_capacities(config.ram_bytes, layout.expert_bytes()[:, 0], config.lru_experts), E),
                            new_page_cache(self.lay.sloc, layout.file_sizes, device.read_ahead_bytes, UNDO_READS,
                                           device.drive.max_request_bytes),
                            new_weight_cache(0 if config.direct else config.page_cache_bytes, self.lay.wbytes))
        self.table = prefetcher_inputs(config, layout, coupling)
        self.pol = read_policy(config, device)
        self.dev = device_numbers(device, layout)
        # a batch union holds at most E experts: working arrays for that serve every chunk
        self.work = new_work(max(E, 1), E, self.pol.workers, self.dev.members, self.dev.queue_slots)
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
    chunk_forwards: int = DEFAULT_CHUNK_FORWARDS,
) -> tuple[InstanceResult, DeviceUsage]:
    """Replay the forwards selected by mask ``forwards`` [F] through ``layout`` on ``device``,
    with results per instance (memory grows with the instances; :func:`replay.model.streaming.replay_steps`
    keeps per-step sums only). ``coupling``: see :class:`Replay`; ``chunk_forwards``: forwards
    replayed per call of the compiled loop (the results do not depend on it).
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
    """How the runtime reads, as the compiled model takes it."""
    return ReadPolicy(bool(config.coalesce), int(config.coalesce_gap_bytes), int(config.coalesce_max_bytes),
                      bool(config.direct), int(device.direct_alignment), int(config.in_flight),
                      float(device.page_cache_fraction), float(config.dense_seconds),
                      source_index(config.prefetch), int(config.prefetch_experts),
                      ADMISSION_POLICIES.index(config.admission), int(config.prefetch_bytes), int(config.prefetch_candidates),
                      float(config.prefetch_min_probability), bool(config.cancel_stale), bool(config.adaptive_budget),
                      bool(config.backoff), bool(config.blocking), bool(config.routing_order))


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
    return Device(M, int(device.chunk_bytes), SPLIT_RULES.index(device.split_rule),
                 float(d.request_seconds), float(d.bandwidth), int(d.queue_slots), float(device.host_bandwidth),
                 float(device.full_bandwidth), float(d.request_bandwidth), int(d.max_request), d.service == "shared",
                 float(d.request_channel_seconds), *per, seg_start, seg_drive)


def _adjacent(wloc: np.ndarray) -> np.ndarray:
    """[L, E]: the three weight tensors are byte-adjacent in one file."""
    order = np.argsort(wloc[:, :, :, 1], axis=2)
    s = np.take_along_axis(wloc, order[..., None], axis=2)
    same_file = (s[:, :, 0, 0] == s[:, :, 1, 0]) & (s[:, :, 1, 0] == s[:, :, 2, 0])
    touching = (s[:, :, 0, 1] + s[:, :, 0, 2] == s[:, :, 1, 1]) & (s[:, :, 1, 1] + s[:, :, 1, 2] == s[:, :, 2, 1])
    return same_file & touching
