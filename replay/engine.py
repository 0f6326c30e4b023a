"""The timing model: replays routing through a layout on a device and measures stall.

**Why layers can be simulated independently.** Loads are demand-only: a layer's routing is known
only once its attention has run, and its compute cannot finish before every expert it needs has
arrived. So when a layer ends, every read it issued has completed and the drives are idle. Given
the RAM state (computed beforehand, see :mod:`replay.runtime`), each (forward, layer) *instance*
is an independent small queueing problem. Instances with the same number of load jobs are
simulated together, vectorised with numpy.

**One instance.** Time 0 is when routing is known. Every missing expert becomes a *job* for the
reader pool (with ``coalesce``, experts contiguous in one file share a job): its weight read(s)
(one pread when the three weight tensors are byte-adjacent, three when not; O_DIRECT widens them
to 4 KiB) and its three buffered scale preads, executed in order by one worker. Workers take jobs
in issue order (physical order); at each step the worker that is free earliest performs its next
read, so reads reach the drives in time order. A read is split over the array's members
(:func:`replay.device.member_split`); a member overlaps the per-request cost of up to
``queue_slots`` requests but transfers large reads one at a time; small reads (up to
``SMALL_READ_BYTES``) queue among themselves beside the large ones and delay them by their own
transfer time; the host link caps the aggregate rate the same way.

The compute thread first runs the resident experts' matmuls, then, in issue order, waits for
each missing expert and runs its matmul. Stall is the time it waits, measured on that critical
path, never summed per expert. With a split plan, a missing expert whose top segment is resident
runs its top part at once and waits only for its bottom segment.

The **oracle** replaces the drives by a stream at the array's full bandwidth with no per-request
cost: the lower bound on stall that no layout can beat.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from relayout.layout import WEIGHT_SLOTS, SCALE_SLOTS, Layout
from relayout.trace import RoutingTrace

from .device import ArrayProfile, member_split, widen_direct
from .runtime import RuntimeConfig, lru_capacities, lru_hits

FILE_ALIGNMENT = 1 << 20
"""Files are assumed to start at 1 MiB boundaries of the array's address space, in file order."""

MEMORY_BANDWIDTH = 10e9
"""Bytes/s for reads served from the OS page cache."""

SMALL_READ_BYTES = 256 * 1024
"""Reads up to this size queue among themselves, beside the large transfers, as a drive's internal
parallelism serves them (their transfer time still delays the large transfers)."""

