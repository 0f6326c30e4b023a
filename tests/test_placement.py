"""Placement arms at equal RAM and the pin set in colibrì's PIN form."""

import json

import jsonschema
import numpy as np
import pytest
from conftest import REPO, cli, make_trace

from containers.errors import InputError
from containers.geometry import load_geometry
from containers.layout import Layout
from relayout.planning.plan import make_plan, source_from_geometry
from relayout.traces.synth import SynthParams, synth_trace
from replay.model.config import RuntimeConfig
from replay.model.device import load_device
from replay.formats.pinfile import pin_file_text, pin_gb_for, runtime_pins, write_pin_file
from replay.control.placement import (
    lrfu_value,
    placement_arms,
    selection_counts,
    union_probability,
)
from replay.formats.planfile import load_plan, plan_digest, save_plan, with_pins
from replay.formats.trace import save_trace


def hand_trace(forwards, layers=(3,), E=8, sessions=None):
    """``forwards``: per forward a list of positions, each a list of expert ids (same k)."""
    return make_trace(forwards, layers, sessions=sessions, E=E)


def hand_layout(layers=(3,), E=8):
    loc = np.zeros((len(layers), E, 6, 3), dtype=np.int64)
    off = 0
    for li in range(len(layers)):
        for e in range(E):
            for slot in range(6):
                loc[li, e, slot] = (0, off, 4096)
                off += 4096
    return Layout(["f.safetensors"], [off], list(layers), E, loc, 4096)


def test_frequency_counts_rows_and_probability_counts_steps():
    # forward 0 selects expert 1 at both positions: two selections, one step
    tr = hand_trace([[[1, 2], [1, 3]], [[1, 4], [5, 6]]])
    lay = hand_layout()
    mask = np.ones(2, bool)
    counts = selection_counts(tr, mask, lay)[0]
    prob = union_probability(tr, mask, lay)[0]
    assert counts[1] == 3 and counts[2] == counts[3] == 1
    assert prob[1] == 1.0 and prob[2] == prob[4] == 0.5 and prob[0] == 0


def test_lrfu_weighs_recent_selections_more():
    # expert 1: three early selections; expert 2: two late ones
    tr = hand_trace([[[1]], [[1]], [[1]], [[0]], [[0]], [[0]], [[2]], [[2]]])
    lay = hand_layout()
    mask = np.ones(8, bool)
    assert selection_counts(tr, mask, lay)[0, 1] > selection_counts(tr, mask, lay)[0, 2]
    short = lrfu_value(tr, mask, lay, half_life_steps=1.0)[0]
    assert short[2] > short[1]
    assert short[2] == pytest.approx(1 + 0.5)           # ages 0 and 1 steps
    long = lrfu_value(tr, mask, lay, half_life_steps=1e9)[0]
    assert long[1] == pytest.approx(3) and long[2] == pytest.approx(2)   # infinite memory: frequency


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    g = load_geometry("qwen3-30b-a3b").scaled(moe_layers=3, experts=32, ffn=384)   # 1.19 MB experts
    tr = synth_trace(g.moe_layers, 32, 8, 700, 17, seed=4, params=SynthParams(clique_strength=0.9))
    d = tmp_path_factory.mktemp("placement")
    save_plan(make_plan(tr, source_from_geometry(g), progress=False), d / "plan.json")
    save_trace(tr, d / "t.rt")
    return load_plan(d / "plan.json"), tr, d


@pytest.mark.parametrize("ram_share,workers", [(0.1, 1), (0.3, 2), (0.6, 8)])
def test_stall_value_pins_never_replay_worse_than_frequency_pins_on_training_sessions(case, ram_share, workers):
    plan, tr, _ = case
    ebytes = plan.layout.expert_bytes()[:, 0]
    ram = int(ram_share * ebytes.sum() * plan.layout.n_experts)
    st = placement_arms(plan, tr, load_device("single-nvme"), RuntimeConfig(workers=workers), ram)
    sv, freq, lru = st.arm("stall-value"), st.arm("frequency"), st.arm("lru")
    assert sv.train_stall_per_token_s <= freq.train_stall_per_token_s
    assert sv.train_stall_per_token_s <= lru.train_stall_per_token_s
    for a in st.arms:                                   # equal RAM: pins + LRU is the budget, pins within their share
        assert a.pins.pin_bytes + a.pins.lru_bytes == ram
        assert a.pins.pin_bytes == int(sum(ebytes[li] for li, _ in a.pins.ranking)) == int(ebytes @ a.pins.pinned.sum(axis=1))
        if a.pins.arm in ("frequency", "hybrid", "probability-per-byte"):
            assert 0 < a.pins.pin_bytes <= 0.5 * ram
        assert 0 <= a.ram_hit_rate <= 1
        s = a.stall_per_token_s
        assert s.low <= s.estimate <= s.high
    assert st.held_out_sessions == 5 and st.sufficient
    assert lru.pins.pin_bytes == 0 and not lru.pins.ranking


