"""The replay model: closed-form cases, striping by hand, both directions of the gate."""

import json
from collections import Counter, OrderedDict
from dataclasses import replace

import numpy as np
import pytest
from conftest import make_trace
from numba import njit
from hypothesis import given, settings
from hypothesis import strategies as st

from containers.errors import InputError
from containers.geometry import load_geometry
from containers.layout import Layout
from relayout.planning.plan import make_plan, source_from_geometry
from relayout.traces.synth import SynthParams, synth_trace
from replay.model.config import RuntimeConfig, lru_capacities
from replay.model.device import ArrayProfile, DriveProfile, load_device, member_split
from replay.model.engine import simulate
from replay.evaluation.gate import compare
from replay.model.jit import fetch_lines
from replay.model.metrics import step_table, summarize
from replay.model.pagecache import buffered_read, new_page_cache
from replay.formats.planfile import load_plan, save_plan
from replay.model.runtime import lru_hits
from replay.evaluation.stats import paired_saving
from replay.model.unions import instance_unions

NO_COMPUTE = dict(dense_seconds=0.0, compute_bytes_per_second=1e30)


def one_drive(latency=1e-4, bw=1e9, host=1e12, slots=32):
    return ArrayProfile("test-drive", DriveProfile("d", latency, bw, slots), 1, 0, "none", host,
                        read_ahead_bytes=0)


def simple_layout(E=16, wbytes=(8192, 8192, 16384), sbytes=(4096, 4096, 4096), layers=(3,)):
    """One file: per expert its three weights adjacent, then its three scales; 4 KiB aligned."""
    loc = np.zeros((len(layers), E, 6, 3), dtype=np.int64)
    off = 4096
    for li in range(len(layers)):
        for e in range(E):
            for slot, n in enumerate(list(wbytes) + list(sbytes)):
                loc[li, e, slot] = (0, off, n)
                off += n
    return Layout(["f.safetensors"], [off], list(layers), E, loc, 4096)


def test_one_drive_no_cache_no_compute_stall_is_the_sum_of_request_costs():
    lat, bw = 1e-4, 1e9
    lay = simple_layout()
    tr = make_trace([[[0, 1, 2]], [[3, 4, 5]]])
    inst, _ = simulate(tr, np.ones(2, bool), lay, one_drive(lat, bw), RuntimeConfig(workers=1, **NO_COMPUTE))
    per_expert = (lat + 32768 / bw) + 3 * (lat + 4096 / bw)  # one weight read + three scale reads
    assert inst.stall == pytest.approx([3 * per_expert, 3 * per_expert], rel=1e-9)
    assert inst.reads.tolist() == [12, 12]


def test_drive_reads_count_weight_reads_and_the_scale_reads_of_a_sessions_first_access():
    """What the model sends to the drive, per instance (compared with a measured run's
    ``drive_requests`` by ``validate``): weight reads always; without readahead and with each
    scale tensor on pages of its own, scale reads on an expert's first access in its session;
    the page cache serves the rest, which ``reads`` still counts."""
    lay = simple_layout()
    tr = make_trace([[[0, 1, 2]], [[0, 1, 2]], [[0, 1, 2]]], sessions=[0, 0, 1])
    inst, _ = simulate(tr, np.ones(3, bool), lay, one_drive(), RuntimeConfig(workers=1, **NO_COMPUTE))
    assert inst.reads.tolist() == [12, 12, 12]
    assert inst.drive_reads.tolist() == [12, 3, 12]
    warm = replace(one_drive(), page_cache_fraction=1.0)          # every weight read served by the page cache
    inst, _ = simulate(tr, np.ones(3, bool), lay, warm, RuntimeConfig(workers=1, **NO_COMPUTE))
    assert inst.reads.tolist() == [12, 12, 12] and inst.drive_reads.tolist() == [9, 0, 9]
    # coalesced, the second forward's scale jobs carry no drive read (an empty placeholder each): not counted
    inst, _ = simulate(tr, np.ones(3, bool), lay, one_drive(), RuntimeConfig(workers=1, coalesce=True, **NO_COMPUTE))
    assert inst.drive_reads.tolist() == [10, 1, 10]