BATCH_INSTANCES = 8192
CHUNK_INSTANCES = 50_000
"""Instances timed together; bounds memory whatever the trace length."""


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
) -> tuple[InstanceResult, DeviceUsage]:
    """Replay the forwards selected by mask ``forwards`` [F] through ``layout`` on ``device``."""
    L, E = len(layout.layers), layout.n_experts
    layer_idx = np.full(int(max(layout.layers)) + 2, -1, dtype=np.int64)
    layer_idx[layout.layers] = np.arange(L)
    tl = trace.row_layer.astype(np.int64)
    rows = np.flatnonzero(forwards[trace.row_forward] & (tl < len(layer_idx)) & (layer_idx[np.minimum(tl, len(layer_idx) - 1)] >= 0))
    r_fwd = trace.row_forward[rows].astype(np.int64)
    r_li = layer_idx[tl[rows]]
    inst_key, row_inst = np.unique(r_fwd * L + r_li, return_inverse=True)
    inst_fwd, inst_li = inst_key // L, inst_key % L
    inst_session = trace.fwd_session[inst_fwd].astype(np.int64)
    I = len(inst_key)

    ex = trace.experts[rows].astype(np.int64)
    valid = ex >= 0
    if len(row_inst) == I:
        # one position per instance (plain decode): the union is the row itself, sorted
        srt = np.sort(np.where(valid, ex, E), axis=1)
        keep = srt < E
        sel_inst = np.repeat(np.arange(I), keep.sum(axis=1))
        sel_e = srt[keep]
        mult = np.ones(len(sel_e), dtype=np.int64)
    else:
        sel_key, mult = np.unique((np.repeat(row_inst, ex.shape[1]).reshape(ex.shape) * E + ex)[valid], return_counts=True)
        sel_inst, sel_e = sel_key // E, sel_key % E
    sel_li = inst_li[sel_inst]

    ebytes = layout.expert_bytes()                         # [L, E]
    wbytes = layout.expert_loc[:, :, list(WEIGHT_SLOTS), 2].sum(axis=2)
    comp = wbytes / config.compute_bytes_per_second        # [L, E] seconds per position

    capacity = lru_capacities(config.ram_bytes, ebytes[:, 0])
    pin = pinned if pinned is not None else np.zeros((L, E), dtype=bool)
    hit = lru_hits(inst_li, inst_session, sel_inst, sel_e, capacity, pin)

    union_experts = np.bincount(sel_inst, minlength=I)
    union_bytes = np.bincount(sel_inst, weights=ebytes[sel_li, sel_e], minlength=I)
    hits_n = np.bincount(sel_inst, weights=hit, minlength=I).astype(np.int64)

    sel_comp = comp[sel_li, sel_e] * mult
    resident_comp = np.bincount(sel_inst, weights=np.where(hit, sel_comp, 0.0), minlength=I)
    top_res = np.zeros(len(sel_e), dtype=bool)
    if split is not None:
        top_res = split.resident[sel_li, sel_e] & ~hit
        resident_comp += np.bincount(sel_inst, weights=np.where(top_res, sel_comp * split.top_fraction[sel_li], 0.0), minlength=I)

    first_access = _first_in_session(inst_session[sel_inst], sel_li * E + sel_e)
    geo = _LayoutArrays(layout)
    stall = np.zeros(I)
    oracle = np.zeros(I)
    reads = np.zeros(I, dtype=np.int64)
    read_bytes = np.zeros(I)
    misses_n = np.zeros(I, dtype=np.int64)
    usage = DeviceUsage(np.zeros(device.members), np.zeros(device.members, dtype=np.int64), np.zeros(device.members))
    expert_wait = np.zeros((L, E))
    sel_start = np.searchsorted(sel_inst, np.arange(I + 1))
    for c0 in range(0, I, CHUNK_INSTANCES):
        c1 = min(I, c0 + CHUNK_INSTANCES)
        s0, s1 = sel_start[c0], sel_start[c1]
        miss = s0 + np.flatnonzero(~hit[s0:s1])
        out = _simulate_chunk(
            c1 - c0, sel_inst[miss] - c0, sel_li[miss], sel_e[miss], top_res[miss], sel_comp[miss], first_access[miss],
            resident_comp[c0:c1], geo, device, config, split, usage, expert_wait)
        stall[c0:c1], oracle[c0:c1], reads[c0:c1], read_bytes[c0:c1], misses_n[c0:c1] = out

    compute = config.dense_seconds + np.bincount(sel_inst, weights=sel_comp, minlength=I)
    return InstanceResult(inst_fwd, inst_li, stall, compute, oracle, union_experts, union_bytes, hits_n, misses_n,
                          reads, read_bytes, expert_wait), usage


class _LayoutArrays:
    """Per (layer, expert) arrays of a layout that the timing model looks up."""

    def __init__(self, layout: Layout):
        wloc = layout.expert_loc[:, :, list(WEIGHT_SLOTS)]     # [L, E, 3, 3]
        first_w = np.argmin(wloc[:, :, :, 1] + wloc[:, :, :, 0] * (1 << 44), axis=2)
        self.wloc = wloc
        self.sloc = layout.expert_loc[:, :, list(SCALE_SLOTS)]
        self.pos_file = np.take_along_axis(wloc[:, :, :, 0], first_w[..., None], axis=2)[..., 0]
        self.pos_off = np.take_along_axis(wloc[:, :, :, 1], first_w[..., None], axis=2)[..., 0]
        self.wbytes = wloc[:, :, :, 2].sum(axis=2)
        self.adjacent = _adjacent(wloc)
        self.bases = file_bases(layout)
        self.n_experts = layout.n_experts
        # each expert's place in its layer's physical order (file, then offset): the issue order
        self.rank = np.empty((len(layout.layers), layout.n_experts), dtype=np.int64)
        for li in range(len(layout.layers)):
            self.rank[li, np.lexsort((self.pos_off[li], self.pos_file[li]))] = np.arange(layout.n_experts)