def test_frequency_arm_pins_the_most_selected_experts(case):
    plan, tr, _ = case
    ebytes = plan.layout.expert_bytes()[:, 0]
    ram = int(0.3 * ebytes.sum() * plan.layout.n_experts)
    st = placement_arms(plan, tr, load_device("single-nvme"), RuntimeConfig(workers=2), ram, arms=("frequency",))
    from replay.control.placement import training_forwards

    counts = selection_counts(tr, training_forwards(tr, plan), plan.layout)
    pinned = st.arm("frequency").pins.pinned
    assert counts[pinned].min() >= counts[~pinned].max()      # equal-sized experts: the top counts, whatever the layer
    ranked = [counts[li, e] for li, e in st.arm("frequency").pins.ranking]
    assert ranked == sorted(ranked, reverse=True)


def test_pin_file_makes_colibri_pin_exactly_the_chosen_set_best_first(tmp_path):
    chosen = [(5, 7), (3, 1), (5, 0), (4, 9)]          # best first, layers out of order on purpose
    path = tmp_path / "PIN.txt"
    write_pin_file(path, chosen)
    assert path.read_text() == "5 7 4\n3 1 3\n5 0 2\n4 9 1\n"
    eb = 19_000_000
    gb = pin_gb_for(len(chosen) * eb)
    assert runtime_pins(path, gb, eb, {3, 4, 5}) == chosen
    assert runtime_pins(path, 2 * eb / 1e9, eb, {3, 4, 5}) == chosen[:2]        # a smaller PIN_GB: the best prefix
    assert runtime_pins(path, gb, eb, {3, 4}) == [(3, 1), (4, 9)]               # layers it does not route: skipped
    assert pin_file_text([]) == ""


def test_plan_records_pins_strictly_and_matches_its_schema(case, tmp_path):
    plan, tr, _ = case
    ebytes = plan.layout.expert_bytes()[:, 0]
    st = placement_arms(plan, tr, load_device("single-nvme"), RuntimeConfig(workers=2),
                        int(0.3 * ebytes.sum() * plan.layout.n_experts), arms=("lru", "frequency"))
    rec = st.pin_record("frequency")
    raw = with_pins(plan.raw, rec)
    assert raw["plan_digest"] != plan.digest
    save_plan(raw, tmp_path / "pinned.json")
    loaded = load_plan(tmp_path / "pinned.json")
    assert loaded.pins == rec and loaded.pins.experts[0][0] in plan.layout.layers
    schema = json.loads((REPO / "manifests" / "schemas" / "plan.schema.json").read_text())
    jsonschema.validate(json.loads((tmp_path / "pinned.json").read_text()), schema)
    for damage, words in ((lambda p: p["experts"].append([p["experts"][0][0], 10_000]), "does not have"),
                          (lambda p: p["experts"].append(list(p["experts"][0])), "repeat"),
                          (lambda p: p.update(pin_bytes=p["pin_bytes"] + 1), "bytes of the pinned experts"),
                          (lambda p: p.update(experts="3:1"), "pairs")):
        bad = json.loads(json.dumps(raw))
        damage(bad["pins"])
        bad["plan_digest"] = plan_digest(bad)
        save_plan(bad, tmp_path / "bad.json")
        with pytest.raises(InputError, match=words):
            load_plan(tmp_path / "bad.json")


def test_placement_refuses_a_split_plan_and_no_ram(case):
    plan, tr, _ = case
    with pytest.raises(InputError, match="RAM budget"):
        placement_arms(plan, tr, load_device("single-nvme"), RuntimeConfig(), 0)
    with pytest.raises(InputError, match="unknown placement arm"):
        placement_arms(plan, tr, load_device("single-nvme"), RuntimeConfig(), 10**8, arms=("mru",))


def test_cli_placement_writes_the_pin_file_and_the_pinned_plan(case, tmp_path):
    plan, _, d = case
    r = cli("placement", "--layout", d / "plan.json", "--trace", d / "t.rt", "--device", "single-nvme", "--ram-gb", "0.02",
            "--workers", "2", "--arms", "lru,frequency,stall-value", "--pin-file", tmp_path / "PIN.txt",
            "--plan-out", tmp_path / "pinned.json", "-o", tmp_path / "arms.json")
    assert r.returncode == 0, r.stderr
    assert "stall-value" in r.stdout and "PIN_GB=" in r.stdout
    pinned = load_plan(tmp_path / "pinned.json").pins
    lines = (tmp_path / "PIN.txt").read_text().splitlines()
    assert [tuple(map(int, x.split()[:2])) for x in lines] == pinned.experts
    arms = json.loads((tmp_path / "arms.json").read_text())
    assert [a["arm"] for a in arms["arms"]] == ["lru", "frequency", "stall-value"]
    bad = cli("placement", "--layout", d / "plan.json", "--trace", d / "t.rt", "--device", "single-nvme", "--ram-gb", "0.02",
              "--pin-gb", "1")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--pin-gb" in bad.stderr
