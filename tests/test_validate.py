"""``relayout validate``: structure of the record, what it leaves behind, its errors.

Measured S depends on the disk, so nothing here asserts a timing: only that every cell was
predicted and measured, that each comparison carries both intervals and the agreement fields,
that the source is untouched and the work directory goes (or stays with --keep).
"""

import json
import os
from pathlib import Path

import numpy as np
import pytest
from conftest import cli, small_geometry, source_with_manifest, tree_state

from relayout.workflows.validation.diagnoses import at_harness_compute, normalized_saving, speed_normalized_savings
from relayout.workflows.validation.record import VALIDATION_FORMAT, VALIDATION_VERSION, judge_record
from relayout.workflows.validation.rules import cell_agreement
from relayout.workflows.validation.run import WORK_MARKER, WORK_NAME
from relayout.workflows.validation.summary import drive_reads_check, harness_compute, page_cache_waits, summarize_validation
from containers.errors import InputError
from replay.evaluation.stats import repetition_interval


@pytest.fixture(scope="module")
def disk(tmp_path_factory):
    """A directory standing for the disk under test, holding a small container with its manifest."""
    root = tmp_path_factory.mktemp("disk")
    source_with_manifest(root / "src", small_geometry(), seed=7)
    return root


def _validate(disk, out, *extra):
    return cli("validate", disk, "--container", disk / "src", "--device", "single-nvme", "--reps", 2, "--tokens", 8,
               "--ram", "0", "--prefetch", "none", "--layouts", "stock,louvain", "-o", out, *extra)


def _check_record(v: dict) -> None:
    assert v["format"] == VALIDATION_FORMAT and v["version"] == VALIDATION_VERSION
    def same(a: dict, b: dict) -> bool:                  # as JSON: a NaN equals itself there
        return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)

    assert same(judge_record(v), v)                      # the verdict is a pure function of what the record holds
    bare = json.loads(json.dumps(v))                     # judged again from its measurements alone
    for c in bare["cells"]:
        del c["agreement"], c["measured_stall_per_token_s"]["family"]
    for x in bare["comparisons"] + bare["prefetch_comparisons"]:
        del x["agreement"], x["words"], x["measured_saving"]["family"]
    del bare["summary"]
    snap = json.loads(json.dumps(bare))
    assert same(judge_record(bare), v) and same(bare, snap)   # and its input is left as it was
    k = len(v["cells"]) + len(v["comparisons"]) + len(v["prefetch_comparisons"])
    assert all(c["measured_stall_per_token_s"]["family"]["judgements"] == k for c in v["cells"])
    for c in v["cells"]:                                 # each run predicted with the compute its harness ran
        h, mc = c["at_harness_compute"], c["measured_compute_per_token_s"]
        assert mc["mean"] > 0 and c["predicted_compute_per_token_s"] > 0
        assert h["excess_compute_per_token_s"] == pytest.approx([x - c["predicted_compute_per_token_s"]
                                                                 for x in mc["repetitions"]])
    assert v["summary"]["harness_compute"]["cells"] == len(v["cells"])
    assert "the harness's compute" in v["summary"]["text"]
    for old in (VALIDATION_VERSION - 1, 6):               # an older record: one line, run validate again
        with pytest.raises(InputError, match=f"version {old}; this relayout reads version {VALIDATION_VERSION}: run "
                                             "relayout validate again") as e:
            judge_record({**v, "version": old}, "v.json")
        assert str(e.value).count("\n") == 0 and str(e.value).startswith("v.json: ")
    with pytest.raises(InputError, match="not a relayout.validation record"):
        judge_record({**v, "format": "something else"})
    lacking = json.loads(json.dumps(v))
    del lacking["placement_control"]
    with pytest.raises(InputError, match="lacks 'placement_control'"):
        judge_record(lacking)
    assert v["device"]["name"] == "single-nvme" and v["device"]["profile"]["drive"]
    assert v["container"]["fingerprint"] and v["trace"]["fingerprint"] and len(v["trace"]["held_out_sessions"]) >= 5
    assert v["config"]["reps"] == 2 and v["config"]["tokens"] == 8 and v["trace"]["steps"] == 8
    assert {(c["layout"], c["ram_fraction"], c["prefetch"]) for c in v["cells"]} == {("stock", 0.0, "none"), ("louvain", 0.0, "none")}
    for c in v["cells"]:
        assert c["predicted_stall_per_token_s"] > 0
        m = c["measured_stall_per_token_s"]
        assert m["mean"] > 0 and len(m["repetitions"]) == 2 and all(x >= 0 for x in m["repetitions"])
        assert m["mean"] == pytest.approx(sum(m["repetitions"]) / 2)
        half = 12.706204736 * abs(m["repetitions"][0] - m["repetitions"][1]) / 2      # t(0.975, 1) * sd / sqrt(2)
        assert (m["high"] - m["low"]) / 2 == pytest.approx(half, rel=1e-6)
        assert (m["high"] + m["low"]) / 2 == pytest.approx(m["mean"], rel=1e-9)
        assert c["ratio"] == pytest.approx(c["predicted_stall_per_token_s"] / m["mean"])
        f = m["family"]      # 3 judgements (2 cells, 1 saving): each ruled out only beyond its 1 - 0.05 / 3 interval
        assert f["judgements"] == 3 and f["level"] == pytest.approx(1 - 0.05 / 3)
        fhalf = 38.188459297 * abs(m["repetitions"][0] - m["repetitions"][1]) / 2            # t(1 - 0.05 / 6, 1)
        assert (f["high_s"] - f["low_s"]) / 2 == pytest.approx(fhalf, rel=1e-6)
        assert c["agreement"] == cell_agreement(c["predicted_stall_per_token_s"], m["mean"], f["low_s"], f["high_s"])
    d = v["drift"]                                       # probed before the first repetition and after each
    assert len(d["rates_Bps"]) == 3 and all(r > 0 for r in d["rates_Bps"]) and len(d["scales"]) == 2
    assert d["probe"]["depth"] == v["config"]["workers"] and d["probe"]["size_bytes"] % 4096 == 0   # the runs' reads
    assert d["scales"][1] == pytest.approx((d["rates_Bps"][1] + d["rates_Bps"][2]) / 2 / d["profile_rate_Bps"])
    assert d["change"] == pytest.approx(max(d["rates_Bps"]) / min(d["rates_Bps"]) - 1)
    for c in v["cells"]:
        p = c["at_probed_speed"]
        assert len(p["predicted_stall_per_token_s"]) == 2 and all(x > 0 for x in p["predicted_stall_per_token_s"])
        assert p["ratio"] == pytest.approx(sum(p["predicted_stall_per_token_s"]) / 2 / c["measured_stall_per_token_s"]["mean"])
    for c in v["cells"]:                                # each run predicted at the rate its drive ran at
        a = c["at_run_speed"]
        assert len(a["scales"]) == 2 and all(f > 0 for f in a["scales"]) and all(r > 0 for r in a["measured_rate_Bps"])
        assert a["ratio"] == pytest.approx(sum(a["predicted_stall_per_token_s"]) / 2 / c["measured_stall_per_token_s"]["mean"])
        n = c["at_neighbour_speed"]
        assert len(n["scales"]) == 2 and all(f > 0 for f in n["scales"])
        assert n["ratio"] == pytest.approx(sum(n["predicted_stall_per_token_s"]) / 2 / c["measured_stall_per_token_s"]["mean"])
    first_run = next(c for c in v["cells"] if c["layout"] == "stock")   # rep 0 measures stock first, then louvain
    louvain_r0 = next(c for c in v["cells"] if c["layout"] == "louvain")["at_run_speed"]["scales"][0]
    assert first_run["at_neighbour_speed"]["scales"][0] == pytest.approx(louvain_r0)
    first = v["first_read"]                             # every container read once, whole, before measuring
    assert set(first) == {"stock", "louvain", "stock-copy"} and all(r["rate_Bps"] > 0 for r in first.values())
    pc = v["placement_control"]                         # a second copy of stock, measured in every block
    assert pc["prefetch"] == "none" and [b["ram_fraction"] for b in pc["blocks"]] == [0.0]
    b = pc["blocks"][0]
    stock_reps = next(c for c in v["cells"] if c["layout"] == "stock")["measured_stall_per_token_s"]["repetitions"]
    assert b["stock_s"] == stock_reps and len(b["copy_s"]) == 2 and all(x >= 0 for x in b["copy_s"])
    assert b["difference"]["repetitions"] == pytest.approx([a - c for a, c in zip(stock_reps, b["copy_s"])])
    assert v["summary"]["placement_bound_s"] == pytest.approx(max(abs(b["difference"]["low_s"]), abs(b["difference"]["high_s"])))
    assert "placement control" in v["summary"]["text"]
    assert first["stock"]["bytes"] == sum(p.stat().st_size for p in Path(v["container"]["path"]).iterdir() if p.is_file())
    assert len(v["comparisons"]) == 1
    x = v["comparisons"][0]
    assert x["layout"] == "louvain" and x["baseline"] == "stock"
    p, m = x["predicted_saving"], x["measured_saving"]
    assert p["low_s"] <= p["high_s"] and p["method"] == "moving-block" and p["block_steps"] >= 1 and p["units"] == 8
    assert m["low_s"] <= m["estimate_s"] <= m["high_s"] and m["units"] == 2 and len(m["repetitions"]) == 2   # per repetition
    stock, louvain = (next(c for c in v["cells"] if c["layout"] == k) for k in ("stock", "louvain"))
    assert m["repetitions"] == pytest.approx([a - b for a, b in zip(stock["measured_stall_per_token_s"]["repetitions"],
                                                                    louvain["measured_stall_per_token_s"]["repetitions"])])
    assert x["agreement"] in ("agrees", "within placement", "unresolved", "disagrees") and "within_tolerance" not in x
    assert x["placement_bound_s"] == pytest.approx(v["summary"]["placement_bound_s"])
    a = x["at_run_speed"]                                # each run brought to the profile's speed, then paired
    assert a["measured"]["repetitions"] == pytest.approx(speed_normalized_savings(
        stock["measured_stall_per_token_s"]["repetitions"], stock["predicted_stall_per_token_s"],
        stock["at_run_speed"]["predicted_stall_per_token_s"], louvain["measured_stall_per_token_s"]["repetitions"],
        louvain["predicted_stall_per_token_s"], louvain["at_run_speed"]["predicted_stall_per_token_s"]))
    assert a["agreement"] in ("agrees", "unresolved", "disagrees") and isinstance(a["predicted_inside_measured"], bool)
    assert v["prefetch_comparisons"] == []               # no prefetch source measured
    assert isinstance(x["predicted_inside_measured"], bool) and isinstance(x["measured_excludes_zero"], bool)
    assert x["sign_agrees"] in (True, False, None) and (x["sign_agrees"] is None) == (not x["measured_excludes_zero"])
    g = x["gate"]
    assert g["threshold"] == 0.05 and g["same_decision"] == (g["predicted"]["passes"] == g["measured"]["passes"])
    assert g["predicted"]["tpot_s"] > 0 and g["measured"]["tpot_s"] > 0
    assert x["words"]
    s = v["summary"]
    assert isinstance(s["holds"], bool) and s["comparisons"] == 1 and s["holds"] == (s["verdict"] == "holds")
    assert s["verdict"] in ("does not hold", "insufficient")      # 2 repetitions: no verdict unless ruled out
    assert s["text"].startswith({"does not hold": "the model does NOT hold",
                                 "insufficient": "INSUFFICIENT on this disk: 2 repetition(s) per cell"}[s["verdict"]])


