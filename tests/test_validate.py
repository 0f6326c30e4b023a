"""``relayout validate``: structure of the record, what it leaves behind, its errors.

Measured S depends on the disk, so nothing here asserts a timing: only that every cell was
predicted and measured, that each comparison carries both intervals and the agreement fields,
that the source is untouched and the work directory goes (or stays with --keep).
"""

import json

import pytest
from conftest import run_cli, small_geometry, source_with_manifest, tree_state

from relayout.validate import (
    VALIDATION_FORMAT,
    VALIDATION_VERSION,
    WORK_MARKER,
    WORK_NAME,
    summarize_validation,
)


@pytest.fixture(scope="module")
def disk(tmp_path_factory):
    """A directory standing for the disk under test, holding a small container with its manifest."""
    root = tmp_path_factory.mktemp("disk")
    source_with_manifest(root / "src", small_geometry(), seed=7)
    return root


def _validate(disk, out, *extra):
    return run_cli("validate", disk, "--container", disk / "src", "--device", "single-nvme", "--reps", 2, "--tokens", 8,
                   "--ram", "0", "--prefetch", "none", "--layouts", "stock,louvain", "-o", out, *extra)


def _check_record(v: dict) -> None:
    assert v["format"] == VALIDATION_FORMAT and v["version"] == VALIDATION_VERSION
    assert v["device"]["name"] == "single-nvme" and v["device"]["profile"]["drive"]
    assert v["container"]["fingerprint"] and v["trace"]["fingerprint"] and len(v["trace"]["held_out_sessions"]) >= 5
    assert v["config"]["reps"] == 2 and v["config"]["tokens"] == 8 and v["trace"]["steps"] == 8
    assert {(c["layout"], c["ram_fraction"], c["prefetch"]) for c in v["cells"]} == {("stock", 0.0, "none"), ("louvain", 0.0, "none")}
    for c in v["cells"]:
        assert c["predicted_stall_per_token_s"] > 0
        m = c["measured_stall_per_token_s"]
        assert m["mean"] > 0 and len(m["repetitions"]) == 2 and all(x >= 0 for x in m["repetitions"])
        assert c["ratio"] == pytest.approx(c["predicted_stall_per_token_s"] / m["mean"])
    d = v["drift"]                                       # probed before the first repetition and after each
    assert len(d["rates_Bps"]) == 3 and all(r > 0 for r in d["rates_Bps"]) and len(d["scales"]) == 2
    assert d["probe"]["depth"] == v["config"]["workers"] and d["probe"]["size_bytes"] % 4096 == 0   # the runs' reads
    assert d["scales"][1] == pytest.approx((d["rates_Bps"][1] + d["rates_Bps"][2]) / 2 / d["profile_rate_Bps"])
    assert d["change"] == pytest.approx(max(d["rates_Bps"]) / min(d["rates_Bps"]) - 1)
    for c in v["cells"]:
        p = c["at_probed_speed"]
        assert len(p["predicted_stall_per_token_s"]) == 2 and all(x > 0 for x in p["predicted_stall_per_token_s"])
        assert p["ratio"] == pytest.approx(sum(p["predicted_stall_per_token_s"]) / 2 / c["measured_stall_per_token_s"]["mean"])
    assert len(v["comparisons"]) == 1
    x = v["comparisons"][0]
    assert x["layout"] == "louvain" and x["baseline"] == "stock"
    for side in ("predicted_saving", "measured_saving"):
        s = x[side]
        assert s["low_s"] <= s["high_s"] and s["method"] == "moving-block" and s["block_steps"] >= 1
    assert x["measured_saving"]["units"] == 2 * x["predicted_saving"]["units"]   # both repetitions, paired by step
    assert isinstance(x["predicted_inside_measured"], bool) and isinstance(x["measured_excludes_zero"], bool)
    assert x["sign_agrees"] in (True, False, None) and (x["sign_agrees"] is None) == (not x["measured_excludes_zero"])
    g = x["gate"]
    assert g["threshold"] == 0.05 and g["same_decision"] == (g["predicted"]["passes"] == g["measured"]["passes"])
    assert g["predicted"]["tpot_s"] > 0 and g["measured"]["tpot_s"] > 0
    assert x["words"]
    s = v["summary"]
    assert isinstance(s["holds"], bool) and s["comparisons"] == 1
    assert s["text"].startswith("the model holds on this disk within" if s["holds"] else "the model does NOT hold")


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
    assert not list(tmp_path.glob("*.device.json"))   # --device given: nothing calibrated


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
        assert (work / "layout-louvain").is_dir() and len(list((work / "runs").glob("*.jsonl"))) == 4
        png = tmp_path / "plots" / "validation_predicted_vs_measured.png"
        assert v["plots"] == [str(png)] and png.read_bytes()[:4] == b"\x89PNG"
        assert tree_state(disk / "src") == before
        r = _validate(disk, out)                       # a kept work directory is ours: reused, then removed
        assert r.returncode == 0, r.stderr
        assert not work.exists()
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
    r = run_cli("validate", disk, "--container", disk / "src", "--device", "single-nvme", "-o", tmp_path / "v.json", *bad)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("relayout: error: ") and r.stderr.count("\n") == 1 and says in r.stderr
    assert not (disk / WORK_NAME).exists() and not (tmp_path / "v.json").exists()


