"""The loader pool's handoff: measured per host, kept in the device profile, charged per block of
demand loads when colibrì's PIPE=1 loaders share the compute thread's core."""

import json
import sys
from dataclasses import replace

import pytest

from containers.errors import InputError
from replay.colibri.engine_config import model_config, parse_runtime_env
from replay.colibri.openmp_team import loaders_on_compute_core
from replay.model.config import RuntimeConfig
from replay.model.device import ArrayProfile, LoaderHandoff, load_device
from replay.model.engine import read_policy
from replay.physical.loader_handoff import loader_handoff
from tests.test_engine_read_paths import BASE, MIB, RATE, copying, drive, run

HANDOFF = LoaderHandoff((1, 8), (1e-5, 4e-5))
FOUR = 1e-5 + 3 / 7 * 3e-5          # four loaders: between the measured one and eight


def test_the_handoff_for_a_pool_lies_between_the_measured_sizes():
    assert HANDOFF.for_pool(4) == pytest.approx(FOUR, rel=1e-12)
    assert HANDOFF.for_pool(1) == 1e-5 and HANDOFF.for_pool(8) == 4e-5
    assert HANDOFF.for_pool(16) == 4e-5               # beyond the largest measured pool: its handoff
    for workers, seconds in (((8, 1), (1e-5, 2e-5)), ((1, 1), (1e-5, 2e-5)), ((1, 2), (1e-5,)), ((0,), (1e-5,)),
                             ((1,), (-1e-6,)), ((1,), (float("nan"),)), ((1,), (0.5,)), ((), ())):
        with pytest.raises(InputError, match="loader_handoff"):
            LoaderHandoff(workers, seconds)


def test_a_profile_keeps_its_handoff_through_json_and_rejects_a_malformed_one(tmp_path):
    profile = replace(drive(), loader_handoff=HANDOFF)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(profile.to_json()))
    back = load_device(str(path))
    assert back.loader_handoff == HANDOFF and back.digest() == profile.digest()
    assert "loader_handoff" not in drive().to_json()     # a profile without it is written as before
    for bad in ({"workers": [1], "seconds": [1e-5], "cores": 2}, {"workers": [2, 1], "seconds": [1e-5, 2e-5]},
                {"workers": 8, "seconds": 1e-5}, [1, 1e-5]):
        path.write_text(json.dumps({**profile.to_json(), "loader_handoff": bad}))
        with pytest.raises(InputError) as err:
            load_device(str(path))
        assert str(path) in str(err.value.where) and "loader_handoff" in err.value.problem


def test_the_loaders_share_the_compute_threads_core_only_under_pipe1_with_the_team_bound():
    on = lambda env: loaders_on_compute_core(parse_runtime_env(env))
    assert on("PIPE=1") and on("PIPE=1 DIRECT=1") and on("PIPE=1 COLI_MMAP=1") and on("PIPE_WORKERS=4")
    assert not on("") and not on("PIPE=0") and not on("URING=1")
    assert not on("PIPE=1 COLI_NO_OMP_TUNE=1") and on("PIPE=1 COLI_NO_OMP_TUNE=1 OMP_PROC_BIND=close")
    cfg = model_config(parse_runtime_env("PIPE=1 PIPE_WORKERS=4"), RuntimeConfig(), 4, omp_threads=2, cores=2)
    assert cfg.loaders_on_compute_core
    assert read_policy(cfg, replace(drive(), loader_handoff=HANDOFF)).handoff == pytest.approx(FOUR, rel=1e-12)
    assert read_policy(cfg, drive()).handoff == 0.0                      # a profile that did not measure it
    pipe0 = model_config(parse_runtime_env("PIPE=0"), RuntimeConfig(), 4, omp_threads=2, cores=2)
    assert read_policy(pipe0, replace(drive(), loader_handoff=HANDOFF)).handoff == 0.0


def test_each_block_of_demand_loads_waits_the_handoff_on_the_compute_threads_core():
    """test_engine_read_paths' layer on two cores with one kept by the bound team: forward 2's
    misses are page-cache copies of 1, 2, 3 u after matmuls of 2, 4, 6 u, and the thread waits 6 u
    (the copies, one at a time, only while it waits). Handed to loaders on its core, the block
    waits the handoff h first and the copies take that core for it too: 6 u + h. Forward 1's
    drive reads start h later: its wait grows by h. Forward 3 finds every expert in the LRU: no
    block, no handoff."""
    u = MIB / RATE
    sizes = [MIB, 2 * MIB, 3 * MIB]
    profile = replace(copying(), loader_handoff=HANDOFF)
    routes = [[0, 1, 2], [0, 1, 2]]
    common = dict(routing_order=True, page_cache_bytes=8 * MIB, cpu_cores=2, team_held_cores=1, workers=4, **BASE)
    without = run(routes, sizes, RuntimeConfig(**common), profile)
    handed = run(routes, sizes, RuntimeConfig(loaders_on_compute_core=True, **common), profile)
    assert without.stall[1] == pytest.approx(6 * u, rel=1e-12)
    assert handed.stall[1] == pytest.approx(6 * u + FOUR, rel=1e-12)
    assert handed.stall[0] == pytest.approx(without.stall[0] + FOUR, rel=1e-12)
    cached = dict(common, lru_experts=3)
    assert list(run(routes, sizes, RuntimeConfig(loaders_on_compute_core=True, **cached), profile).stall)[1] == 0.0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the probe binds threads to cores: Linux only")
def test_the_probe_times_a_real_pool_on_this_host():
    """A real measurement, in a child process: one handoff per pool size, each a positive time
    well under a millisecond's worth of ten (what it is on a given host is not asserted)."""
    got = loader_handoff(pool_sizes=(1, 4), blocks=40)
    assert got["workers"] == [1, 4] and len(got["seconds"]) == 2, got
    assert all(0 < s < 0.01 for s in got["seconds"]), got
    LoaderHandoff(tuple(got["workers"]), tuple(got["seconds"]))      # what calibrate writes, a profile accepts


def test_replay_says_when_the_profile_did_not_measure_the_handoff(tmp_path):
    """A shipped profile has no loader handoff: under PIPE=1 (the loaders on the compute thread's
    core) replay says the handoff is not counted, in one line; under PIPE=0 it says nothing."""
    from conftest import cli, louvain_plan_and_trace

    plan, trace = louvain_plan_and_trace(tmp_path)
    common = ["replay", "--layout", plan, "--trace", trace, "--device", "single-nvme", "--min-sessions", 1]
    pipe1 = cli(*common, "--runtime-env", "PIPE=1 CAP=2")
    assert pipe1.returncode in (0, 1), pipe1.stderr
    notes = [line for line in pipe1.stderr.splitlines() if "loader handoff" in line]
    assert len(notes) == 1 and "single-nvme" in notes[0] and "relayout calibrate again" in notes[0]
    pipe0 = cli(*common, "--runtime-env", "PIPE=0 CAP=2")
    assert pipe0.returncode in (0, 1) and "loader handoff" not in pipe0.stderr