@pytest.mark.slow
def test_validate_record_source_untouched_work_dir_removed(disk, tmp_path):
    before = tree_state(disk / "src")
    out = tmp_path / "validation.json"
    r = _validate(disk, out)
    assert r.returncode == 0, r.stderr
    v = json.loads(out.read_text())
    _check_record(v)
    assert v["work_dir"] is None and v["plots"] == []
    assert tree_state(disk / "src") == before
    assert not (disk / WORK_NAME).exists()
    assert v["summary"]["text"] in r.stdout and "pred/meas" in r.stdout and "total time" in r.stdout
    assert r.stdout.strip().splitlines()[-1].startswith(f"Bottom line: the model {v['summary']['verdict']} on this disk; ")
    assert r.stdout.strip().endswith(f"Record: {out}.")
    assert not list(tmp_path.glob("*.device.json"))   # --device given: nothing calibrated


@pytest.mark.slow
def test_validate_keep_and_plots(disk, tmp_path):
    pytest.importorskip("matplotlib")
    before = tree_state(disk / "src")
    out = tmp_path / "validation.json"
    r = _validate(disk, out, "--keep", "--plots", tmp_path / "plots")
    try:
        assert r.returncode == 0, r.stderr
        v = json.loads(out.read_text())
        _check_record(v)
        work = disk / WORK_NAME
        assert v["work_dir"] == str(work) and (work / WORK_MARKER).is_file()
        assert (work / "layout-louvain").is_dir() and (work / "layout-stock-copy").is_dir()
        assert len(list((work / "runs").glob("*.jsonl"))) == 6           # 2 layouts + the placement control, x 2
        png = tmp_path / "plots" / "validation_predicted_vs_measured.png"
        assert v["plots"] == [str(png)] and png.read_bytes()[:4] == b"\x89PNG"
        assert tree_state(disk / "src") == before
        (work / "notes.txt").write_text("mine")       # the user's, added to the kept directory
        (work / "layout-louvain" / "my_weights.safetensors").write_text("mine too")
        r = _validate(disk, out)                       # refused: its layout directory holds a file it did not make
        assert r.returncode == 2 and "my_weights.safetensors" in r.stderr and "Traceback" not in r.stderr, r.stderr
        (work / "layout-louvain" / "my_weights.safetensors").unlink()
        r = _validate(disk, out)                       # a kept work directory is ours: reused, then removed ...
        assert r.returncode == 0, r.stderr
        assert sorted(os.listdir(work)) == [WORK_MARKER, "notes.txt"] and (work / "notes.txt").read_text() == "mine"
        assert f"kept {work}" in r.stderr and "notes.txt" in r.stderr     # ... all but what it did not make, named
    finally:
        import shutil

        shutil.rmtree(disk / WORK_NAME, ignore_errors=True)


@pytest.mark.slow
def test_validate_compares_each_prefetch_source_with_none(disk, tmp_path):
    out = tmp_path / "validation.json"
    r = cli("validate", disk, "--container", disk / "src", "--device", "single-nvme", "--reps", 2, "--tokens", 8,
            "--ram", "0", "--prefetch", "none,oracle", "--layouts", "stock,louvain", "-o", out)
    assert r.returncode == 0, r.stderr
    v = json.loads(out.read_text())
    cells = {(c["layout"], c["prefetch"]): c for c in v["cells"]}
    assert len(v["prefetch_comparisons"]) == 2 and len(v["comparisons"]) == 2
    for x in v["prefetch_comparisons"]:
        assert x["prefetch"] == "oracle" and x["baseline"] == "none" and x["tolerance"] == 0.30
        none, oracle = cells[(x["layout"], "none")], cells[(x["layout"], "oracle")]
        assert x["measured_saving"]["repetitions"] == pytest.approx(
            [a - b for a, b in zip(none["measured_stall_per_token_s"]["repetitions"],
                                   oracle["measured_stall_per_token_s"]["repetitions"])])
        assert x["predicted_saving"]["estimate_s"] == pytest.approx(
            none["predicted_stall_per_token_s"] - oracle["predicted_stall_per_token_s"])
        assert isinstance(x["within_tolerance"], bool) and x["agreement"] in ("agrees", "unresolved", "disagrees")
        m, p = x["measured_saving"], x["predicted_saving"]["estimate_s"]
        assert x["within_tolerance"] == (abs(p - m["estimate_s"]) <= 0.30 * abs(m["estimate_s"]))
        assert (x["agreement"] == "agrees") == (x["within_tolerance"] or m["low_s"] <= p <= m["high_s"])
    assert v["summary"]["prefetch_comparisons"] == 2
    assert "prefetch saving vs no prefetch" in r.stdout and "of the measured one in" in v["summary"]["text"]