def scales_together_layout(E=16, wbytes=(8192, 8192, 16384), sbytes=(3072, 3072, 8192)):
    """One file: every expert's three weights, then all experts' scales together, expert after
    expert and each expert's down, gate, up (name order, the converter's habit): 14 KB of
    scales per expert, so neighbours share pages."""
    loc = np.zeros((1, E, 6, 3), dtype=np.int64)
    off = 4096
    for e in range(E):
        for slot, n in enumerate(wbytes):
            loc[0, e, slot] = (0, off, n)
            off += n
    for e in range(E):
        for slot in (5, 3, 4):                       # down, gate, up
            loc[0, e, slot] = (0, off, sbytes[slot - 3])
            off += sbytes[slot - 3]
    return Layout(["f.safetensors"], [off], [3], E, loc, 4096)


def test_scale_reads_reach_the_drive_as_the_page_cache_with_readahead_decides():
    """The model's scale preads go through :mod:`replay.model.pagecache` in issue order (each expert's
    weights, then its gate, up and down scales): its drive reads are the weight reads and the
    scale preads a page cache fed the same preads says wait. Neighbours' scales share pages,
    and readahead serves more of them."""
    lay = scales_together_layout()
    tr = make_trace([[[0, 1, 2]], [[0, 1, 2]], [[5, 9, 12]]], sessions=[0, 0, 0])

    def by_hand(read_ahead):
        pc = new_page_cache(lay.expert_loc[:, :, 3:], lay.file_sizes, read_ahead, 0)
        counts = []
        for experts in ([0, 1, 2], [0, 1, 2], [5, 9, 12]):
            n = 0
            for e in experts:
                n += 1                               # its weight read
                for slot in (3, 4, 5):
                    f, off, nb = lay.expert_loc[0, e, slot]
                    n += buffered_read(pc, f, off, nb)[0] > 0
            counts.append(n)
        return counts

    for read_ahead in (0, 128 * 1024):
        dev = replace(one_drive(), read_ahead_bytes=read_ahead)
        inst, _ = simulate(tr, np.ones(3, bool), lay, dev, RuntimeConfig(workers=1, **NO_COMPUTE))
        assert inst.drive_reads.tolist() == by_hand(read_ahead)
    alone, ahead = by_hand(0), by_hand(128 * 1024)
    assert alone[1] == ahead[1] == 3                 # the second forward finds every scale cached
    assert ahead[0] < alone[0] < 12 and ahead[2] < alone[2] < 12


def test_straddling_expert_costs_three_weight_reads():
    lay = simple_layout()
    lay.expert_loc[0, 0, 1, 1] += 4096 * 1000  # move expert 0's up weight away: no longer adjacent
    lay.file_sizes[0] += 4096 * 1001
    tr = make_trace([[[0]]])
    inst, _ = simulate(tr, np.ones(1, bool), lay, one_drive(), RuntimeConfig(workers=1, **NO_COMPUTE))
    assert inst.reads.tolist() == [6]


def test_everything_resident_means_zero_stall():
    lay = simple_layout()
    tr = make_trace([[[0, 1, 2]], [[0, 1, 2]], [[2, 1, 0]]])
    pinned = np.zeros((1, 16), bool)
    pinned[0, :3] = True
    inst, _ = simulate(tr, np.ones(3, bool), lay, one_drive(), RuntimeConfig(workers=1), pinned)
    assert inst.stall.sum() == 0 and inst.reads.sum() == 0
    # an LRU large enough holds them after the first forward
    inst, _ = simulate(tr, np.ones(3, bool), lay, one_drive(), RuntimeConfig(workers=1, ram_bytes=10**9))
    assert inst.stall[0] > 0 and inst.stall[1:].sum() == 0


def test_compute_longer_than_io_with_enough_workers_hides_all_stall():
    lay = simple_layout()
    tr = make_trace([[[0, 1, 2, 3, 4, 5]]] * 4)
    pinned = np.zeros((1, 16), bool)
    pinned[0, :3] = True                    # experts 0-2 resident, 3-5 loaded
    slow = RuntimeConfig(workers=8, dense_seconds=0.0, compute_bytes_per_second=1e6)  # 32 KB -> 33 ms each
    inst, _ = simulate(tr, np.ones(4, bool), lay, one_drive(), slow, pinned)
    assert inst.stall.sum() == 0
    fast = RuntimeConfig(workers=8, **NO_COMPUTE)
    inst, _ = simulate(tr, np.ones(4, bool), lay, one_drive(), fast, pinned)
    assert inst.stall.sum() > 0


