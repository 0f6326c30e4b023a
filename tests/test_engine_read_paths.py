"""colibrì's read paths in the model: PIPE=0's blocking batch, PIPE=1's per-expert waits, URING's
batched queue, routing order and the LRU promotion, each against a stall computed by hand; and the
run configuration in the engine's own variables (replay.colibri.engine_config)."""

import json
import os
from dataclasses import replace

import numpy as np
import pytest

from containers.errors import InputError
from containers.layout import Layout
from replay.model.config import RuntimeConfig
from replay.model.device import ArrayProfile, DriveProfile, load_device
from replay.model.engine import simulate
from replay.colibri.engine_config import (
    EngineConfig,
    aligned_copy_fraction,
    at_engine_copy_rate,
    config_from_run,
    engine_copy_rate,
    engine_cap,
    model_config,
    parse_runtime_env,
)
from replay.colibri.describe import describe
from replay.colibri.openmp_team import team_bound, team_held_cores, team_spin_iterations
from replay.model.routing import RoutingTrace

MIB = 1 << 20
A, B = 1e-3, 1e9        # request latency (s) and bandwidth (bytes/s) of the test drive


def drive():
    """One drive: each request costs A then streams at B; reads side by side share nothing but
    the queue (32 slots), so k concurrent reads of s bytes each complete at A + s / B."""
    return ArrayProfile("q", DriveProfile("d", A, 1e15, 32, B), 1, 0, "none", 1e15, read_ahead_bytes=0)


