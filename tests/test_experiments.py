"""The proposal's experiments replayed: arms on the same held-out steps, tables a
broken runner would get wrong."""

from dataclasses import replace

import numpy as np
import pytest

from containers.geometry import load_geometry
from relayout.planning.plan import make_plan, source_from_geometry
from relayout.traces.synth import SynthParams, synth_trace
from replay.model.config import RuntimeConfig
from replay.model.device import load_device
from replay.control.experiments import (
    admission_arms,
    hypothesis_tables,
    placement_arm_steps,
    split_arm_steps,
    tail_arms,
    tail_configs,
)
from replay.evaluation.hypotheses import INSUFFICIENT, NOT_SUPPORTED, SUPPORTED
from replay.control.placement import placement_arms
from replay.formats.planfile import load_plan, save_plan
from replay.control.splitcurve import split_curve


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    g = load_geometry("qwen3-30b-a3b").scaled(moe_layers=3, experts=32, ffn=384)   # 1.19 MB experts
    tr = synth_trace(g.moe_layers, 32, 8, 700, 17, seed=4, params=SynthParams(clique_strength=0.9))
    d = tmp_path_factory.mktemp("exp")
    save_plan(make_plan(tr, source_from_geometry(g), progress=False), d / "plan.json")
    return load_plan(d / "plan.json"), tr


DEVICE = "single-nvme"
CONFIG = RuntimeConfig(workers=2, prefetch_experts=4, prefetch_bytes=4 * 1_200_000)


def test_admission_arms_share_the_held_out_steps_and_the_oracle_bound_holds(case):
    plan, tr = case
    arms = admission_arms(plan, tr, load_device(DEVICE), CONFIG)
    assert set(arms) == {"none", "probability", "per-byte", "deadline", "stall-value", "oracle"}
    first = arms["none"]
    for a in arms.values():
        assert np.array_equal(a.committed, first.committed) and np.array_equal(a.session, first.session)
    assert arms["none"].speculative_bytes == 0 and arms["stall-value"].speculative_bytes > 0
    assert arms["oracle"].stall_per_token_s <= min(a.stall_per_token_s for a in arms.values()) + 1e-12


def test_placement_and_split_arms_replay_what_the_studies_report(case):
    plan, tr = case
    dev = load_device(DEVICE)
    ram = int(0.3 * plan.layout.expert_bytes()[:, 0].sum() * plan.layout.n_experts)
    cfg = RuntimeConfig(workers=2)
    study = placement_arms(plan, tr, dev, cfg, ram)
    arms = placement_arm_steps(plan, tr, dev, cfg, ram)
    for a in study.arms:
        assert arms[a.pins.arm].stall_per_token_s == pytest.approx(a.stall_per_token_s.estimate, rel=1e-12)
    curve = split_curve(plan, tr, dev, cfg, [ram])
    (whole, split), = split_arm_steps(plan, tr, dev, cfg, [ram]).values()
    assert whole.stall_per_token_s == pytest.approx(curve.whole[0].stall_per_token_s.estimate, rel=1e-12)
    assert split.stall_per_token_s == pytest.approx(curve.split[0].stall_per_token_s.estimate, rel=1e-12)


def test_tail_arms_are_the_runtime_rule_and_its_budgeted_variants(case):
    plan, tr = case
    arms = tail_arms(plan, tr, load_device(DEVICE), CONFIG)
    assert list(arms) == ["default", "fixed-budget", "cancel", "adaptive", "tail-control"]
    assert arms["fixed-budget"].speculative_bytes <= arms["default"].speculative_bytes


def test_over_two_sources_h5_judges_the_per_source_caps_arm_too(case):
    plan, tr = case
    dev = load_device(DEVICE)
    cfg = replace(CONFIG, dense_seconds=0.005)       # time for every admitted load to start before the routing
    arms = tail_arms(plan, tr, dev, cfg, source="heat+coupled")
    assert list(arms) == ["default", "fixed-budget", "cancel", "adaptive", "tail-control", "source-caps"]
    for a in arms.values():
        assert np.array_equal(a.committed, arms["default"].committed)
    # equal shares (0.5, 0.5) of Q = 4 and B = 4 experts: at most 2 loads of each source per layer
    assert arms["source-caps"].capped_per_token > 0 and arms["tail-control"].capped_per_token == 0
    assert arms["source-caps"].speculative_bytes <= arms["tail-control"].speculative_bytes
    tables = hypothesis_tables(plan, tr, dev, cfg, [0], [CONFIG.prefetch_bytes], ("H5",), source="heat+coupled")
    assert [t.hypothesis.test_arm for t in tables] == ["tail-control", "source-caps"]
    assert any("skipped by a per-source cap" in n for n in tables[1].notes)
    caps = tail_configs(replace(CONFIG, prefetch="heat+coupled", admission="probability", source_caps=(0.25, 1.0)),
                        "heat+coupled")
    assert caps["source-caps"].source_caps == [0.25, 1.0] and caps["tail-control"].source_caps == []
    assert "source-caps" not in tail_configs(CONFIG, "coupled")


