"""colibrì's router pilot (PILOT_REAL) in the replay model: its drawn predictions, its eviction
guard, the barrier each layer waits at, and the engine configuration that turns them on."""

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from conftest import make_trace
from hypothesis import given, settings
from hypothesis import strategies as st

from containers.errors import InputError
from replay.colibri.engine_config import EngineConfig, config_from_run, model_config, parse_runtime_env
from replay.colibri.engine_output import read_run
from replay.model.config import RuntimeConfig
from replay.model.engine import simulate
from replay.model.prefetch import PILOT, PairTable, RouterPilot, Scratch, Selections, predict_next
from replay.model.runtime import Heat, guard_protects
from test_replay import EXPERT, one_drive, simple_layout

PILOT_RUN = Path(__file__).parent / "data" / "engine" / "pilot-looka"


def _draw(truth, precision, k=6, E=32, forward=0, heat=None, positions=1):
    """The pilot's list for layer 1 given layer 0's union (one expert, unused) and layer 1's ``truth``."""
    sel_e = np.array([0] + sorted(truth), dtype=np.int64)
    sel_start = np.array([0, 1, len(sel_e)], dtype=np.int64)
    mult = np.ones(len(sel_e), dtype=np.int64)
    heat = np.zeros((2, E), np.int64) if heat is None else heat
    out = np.empty(64, np.int64)
    score = np.zeros(E, np.int64)
    n = predict_next(PILOT, 0, 0, Selections(sel_start, sel_e, mult), PairTable(np.full((1, 1, 1), -1), np.zeros((1, 1, 1))),
                     k, Scratch(score, np.empty(E, np.int64)), out, RouterPilot(precision, forward, positions, heat))
    assert not score.any()                       # the scratch is handed back clean
    return out[:n].tolist()


def test_a_pilot_that_is_always_right_predicts_the_next_layers_experts():
    truth = [3, 7, 11, 20, 21, 30]
    assert sorted(_draw(truth, 1.0)) == truth
    assert _draw(truth, 1.0, forward=5) == _draw(truth, 1.0, forward=5)     # a draw is fixed by its forward
    # PILOT_K below the router's top-k: that many per position, a share of them right
    assert len(_draw(truth, 1.0, k=4)) == 4 and set(_draw(truth, 1.0, k=4)) <= set(truth)


def test_a_pilot_that_is_never_right_draws_the_sessions_favourites():
    truth = [3, 7, 11, 20, 21, 30]
    wrong = _draw(truth, 1e-12)
    assert len(wrong) == 6 and len(set(wrong)) == 6 and not set(wrong) & set(truth)
    heat = np.zeros((2, 32), np.int64)
    heat[1, 9] = 10**9                           # layer 1's expert 9: routed far more than any other
    assert 9 in _draw(truth, 1e-12, heat=heat)
    assert 9 not in _draw(truth, 1e-12)


@settings(max_examples=20, deadline=None)
@given(st.floats(0.1, 0.9))
def test_the_share_of_right_predictions_is_the_precision_given(precision):
    rng = np.random.default_rng(0)
    right = total = 0
    for f in range(1500):
        truth = sorted(rng.choice(32, 6, replace=False).tolist())
        got = _draw(truth, precision, forward=f)
        right += len(set(got) & set(truth))
        total += len(got)
    assert total == 1500 * 6
    assert right / total == pytest.approx(precision, abs=0.03)


def _heat(count, last, clock):
    return Heat(np.array([count], np.int64), np.array([last], np.int64), np.array([clock], np.int64), np.zeros(1, np.int64))


def test_the_eviction_guard_keeps_a_warm_expert_from_a_colder_speculation():
    # expert 0: 5 selections, the last 10 ago (score 5*256 + 245); expert 1: 3 selections, long ago
    h = _heat([5, 3, 12, 1], [990, 0, 0, 1000], 1000)
    assert guard_protects(h, 0, 0, 1)                  # 1525 + 381 + 1024 > 768
    assert not guard_protects(h, 0, 0, 2)              # 12 selections: 3072 is above 2930
    assert not guard_protects(h, 0, 3, 1)              # a victim selected once is never protected