@pytest.mark.slow
def test_validate_coalesces_in_the_model_and_the_measured_runs_alike(disk, tmp_path):
    from containers.container import Container
    from relayout.workflows.validation.prepare import validation_trace
    from replay.model.config import RuntimeConfig
    from replay.model.device import load_device
    from replay.model.engine import simulate
    from replay.evaluation.gate import evaluation_forwards
    from replay.model.metrics import step_table, summarize
    from replay.formats.planfile import load_plan

    out = tmp_path / "validation.json"
    try:
        r = _validate(disk, out, "--coalesce", "--workers", 1, "--keep")
        assert r.returncode == 0, r.stderr
        v = json.loads(out.read_text())
        assert v["config"]["runtime"]["coalesce"] is True and v["config"]["workers"] == 1
        assert "1 workers, reads coalesced" in r.stdout
        for c in v["cells"]:                                 # the harness's waits for page-cache loads, per repetition
            w = c["measured_page_cache_wait_per_token_s"]
            assert len(w["repetitions"]) == v["config"]["reps"] and all(x >= 0 for x in w["repetitions"])
            assert all(x <= s for x, s in zip(w["repetitions"], c["measured_stall_per_token_s"]["repetitions"]))
        assert all("less_page_cache_waits" in x for x in v["comparisons"])
        for c in v["cells"]:                                 # what reaches the drive, per token, in both
            assert c["predicted_drive_reads_per_token"] > 0 and c["measured_drive_reads_per_token"]["mean"] > 0
        assert "drive reads: the model's demand preads that reach the drive are" in r.stdout
        work = disk / WORK_NAME
        for run in (work / "runs").glob("*.jsonl"):          # every measured run read with coalescing on
            steps = [json.loads(x) for x in run.read_text().splitlines() if '"record":"step"' in x]
            assert steps and all("workers=1" in x["configuration"] and "coalesce=1" in x["configuration"] for x in steps)
        trace = validation_trace(Container.open(disk / "src"), 0, 8)
        plans = {m: load_plan(work / f"plan-{m}.json") for m in ("stock", "louvain")}
        mask, _ = evaluation_forwards(trace, list(plans.values()))
        mask &= np.cumsum(mask) <= v["config"]["tokens"]
        for m, plan in plans.items():                        # the prediction is the coalescing model's, not the default's
            layout = plan.stock if m == "stock" else plan.layout  # --container: stock is measured where it is
            predicted = {}
            for coalesce in (True, False):
                inst, usage = simulate(trace, mask, layout, load_device("single-nvme"),
                                       RuntimeConfig(workers=1, coalesce=coalesce))
                predicted[coalesce] = summarize(step_table(trace, mask, inst), usage, 0.0).stall_per_token_s
            cell = next(c for c in v["cells"] if c["layout"] == m)
            assert cell["predicted_stall_per_token_s"] == pytest.approx(predicted[True], rel=1e-9)
            if m == "louvain":
                assert predicted[True] != pytest.approx(predicted[False], rel=1e-3)
    finally:
        import shutil

        shutil.rmtree(disk / WORK_NAME, ignore_errors=True)


def test_validate_refuses_a_foreign_work_dir(disk, tmp_path):
    work = disk / WORK_NAME
    work.mkdir()
    (work / "precious.txt").write_text("not ours")
    try:
        r = _validate(disk, tmp_path / "v.json")
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and WORK_MARKER in r.stderr
        assert (work / "precious.txt").read_text() == "not ours"
    finally:
        (work / "precious.txt").unlink()
        work.rmdir()


@pytest.mark.parametrize("bad, says", [
    (["--reps", "0"], "--reps"),
    (["--ram", "-1"], "--ram"),
    (["--ram", "0,x"], "--ram"),
    (["--layouts", "stock,zigzag"], "zigzag"),
    (["--layouts", "louvain"], "stock"),
    (["--prefetch", "psychic"], "psychic"),
    (["--tokens", "1"], "--tokens"),
    (["--workers", "0"], "--workers"),
    (["--minutes", "-2"], "--minutes"),
    (["--minutes", "1", "--tokens", "8", "--reps", "2"], "--minutes"),
])
def test_validate_bad_arguments_are_one_line(disk, tmp_path, bad, says):
    r = cli("validate", disk, "--container", disk / "src", "--device", "single-nvme", "-o", tmp_path / "v.json", *bad)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("relayout: error: ") and r.stderr.count("\n") == 1 and says in r.stderr
    assert not (disk / WORK_NAME).exists() and not (tmp_path / "v.json").exists()


def test_validate_bad_paths_are_one_line(disk, tmp_path):
    r = cli("validate", tmp_path / "missing", "--device", "single-nvme")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "not a directory" in r.stderr
    r = cli("validate", disk, "--device", "no-such-profile", "--container", disk / "src", "-o", tmp_path / "v.json")
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert not (disk / WORK_NAME).exists()


def _cell(layout, predicted, reps):
    m = repetition_interval(reps)
    return {"layout": layout, "ratio": predicted / m.estimate, "agreement": cell_agreement(predicted, m.estimate, m.low, m.high),
            "measured_stall_per_token_s": {"mean": m.estimate, "repetitions": list(reps), "low": m.low, "high": m.high}}


STEADY = (0.99, 1.0, 1.01, 1.0)


def _comparison(sign, same=True, inside=True, words="measurement agrees with the prediction"):
    return {"layout": "louvain", "ram_fraction": 0.0, "prefetch": "none", "sign_agrees": sign,
            "predicted_inside_measured": inside, "agreement": "agrees" if inside and sign is not False else "disagrees",
            "gate": {"same_decision": same}, "words": words}


def test_a_run_is_predicted_with_its_harness_compute_as_slower_matmuls():
    rates = []

    def stall_at(rate):
        rates.append(rate)
        return 0.03

    # the model computes 11 ms/token, 3 of them matmuls at 50 GB/s; the harness ran 15: 4 ms more matmul time
    x = at_harness_compute(stall_at, 50e9, 0.011, 0.003, 0.015)
    assert x == {"excess_compute_per_token_s": pytest.approx(0.004), "predicted_stall_per_token_s": 0.03}
    assert rates == [pytest.approx(50e9 * 3 / 7)]             # 3 ms of matmuls stretched to 7
    assert at_harness_compute(stall_at, 50e9, 0.011, 0.003, 0.0) is None     # the run carried no compute
    assert at_harness_compute(stall_at, 50e9, 0.011, 0.0, 0.015) is None     # no matmul to stretch
    assert at_harness_compute(stall_at, 50e9, 0.011, 0.003, 0.007) is None   # faster than the model's dense part
    assert len(rates) == 1