def test_md_striping_by_hand():
    md = ArrayProfile("md", DriveProfile("d", 1e-4, 1e9), 4, 512 * 1024, "md", 1e12, read_ahead_bytes=0)
    # 1 MiB starting 100 KiB into chunk 2: pieces on chunks 2, 3, 4 -> members 2, 3, 0
    pieces, nbytes = member_split(md, np.array([2 * 524288 + 102400]), np.array([1048576]))
    assert pieces.tolist() == [[1, 0, 1, 1]]
    assert nbytes.tolist() == [[102400, 0, 524288 - 102400, 524288]]
    # 9 chunks from chunk 0: member 0 gets chunks 0, 4, 8 -> three requests
    pieces, nbytes = member_split(md, np.array([0]), np.array([9 * 524288]))
    assert pieces.tolist() == [[3, 2, 2, 2]] and nbytes.sum() == 9 * 524288


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 6), st.sampled_from([512, 3000, 4096, 32768, 393216]), st.sampled_from(["md", "apple"]),
       st.integers(0, 10**6), st.integers(0, 200_000), st.sampled_from([None, 1000, 4096]))
def test_striping_matches_a_chunk_by_chunk_walk(members, chunk, rule, start, length, max_request):
    """Chunk sizes, member counts and request limits that are powers of two (split by shifts) and
    that are not (by division) split alike."""
    rule = rule if members > 1 else "none"
    dev = ArrayProfile("a", DriveProfile("d", 1e-4, 1e9, max_request_bytes=max_request), members, chunk, rule, 1e12,
                       read_ahead_bytes=0)
    pieces, nbytes = member_split(dev, np.array([start]), np.array([length]))
    want_bytes = [0] * members
    want_pieces = [0] * members
    pos = start
    while pos < start + length:                       # one chunk (or its part) at a time
        c = pos // chunk
        n = min((c + 1) * chunk, start + length) - pos
        want_bytes[c % members] += n
        want_pieces[c % members] += 1
        pos += n
    if rule != "md":
        want_pieces = [int(b > 0) for b in want_bytes]
    if max_request:
        want_pieces = [max(p, -(-b // max_request)) for p, b in zip(want_pieces, want_bytes)]
    assert nbytes[0].tolist() == want_bytes and pieces[0].tolist() == want_pieces


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 2), st.lists(st.integers(0, 11), max_size=6, unique=True)),
                min_size=1, max_size=40),
       st.lists(st.integers(0, 5), min_size=3, max_size=3), st.randoms(use_true_random=False))
def test_lru_matches_an_ordered_dict(steps, caps, rnd):
    # instances of up to 3 layers, sessions in runs; the reference is the runtime's LRU written
    # plainly: hits refreshed in lookup order, then the misses inserted in physical order
    rank = np.array([rnd.sample(range(12), 12) for _ in range(3)])
    steps = sorted(steps, key=lambda s: s[1])              # sessions contiguous, as in a trace
    inst_layer = np.array([s[0] for s in steps])
    inst_session = np.array([s[1] for s in steps])
    sels = [sorted(s[2]) for s in steps]
    sel_start = np.concatenate([[0], np.cumsum([len(x) for x in sels])])
    sel_e = np.array([e for x in sels for e in x], dtype=np.int64)
    pinned = np.zeros((3, 12), bool)
    pinned[:, 11] = True
    got = lru_hits(inst_layer, inst_session, sel_start, sel_e, np.array(caps), pinned, rank)
    want = []
    caches = {}
    for (li, sess, _), x in zip(steps, sels):
        lru = caches.setdefault((li, sess), OrderedDict())
        missed = []
        for e in x:
            if e == 11:
                want.append(True)
            elif e in lru:
                lru.move_to_end(e)
                want.append(True)
            else:
                want.append(False)
                missed.append(e)
        if caps[li] > 0:
            for e in sorted(missed, key=lambda e: rank[li, e]):
                lru[e] = None
            while len(lru) > caps[li]:
                lru.popitem(last=False)
    assert got.tolist() == want


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.lists(st.integers(-1, 9), min_size=3, max_size=3), min_size=1, max_size=4), min_size=1, max_size=6))
def test_batch_union_counts_positions_per_expert(forwards):
    rows = [r for f in forwards for r in f]
    row_start = np.concatenate([[0], np.cumsum([len(f) for f in forwards])])
    sel_start, sel_e, sel_mult = instance_unions(row_start, np.arange(len(rows)), np.array(rows, dtype=np.int16), 10)
    for i, f in enumerate(forwards):
        counts = Counter(e for r in f for e in r if e >= 0)
        a, b = sel_start[i], sel_start[i + 1]
        assert sel_e[a:b].tolist() == sorted(counts) and sel_mult[a:b].tolist() == [counts[e] for e in sorted(counts)]


