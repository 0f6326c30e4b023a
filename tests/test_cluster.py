"""The executor (serial and Dask give the same results), the sweep on both, and pooled counting
over many trace files (exact map-reduce, same counts as counting the files' rows directly)."""

import json

import numpy as np
import pytest
from conftest import cli
from hypothesis import given, settings
from hypothesis import strategies as st

from containers.errors import InputError
from containers.geometry import load_geometry
from relayout.planning.coactivation import LayerCounts, PairCounts, count_pairs, pair_counts
from relayout.planning.plan import make_plan, source_from_geometry
from relayout.traces.synth import SynthParams, synth_trace
from relayout.planning.training import (
    pooled_training,
    split_sessions,
    trace_paths,
    training_rows,
)
from replay.execution import SerialExecutor, open_executor
from replay.model.config import RuntimeConfig
from replay.model.device import load_device
from replay.evaluation.gate import sweep
from replay.formats.planfile import load_plan, save_plan
from replay.formats.trace import save_trace

pytest.importorskip("distributed")


def _square_plus(x, y):
    return x * x + y


def _concat(a, b):
    return a + b


def _listed(x):
    return [x]


def _refuse(x):
    if x == 3:
        raise InputError(f"item{x}.rt", "is not a trace")
    return [x]


@pytest.fixture(scope="module")
def cluster():
    """A 2-process local Dask cluster, the default a user gets (tasks and results are pickled)."""
    with open_executor("local", workers=2) as ex:
        yield ex


def test_map_and_map_reduce_agree_with_serial_in_order(cluster):
    tasks = [(i, 10 - i) for i in range(9)]
    assert cluster.map(_square_plus, tasks) == SerialExecutor().map(_square_plus, tasks) == [i * i + 10 - i for i in range(9)]
    # concatenation is associative, not commutative: the tree must keep the tasks' order
    lists = [(i,) for i in range(7)]
    assert cluster.map_reduce(_listed, lists, _concat) == SerialExecutor().map_reduce(_listed, lists, _concat) == list(range(7))


@pytest.mark.parametrize("which", ["serial", "dask"])
def test_an_input_error_in_a_task_is_the_same_one_line_error(cluster, which):
    ex = cluster if which == "dask" else SerialExecutor()
    with pytest.raises(InputError, match=r"item3\.rt: is not a trace"):
        ex.map(_refuse, [(i,) for i in range(5)])
    with pytest.raises(InputError, match=r"item3\.rt: is not a trace"):
        ex.map_reduce(_refuse, [(i,) for i in range(5)], _concat)


def test_serial_scheduler_and_unreachable_address():
    with open_executor("none") as ex:
        assert isinstance(ex, SerialExecutor)
    with pytest.raises(InputError, match="cannot reach the Dask scheduler"):
        with open_executor("tcp://127.0.0.1:9", timeout_s=1):
            pass


@pytest.fixture(scope="module")
def sweep_case(tmp_path_factory):
    root = tmp_path_factory.mktemp("sweep")
    g = load_geometry("qwen3-30b-a3b").scaled(moe_layers=3, ffn=384)
    tr = synth_trace(g.moe_layers, 128, 8, 900, 12, seed=3, params=SynthParams(clique_strength=0.9))
    save_plan(make_plan(tr, source_from_geometry(g), progress=False), root / "plan.json")
    return load_plan(root / "plan.json"), tr


def test_sweep_table_is_identical_on_dask_and_serial(cluster, sweep_case):
    plan, tr = sweep_case
    args = (plan, tr, load_device("single-nvme"), RuntimeConfig(), [0.0, 0.05], [1, 4])
    serial = sweep(*args)
    dask = sweep(*args, executor=cluster)
    assert len(serial) == 8 and [(c.ram_gb, c.workers, c.coalesce) for c in serial][:3] == [(0.0, 1, False), (0.0, 1, True), (0.0, 4, False)]
    # bit for bit: floats printed at full precision
    assert json.dumps([c.to_json() for c in serial]) == json.dumps([c.to_json() for c in dask])
    assert len({c.baseline_stall_s for c in serial}) > 1  # the cells differ: each ran its own config


def _files(tmp_path, n=3, tokens=300):
    paths = []
    for i in range(n):
        tr = synth_trace([3, 4, 5], 32, 8, tokens, 4, seed=10 + i, params=SynthParams(clique_strength=0.8))
        p = tmp_path / "pool" / f"t{i}.rt"
        p.parent.mkdir(exist_ok=True)
        save_trace(tr, p)
        paths.append(str(p))
    return paths


def _direct_counts(paths, layers, E):
    """Brute force: each file's training rows counted densely, summed."""
    from replay.formats.trace import load_trace

    total = {layer: np.zeros((E, E), dtype=np.int64) for layer in layers}
    for p in paths:
        tr = load_trace(p)
        train, _ = split_sessions(len(tr.sessions), 0.7)
        fm = training_rows(tr, train)
        for layer in layers:
            total[layer] += pair_counts(tr.experts[tr.layer_rows(layer, fm)].astype(np.int64), E)
    return total


