"""The `relayout validate` runs kept in ``benchmarks/records`` (docs/BENCHMARKS.md) judged again.

A record holds the measurements and predictions of one run on a real disk; the verdict is a pure
function of them (:func:`relayout.validate.judge_record`). Judging the kept records again must give
the verdicts and counts that docs/BENCHMARKS.md quotes: a change to the rules that moves one of
them is a change to the published evidence and has to be made (and written down) on purpose.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from replay.model.device import load_device
from relayout.validate import judge_record

RECORDS = Path(__file__).resolve().parent.parent / "benchmarks" / "records"
VALIDATIONS = sorted(RECORDS.glob("*.validation.json"))
PROFILES = sorted(RECORDS.glob("*.device.json"))

# What docs/BENCHMARKS.md quotes for each run ("One fitted profile across days").
QUOTED = {
    "v26-2026-12-03": dict(verdict="holds", inside_measured=12, unresolved_savings=1, gate_disagreements=0,
                           ratio=(0.93, 0.96)),
    "v27-2026-12-03": dict(verdict="holds", inside_measured=11, unresolved_savings=1, gate_disagreements=0,
                           ratio=(0.95, 1.00)),
    "v28-2026-12-03": dict(verdict="holds", inside_measured=10, unresolved_savings=3, gate_disagreements=0,
                           ratio=(1.02, 1.08)),
}
# "Where expert order matters": 2.4 MB experts, coalescing; v32 and v33 with the harness's compute.
QUOTED.update({
    "v29-2026-12-03": dict(verdict="does not hold", inside_measured=0, ratio=(1.01, 1.13)),
    "v30-2026-12-03": dict(verdict="inconclusive", inside_measured=0, ratio=(0.82, 0.90)),
    "v32-2026-12-03": dict(verdict="holds", inside_measured=4, ratio=(0.95, 1.05)),
    "v33-2026-12-03": dict(verdict="does not hold", inside_measured=0, ratio=(0.87, 1.04)),
    "v36-2026-12-03": dict(verdict="holds", inside_measured=10, unresolved_savings=2, gate_disagreements=0,
                           ratio=(0.87, 0.96)),
    "v37-2026-12-03": dict(verdict="inconclusive", inside_measured=2, ratio=(0.84, 0.98)),
})
# "Request channel time, and what merging two reads saves": the model with c (v38-v41), v39-v41 with the merge check.
QUOTED.update({
    "v38-2026-12-03": dict(verdict="inconclusive", inside_measured=1, ratio=(0.99, 1.10)),
    "v39-2026-12-03": dict(verdict="inconclusive", inside_measured=0, ratio=(0.94, 1.03),
                           merge_saving_predicted_over_measured=pytest.approx(0.81, abs=0.005)),
    "v40-2026-12-03": dict(verdict="holds", inside_measured=12, unresolved_savings=0, gate_disagreements=0,
                           ratio=(0.85, 0.89), merge_saving_predicted_over_measured=pytest.approx(1.37, abs=0.005)),
    "v41-2026-12-03": dict(verdict="inconclusive", inside_measured=2, ratio=(0.79, 0.84),
                           merge_saving_predicted_over_measured=pytest.approx(0.56, abs=0.005)),
})
# "The harness's own waits": the garbage collector frozen (v42), then cold sessions (v43-v46; a lock-free spin, since removed).
QUOTED.update({
    "v42-2026-12-03": dict(verdict="does not hold", inside_measured=0, ratio=(0.78, 0.88),
                           merge_saving_predicted_over_measured=pytest.approx(1.00, abs=0.005)),
    "v43-2026-12-03": dict(verdict="does not hold", inside_measured=0, ratio=(0.75, 0.85),
                           merge_saving_predicted_over_measured=pytest.approx(0.85, abs=0.005)),
    "v44-2026-12-03": dict(verdict="inconclusive", inside_measured=9, unresolved_savings=4, gate_disagreements=0,
                           ratio=(1.03, 1.10), merge_saving_predicted_over_measured=pytest.approx(3.91, abs=0.005)),
    "v45-2026-12-03": dict(verdict="inconclusive", inside_measured=0, ratio=(0.94, 1.12),
                           merge_saving_predicted_over_measured=None),   # merging cost 29 us before the runs
    "v46-2026-12-03": dict(verdict="inconclusive", inside_measured=0, unresolved_savings=1, ratio=(0.74, 0.83),
                           merge_saving_predicted_over_measured=pytest.approx(0.98, abs=0.005)),
})
# "Scale reads and the kernel's readahead": the model's page cache (replay.model.pagecache), on this session's slower disk.
QUOTED.update({
    "v47-2026-12-03": dict(verdict="inconclusive", inside_measured=2, unresolved_savings=2, ratio=(0.97, 1.09),
                           merge_saving_predicted_over_measured=pytest.approx(1.50, abs=0.005)),
    "v48-2026-12-03": dict(verdict="holds", inside_measured=3, unresolved_savings=0, gate_disagreements=0,
                           ratio=(0.86, 0.94), merge_saving_predicted_over_measured=pytest.approx(0.90, abs=0.005)),
    "v49-2026-12-03": dict(verdict="holds", inside_measured=10, unresolved_savings=2, gate_disagreements=0,
                           ratio=(0.95, 1.00), prefetch_within_tolerance=6,
                           merge_saving_predicted_over_measured=None),   # merging cost 38 us before the runs
})
# "Which scale reads reach the drive, asked with mincore": the harness asks mincore (v52 coalescing, v53 default).
QUOTED.update({
    "v52-2026-12-04": dict(verdict="inconclusive", inside_measured=0, unresolved_savings=0, gate_disagreements=0,
                           ratio=(0.99, 1.29)),
    "v53-2026-12-04": dict(verdict="holds", inside_measured=12, unresolved_savings=2, gate_disagreements=0,
                           ratio=(0.92, 1.17), prefetch_within_tolerance=8),
})
WAITS = {"v43-2026-12-03": dict(louvain=(0.20e-3, 0.41e-3), stock=(0.04e-3, 0.13e-3), savings=4, savings_inside=0,
                                savings_ruled_out=3),
         "v44-2026-12-03": dict(louvain=(0.0, 0.0), stock=(0.0, 0.0), savings=12, savings_inside=11, savings_ruled_out=0),
         "v45-2026-12-03": dict(louvain=(0.15e-3, 0.33e-3), stock=(0.03e-3, 0.11e-3), savings=4, savings_inside=0,
                                savings_ruled_out=3),
         "v46-2026-12-03": dict(louvain=(0.23e-3, 0.45e-3), stock=(0.05e-3, 0.14e-3), savings=4, savings_inside=0,
                                savings_ruled_out=1),
         "v47-2026-12-03": dict(louvain=(0.61e-3, 1.19e-3), stock=(0.18e-3, 0.46e-3), savings=4, savings_inside=4,
                                savings_ruled_out=0),
         "v48-2026-12-03": dict(louvain=(0.65e-3, 1.40e-3), stock=(0.19e-3, 0.51e-3), savings=4, savings_inside=4,
                                savings_ruled_out=0),
         "v49-2026-12-03": dict(louvain=(0.0, 0.0), stock=(0.0, 0.0), savings=12, savings_inside=11, savings_ruled_out=0),
         "v52-2026-12-04": dict(louvain=(0.31e-3, 0.63e-3), stock=(0.05e-3, 0.13e-3), savings=4, savings_inside=0,
                                savings_ruled_out=2),
         "v53-2026-12-04": dict(louvain=(0.0, 0.0), stock=(0.0, 0.0), savings=12, savings_inside=12, savings_ruled_out=0)}
READS = {"v46-2026-12-03": dict(cells=6, within=0, unmeasured=0, ratio=(1.37, 2.03)),
         "v47-2026-12-03": dict(cells=6, within=6, unmeasured=0, ratio=(1.00, 1.01)),
         "v48-2026-12-03": dict(cells=6, within=6, unmeasured=0, ratio=(0.99, 1.02)),
         "v49-2026-12-03": dict(cells=18, within=17, unmeasured=0, ratio=(0.96, 1.11)),
         "v52-2026-12-04": dict(cells=6, within=6, unmeasured=0, ratio=(0.99, 1.00)),
         "v53-2026-12-04": dict(cells=18, within=17, unmeasured=0, ratio=(0.90, 1.14))}
"""Quoted with the model's demand drive reads per token over the harness's (record version 12 on)."""
"""Quoted with the harness's waits for experts whose own reads the page cache served (s/token, per layout) and the layout
savings at equal disk speed less them."""
HARNESS = {"v32-2026-12-03": (0.94, 0.97, 0.14, 0.42), "v33-2026-12-03": (0.94, 0.97, 0.14, 0.43),
           "v36-2026-12-03": (0.99, 1.01, 0.01, 0.04), "v37-2026-12-03": (0.96, 0.99, 0.03, 0.05),
           "v38-2026-12-03": (0.96, 0.98, 0.03, 0.05), "v39-2026-12-03": (0.97, 0.99, 0.02, 0.04),
           "v40-2026-12-03": (0.99, 1.01, 0.01, 0.03), "v41-2026-12-03": (0.96, 0.98, 0.04, 0.06),
           "v42-2026-12-03": (0.96, 0.99, 0.03, 0.04), "v43-2026-12-03": (0.96, 0.99, 0.0, 0.01),
           "v44-2026-12-03": (0.99, 1.01, 0.0, 0.02), "v45-2026-12-03": (0.96, 0.99, 0.0, 0.01),
           "v46-2026-12-03": (0.96, 0.99, 0.0, 0.01), "v47-2026-12-03": (0.96, 0.98, 0.06, 0.11),
           "v48-2026-12-03": (0.95, 0.97, 0.07, 0.17), "v49-2026-12-03": (0.99, 1.01, 0.07, 0.17),
           "v52-2026-12-04": (0.96, 0.99, 0.04, 0.06), "v53-2026-12-04": (0.98, 1.01, 0.02, 0.04)}
"""Quoted with the harness's compute: S at each run's speed and compute, and the excess over the model's compute."""