def test_apple_striping_by_hand():
    apple = ArrayProfile("apple", DriveProfile("d", 1e-4, 1e9), 4, 32768, "apple", 1e12, read_ahead_bytes=0)
    pieces, nbytes = member_split(apple, np.array([0]), np.array([18915328]))  # a GLM expert
    assert pieces.tolist() == [[1, 1, 1, 1]]
    assert nbytes.tolist() == [[4751360, 4726784, 4718592, 4718592]]  # 577 chunks: 145, 144, 144, 144
    pieces, nbytes = member_split(apple, np.array([32768 + 10]), np.array([100]))
    assert pieces.tolist() == [[0, 1, 0, 0]] and nbytes.tolist() == [[0, 100, 0, 0]]


def test_lru_evicts_least_recently_used_and_resets_per_session():
    # instances of one layer; capacity 2
    inst_layer = np.zeros(5, dtype=np.int64)
    inst_session = np.array([0, 0, 0, 0, 1])
    seq = [[1], [2], [1], [3], [1]]           # 1 hit at i=2; 3 evicts 2; new session: 1 misses
    sel_start = np.concatenate([[0], np.cumsum([len(s) for s in seq])])
    sel_e = np.concatenate(seq)
    hits = lru_hits(inst_layer, inst_session, sel_start, sel_e, np.array([2]), np.zeros((1, 8), bool))
    assert hits.tolist() == [False, False, True, False, False]


def test_rejected_positions_charge_stall_but_not_tokens():
    lay = simple_layout()
    tr = make_trace([[[0, 1], [2, 3]], [[4, 5], [6, 7]]], committed=[1, 1], evaluated=[2, 2])
    mask = np.ones(2, bool)
    inst, usage = simulate(tr, mask, lay, one_drive(), RuntimeConfig(workers=1, **NO_COMPUTE))
    steps = step_table(tr, mask, inst)
    s = summarize(steps, usage, 0.0)
    assert inst.misses.tolist() == [4, 4]  # the union of both positions is loaded
    assert s.committed_tokens == 2 and s.evaluated_positions == 4
    assert s.stall_per_token_s == pytest.approx(inst.stall.sum() / 2)


def test_paired_bootstrap_interval():
    base = np.array([10.0, 11, 9, 10, 12])
    same = paired_saving(base, base, np.ones(5), "session")
    assert same.estimate == same.low == same.high == 0
    better = paired_saving(base, base - 1, np.ones(5), "session")
    assert better.low == pytest.approx(1) and better.high == pytest.approx(1)
    noisy = paired_saving(base, base - np.array([2, 0, 1, 3, -1]), np.ones(5), "session")
    assert noisy.low < noisy.estimate < noisy.high


# ---------------------------------------------------------------- both directions of the gate


def plan_for(tmp_path, g, tr, name):
    p = make_plan(tr, source_from_geometry(g), progress=False)
    path = tmp_path / f"{name}.json"
    save_plan(p, path)
    return load_plan(path)


@pytest.mark.slow
def test_glm_whole_experts_default_runtime_show_no_headroom(tmp_path):
    g = load_geometry("glm-5.2-int4-row")
    tr = synth_trace(g.moe_layers, 256, 8, 170, 17, seed=3, params=SynthParams(clique_strength=0.9))   # 5 held out
    plan = plan_for(tmp_path, g, tr, "glm")
    gate = compare(plan, tr, load_device("mac-pro-2019-applraid-4x"), RuntimeConfig()).to_json()
    assert gate["verdict"] == "fail"
    assert "No headroom" in gate["reason"]
    assert abs(gate["saving_fraction_of_tpot"]["estimate"]) < 0.02


@pytest.fixture(scope="module")
def small_expert_case(tmp_path_factory):
    g = load_geometry("qwen3-30b-a3b").scaled(moe_layers=6, ffn=384)   # 1.19 MB experts
    tr = synth_trace(g.moe_layers, 128, 8, 1700, 17, seed=1, params=SynthParams(clique_strength=0.9))   # 5 held out
    return g, tr, plan_for(tmp_path_factory.mktemp("p"), g, tr, "small")


