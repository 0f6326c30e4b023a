"""``relayout validate --engine``: the judging of model against engine, the record, the refusals
before anything runs, and (with ``RELAYOUT_COLIBRI_ENGINE`` and ``RELAYOUT_COLIBRI_FIXTURE`` set,
docs/ENGINE.md) a whole validation against the real engine."""

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

from containers.errors import InputError
from relayout.workflows.validation.engine import (EngineValidateOptions, cell_copy_rates, cell_env, cell_name,
                                                  check_options)
from relayout.workflows.validation.engine_record import (ENGINE_VALIDATION_VERSION, CellResult, EngineValidationRecord,
                                                         RunResult, arm_result, placement_bound, saving_result, summarize)


def _run(arm, prompt, rep, measured, predicted, tokens=20, tpot=0.010, loads=(30, 30)):
    return RunResult(f"/runs/{arm}/p{prompt:02d}-r{rep:02d}", arm, prompt, rep, tokens, measured, predicted, tpot,
                     loads[0], loads[1], 0, -1, -1, -1, 0, predicted)


def _arm(arm, per_prompt, scale=1.0, prompts=6, reps=2, jitter=0.002):
    """Runs whose measured wait is ``per_prompt(p)`` s (+/- jitter by repetition) and predicted ``scale`` times it."""
    return [_run(arm, p, r, per_prompt(p) + (jitter if r else -jitter), scale * per_prompt(p))
            for p in range(prompts) for r in range(reps)]


def test_a_model_that_predicts_the_engine_holds_and_one_at_half_is_ruled_out():
    runs = _arm("stock", lambda p: 0.1 + 0.01 * p)
    good, half = arm_result("stock", runs), arm_result("stock", _arm("stock", lambda p: 0.1 + 0.01 * p, scale=0.5))
    assert good.agreement == "agrees" and abs(good.ratio - 1) < 1e-9 and good.loads_agree
    assert half.agreement == "disagrees" and abs(half.ratio - 0.5) < 1e-9
    assert good.measured_s.low < good.measured_s.estimate < good.measured_s.high and good.runs == 12
    unequal = arm_result("stock", runs[:-1] + [_run("stock", 5, 1, 0.15, 0.15, loads=(31, 30))])
    assert not unequal.loads_agree


def test_savings_are_judged_per_prompt_and_the_gates_rule_is_applied_to_both_sides():
    stock = _arm("stock", lambda p: 0.2 + 0.01 * p)
    better = _arm("louvain", lambda p: 0.1 + 0.01 * p)                   # saves 0.1 s per 20 tokens: 5 ms/token
    s = saving_result("louvain", stock, better)
    assert s.prompts == 6 and abs(s.measured.estimate - 0.005) < 1e-9 and abs(s.predicted.estimate - 0.005) < 1e-9
    assert s.agreement == "agrees" and s.sign_agrees is True
    assert abs(s.need_s - 0.05 * 0.010) < 1e-12                           # 5% of the measured stock TPOT
    assert s.gate_decision == s.measured_decision == "pass" and s.decisions_agree
    # predicted to lose where the engine measured a clear saving: the sign and the decision differ
    wrong = [RunResult(r.run, r.arm, r.prompt, r.repetition, r.committed_tokens, r.measured_wait_s, 0.3, r.tpot_s,
                       r.measured_loads, r.predicted_loads, 0, -1, -1, -1, 0, 0.3) for r in better]
    w = saving_result("louvain", stock, wrong)
    assert w.sign_agrees is False and w.gate_decision == "fail" and w.measured_decision == "pass" and not w.decisions_agree
    assert w.agreement == "disagrees" and "CONTRADICTS" in w.words
    # four prompts are too few held-out sessions for the gate's rule: insufficient on both sides
    few = saving_result("louvain", [r for r in stock if r.prompt < 4], [r for r in better if r.prompt < 4])
    assert few.gate_decision == few.measured_decision == "insufficient"


def test_no_saving_is_a_result_the_validation_can_give():
    stock = _arm("stock", lambda p: 0.2 + 0.01 * p)
    same = _arm("random", lambda p: 0.2 + 0.01 * p, jitter=0.004)
    s = saving_result("random", stock, same)
    assert s.measured.low < 0 < s.measured.high and s.sign_agrees is None
    assert s.gate_decision == "fail" and s.measured_decision == "fail" and s.decisions_agree


