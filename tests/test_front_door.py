"""What a user sees first: the held-out sessions a verdict will rest on, refusals before long work,
and a bottom line in words."""

import dataclasses
import json

import pytest

from relayout.render.gate import bottom_line, held_out_notice
from relayout.planning.training import held_out_advice, sessions_needed, split_sessions
from replay.evaluation.evidence import HeldOut
from replay.formats.gatefile import load_gate

from conftest import cli, small_geometry, source_with_manifest


@pytest.mark.parametrize("fraction", [0.5, 0.625, 0.7, 0.8, 0.9])
@pytest.mark.parametrize("need", [1, 5, 9])
def test_sessions_needed_is_the_fewest_that_hold_out_enough(fraction, need):
    n = sessions_needed(fraction, need)
    assert len(split_sessions(n, fraction)[1]) >= need
    assert len(split_sessions(n - 1, fraction)[1]) < need


def test_plan_advice_names_how_many_more_sessions():
    assert "record 3 more (15 in all" in held_out_advice(12, 0.7, 5)
    assert "record" not in held_out_advice(15, 0.7, 5)


def test_replay_notice_says_insufficient_before_the_work():
    few = HeldOut([3, 4], [0, 1, 2], {}, "content")
    assert "will be INSUFFICIENT: record 3 more sessions" in held_out_notice(few, 5)
    assert "INSUFFICIENT" not in held_out_notice(HeldOut([3, 4, 5, 6, 7], [0, 1, 2], {}, "content"), 5)


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """Two different small containers, a 12-session trace and a plan for the first container."""
    root = tmp_path_factory.mktemp("front")
    g = small_geometry()
    a = source_with_manifest(root / "a", g, seed=1)
    b = source_with_manifest(root / "b", g, seed=2)
    trace = root / "t.rt"
    res = cli("synth", "trace", trace, "--geometry", "glm-5.2-int4-g64", "--moe-layers", 3, "--experts", 16,
              "--tokens", 600, "--sessions", 12)
    assert res.returncode == 0, res.stderr
    plan = root / "plan.json"
    res = cli("plan", "--trace", trace, "--container", a, "-o", plan)
    assert res.returncode == 0, res.stderr
    assert "learning from the first 8 of 12 sessions; 4 held out" in res.stderr
    assert "record 3 more" in res.stderr
    return root, a, b, trace, plan


def test_plan_for_another_container_is_refused_before_the_replay(planned):
    root, a, b, trace, plan = planned
    gate = root / "gate-other.json"
    res = cli("replay", "--layout", plan, "--trace", trace, "--device", "single-nvme", "--container", b,
              "--out", root / "dst-other", "-o", gate)
    assert res.returncode == 2
    assert f"the plan is for {a} " in res.stderr and len(res.stderr.strip().splitlines()) == 1
    assert not gate.exists(), "the replay ran (and wrote its gate) before the mismatch was found"
    assert not (root / "dst-other.partial").exists()


def test_existing_destination_is_refused_before_the_replay(planned):
    root, a, b, trace, plan = planned
    dst = root / "taken"
    dst.mkdir()
    gate = root / "gate-taken.json"
    res = cli("replay", "--layout", plan, "--trace", trace, "--device", "single-nvme", "--container", a,
              "--out", dst, "-o", gate)
    assert res.returncode == 2 and "already exists" in res.stderr
    assert not gate.exists()


def test_replay_ends_with_a_bottom_line_for_each_verdict(planned):
    root, a, b, trace, plan = planned
    gate = root / "gate.json"
    res = cli("replay", "--layout", plan, "--trace", trace, "--device", "single-nvme", "-o", gate)
    assert res.returncode == 0, res.stderr
    assert "the verdict will rest on 4 held-out sessions" in res.stdout
    last = res.stdout.strip().splitlines()[-1]
    assert last.startswith("Bottom line: NO VERDICT (insufficient evidence): the new layout saves ")
    assert "ms/token (95% interval" in last and "Record more sessions" in last

    record = load_gate(gate)
    passed = dataclasses.replace(record, verdict="pass")
    text = bottom_line(passed, "plan.json", "gate.json", None, None)
    assert text.startswith("Bottom line: PASS: ")
    assert "relayout rewrite SRC --layout plan.json --gate gate.json --out DST --verify" in text
    assert "SNAP=DST" in text
    failed = dataclasses.replace(record, verdict="fail")
    text = bottom_line(failed, "plan.json", "gate.json", None, None)
    assert text.startswith("Bottom line: FAIL: ") and "Keep the container" in text
    no_room = dataclasses.replace(failed, headroom=dataclasses.replace(record.headroom, max_saving_fraction_of_tpot=0.0))
    assert "there is no headroom" in bottom_line(no_room, "plan.json", None, None, None)
    assert json.loads(gate.read_text())["verdict"] == "insufficient"


def test_ram_beyond_the_routed_experts_is_refused(planned):
    root, a, b, trace, plan = planned
    res = cli("replay", "--layout", plan, "--trace", trace, "--device", "single-nvme", "--ram-gb", 100000)
    assert res.returncode == 2 and "--ram-gb 100000 is more than all" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


def test_sweep_budgets_come_from_the_model(planned):
    root, a, b, trace, plan = planned
    out = root / "sweep.json"
    res = cli("replay", "--layout", plan, "--trace", trace, "--device", "single-nvme", "--sweep", "--sweep-workers", 8,
              "--scheduler", "none", "--ram-gb", 0.001, "-o", out)
    assert res.returncode == 0, res.stderr
    cells = json.loads(out.read_text())["cells"]
    budgets = sorted({c["ram_gb"] for c in cells})
    from replay.formats.planfile import load_plan

    routed = float(load_plan(plan).layout.expert_bytes().sum()) / 1e9
    assert budgets[0] == 0 and 0.001 in budgets
    assert max(budgets) <= routed and max(budgets) == pytest.approx(routed / 2, rel=1e-2)
    assert "not significant" not in res.stdout


def test_verify_against_the_wrong_source_is_bounded(planned):
    root, a, b, trace, plan = planned
    res = cli("verify", a, b)
    assert res.returncode == 2
    lines = res.stdout.strip().splitlines()
    assert len(lines) == 21 and lines[-1].startswith("... and ") and "more problem(s)" in lines[-1]
    full = cli("verify", a, b, "--json")
    assert len(json.loads(full.stdout)["problems"]) == int(lines[-1].split()[2]) + 20


def test_a_missing_directory_is_named_as_missing(tmp_path):
    res = cli("inspect", tmp_path / "nowhere")
    assert res.returncode == 2 and "no such directory" in res.stderr


def test_the_demo_picks_a_new_folder_under_the_current_directory(tmp_path):
    from relayout.workflows.demo import default_demo_dir

    assert default_demo_dir(tmp_path) == tmp_path / "relayout-demo"
    (tmp_path / "relayout-demo").mkdir()
    (tmp_path / "relayout-demo-2").symlink_to(tmp_path / "elsewhere")          # a dangling link counts as taken
    assert default_demo_dir(tmp_path) == tmp_path / "relayout-demo-3"
