"""The command line: demo runs end to end; bad input is one line and exit 2."""

from conftest import run_cli


def test_demo_runs(tmp_path):
    res = run_cli("demo", "--dir", tmp_path / "demo")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "re-check: 0 mismatches" in res.stdout
    assert "1 worker, coalescing reads" in res.stdout and "-> PASS" in res.stdout
    assert (tmp_path / "demo" / "gate.json").exists() and (tmp_path / "demo" / "plan.json").exists()
    assert "verify --full: 0 problems" in res.stdout and "measured S: stock" in res.stdout and (tmp_path / "demo" / "relaid" / "relayout.manifest.json").exists()


def test_unknown_geometry_is_one_line(tmp_path):
    res = run_cli("synth", "container", tmp_path / "x", "--geometry", "nope")
    assert res.returncode == 2 and "unknown geometry" in res.stderr and res.stderr.count("\n") == 1
    assert not (tmp_path / "x").exists()


def test_synth_refuses_existing_output(small_container):
    res = run_cli("synth", "container", small_container, "--geometry", "glm-5.2-int4-row")
    assert res.returncode == 2 and "already exists" in res.stderr


def test_manifest_of_missing_dir(tmp_path):
    res = run_cli("manifest", tmp_path / "nope")
    assert res.returncode == 2 and "not a directory" in res.stderr and "Traceback" not in res.stderr