def test_small_experts_coalesced_with_few_workers_show_a_clear_gain(small_expert_case):
    g, tr, plan = small_expert_case
    dev = load_device("mac-pro-2019-applraid-4x")
    gate = compare(plan, tr, dev, RuntimeConfig(workers=1, coalesce=True)).to_json()
    assert gate["verdict"] == "pass", gate["reason"]
    assert gate["saving_per_token_s"]["low"] > 0.05 * gate["baseline_metrics"]["tpot_s"]
    assert gate["plan_metrics"]["reads_per_token"] < gate["baseline_metrics"]["reads_per_token"]
    # two workers: still a gain on md RAID-0, whose 512 KiB chunks cost a request per MB per read
    assert compare(plan, tr, load_device("linux-md-raid0-4x"), RuntimeConfig(workers=2, coalesce=True)).verdict == "pass"


def test_gain_shrinks_toward_the_bandwidth_bound_as_workers_rise(small_expert_case):
    g, tr, plan = small_expert_case
    dev = load_device("linux-md-raid0-4x")
    savings, headroom = [], []
    for w in (1, 2, 4, 8):
        gate = compare(plan, tr, dev, RuntimeConfig(workers=w, coalesce=True)).to_json()
        savings.append(gate["saving_fraction_of_tpot"]["estimate"])
        headroom.append(gate["headroom"]["max_saving_fraction_of_tpot"])
        assert gate["plan_metrics"]["stall_per_token_s"] >= gate["headroom"]["oracle_stall_s"] * 0.999
    assert savings[0] > savings[1] > savings[3]
    assert headroom[0] > headroom[1] > headroom[3]
    assert abs(savings[3]) < headroom[3]  # what is left is within what bandwidth alone allows


def test_replay_is_deterministic_and_refuses_training_sessions(small_expert_case):
    g, tr, plan = small_expert_case
    dev = load_device("linux-md-raid0-4x")
    a = compare(plan, tr, dev, RuntimeConfig(workers=2)).to_json()
    b = compare(plan, tr, dev, RuntimeConfig(workers=2)).to_json()
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
    assert set(a["trace"]["sessions_excluded_as_training"]) == set(plan.training_sessions)
    assert not set(a["trace"]["sessions_evaluated"]) & set(plan.training_sessions)
    only_train = tr.subset(list(range(len(plan.training_sessions))))
    with pytest.raises(InputError, match="held-out"):
        compare(plan, only_train, dev, RuntimeConfig())


def test_more_ram_never_lowers_the_hit_rate(small_expert_case):
    g, tr, plan = small_expert_case
    dev = load_device("single-nvme")
    rates = [compare(plan, tr, dev, RuntimeConfig(ram_bytes=int(x * 1e9))).baseline_metrics.ram_hit_rate for x in (0, 0.2, 0.5, 2)]
    assert rates == sorted(rates) and rates[0] == 0 and rates[-1] > 0.5


@pytest.mark.parametrize("prefetch", ["none", "coupled"])
def test_gate_record_matches_its_schema(small_expert_case, tmp_path, prefetch):
    import jsonschema
    from conftest import REPO

    from containers.atomic import write_json_atomic

    g, tr, plan = small_expert_case
    record = compare(plan, tr, load_device("single-nvme"), RuntimeConfig(workers=2, prefetch=prefetch))
    gate = record.to_json()
    write_json_atomic(tmp_path / "gate.json", gate)
    jsonschema.validate(json.loads((tmp_path / "gate.json").read_text()),
                        json.loads((REPO / "manifests/schemas/gate.schema.json").read_text()))
    assert (gate["baseline_metrics"]["prefetch"] is None) == (prefetch == "none")
    from replay.formats.gatefile import GateRecord, load_gate

    assert load_gate(tmp_path / "gate.json") == record          # the typed record reads back exactly
    broken = json.loads(json.dumps(gate))
    broken["baseline_metrics"]["steps"] = 1.5
    with pytest.raises(InputError, match=r"gate record: gate record.baseline_metrics.steps is 1.5, not an integer"):
        GateRecord.from_json(broken, "gate.json")


# ---- prefetch: layer 3 is routed, the prefetcher loads layer 4's predicted experts until layer 4 is routed

TWO_LAYERS = dict(layers=(3, 4))
EXPERT = 32768 + 3 * 4096               # simple_layout: weights + scales, bytes


