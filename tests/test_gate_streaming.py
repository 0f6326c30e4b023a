"""The gate streams its trace and replays the plan's own pins.

One implementation reads rows block by block for a trace in memory and for one streamed from its
file; every figure the gate records must be the same from both, to the bit. A plan that carries a
pin set is replayed with it, in both layouts, and gate.json says which pin set was used.
"""

import json
import pickle

import numpy as np
import pytest
from conftest import cli

from containers.errors import InputError
from containers.geometry import load_geometry
from containers.hashing import digest_of
from relayout.cli.arguments import runtime_config as _runtime_config
from relayout.cli.parser import build_parser
from relayout.planning.plan import make_plan, source_from_geometry
from relayout.traces.synth import SynthParams, synth_trace
from replay.model.config import RuntimeConfig
from replay.model.coupling import COUPLED_TARGETS, coupling_table, top_targets
from replay.model.device import load_device
from replay.evaluation.gate import compare, gate_pins, sweep
from replay.formats.pinfile import PinRecord
from replay.formats.planfile import load_plan, save_plan, with_pins
from replay.formats.trace import TraceFile, load_trace, save_trace

DEVICE = "single-nvme"
BLOCK = 37
"""Rows per block when streaming: small and prime, so forwards and sessions straddle blocks."""


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """Three MoE layers of 64 experts, 12 sessions (8 train the plan, 4 are held out), saved."""
    root = tmp_path_factory.mktemp("gate-streaming")
    g = load_geometry("qwen3-30b-a3b").scaled(moe_layers=3, experts=64, ffn=384)
    tr = synth_trace(g.moe_layers, 64, 8, 600, 12, seed=4, params=SynthParams(clique_strength=0.9))
    save_trace(tr, root / "t.rt")
    save_plan(make_plan(tr, source_from_geometry(g), method="louvain", progress=False), root / "plan.json")
    return dict(root=root, trace=tr, path=root / "t.rt", plan=load_plan(root / "plan.json"))


def reference_fingerprint(tr) -> str:
    """The whole-trace digest as it was defined before streaming: each array hashed whole."""
    h = [json.dumps([tr.layers.tolist(), tr.n_experts, tr.top_k, tr.sessions]).encode()]
    for name in ("row_forward", "row_layer", "row_position", "experts", "gates",
                 "fwd_session", "fwd_kind", "fwd_evaluated", "fwd_committed"):
        h.append(digest_of(np.ascontiguousarray(getattr(tr, name)).tobytes()).encode())
    return digest_of(b"|".join(h))


def reference_session_fingerprints(tr) -> list[str]:
    """Each session's digest as defined before streaming: its forwards' and rows' arrays whole."""
    import xxhash

    out = []
    for si in range(len(tr.sessions)):
        fw = np.flatnonzero(tr.fwd_session == si)
        rows = np.flatnonzero(np.isin(tr.row_forward, fw))
        h = xxhash.xxh3_128()
        for arr in (tr.fwd_kind[fw], tr.fwd_evaluated[fw], tr.fwd_committed[fw]):
            h.update(arr.astype(np.int64).tobytes())
        for arr in (tr.row_forward[rows].astype(np.int64) - (fw[0] if len(fw) else 0), tr.row_layer[rows], tr.row_position[rows]):
            h.update(np.asarray(arr, dtype=np.int64).tobytes())
        h.update(tr.experts[rows].astype(np.int64).tobytes())
        out.append(h.hexdigest())
    return out


def test_digests_are_the_same_from_memory_from_the_file_and_by_the_old_definition(case):
    tr, path = case["trace"], case["path"]
    loaded, streamed = load_trace(path), TraceFile(path, rows_per_block=BLOCK)
    want = reference_fingerprint(tr)
    assert tr.fingerprint() == loaded.fingerprint() == streamed.fingerprint() == want
    assert "_gates" in loaded.__dict__ and not isinstance(loaded.__dict__["_gates"], np.ndarray)   # hashed from the file
    sessions = reference_session_fingerprints(tr)
    assert len(set(sessions)) == len(sessions)
    assert tr.session_fingerprints() == loaded.session_fingerprints() == streamed.session_fingerprints() == sessions
    # a changed gate changes the whole-trace digest but no session's (gates are not routing content)
    tr2 = load_trace(path, gates=True)
    tr2.gates[5, 0] += 0.5
    assert tr2.fingerprint() != want and tr2.session_fingerprints() == sessions