def _predicting(runs, like):
    """``runs`` with the predicted waits of ``like`` (run for run)."""
    return [RunResult(r.run, r.arm, r.prompt, r.repetition, r.committed_tokens, r.measured_wait_s, o.predicted_wait_s,
                      r.tpot_s, r.measured_loads, r.predicted_loads, 0, -1, -1, -1, 0, o.predicted_wait_s)
            for r, o in zip(runs, like)]


def test_a_saving_no_larger_than_placement_is_not_held_against_the_model():
    """Stock runs 0.2 ms/token slower than its rewrite (the placement control) while the model
    predicts the two alike, and a layout saves as much while the model predicts nothing: outside
    the measured interval, but within what placement moves, so neither confirmed nor ruled out.
    Without the control it is ruled out. When the model does predict the control's saving (the
    rewrite's alignment), placement is only what is left beyond that prediction, and the same
    layout saving is ruled out again."""
    stock = _arm("stock", lambda p: 0.2 + 0.01 * p, jitter=0.0005)
    measured_copy = _arm("stock-copy", lambda p: 0.196 + 0.01 * p, jitter=0.0005)
    layout = _predicting(_arm("random", lambda p: 0.196 + 0.01 * p, jitter=0.0005), stock)
    control = saving_result("stock-copy", stock, _predicting(measured_copy, stock))
    bound = placement_bound(control)
    assert abs(control.predicted.estimate) < 1e-15 and control.measured.low > 0 and abs(bound - control.measured.high) < 1e-12
    assert saving_result("random", stock, layout).agreement == "disagrees"
    judged = saving_result("random", stock, layout, placement_s=bound)
    assert judged.agreement == "within placement" and "placement" in judged.words
    explained = saving_result("stock-copy", stock, measured_copy)           # the model predicts what was measured
    small = placement_bound(explained)
    assert explained.predicted.estimate > 0 and small < bound / 4
    assert abs(small - max(explained.predicted.estimate - explained.measured.low,
                           explained.measured.high - explained.predicted.estimate)) < 1e-12
    assert saving_result("random", stock, layout, placement_s=small).agreement == "disagrees"


def test_the_verdict_counts_every_layout_cell_and_the_record_round_trips():
    stock = _arm("stock", lambda p: 0.2 + 0.01 * p)
    new = _arm("louvain", lambda p: 0.1 + 0.01 * p)
    control = saving_result("stock-copy", stock, _arm("stock-copy", lambda p: 0.2 + 0.01 * p))
    ok = CellResult("pipe-0-cap4", cell_env("PIPE=0", 4), [arm_result("stock", stock), arm_result("louvain", new)],
                    control.measured, control.predicted.estimate, placement_bound(control),
                    [saving_result("louvain", stock, new)], 8.6e9, "its stock runs", [1.0e9, 1.1e9], 1.05, 0.0, [], [3.0e8, 2.5e8])
    agree, disagree, unresolved, decided, decisions, verdict, words = summarize([ok])
    assert (agree, disagree, decided, decisions, verdict) == (2, 0, 1, 1, "holds")
    off = CellResult("pipe-1-cap4", cell_env("PIPE=1", 4), [arm_result("stock", _arm("stock", lambda p: 0.2, scale=0.5))],
                     control.measured, 0.0, 0.0, [], 0.0, "", [2.0e9, 1.6e9], 1.8, 0.0, [], [-1.0, 1.0e8])
    *_, verdict2, words2 = summarize([ok, off])
    assert verdict2 == "does not hold" and "pipe-1-cap4" in words2 and "0.50" in words2
    assert "disk ran beyond" in words2 and "pipe-1-cap4 (1.80x)" in words2 and "pipe-0-cap4 (" not in words2
    assert "disk ran beyond" not in words                   # 1.05x: within the tolerance
    rec = EngineValidationRecord(format="relayout-engine-validation", version=ENGINE_VALIDATION_VERSION, engine="colibri", container="m",
                                 device="d", device_source="given", layouts={"stock": "m"}, training_sessions=["a"],
                                 prompts=6, reps=2, ngen=24, tolerance=0.2, cells=[ok, off], runs=stock + new,
                                 cells_agree=agree, cells_disagree=1, cells_unresolved=0, decisions_agree=1, decisions=1,
                                 verdict=verdict2, summary=words2)
    assert EngineValidationRecord.from_json(rec.to_json()) == rec
    from relayout.render.engine import engine_validation_bottom_line

    bottom = engine_validation_bottom_line(rec, "v.json")
    assert bottom.startswith("Bottom line: the model does not hold against colibrì")
    assert "taken as the engine's for PIPE=0." in bottom and "Do not take them as the engine's for PIPE=1:" in bottom
    assert "Record: v.json." in bottom
    with pytest.raises(InputError, match="version"):
        EngineValidationRecord.from_json({**rec.to_json(), "version": 99})
    with pytest.raises(InputError):
        EngineValidationRecord.from_json({**rec.to_json(), "cells_agree": True})


