"""The compiled model's cache follows every module of the model, not only the defining one."""

import os
import shutil
import time
from pathlib import Path

import replay
from replay import CACHE_PREFIX, STALE_SECONDS, compiled_cache_dir, source_digest


def test_editing_any_module_of_the_model_changes_the_cache_directory(tmp_path):
    pkg = tmp_path / "replay"
    shutil.copytree(Path(replay.__file__).parent, pkg, ignore=shutil.ignore_patterns("__pycache__"))
    before = source_digest(pkg)
    assert before == source_digest(Path(replay.__file__).parent)
    (pkg / "device.py").write_text((pkg / "device.py").read_text() + "\n# an edit of a module the loop inlines\n")
    assert source_digest(pkg) != before


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