def test_the_harness_compute_is_summarized_per_layout_and_explains_a_gap_only_when_it_does():
    def cell(layout, ram, measured_compute, ratio):
        c = _cell(layout, 0.03, STEADY)
        c.update(ram_fraction=ram, prefetch="none", predicted_compute_per_token_s=0.011,
                 measured_compute_per_token_s={"mean": measured_compute, "repetitions": [measured_compute] * 4},
                 at_harness_compute={"ratio": ratio})
        return c

    cells = [cell("stock", 0.0, 0.015, 1.02), cell("louvain", 0.0, 0.013, 0.97), cell("stock", 0.25, 0.012, 1.0)]
    h = harness_compute(cells, [])
    assert h["excess_max"] == pytest.approx(4 / 11) and h["excess_min_s"] == pytest.approx(0.001)
    assert h["layout_spread_s"] == pytest.approx(0.002)       # stock against louvain at RAM 0, not across budgets
    assert (h["ratio_min"], h["ratio_max"], h["cells_within_band"], h["savings"]) == (0.97, 1.02, 3, 0)
    assert harness_compute([_cell("stock", 0.03, STEADY)], []) is None   # a record without compute (version 8)
    far = [{**c, "ratio": 1.3, "agreement": "disagrees"} for c in cells]   # the model 30% off the measured S
    text = summarize_validation(far, [])["text"]
    assert text.startswith("the model does NOT hold") and "the harness's compute: the measuring harness computed" in text
    assert "the gap is the harness's more than the model's" in text     # with the harness's compute, all within 10%
    off = [{**c, "at_harness_compute": {"ratio": 1.25}} for c in far]
    assert "the gap is the harness's" not in summarize_validation(off, [])["text"]
    zero = [{**c, "at_harness_compute": {"ratio": 0.0}} for c in far]    # no stall predicted: a miss, still counted
    assert harness_compute(zero, [])["cells"] == 3 and "the gap is the harness's" not in summarize_validation(zero, [])["text"]
    none = [{**c, "at_harness_compute": None} for c in far]              # no run could be replayed so
    assert harness_compute(none, [])["cells"] == 0
    assert "the harness's compute: the measuring harness computed" in summarize_validation(none, [])["text"]
    bad_pf = [{"layout": "stock", "ram_fraction": 0.0, "prefetch": "oracle", "sign_agrees": False, "agreement": "disagrees",
               "within_tolerance": False, "measured_saving": {"estimate_s": 1.0, "low_s": 0.9, "high_s": 1.1}}]
    assert "the gap is the harness's" not in summarize_validation(far, [], prefetch_comparisons=bad_pf)["text"]


def test_page_cache_waits_are_summarized_per_layout_with_the_savings_less_them():
    cells = []
    for layout, waits in (("stock", (0.0001, 0.0002)), ("louvain", (0.0004, 0.0006))):
        for ram, w in zip((0.0, 0.25), waits):
            c = _cell(layout, 0.03, STEADY)
            c.update(ram_fraction=ram, prefetch="none", measured_page_cache_wait_per_token_s={"mean": w, "repetitions": [w] * 4})
            cells.append(c)
    comparisons = [{**_comparison(True), "ram_fraction": ram,
                    "less_page_cache_waits": {"measured": {"estimate_s": 0.0009}, "predicted_inside_measured": inside,
                                              "agreement": agreement}}
                   for ram, inside, agreement in ((0.0, True, "agrees"), (0.25, False, "disagrees"))]
    comparisons.append({**_comparison(True), "layout": "random", "less_page_cache_waits": None})   # not judged so
    w = page_cache_waits(cells, comparisons)
    assert w["by_layout"] == {"stock": (0.0001, 0.0002), "louvain": (0.0004, 0.0006)}
    assert (w["savings"], w["savings_inside"], w["savings_ruled_out"]) == (2, 1, 1)
    assert page_cache_waits([_cell("stock", 0.03, STEADY)], []) is None      # a record without I/O counts (version 10)
    text = summarize_validation(cells, [])["text"]
    assert "waits for the page cache: the harness's compute thread waited 0.10-0.20 ms/token in stock, 0.40-0.60" in text
    assert "less these waits, the predicted layout saving lies inside the measured interval in 1 of 2, ruled out in 1" in \
        summarize_validation(cells, comparisons)["text"]
    nothing = [{**c, "measured_page_cache_wait_per_token_s": {"mean": 0.0, "repetitions": [0.0] * 4}} for c in cells]
    assert "waits for the page cache" not in summarize_validation(nothing, [])["text"]   # the default regime: none


def test_the_model_and_the_harness_are_compared_on_the_reads_that_reach_the_drive():
    cells = []
    for layout, predicted, measured in (("stock", 9.0, 8.5), ("louvain", 6.0, 4.0)):
        c = _cell(layout, 0.03, STEADY)
        c.update(ram_fraction=0.0, prefetch="none", predicted_drive_reads_per_token=predicted,
                 measured_drive_reads_per_token={"mean": measured, "repetitions": [measured] * 4})
        cells.append(c)
    r = drive_reads_check(cells)
    assert (r["cells"], r["within"], r["unmeasured"]) == (2, 1, 0)
    assert (r["ratio_min"], r["ratio_max"]) == (pytest.approx(9 / 8.5), pytest.approx(1.5))

    def said(cs):
        return summarize_validation(cs, [])["text"].split("drive reads: ")[1].split("\n")[0]

    assert said(cells).startswith("the model's demand preads that reach the drive are 1.06-1.50 times the harness's")
    assert "disagree about which of them reach the drive" in said(cells) and "page cache" not in said(cells)
    assert "disagree" not in said(cells[:1])
    above = [{**c, "measured_drive_reads_per_token": {"mean": 5.0, "repetitions": [5.0] * 4}} for c in cells]
    assert "held fewer scale pages than the kernel's" in said(above)          # the model reads more, in every cell
    below = [{**c, "measured_drive_reads_per_token": {"mean": 20.0, "repetitions": [20.0] * 4}} for c in cells]
    assert "still being read by an earlier readahead waits for the drive" in said(below)  # the harness reads more
    none = {**cells[1], "measured_drive_reads_per_token": {"mean": 0.0, "repetitions": [0.0] * 4}}
    assert drive_reads_check([cells[0], none])["unmeasured"] == 1
    assert "in 1 cell(s) the model read from the drive and the harness did not" in said([cells[0], none])
    assert drive_reads_check([_cell("stock", 0.03, STEADY)]) is None     # a record of version 11 or before


def test_a_normalized_saving_needs_a_positive_prediction_for_every_run():
    runs = ([0.03, 0.031], 0.03, [{"predicted_stall_per_token_s": 0.029}, {"predicted_stall_per_token_s": 0.03}])
    zero = ([0.02, 0.021], 0.02, [{"predicted_stall_per_token_s": 0.0}, {"predicted_stall_per_token_s": 0.02}])
    assert normalized_saving(runs, runs)["measured"]["repetitions"] == pytest.approx([0.0, 0.0])
    assert normalized_saving(runs, zero) is None and normalized_saving(runs, (*zero[:2], [None, None])) is None


def test_repetition_interval_is_students_t_over_repetitions():
    iv = repetition_interval([1.0, 2.0, 4.0])
    sd = ((1 - 7 / 3) ** 2 + (2 - 7 / 3) ** 2 + (4 - 7 / 3) ** 2) ** 0.5 / 2 ** 0.5
    assert iv.estimate == pytest.approx(7 / 3) and iv.n_units == 3
    assert iv.high - iv.estimate == pytest.approx(4.302653 * sd / 3 ** 0.5, rel=1e-6)   # t(0.975, 2)
    assert iv.estimate - iv.low == pytest.approx(iv.high - iv.estimate)
    assert repetition_interval([5.0]).low == repetition_interval([5.0]).high == 5.0


