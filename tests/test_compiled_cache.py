"""The compiled model's cache follows every module of the model, not only the defining one."""

import os
import shutil
import time
from pathlib import Path

import replay
from replay.compiled import CACHE_PREFIX, STALE_SECONDS, compiled_cache_dir, source_digest


def _copy_of_replay(tmp_path: Path) -> Path:
    pkg = tmp_path / "replay"
    shutil.copytree(Path(replay.__file__).parent, pkg, ignore=shutil.ignore_patterns("__pycache__"))
    return pkg


def test_editing_any_module_of_the_model_changes_the_cache_directory(tmp_path):
    pkg = _copy_of_replay(tmp_path)
    before = source_digest(pkg / "model")
    assert before == source_digest()
    (pkg / "model" / "device.py").write_text((pkg / "model" / "device.py").read_text() + "\n# an edit the loop inlines\n")
    assert source_digest(pkg / "model") != before


def test_a_new_module_deeper_in_the_model_changes_the_cache_directory(tmp_path):
    pkg = _copy_of_replay(tmp_path)
    before = source_digest(pkg / "model")
    (pkg / "model" / "kernels").mkdir()
    (pkg / "model" / "kernels" / "extra.py").write_text("X = 1\n")
    assert source_digest(pkg / "model") != before


def test_a_docstring_edit_outside_the_model_keeps_the_compiled_build(tmp_path):
    """Editing the gate, the hypotheses or a file format leaves the digest, and so the cached
    build, as it was."""
    pkg = _copy_of_replay(tmp_path)
    before = source_digest(pkg / "model")
    for rel in ("evaluation/hypotheses.py", "evaluation/gate.py", "formats/trace.py", "__init__.py"):
        f = pkg / rel
        f.write_text('"""An edited docstring."""\n' + f.read_text())
    assert source_digest(pkg / "model") == before


def test_the_cache_lives_under_the_users_cache_and_stale_builds_go(tmp_path, monkeypatch):
    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    root = tmp_path / "relayout"
    stale, recent = root / f"{CACHE_PREFIX}0000", root / f"{CACHE_PREFIX}1111"
    for d in (stale, recent):
        d.mkdir(parents=True)
    old = time.time() - STALE_SECONDS - 60
    os.utime(stale, (old, old))
    here = compiled_cache_dir()
    assert here == root / f"{CACHE_PREFIX}{source_digest()}" and here.is_dir()
    assert not stale.exists() and recent.exists()         # another version in use today is left alone
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(here))       # a child process of ours inherits the directory
    assert compiled_cache_dir() == here
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "mine"))
    assert compiled_cache_dir() == tmp_path / "mine" / "relayout" / f"{CACHE_PREFIX}{source_digest()}"


def test_an_uncreatable_cache_leaves_numba_its_default(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    assert compiled_cache_dir() is None
