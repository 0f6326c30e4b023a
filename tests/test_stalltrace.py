"""STALL_TRACE analysis: known answers, no double counting, committed-token accounting, validation."""

import json

import numpy as np
import pytest

from containers.errors import InputError
from replay.physical.stalltrace import compare, interval_union, report


def expert(step, layer, e, issue, ready, need, nbytes=1000, required=True, *, run="r1", **kw):
    return {"run_id": run, "request_id": 0, "step": step, "layer": layer, "expert_id": e, "required": required,
            "bytes": nbytes, "issue_ns": issue, "ready_ns": ready, "need_ns": need, **kw}


def step(s, committed=1, evaluated=1, run="r1", **kw):
    return {"record": "step", "run_id": run, "request_id": 0, "step": s, "committed_tokens": committed,
            "evaluated_positions": evaluated, **kw}


def write(path, records):
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return path


def test_known_answer_s_and_recall(tmp_path):
    recs = [
        step(0), step(1),
        expert(0, 3, 1, 0, 500, 200),      # late by 300
        expert(0, 3, 2, 0, 100, 200, priority="speculative"),      # prefetched, timely
        expert(0, 4, 5, 0, 1000, 400),     # late by 600
        expert(1, 3, 1, 0, 0, 0, tier_served="ram", tier_at_prediction="ram"),  # resident
        expert(1, 3, 7, 0, 250, 250, priority="speculative"),      # prefetched, exactly on time
    ]
    r = report([write(tmp_path / "t.jsonl", recs)])
    m = r["runs"][0]
    assert m["total_stall_ns"] == 900
    assert r["stall_per_committed_token_ns"] == pytest.approx(450)
    # not-already-ready required bytes: 4 records x 1000; timely: experts 2 and 7
    assert m["timely_required_byte_recall"] == pytest.approx(0.5)
    assert m["union_bytes_per_committed_token"] == pytest.approx(5 * 1000 / 2)


def test_overlapping_waits_are_not_double_counted(tmp_path):
    recs = [step(0),
            expert(0, 3, 1, 0, 1000, 100),   # waits 100..1000
            expert(0, 3, 2, 0, 800, 300),    # inside that wait
            expert(0, 3, 3, 0, 1200, 900)]   # overlaps its end, extends to 1200 -> union 1100
    m = report([write(tmp_path / "t.jsonl", recs)])["runs"][0]
    assert m["total_stall_ns"] == 1100
    assert interval_union(np.array([0, 5, 20]), np.array([10, 8, 30])) == 20


def test_rejected_positions_charge_stall_not_tokens(tmp_path):
    recs = [step(0, committed=1, evaluated=3), expert(0, 3, 1, 0, 900, 0), expert(0, 3, 2, 0, 600, 0)]
    r = report([write(tmp_path / "t.jsonl", recs)])
    assert r["committed_tokens"] == 1 and r["stall_per_committed_token_ns"] == pytest.approx(900)


@pytest.mark.parametrize("bad, words", [
    ({"run_id": "r", "request_id": 0, "step": 0, "layer": 3, "required": True, "bytes": 1}, "expert_id"),
    (expert(0, 3, 1, 500, 100, 0), "before issue_ns"),
    (expert(0, 3, 1, 0, 100, 0, barrier_enter_ns=50, barrier_exit_ns=10), "barrier_exit_ns"),
    (step(0, committed=3, evaluated=2), "exceeds"),
    (expert(0, -1, 1, 0, 1, 0), "'layer'"),
])
def test_malformed_records_are_rejected_with_line_numbers(tmp_path, bad, words):
    p = write(tmp_path / "bad.jsonl", [step(0), bad])
    with pytest.raises(InputError) as exc:
        report([p])
    assert str(exc.value).startswith(f"{p}:2:") and words in str(exc.value)


def test_compares_few_repetitions_with_a_students_t_interval(tmp_path):
    """Two pairs: a percentile bootstrap over them spans just the two savings; t(0.975, 1) = 12.7
    says how little two repetitions of a drifting disk pin down."""
    def config(name, lates):
        recs = []
        for i, late in enumerate(lates):
            recs.append(step(0, run=f"{name}{i}", token_hashes=["a"]))
            recs.append(expert(0, 3, 1, 0, late, 0, run=f"{name}{i}"))
        return write(tmp_path / f"{name}.jsonl", recs)

    x = compare([config("ctl", [1000, 1000]), config("new", [500, 300])])["comparisons"][0]
    assert x["per_pair_ns"] == pytest.approx([500.0, 700.0]) and x["saving_ns"]["estimate"] == pytest.approx(600)
    half = 12.706204736 * float(np.std([500.0, 700.0], ddof=1)) / 2 ** 0.5
    assert x["saving_ns"]["high"] == pytest.approx(600 + half) and x["saving_ns"]["low"] == pytest.approx(600 - half)
    assert x["saving_ns"]["low"] < 0                    # two repetitions cannot exclude zero here