def test_a_cell_is_ruled_out_only_beyond_its_measured_interval_and_the_tolerance():
    assert cell_agreement(1.15, 1.0, 0.99, 1.01) == "agrees"                # within +/-20% of the mean
    assert cell_agreement(1.3, 1.0, 0.99, 1.01) == "disagrees"              # 1.3 > 1.01 x 1.2
    assert cell_agreement(1.3, 1.0, 0.5, 1.5) == "unresolved"               # the repetitions admit S = 1.5
    assert cell_agreement(0.7, 1.0, 0.9, 1.1) == "disagrees"                # 0.7 < 0.9 x 0.8
    assert cell_agreement(0.2, 1.0, -0.3, 2.3) == "unresolved"              # a low end below zero is zero
    assert cell_agreement(0.0, 0.0, 0.0, 0.0) == "unresolved"               # nothing measured, nothing predicted


def test_summary_sentences():
    s = summarize_validation([_cell("stock", 0.93, STEADY), _cell("louvain", 1.08, STEADY)], [_comparison(True)])
    assert s["verdict"] == "holds" and s["holds"] and s["text"].startswith("the model holds on this disk within 8%")
    head, *aspects = s["text"].splitlines()     # the verdict alone on the first line, then one labelled line per aspect
    assert head == "the model holds on this disk within 8% (predicted/measured S 0.93-1.08 over 2 cells)"
    assert [a.split(":")[0] for a in aspects] == ["  layout savings"]
    s = summarize_validation([_cell("stock", 0.5, STEADY), _cell("louvain", 0.7, STEADY)], [_comparison(None)])
    assert s["verdict"] == "does not hold" and not s["holds"] and s["cells_disagree"] == 2
    assert "does NOT hold" in s["text"] and "0.50-0.70" in s["text"] and "widened by +/-20%" in s["text"]
    s = summarize_validation([_cell("stock", 1.0, STEADY), _cell("louvain", 1.0, STEADY)],
                             [_comparison(False, inside=False, words="measurement CONTRADICTS the prediction: ...")])
    assert s["verdict"] == "does not hold" and "sign is wrong beyond the measured family interval and placement in 1 of 1 comparison(s)" in s["text"] and "CONTRADICTS" in s["text"]
    s = summarize_validation([_cell("stock", 1.0, STEADY), _cell("louvain", 1.0, STEADY)], [_comparison(True, inside=False)])
    assert s["verdict"] == "does not hold" and "lies beyond the measured family interval and placement in 1 of 1" in s["text"]
    # scattered repetitions: beyond the tolerance, but the measurement does not rule the prediction out
    s = summarize_validation([_cell("stock", 1.3, (0.7, 1.0, 1.3, 1.0)), _cell("louvain", 1.0, STEADY)], [_comparison(None)])
    assert s["verdict"] == "inconclusive" and not s["holds"] and s["cells_unresolved"] == 1
    assert s["text"].startswith("INCONCLUSIVE") and "1 of 2 cell(s) are beyond +/-20%" in s["text"] and "--reps" in s["text"]
    s = summarize_validation([_cell("stock", 1.0, STEADY), _cell("louvain", 1.0, STEADY)], [_comparison(None, same=False)])
    assert s["verdict"] == "inconclusive" and "the gate would decide differently in 1 of 1" in s["text"]
    drifting = [{**_cell("stock", 1.3, STEADY), "at_probed_speed": {"ratio": 1.04}},
                {**_cell("louvain", 1.25, STEADY), "at_probed_speed": {"ratio": 0.97}}]
    s = summarize_validation(drifting, [_comparison(True)], drift=0.31)
    assert not s["holds"] and s["drift"] == 0.31 and s["probed_within"] == pytest.approx(0.04)
    assert ("probed rate moved by 31%" in s["text"] and "0.97-1.04 (2 of 2 cells within +/-10%, against 0 of 2 on the "
            "profile as calibrated)" in s["text"])
    assert s["text"].splitlines()[0].endswith("The disk's own speed moved by 31% during the run, and at its probed speed "
                                              "every cell's S is within 4% of measurement: the gap on the profile is the "
                                              "disk's speed more than the model")
    drifting[0]["at_probed_speed"]["ratio"] = 1.15               # one cell off at the probed speed too: not said
    assert "own speed" not in summarize_validation(drifting, [_comparison(True)], drift=0.31)["text"]


def test_a_container_whose_first_read_was_slow_is_named():
    cells = [_cell("stock", 1.0, STEADY), _cell("louvain", 1.0, STEADY)]
    slow = {"stock": {"rate_Bps": 0.6e9}, "louvain": {"rate_Bps": 1.0e9}, "random": {"rate_Bps": 0.9e9}}
    s = summarize_validation(cells, [_comparison(True)], first_read=slow)
    assert s["first_read_slow"] == ["stock"] and "the stock container ran at 60% of the fastest" in s["text"]
    s = summarize_validation(cells, [_comparison(True)], first_read={**slow, "stock": {"rate_Bps": 0.8e9}})
    assert s["first_read_slow"] == [] and "first time" not in s["text"]


def test_read_once_reads_every_byte_of_every_file(tmp_path):
    from replay.physical.calibrate import READ_ONCE_BYTES, read_once

    sizes = [0, 1, 4097, 2 * READ_ONCE_BYTES + 123]
    paths = []
    for i, n in enumerate(sizes):
        paths.append(tmp_path / f"f{i}")
        paths[-1].write_bytes(np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8).tobytes())
    seen = []
    n, seconds = read_once(paths, seen.append)
    assert n == sum(sizes) == sum(seen) and seconds > 0
    assert len(seen) == 1 + 1 + 3                       # one call per chunk read: 1, 4097 and three chunks


def test_prefetch_saving_agrees_inside_the_measured_interval_or_within_the_tolerance():
    from relayout.workflows.validation.rules import PREFETCH_TOLERANCE, judge_saving

    def measured(reps_ms):
        iv = repetition_interval(np.asarray(reps_ms) / 1e3)
        return {"estimate_s": iv.estimate, "low_s": iv.low, "high_s": iv.high}

    cost = measured([-20.0, -22.0, -18.0])                           # prefetch costs 20 ms/token, steadily
    x = judge_saving(-0.005, cost, PREFETCH_TOLERANCE)                     # predicted -5 vs measured -20 [-25, -15]
    assert x["measured_excludes_zero"] and x["sign_agrees"] and not x["predicted_inside_measured"]
    assert not x["within_tolerance"] and x["agreement"] == "disagrees"
    x = judge_saving(-0.019, cost, PREFETCH_TOLERANCE)
    assert x["predicted_inside_measured"] and x["agreement"] == "agrees"
    x = judge_saving(-0.0145, measured([-20.0, -20.1, -19.9]), PREFETCH_TOLERANCE)   # 27.5% off, outside a tight interval
    assert not x["predicted_inside_measured"] and x["within_tolerance"] and x["agreement"] == "agrees"
    x = judge_saving(+0.010, cost, PREFETCH_TOLERANCE)                     # predicted a gain, measured a clear cost
    assert x["sign_agrees"] is False and x["agreement"] == "disagrees" and "CONTRADICTS" in x["words"]
    assert "within_tolerance" not in judge_saving(-0.019, cost)            # layouts: no tolerance, the interval alone


def test_a_scaled_profile_is_the_same_drives_at_another_speed():
    import numpy as np

    from replay.model.device import load_device, queue_throughput

    d = load_device("single-nvme")
    f = d.scaled(2.5)
    assert f.drive.queue_slots == d.drive.queue_slots and f.drive.max_request_bytes == d.drive.max_request_bytes
    assert f.full_bandwidth == pytest.approx(2.5 * d.full_bandwidth)
    size, depth = np.array([4096, 1 << 20, 19_000_000]), np.array([1, 8, 32])
    x = queue_throughput(d.drive.request_seconds, d.drive.request_bandwidth, d.drive.bandwidth, d.drive.queue_slots,
                         size[:, None], depth[None, :], d.drive.max_request)
    y = queue_throughput(f.drive.request_seconds, f.drive.request_bandwidth, f.drive.bandwidth, f.drive.queue_slots,
                         size[:, None], depth[None, :], f.drive.max_request)
    assert np.allclose(y, 2.5 * x, rtol=1e-12)
    with pytest.raises(Exception, match="positive and finite"):
        d.scaled(0.0)
    four = 4 << 20                                       # one drive: the queue model's steady rate
    assert d.steady_rate(four, 8) == pytest.approx(min(float(queue_throughput(
        d.drive.request_seconds, d.drive.request_bandwidth, d.drive.bandwidth, d.drive.queue_slots, four, 8,
        d.drive.max_request)), d.host_bandwidth))
    assert f.steady_rate(four, 8) == pytest.approx(2.5 * d.steady_rate(four, 8))