def _load(path: Path) -> dict:
    with open(path) as f:
        return json.load(f)


def test_every_quoted_run_is_kept():
    assert {p.name.removesuffix(".validation.json") for p in VALIDATIONS} >= set(QUOTED)


@pytest.mark.parametrize("path", VALIDATIONS, ids=lambda p: p.name)
def test_kept_record_judged_again_gives_its_verdict(path):
    record = _load(path)
    judged = judge_record(record)["summary"]
    kept = record["summary"]
    for key in ("verdict", "cells_disagree", "cells_unresolved", "inside_measured", "unresolved_savings",
                "sign_wrong", "prefetch_within_tolerance", "prefetch_disagree", "gate_disagreements"):
        assert judged[key] == kept[key], key
    quoted = dict(QUOTED.get(path.name.removesuffix(".validation.json"), {}))
    if quoted:
        low, high = quoted.pop("ratio")
        assert low <= judged["ratio_min"] <= judged["ratio_max"] <= high
        assert {k: judged[k] for k in quoted} == quoted
    harness = HARNESS.get(path.name.removesuffix(".validation.json"))
    if harness:
        low, high, least, most = harness
        h = judged["harness_compute"]
        assert low <= h["ratio_min"] <= h["ratio_max"] <= high and least <= h["excess_min"] <= h["excess_max"] <= most
    waits = dict(WAITS.get(path.name.removesuffix(".validation.json"), {}))
    if waits:
        w = judged["page_cache_waits"]
        for layout in ("louvain", "stock"):
            lo, hi = waits.pop(layout)
            assert lo - 5e-6 <= w["by_layout"][layout][0] <= w["by_layout"][layout][1] <= hi + 5e-6, layout
        assert {k: w[k] for k in waits} == waits
    reads = dict(READS.get(path.name.removesuffix(".validation.json"), {}))
    if reads:
        low, high = reads.pop("ratio")
        r = judged["drive_reads"]
        assert low <= r["ratio_min"] <= r["ratio_max"] <= high and {k: r[k] for k in reads} == reads


@pytest.mark.parametrize("path", PROFILES, ids=lambda p: p.name)
def test_kept_profile_loads_as_the_run_used_it(path):
    profile = load_device(str(path))
    assert profile.drive.bandwidth > 0 and profile.drive.request_seconds > 0
    users = [r for r in map(_load, VALIDATIONS) if r["device"]["digest"] == profile.digest()]
    assert users                                      # every kept profile is one a kept run used
    for record in users:
        used = record["device"]["profile"]
        assert used["drive"] == _load(path)["drive"]
        assert used["host_bandwidth"] == profile.host_bandwidth