def test_compare_pairs_repetitions_and_flags_token_divergence(tmp_path):
    def config(name, late, runs=4, tokens=("a", "b")):
        recs = []
        for i in range(runs):
            run = f"{name}{i}"
            for s in range(2):
                recs.append(step(s, run=run, token_hashes=[tokens[s]]))
                recs.append(expert(s, 3, 1, 0, late + 10 * i, 0, run=run))
        return write(tmp_path / f"{name}.jsonl", recs)

    a, b = config("a", 1000), config("b", 400)
    c = compare([a, b])
    assert c["correctness_failures"] == []
    x = c["comparisons"][0]
    assert x["pairs"] == 4 and x["saving_ns"]["estimate"] == pytest.approx(600)
    assert x["saving_ns"]["low"] <= 600 <= x["saving_ns"]["high"]
    bad = config("bad", 400, tokens=("a", "z"))
    c = compare([a, bad])
    assert len(c["correctness_failures"]) == 4 and "request:step 0:1" in c["correctness_failures"][0]


def test_plots_are_written(tmp_path):
    pytest.importorskip("matplotlib")
    from replay.physical.stallplots import write_plots

    recs = [step(0), step(1), expert(0, 3, 1, 0, 500, 200), expert(1, 4, 2, 0, 900, 100)]
    r = report([write(tmp_path / "t.jsonl", recs)])
    gate = {"baseline_metrics": {"stall_per_token_s": 0.001}, "plan_metrics": {"stall_per_token_s": 0.0005}}
    paths = write_plots(r, tmp_path / "plots", gate)
    assert [p.name for p in paths] == ["stall_cdf.png", "stall_per_layer.png", "predicted_vs_measured.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in paths)


def test_drive_busy_is_the_union_of_the_loads_that_read_the_drive():
    """Two overlapping drive loads and one apart count their union; a page-cache load (no drive
    requests) and a record without I/O counts do not count at all."""
    from replay.physical.stalltrace import drive_busy

    io = [(2, 100, 0, 0, 0, 0), (1, 50, 0, 0, 0, 0), (0, 0, 3, 30, 0, 0), None, (1, 10, 0, 0, 0, 0)]
    issue = np.array([0, 5, 0, 0, 40], dtype=np.int64)
    ready = np.array([10, 20, 100, 100, 45], dtype=np.int64)
    assert drive_busy(io, issue, ready) == (160, 25)
    assert drive_busy([None, (0, 0, 1, 4, 0, 0)], issue[:2], ready[:2]) == (0, 0)


def test_page_cache_wait_counts_demand_loads_the_page_cache_served_whole(tmp_path):
    """Only demand loads with no drive and no unclassified request, and some page-cache ones,
    count; their foreground stall is summed, and published per committed token."""
    from replay.physical.stalltrace import page_cache_wait

    io = [(0, 0, 3, 30, 0, 0), (1, 50, 2, 20, 0, 0), (0, 0, 0, 0, 3, 30), (0, 0, 3, 30, 0, 0), None, (0, 0, 3, 30, 0, 0)]
    stall = [7, 100, 100, 100, 100, 5]
    spec = [False, False, False, True, False, False]
    assert page_cache_wait(io, stall, spec) == 12
    assert page_cache_wait([None, None], [3, 4], [False, False]) is None
    assert page_cache_wait([(1, 50, 0, 0, 0, 0), (0, 0, 0, 0, 3, 30)], [3, 4], [False, False]) is None  # no RWF_NOWAIT
    io_fields = ("drive_requests", "drive_bytes", "page_cache_requests", "page_cache_bytes", "unclassified_requests",
                 "unclassified_bytes")
    recs = [expert(0, 3, 1, 0, 40, 10, foreground_stall_ns=30, committed_tokens=2, evaluated_positions=2,
                   **dict(zip(io_fields, (1, 1000, 0, 0, 0, 0)))),
            expert(0, 3, 2, 0, 60, 50, foreground_stall_ns=10, committed_tokens=2, evaluated_positions=2,
                   **dict(zip(io_fields, (0, 0, 3, 30, 0, 0)))),
            step(0, committed=2, evaluated=2)]
    m = report([write(tmp_path / "t.jsonl", recs)])["runs"][0]
    assert m["page_cache_wait_per_committed_token_ns"] == 5.0


def test_figure_labels_are_short_and_distinct():
    from types import SimpleNamespace

    from replay.physical.stallplots import LABEL_CHARS, _labels

    long_a = "stock-" + "x" * 30 + "-20261204T101010-a"
    long_b = "stock-" + "x" * 30 + "-20261204T101010-b"
    runs = [SimpleNamespace(run_id=i, source=f"/r/{n}.jsonl") for n, i in enumerate([long_a, long_b, "short", "short"])]
    labels = _labels(runs)
    assert len(set(labels)) == 4
    assert all(len(x) <= LABEL_CHARS + 4 for x in labels)
    assert labels[0] != labels[1] and labels[0].endswith("-a")


def test_legends_sit_outside_the_data():
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from replay.physical.stallplots import _legend_outside

    fig, ax = plt.subplots()
    ax.bar([0, 1], [1, 2], label="a run with a long label")
    _legend_outside(ax)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    legend = ax.get_legend().get_window_extent(renderer)
    assert legend.x0 >= ax.get_window_extent(renderer).x1
    plt.close(fig)


def test_one_repetition_per_configuration_gives_no_interval(tmp_path):
    """One pair cannot say how much a saving varies: the text says insufficient and how to pass repetitions."""
    from relayout.render.measurements import format_compare

    def config(name, late):
        return write(tmp_path / f"{name}.jsonl", [step(0, run=name), expert(0, 3, 1, 0, late, 0, run=name)])

    text = format_compare(compare([config("ctl", 1000), config("new", 500)]))
    assert "insufficient, one paired repetition" in text and "95% CI" not in text and "cat " in text