def test_a_cell_on_a_drifted_disk_is_also_judged_at_the_speed_it_probed():
    """The model at half the engine's S on the profile's drive rates, and equal to it with the
    drives at the speed the disk probed (half the profile's): the verdict stays the profile's
    (ruled out), the summary counts the cell as agreeing at the probed speed, and the table shows
    both ratios."""
    from dataclasses import replace as with_

    from relayout.render.engine import format_engine_validation

    runs = [with_(r, predicted_wait_probed_s=r.measured_wait_s) for r in _arm("stock", lambda p: 0.2, scale=0.5)]
    arm = arm_result("stock", runs)
    assert (arm.agreement, arm.agreement_probed) == ("disagrees", "agrees")
    assert abs(arm.ratio - 0.5) < 1e-9 and abs(arm.ratio_probed - 1) < 1e-9
    stock = _arm("stock", lambda p: 0.2 + 0.01 * p)
    control = saving_result("stock-copy", stock, stock)
    cell = CellResult("pipe-0-cap4", cell_env("PIPE=0", 4), [arm], control.measured, 0.0, 0.0, [], 0.0, "",
                      [1.0e9, 1.0e9], 0.5, 0.0, [], [-1.0, 1.0e8])
    agree, *_, verdict, words = summarize([cell])
    assert verdict == "does not hold" and agree == 0
    assert "at the speed the disk probed around each cell, 1 of 1 layout-cells are within +/-20%" in words
    steady = CellResult("pipe-0-cap4", cell_env("PIPE=0", 4), [arm], control.measured, 0.0, 0.0, [], 0.0, "",
                        [2.0e9, 2.0e9], 1.0, 0.0, [], [-1.0, 1.0e8])
    assert "probed around each cell" not in summarize([steady])[-1]     # no drift: nothing more to say
    rec = EngineValidationRecord(format="relayout-engine-validation", version=ENGINE_VALIDATION_VERSION, engine="e",
                                 container="m", device="d", device_source="given", layouts={"stock": "m"},
                                 training_sessions=["a"], prompts=6, reps=2, ngen=24, tolerance=0.2, cells=[cell],
                                 runs=runs, cells_agree=0, cells_disagree=1, cells_unresolved=0, decisions_agree=0,
                                 decisions=0, verdict=verdict, summary=words)
    row = next(line for line in format_engine_validation(rec).splitlines() if line.startswith("pipe-0-cap4") and "stock" in line)
    assert "0.50  disagrees      1.00" in row


def test_cells_are_named_and_configured_in_the_engines_words():
    assert cell_name("PIPE=1 DIRECT=1", 4) == "pipe-1_direct-1-cap4"
    assert cell_env("URING=1", 12, "COLI_NO_OMP_TUNE=1") == "URING=1 CAP=12 CAP_RAISE=0 AUTOPIN=0 COLI_NO_OMP_TUNE=1"


def _engine(tmp_path: Path) -> Path:
    script = tmp_path / "engine.sh"
    script.write_text("#!/bin/sh\necho ran >> '%s'\n" % (tmp_path / "calls.txt"))
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


def _options(tmp_path: Path, **kw) -> EngineValidateOptions:
    c = tmp_path / "model"
    c.mkdir(exist_ok=True)
    (c / "out-00000.safetensors").write_bytes(b"\0" * 64)
    (tmp_path / "held.txt").write_text("one\ntwo\n")
    (tmp_path / "train.txt").write_text("three\nfour\n")
    base = dict(path=tmp_path / "v", engine=_engine(tmp_path), container=c, prompts=tmp_path / "held.txt",
                train_prompts=tmp_path / "train.txt")
    return EngineValidateOptions(**{**base, **kw})