def _two_layers(forwards, ram_experts, **kw):
    """Layers 3 and 4, one position per forward: layer 3 routes expert 0, layer 4 the given expert."""
    lay = simple_layout(layers=(3, 4))
    tr = make_trace([[[0]]] * len(forwards), layers=(3, 4))
    for f, e in enumerate(forwards):
        tr.experts[2 * f + 1] = [e]
    cfg = RuntimeConfig(workers=1, ram_bytes=2 * ram_experts * EXPERT, dense_seconds=1e-5, compute_bytes_per_second=1e30,
                        prefetch="pilot", prefetch_experts=1, **kw)
    return lay, tr, cfg


def test_a_layer_waits_whole_for_the_pilots_loads_as_other_time_not_stall():
    lay, tr, cfg = _two_layers([2], ram_experts=2, pilot_precision=1.0)
    pinned = np.zeros((2, 16), bool)
    pinned[0, 0] = True                          # layer 3 reads nothing: layer 4 is routed while the pilot loads
    waited, _ = simulate(tr, np.ones(1, bool), lay, one_drive(), replace(cfg, layer_barrier=True), pinned)
    assert waited.prefetch.loads[0] == 1 and waited.hits[1] == 1 and waited.stall[1] == 0
    assert waited.prefetch.barrier[1] > 0
    # without the barrier the same load in flight is waited for by its expert's matmul: stall
    felt, _ = simulate(tr, np.ones(1, bool), lay, one_drive(), cfg, pinned)
    assert felt.stall[1] > 0 and felt.prefetch.barrier.sum() == 0
    assert felt.stall[1] == pytest.approx(waited.prefetch.barrier[1], rel=1e-9)


def test_the_guard_drops_a_cold_speculation_that_would_evict_a_warm_expert():
    # layer 4 keeps one expert and routes expert 2 every time; the pilot is always wrong
    lay, tr, cfg = _two_layers([2, 2, 2, 2], ram_experts=1, pilot_precision=1e-12, layer_barrier=True)
    guarded, _ = simulate(tr, np.ones(4, bool), lay, one_drive(), replace(cfg, evict_guard=True))
    plain, _ = simulate(tr, np.ones(4, bool), lay, one_drive(), cfg)
    layer4 = guarded.layer == 1
    # forward 0 fills a free slot; forward 1's victim was selected once (not warm): both loads go
    # ahead and evict expert 2; from forward 2 on expert 2 is warm and stays
    assert guarded.prefetch.rejected.sum() == 2 and guarded.prefetch.loads.sum() == 2
    assert guarded.hits[layer4].tolist() == [0, 0, 1, 1]
    assert plain.hits[layer4].tolist() == [0, 0, 0, 0] and plain.prefetch.loads.sum() == 4


def test_the_pilot_skips_forwards_of_more_than_eight_positions():
    lay = simple_layout(layers=(3, 4))
    cfg = RuntimeConfig(workers=1, ram_bytes=4 * EXPERT, dense_seconds=1e-5, compute_bytes_per_second=1e30,
                        prefetch="pilot", prefetch_experts=1, pilot_precision=1.0, layer_barrier=True,
                        engine_env="PILOT_REAL=1")
    for positions, loads in ((8, 1), (9, 0)):
        tr = make_trace([[[p % 16] for p in range(positions)]], layers=(3, 4))
        inst, _ = simulate(tr, np.ones(1, bool), lay, one_drive(), cfg)
        assert (inst.prefetch.loads.sum() > 0) == bool(loads)
    # relayout's own prefetch thread (no colibrì configuration) works for every forward
    inst, _ = simulate(tr, np.ones(1, bool), lay, one_drive(), replace(cfg, engine_env=""))
    assert inst.prefetch.loads.sum() > 0


def test_a_pilot_run_says_its_configuration_and_its_precision():
    run = read_run(PILOT_RUN)
    hits, total = run.output.pilot_lookahead
    assert 0 < hits < total and run.output.pilot_loads > 0 and run.output.pilot_drops >= 0
    cfg, facts = config_from_run(PILOT_RUN)
    assert cfg.PILOT_REAL == 1 and cfg.PILOT == 1 and cfg.PILOT_K == 6 and cfg.PILOT_EVICT_GUARD == 1
    assert facts.pilot_precision == pytest.approx(hits / total)
    assert facts.between_layers_seconds > 0
    m = model_config(cfg, RuntimeConfig(), 4, pilot_precision=facts.pilot_precision)
    assert (m.prefetch, m.prefetch_experts, m.evict_guard, m.layer_barrier) == ("pilot", 6, True, True)
    assert "PILOT_REAL" in m.engine_env and m.runtime_changes == []
    off = model_config(parse_runtime_env("PILOT_REAL=1 PILOT_EVICT_GUARD=0 PILOT_K=3"), RuntimeConfig(), 4,
                       pilot_precision=0.5)
    assert (off.prefetch_experts, off.evict_guard) == (3, False)