def two_layer_case(ram_bytes=0, dense=0.0, **kw):
    """One forward: layer 3 needs experts 0 and 1, layer 4 needs 2 and 3; no matmul time."""
    lay = simple_layout(layers=(3, 4))
    tr = make_trace([[[0, 1]]], **TWO_LAYERS)
    tr.experts[1] = [2, 3]
    cfg = RuntimeConfig(workers=1, ram_bytes=ram_bytes, dense_seconds=dense, compute_bytes_per_second=1e30, **kw)
    return lay, tr, cfg


def test_oracle_prefetch_with_time_to_spare_removes_the_next_layers_stall():
    lay, tr, none = two_layer_case(dense=0.01)
    base, _ = simulate(tr, np.ones(1, bool), lay, one_drive(), none)
    inst, _ = simulate(tr, np.ones(1, bool), lay, one_drive(), replace(none, prefetch="oracle"))
    per_expert = (1e-4 + 32768 / 1e9) + 3 * (1e-4 + 4096 / 1e9)
    assert base.stall.tolist() == pytest.approx([2 * per_expert, 2 * per_expert], rel=1e-12)
    assert inst.stall[1] == 0
    # the runtime queues layer 4's loads when layer 3 is routed (colibri's couple_prefetch): the
    # prefetch thread and the demand worker alternate on the drive, the prefetch thread first, so
    # each demand read waits for the transfer queued before it: one 32 KiB weight transfer in all
    assert inst.stall[0] == pytest.approx(2 * per_expert + 32768 / 1e9, rel=1e-12)
    assert inst.hits.tolist() == [0, 2] and inst.reads.sum() == base.reads.sum()
    p = inst.prefetch
    assert p.issued.tolist() == [2 * EXPERT, 0] and p.required.tolist() == [2 * EXPERT, 2 * EXPERT]
    assert p.timely.tolist() == [0, 2 * EXPERT] and p.unused.sum() == 0
    # the loads end per_expert and 2 x per_expert after layer 3 is routed (the drive serves the
    # prefetch thread's reads first); layer 4 is routed 10 ms after layer 3's compute ends
    routed = inst.stall[0] + 0.01
    assert p.slack.sum() == pytest.approx((routed - per_expert) + (routed - 2 * per_expert), rel=1e-9)
    # a controlled prefetcher (here a byte budget that admits both) keeps demand's strict priority
    held, _ = simulate(tr, np.ones(1, bool), lay, one_drive(), replace(none, prefetch="oracle", prefetch_bytes=10**9))
    assert held.stall[0] == pytest.approx(base.stall[0], rel=1e-12) and held.stall[1] == 0
    assert held.prefetch.slack.sum() == pytest.approx((0.01 - per_expert) + (0.01 - 2 * per_expert), rel=1e-9)


def test_prefetch_with_no_time_before_the_next_layer_changes_nothing():
    lay, tr, none = two_layer_case(dense=0.0)
    base, _ = simulate(tr, np.ones(1, bool), lay, one_drive(), none)
    # demand first: the prefetcher starts when layer 3's demand loads are done, which is when
    # layer 4 is routed (no compute, no dense time)
    held, _ = simulate(tr, np.ones(1, bool), lay, one_drive(), replace(none, prefetch="oracle", prefetch_bytes=10**9))
    assert held.stall.tolist() == base.stall.tolist() and held.prefetch.issued.sum() == 0
    assert held.prefetch.required[1] == 2 * EXPERT and held.prefetch.timely.sum() == 0
    assert held.prefetch.cancelled[0] == 2
    # the runtime's rule queued them at routing: they load beside layer 3's demand reads, in time
    inst, _ = simulate(tr, np.ones(1, bool), lay, one_drive(), replace(none, prefetch="oracle"))
    assert inst.stall[1] == 0 and inst.prefetch.timely[1] == 2 * EXPERT and inst.prefetch.cancelled.sum() == 0