@pytest.mark.parametrize("change, says", [
    ({"layouts": ("louvain", "stock")}, "must start with stock"),
    ({"layouts": ("stock",)}, "must start with stock"),
    ({"reps": 1}, "--reps must be at least 2"),
    ({"caps": (0,)}, "--caps"),
    ({"read_paths": ("PILOT_REAL=1 COUPLE=pairs.txt COUPLE_D=2",)}, "COUPLE_D=2"),
    ({"read_paths": ("PIPE=3",)}, "PIPE must be 0 or 1"),
])
def test_what_cannot_be_validated_is_refused_before_the_engine_runs(tmp_path, change, says):
    o = _options(tmp_path, **change)
    with pytest.raises(InputError, match=says):
        check_options(o)
    assert not (tmp_path / "calls.txt").exists() and not o.path.exists()


def test_the_engine_env_passes_variables_the_model_does_not_read_and_read_paths_stay_strict(tmp_path):
    """``--engine-env`` carries what the engine reads and the model does not (``DRAFT``): accepted,
    and a variable the model reads (``OMP_WAIT_POLICY``) is checked as the model reads it; a read
    path, which names a cell's read path in the model's terms, refuses a variable the model does
    not read."""
    prompts, train = check_options(_options(tmp_path, engine_env="COLI_NO_OMP_TUNE=1 OMP_WAIT_POLICY=PASSIVE DRAFT=0"))
    assert prompts and train
    check_options(_options(tmp_path, read_paths=("PIPE=1 OMP_WAIT_POLICY=PASSIVE",)))
    with pytest.raises(InputError, match="OMP_WAIT_POLICY"):
        check_options(_options(tmp_path, engine_env="OMP_WAIT_POLICY=lazy"))
    with pytest.raises(InputError, match="DRAFT"):
        check_options(_options(tmp_path, read_paths=("PIPE=1 DRAFT=0",)))


def test_a_cell_whose_runs_time_no_load_takes_the_other_cells_copy_rate():
    """URING=1 and DIRECT=1 cells measure no copy rate: they take the median of the cells that do
    with as many copies at once, and say so, never a COLI_MMAP=1 cell's re-touches; with none
    such, none is used (the device's rates)."""
    rates = cell_copy_rates({"pipe-0-cap4": (8e9, (2, False)), "pipe-1-cap4": (9e9, (1, False)),
                             "pipe-1-cap12": (10e9, (1, False)), "pipe-0_coli_mmap-1-cap4": (40e9, (2, True)),
                             "uring-1-cap4": (0.0, (1, False)), "pipe-0_direct-1-cap4": (0.0, (2, False)),
                             "uring-1-cap12": (0.0, (3, False))})
    assert rates["pipe-1-cap4"] == (9e9, "its stock runs")
    assert rates["uring-1-cap4"] == (9.5e9, "the median of cells pipe-1-cap4, pipe-1-cap12")
    assert rates["pipe-0_direct-1-cap4"] == (8e9, "the median of cells pipe-0-cap4")
    assert rates["uring-1-cap12"] == (0.0, "")


def test_measured_prompts_must_be_held_out(tmp_path):
    o = _options(tmp_path)
    (tmp_path / "held.txt").write_text("one\nfour\n")
    with pytest.raises(InputError, match="also training prompts"):
        check_options(o)


