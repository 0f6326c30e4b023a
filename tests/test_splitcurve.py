"""S versus RAM for whole and split experts."""

import json

import numpy as np
import pytest
from conftest import cli

from containers.errors import InputError
from containers.geometry import ExpertFormat, load_geometry
from relayout.planning.plan import make_plan, source_from_geometry
from relayout.traces.synth import SynthParams, synth_trace
from replay.model.config import RuntimeConfig
from replay.model.device import load_device
from replay.formats.planfile import load_plan, save_plan
from replay.control.splitcurve import split_curve
from replay.control.splitsizes import segment_sizes
from replay.formats.trace import save_trace


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    g = load_geometry("qwen3-30b-a3b").scaled(moe_layers=3, experts=32, ffn=384)   # 1.19 MB experts
    tr = synth_trace(g.moe_layers, 32, 8, 700, 17, seed=5, params=SynthParams(clique_strength=0.9))
    d = tmp_path_factory.mktemp("curve")
    save_plan(make_plan(tr, source_from_geometry(g), progress=False), d / "plan.json")
    save_trace(tr, d / "t.rt")
    return load_plan(d / "plan.json"), tr, d


def budgets(plan, per_layer_experts):
    eb = plan.layout.expert_bytes()[:, 0]
    return [int(f * eb.sum()) for f in per_layer_experts]


def test_split_curve_at_r_zero_is_the_whole_expert_curve(case):
    plan, tr, _ = case
    c = split_curve(plan, tr, load_device("single-nvme"), RuntimeConfig(workers=2), budgets(plan, (0.5, 2, 6)), ratios=(0.0,))
    assert len(c.whole) == len(c.split) == 3
    for w, s in zip(c.whole, c.split):
        assert s.ratio == 0 and s.top_bytes == 0 and s.resident_tops == 0 and s.lru_bytes == w.ram_bytes
        assert s.train_stall_per_token_s == w.train_stall_per_token_s
        assert s.stall_per_token_s == w.stall_per_token_s and s.ram_hit_rate == w.ram_hit_rate
    assert [w.stall_per_token_s.estimate for w in c.whole] == sorted((w.stall_per_token_s.estimate for w in c.whole), reverse=True)


def test_split_search_never_loses_on_training_and_wins_below_one_expert_per_layer(case):
    plan, tr, _ = case
    c = split_curve(plan, tr, load_device("single-nvme"), RuntimeConfig(workers=2), budgets(plan, (0.6, 3)))
    for w, s in zip(c.whole, c.split):
        assert s.train_stall_per_token_s <= w.train_stall_per_token_s
        assert s.top_bytes + s.lru_bytes <= s.ram_bytes == w.ram_bytes
    low_w, low_s = c.whole[0], c.split[0]
    # 0.6 of an expert per layer: the LRU holds nothing whole, resident tops do fit
    assert low_w.ram_hit_rate == 0 and low_s.ratio > 0 and low_s.resident_tops > 0
    assert low_s.train_stall_per_token_s < low_w.train_stall_per_token_s
    assert low_s.stall_per_token_s.estimate < low_w.stall_per_token_s.estimate
    g = plan.geometry
    sz = segment_sizes(ExpertFormat.parse(
        g.expert_formats[plan.layout.layers[0]]), g.hidden_size, g.moe_intermediate_size, low_s.ratio)
    assert low_s.top_bytes == low_s.resident_tops * sz.top_bytes and low_s.top_rows[0] == sz.top_rows
    assert json.loads(json.dumps(c.to_json()))["split"][0]["ratio"] == low_s.ratio


def test_split_curve_rejects_bad_searches(case):
    plan, tr, _ = case
    dev = load_device("single-nvme")
    for kw, words in ((dict(ram_bytes=[0]), "above 0"), (dict(ram_bytes=[10**7], ratios=(1.0,)), "ratios"),
                      (dict(ram_bytes=[10**7], top_shares=(0.0,)), "top shares")):
        with pytest.raises(InputError, match=words):
            split_curve(plan, tr, dev, RuntimeConfig(), **kw)


def test_cli_split_curve(case, tmp_path):
    plan, _, d = case
    eb = plan.layout.expert_bytes()[:, 0].sum()
    r = cli("split-curve", "--layout", d / "plan.json", "--trace", d / "t.rt", "--device", "single-nvme",
            "--ram-gb", f"{0.6 * eb / 1e9:.6f},{3 * eb / 1e9:.6f}", "--workers", "2", "--ratios", "0.25,0.5",
            "-o", tmp_path / "curve.json")
    assert r.returncode == 0, r.stderr
    rec = json.loads((tmp_path / "curve.json").read_text())
    assert rec["format"] == "relayout.split-curve" and len(rec["whole"]) == len(rec["split"]) == 2
    assert "whole experts" in r.stdout and "split" in r.stdout
    assert np.isfinite([p["stall_per_token_s"]["estimate"] for p in rec["split"]]).all()