def test_validate_bad_paths_are_one_line(disk, tmp_path):
    r = run_cli("validate", tmp_path / "missing", "--device", "single-nvme")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "not a directory" in r.stderr
    r = run_cli("validate", disk, "--device", "no-such-profile", "--container", disk / "src", "-o", tmp_path / "v.json")
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert not (disk / WORK_NAME).exists()


def _cell(layout, ratio):
    return {"layout": layout, "ratio": ratio}


def _comparison(sign, same=True, words="measurement agrees with the prediction"):
    return {"layout": "louvain", "ram_fraction": 0.0, "prefetch": "none", "sign_agrees": sign,
            "predicted_inside_measured": sign is not False, "gate": {"same_decision": same}, "words": words}


def test_summary_sentences():
    s = summarize_validation([_cell("stock", 0.93), _cell("louvain", 1.08)], [_comparison(True)])
    assert s["holds"] and s["text"].startswith("the model holds on this disk within 8%")
    s = summarize_validation([_cell("stock", 0.5), _cell("louvain", 0.7)], [_comparison(None)])
    assert not s["holds"] and "does NOT hold" in s["text"] and "0.50-0.70" in s["text"]
    s = summarize_validation([_cell("stock", 1.0), _cell("louvain", 1.0)],
                             [_comparison(False, words="measurement CONTRADICTS the prediction: ...")])
    assert not s["holds"] and "saving sign wrong in 1 of 1" in s["text"] and "CONTRADICTS" in s["text"]
    s = summarize_validation([_cell("stock", 1.0), _cell("louvain", 1.0)], [_comparison(None, same=False)])
    assert not s["holds"] and "the gate would decide differently in 1 of 1" in s["text"]
    drifting = [{**_cell("stock", 1.3), "at_probed_speed": {"ratio": 1.04}},
                {**_cell("louvain", 1.25), "at_probed_speed": {"ratio": 0.97}}]
    s = summarize_validation(drifting, [_comparison(True)], drift=0.31)
    assert not s["holds"] and s["drift"] == 0.31 and s["probed_within"] == pytest.approx(0.04)
    assert ("probed rate moved by 31%" in s["text"] and "0.97-1.04 (2 of 2 cells within +/-10%, against 0 of 2 on the "
            "profile as calibrated)" in s["text"])


def test_a_scaled_profile_is_the_same_drives_at_another_speed():
    import numpy as np

    from replay.device import load_device, queue_throughput

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


def test_layouts_are_measured_in_a_balanced_rotating_order():
    """A fixed order (stock always first) turns a disk's drift within a round into a fake saving."""
    from collections import Counter

    from relayout.validate import measurement_order

    methods = ["stock", "louvain", "random"]
    for cell in range(4):
        orders = [measurement_order(methods, rep, cell) for rep in range(3)]
        assert all(sorted(o) == sorted(methods) for o in orders)
        for pos in range(3):                                     # every layout once in every position
            assert Counter(o[pos] for o in orders) == Counter(methods)
    assert measurement_order(methods, 0, 1) != measurement_order(methods, 0, 0)   # cells rotate too