def test_runs_are_measured_in_a_counterbalanced_rotating_order():
    """A fixed order (stock always first, no prefetch before a source) turns a disk's drift within
    a round into a fake saving: over each pair of repetitions every run's mean place is the same."""
    from relayout.workflows.validation.run import measurement_order

    runs = [(m, pf) for m in ("stock", "louvain", "random") for pf in ("none", "oracle", "coupled")]
    for block in range(3):
        orders = [measurement_order(runs, rep, block) for rep in range(4)]
        assert all(sorted(o) == sorted(runs) for o in orders)
        for first, second in (orders[0:2], orders[2:4]):
            assert all(first.index(r) + second.index(r) == len(runs) - 1 for r in runs)   # a steady drift cancels
        assert orders[2] != orders[0]                                                    # pairs rotate
    assert measurement_order(runs, 0, 1) != measurement_order(runs, 0, 0)               # blocks rotate too


def test_a_budget_is_measured_in_pairs_of_repetitions(tmp_path):
    """The run order is counterbalanced over pairs of repetitions, so --minutes picks an even
    number of them (unless --reps says otherwise), whatever the budget and the trace's length."""
    from relayout.workflows.validation.options import ValidateOptions, choose_size

    for tokens in (None, 8):
        o = ValidateOptions(tmp_path, tmp_path / "v.json", minutes=5, tokens=tokens)
        for available in (10, 40, 400):
            for budget in (30.0, 90.0, 300.0, 900.0, 5000.0):
                t, reps, _ = choose_size(o, available, 18, 1.0, 10, budget)
                assert reps % 2 == 0 and reps >= 2 and t >= 1
    o = ValidateOptions(tmp_path, tmp_path / "v.json", minutes=5, reps=3)
    assert choose_size(o, 400, 18, 1.0, 10, 900.0)[1] == 3
    o = ValidateOptions(tmp_path, tmp_path / "v.json", minutes=5)
    t, reps, why = choose_size(o, 400, 18, 1.0, 10, 400.0)      # 4 repetitions of 4 steps fit: a verdict's 4 first
    assert reps == 4 and t >= 4 and "insufficient" not in why
    t, reps, why = choose_size(o, 400, 18, 1.0, 10, 30.0)       # not even that: 2, and it says what that means
    assert reps == 2 and "fewer repetitions than the 4 a verdict needs" in why


def test_at_run_speed_finds_the_speed_a_run_was_measured_at():
    """A run "measured" on the same drive at 0.6 times its speed: the fixed point recovers the
    factor from the two rates alone, and predicts the run as the slowed drive does."""
    from relayout.workflows.validation.diagnoses import at_run_speed
    from replay.model.config import RuntimeConfig
    from replay.model.device import load_device
    from replay.model.engine import simulate
    from replay.model.metrics import drive_rate, step_table, summarize
    from relayout.planning.plan import source_from_geometry
    from relayout.traces.synth import synth_trace

    g = small_geometry()
    tr = synth_trace(g.moe_layers, g.n_routed_experts, 8, 30, 1, seed=4, geometry=g.name)
    stock = source_from_geometry(g).stock
    mask = np.ones(tr.n_forwards, bool)
    device = load_device("single-nvme")

    def stall_and_rate(dev):
        inst, usage = simulate(tr, mask, stock, dev, RuntimeConfig())
        return summarize(step_table(tr, mask, inst), usage, 0.0).stall_per_token_s, drive_rate(usage, dev)

    slow_stall, slow_rate = stall_and_rate(device.scaled(0.6))
    fast_stall, fast_rate = stall_and_rate(device)
    assert slow_stall > 1.3 * fast_stall and slow_rate < 0.7 * fast_rate
    x = at_run_speed(stall_and_rate, device, slow_rate)
    assert x["scale"] == pytest.approx(0.6, rel=1e-3)
    assert x["predicted_stall_per_token_s"] == pytest.approx(slow_stall, rel=1e-3)
    assert x["modelled_rate_Bps"] == pytest.approx(slow_rate, rel=1e-3)
    assert at_run_speed(stall_and_rate, device, None) is None


def test_speed_normalized_savings_remove_the_disks_speed_not_the_models_error():
    """Two layouts whose runs measured exactly what the model predicts at each run's speed give
    the predicted saving whatever the disk did between them; a model 10% wrong on one layout
    only shows that 10% of its S."""
    pred_base, pred_new = 0.300, 0.250                  # s/token on the profile
    speeds = [(0.5, 1.4), (1.2, 0.7), (1.0, 1.0)]        # each repetition: the base run's and the new run's disk speed
    base_at = [pred_base / f for f, _ in speeds]         # S predicted at each run's speed (a drive-bound S scales as 1/f)
    new_at = [pred_new / g for _, g in speeds]
    exact = speed_normalized_savings(base_at, pred_base, base_at, new_at, pred_new, new_at)
    assert exact == pytest.approx([0.05] * 3)
    off = speed_normalized_savings(base_at, pred_base, base_at, [1.1 * x for x in new_at], pred_new, new_at)
    assert off == pytest.approx([0.05 - 0.1 * pred_new] * 3)
    naive = [b - n for b, n in zip(base_at, new_at)]     # the plain paired saving sees the disk
    assert max(naive) - min(naive) > 0.3


def test_neighbour_scales_come_from_the_runs_interleaved_with_each_run_never_itself():
    from relayout.workflows.validation.diagnoses import neighbour_scales

    groups = ["a", "a", "a", "b", "b", "c"]
    assert neighbour_scales([1.0, 2.0, 4.0, None, 8.0, 5.0], groups) == [3.0, 2.5, 1.5, 8.0, None, None]
    assert neighbour_scales([3.0], ["a"]) == [None]
    assert neighbour_scales([], []) == []


def test_calibration_reads_the_stock_containers_largest_file_when_it_can(tmp_path):
    """validate calibrates on data its runs read (the stock container's largest file, only read)
    when that file is large enough; else it writes a test file in PATH."""
    from relayout.workflows.validation.prepare import calibration_target
    from replay.physical.calibrate import MIN_FILE_BYTES

    c = tmp_path / "stock"
    c.mkdir()
    (c / "a.safetensors").write_bytes(b"x" * 100)
    assert calibration_target(c, tmp_path) == tmp_path               # too small: a test file in PATH
    with open(c / "b.safetensors", "wb") as f:                       # sparse, the size is what counts
        f.truncate(MIN_FILE_BYTES)
    assert calibration_target(c, tmp_path) == c / "b.safetensors"


