"""The memory a run's control group leaves the engine (``relayout.workflows.memory_room``), the
run record that keeps it, and the page cache the model gives a run under a memory limit."""

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from containers.errors import InputError
from relayout.workflows.memory_room import memory_room
from replay.colibri.engine_config import config_from_run, engine_copy_rate
from replay.colibri.engine_output import RUN_FILE, RunIdentity

PILOT_RUN = Path(__file__).parent / "data" / "engine" / "pilot-looka"
MiB = 1 << 20


def _proc(tmp_path, lines):
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "cgroup").write_text("\n".join(lines) + "\n")
    return proc


def _v1(tmp_path, group, limit, rss):
    d = tmp_path / "cg" / "memory" / group.lstrip("/")
    d.mkdir(parents=True)
    (d / "memory.stat").write_text(f"cache 5153697792\nrss {rss}\nhierarchical_memory_limit {limit}\n"
                                   f"total_cache 5153697792\ntotal_rss {rss}\n")
    return tmp_path / "cg"


def test_a_v1_limit_less_the_anonymous_memory_charged_beside_the_engine(tmp_path):
    root = _v1(tmp_path, "/jobs/a", 600 * MiB, 200 * MiB)
    proc = _proc(tmp_path, ["9:name=systemd:/", "4:memory:/jobs/a", "0::/"])
    assert memory_room(proc, root) == 400 * MiB


def test_no_limit_is_none_and_so_is_a_machine_without_control_groups(tmp_path):
    root = _v1(tmp_path, "/", 9223372036854771712, 200 * MiB)
    assert memory_room(_proc(tmp_path, ["4:memory:/"]), root) is None
    assert memory_room(tmp_path / "no-proc", root) is None


def test_a_group_outside_the_mount_is_read_at_the_mount_as_in_a_cgroup_namespace(tmp_path):
    root = _v1(tmp_path, "/", 300 * MiB, 100 * MiB)
    assert memory_room(_proc(tmp_path, ["4:memory,hugetlb:/outside/ns"]), root) == 200 * MiB


def test_v2_takes_the_smallest_limit_of_the_group_and_its_ancestors_and_the_anon_where_it_is_set(tmp_path):
    root = tmp_path / "cg"
    leaf = root / "slice" / "job"
    leaf.mkdir(parents=True)
    (root / "cgroup.controllers").write_text("cpu memory\n")
    (root / "slice" / "memory.max").write_text(f"{500 * MiB}\n")
    (root / "slice" / "memory.stat").write_text(f"anon {120 * MiB}\nfile {900 * MiB}\n")
    (leaf / "memory.max").write_text("max\n")
    (leaf / "memory.stat").write_text(f"anon {20 * MiB}\n")
    proc = _proc(tmp_path, ["0::/slice/job"])
    assert memory_room(proc, root) == 380 * MiB
    (leaf / "memory.max").write_text(f"{100 * MiB}\n")
    assert memory_room(proc, root) == 80 * MiB
    (leaf / "memory.max").write_text("max\n")
    (root / "slice" / "memory.max").write_text("max\n")
    assert memory_room(proc, root) is None


def test_the_run_record_keeps_the_room_and_reads_version_1_records_without_it():
    old = json.loads((PILOT_RUN / RUN_FILE).read_text())
    assert old["version"] == 1 and RunIdentity.from_json(old).memory_room is None
    new = replace(RunIdentity.from_json(old), memory_room=400 * MiB)
    assert RunIdentity.from_json(new.to_json()) == new and new.to_json()["version"] == 2
    for bad in ({**new.to_json(), "memory_room": -1}, {**new.to_json(), "memory_room": True},
                {**new.to_json(), "drive_read_bytes": -1}, {**new.to_json(), "drive_read_bytes": 1.5},
                {**old, "memory_room": 5}, {k: v for k, v in new.to_json().items() if k != "memory_room"}):
        with pytest.raises(InputError):
            RunIdentity.from_json(bad)


def test_a_memory_limit_bounds_the_memory_the_model_gives_a_run(tmp_path):
    _, free = config_from_run(PILOT_RUN)
    run = tmp_path / "run"
    shutil.copytree(PILOT_RUN, run)
    identity = RunIdentity.from_json(json.loads((run / RUN_FILE).read_text()))
    (run / RUN_FILE).write_text(json.dumps(replace(identity, memory_room=300 * MiB).to_json()))
    _, bound = config_from_run(run)
    assert free.available_bytes > 1e9 and bound.available_bytes == 300 * MiB


def test_several_pilot_threads_give_no_copy_rate_of_their_own():
    """Their loads' thread times include waiting for each other on the cores they share."""
    from test_pilot import _two_layers

    cfg, facts = config_from_run(PILOT_RUN)
    lay, _, _ = _two_layers([2], ram_experts=1, pilot_precision=1.0)
    assert engine_copy_rate(cfg, facts, lay) > 0
    assert engine_copy_rate(replace(cfg, PILOT_WORKERS=4), facts, lay) == 0.0
    assert engine_copy_rate(replace(cfg, PILOT_WORKERS=4, URING=1), facts, lay) > 0


