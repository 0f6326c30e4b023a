"""A streamed replay is the one-shot replay: chunked by forwards, or fed row blocks cut anywhere."""

from dataclasses import fields, replace

import numpy as np
import pytest

from containers.errors import InputError
from containers.geometry import load_geometry
from relayout.planning.plan import source_from_geometry
from relayout.traces.synth import synth_trace
from replay.model.config import RuntimeConfig
from replay.model.coupling import coupling_table
from replay.model.device import load_device
from replay.model.engine import simulate
from replay.model.metrics import StepTable, step_table
from replay.model.streaming import replay_steps
from replay.formats.trace import TraceFile, load_trace, save_trace
from replay.model.routing import RoutingTrace
from replay.model.unions import RowBlock, realign_blocks, whole_forward_blocks

CONFIGS = {
    "no cache": RuntimeConfig(),
    "LRU, coalesce": RuntimeConfig(ram_bytes=2 * 10**9, coalesce=True, workers=4),
    "oracle prefetch": RuntimeConfig(prefetch="oracle", prefetch_experts=4, dense_seconds=2e-4),
    "LRU, coupled prefetch": RuntimeConfig(ram_bytes=2 * 10**9, prefetch="coupled", prefetch_experts=6, dense_seconds=2e-4),
}


@pytest.fixture(scope="module")
def case():
    g = load_geometry("glm-5.2-int4-row").scaled(moe_layers=4, experts=64)
    tr = synth_trace(list(g.moe_layers), 64, 8, 120, 4, seed=3, geometry=g.name)
    layout = source_from_geometry(g).stock
    train = tr.session_forward_mask([0])
    held = ~train
    held[np.flatnonzero(held)[::5]] = False                  # gaps: forwards a chunk holds but does not replay
    return tr, layout, held, coupling_table(tr, train, layout, max_targets=8), load_device("mac-pro-2019-applraid-4x")


def assert_same_steps(a: StepTable, b: StepTable):
    for f in fields(StepTable):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if f.name == "prefetch":
            assert (x is None) == (y is None)
            if x is not None:
                assert x.keys() == y.keys()
                for k in x:
                    assert np.array_equal(x[k], y[k]), k
        else:
            assert x.dtype == y.dtype and np.array_equal(x, y), f.name   # bit-identical, not approximately


@pytest.mark.parametrize("label", list(CONFIGS))
def test_chunked_replay_is_bit_identical_to_one_shot(case, label):
    tr, layout, held, table, dev = case
    cfg = CONFIGS[label]
    inst, usage = simulate(tr, held, layout, dev, cfg, coupling=table, chunk_forwards=tr.n_forwards)
    whole = step_table(tr, held, inst)
    assert whole.stall.sum() > 0
    if cfg.prefetch != "none":
        assert whole.prefetch["issued"].sum() > 0
    if cfg.ram_bytes:
        assert whole.hits.sum() > 0
    for chunk in (1, 7, tr.n_forwards):
        r = replay_steps(tr, held, layout, dev, cfg, coupling=table, chunk_forwards=chunk)
        assert_same_steps(r.steps, whole)
        assert np.array_equal(r.expert_wait, inst.expert_wait)
        for f in fields(usage):
            assert np.array_equal(getattr(r.usage, f.name), getattr(usage, f.name)), f.name
        chunked, _ = simulate(tr, held, layout, dev, cfg, coupling=table, chunk_forwards=chunk)
        for f in fields(inst):
            if f.name != "prefetch":
                assert np.array_equal(getattr(chunked, f.name), getattr(inst, f.name)), f.name


def test_row_blocks_cut_mid_forward_replay_the_same(case):
    tr, layout, held, table, dev = case
    cfg = CONFIGS["LRU, coupled prefetch"]
    whole = replay_steps(tr, held, layout, dev, cfg, coupling=table, chunk_forwards=tr.n_forwards).steps
    rng = np.random.default_rng(0)
    cuts = np.unique(np.concatenate([[0], rng.integers(0, tr.n_rows, 40), [tr.n_rows]]))
    blocks = [RowBlock(tr.row_forward[a:b], tr.row_layer[a:b], tr.experts[a:b]) for a, b in zip(cuts[:-1], cuts[1:])]
    blocks.insert(3, RowBlock(tr.row_forward[:0], tr.row_layer[:0], tr.experts[:0]))   # an empty block is harmless
    assert_same_steps(replay_steps(tr, held, layout, dev, cfg, coupling=table, blocks=blocks).steps, whole)