def layout(E, wbytes, sbytes=None, start=4096):
    """One file; from byte ``start`` on, expert e's three weights adjacent (one read of wbytes[e]),
    then its three scales (sbytes[e] bytes in all; empty by default)."""
    sbytes = sbytes or [0] * E
    loc = np.zeros((1, E, 6, 3), dtype=np.int64)
    off = start
    for e in range(E):
        w, sc = wbytes[e], sbytes[e]
        for slot, n in enumerate([w // 4, w // 4, w - 2 * (w // 4), sc // 3, sc // 3, sc - 2 * (sc // 3)]):
            loc[0, e, slot] = (0, off, n)
            off += n
    return Layout(["f.safetensors"], [off], [3], E, loc, 4096)


def forwards(routes, E):
    """One forward per entry of ``routes``, one position each, selecting its experts in that order."""
    F, k = len(routes), max(len(r) for r in routes)
    experts = np.full((F, k), -1, dtype=np.int16)
    for f, r in enumerate(routes):
        experts[f, :len(r)] = r
    return RoutingTrace(
        layers=np.array([3], dtype=np.int16), n_experts=E, top_k=k, geometry="test", sessions=["s0"],
        row_forward=np.arange(F, dtype=np.int32), row_layer=np.full(F, 3, np.int16), row_position=np.zeros(F, np.int32),
        experts=experts, gates=np.full((F, k), np.nan, dtype=np.float32), fwd_session=np.zeros(F, np.int32),
        fwd_kind=np.zeros(F, np.int8), fwd_evaluated=np.ones(F, np.int32), fwd_committed=np.ones(F, np.int32))


def run(routes, wbytes, config, device=None, sbytes=None, start=4096):
    E = len(wbytes)
    inst, _ = simulate(forwards(routes, E), np.ones(len(routes), bool), layout(E, wbytes, sbytes, start), device or drive(),
                       config)
    return inst


COMPUTE = 1e9                     # matmul: 1 ms per MiB-ish of weights (bytes/s)
BASE = dict(dense_seconds=0.0, compute_bytes_per_second=COMPUTE, direct=False)


def test_pipe0_blocks_the_compute_thread_for_the_whole_batch():
    """PIPE=0, a team of 2: misses of 1, 2, 3 MiB. Thread 1 takes the 1 MiB (done at A + 1 MiB/B),
    thread 2 the 2 MiB (A + 2 MiB/B); thread 1 then the 3 MiB (issued at its first's end, done
    2A + 4 MiB/B). The compute waits for the last: stall 2A + 4 MiB/B; then all matmuls."""
    sizes = [MIB, 2 * MIB, 3 * MIB]
    cfg = RuntimeConfig(workers=2, blocking=True, routing_order=True, **BASE)
    inst = run([[0, 1, 2]], sizes, cfg)
    expect = 2 * A + 4 * MIB / B
    assert inst.stall[0] == pytest.approx(expect, rel=1e-12)
    assert inst.compute[0] == pytest.approx(6 * MIB / COMPUTE, rel=1e-12)


def test_pipe1_overlaps_loads_with_matmuls_and_waits_per_expert():
    """PIPE=1, 2 workers, same batch in routing order 0, 1, 2. Loads done at d0 = A + 1M/B,
    d1 = A + 2M/B, d2 = 2A + 4M/B; the compute thread waits for each in turn and runs its matmul
    (c = s / C) before waiting for the next: stall = sum of max(d_p - t_p, 0)."""
    sizes = [MIB, 2 * MIB, 3 * MIB]
    cfg = RuntimeConfig(workers=2, routing_order=True, **BASE)
    inst = run([[0, 1, 2]], sizes, cfg)
    d = [A + MIB / B, A + 2 * MIB / B, 2 * A + 4 * MIB / B]
    c = [s / COMPUTE for s in sizes]
    t, stall = 0.0, 0.0
    for p in range(3):
        w = max(d[p] - t, 0.0)
        stall += w
        t += w + c[p]
    assert inst.stall[0] == pytest.approx(stall, rel=1e-12)
    blocked = run([[0, 1, 2]], sizes, RuntimeConfig(workers=2, blocking=True, routing_order=True, **BASE))
    assert inst.stall[0] < blocked.stall[0]          # overlap: less waiting than the blocking batch


def test_uring_puts_every_load_of_the_layer_in_flight_at_once():
    """URING (the batched queue, 64 loads in flight): the three loads all start at 0 and complete
    at A + s/B each; the compute waits for each in routing order."""
    sizes = [MIB, 2 * MIB, 3 * MIB]
    inst = run([[0, 1, 2]], sizes, RuntimeConfig(batched=True, routing_order=True, **BASE))
    d = [A + s / B for s in sizes]
    c = [s / COMPUTE for s in sizes]
    t, stall = 0.0, 0.0
    for p in range(3):
        w = max(d[p] - t, 0.0)
        stall += w
        t += w + c[p]
    assert inst.stall[0] == pytest.approx(stall, rel=1e-12)


def test_routing_order_issues_misses_as_routed_and_computes_hits_between_them():
    """Forward 1 loads expert 2 into an LRU of 1; forward 2 routes 0 then 2 (a hit). Routing
    order: the miss 0 is issued and waited for first (its load A + 1M/B), then the hit's matmul
    runs: stall A + 1M/B. Relayout's order runs the hit first (M/2 / C of compute), so the same
    miss costs A + 1M/B - M/2 / C."""
    sizes = [MIB, MIB, MIB // 2]
    routed = run([[2], [0, 2]], sizes, RuntimeConfig(workers=1, routing_order=True, lru_experts=1, **BASE))
    physical = run([[2], [0, 2]], sizes, RuntimeConfig(workers=1, lru_experts=1, **BASE))
    assert routed.hits[1] == physical.hits[1] == 1
    assert routed.stall[1] == pytest.approx(A + MIB / B, rel=1e-12)
    assert physical.stall[1] == pytest.approx(A + MIB / B - MIB / 2 / COMPUTE, rel=1e-12)


def test_routing_order_issue_order_changes_the_stall_of_an_unsorted_route():
    """One worker, route 2 then 0 (2 is 3 MiB, 0 is 1 MiB). Routing order loads 2 first: waits
    A + 3M/B, computes 3M/C, then 0 is done at 2A + 4M/B. Physical order loads 0 first."""
    sizes = [MIB, MIB, 3 * MIB]
    inst = run([[2, 0]], sizes, RuntimeConfig(workers=1, routing_order=True, **BASE))
    t = A + 3 * MIB / B
    stall = t
    t += 3 * MIB / COMPUTE
    stall += max(2 * A + 4 * MIB / B - t, 0.0)
    assert inst.stall[0] == pytest.approx(stall, rel=1e-12)


def test_the_engines_promotion_keeps_the_last_misses_of_a_layer():
    """Cap 1: forward 1 misses 0 then 1; colibrì promotes only the last (1). Forward 2 routes 0,
    1: 1 hits, 0 misses (relayout's order would have kept 1 as well, the newest)."""
    sizes = [MIB, MIB, MIB]
    inst = run([[0, 1], [1], [0]], sizes, RuntimeConfig(workers=1, routing_order=True, lru_experts=1, **BASE))
    assert list(inst.hits) == [0, 1, 0]
    # cap 2, three misses 0, 1, 2: the last two (1, 2) are kept, 2 the oldest (promoted first)
    inst = run([[0, 1, 2], [0], [1], [2]], sizes, RuntimeConfig(workers=1, routing_order=True, lru_experts=2, **BASE))
    assert list(inst.hits) == [0, 0, 1, 0]


# ------------------------------------------------------------------------ the run configuration

def test_the_default_configuration_is_the_engines_linux_default():
    """The parser's defaults are colibrì's on Linux (CPU build), as its source sets them
    (/work/engine/c/colibri.c at 4ef9a99): PIPE 0 off Windows (main, lines 9319-9325), PIPE_WORKERS 8
    (9330), DIRECT 0 (9333), URING 0 (9341), COLI_MMAP 0 (9240), CAP_RAISE 1 where the Metal
    fast-SSD probe did not run (8688, g_ssd_fast 0 off Metal: 130-134), RAM_GB 0 = auto (9653),
    PIN_GB 10 (9633), AUTOPIN 1 (9658), COUPLE_K 8 and COUPLE_D 1 (9644-9646), PILOT and
    PILOT_REAL 0 (9301-9302), COLI_PIPE_BLOCK 0 (9332); CAP from argv[1] or CAP, 64 when neither
    (coli_resolve_cap, 9098-9113)."""
    d = parse_runtime_env("")
    assert d == EngineConfig()
    assert (d.PIPE, d.PIPE_WORKERS, d.URING, d.DIRECT, d.COLI_MMAP, d.CAP_RAISE, d.RAM_GB, d.PIN_GB, d.AUTOPIN,
            d.COUPLE_K, d.COUPLE_D, d.PILOT, d.PILOT_REAL, d.COLI_PIPE_BLOCK, d.PIN, d.COUPLE) == \
        (0, 8, 0, 0, 0, 1, 0.0, 10.0, 1, 8, 1, 0, 0, 0, "", "")
    m = model_config(d, RuntimeConfig(), lru_experts=engine_cap(d, 256, 1e9, 0, 1e6), omp_threads=2)
    assert m.blocking and m.routing_order and not m.direct and not m.batched and m.workers == 2
    assert m.lru_experts == 64 and m.engine_env == "(defaults)" and m.runtime_changes == []


def test_the_parser_applies_the_engines_implications_and_is_strict():
    assert parse_runtime_env("URING=1").PIPE == 1
    assert parse_runtime_env("PIPE_WORKERS=4").PIPE == 1
    assert parse_runtime_env("PIPE=0 PIPE_WORKERS=4").PIPE == 0
    assert parse_runtime_env("PIN_GB=all PROMPT='a b' SNAP=/x").PIN_GB == -1.0
    for bad, word in [("PIPE=2", "PIPE"), ("FOO=1", "FOO"), ("PIPE_WORKERS=0", "PIPE_WORKERS"), ("RAM_GB=lots", "RAM_GB"),
                      ("PIPE", "PIPE"), ("DIRECT=1 DIRECT=0", "DIRECT"), ("URING=1 COLI_MMAP=1", "COLI_MMAP")]:
        with pytest.raises(InputError, match=word):
            parse_runtime_env(bad)


def test_each_engine_mode_maps_onto_its_read_path():
    base = RuntimeConfig(coalesce=True)
    p1 = model_config(parse_runtime_env("PIPE=1 PIPE_WORKERS=32 DIRECT=1"), base, 4)
    assert (p1.blocking, p1.batched, p1.workers, p1.direct) == (False, False, 16, True)
    u = model_config(parse_runtime_env("URING=1"), base, 4)
    assert u.batched and u.in_flight == 64 and not u.blocking
    assert any("1398" in c for c in u.runtime_changes) and "NEEDS A RUNTIME CHANGE" in describe(u)
    plain = RuntimeConfig()                       # the line says when the team keeps cores from the copies
    held = model_config(parse_runtime_env("PIPE=1"), plain, 4, omp_threads=2, cores=2)
    assert held.team_held_cores == 1 and "less the 1 the OpenMP team keeps from them" in describe(held)
    free = model_config(parse_runtime_env("PIPE=1 COLI_NO_OMP_TUNE=1"), plain, 4, omp_threads=2, cores=2)
    assert free.team_held_cores == 0 and "copies at most 2 at once (the cores)" in describe(free)
    with pytest.raises(InputError, match="PILOT"):
        model_config(parse_runtime_env("PILOT=1"), base, 4)


def test_cap_for_ram_lowers_and_raises_the_cap_as_the_engine_does():
    row, wide = 1e9, 1e7
    reserve = 3.7e9 + 64 * wide
    # 20 GB - 5 GB resident - reserve pays for 10 rows: CAP 16 lowered to 10; CAP 4 raised to 10 (not with CAP_RAISE=0)
    ram = (5e9 + reserve + 10.5 * row) / 1e9
    assert engine_cap(EngineConfig(CAP=16, RAM_GB=ram), 256, row, 5e9, wide) == 10
    assert engine_cap(EngineConfig(CAP=4, RAM_GB=ram), 256, row, 5e9, wide) == 10
    assert engine_cap(EngineConfig(CAP=4, RAM_GB=ram, CAP_RAISE=0), 256, row, 5e9, wide) == 4
    assert engine_cap(EngineConfig(CAP=4, RAM_GB=ram), 8, row, 5e9, wide) == 8          # at most n_experts
    assert engine_cap(EngineConfig(CAP=4, RAM_GB=1.0), 256, row, 5e9, wide) == 1        # the floor
    assert engine_cap(EngineConfig(CAP=4), 256, row, 5e9, wide) == 4                    # auto budget: as requested


def test_a_runs_effective_configuration_is_read_from_its_output(tmp_path):
    out = tmp_path / "run.txt"
    out.write_text(
        "[PROF] machine: Intel | 8 cores (2 omp threads) | RAM 8.0 GB total, 6.0 GB available | backend CPU\n"
        "[PROF] config: RAM_GB=auto 5.3 CTX=4096 | expert cache cap 4/layer (up to 0.0 GB) | pinned 0 (0.0 GB) | "
        "DRAFT=0 PIPE=1 DIRECT=1 MMAP=0 IDOT=1 DSA=off PILOT=0 CACHE_ROUTE=0\n"
        "[URING] queued expert I/O active (depth=512, workers=8, DIRECT=1)\n"
        "P0-EXEC: routed CPU 1.500s / 7.10 GB/s (120 row) | routed GPU critical 0.000s\n")
    cfg, facts = config_from_run(out)
    assert (cfg.PIPE, cfg.DIRECT, cfg.URING, cfg.PIPE_WORKERS, cfg.RAM_GB) == (1, 1, 1, 8, 0.0)
    assert (facts.cap, facts.pinned, facts.omp_threads, facts.cores) == (4, 0, 2, 8)
    assert facts.matmul_bytes_per_second == pytest.approx(7.1e9)
    (tmp_path / "bare.txt").write_text("PROFILE: expert-disk 1.0s service / 0.5s wait\n")
    with pytest.raises(InputError, match="PROF"):
        config_from_run(tmp_path / "bare.txt")


DISK_CLASS = ("[PROF] DISK-CLASS (recency split): cold 175 x 0.31 GB @ 6.22 GB/s-thread, wall 0.0s @ 8.21 GB/s-wall, "
              "avg-conc 1.3 (direct {cd}/175) | warm 278 x 0.49 GB @ {rate} GB/s-thread, wall 0.0s @ 11.06 GB/s-wall, "
              "avg-conc 1.4 (direct {wd}/278) | disk-busy 0.1s (37% of window)\n")
CONFIG = ("[PROF] config: RAM_GB=auto 20.9 CTX=4096 | expert cache cap 4/layer (up to 0.0 GB) | pinned 0 (0.0 GB) | "
          "DRAFT=0 PIPE=0 DIRECT=0 MMAP=0 IDOT=1 DSA=off PILOT=0 CACHE_ROUTE=0\n")


def test_a_runs_warm_read_rate_is_taken_only_when_every_warm_read_was_buffered(tmp_path):
    """The DISK-CLASS line's warm rate (GB/s per thread) is the run's page-cache copy rate when
    none of those reads was O_DIRECT; a DIRECT read among them, or a run without the line, says
    nothing of copies."""
    out = tmp_path / "run.txt"
    for cd, wd, rate, want in ((0, 0, "7.84", 7.84e9), (175, 0, "7.84", 7.84e9), (0, 3, "7.84", None),
                               (0, 0, "0.00", None)):
        out.write_text(CONFIG + DISK_CLASS.format(cd=cd, wd=wd, rate=rate))
        _, facts = config_from_run(out)
        assert facts.warm_read_bytes_per_second == (pytest.approx(want) if want else None), (cd, wd, rate)
    out.write_text(CONFIG)
    assert config_from_run(out)[1].warm_read_bytes_per_second is None


def test_a_runs_copy_rate_is_a_decode_loads_bytes_over_its_thread_time(tmp_path):
    """A buffered run's decode PROFILE line's service over its expert I/O line's loads is one
    decode load's thread time; the copy rate is the container's mean expert over it. URING=1 does
    not time its loads (service 0) and DIRECT=1 reads weights from the drives: the warm reads'
    rate then, when there is one."""
    decode = ("PROFILE: expert-disk 0.500s service / 0.300s wait | expert-matmul 0.2s | attention 0.0s (including kvb "
              "0.0s) | lm_head 0.0s | other 0.0s\n"
              "PROFILE: expert-disk {svc}s service / 0.058s wait | expert-matmul 0.069s | attention 0.004s (including "
              "kvb 0.000s) | lm_head 0.000s | other 0.025s\n"
              "[PROF] expert I/O: 0.802 GB fetched (33.4 MB/token, 5.12 GB/s over the run) | hit 17.9% (0 pin + 99 "
              "lru / 400 load) | 23.0 loads/token | 0.1s read service / 0.1s felt wait\n")
    lay = layout(4, [3 * MIB] * 4, [96 * 1024] * 4)
    mean = 3 * MIB + 96 * 1024
    out = tmp_path / "run.txt"
    out.write_text(CONFIG + decode.format(svc="0.080") + DISK_CLASS.format(cd=0, wd=0, rate="9.00"))
    cfg, facts = config_from_run(out)
    assert facts.decode_load_seconds == pytest.approx(0.080 / 400)
    assert engine_copy_rate(cfg, facts, lay) == pytest.approx(mean / (0.080 / 400))
    out.write_text(CONFIG.replace("DIRECT=0", "DIRECT=1") + decode.format(svc="0.080") +
                   DISK_CLASS.format(cd=0, wd=0, rate="9.00"))
    assert engine_copy_rate(*config_from_run(out), lay) == pytest.approx(9e9)
    out.write_text(CONFIG + decode.format(svc="0.000") + "[URING] queued expert I/O active (depth=512, workers=8, "
                   "buffered)\n")
    cfg, facts = config_from_run(out)
    assert facts.decode_load_seconds is None and engine_copy_rate(cfg, facts, lay) == 0.0


def test_the_engines_copy_rate_moves_both_rates_by_one_factor_for_the_container_it_read():
    """A stock container whose experts start off the cache line copies at the unaligned rate;
    told the engine copied it at 3e9 bytes/s, the unaligned rate becomes 3e9 and the aligned one
    keeps the calibrated ratio (4/2.5), so an aligned rewrite is predicted faster by as much. A
    half-aligned container moves both so that its byte-weighted mean time per byte is 1/3e9.
    A warm rate no faster than the drives is a drive rate: the profile stays as it was."""
    both = replace(copying(rate=4e9), unaligned_memory_bandwidth=2.5e9, host_bandwidth=1e9)
    off = layout(2, [MIB, MIB], start=4112)
    assert aligned_copy_fraction(off) == 0.0 and aligned_copy_fraction(layout(2, [MIB, MIB])) == 1.0
    moved = at_engine_copy_rate(both, 3e9, off)
    assert moved.unaligned_memory_bandwidth == pytest.approx(3e9)
    assert moved.memory_bandwidth == pytest.approx(3e9 * 4 / 2.5)
    assert "3.00 GB/s" in moved.name
    half = layout(2, [MIB, MIB], start=4096)
    half.expert_loc[0, 1, :, 1] += 16                       # expert 1 off the line
    mixed = at_engine_copy_rate(both, 3e9, half)
    assert 0.5 / mixed.memory_bandwidth + 0.5 / mixed.unaligned_memory_bandwidth == pytest.approx(1 / 3e9)
    assert at_engine_copy_rate(both, both.host_bandwidth, off) is both


# ------------------------------------------------------------------------ the command line

def test_the_gate_models_the_engine_configuration_it_is_given(tmp_path):
    from conftest import cli, louvain_plan_and_trace

    plan, trace = louvain_plan_and_trace(tmp_path)
    common = ["replay", "--layout", plan, "--trace", trace, "--device", "single-nvme",
              "--min-sessions", 1]
    res = cli(*common, "--json")
    assert res.returncode == 0, res.stderr
    rt = json.loads(res.stdout)["runtime"]
    assert rt["blocking"] and rt["routing_order"] and not rt["direct"] and rt["engine_env"] == "(defaults)"
    res = cli(*common, "--json", "--runtime-env", "PIPE=1 PIPE_WORKERS=2 DIRECT=1 CAP=3 CAP_RAISE=0 SNAP=/m",
              "--coalesce")
    assert res.returncode == 0, res.stderr
    import jsonschema
    from conftest import REPO

    jsonschema.validate(json.loads(res.stdout), json.loads((REPO / "manifests/schemas/gate.schema.json").read_text()))
    rt = json.loads(res.stdout)["runtime"]
    assert (rt["blocking"], rt["workers"], rt["direct"], rt["lru_experts"]) == (False, 2, True, 3)
    assert rt["engine_env"] == "PIPE=1 PIPE_WORKERS=2 DIRECT=1 CAP=3 CAP_RAISE=0"
    assert any("1398" in c for c in rt["runtime_changes"])
    res = cli(*common, "--runtime-env", "PIPE=1", "--compute-gbps", 7)
    assert res.returncode == 0 and "read path: colibrì PIPE=1" in res.stdout and "7 GB/s" in res.stdout
    res = cli(*common, "--workers", 2)                       # relayout's own read path, as before
    assert res.returncode == 0 and "relayout's read path: 2 loader workers" in res.stdout
    for bad, word in [(["--runtime-env", "PIPE=3"], "PIPE must be 0 or 1"), (["--runtime-env", "NOPE=1"], "NOPE"),
                      (["--runtime-env", "PIPE=1", "--workers", 2], "--workers")]:
        res = cli(*common, *bad)
        assert res.returncode == 2 and word in res.stderr and "Traceback" not in res.stderr
        assert len(res.stderr.strip().splitlines()) == 1


def test_coli_mmap_is_the_buffered_path_with_mapped_views_taken_from_a_run_of_it(tmp_path):
    """COLI_MMAP=1: weights never O_DIRECT (the mapped branch comes first), the LRU's slots hold no
    copies (the page cache left to the experts is what was available less resident), and the
    cost of a page-cache hit only a PROF=1 run of it can give: without one, or from a run that
    did not map, it is refused, naming the option."""
    from relayout.planning.replay_setup import RuntimeRequest, runtime_config

    m = model_config(parse_runtime_env("COLI_MMAP=1 DIRECT=1"), RuntimeConfig(), 4, omp_threads=2, cores=2)
    assert m.mapped_views and not m.direct and m.blocking and "mapped views" in describe(m)
    assert not model_config(parse_runtime_env("DIRECT=1"), RuntimeConfig(), 4).mapped_views
    decode = ("PROFILE: expert-disk 0.200s service / 0.100s wait | expert-matmul 0.2s | attention 0.0s (including kvb "
              "0.0s) | lm_head 0.0s | other 0.0s\n"
              "PROFILE: expert-disk 0.022s service / 0.014s wait | expert-matmul 0.082s | attention 0.005s (including "
              "kvb 0.000s) | lm_head 0.000s | other 0.027s\n"
              "[PROF] expert I/O: 0.100 GB fetched (4.0 MB/token, 5.00 GB/s over the run) | hit 17.9% (0 pin + 99 "
              "lru / 440 load) | 23.0 loads/token | 0.0s read service / 0.0s felt wait\n"
              "[PROF] machine: AMD | 2 cores (2 omp threads) | RAM 24.7 GB total, 20.0 GB available | backend CPU\n")
    lay = layout(4, [3 * MIB] * 4, [96 * 1024] * 4)
    mapped_run, plain_run = tmp_path / "mmap.txt", tmp_path / "plain.txt"
    mapped_run.write_text(CONFIG.replace("MMAP=0", "MMAP=1") + decode)
    plain_run.write_text(CONFIG + decode)
    req = dict(coalesce_max_mb=256, dense_ms=0.0, colibri_run=True)
    c = runtime_config(RuntimeRequest(**req, runtime_env_from=str(mapped_run)), lay)
    assert c.mapped_views and c.page_cache_bytes == int(20e9 - sum(lay.file_sizes) + lay.expert_bytes().sum())
    buffered = runtime_config(RuntimeRequest(**req, runtime_env_from=str(plain_run)), lay)
    assert buffered.page_cache_bytes < c.page_cache_bytes                 # the slots and slabs hold copies there
    for bad in (dict(runtime_env="COLI_MMAP=1"), dict(runtime_env_from=str(plain_run), runtime_env="COLI_MMAP=1")):
        with pytest.raises(InputError, match="COLI_MMAP=1 is modelled from a PROF=1 run of it"):
            runtime_config(RuntimeRequest(**req, **bad), lay)


def test_buffered_weight_reads_are_served_again_from_the_page_cache():
    """Buffered weights, no LRU, a page cache of 1.5 MiB: forward 1 reads expert 0 from the drive
    (A + 1M/B); forward 2's re-read of 0 comes from memory (1M copied at the profile's
    memory_bandwidth, 10e9 when it does not give one; no drive read); forward 3 reads 1, which
    evicts 0 (the experts start on 64 KiB blocks, which the page cache evicts whole); forward
    4's 0 goes to the drive again. O_DIRECT reads neither use nor fill the page cache."""
    sizes = [MIB, MIB]
    cfg = RuntimeConfig(workers=1, routing_order=True, page_cache_bytes=3 * MIB // 2, **BASE)
    inst = run([[0], [0], [1], [0]], sizes, cfg, start=64 * 1024)
    assert list(inst.drive_reads) == [1, 0, 1, 1]
    assert inst.stall[0] == pytest.approx(A + MIB / B, rel=1e-12)
    assert inst.stall[1] == pytest.approx(MIB / 10e9, rel=1e-12)
    assert inst.stall[3] == pytest.approx(A + MIB / B, rel=1e-12)
    direct = run([[0], [0]], sizes, RuntimeConfig(workers=1, page_cache_bytes=4 * MIB, **dict(BASE, direct=True)))
    assert list(direct.drive_reads) == [1, 1]
    none = run([[0], [0]], sizes, RuntimeConfig(workers=1, **BASE))
    assert list(none.drive_reads) == [1, 1]


def test_the_union_is_met_in_routing_order():
    """Two positions routing (5, 1) and (1, 7), and a second instance routing (3, 2): the union is
    kept ascending, and met in the order colibrì builds it: 5, 1, 7 (1 at its first selection), then 3, 2."""
    from replay.model.unions import instance_unions, routing_order

    experts = np.array([[5, 1], [1, 7], [3, 2]], dtype=np.int16)
    row_start, rows = np.array([0, 2, 3]), np.arange(3)
    sel_start, sel_e, _ = instance_unions(row_start, rows, experts, 8)
    order = routing_order(row_start, rows, experts, sel_start, sel_e, 8)
    assert list(sel_e) == [1, 5, 7, 2, 3]
    assert [int(sel_e[j]) for j in order] == [5, 1, 7, 3, 2]


# ------------------------------------------------------------------------ page-cache copies

RATE = 2e9                        # the test profile's memory_bandwidth: one thread's copy rate (bytes/s)


def copying(service="in-order", rate=RATE):
    """The test drive (:func:`drive`) with its channel ``service`` and the copy rate ``rate``."""
    d = drive()
    return replace(d, drive=replace(d.drive, service=service), memory_bandwidth=rate)


def test_a_page_cache_hit_is_copied_at_the_profiles_memory_bandwidth():
    """A re-read the page cache serves takes its bytes over the profile's memory_bandwidth: 1 MiB
    at 10e9 and at 2.5e9 bytes/s, the time 1 / rate. A profile declaring every weight read warm
    (page_cache_fraction 1) copies the first read too, at the same rate."""
    cfg = RuntimeConfig(workers=1, routing_order=True, page_cache_bytes=2 * MIB, **BASE)
    for rate in (10e9, 2.5e9):
        inst = run([[0], [0]], [MIB, MIB], cfg, copying(rate=rate))
        assert list(inst.drive_reads) == [1, 0]
        assert inst.stall[1] == pytest.approx(MIB / rate, rel=1e-12)
        warm = run([[0]], [MIB, MIB], cfg, replace(copying(rate=rate), page_cache_fraction=1.0))
        assert list(warm.drive_reads) == [0]
        assert warm.stall[0] == pytest.approx(MIB / rate, rel=1e-12)


def test_a_page_cache_hit_off_the_cache_line_is_copied_at_the_unaligned_rate():
    """The kernel copies a page-cache hit into a page-aligned buffer more slowly when the read
    does not start on a cache line (64 B). Expert 0's re-read (1 MiB of weights, then three 64 B
    scales) from file offset 4096 or 4160 (cache lines) takes its bytes over memory_bandwidth; from
    4112 or 4104 (16 and 8 B into a line), over unaligned_memory_bandwidth; a profile without the
    unaligned rate copies both at memory_bandwidth."""
    cfg = RuntimeConfig(workers=1, routing_order=True, page_cache_bytes=2 * MIB, **BASE)
    both = replace(copying(rate=4e9), unaligned_memory_bandwidth=2.5e9)
    n = MIB + 192
    for start, rate in ((4096, 4e9), (4160, 4e9), (4112, 2.5e9), (4104, 2.5e9)):
        inst = run([[0], [0]], [MIB, MIB], cfg, both, sbytes=[192, 192], start=start)
        assert inst.drive_reads[1] == 0
        assert inst.stall[1] == pytest.approx(n / rate, rel=1e-12), start
        plain = run([[0], [0]], [MIB, MIB], cfg, copying(rate=4e9), sbytes=[192, 192], start=start)
        assert plain.stall[1] == pytest.approx(n / 4e9, rel=1e-12)


MODES = {"pipe0": dict(workers=4, blocking=True), "pipe1": dict(workers=4), "uring": dict(batched=True)}


@pytest.mark.parametrize("service", ["in-order", "shared"])
@pytest.mark.parametrize("mode", sorted(MODES))
def test_page_cache_copies_run_at_most_one_per_core(mode, service):
    """Forward 1 reads experts 0, 1, 2 (1, 2, 3 MiB) from the drive into the page cache; forward 2's
    misses are all page-cache hits: copies of 1, 2, 3 u (u = 1 MiB at memory_bandwidth), issued at
    once on four readers (PIPE=0's team, PIPE=1's pool) or 64 (URING). Not bounded (cpu_cores 0,
    as before the bound existed): done at 1, 2, 3 u. Two cores: the third waits for the first
    core to free: 1, 2, 4 u. One core: in turn, 1, 3, 6 u. PIPE=0 waits for the last; PIPE=1 and
    URING for each in routing order, its matmul (at 1e12 bytes/s) between, and no layer ends
    before its matmuls plus its copies over the cores (test_matmuls_and_copies_share_the_cores)."""
    u = MIB / RATE
    sizes = [MIB, 2 * MIB, 3 * MIB]
    fast = dict(BASE, compute_bytes_per_second=1e12)
    for cores, ready in ((0, [1, 2, 3]), (2, [1, 2, 4]), (1, [1, 3, 6])):
        cfg = RuntimeConfig(routing_order=True, page_cache_bytes=8 * MIB, cpu_cores=cores, **MODES[mode], **fast)
        inst = run([[0, 1, 2], [0, 1, 2]], sizes, cfg, copying(service))
        assert list(inst.drive_reads) == [3, 0]
        if mode == "pipe0":
            expect = ready[-1] * u
        else:
            t, expect = 0.0, 0.0
            for r, n in zip(ready, sizes):
                wait = max(r * u - t, 0.0)
                expect += wait
                t += wait + n / 1e12
            if cores:                                # matmuls and copies share the cores
                expect += max(sum(sizes) / 1e12 + 6 * u / cores - t, 0.0)
        assert inst.stall[1] == pytest.approx(expect, rel=1e-12), (cores, ready)


@pytest.mark.parametrize("mode", ["pipe1", "uring"])
def test_matmuls_and_copies_share_the_cores(mode):
    """PIPE=1 and URING on C cores: the matmuls run on a team as wide as the machine, so a layer
    whose misses are page-cache hits (copies of 1, 2, 3 u, u = 1 MiB at memory_bandwidth; matmuls
    of 2, 4, 6 u at 1e9 bytes/s) ends no earlier than its 12 u of matmuls plus its 6 u of copies
    over C. Two cores: copies done at 1, 2, 4 u, the thread waits 1 u and would end at 13 u; it
    ends at 15 u instead, 2 u more wait at the last miss: 3 u. One core (1, 3, 6 u): 1 u, then
    18 - 13 = 5 u more: 6 u. With copies not bounded (C = 0, relayout's own read path) only the
    1 u wait for the first copy remains."""
    u = MIB / RATE
    sizes = [MIB, 2 * MIB, 3 * MIB]
    for cores, expect in ((2, 3 * u), (1, 6 * u), (0, u)):
        cfg = RuntimeConfig(routing_order=True, page_cache_bytes=8 * MIB, cpu_cores=cores, **MODES[mode], **BASE)
        inst = run([[0, 1, 2], [0, 1, 2]], sizes, cfg, copying())
        assert list(inst.drive_reads) == [3, 0]
        assert inst.stall[1] == pytest.approx(expect, rel=1e-12), cores


@pytest.mark.parametrize("mode", ["pipe1", "uring"])
def test_cores_the_team_keeps_take_the_copies_off_the_matmuls(mode):
    """The layer of test_matmuls_and_copies_share_the_cores (copies of 1, 2, 3 u; matmuls of 2, 4,
    6 u) when the OpenMP team keeps cores from the copies (a bound team on C cores keeps C - 1).
    Two cores, one kept: the copies run one at a time (done at 1, 3, 6 u) and only while the
    compute thread waits: the layer ends at its 12 u of matmuls plus 6 u of copies, 18 u, where
    it would end at 13 u: 1 u + 5 u = 6 u of wait, against 3 u when no core is kept. Four cores,
    three kept: the same 6 u, against 1.5 u (copies on four cores: 1 u, then 12 + 6/4 - 13 u)."""
    u = MIB / RATE
    sizes = [MIB, 2 * MIB, 3 * MIB]
    for cores, held, expect in ((2, 1, 6 * u), (2, 0, 3 * u), (4, 3, 6 * u), (4, 0, 1.5 * u)):
        cfg = RuntimeConfig(routing_order=True, page_cache_bytes=8 * MIB, cpu_cores=cores, team_held_cores=held,
                            **MODES[mode], **BASE)
        inst = run([[0, 1, 2], [0, 1, 2]], sizes, cfg, copying())
        assert list(inst.drive_reads) == [3, 0]
        assert inst.stall[1] == pytest.approx(expect, rel=1e-12), (cores, held)
    for bad in (2, -1, True):
        with pytest.raises(InputError, match="keeps from copies"):
            RuntimeConfig(cpu_cores=2, team_held_cores=bad)
    with pytest.raises(InputError, match="keeps from copies"):
        RuntimeConfig(team_held_cores=1)                 # copies not bounded by cores: nothing to keep


def test_one_copying_thread_copies_one_at_a_time_on_any_number_of_cores():
    """URING=1's page-cache hits are copied by one io-wq worker (``copy_threads`` 1): on two cores
    the copies of 1, 2, 3 u (matmuls nearly free) are done at 1, 3, 6 u, one after another, where
    two copying threads finish them at 1, 2, 4 u: 6 u of wait against 4 u. The cores still bound
    the layer as before (busy + copies / 2 = 3 u, below both)."""
    u = MIB / RATE
    sizes = [MIB, 2 * MIB, 3 * MIB]
    fast = dict(BASE, compute_bytes_per_second=1e12)
    for threads, expect in ((1, 6 * u), (0, 4 * u)):
        cfg = RuntimeConfig(routing_order=True, page_cache_bytes=8 * MIB, cpu_cores=2, copy_threads=threads,
                            **MODES["uring"], **fast)
        assert cfg.copy_slots == (threads or 2)
        inst = run([[0, 1, 2], [0, 1, 2]], sizes, cfg, copying())
        overlap = (sizes[0] + sizes[1]) / 1e12            # the first two matmuls run before the next waits
        assert inst.stall[1] == pytest.approx(expect - overlap, rel=1e-12), threads
    m = model_config(parse_runtime_env("URING=1 COLI_NO_OMP_TUNE=1 OMP_WAIT_POLICY=PASSIVE"), RuntimeConfig(), 4,
                     omp_threads=2, cores=2)
    assert (m.copy_threads, m.copy_slots, m.copy_cores) == (1, 1, 2)
    assert model_config(parse_runtime_env("PIPE=1"), RuntimeConfig(), 4, omp_threads=2, cores=2).copy_threads == 0


def test_how_the_openmp_team_waits_and_where_it_runs_follow_the_engine_and_libgomp():
    """colibrì's hot-thread tuning (unless COLI_NO_OMP_TUNE is given, with any value) sets
    OMP_WAIT_POLICY=active, GOMP_SPINCOUNT=200000 and OMP_PROC_BIND=close where the user did not;
    libgomp takes GOMP_SPINCOUNT first, else spins without end under ACTIVE, not at all under
    PASSIVE, 300000 iterations otherwise; OMP_PLACES implies binding."""
    spin = lambda env: team_spin_iterations(parse_runtime_env(env))
    assert spin("") == 200000 and spin("OMP_WAIT_POLICY=PASSIVE") == 200000    # the tuning still sets the count
    assert spin("COLI_NO_OMP_TUNE=1") == 300000 and spin("COLI_NO_OMP_TUNE=0") == 300000   # presence, as the engine
    assert spin("COLI_NO_OMP_TUNE=1 OMP_WAIT_POLICY=passive") == 0
    assert spin("COLI_NO_OMP_TUNE=1 OMP_WAIT_POLICY=ACTIVE") == float("inf")
    assert spin("GOMP_SPINCOUNT=2k") == 2000 and spin("GOMP_SPINCOUNT=infinite") == float("inf")
    bound = lambda env: team_bound(parse_runtime_env(env))
    assert bound("") and not bound("COLI_NO_OMP_TUNE=1") and not bound("OMP_PROC_BIND=false")
    assert bound("COLI_NO_OMP_TUNE=1 OMP_PROC_BIND=spread,close") and bound("COLI_NO_OMP_TUNE=1 OMP_PLACES=cores")
    for bad, word in [("OMP_WAIT_POLICY=sometimes", "OMP_WAIT_POLICY"), ("GOMP_SPINCOUNT=lots", "GOMP_SPINCOUNT"),
                      ("OMP_PROC_BIND=sideways", "OMP_PROC_BIND"), ("OMP_PLACES=", "OMP_PLACES")]:
        with pytest.raises(InputError, match=word):
            parse_runtime_env(bad)


def test_the_cores_the_team_keeps_from_the_copies():
    """A bound team (colibrì's default) keeps every core but the main thread's: the loaders and
    io-wq workers inherit its one core. Not bound: URING=1's one io-wq copier is left one core
    by a spinning team; PIPE=1's loaders share every core; a parked team keeps none; PIPE=0
    loads on the team itself; a team wider than the cores spins only briefly."""
    held = lambda env, team=2, cores=2: team_held_cores(parse_runtime_env(env), team, cores)
    assert held("PIPE=1") == 1 and held("URING=1") == 1 and held("PIPE=1", 8, 8) == 7
    assert held("PIPE=1 COLI_NO_OMP_TUNE=1") == 0 and held("URING=1 COLI_NO_OMP_TUNE=1") == 1
    assert held("URING=1 COLI_NO_OMP_TUNE=1", 4, 8) == 3 and held("URING=1 COLI_NO_OMP_TUNE=1", 4, 2) == 0
    assert held("URING=1 COLI_NO_OMP_TUNE=1 OMP_WAIT_POLICY=PASSIVE") == 0
    assert held("") == 0 and held("COLI_NO_OMP_TUNE=1") == 0
    m = model_config(parse_runtime_env("URING=1"), RuntimeConfig(), 4, omp_threads=2, cores=2)
    assert (m.cpu_cores, m.team_held_cores, m.copy_cores) == (2, 1, 1)


def test_a_runs_openmp_settings_come_from_its_output_and_its_recorded_environment(tmp_path):
    """Without the engine's ``[OMP] hot-thread tuning`` line the tuning did not run
    (COLI_NO_OMP_TUNE); a measured run's directory adds the OpenMP variables its environment set."""
    from conftest import REPO

    out = tmp_path / "run.txt"
    out.write_text(CONFIG)
    assert config_from_run(out)[0].COLI_NO_OMP_TUNE == 1
    out.write_text("[OMP] hot-thread tuning: re-exec once (COLI_NO_OMP_TUNE=1 to skip)\n" + CONFIG)
    cfg = config_from_run(out)[0]
    assert cfg.COLI_NO_OMP_TUNE == 0 and team_bound(cfg) and team_spin_iterations(cfg) == 200000
    src = REPO / "tests/data/engine/stock-louvain/container/p00-r00"
    run_dir = tmp_path / "p00-r00"
    run_dir.mkdir()
    for name in ("stdout.txt", "stderr.txt"):
        (run_dir / name).write_bytes((src / name).read_bytes())
    ident = json.loads((src / "engine-run.json").read_text())
    assert config_from_run(src)[0].OMP_WAIT_POLICY == ""
    ident["env"]["OMP_WAIT_POLICY"] = "passive"
    (run_dir / "engine-run.json").write_text(json.dumps(ident))
    cfg = config_from_run(run_dir)[0]
    assert (cfg.COLI_NO_OMP_TUNE, cfg.OMP_WAIT_POLICY, team_spin_iterations(cfg)) == (1, "PASSIVE", 0)
    ident["env"]["OMP_WAIT_POLICY"] = "lazy"
    (run_dir / "engine-run.json").write_text(json.dumps(ident))
    with pytest.raises(InputError, match="OMP_WAIT_POLICY"):
        config_from_run(run_dir)


@pytest.mark.parametrize("service", ["in-order", "shared"])
def test_a_copy_takes_its_core_when_its_reads_are_done(service):
    """PIPE=0 on a team of 2, one core, O_DIRECT weights (scales buffered, cached since forward
    1). Forward 2 reads expert 0's 4 MiB of weights and expert 1's 1 MiB from the drive; each
    job then copies its 192 KiB of scales. The core copies expert 1's scales when its short read
    is done and expert 0's when its long one is: the stall is the same as with copies not bounded
    by the cores (were copies given their core in the order the readers issue their jobs, expert
    1's copy would wait behind expert 0's and the layer would end a copy later)."""
    sizes, scales = [4 * MIB, MIB], [3 * 64 * 1024, 3 * 64 * 1024]
    cfg = RuntimeConfig(workers=2, blocking=True, routing_order=True, cpu_cores=1, **dict(BASE, direct=True))
    inst = run([[0, 1], [0, 1]], sizes, cfg, copying(service), scales)
    assert inst.drive_reads[1] == 2
    unbounded = run([[0, 1], [0, 1]], sizes, replace(cfg, cpu_cores=0), copying(service), scales)
    assert unbounded.stall[1] == pytest.approx(inst.stall[1], rel=1e-12)
    assert inst.stall[1] >= A + 4 * MIB / B + 3 * 64 * 1024 / RATE


def test_the_copy_rate_and_the_cores_are_checked(tmp_path):
    with pytest.raises(InputError, match="cores"):
        RuntimeConfig(cpu_cores=-1)
    for bad in (0, -1.0, float("inf"), float("nan"), True, "fast"):
        with pytest.raises(InputError, match="memory_bandwidth"):
            copying(rate=bad)
    for bad in (0, -1.0, float("inf"), float("nan"), True, "fast"):
        with pytest.raises(InputError, match="unaligned_memory_bandwidth"):
            replace(copying(), unaligned_memory_bandwidth=bad)
    assert "memory_bandwidth" not in drive().to_json()                 # the default: profiles as they were
    assert "unaligned_memory_bandwidth" not in drive().to_json()
    assert copying(rate=4.9e9).to_json()["memory_bandwidth"] == 4.9e9
    both = replace(copying(rate=4.9e9), unaligned_memory_bandwidth=3.5e9)
    (tmp_path / "both.json").write_text(json.dumps(both.to_json()))
    assert load_device(str(tmp_path / "both.json")) == both


def test_an_engine_configuration_bounds_copies_by_the_runs_cores():
    """A recorded run's ``[PROF] machine`` line gives its machine's cores (2 here); the model's
    engine configuration bounds the copies by them, else by this machine's cores. relayout's own
    read path does not bound them."""
    from conftest import REPO

    cfg, facts = config_from_run(REPO / "tests/data/engine/stock-louvain/container/p00-r00")
    assert (facts.cores, facts.omp_threads) == (2, 2)
    assert model_config(cfg, RuntimeConfig(), facts.cap, facts.omp_threads, cores=facts.cores).cpu_cores == 2
    assert model_config(cfg, RuntimeConfig(), facts.cap).cpu_cores == (os.cpu_count() or 1)
    assert RuntimeConfig().cpu_cores == 0


def test_the_prefetch_threads_copies_take_a_core_too():
    """Two layers of two 1 MiB experts; each forward routes expert 0 in both, with the oracle
    prefetch (queued when a layer is routed, ahead of its demand loads) and no LRU. Forward 2 finds
    every expert in the page cache: when layer 3 is routed the prefetch thread's load of layer 4's
    expert 0 and layer 3's demand miss are both copies of c = 1 MiB / rate. On one core the
    prefetch thread's copy goes first (its load was queued first): layer 3 waits 2c; not bounded, c."""
    E = 2
    loc = np.zeros((2, E, 6, 3), dtype=np.int64)
    off = 4096
    for li in range(2):
        for e in range(E):
            for slot in range(3):
                n = MIB // 4 if slot < 2 else MIB - 2 * (MIB // 4)
                loc[li, e, slot] = (0, off, n)
                off += n
    lay = Layout(["f.safetensors"], [off], [3, 4], E, loc, 4096)
    F = 2
    trace = RoutingTrace(
        layers=np.array([3, 4], dtype=np.int16), n_experts=E, top_k=1, geometry="test", sessions=["s0"],
        row_forward=np.repeat(np.arange(F, dtype=np.int32), 2), row_layer=np.tile(np.array([3, 4], np.int16), F),
        row_position=np.zeros(2 * F, np.int32), experts=np.zeros((2 * F, 1), dtype=np.int16),
        gates=np.full((2 * F, 1), np.nan, dtype=np.float32), fwd_session=np.zeros(F, np.int32),
        fwd_kind=np.zeros(F, np.int8), fwd_evaluated=np.ones(F, np.int32), fwd_committed=np.ones(F, np.int32))
    c = MIB / RATE
    for cores, expect in ((0, c), (1, 2 * c)):
        cfg = RuntimeConfig(workers=1, routing_order=True, page_cache_bytes=8 * MIB, prefetch="oracle", cpu_cores=cores,
                            lru_experts=0, **dict(BASE, compute_bytes_per_second=1e12))
        inst, _ = simulate(trace, np.ones(F, bool), lay, copying(), cfg)
        assert list(inst.drive_reads) == [1, 0, 0, 0]
        assert inst.stall[2] == pytest.approx(expect, rel=1e-12), cores


@pytest.mark.parametrize("mode", sorted(MODES))
def test_the_oracle_takes_page_cache_hits_for_free_so_it_bounds_the_stall(mode):
    """Forward 2's misses are page-cache hits copied at 1e9 bytes/s, slower than the drive's
    stream, and in parallel: streamed through the oracle's one channel at the drive's rate they
    would put the bound above the stall of a path that never touches the drive. The oracle
    charges them nothing (no layout changes them), and stays at or below the stall in every instance."""
    sizes = [MIB, 2 * MIB, 3 * MIB]
    cfg = RuntimeConfig(routing_order=True, page_cache_bytes=8 * MIB, **MODES[mode], **BASE)
    inst = run([[0, 1, 2], [0, 1, 2]], sizes, cfg, copying(rate=1e9))
    assert list(inst.drive_reads) == [3, 0]
    assert (inst.oracle_stall <= inst.stall + 1e-15).all()
    assert inst.oracle_stall[1] == 0.0 and inst.oracle_stall[0] > 0.0