def test_a_streamed_trace_pickles_for_a_cluster_and_still_reads_its_file(case):
    tf = TraceFile(case["path"], rows_per_block=BLOCK)
    back = pickle.loads(pickle.dumps(tf))
    assert back.fingerprint() == case["trace"].fingerprint()
    assert np.array_equal(np.concatenate([b.experts for b in back.row_blocks()]), case["trace"].experts)


def _pair_table_by_hand(tr, train, layout):
    """The coupled table counted row by row: expert e of layer l and f of layer l+1 at the same
    (forward, position) of a training forward count once."""
    L, E = len(layout.layers), layout.n_experts
    at = {}
    for r in np.flatnonzero(train[tr.row_forward]):
        at[(int(tr.row_forward[r]), int(tr.row_layer[r]), int(tr.row_position[r]))] = tr.experts[r][tr.experts[r] >= 0]
    targets = np.full((L, E, COUPLED_TARGETS), -1)
    counts = np.zeros((L, E, COUPLED_TARGETS))
    for li in range(L - 1):
        X = np.zeros((E, E), dtype=np.int64)
        for (f, layer, pos), a in at.items():
            if layer == layout.layers[li]:
                for e in a:
                    for g in at.get((f, int(layout.layers[li + 1]), pos), ()):
                        X[e, g] += 1
        targets[li], counts[li] = top_targets(X, COUPLED_TARGETS)
    return targets, counts


def test_heat_and_the_coupling_table_from_blocks_are_the_counts_in_memory(case):
    tr, plan = case["trace"], case["plan"]
    tf = TraceFile(case["path"], rows_per_block=BLOCK)
    train = tr.session_forward_mask([0, 1, 2])
    direct = np.zeros((len(tr.layers), tr.n_experts), dtype=np.int64)
    rows = np.flatnonzero(train[tr.row_forward])
    for r in rows:
        for e in tr.experts[r][tr.experts[r] >= 0]:
            direct[tr.layer_index(int(tr.row_layer[r])), e] += 1
    assert direct.sum() > 0
    assert np.array_equal(tr.expert_heat(train), direct) and np.array_equal(tf.expert_heat(train), direct)
    assert np.array_equal(tr.expert_heat(), tr.expert_heat(np.ones(tr.n_forwards, bool)))
    want = _pair_table_by_hand(tr, train, plan.layout)
    assert (want[1] > 0).any()
    for source in (tr, tf):
        got = coupling_table(source, train, plan.layout, COUPLED_TARGETS)
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])


@pytest.mark.parametrize("config", [
    RuntimeConfig(workers=2, coalesce=True),
    RuntimeConfig(workers=2, ram_bytes=8 * 10**6, pin_bytes=6 * 10**6, prefetch="coupled", prefetch_experts=4,
                  dense_seconds=2e-4),
], ids=["demand", "LRU, heat pins, coupled prefetch"])
def test_the_gate_record_is_the_same_from_memory_and_streamed_from_the_file(case, config):
    plan, path = case["plan"], case["path"]
    dev = load_device(DEVICE)
    in_memory = compare(plan, load_trace(path), dev, config).to_json()
    streamed = compare(plan, TraceFile(path, rows_per_block=BLOCK), dev, config).to_json()
    assert streamed == in_memory
    assert in_memory["baseline_metrics"]["stall_per_token_s"] > 0
    assert in_memory["pins"]["source"] == ("heat" if config.pin_bytes else "none")
    assert (in_memory["pins"]["experts"] > 0) == bool(config.pin_bytes)
    assert len(in_memory["trace"]["sessions_evaluated"]) == 4


def test_the_sweep_is_the_same_from_memory_and_streamed(case):
    plan, path = case["plan"], case["path"]
    dev, cfg = load_device(DEVICE), RuntimeConfig(workers=2)
    args = ([0.0, 0.01], [2], 0.05)
    assert sweep(plan, TraceFile(path, rows_per_block=BLOCK), dev, cfg, *args) == sweep(plan, load_trace(path), dev, cfg, *args)


# ---------------------------------------------------------------- the plan's own pins


def pinned_plan(case, name: str, experts: list[tuple[int, int]]):
    """The case's plan carrying the pin set ``experts`` ((absolute layer, expert) pairs)."""
    plan = case["plan"]
    size = sum(plan.geometry.expert_bytes[layer] for layer, _ in experts)
    rec = PinRecord("frequency", size, size, 0, DEVICE, "chosen by the test", experts)
    save_plan(with_pins(plan.raw, rec), case["root"] / name)
    return load_plan(case["root"] / name)