def test_what_the_model_does_not_run_of_the_prefetchers_is_refused_by_name():
    with pytest.raises(InputError, match="COUPLE_D=2"):
        model_config(parse_runtime_env("PILOT_REAL=1 COUPLE=pairs.txt COUPLE_D=2"), RuntimeConfig(), 4, pilot_precision=0.5)


@pytest.mark.parametrize("env, threads", [
    ("PILOT_REAL=1 PILOT_WORKERS=4", 4),
    ("PILOT_REAL=1", 1),
    ("PILOT_REAL=1 PILOT_WORKERS=4 URING=1", 1),       # colibrì drains its ring with one io_uring thread
    ("PILOT=1 PILOT_WORKERS=4", 1),                    # hints: one fadvise thread
])
def test_pilot_workers_load_the_pilots_queue_only_where_colibri_fans_out(env, threads):
    assert model_config(parse_runtime_env(env), RuntimeConfig(), 4, pilot_precision=0.5).pilot_workers == threads


def test_several_pilot_threads_need_the_router_pilot_on_a_blocking_read_path():
    with pytest.raises(InputError, match="PILOT_WORKERS"):
        RuntimeConfig(prefetch="pilot", pilot_precision=0.5, pilot_workers=2)
    with pytest.raises(InputError, match="1-16"):
        RuntimeConfig(prefetch="pilot", pilot_precision=0.5, layer_barrier=True, pilot_workers=17)


@pytest.mark.parametrize("service", ["in-order", "shared"])
def test_pilot_threads_start_as_many_loads_as_they_are_before_the_next_layer(service):
    """Layer 3 reads nothing, so layer 4 is routed almost at once: one pilot thread has started one
    of its four loads by then, four threads all four. The loads in flight overlap on the drive, so
    the layer's barrier for four is well under four loads' time, and nothing is left to stall."""
    lay = simple_layout(layers=(3, 4))
    tr = make_trace([[[0, 1, 6, 7]]], layers=(3, 4))
    tr.experts[1] = [2, 3, 4, 5]
    pinned = np.zeros((2, 16), bool)
    pinned[0, [0, 1, 6, 7]] = True
    cfg = RuntimeConfig(workers=1, ram_bytes=2 * 8 * EXPERT, dense_seconds=1e-5, compute_bytes_per_second=1e30,
                        prefetch="pilot", prefetch_experts=4, pilot_precision=1.0, layer_barrier=True)
    drive = one_drive()
    drive = replace(drive, drive=replace(drive.drive, service=service))
    one, _ = simulate(tr, np.ones(1, bool), lay, drive, cfg, pinned)
    four, _ = simulate(tr, np.ones(1, bool), lay, drive, replace(cfg, pilot_workers=4), pinned)
    assert (one.prefetch.loads.sum(), one.prefetch.cancelled.sum(), one.hits[1]) == (1, 3, 1)
    assert (four.prefetch.loads.sum(), four.prefetch.cancelled.sum(), four.hits[1]) == (4, 0, 4)
    assert one.stall[1] > 0 and four.stall[1] == 0
    assert 0 < four.prefetch.barrier[1] < 2 * one.prefetch.barrier[1]


@pytest.mark.parametrize("service", ["in-order", "shared"])
def test_pilot_threads_share_the_drive_with_the_layers_demand_loads(service):
    """The pilot threads' reads interleave with the demand worker's: every queued load completes
    while layer 3 loads its own four experts, and layer 4 finds all four. Drives that serve reads
    in order make the demand loads wait longer beside four pilot threads than beside one; drives
    that share their channel fairly finish the same bytes at the same time either way."""
    lay = simple_layout(layers=(3, 4))
    tr = make_trace([[[0, 1, 6, 7]]], layers=(3, 4))
    tr.experts[1] = [2, 3, 4, 5]
    cfg = RuntimeConfig(workers=1, ram_bytes=2 * 8 * EXPERT, dense_seconds=1e-5, compute_bytes_per_second=1e30,
                        prefetch="pilot", prefetch_experts=4, pilot_precision=1.0, layer_barrier=True)
    drive = one_drive(latency=1e-5, bw=2e8)
    drive = replace(drive, drive=replace(drive.drive, service=service))
    one, _ = simulate(tr, np.ones(1, bool), lay, drive, cfg)
    four, _ = simulate(tr, np.ones(1, bool), lay, drive, replace(cfg, pilot_workers=4))
    for r in (one, four):
        assert (r.prefetch.loads.sum(), r.prefetch.cancelled.sum(), r.hits[1], r.stall[1]) == (4, 0, 4, 0)
    if service == "in-order":
        assert four.stall[0] > one.stall[0]
    else:
        assert four.stall[0] == pytest.approx(one.stall[0], rel=1e-12)