def test_the_summary_counts_the_prefetch_savings_measured_precisely_enough_to_judge():
    from relayout.workflows.validation.rules import PREFETCH_TOLERANCE, judge_saving, resolves_tolerance

    def prefetch(predicted_ms, reps_ms):
        iv = repetition_interval(np.asarray(reps_ms) / 1e3)
        m = {"estimate_s": iv.estimate, "low_s": iv.low, "high_s": iv.high}
        return {"measured_saving": m, **judge_saving(predicted_ms / 1e3, m, PREFETCH_TOLERANCE)}

    tight = prefetch(-9.0, [-10.0, -10.2, -9.8])          # -10 +/- 0.5: resolves +/-30%, prediction 10% off
    tight_off = prefetch(-6.0, [-10.0, -10.2, -9.8])      # resolves it, prediction 40% off (and outside)
    loose = prefetch(1.2, [1.0, 3.0, 1.6])                # +1.9 +/- 2.5: cannot resolve +/-30%
    assert resolves_tolerance(tight["measured_saving"], PREFETCH_TOLERANCE)
    assert not resolves_tolerance(loose["measured_saving"], PREFETCH_TOLERANCE)
    assert loose["agreement"] == "agrees" and not loose["within_tolerance"]      # inside its wide interval
    s = summarize_validation([_cell("stock", 1.0, STEADY)], [_comparison(True)],
                             prefetch_comparisons=[tight, tight_off, loose])
    assert s["prefetch_within_tolerance"] == 1 and s["prefetch_resolved"] == 2
    assert s["prefetch_resolved_within_tolerance"] == 1
    assert "resolves +/-30%" in s["text"] and "in 2 of 3, and there the prediction is within it in 1" in s["text"]


def test_a_drive_that_shares_itself_among_concurrent_reads_is_said_in_the_summary():
    cells = [_cell("stock", 1.0, STEADY), _cell("louvain", 1.0, STEADY)]
    shared = ("8 concurrent 16 MiB reads: the first completed after 0.99 of the time the last took ...", True)
    s = summarize_validation(cells, [_comparison(True)], sharing=shared)
    assert s["drive_shares_concurrent_reads"] is True
    assert s["text"].splitlines()[-1] == "  the drive: the calibration found that " + shared[0]
    s = summarize_validation(cells, [_comparison(True)], sharing=("... in order, as the model assumes", False))
    assert s["drive_shares_concurrent_reads"] is False and "calibration found" not in s["text"]
    assert summarize_validation(cells, [_comparison(True)])["drive_shares_concurrent_reads"] is None   # --device


def test_layout_savings_within_the_placement_control_are_counted():
    from relayout.workflows.validation.rules import placement_difference

    cells = [_cell("stock", 1.0, STEADY), _cell("louvain", 1.0, STEADY)]
    block = placement_difference(0.0, [0.100, 0.102, 0.101], [0.090, 0.093, 0.091])   # the copy: 10 ms/token faster
    assert block["difference"]["estimate_s"] == pytest.approx(0.029 / 3)

    def saving(ms):
        return {**_comparison(True), "measured_saving": {"estimate_s": ms / 1e3, "low_s": ms / 1e3, "high_s": ms / 1e3}}

    s = summarize_validation(cells, [saving(4.0), saving(25.0)], placement=[block])
    bound = max(abs(block["difference"]["low_s"]), abs(block["difference"]["high_s"]))
    assert s["placement_bound_s"] == pytest.approx(bound) and bound > 0.029 / 3
    assert s["savings_no_larger_than_placement"] == 1                   # 4 ms/token is within it, 25 is not
    assert "not separable from where the disk put the files, and 1 of 2 are" in s["text"]
    assert summarize_validation(cells, [saving(4.0)])["savings_no_larger_than_placement"] is None


def _measured(reps_ms, judgements=1):
    from relayout.workflows.validation.rules import over_repetitions

    return over_repetitions([x / 1e3 for x in reps_ms], judgements)


def test_a_layout_saving_is_ruled_out_only_beyond_the_family_interval_and_placement():
    from relayout.workflows.validation.rules import judge_saving

    m = _measured([-2.0, -2.4, -2.2, -2.6], judgements=42)           # -2.3 [-2.71, -1.89] ms/token; 99.88%: [-3.87, -0.73]
    assert m["family"]["level"] == pytest.approx(1 - 0.05 / 42)
    assert m["family"]["low_s"] < m["low_s"] and m["family"]["high_s"] > m["high_s"]
    assert judge_saving(-0.0022, m, placement_s=0.001)["agreement"] == "agrees"                 # inside the 95% interval
    x = judge_saving(-0.001, m, placement_s=0.003)                         # outside 95%, inside the family one: chance
    assert x["agreement"] == "unresolved" and "42 judgements" in x["words"]
    x = judge_saving(0.0, m, placement_s=0.003)                            # beyond the family one, but placement moves S 3 ms
    assert x["agreement"] == "within placement" and "placement control" in x["words"] and x["sign_agrees"] is False
    assert "CONTRADICTS" not in x["words"] and x["placement_bound_s"] == 0.003
    x = judge_saving(+0.001, m, placement_s=0.0001)                        # beyond both: the measurement rules it out
    assert x["agreement"] == "disagrees" and "CONTRADICTS" in x["words"]
    assert judge_saving(0.0, m)["agreement"] == "disagrees"                # no control: the family interval alone
    assert judge_saving(-0.001, _measured([-2.0, -2.4, -2.2, -2.6]))["agreement"] == "disagrees"   # one judgement: 95%


def test_a_prediction_farther_from_the_measurement_never_stands_better():
    from relayout.workflows.validation.rules import PREFETCH_TOLERANCE, judge_saving

    rank = {"agrees": 0, "unresolved": 1, "within placement": 2, "disagrees": 3}
    for reps, k, tolerance, bound in [([1.0, 1.2, 1.1, 1.3], 42, None, 0.0001), ([1.0, 1.2, 1.1, 1.3], 42, None, 0.001),
                                      ([-5.0, -5.5, -6.0, -6.5], 42, PREFETCH_TOLERANCE, None),
                                      ([3.0, 3.0, 3.0, 3.0], 24, None, 0.0005)]:          # zero-width interval
        m = _measured(reps, judgements=k)
        centre = m["estimate_s"]
        for direction in (-1, 1):
            states = [rank[judge_saving(centre + direction * d * 1e-5, m, tolerance, bound)["agreement"]] for d in range(3000)]
            assert states == sorted(states), (reps, tolerance, bound, direction)
            assert states[0] == 0 and states[-1] == 3


def test_a_prefetch_saving_is_ruled_out_only_beyond_its_family_interval_widened_by_the_tolerance():
    from relayout.workflows.validation.rules import PREFETCH_TOLERANCE, judge_saving

    m = _measured([-5.5, -5.8, -6.3, -6.6], judgements=42)           # -6.05 ms/token, 99.88% interval to about -3.9
    high = m["family"]["high_s"]
    assert high < 0
    x = judge_saving(high * (1 - PREFETCH_TOLERANCE) - 1e-6, m, PREFETCH_TOLERANCE)   # within 30% of the interval's end
    assert x["agreement"] == "unresolved" and not x["within_tolerance"] and "tolerance" in x["words"]
    assert judge_saving(high * (1 - PREFETCH_TOLERANCE) + 1e-6, m, PREFETCH_TOLERANCE)["agreement"] == "disagrees"
    assert judge_saving(high + 1e-6, m)["agreement"] == "disagrees"       # a layout saving: no tolerance