def held_out_heat(case):
    """Selections per (layout layer index, expert) in the held-out sessions."""
    tr = case["trace"]
    return tr.expert_heat(tr.session_forward_mask(list(range(8, 12))))


def test_plan_pins_are_replayed_in_both_layouts_and_move_stall_the_way_they_should(case):
    plan, tr = case["plan"], case["trace"]
    dev, cfg = load_device(DEVICE), RuntimeConfig(workers=2)
    layers = [int(x) for x in plan.layout.layers]
    assert layers == tr.layers.tolist()
    heat = held_out_heat(case)
    plain = compare(plan, tr, dev, cfg)
    assert plain.pins.source == "none" and plain.baseline_metrics.stall_per_token_s > 0

    every = pinned_plan(case, "all.json", [(layer, e) for layer in layers for e in range(plan.layout.n_experts)])
    g = compare(every, tr, dev, cfg)
    assert g.pins.source == "plan" and g.pins.experts == len(layers) * plan.layout.n_experts
    assert g.baseline_metrics.stall_per_token_s == 0 and g.plan_metrics.stall_per_token_s == 0
    assert g.baseline_metrics.ram_hit_rate == 1.0

    cold = [(layer, int(e)) for li, layer in enumerate(layers) for e in np.flatnonzero(heat[li] == 0)]
    assert cold                                    # experts no held-out step selects: pinning them changes nothing
    g = compare(pinned_plan(case, "cold.json", cold), tr, dev, cfg)
    assert g.pins.experts == len(cold)
    assert g.baseline_metrics.stall_per_token_s == plain.baseline_metrics.stall_per_token_s
    assert g.plan_metrics.stall_per_token_s == plain.plan_metrics.stall_per_token_s

    hot = [(layer, int(e)) for li, layer in enumerate(layers) for e in np.argsort(-heat[li], kind="stable")[:16]]
    g = compare(pinned_plan(case, "hot.json", hot), tr, dev, cfg)
    assert g.pins.source == "plan" and g.pins.bytes == sum(plan.geometry.expert_bytes[lay] for lay, _ in hot)
    assert g.baseline_metrics.stall_per_token_s < 0.9 * plain.baseline_metrics.stall_per_token_s     # the baseline too
    assert g.plan_metrics.stall_per_token_s < 0.9 * plain.plan_metrics.stall_per_token_s
    assert g.baseline_metrics.ram_hit_rate > plain.baseline_metrics.ram_hit_rate


def test_plan_pins_and_pin_bytes_together_are_refused(case):
    plan = pinned_plan(case, "one.json", [(int(case["plan"].layout.layers[0]), 0)])
    with pytest.raises(InputError, match="carries its own pin set .* drop --pin-gb"):
        gate_pins(case["trace"], plan, RuntimeConfig(pin_bytes=10**6))


def test_replay_from_the_command_line_streams_the_file_and_records_the_plan_pins(case, tmp_path):
    plan = case["plan"]
    hot = [(int(layer), e) for layer in plan.layout.layers for e in range(8)]
    pinned = pinned_plan(case, "cli.json", hot)
    common = ["replay", "--layout", str(pinned.path), "--trace", str(case["path"]), "--device", DEVICE, "--workers", "2"]
    res = cli(*common, "-o", tmp_path / "gate.json")
    assert res.returncode == 0, res.stderr
    gate = json.loads((tmp_path / "gate.json").read_text())
    assert gate["pins"]["source"] == "plan" and gate["pins"]["experts"] == len(hot)
    assert f"pins: {len(hot)} experts, " in res.stdout and "the plan's pin set" in res.stdout
    assert gate["trace"]["fingerprint"] == case["trace"].fingerprint()
    config = _runtime_config(build_parser().parse_args(common))          # the CLI's runtime defaults
    assert gate == compare(pinned, load_trace(case["path"]), load_device(DEVICE), config).to_json()
    res = cli(*common, "--pin-gb", "1")
    assert res.returncode == 2 and "drop --pin-gb" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    (tmp_path / "text.txt").write_text("0 0 3 5:0.5000\n")
    res = cli("replay", "--layout", plan.path, "--trace", tmp_path / "text.txt", "--device", DEVICE)
    assert res.returncode == 2 and "not a relayout trace" in res.stderr and len(res.stderr.strip().splitlines()) == 1