def test_a_wrong_prefetch_in_flight_delays_the_demand_it_did_not_predict():
    lay, tr, none = two_layer_case(dense=1e-5)
    targets, counts = np.full((2, 16, 4), -1), np.zeros((2, 16, 4), dtype=np.int64)
    targets[0, 0, 0], counts[0, 0, 0] = 9, 5             # "after expert 0 comes expert 9": wrong
    table = (targets, counts)
    base, _ = simulate(tr, np.ones(1, bool), lay, one_drive(), none)
    inst, _ = simulate(tr, np.ones(1, bool), lay, one_drive(), replace(none, prefetch="coupled"), coupling=table)
    assert inst.prefetch.issued[0] == EXPERT and inst.prefetch.unused[1] == EXPERT
    assert inst.prefetch.timely.sum() == 0
    # queued at routing (the runtime's rule), expert 9's reads share the drive with layer 3's demand
    assert inst.stall[0] > base.stall[0] and inst.stall[1] == base.stall[1]
    # after layer 3's demand (a controlled prefetcher), it is in flight when layer 4 is routed
    held, _ = simulate(tr, np.ones(1, bool), lay, one_drive(), replace(none, prefetch="coupled", prefetch_bytes=10**9),
                       coupling=table)
    assert held.prefetch.issued[0] == EXPERT and held.stall[0] == base.stall[0]
    assert held.stall[1] > base.stall[1]                 # the drive was busy with expert 9
    # with a cache, a wrong prefetch also takes a slot: here it evicts layer 4's expert 2
    lay, tr, none = two_layer_case(dense=0.01, ram_bytes=2 * 2 * EXPERT)   # one expert per layer
    tr2 = make_trace([[[0, 1]], [[0, 1]]], **TWO_LAYERS)
    tr2.experts[1] = [2, 0]
    tr2.experts[3] = [2, 0]
    targets[0, 1, 0], counts[0, 1, 0] = 9, 5
    base, _ = simulate(tr2, np.ones(2, bool), lay, one_drive(), none)
    inst, _ = simulate(tr2, np.ones(2, bool), lay, one_drive(), replace(none, prefetch="coupled"), coupling=table)
    assert inst.hits.sum() < base.hits.sum()


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 11), min_size=1, max_size=5, unique=True), st.integers(1, 8), st.integers(0, 2**31))
def test_coupled_prediction_is_the_k_best_scores(union, k, seed):
    from replay.model.prefetch import COUPLED, PairTable, RouterPilot, Scratch, Selections, predict_next

    rng = np.random.default_rng(seed)
    targets = np.full((1, 12, 4), -1, dtype=np.int32)
    counts = np.zeros((1, 12, 4), dtype=np.int32)
    for e in range(12):
        n = int(rng.integers(0, 5))
        targets[0, e, :n] = rng.choice(12, n, replace=False)
        counts[0, e, :n] = rng.integers(1, 4, n)          # few values: ties happen
    sel_e = np.array(sorted(union) + [0], dtype=np.int64)
    sel_start = np.array([0, len(union), len(union) + 1])
    score, out = np.zeros(12, dtype=np.int64), np.empty(12, dtype=np.int64)
    n = predict_next(COUPLED, 0, 0, Selections(sel_start=sel_start, sel_e=sel_e, sel_mult=np.ones(len(sel_e), dtype=np.int64)),
                     PairTable(targets=targets, counts=counts), k, Scratch(score=score, touched=np.empty(12, dtype=np.int64)), out,
                     RouterPilot(precision=0.0, forward=0, positions=1, heat=np.zeros((1, 1), np.int64)))
    want = np.zeros(12, dtype=np.int64)
    for e in union:
        for f, c in zip(targets[0, e], counts[0, e]):
            if f >= 0:
                want[f] += c
    best = sorted((f for f in range(12) if want[f] > 0), key=lambda f: (-want[f], f))[:k]
    assert out[:n].tolist() == best and not score.any()