@dataclass
class _Misses:
    """The missing experts of a chunk's instances, in issue (physical) order within each instance."""

    inst: np.ndarray
    li: np.ndarray
    e: np.ndarray
    top: np.ndarray          # a resident top segment leaves only the bottom to read
    comp: np.ndarray         # compute still to do after the bytes arrive (s)
    first_touch: np.ndarray  # first load of this expert in its session (scales not yet in the page cache)
    keep: np.ndarray         # share of the expert's bytes still to read
    wlen: np.ndarray         # weight bytes to read


@dataclass
class _Jobs:
    """Load jobs: each missing expert's weight job and scale job (the same job unless coalescing)."""

    n: int
    weight_job: np.ndarray   # per missing expert
    scale_job: np.ndarray    # per missing expert
    inst: np.ndarray         # per job
    w_job: np.ndarray        # per weight read
    w_file: np.ndarray
    w_off: np.ndarray
    w_len: np.ndarray


def _order_misses(m_inst, m_li, m_e, m_top, m_comp, m_first_access, I, geo: "_LayoutArrays", split) -> _Misses:
    key = m_inst * geo.n_experts + geo.rank[m_li, m_e]
    order = np.argsort(key.astype(np.int32 if I * geo.n_experts < 2**31 else np.int64))
    m_inst, m_li, m_e, m_top = m_inst[order], m_li[order], m_e[order], m_top[order]
    comp = m_comp[order]
    keep = np.ones(len(m_e))
    if split is not None:
        comp = np.where(m_top, comp * (1 - split.top_fraction[m_li]), comp)
        keep = np.where(m_top, 1 - split.top_fraction[m_li], 1.0)
    wlen = np.ceil(geo.wbytes[m_li, m_e] * keep).astype(np.int64)
    return _Misses(m_inst, m_li, m_e, m_top, comp, m_first_access[order], keep, wlen)


