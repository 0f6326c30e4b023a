"""The study tables' typed records (sweep, placement, split curve, hypotheses): the JSON they write
keeps its keys and their order, reads back strictly, and the renderers read the records."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from containers import records
from containers.errors import InputError
from replay.control.placement import PlacementArmRecord, PlacementTable
from replay.control.splitcurve import CurvePoint, SplitCurve
from replay.evaluation.hypotheses import ArmRow, Comparison, HypothesisTableRecord
from replay.formats.interval import Interval
from replay.formats.sweepfile import SWEEP_FORMAT, SweepCell, SweepTable

from relayout.render.gate import format_sweep

finite = st.floats(-1e3, 1e3, allow_nan=False)
intervals = st.builds(Interval, finite, finite, finite, st.none() | st.sampled_from(["session", "block"]),
                      st.none() | st.integers(1, 50), st.none() | st.sampled_from(["session", "moving-block"]))
cells = st.builds(SweepCell, ram_gb=finite, workers=st.integers(1, 64), coalesce=st.booleans(),
                  verdict=st.sampled_from(["pass", "fail", "insufficient"]), baseline_stall_s=finite,
                  plan_stall_s=finite, oracle_stall_s=finite, saving=intervals, saving_fraction_of_tpot=intervals,
                  tpot_s=finite, p_below_threshold=finite, sufficient=st.booleans(), pins=st.text(max_size=4),
                  holm_significant=st.none() | st.booleans())

SWEEP_KEYS = ["ram_gb", "workers", "coalesce", "verdict", "baseline_stall_s", "plan_stall_s", "oracle_stall_s", "saving",
              "saving_fraction_of_tpot", "tpot_s", "p_below_threshold", "sufficient", "pins", "holm_significant"]


def cell(**kw) -> SweepCell:
    base = dict(ram_gb=0.5, workers=8, coalesce=True, verdict="pass", baseline_stall_s=0.004, plan_stall_s=0.003,
                oracle_stall_s=0.001, saving=Interval(0.001, 0.0008, 0.0012, "session", 6, "session"),
                saving_fraction_of_tpot=Interval(0.1, 0.08, 0.12), tpot_s=0.01, p_below_threshold=0.001,
                sufficient=True, pins="none", holm_significant=True)
    return SweepCell(**(base | kw))


@settings(max_examples=40)
@given(st.lists(cells, max_size=4))
def test_a_sweep_table_round_trips_through_json_text(cs):
    table = SweepTable(SWEEP_FORMAT, "sha256:ab", "single-nvme", cs)
    assert SweepTable.from_json(json.loads(json.dumps(table.to_json())), "sweep.json") == table


def test_a_sweep_cell_writes_its_keys_in_order_with_a_null_holm_and_a_bare_fraction():
    obj = cell(holm_significant=None).to_json()
    assert list(obj) == SWEEP_KEYS
    assert obj["holm_significant"] is None
    assert list(obj["saving"]) == ["estimate", "low", "high", "unit", "n_units", "method"]
    assert list(obj["saving_fraction_of_tpot"]) == ["estimate", "low", "high"]


def test_a_sweep_cell_lacking_a_field_is_one_named_error():
    obj = cell().to_json()
    del obj["holm_significant"]
    with pytest.raises(InputError, match="sweep.json.*holm_significant"):
        SweepCell.from_json(obj, "sweep.json")


def test_the_sweep_table_says_which_passes_survive_holm():
    text = format_sweep([cell(), cell(holm_significant=False), cell(verdict="fail", holm_significant=None)])
    rows = text.splitlines()[2:5]
    assert rows[0].endswith("  pass") and rows[1].endswith("pass, not after Holm") and rows[2].endswith("  fail")
    assert "   1.000 [  0.800,  1.200]" in rows[0]  # saving in ms with its interval


def test_a_placement_table_keeps_the_pin_record_fields_first_and_null_intervals():
    arm = PlacementArmRecord(arm="lru", ram_bytes=100, pin_bytes=0, lru_bytes=100, device="d", how="none",
                             experts=[(3, 1)], pin_share=0.5, train_stall_per_token_s=0.1, train_ram_hit_rate=0.2,
                             stall_per_token_s=Interval(0.1, 0.05, 0.15), ram_hit_rate=0.3, saving_vs_frequency_s=None)
    table = PlacementTable(format="relayout.placement", ram_bytes=100, pin_share=0.5, device="d", training_sessions=3,
                           held_out_sessions=2, method="session", sufficient=False, sufficiency="2 sessions",
                           stall_value_replays=4, arms=[arm])
    obj = table.to_json()
    assert list(obj["arms"][0])[:8] == ["arm", "ram_bytes", "pin_bytes", "lru_bytes", "device", "how", "experts", "pin_share"]
    assert obj["arms"][0]["experts"] == [[3, 1]] and obj["arms"][0]["saving_vs_frequency_s"] is None
    assert PlacementTable.from_json(json.loads(json.dumps(obj)), "p.json") == table


def test_a_split_curve_writes_its_format_first_and_the_curves_last():
    point = CurvePoint(ram_bytes=10, ratio=0.25, top_rows=[32, 32], top_bytes=4, lru_bytes=6, resident_tops=1,
                       train_stall_per_token_s=0.1, stall_per_token_s=Interval(0.1, 0.0, 0.2), ram_hit_rate=0.5)
    curve = SplitCurve(device="d", ratios=(0.25,), top_shares=(0.5, 1.0), training_sessions=3, held_out_sessions=2,
                       sufficient=False, sufficiency="few", candidate_replays=7, whole=[point], split=[point])
    obj = curve.to_json()
    assert list(obj) == ["format", "device", "ratios", "top_shares", "training_sessions", "held_out_sessions",
                         "sufficient", "sufficiency", "candidate_replays", "whole", "split"]
    assert obj["format"] == "relayout.split-curve" and obj["ratios"] == [0.25]
    assert records.from_json(CurvePoint, obj["split"][0], "c.json") == point

    held = CurvePoint(**{**vars(point), "resident": np.ones((2, 4), dtype=bool)})
    assert "resident" not in records.to_json(held)  # in memory only: the next step's split state
    assert records.from_json(CurvePoint, records.to_json(held), "c.json").resident is None


def test_a_hypothesis_table_names_its_arm_rows_as_json_does():
    row = ArmRow(arm="top-k", stall_per_token_s=Interval(0.1, 0.0, 0.2), p50_step_stall_s=0.1, p99_step_stall_s=0.3,
                 speculative_bytes_per_token=0.0, eta_stall_s_per_byte=None, ram_hit_rate=0.5,
                 timely_required_byte_recall=None, unused_bytes_per_token=None, queue_depth=None)
    comp = Comparison("top-k", "none", "S", Interval(0.01, 0.0, 0.02), 0.2, False, "no")
    rec = HypothesisTableRecord(hypothesis="H2", claim="c", falsifier="f", regime="r", verdict="insufficient",
                                sufficiency="s", reason="why", notes=[], arms=[row], comparisons=[comp])
    obj = records.to_json(rec)
    assert list(obj["arms"][0]) == ["arm", "stall_per_token_s", "p50_step_stall_s", "p99_step_stall_s",
                                    "speculative_bytes_per_token", "eta_stall_s_per_byte", "ram_hit_rate",
                                    "timely_required_byte_recall", "unused_bytes_per_token", "queue_depth"]
    assert list(obj["comparisons"][0]) == ["test", "against", "what", "difference", "p_value", "holds", "words"]
    assert records.from_json(HypothesisTableRecord, json.loads(json.dumps(obj)), "h.json") == rec