def test_a_compute_bound_host_supports_no_hypothesis(case):
    """Matmuls so slow that every load finishes long before it is needed: no policy, placement,
    split or tail control can remove stall, and no table may say otherwise."""
    plan, tr = case
    slow = replace(CONFIG, compute_bytes_per_second=1e6, dense_seconds=0.5)
    ram = int(0.3 * plan.layout.expert_bytes()[:, 0].sum() * plan.layout.n_experts)
    tables = hypothesis_tables(plan, tr, load_device(DEVICE), slow, [ram], [CONFIG.prefetch_bytes])
    assert [t.hypothesis.key for t in tables] == ["H2", "H3a", "H3b", "H5"]
    for t in tables:
        assert t.verdict in (NOT_SUPPORTED, INSUFFICIENT), (t.hypothesis.key, t.reason)
        assert t.verdict != SUPPORTED
        if t.verdict == NOT_SUPPORTED:
            assert "Falsifier:" in t.reason


def test_cli_policy_prints_h2_and_sweep_writes_every_hypothesis(case, tmp_path):
    import json

    from conftest import cli

    from replay.formats.trace import save_trace

    plan, tr = case
    save_trace(tr, tmp_path / "t.rt")
    common = ["--layout", plan.path, "--trace", tmp_path / "t.rt", "--device", DEVICE, "--workers", 2, "--prefetch-experts", 4]
    r = cli("replay", *common, "--policy", "probability,deadline", "--prefetch-budget-mb", 4.8, "-o", tmp_path / "h2.json")
    assert r.returncode == 0, r.stderr
    assert "H2 at RAM 0 GB, B = 4.8 MB per layer" in r.stdout
    assert "Falsifier" in r.stdout or "SUPPORTED" in r.stdout
    rec = json.loads((tmp_path / "h2.json").read_text())
    assert [t["hypothesis"] for t in rec["tables"]] == ["H2"]
    assert [a["arm"] for a in rec["tables"][0]["arms"]] == ["none", "probability", "deadline", "stall-value"]
    ram_gb = 0.3 * plan.layout.expert_bytes()[:, 0].sum() * plan.layout.n_experts / 1e9
    r = cli("replay", *common, "--policy", "probability", "--sweep", "--sweep-ram", f"{ram_gb}", "--sweep-budgets-mb", "4.8",
            "--scheduler", "none", "--json")
    assert r.returncode == 0, r.stderr
    assert [t["hypothesis"] for t in json.loads(r.stdout)["tables"]] == ["H2", "H3a", "H3b", "H5"]
    r = cli("replay", *common, "--hypotheses", "H9")
    assert r.returncode == 2 and "unknown hypothesis 'H9'" in r.stderr


def test_cli_policy_over_two_sources_scores_them_and_their_fusion(case, tmp_path):
    import json

    from conftest import cli

    from replay.formats.trace import save_trace

    plan, tr = case
    save_trace(tr, tmp_path / "t.rt")
    common = ["--layout", plan.path, "--trace", tmp_path / "t.rt", "--device", DEVICE, "--workers", 2, "--prefetch-experts", 4,
              "--prefetch-budget-mb", 4.8]
    r = cli("replay", *common, "--prefetch", "coupled+persistence", "--policy", "probability",
            "--hypotheses", "H2,H5", "--source-caps", "0.75,0.25", "-o", tmp_path / "h.json")
    assert r.returncode == 0, r.stderr
    assert "prediction sources on the held-out sessions (coupled+persistence" in r.stdout
    assert "H5 at RAM 0 GB, B = 4.8 MB per layer, arm judged: source-caps" in r.stdout
    rec = json.loads((tmp_path / "h.json").read_text())
    assert [p["source"] for p in rec["predictors"]] == ["coupled", "persistence", "coupled+persistence"]
    assert len({p["candidates"] for p in rec["predictors"]}) == 1
    assert [t["hypothesis"] for t in rec["tables"]] == ["H2", "H5", "H5"]
    r = cli("replay", *common, "--prefetch", "coupled+oracle", "--policy", "probability")
    assert r.returncode == 2 and "not none, oracle or pilot" in r.stderr and "Traceback" not in r.stderr
    r = cli("replay", *common, "--prefetch", "coupled+persistence", "--policy", "probability", "--source-caps", "0.5")
    assert r.returncode == 2 and "one per source" in r.stderr