def test_the_verdict_allows_as_many_misses_of_95_percent_intervals_as_chance_gives():
    from replay.evaluation.stats import chance_misses

    cells = [_cell("stock", 1.0, STEADY), _cell("louvain", 1.0, STEADY)]

    def saving(agreement, sign=True):
        return {**_comparison(sign, inside=agreement == "agrees"), "agreement": agreement}

    def prefetch(agreement):
        return {**saving(agreement), "within_tolerance": agreement == "agrees", "measured_saving":
                {"estimate_s": -0.004, "low_s": -0.005, "high_s": -0.003}}

    k = 24
    allowed = chance_misses(k)
    assert allowed == 3
    s = summarize_validation(cells, [saving("unresolved")] * 2 + [saving("agrees")] * 10,
                             prefetch_comparisons=[prefetch("unresolved")] + [prefetch("agrees")] * 11)
    assert s["verdict"] == "holds" and s["unresolved_savings"] == 3 and s["chance_allows"] == 3
    assert "  chance: 3 of 24 saving(s) lie outside their measured 95% interval without being ruled out" in s["text"]
    s = summarize_validation(cells, [saving("unresolved")] * 2 + [saving("within placement")] + [saving("agrees")] * 9,
                             prefetch_comparisons=[prefetch("unresolved")] + [prefetch("agrees")] * 11)
    assert s["verdict"] == "inconclusive" and s["judged_within_placement"] == 1
    assert "4 of 24 saving(s) lie outside their measured 95% interval, more than the 3" in s["text"]
    assert "1 of them beyond their family interval by no more than placement" in s["text"]
    assert "More repetitions do not separate a layout saving from placement" in s["text"]   # it holds but for that one
    assert "--reps" not in s["text"]
    s = summarize_validation(cells, [saving("unresolved")] * 4 + [saving("agrees")] * 20)
    assert "--reps" in s["text"] and "placement" not in s["text"].splitlines()[0]
    s = summarize_validation(cells, [saving("unresolved", sign=False)] + [saving("agrees")] * 23)   # wrong sign, by chance
    assert s["verdict"] == "holds" and s["sign_wrong"] == 1 and s["sign_wrong_ruled_out"] == 0
    assert "the sign is wrong in 1 of 24 where the measured 95% interval excludes zero (0 of them ruled out)" in s["text"]
    s = summarize_validation(cells, [saving("disagrees")] + [saving("agrees")] * (k - 1))
    assert s["verdict"] == "does not hold"
    s = summarize_validation(cells, [saving("agrees")] * 12, prefetch_comparisons=[prefetch("disagrees")] * 2)
    assert s["verdict"] == "does not hold" and "beyond the measured family interval widened by +/-30% in 2 of 2" in s["text"]


def test_chance_misses_is_the_binomial_95th_percentile_and_family_level_is_bonferroni():
    from scipy.stats import binom

    from replay.evaluation.stats import chance_misses, family_level

    for k in (1, 2, 12, 24, 42, 100):
        b = chance_misses(k)
        assert binom.sf(b, k, 0.05) <= 0.05 and (b == 0 or binom.sf(b - 1, k, 0.05) > 0.05)
    assert [chance_misses(k) for k in (1, 12, 24)] == [0, 2, 3]
    assert family_level(1) == pytest.approx(0.95) and family_level(42) == pytest.approx(1 - 0.05 / 42)
    with pytest.raises(ValueError):
        family_level(0)


def test_a_gate_decision_measured_on_a_saving_within_placement_is_not_held_against_the_model():
    cells = [_cell("stock", 1.0, STEADY), _cell("louvain", 1.0, STEADY)]
    placed = {**_comparison(True, same=False, inside=False), "agreement": "within placement"}
    s = summarize_validation(cells, [placed])
    assert s["gate_disagreements"] == 0 and s["gate_disagreements_within_placement"] == 1
    assert "decides differently in 0 of 1 and in 1 more whose prediction is off by no more than placement" in s["text"]
    s = summarize_validation(cells, [_comparison(True, same=False)])
    assert s["gate_disagreements"] == 1 and s["verdict"] == "inconclusive"


def test_fewer_repetitions_than_a_verdict_needs_give_insufficient_unless_a_measurement_rules_the_model_out():
    from relayout.workflows.validation.rules import VERDICT_REPS

    two = [_cell("stock", 1.0, (0.99, 1.01)), _cell("louvain", 1.0, (0.99, 1.01))]
    s = summarize_validation(two, [_comparison(True)])
    assert s["verdict"] == "insufficient" and not s["holds"] and VERDICT_REPS == 4
    assert s["text"].startswith("INSUFFICIENT on this disk: 2 repetition(s) per cell, where a verdict needs 4 (over 2, a "
                                "95% interval reaches 12.7 standard errors")
    assert summarize_validation(two, [_comparison(True, inside=False)])["verdict"] == "does not hold"
    four = [_cell("stock", 1.0, STEADY), _cell("louvain", 1.0, STEADY)]
    assert summarize_validation(four, [_comparison(True)])["verdict"] == "holds"


def _record(stock_reps, louvain_reps, predicted=(1.0e-3, 0.8e-3), saving=None):
    """A present-form validation record of two cells (stock, louvain at RAM 0) and their saving, unjudged (s/token)."""
    cells = [{"layout": m, "ram_fraction": 0.0, "prefetch": "none", "predicted_stall_per_token_s": p,
              "predicted_tpot_s": p + 0.01, "ratio": p / (sum(r) / len(r)),
              "measured_stall_per_token_s": {"mean": sum(r) / len(r), "repetitions": list(r)},
              "at_probed_speed": None, "at_run_speed": None, "at_neighbour_speed": None, "at_harness_compute": None}
             for m, p, r in (("stock", predicted[0], stock_reps), ("louvain", predicted[1], louvain_reps))]
    each = [a - b for a, b in zip(stock_reps, louvain_reps)]
    iv = repetition_interval(each)
    comparison = {"layout": "louvain", "baseline": "stock", "ram_fraction": 0.0, "prefetch": "none",
                  "predicted_saving": {"estimate_s": predicted[0] - predicted[1] if saving is None else saving},
                  "measured_saving": {"estimate_s": iv.estimate, "low_s": iv.low, "high_s": iv.high, "repetitions": each},
                  "at_run_speed": None, "at_harness_compute": None, "less_page_cache_waits": None,
                  "gate": {"same_decision": True}}
    return {"format": VALIDATION_FORMAT, "version": VALIDATION_VERSION, "tool_version": "test", "path": "/disk",
            "device": {}, "container": {}, "trace": {}, "layouts": {}, "config": {}, "drift": None, "first_read": {},
            "cells": cells, "comparisons": [comparison], "prefetch_comparisons": [],
            "placement_control": {"prefetch": "none", "blocks": []}, "calibration_sharing": None,
            "calibration_merge": None}


def test_a_synthetic_record_is_judged_close_contradicted_or_insufficient_by_the_rules():
    stock, louvain = (1.00e-3, 1.02e-3, 0.98e-3, 1.01e-3), (0.80e-3, 0.81e-3, 0.79e-3, 0.80e-3)
    r = _record(stock, louvain)
    v = judge_record(r)                                    # predictions on the measured means: close, holds
    assert [c["agreement"] for c in v["cells"]] == ["agrees", "agrees"]
    assert v["comparisons"][0]["agreement"] == "agrees" and v["summary"]["verdict"] == "holds"
    assert v["summary"]["text"].startswith("the model holds on this disk within 1% (predicted/measured S 1.00-1.00")
    assert "summary" not in r and "agreement" not in r["cells"][0]        # the input is left as it was
    assert list(v)[-4:] == ["summary", "work_dir", "plots", "elapsed_seconds"]   # the written order
    far = judge_record(_record(stock, louvain, predicted=(1.5e-3, 0.8e-3)))     # stock 49% over a tight measurement
    assert far["cells"][0]["agreement"] == "disagrees" and far["summary"]["verdict"] == "does not hold"
    wrong = judge_record(_record(stock, louvain, saving=-0.2e-3))             # a cost predicted, a clear saving measured
    x = wrong["comparisons"][0]
    assert x["agreement"] == "disagrees" and x["sign_agrees"] is False and "CONTRADICTS" in x["words"]
    assert wrong["summary"]["contradictions"] == 1 and wrong["summary"]["verdict"] == "does not hold"
    two = judge_record(_record(stock[:2], louvain[:2]))                       # two repetitions: no verdict
    assert two["summary"]["verdict"] == "insufficient" and two["summary"]["text"].startswith("INSUFFICIENT")
    with pytest.raises(InputError, match="lacks 'cells'"):
        judge_record({k: x for k, x in r.items() if k != "cells"})