def test_realigned_blocks_hold_whole_forwards_and_every_row_once(case):
    tr = case[0]
    rng = np.random.default_rng(1)
    cuts = np.unique(np.concatenate([[0], rng.integers(0, tr.n_rows, 25), [tr.n_rows]]))
    out = list(realign_blocks(RowBlock(tr.row_forward[a:b], tr.row_layer[a:b], tr.experts[a:b])
                              for a, b in zip(cuts[:-1], cuts[1:])))
    assert np.array_equal(np.concatenate([b.row_forward for b in out]), tr.row_forward)
    assert np.array_equal(np.concatenate([b.experts for b in out]), tr.experts)
    seen = set()
    for b in out:
        fs = set(np.unique(b.row_forward).tolist())
        assert not fs & seen                                  # no forward in two blocks
        seen |= fs
    assert [len(b.row_forward) for b in whole_forward_blocks(tr, 7)] == \
        [int(((tr.row_forward >= f) & (tr.row_forward < f + 7)).sum()) for f in range(0, tr.n_forwards, 7)]


def test_a_replay_with_nothing_to_replay_has_empty_steps(case):
    tr, layout, _, table, dev = case
    r = replay_steps(tr, np.zeros(tr.n_forwards, bool), layout, dev, replace(CONFIGS["oracle prefetch"]))
    assert len(r.steps.stall) == 0 and r.steps.prefetch is not None and not r.expert_wait.any()


# ---------------------------------------------------------------- rows streamed from the trace file


def test_a_replay_streamed_from_the_file_is_the_replay_in_memory(case, tmp_path):
    tr, layout, held, table, dev = case
    save_trace(tr, tmp_path / "t.rt")
    tf = TraceFile(tmp_path / "t.rt", rows_per_block=37)
    assert tf.n_forwards == tr.n_forwards and tf.n_rows == tr.n_rows
    assert np.array_equal(np.concatenate([b.experts for b in tf.row_blocks()]), tr.experts)
    cfg = CONFIGS["LRU, coupled prefetch"]
    whole = replay_steps(tr, held, layout, dev, cfg, coupling=table).steps
    assert_same_steps(replay_steps(tf, held, layout, dev, cfg, coupling=table, blocks=tf.row_blocks()).steps, whole)


def write_unchecked(trace, path, monkeypatch):
    """Save a trace whose content breaks validate (a damaged exporter's file with a good digest)."""
    with monkeypatch.context() as m:
        m.setattr(RoutingTrace, "validate", lambda self: None)
        save_trace(trace, path)


@pytest.mark.parametrize("damage, message", [
    (lambda t: t.experts.__setitem__((-1, 0), 99), "expert id is >= n_experts"),
    (lambda t: t.gates.__setitem__((-2, 1), np.inf), "gate is infinite"),
    (lambda t: t.row_position.__setitem__(-1, -3), "position is outside"),
])
def test_opening_a_trace_file_checks_every_block(case, tmp_path, monkeypatch, damage, message):
    tr = case[0].subset([0, 1])
    tr.experts, tr.gates, tr.row_position = tr.experts.copy(), tr.gates.copy(), tr.row_position.copy()
    damage(tr)
    write_unchecked(tr, tmp_path / "bad.rt", monkeypatch)
    with pytest.raises(InputError, match=message):
        TraceFile(tmp_path / "bad.rt", rows_per_block=16)     # the damage sits in the last block
    with pytest.raises(InputError, match=message):
        load_trace(tmp_path / "bad.rt")


def test_rows_out_of_order_across_a_block_boundary_are_refused(case, tmp_path, monkeypatch):
    tr = case[0].subset([0])
    order = np.arange(tr.n_rows)
    order[[15, 16]] = order[[16, 15]]                         # rows 15 and 16 straddle the first boundary
    for name in ("row_forward", "row_layer", "row_position", "experts", "gates"):
        setattr(tr, name, getattr(tr, name)[order])
    write_unchecked(tr, tmp_path / "order.rt", monkeypatch)
    with pytest.raises(InputError, match="not sorted|not in forward order"):
        TraceFile(tmp_path / "order.rt", rows_per_block=16)
    monkeypatch.setattr("replay.model.routing.ROWS_PER_BLOCK", 16)     # validate checks in blocks too
    with pytest.raises(InputError, match="not sorted|not in forward order"):
        tr.validate()


def test_a_trace_file_that_changes_after_opening_is_refused(case, tmp_path):
    tr = case[0]
    save_trace(tr, tmp_path / "t.rt")
    tf = TraceFile(tmp_path / "t.rt")
    save_trace(tr.subset([0]), tmp_path / "t.rt")
    with pytest.raises(InputError, match="changed since it was opened"):
        next(tf.row_blocks())