def test_coupled_source_learns_which_experts_follow(tmp_path):
    from replay.model.coupling import coupling_table

    # layer 4 always picks the two experts after layer 3's: a coupling a table can learn
    rng = np.random.default_rng(0)
    rows = []
    for f in range(40):
        a = sorted(rng.choice(14, 2, replace=False).tolist())
        rows.append(a)
    tr = make_trace([[r] for r in rows], sessions=[0] * 20 + [1] * 20, **TWO_LAYERS)
    tr.experts[1::2] = tr.experts[0::2] + 2
    train = tr.session_forward_mask([0])
    targets, counts = coupling_table(tr, train, simple_layout(layers=(3, 4)))
    want = np.zeros((16, 16), dtype=np.int64)
    for a in tr.experts[0:40:2]:
        for e in a:
            for f in a + 2:
                want[e, f] += 1
    for e in range(16):                                  # each expert's successors, best first, ties by id
        ranked = sorted((f for f in range(16) if want[e, f]), key=lambda f: (-want[e, f], f))[:16]
        assert targets[0, e, :len(ranked)].tolist() == ranked
        assert counts[0, e, :len(ranked)].tolist() == [want[e, f] for f in ranked]
    assert (targets[1] == -1).all()                      # the last layer has no next layer
    table = (targets, counts)
    lay, _, cfg = two_layer_case(dense=0.01)
    test = tr.session_forward_mask([1])
    coupled, _ = simulate(tr, test, lay, one_drive(), replace(cfg, prefetch="coupled", prefetch_experts=2), coupling=table)
    oracle, _ = simulate(tr, test, lay, one_drive(), replace(cfg, prefetch="oracle", prefetch_experts=2))

    def next_layer_recall(inst):                         # over layer 4, the layer that was predicted
        on = inst.layer == 1
        return inst.prefetch.timely[on].sum() / inst.prefetch.required[on].sum()

    assert next_layer_recall(coupled) > 0.5 and next_layer_recall(oracle) == 1.0


def test_a_first_compile_says_so_and_a_cached_run_says_nothing(capsys):
    from numba import njit

    from replay.model.jit import compile_notice

    @njit
    def twice(x):
        return 2 * x

    with compile_notice():
        assert twice(21) == 42
    assert "compiling the replay model with numba, once on this machine" in capsys.readouterr().err
    with compile_notice():
        assert twice(4) == 8          # already compiled: silent
    assert capsys.readouterr().err == ""


def test_top_targets_pads_when_a_layer_has_fewer_experts_than_targets():
    from replay.model.coupling import top_targets

    X = np.array([[0, 3, 1], [2, 0, 0], [0, 0, 0]])
    targets, counts = top_targets(X, 5)
    assert targets.shape == counts.shape == (3, 5)
    assert targets[0].tolist() == [1, 2, -1, -1, -1] and counts[0].tolist() == [3, 1, 0, 0, 0]
    assert targets[2].tolist() == [-1] * 5


def test_the_models_lru_takes_misses_in_physical_order_as_the_harness_does(tmp_path):
    """With a layout whose physical order is not the expert ids', the replay model's RAM hits
    are those of an LRU that inserts each instance's misses in physical order (the order the
    harness inserts them in, and their loads complete in), not in lookup order: the two orders
    give different hits here, so a model inserting by id fails."""
    from replay.model.engine import layout_arrays
    from replay.model.unions import chunk_instances, whole_forward_blocks

    g = load_geometry("glm-5.2-int4-row").scaled(moe_layers=3)       # GLM's first three MoE layers, its experts
    tr = synth_trace(g.moe_layers, 256, 8, 400, 2, seed=11, geometry=g.name)
    src = source_from_geometry(g)
    save_plan(make_plan(tr, src, "random", progress=False), tmp_path / "plan.json")
    plan = load_plan(tmp_path / "plan.json")
    cfg = RuntimeConfig(ram_bytes=int(0.2 * plan.layout.expert_bytes()[:3].sum()))
    mask = np.ones(tr.n_forwards, bool)
    inst, _ = simulate(tr, mask, plan.layout, load_device("single-nvme"), cfg)
    (chunk,) = list(chunk_instances(whole_forward_blocks(tr, tr.n_forwards), mask, tr.fwd_session, plan.layout))

    caps = lru_capacities(cfg.ram_bytes, plan.layout.expert_bytes()[:, 0])
    pinned = np.zeros((len(plan.layout.layers), plan.layout.n_experts), bool)
    rank = layout_arrays(plan.layout, cfg, None).rank
    args = (chunk.layer, chunk.session, chunk.sel_start, chunk.sel_e, caps, pinned)
    by_place = lru_hits(*args, rank)
    per_instance = np.add.reduceat(by_place.astype(np.int64), chunk.sel_start[:-1])
    assert inst.hits.tolist() == per_instance.tolist()
    assert by_place.tolist() != lru_hits(*args).tolist()


@njit
def _fetched_sum(a, i):
    fetch_lines(a[i])
    fetch_lines(a[i, :0])
    fetch_lines(a[i, 1:2])
    return a[i].sum()


def test_fetching_rows_into_the_cpu_caches_changes_no_value():
    a = np.arange(60.0).reshape(3, 20)
    before = a.copy()
    assert _fetched_sum(a, 1) == before[1].sum()
    assert np.array_equal(a, before)