def _plan_jobs(ms: _Misses, geo: "_LayoutArrays", config: RuntimeConfig) -> _Jobs:
    """One job per missing expert (weights: one extent when byte-adjacent, else three; then its
    scales); with coalescing, runs of one-extent experts contiguous in one file (gap <=
    ``coalesce_gap_bytes``, span <= ``coalesce_max_bytes``) share one weight read, and each expert's
    scale preads become a job of their own queued after it, so other workers take them."""
    wloc, pos_file, pos_off = geo.wloc, geo.pos_file, geo.pos_off
    n_ext = np.where(geo.adjacent[ms.li, ms.e] | ms.top, 1, 3)
    x_miss = np.repeat(np.arange(len(ms.e)), n_ext)
    x_k = np.arange(len(x_miss)) - np.repeat(np.cumsum(n_ext) - n_ext, n_ext)
    x_li, x_e = ms.li[x_miss], ms.e[x_miss]
    single = n_ext[x_miss] == 1
    x_file = np.where(single, pos_file[x_li, x_e], wloc[x_li, x_e, x_k, 0])
    x_off = np.where(single, pos_off[x_li, x_e], wloc[x_li, x_e, x_k, 1])
    x_len = np.where(single, ms.wlen[x_miss], wloc[x_li, x_e, x_k, 2])

    m_single = n_ext == 1
    m_start = pos_off[ms.li, ms.e]
    m_end = m_start + ms.wlen
    if config.coalesce and len(ms.e):
        m_file = pos_file[ms.li, ms.e]
        gap = m_start[1:] - m_end[:-1]
        joins = (ms.inst[1:] == ms.inst[:-1]) & m_single[1:] & m_single[:-1] & (m_file[1:] == m_file[:-1]) \
            & (gap >= 0) & (gap <= config.coalesce_gap_bytes)
        brk = np.concatenate([[True], ~joins])
        run_start = np.flatnonzero(brk)
        run = np.cumsum(brk) - 1
        chunk = (np.maximum(m_end - m_start[run_start][run], 1) - 1) // config.coalesce_max_bytes
        newjob = brk.copy()
        newjob[1:] |= chunk[1:] != chunk[:-1]
        m_job = np.cumsum(newjob) - 1
    else:
        m_job = np.arange(len(ms.e))
    n_jobs = int(m_job[-1]) + 1 if len(m_job) else 0
    job_size = np.bincount(m_job, minlength=n_jobs)
    merged = job_size[m_job] > 1
    # weight reads: a merged job reads its span once; any other job reads its expert's extents
    x_keep = ~merged[x_miss]
    jstart = np.full(n_jobs, np.iinfo(np.int64).max)
    jend = np.zeros(n_jobs, dtype=np.int64)
    np.minimum.at(jstart, m_job[merged], m_start[merged])
    np.maximum.at(jend, m_job[merged], m_end[merged])
    jfile = np.zeros(n_jobs, dtype=np.int64)
    jfile[m_job[merged]] = pos_file[ms.li, ms.e][merged]
    mj = np.flatnonzero(job_size > 1)
    w_job = np.concatenate([m_job[x_miss][x_keep], mj])
    w_file = np.concatenate([x_file[x_keep], jfile[mj]])
    w_off = np.concatenate([x_off[x_keep], jstart[mj]])
    w_len = np.concatenate([x_len[x_keep], jend[mj] - jstart[mj]])
    if config.coalesce and len(m_job):
        run_first = np.concatenate([[0], np.flatnonzero(np.diff(m_job)) + 1])
        wkey = 2 * run_first[m_job]
        skey = 2 * np.arange(len(m_job)) + 1
        keys, inv = np.unique(np.concatenate([wkey, skey]), return_inverse=True)
        renum_w, m_sjob = inv[: len(m_job)], inv[len(m_job):]
        remap = np.zeros(n_jobs, dtype=np.int64)
        remap[m_job] = renum_w
        w_job = remap[w_job]
        m_job = renum_w
        n_jobs = len(keys)
    else:
        m_sjob = m_job
    job_inst = np.zeros(n_jobs, dtype=np.int64)
    job_inst[m_job] = ms.inst
    job_inst[m_sjob] = ms.inst
    return _Jobs(n_jobs, m_job, m_sjob, job_inst, w_job, w_file, w_off, w_len)