def test_the_router_pilot_needs_its_measured_precision():
    with pytest.raises(InputError, match="LOOKA=1"):
        model_config(EngineConfig(PILOT_REAL=1), RuntimeConfig(), 4)
    with pytest.raises(InputError, match="precision"):
        RuntimeConfig(prefetch="pilot")


def _pairs_file(path, lines):
    from replay.formats.colipairs import write_coli_pairs_lines

    write_coli_pairs_lines(path, lines)
    return str(path)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(1, 2), st.integers(0, 7),
                          st.lists(st.tuples(st.integers(0, 7), st.integers(0, 2**31 - 1)), min_size=1, max_size=16)),
                max_size=12, unique_by=lambda t: t[:3]))
def test_a_pair_file_reads_back_as_its_next_layer_table(tmp_path_factory, lines):
    from replay.formats.colipairs import read_coli_pairs

    path = _pairs_file(tmp_path_factory.mktemp("pairs") / "t.coli_pairs", lines)
    targets, counts = read_coli_pairs(path, [0, 1, 2], 8)
    want_t, want_c = np.full((3, 8, 16), -1), np.zeros((3, 8, 16))
    for layer, dl, e, pairs in lines:
        if dl == 1 and layer < 2:                  # layer 2 has no next layer in the layout; distance 2 is not kept
            for t, (f, c) in enumerate(pairs):
                want_t[layer, e, t], want_c[layer, e, t] = f, c
    assert (targets == want_t).all() and (counts == want_c).all()


@pytest.mark.parametrize("text, words", [
    ("PAIRS 1 0\n", "header"),
    ("COLIPAIRS 1 2\n0 1 3 4:5\n", "announces 2"),
    ("COLIPAIRS 1 1\n0 1 3 4=5\n", "line 2"),
    ("COLIPAIRS 1 1\n0 3 3 4:5\n", "distance 1 or 2"),
    ("COLIPAIRS 1 1\n0 1 9 4:5\n", "experts below 8"),
    ("COLIPAIRS 1 2\n0 1 3 4:5\n0 1 3 5:5\n", "given twice"),
])
def test_a_bad_pair_file_is_refused_naming_its_line(tmp_path, text, words):
    from replay.formats.colipairs import read_coli_pairs

    (tmp_path / "bad").write_text(text)
    with pytest.raises(InputError, match=words):
        read_coli_pairs(tmp_path / "bad", [0, 1], 8)


def test_couple_queues_its_tables_best_after_the_pilots(tmp_path):
    # the pilot is always wrong; COUPLE's table says layer 4's expert 2 follows layer 3's expert 0
    lay, tr, cfg = _two_layers([2], ram_experts=2, pilot_precision=1e-12, layer_barrier=True)
    cfg = replace(cfg, dense_seconds=0.01)       # time for both loads before layer 4
    path = _pairs_file(tmp_path / "p.coli_pairs", [(3, 1, 0, [(2, 9)])])
    from replay.formats.colipairs import read_coli_pairs

    table = read_coli_pairs(path, lay.layers, lay.n_experts)
    pinned = np.zeros((2, 16), bool)
    pinned[0, 0] = True
    alone, _ = simulate(tr, np.ones(1, bool), lay, one_drive(), cfg, pinned)
    both, _ = simulate(tr, np.ones(1, bool), lay, one_drive(), replace(cfg, couple_file=path, couple_experts=8), pinned,
                       coupling=table)
    assert alone.prefetch.loads[0] == 1 and alone.hits[1] == 0
    assert both.prefetch.loads[0] == 2 and both.hits[1] == 1 and both.stall[1] == 0
    with pytest.raises(InputError, match="pair table is not given"):
        simulate(tr, np.ones(1, bool), lay, one_drive(), replace(cfg, couple_file=path, couple_experts=8))