def test_emulation_options_with_engine_are_one_line_errors(tmp_path):
    o = _options(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    base = [sys.executable, "-m", "relayout", "validate", str(o.path), "--engine", str(o.engine), "--container",
            str(o.container), "--prompts", str(o.prompts), "--train-prompts", str(o.train_prompts)]
    for extra, says in ((["--gb", "2"], "--gb"), (["--keep"], "--keep")):
        res = subprocess.run(base + extra, capture_output=True, text=True, env=env)
        assert res.returncode == 2 and res.stderr.count("\n") == 1 and says in res.stderr, res.stderr
    res = subprocess.run([sys.executable, "-m", "relayout", "validate", str(o.path), "--prompts", str(o.prompts)],
                         capture_output=True, text=True, env=env)
    assert res.returncode == 2 and "--prompts belong to validate --engine" in res.stderr
    assert not o.path.exists() and not (tmp_path / "calls.txt").exists()


ENGINE = os.environ.get("RELAYOUT_COLIBRI_ENGINE")
FIXTURE = os.environ.get("RELAYOUT_COLIBRI_FIXTURE")


@pytest.mark.skipif(not (ENGINE and FIXTURE), reason="set RELAYOUT_COLIBRI_ENGINE (a colibrì binary) and "
                                                      "RELAYOUT_COLIBRI_FIXTURE (a model it runs, docs/ENGINE.md)")
def test_a_whole_validation_against_the_real_engine_resumes_and_counts_loads_as_the_engine(tmp_path):
    """Stock, its placement control and a random layout, one cell, 5 held-out prompts x 2: every
    run's expert loads as the model counts them equal the engine's; run again, every run is kept."""
    (tmp_path / "held.txt").write_text("".join(f"Held-out prompt number {i} about rivers.\n" for i in range(5)))
    (tmp_path / "train.txt").write_text("".join(f"Training prompt {i}: the history of bridges.\n" for i in range(4)))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    argv = [sys.executable, "-m", "relayout", "validate", str(tmp_path / "v"), "--engine", ENGINE, "--container", FIXTURE,
            "--prompts", str(tmp_path / "held.txt"), "--train-prompts", str(tmp_path / "train.txt"), "--layouts",
            "stock,random", "--read-paths", "PIPE=1", "--caps", "4", "--reps", "2", "--ngen", "6",
            "--engine-env", "COLI_NO_OMP_TUNE=1", "--device", "single-nvme"]
    res = subprocess.run(argv, capture_output=True, text=True, env=env)
    assert res.returncode in (0, 1), res.stderr
    rec = EngineValidationRecord.from_json(__import__("json").loads((tmp_path / "v" / "validation-engine.json").read_text()))
    assert len(rec.runs) == 3 * 5 * 2 and all(a.loads_agree for c in rec.cells for a in c.arms)
    assert rec.cells[0].savings[0].prompts == 5 and "verdict: the model" in res.stdout
    again = subprocess.run(argv, capture_output=True, text=True, env=env)      # resumes: every run kept
    assert again.returncode == res.returncode and again.stderr.count("kept (complete)") == 30 + 4


def test_a_cells_disk_probe_brackets_its_runs_and_is_kept_for_a_resumed_cell(tmp_path):
    """The probe reads the file before and after the cell's runs (real reads of a small file),
    writes both rates beside the runs, and a second pass over the same cell takes the kept rates
    instead of probing a disk whose runs are long over; a cell whose runs were all made before,
    unprobed, gets no probe at all."""
    from relayout.workflows.validation.engine import DISK_PROBE_NAME, probe_cell
    from replay.colibri.engine_output import RUN_FILE

    data = tmp_path / "f.bin"
    data.write_bytes(os.urandom(4 << 20))
    cell = tmp_path / "cell"
    cell.mkdir()
    order = []

    def one_run(name):
        def run():
            order.append(name)
            (cell / "stock" / name).mkdir(parents=True)
            (cell / "stock" / name / RUN_FILE).write_text("{}")
        return run

    rates = probe_cell(cell, (data, 1 << 20), one_run("p00-r00"))
    assert order == ["p00-r00"] and len(rates) == 2 and all(r > 0 for r in rates)
    kept = json.loads((cell / DISK_PROBE_NAME).read_text())
    assert kept["rates_Bps"] == rates and kept["read_bytes"] == 1 << 20
    assert probe_cell(cell, (data, 1 << 20), lambda: order.append("again")) == rates and order[-1] == "again"
    (cell / DISK_PROBE_NAME).unlink()                       # runs made earlier, never probed: no probe now
    assert probe_cell(cell, (data, 1 << 20), lambda: order.append("resumed")) == []
    assert not (cell / DISK_PROBE_NAME).exists()
    assert probe_cell(tmp_path / "none", (None, 0), lambda: order.append("unprobed")) == []


def test_a_cell_runs_the_router_pilot_whether_its_read_path_or_the_engine_env_sets_it(tmp_path):
    from relayout.workflows.validation.engine import _cell_precision, uses_pilot

    assert not uses_pilot(_options(tmp_path))
    assert uses_pilot(_options(tmp_path, read_paths=("PIPE=0 PILOT_REAL=1",)))
    assert uses_pilot(_options(tmp_path, engine_env="PILOT_REAL=1 DRAFT=4"))
    precisions = {False: 0.5, True: 0.7}
    assert _cell_precision("PIPE=0 PILOT_REAL=1 PILOT_TWO=1 CAP=4", precisions) == 0.7
    assert _cell_precision("PIPE=1 PILOT=1", precisions) == 0.5
    assert _cell_precision("PIPE=1 PILOT_REAL=0", precisions) is None