def _simulate_chunk(I, m_inst, m_li, m_e, m_top, m_comp, m_first_access, resident_comp, geo: _LayoutArrays,
                    device: ArrayProfile, config: RuntimeConfig, split: SplitState | None, usage: DeviceUsage,
                    expert_wait: np.ndarray):
    """The timing model for instances ``0..I-1`` of a chunk, given their missing experts."""
    ms = _order_misses(m_inst, m_li, m_e, m_top, m_comp, m_first_access, I, geo, split)
    misses_n = np.bincount(ms.inst, minlength=I)
    jb = _plan_jobs(ms, geo, config)
    w_job, w_len = jb.w_job, jb.w_len

    # weight reads: O_DIRECT widens them; a declared warm fraction of the device serves some from RAM
    w_addr = geo.bases[jb.w_file] + jb.w_off
    if config.direct:
        w_addr, w_len = widen_direct(w_addr, w_len, device.direct_alignment)
    w_warm = np.zeros(len(w_job), dtype=bool)
    if device.page_cache_fraction > 0:
        key = (jb.w_file * 1_000_003 + jb.w_off // 4096) % 10_000
        w_warm = key < device.page_cache_fraction * 10_000
    # scale reads are buffered: the first load of an expert in a session reads them from the drives;
    # later loads find them in the OS page cache
    sloc = geo.sloc
    s_len3 = np.ceil(sloc[ms.li, ms.e, :, 2] * ms.keep[:, None]).astype(np.int64)      # [misses, 3]
    s_bytes = s_len3.sum(axis=1)
    m_bytes = ms.wlen + np.where(ms.first_touch, s_bytes, 0)                       # bytes from the drives
    reads = (np.bincount(jb.inst[w_job], minlength=I) + 3 * misses_n) if len(w_job) else 3 * misses_n
    read_bytes = np.bincount(jb.inst[w_job], weights=w_len, minlength=I) + np.bincount(ms.inst, weights=s_bytes, minlength=I)

    cold = np.flatnonzero(ms.first_touch)
    s_job = np.repeat(jb.scale_job[cold], 3)
    s_addr = (geo.bases[sloc[ms.li[cold], ms.e[cold], :, 0]] + sloc[ms.li[cold], ms.e[cold], :, 1]).ravel()
    s_len = s_len3[cold].ravel()
    # page-cache reads cost memory time on their worker and never touch a drive: fold them into their
    # job's tail; a job left with no read at all keeps one empty read to carry it
    warm_time = np.where(ms.first_touch, 0.0, s_bytes / MEMORY_BANDWIDTH)
    job_tail = np.bincount(jb.scale_job, weights=warm_time, minlength=jb.n)
    job_tail += np.bincount(w_job, weights=np.where(w_warm, w_len / MEMORY_BANDWIDTH, 0.0), minlength=jb.n)
    w_keep = ~w_warm
    has_read = np.zeros(jb.n, dtype=bool)
    has_read[w_job[w_keep]] = True
    has_read[s_job] = True
    empty = np.flatnonzero(~has_read)
    r_job = np.concatenate([w_job[w_keep], s_job, empty])
    addr = np.concatenate([w_addr[w_keep], s_addr, np.zeros(len(empty), dtype=np.int64)])
    rlen = np.concatenate([w_len[w_keep], s_len, np.zeros(len(empty), dtype=np.int64)])
    warm = np.concatenate([np.zeros(int(w_keep.sum()) + len(s_job), dtype=bool), np.ones(len(empty), dtype=bool)])
    r_order = np.argsort(r_job, kind="stable")
    r_job, addr, rlen, warm = r_job[r_order], addr[r_order], rlen[r_order], warm[r_order]

    job_done = _time_jobs(I, jb, r_job, addr, rlen, warm, job_tail, device, config, usage)

    # ---- the compute thread, and the oracle's, per instance with misses
    m_ready = np.maximum(job_done[jb.weight_job], job_done[jb.scale_job]) if len(ms.e) else np.zeros(0)
    m_oracle_ready = _cumsum_by_group(m_bytes.astype(np.float64), ms.inst) / device.full_bandwidth
    stall = np.zeros(I)
    oracle = np.zeros(I)
    m_first = np.concatenate([[0], np.cumsum(misses_n)[:-1]])
    with_miss = np.flatnonzero(misses_n)
    for k in np.unique(misses_n[with_miss]):
        group = with_miss[misses_n[with_miss] == k]
        idx = m_first[group][:, None] + np.arange(k)[None, :]
        stall[group], waits = _compute_thread(resident_comp[group], m_ready[idx], ms.comp[idx])
        np.add.at(expert_wait, (ms.li[idx], ms.e[idx]), waits)
        oracle[group], _ = _compute_thread(resident_comp[group], m_oracle_ready[idx], ms.comp[idx])
    return stall, oracle, reads, read_bytes, misses_n


def _time_jobs(I, jb: _Jobs, r_job, addr, rlen, warm, job_tail, device: ArrayProfile, config: RuntimeConfig,
               usage: DeviceUsage) -> np.ndarray:
    """Completion time of every job: reads split over the members, then the reader-pool simulation,
    batched over instances with the same numbers of jobs and reads."""
    pieces, nbytes = member_split(device, addr, rlen)
    if warm.any():
        pieces, nbytes = np.where(warm[:, None], 0, pieces), np.where(warm[:, None], 0, nbytes)
    usage.transfer_seconds += nbytes.sum(axis=0) / device.drive.bandwidth
    usage.requests += pieces.sum(axis=0)
    job_nreads = np.bincount(r_job, minlength=jb.n)
    job_first_read = np.concatenate([[0], np.cumsum(job_nreads)[:-1]])
    inst_njobs = np.bincount(jb.inst, minlength=I) if jb.n else np.zeros(I, dtype=np.int64)
    inst_first_job = np.concatenate([[0], np.cumsum(inst_njobs)[:-1]])
    job_done = np.zeros(jb.n)
    insts_with_jobs = np.flatnonzero(inst_njobs)
    inst_nreads = np.bincount(jb.inst, weights=job_nreads, minlength=I).astype(np.int64)
    key = inst_njobs[insts_with_jobs] * (int(inst_nreads.max(initial=0)) + 1) + inst_nreads[insts_with_jobs]
    for k in np.unique(key):
        group = insts_with_jobs[key == k]
        nj = int(inst_njobs[group[0]])
        for b in range(0, len(group), BATCH_INSTANCES):
            g = group[b : b + BATCH_INSTANCES]
            jobs = inst_first_job[g][:, None] + np.arange(nj)[None, :]          # [G, J]
            _run_jobs(jobs, job_nreads, job_first_read, job_tail, job_done, pieces, nbytes, rlen, warm, device, config, usage)
    return job_done


def _first_in_session(session: np.ndarray, key: np.ndarray) -> np.ndarray:
    """True where (session, key) occurs for the first time, in array order."""
    if not len(key):
        return np.zeros(0, dtype=bool)
    combined = session * (int(key.max()) + 1) + key
    if combined.max() < 2**31:
        combined = combined.astype(np.int32)
    _, first = np.unique(combined, return_index=True)
    out = np.zeros(len(key), dtype=bool)
    out[first] = True
    return out


def _adjacent(wloc: np.ndarray) -> np.ndarray:
    """[L, E]: the three weight tensors are byte-adjacent in one file."""
    order = np.argsort(wloc[:, :, :, 1], axis=2)
    s = np.take_along_axis(wloc, order[..., None], axis=2)
    same_file = (s[:, :, 0, 0] == s[:, :, 1, 0]) & (s[:, :, 1, 0] == s[:, :, 2, 0])
    touching = (s[:, :, 0, 1] + s[:, :, 0, 2] == s[:, :, 1, 1]) & (s[:, :, 1, 1] + s[:, :, 1, 2] == s[:, :, 2, 1])
    return same_file & touching


def _cumsum_by_group(x: np.ndarray, group: np.ndarray) -> np.ndarray:
    """Inclusive cumulative sum of ``x`` restarting at each new value of sorted ``group``."""
    if not len(x):
        return x
    c = np.cumsum(x)
    starts = np.flatnonzero(np.concatenate([[True], group[1:] != group[:-1]]))
    offset = np.concatenate([[0.0], c[starts[1:] - 1]])
    return c - np.repeat(offset, np.diff(np.concatenate([starts, [len(x)]])))


def _compute_thread(resident: np.ndarray, ready: np.ndarray, comp: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A compute thread that runs resident work, then waits for each expert in order.

    Returns the stall [G] and each wait [G, k] (the time spent waiting right before expert k).
    """
    t = resident.copy()
    waits = np.zeros(ready.shape)
    for k in range(ready.shape[1]):
        waits[:, k] = np.maximum(ready[:, k] - t, 0.0)
        t = t + waits[:, k] + comp[:, k]
    return waits.sum(axis=1), waits


def _device_read(r, t, gi, pieces, nbytes, rlen, warm, device: ArrayProfile, mfree, sfree, hfree, hsfree,
                 usage: DeviceUsage) -> np.ndarray:
    """Serve reads ``r`` issued at times ``t`` (one per instance ``gi``); returns their completion times.

    Updates the members' large and small channels and the host link in place.
    """
    drive = device.drive
    nb = nbytes[r]                                  # [A, M]
    lat = drive.request_seconds * np.ceil(pieces[r] / drive.queue_slots)
    on = nb > 0
    total = rlen[r]
    small1 = total <= SMALL_READ_BYTES
    small = small1[:, None]
    xm = nb / drive.bandwidth
    mf, sf = mfree[gi], sfree[gi]
    mdone = np.where(on, np.maximum(t[:, None] + lat, np.where(small, sf, mf)) + xm, -np.inf)
    usage.residence_seconds += np.where(on, mdone - t[:, None], 0.0).sum(axis=0)
    mfree[gi] = np.where(on, np.where(small, mf + xm, mdone), mf)
    sfree[gi] = np.where(on & small, mdone, sf)
    xfer = total / device.host_bandwidth
    hf, hs = hfree[gi], hsfree[gi]
    hdone = np.maximum(np.where(small1, hs, hf), t) + xfer
    hw = warm[r]
    hfree[gi] = np.where(hw, hf, np.where(small1, hf + xfer, hdone))
    hsfree[gi] = np.where(~hw & small1, hdone, hs)
    return np.where(hw, t + total / MEMORY_BANDWIDTH, np.maximum(mdone.max(axis=1), hdone))


def _run_jobs(jobs, job_nreads, job_first_read, job_tail, job_done, pieces, nbytes, rlen, warm, device: ArrayProfile,
              config: RuntimeConfig, usage: DeviceUsage) -> None:
    """Event-ordered simulation of the reader pool for a batch of instances with J jobs each."""
    G, J = jobs.shape
    W = config.in_flight
    M = device.members
    wfree = np.zeros((G, W))
    wjob = np.full((G, W), -1, dtype=np.int64)
    wpos = np.zeros((G, W), dtype=np.int64)
    next_job = np.zeros(G, dtype=np.int64)
    mfree = np.zeros((G, M))        # large-transfer channel of each member
    sfree = np.zeros((G, M))        # small reads, served beside large transfers
    hfree = np.zeros(G)
    hsfree = np.zeros(G)
    rows = np.arange(G)
    nreads = job_nreads[jobs]                       # [G, J]
    total_steps = int(nreads.sum(axis=1).max())
    if W >= J and (nreads == 1).all():
        # every job is one read and has a worker of its own: all are issued at time 0, in order
        for i in range(J):
            job = jobs[:, i]
            r = job_first_read[job]
            done = _device_read(r, np.zeros(G), slice(None), pieces, nbytes, rlen, warm, device, mfree, sfree, hfree, hsfree, usage)
            job_done[job] = done + job_tail[job]
        return
    for _ in range(total_steps):
        has_work = (wjob >= 0) | (next_job < J)[:, None]
        t_w = np.where(has_work, wfree, np.inf)
        w = np.argmin(t_w, axis=1)
        t = t_w[rows, w]
        act = np.isfinite(t)
        if act.all():
            g, gi = rows, slice(None)        # every instance steps: per-instance state is used in place
        elif act.any():
            g = rows[act]
            gi = g
            w = w[act]
            t = t[act]
        else:
            break
        take = wjob[g, w] < 0
        if take.any():
            gt = g[take]
            wjob[gt, w[take]] = next_job[gt]
            wpos[gt, w[take]] = 0
            next_job[gt] += 1
        j = wjob[g, w]
        job = jobs[g, j]
        pos = wpos[g, w]
        r = job_first_read[job] + pos
        done = _device_read(r, t, gi, pieces, nbytes, rlen, warm, device, mfree, sfree, hfree, hsfree, usage)
        pos = pos + 1
        wpos[g, w] = pos
        finished = pos >= job_nreads[job]
        done = np.where(finished, done + job_tail[job], done)
        wfree[g, w] = done
        if finished.any():
            job_done[job[finished]] = done[finished]
            wjob[g[finished], w[finished]] = -1