def test_pooled_counts_are_exact_and_the_same_on_dask_and_serial(cluster, tmp_path):
    """5 files: serially in 4 batches (one of two files), on 2 workers in 5 batches of one."""
    paths = _files(tmp_path, n=5)
    g = load_geometry("glm-5.2-int4-row").scaled(moe_layers=3, experts=32)
    geometry = source_from_geometry(g).geometry
    serial = pooled_training(paths, geometry, 0.7, SerialExecutor())
    dask = pooled_training(paths, geometry, 0.7, cluster)
    assert np.array_equal(serial.counts.keys, dask.counts.keys) and np.array_equal(serial.counts.counts, dask.counts.counts)
    assert serial.sessions == dask.sessions and serial.session_fingerprints == dask.session_fingerprints
    # each file split on its own (3 of 4 sessions train), named by its file, in the order given
    assert serial.sessions == [f"{p}:synth-{10 + i}-s00{j}" for i, p in enumerate(paths) for j in range(3)]
    assert serial.held_out_sessions == [f"{p}:synth-{10 + i}-s003" for i, p in enumerate(paths)]
    direct = _direct_counts(paths, g.moe_layers, 32)
    for li, layer in enumerate(g.moe_layers):
        assert np.array_equal(serial.counts.layer(li).pairs, direct[layer])


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(2, 6))
def test_sparse_pair_counts_merge_exactly(seed, k):
    rng = np.random.default_rng(seed)
    E = 12
    tr = synth_trace([0, 1], E, k, 60, 2, seed=seed % 1000)
    half = np.zeros(tr.n_forwards, dtype=bool)
    half[: tr.n_forwards // 2] = True
    a = count_pairs(tr, half, [0, 1, 2], E)
    b = count_pairs(tr, ~half, [0, 1, 2], E)
    both = count_pairs(tr, np.ones(tr.n_forwards, bool), [0, 1, 2], E)
    m = a.merged(b)
    assert np.array_equal(m.keys, both.keys) and np.array_equal(m.counts, both.counts)
    assert np.array_equal(m.heat, both.heat) and m.rows.tolist() == both.rows.tolist()
    for li, layer in enumerate([0, 1]):
        rows = tr.experts[tr.row_layer == layer].astype(np.int64)
        dense = LayerCounts.of_rows(rows, E)
        assert np.array_equal(m.layer(li).pairs, dense.pairs) and np.array_equal(m.layer(li).heat, dense.heat)
        order = rng.permutation(E)
        from relayout.planning.ordering import runs_per_token

        assert m.layer(li).runs_per_token(order) == pytest.approx(runs_per_token(rows, order))
    assert m.layer(2).rows == 0 and not m.layer(2).pairs.any()  # an untraced layer counts nothing
    with pytest.raises(ValueError):
        a.merged(PairCounts(np.array([0]), E, a.rows[:1], a.heat[:1], a.keys[:0], a.counts[:0]))


def test_trace_paths_expand_dirs_and_globs_and_refuse_nothing_or_twice(tmp_path):
    paths = _files(tmp_path, n=2, tokens=60)
    d = tmp_path / "pool"
    assert trace_paths([d]) == paths
    assert trace_paths([str(d / "t*.rt")]) == paths
    with pytest.raises(InputError, match="given twice"):
        trace_paths([paths[0], d])
    with pytest.raises(InputError, match="no such trace file"):
        trace_paths([tmp_path / "missing.rt"])
    with pytest.raises(InputError, match="matches no trace files"):
        trace_paths([str(tmp_path / "nothing*.rt")])


def test_pooled_plan_cli_and_replay_holds_out_each_files_tail(tmp_path):
    paths = _files(tmp_path, n=3, tokens=400)
    geo = ["--geometry", "glm-5.2-int4-row", "--moe-layers", 3, "--experts", 32, "--hidden", 256, "--ffn", 64, "--vocab", 64]
    res = cli("plan", "--trace", paths[0], "--trace", str(tmp_path / "pool" / "t[12].rt"), *geo, "--scheduler", "none",
              "-o", tmp_path / "p.json")
    assert res.returncode == 0, res.stderr
    plan = json.loads((tmp_path / "p.json").read_text())
    assert plan["training"]["trace"] == paths and len(plan["training"]["trace_fingerprint"]) == 3
    assert len(plan["training"]["sessions"]) == 3 * 3 and len(plan["training"]["held_out_sessions"]) == 3
    res = cli("plan", "--trace", str(tmp_path / "pool"), *geo, "--split-ratio", 0.25, "--split-ram-gb", 1,
              "--scheduler", "none", "-o", tmp_path / "q.json")
    assert res.returncode == 2 and "single --trace" in res.stderr and "Traceback" not in res.stderr
    res = cli("replay", "--layout", tmp_path / "p.json", "--trace", paths[1], "--device", "single-nvme", "--json",
              "--min-sessions", 1)
    assert res.returncode == 0, res.stderr
    gate = json.loads(res.stdout)
    assert len(gate["trace"]["sessions_evaluated"]) == 1  # the file's held-out tail; its training sessions excluded by content


def test_a_plan_from_pooled_counts_orders_as_the_plan_from_the_rows(tmp_path):
    """Ordering reads counts only: one file pooled gives the plan its rows give, order for order."""
    from replay.formats.trace import load_trace

    paths = _files(tmp_path, n=1, tokens=400)
    g = load_geometry("glm-5.2-int4-row").scaled(moe_layers=3, experts=32)
    src = source_from_geometry(g)
    for method in ("louvain", "greedy-modularity", "heat"):
        direct = make_plan(load_trace(paths[0]), src, method, progress=False)
        pooled = make_plan(pooled_training(paths, src.geometry, 0.7, SerialExecutor()), src, method, progress=False)
        assert pooled["orders"] == direct["orders"] and pooled["layers"] == direct["layers"]
        assert pooled["training"]["session_fingerprints"] == direct["training"]["session_fingerprints"]
