"""The command line: demo runs end to end; bad input is one line and exit 2."""

import json
import re

import numpy as np
import pytest
from conftest import cli, run_cli

from replay.physical.stalltrace import report


@pytest.mark.slow
def test_demo_runs(tmp_path):
    res = run_cli("demo", "--dir", tmp_path / "demo")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "re-check: 0 mismatches" in res.stdout
    assert "1 worker, coalescing reads" in res.stdout and "-> PASS" in res.stdout
    assert (tmp_path / "demo" / "gate.json").exists() and (tmp_path / "demo" / "plan.json").exists()
    record = json.loads((tmp_path / "demo" / ".relayout-demo").read_text())     # every path it made, recorded
    assert {"source", "relaid", "relaid/relayout.manifest.json", "trace.rt", "plan.json", "gate.json"} <= set(record["paths"])
    assert "verify --full: 0 problems" in res.stdout and "measured S: stock" in res.stdout and (tmp_path / "demo" / "relaid" / "relayout.manifest.json").exists()
    line = next(x for x in res.stdout.splitlines() if "compute, ms/token: the harness ran" in x)
    said = re.search(r"stock ([\d.]+), relaid ([\d.]+), the model ([\d.]+)", line)
    for label, value in (("stock", said[1]), ("relaid", said[2])):    # the compute its STALL_TRACEs hold
        runs = report([tmp_path / "demo" / f"measure-{label}.jsonl"]).runs
        assert len(runs) == 2 and float(value) == pytest.approx(
            np.mean([m.published["compute_per_committed_token_ns"] for m in runs]) / 1e6, abs=6e-4)
    assert float(said[3]) > 0 and ("ran beyond the emulated compute" in line) == (
        max(float(said[1]), float(said[2])) > 1.1 * float(said[3]))


def test_unknown_geometry_is_one_line(tmp_path):
    res = cli("synth", "container", tmp_path / "x", "--geometry", "nope")
    assert res.returncode == 2 and "unknown geometry" in res.stderr and res.stderr.count("\n") == 1
    assert not (tmp_path / "x").exists()


def test_synth_refuses_existing_output(small_container):
    res = cli("synth", "container", small_container, "--geometry", "glm-5.2-int4-row")
    assert res.returncode == 2 and "already exists" in res.stderr


def test_manifest_of_missing_dir(tmp_path):
    res = cli("manifest", tmp_path / "nope")
    assert res.returncode == 2 and "no such directory" in res.stderr and "Traceback" not in res.stderr


def test_demo_never_deletes_what_it_did_not_make(tmp_path):
    work = tmp_path / "work"
    (work / "source").mkdir(parents=True)
    (work / "source" / "mine.txt").write_text("user data")
    (work / "plan.json").write_text("{}")
    res = cli("demo", "--dir", work)
    assert res.returncode == 2 and "not a previous demo's directory" in res.stderr and res.stderr.count("\n") == 1
    assert (work / "source" / "mine.txt").read_text() == "user data" and (work / "plan.json").read_text() == "{}"


def test_output_paths_under_a_file_are_one_line_errors(tmp_path, small_container):
    blocker = tmp_path / "gate.json"
    blocker.write_text("{}")
    cases = [
        ("synth", "container", blocker / "c", "--geometry", "qwen3-30b-a3b", "--moe-layers", 1, "--experts", 4),
        ("demo", "--dir", blocker / "demo"),
        ("manifest", small_container, "-o", blocker / "m.json"),
        ("calibrate", tmp_path, "-o", tmp_path / "d.json", "--seconds", 0),
    ]
    for args in cases:
        res = cli(*args)
        assert res.returncode == 2 and res.stderr.count("\n") == 1 and "Traceback" not in res.stderr, (args, res.stderr)
    assert blocker.read_text() == "{}"


def test_an_unexpected_exception_is_one_line_asking_for_a_bug_report(monkeypatch, capsys):
    from relayout import cli
    from relayout.cli import commands_containers

    def broken(args):
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(commands_containers, "cmd_inspect", broken)
    assert cli.main(["inspect", "x"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "relayout inspect: internal error (ZeroDivisionError" in err and "RELAYOUT_DEBUG=1" in err
    monkeypatch.setenv("RELAYOUT_DEBUG", "1")
    try:
        cli.main(["inspect", "x"])
    except ZeroDivisionError:
        pass
    else:
        raise AssertionError("RELAYOUT_DEBUG=1 must show the exception")


def test_the_demo_says_in_words_when_measurement_contradicts_prediction():
    from relayout.workflows.validation.rules import measured_vs_predicted

    assert measured_vs_predicted(-6.4, -8.0, -4.9, 3.4).startswith("measurement CONTRADICTS the prediction: measured saving is negative")
    assert "CONTRADICTS" in measured_vs_predicted(2.0, 1.5, 2.5, -0.5)
    assert "CONTRADICTS" in measured_vs_predicted(0.1, -0.2, 0.4, 3.0)
    assert measured_vs_predicted(2.0, 1.5, 2.5, 2.2).startswith("measurement agrees")
    assert "agree in sign but not in size" in measured_vs_predicted(2.0, 1.5, 2.5, 3.4)


def test_trace_stats_text_has_no_python_reprs(tmp_path):
    res = cli("synth", "trace", tmp_path / "t.rt", "--geometry", "qwen3-30b-a3b", "--moe-layers", 2, "--experts", 16,
              "--tokens", 100, "--sessions", 2)
    assert res.returncode == 0, res.stderr
    out = cli("trace", "stats", tmp_path / "t.rt").stdout
    assert "None" not in out and "{" not in out and "(100 decode)" in out and "n/a" in out
