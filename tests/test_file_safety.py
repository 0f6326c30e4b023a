"""Nothing written but what was asked: no link followed, no device or FIFO replaced, temp names
unguessable; work directories remove exactly what they recorded making; calibration's test file
never outlives it. Every case is built in a temporary directory; nothing depends on timing."""

import json
import os
import signal
import stat
import subprocess
import sys

import pytest
from conftest import REPO, cli

from containers.atomic import TEMP_NAME, atomic_output, temp_name, write_json_atomic
from containers.errors import InputError
from relayout.workflows.workdir import WorkDir


def _victim(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    return victim


def test_a_symlink_at_the_target_is_refused_and_not_followed(tmp_path):
    victim = _victim(tmp_path)
    out = tmp_path / "plan.json"
    out.symlink_to(victim)
    with pytest.raises(InputError, match="symbolic link"):
        write_json_atomic(out, {"a": 1})
    assert victim.read_text() == "precious\n" and out.is_symlink()
    assert [p.name for p in tmp_path.iterdir() if TEMP_NAME.match(p.name)] == []


def test_symlinks_planted_at_predictable_temp_names_are_never_followed(tmp_path):
    victim = _victim(tmp_path)
    out = tmp_path / "gate.json"
    for guess in (f".gate.json.tmp-{os.getpid()}", f".gate.json.tmp-{os.getpid() + 1}", ".gate.json.tmp"):
        (tmp_path / guess).symlink_to(victim)
    write_json_atomic(out, {"verdict": "pass"})
    assert json.loads(out.read_text()) == {"verdict": "pass"} and not out.is_symlink()
    assert victim.read_text() == "precious\n"
    names = {temp_name("gate.json") for _ in range(50)}
    assert len(names) == 50 and all(TEMP_NAME.match(n) for n in names)


def test_a_fifo_target_is_refused_without_opening_it(tmp_path):
    fifo = tmp_path / "out.json"
    os.mkfifo(fifo)
    with pytest.raises(InputError, match="FIFO"):    # opening it for writing would block: it is never opened
        write_json_atomic(fifo, {"a": 1})
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


def test_a_directory_target_and_a_missing_directory_are_one_line_errors(tmp_path):
    (tmp_path / "d").mkdir()
    with pytest.raises(InputError, match="a directory"):
        write_json_atomic(tmp_path / "d", {})
    with pytest.raises(InputError, match="not a directory"):
        write_json_atomic(tmp_path / "nowhere" / "x.json", {})


def _mknod(path, like):
    try:
        os.mknod(path, stat.S_IFCHR | 0o666, os.stat(like).st_rdev)
    except (PermissionError, OSError) as exc:
        pytest.skip(f"cannot create a device node here ({exc})")


def test_a_null_device_is_written_to_never_replaced(tmp_path):
    dev = tmp_path / "null"
    _mknod(dev, os.devnull)
    rdev = os.lstat(dev).st_rdev
    with atomic_output(dev) as fh:
        fh.write(b"x" * 100_000)
    st = os.lstat(dev)
    assert stat.S_ISCHR(st.st_mode) and st.st_rdev == rdev
    assert [p.name for p in tmp_path.iterdir()] == ["null"]


def test_another_character_device_is_refused(tmp_path):
    if not os.path.exists("/dev/zero"):
        pytest.skip("no /dev/zero")
    dev = tmp_path / "zero"
    _mknod(dev, "/dev/zero")
    with pytest.raises(InputError, match="character device"):
        write_json_atomic(dev, {})
    assert stat.S_ISCHR(os.lstat(dev).st_mode)


def test_cli_output_onto_a_symlink_or_fifo_is_one_line_exit_2(tmp_path):
    victim = _victim(tmp_path)
    link = tmp_path / "t.rt"
    link.symlink_to(victim)
    fifo = tmp_path / "f.rt"
    os.mkfifo(fifo)
    for out in (link, fifo):
        res = cli("synth", "trace", out, "--geometry", "glm-5.2-int4-g64", "--moe-layers", 2, "--experts", 16,
                  "--tokens", 50, "--sessions", 2)
        assert res.returncode == 2 and res.stderr.count("\n") == 1 and str(out) in res.stderr, res.stderr
    assert victim.read_text() == "precious\n" and link.is_symlink() and stat.S_ISFIFO(os.lstat(fifo).st_mode)


def test_cli_output_to_dev_null_leaves_it_a_device():
    st = os.lstat(os.devnull)
    res = cli("synth", "trace", os.devnull, "--geometry", "glm-5.2-int4-g64", "--moe-layers", 2, "--experts", 16,
              "--tokens", 50, "--sessions", 2)
    assert res.returncode == 0, res.stderr
    after = os.lstat(os.devnull)
    assert stat.S_ISCHR(after.st_mode) and after.st_rdev == st.st_rdev and after.st_ino == st.st_ino


# ---------------------------------------------------------------------- work directories
def _made(work):
    (work.claim("out.json")).write_text("{}")
    sub = work.claim("layout-x", "layout-x.partial")
    sub.mkdir()
    (sub / "a.safetensors").write_bytes(b"abc")
    work.seal()


def test_a_work_dir_removes_exactly_what_it_recorded(tmp_path):
    root = tmp_path / "relayout-validate"
    work = WorkDir.open(root, ".relayout-validate", "validate")
    _made(work)
    assert work.remove() == [] and not root.exists()


def test_a_users_file_added_to_a_kept_work_dir_survives_and_is_named(tmp_path):
    root = tmp_path / "relayout-validate"
    work = WorkDir.open(root, ".relayout-validate", "validate")
    _made(work)                                        # a kept (--keep) run ends here
    (root / "notes.txt").write_text("mine")
    (root / "layout-x" / "my_weights.safetensors").write_text("mine too")
    again = WorkDir.open(root, ".relayout-validate", "validate")
    with pytest.raises(InputError, match="my_weights"):  # its output directory holds a file it did not make
        again.claim("layout-x")
    kept = again.remove()
    assert (root / "notes.txt").read_text() == "mine" and (root / "layout-x" / "my_weights.safetensors").read_text() == "mine too"
    assert not (root / "out.json").exists() and not (root / "layout-x" / "a.safetensors").exists()
    assert len(kept) == 1 and "notes.txt" in kept[0] and "my_weights" in kept[0] and "did not make" in kept[0]


def test_a_recorded_file_replaced_by_the_user_is_kept(tmp_path):
    root = tmp_path / "w"
    work = WorkDir.open(root, ".relayout-demo", "demo")
    _made(work)
    (root / "out.json").unlink()
    (root / "out.json").write_text("the user's own")      # same name, another inode
    kept = WorkDir.open(root, ".relayout-demo", "demo").remove()
    assert (root / "out.json").read_text() == "the user's own" and kept and "out.json" in kept[0]


def test_a_marker_is_never_written_or_read_through_a_symlink(tmp_path):
    victim = _victim(tmp_path)
    root = tmp_path / "w"
    root.mkdir()
    (root / ".relayout-demo").symlink_to(victim)
    with pytest.raises(InputError, match="symlink"):
        WorkDir.open(root, ".relayout-demo", "demo")
    assert victim.read_text() == "precious\n"


def test_a_foreign_directory_and_an_old_marker_remove_nothing(tmp_path):
    root = tmp_path / "w"
    root.mkdir()
    (root / "my_weights.safetensors").write_text("mine")
    with pytest.raises(InputError, match="not empty"):
        WorkDir.open(root, ".relayout-demo", "demo")
    (root / ".relayout-demo").write_text("made by relayout demo: an older marker that records nothing\n")
    work = WorkDir.open(root, ".relayout-demo", "demo")
    with pytest.raises(InputError, match="not made by relayout"):
        work.claim("my_weights.safetensors")
    assert work.remove() and (root / "my_weights.safetensors").read_text() == "mine"


def test_a_run_stopped_by_an_exception_still_removes_what_it_claimed(tmp_path):
    root = tmp_path / "w"
    work = WorkDir.open(root, ".relayout-demo", "demo")
    try:
        sub = work.claim("relaid", "relaid.partial")
        (sub.with_name("relaid.partial")).mkdir()
        (sub.with_name("relaid.partial") / "x").write_bytes(b"1")
        raise KeyboardInterrupt
    except KeyboardInterrupt:
        assert work.remove() == []
    assert not root.exists()


# ---------------------------------------------------------------------- calibration
def test_ctrl_c_in_calibrate_removes_its_test_file(tmp_path):
    """SIGINT once the test file exists (seen on disk, no timing): exit 130, one line, no file left."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-m", "relayout", "calibrate", str(tmp_path), "--size-mb", "64",
                             "-o", str(tmp_path / "p.json")], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        while proc.poll() is None and not [p for p in tmp_path.iterdir() if p.name.startswith(".relayout-calibrate")]:
            os.sched_yield()
        made = [p.name for p in tmp_path.iterdir() if p.name.startswith(".relayout-calibrate")]
        assert made and all(TEMP_NAME.match(n) for n in made), made
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130 and err.count("\n") == 1, err
    assert list(tmp_path.iterdir()) == []


def test_synth_clears_only_an_interrupted_synths_own_files(tmp_path):
    from conftest import small_geometry

    from containers.synth import SYNTH_MARKER, synth_container

    partial = tmp_path / "c.partial"
    partial.mkdir()
    (partial / SYNTH_MARKER).write_bytes(b"")
    (partial / "out-00001.safetensors").write_bytes(b"half")
    (partial / "my_notes.txt").write_text("mine")
    with pytest.raises(InputError, match="my_notes.txt"):
        synth_container(tmp_path / "c", small_geometry(moe_layers=1, experts=8), progress=False)
    assert (partial / "my_notes.txt").read_text() == "mine" and (partial / "out-00001.safetensors").exists()
    (partial / "my_notes.txt").unlink()
    synth_container(tmp_path / "c", small_geometry(moe_layers=1, experts=8), progress=False)
    assert not partial.exists() and (tmp_path / "c" / "config.json").is_file()