def test_the_experts_page_cache_is_what_the_engines_memory_leaves():
    """Available memory less the container's dense bytes, the LRU's slots and one working slab
    per expert of a layer (16 here, under colibrì's 64): the rest caches experts' pages, weights
    and scales alike."""
    from replay.colibri.engine_config import EngineConfig, RunFacts, memory_terms
    from test_replay import simple_layout

    lay = simple_layout(E=16, wbytes=(8192, 8192, 16384), sbytes=(4096, 4096, 4096), layers=(3, 4))
    expert = 32768 + 12288
    dense = sum(lay.file_sizes) - 2 * 16 * expert
    lru, page = memory_terms(EngineConfig(CAP=4), RunFacts(cap=4, available_bytes=50e6), lay, 0)
    assert lru == 4
    assert page == int(50e6 - dense - 4 * 2 * expert - 16 * expert)
    assert memory_terms(EngineConfig(CAP=4, DIRECT=1), RunFacts(cap=4, available_bytes=50e6), lay, 0)[1] == 0


def test_a_gate_whose_page_cache_cannot_hold_the_experts_says_its_copies_are_at_the_profiles_rate(tmp_path):
    from conftest import cli, louvain_plan_and_trace

    plan, trace = louvain_plan_and_trace(tmp_path)
    common = ["replay", "--layout", plan, "--trace", trace, "--device", "single-nvme",
              "--min-sessions", 1, "--runtime-env", "PIPE=0 CAP=2"]
    small = cli(*common, "--page-cache-gb", "0.000001")
    assert small.returncode == 0, small.stderr
    assert "holds less than the container's experts" in small.stderr
    large = cli(*common, "--page-cache-gb", "100")
    assert large.returncode == 0 and "holds less" not in large.stderr
    direct = cli(*common[:-1], "PIPE=0 CAP=2 DIRECT=1", "--page-cache-gb", "0.000001")
    assert direct.returncode == 0 and "holds less" not in direct.stderr


def test_v1_takes_the_anonymous_memory_of_the_ancestor_that_sets_the_limit(tmp_path):
    """A limit set on a parent group bounds its children together: the anonymous memory of the
    parent's whole subtree counts, not only the process's own group's."""
    root = tmp_path / "cg"
    parent, leaf = root / "memory" / "jobs", root / "memory" / "jobs" / "a"
    leaf.mkdir(parents=True)
    (parent / "memory.limit_in_bytes").write_text(f"{600 * MiB}\n")
    (parent / "memory.stat").write_text(f"hierarchical_memory_limit {600 * MiB}\ntotal_rss {250 * MiB}\n")
    (leaf / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    (leaf / "memory.stat").write_text(f"hierarchical_memory_limit {600 * MiB}\ntotal_rss {50 * MiB}\n")
    assert memory_room(_proc(tmp_path, ["4:memory:/jobs/a"]), root) == 350 * MiB


def test_a_memory_limited_run_gives_its_warm_class_rate_only_when_it_is_far_above_its_cold_class():
    """Its decode loads mix copies with drive reads; its warm class is taken for the copies only
    when it read at least MIXED_CLASS_FACTOR times as fast as its cold class; the run's own
    output gives both rates (the DISK-CLASS line)."""
    from replay.colibri.engine_config import MIXED_CLASS_FACTOR, EngineConfig, RunFacts
    from test_replay import simple_layout

    lay = simple_layout(E=16, wbytes=(8192, 8192, 16384), sbytes=(4096, 4096, 4096), layers=(3, 4))
    limited = RunFacts(cap=4, available_bytes=1e5, decode_load_seconds=1e-3, cold_read_bytes_per_second=1.5e9,
                       warm_read_bytes_per_second=MIXED_CLASS_FACTOR * 1.5e9)
    assert engine_copy_rate(EngineConfig(CAP=4), limited, lay) == MIXED_CLASS_FACTOR * 1.5e9
    mixed = replace(limited, warm_read_bytes_per_second=MIXED_CLASS_FACTOR * 1.5e9 * 0.99)
    assert engine_copy_rate(EngineConfig(CAP=4), mixed, lay) == 0.0
    assert engine_copy_rate(EngineConfig(CAP=4), replace(limited, cold_read_bytes_per_second=None), lay) == 0.0
    roomy = replace(limited, available_bytes=1e9)        # the page cache holds the experts: the decode loads' rate
    assert engine_copy_rate(EngineConfig(CAP=4), roomy, lay) == pytest.approx(lay.expert_bytes().mean() / 1e-3)
    _, facts = config_from_run(Path(__file__).parent / "data" / "engine" / "stock-louvain" / "baseline" / "p00-r00")
    assert (facts.cold_read_bytes_per_second, facts.warm_read_bytes_per_second) == (0.33e9, 0.29e9)
