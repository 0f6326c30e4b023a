"""``relayout measure --engine``: the run schedule, crash safety and resumption, and (by hand, with
``RELAYOUT_COLIBRI_ENGINE`` naming a colibrì binary and ``RELAYOUT_COLIBRI_FIXTURE`` a model it
runs, e.g. the storage-bound fixture of docs/ENGINE.md) the real engine."""

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, cli

from containers.errors import InputError
from relayout.workflows.engine_runs import EngineArm, measure_engine, schedule
from replay.colibri.engine_config import env_words, parse_runtime_env
from replay.colibri.engine_metrics import engine_compare, engine_report
from replay.colibri.engine_output import RUN_FILE, read_runs

RECORDED = sorted(p for p in (REPO / "tests" / "data" / "engine" / "stock-louvain" / "baseline").iterdir() if p.is_dir())[0]


def _stand_in_engine(tmp_path: Path, exit_code: int = 0) -> Path:
    """An executable that prints a recorded real run's stdout and stderr, writes ROUTE_TRACE and
    logs the environment it was given (a stand-in for the external binary, not for relayout's I/O)."""
    script = tmp_path / "engine.sh"
    script.write_text(
        "#!/bin/sh\n"
        f"cat '{RECORDED / 'stdout.txt'}'\n"
        f"cat '{RECORDED / 'stderr.txt'}' >&2\n"
        f"cp '{RECORDED / 'route-trace.txt'}' \"$ROUTE_TRACE\"\n"
        f"echo \"$SNAP|$PROMPT|$PIPE|$TEMP|$PROF|$TOKENS|$NGEN\" >> '{tmp_path / 'calls.txt'}'\n"
        f"exit {exit_code}\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


def _container(path: Path) -> Path:
    path.mkdir()
    (path / "out-00000.safetensors").write_bytes(b"\0" * 4096)
    return path


def test_repetitions_interleave_the_arms_and_alternate_their_order():
    a, b = EngineArm("baseline", Path("a")), EngineArm("container", Path("b"))
    s = schedule([a, b], 2, 2)
    assert [(x.name, p, r) for x, p, r in s] == [
        ("baseline", 0, 0), ("container", 0, 0), ("baseline", 1, 0), ("container", 1, 0),
        ("container", 0, 1), ("baseline", 0, 1), ("container", 1, 1), ("baseline", 1, 1)]


def test_runtime_env_is_the_engines_own_words():
    run = lambda text: env_words(text, strict=False)          # noqa: E731  (measure --engine's reading)
    assert run("PIPE=1 DIRECT=1 RAM_GB=128") == {"PIPE": "1", "DIRECT": "1", "RAM_GB": "128"}
    assert run("") == {} and run(None) == {}
    assert run("DRAFT=4 'PROMPT=a b'") == {"DRAFT": "4", "PROMPT": "a b"}     # variables the model does not read: kept
    for bad in ("PIPE", "1X=2", "=1"):
        with pytest.raises(InputError, match="NAME=value"):
            run(bad)
    with pytest.raises(InputError, match="split"):
        run("PROMPT='unbalanced")


def test_running_and_modelling_read_the_engines_variables_by_the_same_rules():
    """The environment a run is given and the configuration the model takes: one parser, the
    same verdict on every variable both read; only a variable the model does not know differs."""
    for bad, word in [("PIPE=2", "PIPE"), ("PIPE_WORKERS=0", "PIPE_WORKERS"), ("RAM_GB=lots", "RAM_GB"),
                      ("PIN=", "PIN"), ("DIRECT=1 DIRECT=0", "DIRECT")]:
        for parse in (lambda t: env_words(t, strict=False), parse_runtime_env):
            with pytest.raises(InputError, match=word):
                parse(bad)
    assert env_words("PIPE=1 PIN_GB=all CAP=4", strict=False) == {"PIPE": "1", "PIN_GB": "all", "CAP": "4"}
    assert parse_runtime_env("PIPE=1 PIN_GB=all CAP=4").PIN_GB == -1.0
    assert env_words("MTP=1", strict=False) == {"MTP": "1"}
    with pytest.raises(InputError, match="unknown variable MTP"):
        parse_runtime_env("MTP=1")


def test_runs_are_kept_per_arm_prompt_and_repetition_and_resumed(tmp_path):
    engine = _stand_in_engine(tmp_path)
    stock, relaid = _container(tmp_path / "stock"), _container(tmp_path / "relaid")
    arms = [EngineArm("baseline", stock), EngineArm("container", relaid)]
    out = tmp_path / "runs"
    lines = []
    dirs = measure_engine(engine, arms, ["first prompt", "second"], 2, {"PIPE": "1"}, 5, out, progress=lines.append)
    assert len(dirs) == 8 and all((d / RUN_FILE).is_file() for d in dirs)
    calls = (tmp_path / "calls.txt").read_text().splitlines()
    assert calls[0] == f"{stock}|first prompt|1|0|1|1|5" and calls[1].startswith(f"{relaid}|first prompt|1|")
    ident = json.loads((out / "container" / "p01-r01" / RUN_FILE).read_text())
    assert ident["env"]["PIPE"] == "1" and ident["prompt"] == 1 and ident["repetition"] == 1
    assert ident["cold"].startswith(("cold", "warm")) and ident["returncode"] == 0
    assert (out / "container" / "p01-r01" / "route-trace.txt").stat().st_size > 0
    assert not list(out.glob("*/.*partial"))
    # a run cut short leaves a partial directory, never a complete-looking one; the next call redoes it
    (out / "baseline" / "p00-r01").rename(out / "baseline" / ".p00-r01.partial")
    (out / "baseline" / ".p00-r01.partial" / RUN_FILE).unlink()
    lines.clear()
    measure_engine(engine, arms, ["first prompt", "second"], 2, {"PIPE": "1"}, 5, out, progress=lines.append)
    assert sum("kept" in x for x in lines) == 7 and len((tmp_path / "calls.txt").read_text().splitlines()) == 9
    assert (out / "baseline" / "p00-r01" / RUN_FILE).is_file()
    c = engine_compare([out / "baseline", out / "container"])
    assert c["comparisons"][0]["pairs"] == 4 and c["correctness_failures"] == []


def test_the_openmp_variables_a_run_inherits_are_recorded_with_it(tmp_path, monkeypatch):
    """An OMP_WAIT_POLICY exported in the shell changes how the engine's team waits: the run's
    record keeps it (the model reads it back), and a variable the run sets itself wins."""
    from replay.colibri.engine_config import config_from_run

    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.setenv("GOMP_SPINCOUNT", "1000")
    monkeypatch.setenv("UNRELATED_SHELL_VARIABLE", "x")
    engine = _stand_in_engine(tmp_path)
    out = tmp_path / "runs"
    dirs = measure_engine(engine, [EngineArm("baseline", _container(tmp_path / "stock"))], ["p"], 1,
                          {"PIPE": "1", "GOMP_SPINCOUNT": "0"}, 5, out)
    env = json.loads((dirs[0] / RUN_FILE).read_text())["env"]
    assert env["OMP_WAIT_POLICY"] == "PASSIVE" and env["GOMP_SPINCOUNT"] == "0" and "UNRELATED_SHELL_VARIABLE" not in env
    cfg, _ = config_from_run(dirs[0])
    assert (cfg.OMP_WAIT_POLICY, cfg.GOMP_SPINCOUNT) == ("PASSIVE", "0")


def test_a_partial_directory_holding_foreign_files_is_left_alone(tmp_path):
    engine = _stand_in_engine(tmp_path)
    arms = [EngineArm("container", _container(tmp_path / "c"))]
    partial = tmp_path / "runs" / "container" / ".p00-r00.partial"
    partial.mkdir(parents=True)
    (partial / "mine.txt").write_text("not relayout's")
    with pytest.raises(InputError, match="did not write"):
        measure_engine(engine, arms, ["p"], 1, {}, 4, tmp_path / "runs", progress=lambda s: None)
    assert (partial / "mine.txt").read_text() == "not relayout's"


def test_a_failing_engine_is_recorded_and_reported(tmp_path):
    engine = _stand_in_engine(tmp_path, exit_code=3)
    arms = [EngineArm("container", _container(tmp_path / "c"))]
    measure_engine(engine, arms, ["p"], 1, {}, 4, tmp_path / "runs", progress=lambda s: None)
    r = engine_report([tmp_path / "runs" / "container"])["arms"][0]
    assert r["failed_runs"] and r["failed_runs"][0].endswith("p00-r00")


def test_bad_inputs_are_one_line_errors(tmp_path):
    c = _container(tmp_path / "c")
    res = cli("measure", "--engine", tmp_path / "nope", "--container", c, "--prompts", tmp_path / "p.txt", "-o", tmp_path / "o")
    assert res.returncode == 2 and res.stderr.count("\n") == 1
    res = cli("measure", "--container", c)
    assert res.returncode == 2 and "--trace" in res.stderr and "--engine" in res.stderr
    engine = _stand_in_engine(tmp_path)
    (tmp_path / "p.txt").write_text("a prompt\n")
    for bad, says in (("PIPE=2", "PIPE must be 0 or 1"), ("PROMPT='unbalanced", "cannot split")):
        res = cli("measure", "--engine", engine, "--container", c, "--prompts", tmp_path / "p.txt", "-o", tmp_path / "o",
                  "--runtime-env", bad)
        assert res.returncode == 2 and res.stderr.count("\n") == 1 and says in res.stderr, res.stderr
        assert not (tmp_path / "o").exists() and not (tmp_path / "calls.txt").exists()     # nothing run


ENGINE = os.environ.get("RELAYOUT_COLIBRI_ENGINE")
FIXTURE = os.environ.get("RELAYOUT_COLIBRI_FIXTURE")


@pytest.mark.skipif(not (ENGINE and FIXTURE), reason="set RELAYOUT_COLIBRI_ENGINE (a colibrì binary) and "
                                                      "RELAYOUT_COLIBRI_FIXTURE (a model it runs, docs/ENGINE.md)")
def test_the_real_engine_measured_cold_twice_agrees_with_itself(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The quick brown fox.\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    res = subprocess.run([sys.executable, "-m", "relayout", "measure", "--engine", ENGINE, "--container", FIXTURE,
                          "--baseline", FIXTURE, "--prompts", str(prompts), "--reps", "1", "--ngen", "4",
                          "--runtime-env", "CAP=2 CAP_RAISE=0 AUTOPIN=0 COLI_NO_OMP_TUNE=1", "-o", str(tmp_path / "runs")],
                         capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stderr
    base, new = read_runs(tmp_path / "runs" / "baseline"), read_runs(tmp_path / "runs" / "container")
    assert base[0].output.output_tokens == new[0].output.output_tokens and len(new[0].output.output_tokens) == 4
    for run in base + new:
        o = run.output
        assert o.cap == 2 and o.config["PIPE"] == "0" and o.decode.wait_s >= 0
        assert o.expert_io.loads > 0 and Path(run.route_trace).stat().st_size > 0
        assert run.identity.cold.startswith("cold")
    assert "S (expert wait per committed token)" in res.stdout


def test_each_arm_gets_its_own_variables_and_its_split_directories_are_dropped_cold(tmp_path, monkeypatch):
    """A split layout per arm (``--baseline-env`` / ``--container-env``): the engine gets the arm's
    ``COLI_MODEL_DIRS`` over the common variables, with absolute paths though the command was given
    relative ones (the engine runs in the run's directory), and every arm's shards, its split
    directories' with its container's, are evicted before each run."""
    from replay.physical import measure

    script = tmp_path / "engine.sh"
    script.write_text("#!/bin/sh\n"
                      f"cat '{RECORDED / 'stdout.txt'}'\ncat '{RECORDED / 'stderr.txt'}' >&2\n"
                      f"cp '{RECORDED / 'route-trace.txt'}' \"$ROUTE_TRACE\"\n"
                      f"echo \"$SNAP|$COLI_MODEL_DIRS|$CAP\" >> '{tmp_path / 'calls.txt'}'\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    even, planned = _container(tmp_path / "even"), _container(tmp_path / "planned")
    slow_even, slow_planned = _container(tmp_path / "slow-even"), _container(tmp_path / "slow-planned")
    dropped = []
    real_drop = measure.drop_cache
    monkeypatch.setattr(measure, "drop_cache", lambda files: dropped.append(set(files)) or real_drop(files))
    monkeypatch.chdir(tmp_path)
    arms = [EngineArm("baseline", Path("even"), {"COLI_MODEL_DIRS": str(slow_even)}),
            EngineArm("container", Path("planned"), {"COLI_MODEL_DIRS": f" {slow_planned} ;", "CAP": "8"})]
    measure_engine(Path("engine.sh"), arms, ["p"], 1, {"CAP": "4"}, 3, "runs", progress=lambda _: None)
    calls = (tmp_path / "calls.txt").read_text().splitlines()
    assert calls == [f"{even}|{slow_even}|4", f"{planned}| {slow_planned} ;|8"]
    every = {d / "out-00000.safetensors" for d in (even, slow_even, planned, slow_planned)}
    assert dropped == [every, every]
    assert json.loads((tmp_path / "runs" / "container" / "p00-r00" / RUN_FILE).read_text())["env"]["COLI_MODEL_DIRS"] == f" {slow_planned} ;"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore on files is Linux's")
def test_every_arms_pages_are_evicted_before_each_run(tmp_path):
    """Under a memory limit the pages of the arm run before would keep part of the page cache
    from the next run: each run starts with no container's pages cached, not only its own. The
    stand-in engine reads its container whole, so after two runs the second arm's file is
    cached and the first's, read by the first run, is not; each run's reads from the drive are
    counted in its record."""
    from conftest import page_cache_evicts

    from replay.physical.residency import open_residency

    script = tmp_path / "engine.sh"
    script.write_text("#!/bin/sh\ncat \"$SNAP\"/*.safetensors > /dev/null\n"
                      f"cat '{RECORDED / 'stdout.txt'}'\ncat '{RECORDED / 'stderr.txt'}' >&2\n"
                      f"cp '{RECORDED / 'route-trace.txt'}' \"$ROUTE_TRACE\"\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    arms = []
    for name in ("baseline", "container"):
        d = tmp_path / name
        d.mkdir()
        (d / "out-00000.safetensors").write_bytes(os.urandom(64 * 4096))
        arms.append(EngineArm(name, d))
    first = arms[0].container / "out-00000.safetensors"
    if not page_cache_evicts(first):
        pytest.skip("this file system keeps its pages in memory")
    dirs = measure_engine(script, arms, ["p"], 1, {}, 3, tmp_path / "runs", progress=lambda _: None)
    for d in dirs:                           # each read its evicted container from the drive, and it was counted
        assert json.loads((d / RUN_FILE).read_text())["drive_read_bytes"] >= 64 * 4096
    arm = engine_report([tmp_path / "runs" / "baseline"])["arms"][0]
    assert arm["drive_read_bytes_per_token"] * arm["committed_tokens"] >= 64 * 4096
    files = [a.container / "out-00000.safetensors" for a in arms]
    fds = [os.open(f, os.O_RDONLY) for f in files]
    try:
        res = open_residency(fds, files)
        assert res[1].cached(0, 64 * 4096) and res[0].cached_run(0, 64 * 4096) == 0
    finally:
        for fd in fds:
            os.close(fd)