def test_a_run_with_couple_models_the_table_it_loaded(tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(PILOT_RUN, run)
    with open(run / "stderr.txt", "a") as f:
        f.write("[COUPLE] pairs.coli_pairs: 120 conditioning entries, K=5 depth=1\n")
    cfg, _ = config_from_run(run)
    assert (cfg.COUPLE, cfg.COUPLE_K, cfg.COUPLE_D) == (str(run / "pairs.coli_pairs"), 5, 1)
    m = model_config(cfg, RuntimeConfig(), 4, pilot_precision=0.5)
    assert (m.couple_file, m.couple_experts) == (str(run / "pairs.coli_pairs"), 5)
    assert config_from_run(PILOT_RUN)[0].COUPLE == ""     # no [COUPLE] line: the engine ran without a table


def test_the_gate_runs_the_router_pilot_and_its_table_as_the_engine_would(tmp_path):
    import json

    from conftest import cli, louvain_plan_and_trace

    plan, trace = louvain_plan_and_trace(tmp_path)
    assert cli("export", "coli-pairs", trace, "-o", tmp_path / "t.coli_pairs").returncode == 0
    common = ["replay", "--layout", plan, "--trace", trace, "--device", "single-nvme",
              "--min-sessions", 1, "--runtime-env", f"PILOT_REAL=1 CAP=2 COUPLE={tmp_path / 't.coli_pairs'} COUPLE_K=4"]
    res = cli(*common, "--json", "--pilot-precision", "0.5")
    assert res.returncode == 0, res.stderr
    rt = json.loads(res.stdout)["runtime"]
    assert (rt["prefetch"], rt["pilot_precision"], rt["couple_experts"], rt["layer_barrier"]) == ("pilot", 0.5, 4, True)
    assert rt["couple_file"] == str(tmp_path / "t.coli_pairs") and rt["runtime_changes"] == []
    res = cli(*common)
    assert res.returncode == 2 and "LOOKA=1" in res.stderr and len(res.stderr.strip().splitlines()) == 1


def test_the_pilots_copies_take_the_cores_the_layers_work_needs():
    """A layer ends no earlier than its matmuls and every copy on the cores they share: its demand
    jobs' and the prefetch loads completed while they ran (one core here, the team keeping the other)."""
    from replay.model.demand import _shared_cores
    from replay.model.state import PILOT_FIRST, PILOT_NEXT, new_work

    work = new_work(4, 8, 2, 1, 4, 1)
    work.miss.comp[0], work.miss.top[0] = 1e-3, False
    work.jobs.tail[0] = 2e-3                          # the demand job's copy
    work.jobs.tail[1] = 3e-3                          # the prefetch thread's load, done while the layer ran
    work.pilot.state[PILOT_FIRST], work.pilot.state[PILOT_NEXT] = 1, 2
    assert _shared_cores(1e-3, 0.0, 1, 1, 1.0, 1, 1, 0.0, work) == pytest.approx(5e-3)
    work.pilot.state[PILOT_NEXT] = 1                  # none done yet: the demand copy alone
    assert _shared_cores(1e-3, 0.0, 1, 1, 1.0, 1, 1, 0.0, work) == pytest.approx(2e-3)
    work.pilot.state[PILOT_NEXT], work.pilot.job[0] = 2, 1   # taken, still under way: not done by now
    assert _shared_cores(1e-3, 0.0, 1, 1, 1.0, 1, 1, 0.0, work) == pytest.approx(2e-3)


def test_hints_bring_pages_into_the_page_cache_and_nothing_into_the_lru():
    """PILOT=1 without PILOT_REAL (and COUPLE alone): the prefetch thread's loads are WILLNEED hints."""
    lay, tr, cfg = _two_layers([2], ram_experts=2, pilot_precision=1.0)
    cfg = replace(cfg, dense_seconds=0.01, direct=False, page_cache_bytes=10**9)
    pinned = np.zeros((2, 16), bool)
    pinned[0, 0] = True
    none, _ = simulate(tr, np.ones(1, bool), lay, one_drive(), replace(cfg, prefetch="none", pilot_precision=0.0), pinned)
    hints, _ = simulate(tr, np.ones(1, bool), lay, one_drive(), replace(cfg, prefetch_hints=True), pinned)
    assert none.drive_reads[1] > 0 and none.hits[1] == 0
    assert hints.prefetch.loads[0] == 1 and hints.hits[1] == 0       # not in the LRU: a miss, copied from the page cache
    assert hints.drive_reads[1] == 0 and hints.stall[1] < none.stall[1]
    real, _ = simulate(tr, np.ones(1, bool), lay, one_drive(), replace(cfg, layer_barrier=True), pinned)
    assert real.hits[1] == 1                                         # PILOT_REAL's load is in the LRU
    # O_DIRECT weights are not hinted: only the scales, whose pages the demand load then finds
    direct, _ = simulate(tr, np.ones(1, bool), lay, one_drive(), replace(cfg, prefetch_hints=True, direct=True), pinned)
    plain, _ = simulate(tr, np.ones(1, bool), lay, one_drive(), replace(cfg, prefetch="none", pilot_precision=0.0,
                                                                     direct=True), pinned)
    assert 0 < direct.drive_reads[1] < plain.drive_reads[1]


def test_hint_configurations_map_to_the_engines_lists():
    m = model_config(parse_runtime_env("PILOT=1"), RuntimeConfig(), 4, pilot_precision=0.5)
    assert (m.prefetch, m.prefetch_experts, m.prefetch_hints, m.layer_barrier, m.evict_guard) == ("pilot", 8, True,
                                                                                                   False, False)
    c = model_config(parse_runtime_env("COUPLE=t.coli_pairs COUPLE_K=3"), RuntimeConfig(), 4)
    assert (c.prefetch, c.prefetch_experts, c.couple_file, c.couple_experts, c.prefetch_hints) == ("coupled", 3,
                                                                                                   "t.coli_pairs", 0, True)
    with pytest.raises(InputError, match="LOOKA=1"):
        model_config(parse_runtime_env("PILOT=1"), RuntimeConfig(), 4)


def test_the_two_step_pilot_takes_its_own_precision(tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(PILOT_RUN, run)
    with open(run / "stdout.txt", "a") as f:
        f.write("PILOT_TWO: two-step shared-expert-corrected prefetch active (3 extra matmuls/prediction)\n"
                "  next layer (two-step, shared-expert)        68.0%  (313/460)\n")
    cfg, facts = config_from_run(run)
    assert cfg.PILOT_TWO == 1 and facts.pilot_precision == pytest.approx(313 / 460)
    assert parse_runtime_env("PILOT_TWO=1").PILOT == 1      # the engine: PILOT_TWO implies the pilot
    m = model_config(cfg, RuntimeConfig(), 4, pilot_precision=facts.pilot_precision)
    assert m.prefetch == "pilot" and m.pilot_precision == pytest.approx(313 / 460) and m.layer_barrier


def test_the_report_of_a_pilot_run_gives_its_loads_and_its_precision():
    from replay.colibri.engine_metrics import engine_report

    arm = engine_report([PILOT_RUN])["arms"][0]
    run = read_run(PILOT_RUN).output
    tokens = run.committed_tokens
    assert arm["pilot_loads_per_token"] == pytest.approx(run.pilot_loads / tokens)
    assert arm["pilot_drops_per_token"] == pytest.approx(run.pilot_drops / tokens)
    assert arm["pilot_precision"] == pytest.approx(run.pilot_lookahead[0] / run.pilot_lookahead[1])
    assert "PILOT=1" in arm["configurations"][0]


def test_the_pilot_under_uring_is_its_one_thread_beside_the_batched_demand_loads():
    from replay.colibri.describe import describe

    m = model_config(parse_runtime_env("URING=1 PILOT_REAL=1"), RuntimeConfig(), 4, pilot_precision=0.5)
    assert m.batched and m.prefetch == "pilot" and m.layer_barrier and m.copy_threads == 1
    assert "io_uring batches taken as its loads in turn" in describe(m)


def test_a_changed_pair_file_is_read_again(tmp_path):
    from replay.formats.colipairs import configured_pair_table

    lay = simple_layout(layers=(3, 4))
    path = _pairs_file(tmp_path / "p.coli_pairs", [(3, 1, 0, [(2, 9)])])
    cfg = RuntimeConfig(prefetch="pilot", pilot_precision=0.5, couple_file=path, couple_experts=2)
    first = configured_pair_table(cfg, lay)
    assert first[0][0, 0, 0] == 2
    first[0][0, 0, 0] = 7                              # the caller's copy: the next read is not changed
    assert configured_pair_table(cfg, lay)[0][0, 0, 0] == 2
    _pairs_file(tmp_path / "p.coli_pairs", [(3, 1, 0, [(5, 9), (6, 1)])])
    assert configured_pair_table(cfg, lay)[0][0, 0, :2].tolist() == [5, 6]
    assert configured_pair_table(RuntimeConfig(), lay) is None
