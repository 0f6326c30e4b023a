"""The compiled model's cache follows every module of the model, not only the defining one, and
the build shipped with the package is of these sources and loads without compiling."""

import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

import replay
from replay.compiled import (
    CACHE_PREFIX,
    CPU_NAME,
    NO_PREBUILT,
    PREBUILT,
    STALE_SECONDS,
    PrebuiltBuild,
    compiled_cache_dir,
    install_prebuilt,
    model_cache_subdir,
    numba_version,
    python_tag,
    read_prebuilt,
    source_digest,
    write_prebuilt,
)

REBUILD = "python -m relayout.workflows.prebuild, then commit replay/prebuilt/model-build.tar.xz"


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


def test_the_shipped_build_is_of_these_sources():
    build = read_prebuilt()
    assert build.source_digest == source_digest(), f"replay/model/ changed since the shipped build was made: run {REBUILD}"
    assert build.codegen[1] == CPU_NAME and build.codegen[2] == ""
    assert "replay.model.instance.simulate_instances" in build.entries
    with tarfile.open(PREBUILT, "r:xz") as tar:
        assert sorted(tar.getnames()) == sorted(["build.json"] + [f"model/{f}" for f in build.files])
    for entry in build.entries:                                    # replay.model.<module>.<function>
        stem = entry.removeprefix("replay.model.")
        assert f"{stem}-" in " ".join(f for f in build.files if f.endswith(".nbi")), entry


def _fake_build(tmp_path: Path, digest: str, files=("instance.f-1.py311.nbi", "instance.f-1.py311.1.nbc")) -> Path:
    cache = tmp_path / "built"
    cache.mkdir()
    for i, name in enumerate(files):
        (cache / name).write_bytes(b"cache file %d" % i)
    archive = tmp_path / "build.tar.xz"
    write_prebuilt(archive, PrebuiltBuild(digest, numba_version(), python_tag(), ("t", CPU_NAME, ""),
                                          ("replay.model.instance.f",), tuple(files)), cache)
    return archive


def test_a_matching_build_is_unpacked_once_where_numba_looks_and_nothing_is_overwritten(tmp_path):
    archive = _fake_build(tmp_path, source_digest())
    here = tmp_path / "cache" / f"{CACHE_PREFIX}x"
    target = here / model_cache_subdir()
    target.mkdir(parents=True)
    (target / "instance.f-1.py311.nbi").write_bytes(b"numba's own")
    assert install_prebuilt(here, archive) == 1
    assert (target / "instance.f-1.py311.1.nbc").read_bytes() == b"cache file 1"
    assert (target / "instance.f-1.py311.nbi").read_bytes() == b"numba's own"
    marker = json.loads((here / f"prebuilt-{numba_version()}-{python_tag()}.json").read_text())
    assert marker["installed"] and marker["files_written"] == 1
    (target / "instance.f-1.py311.1.nbc").unlink()
    assert install_prebuilt(here, archive) == 0                     # once: the marker says it was done
    assert not (target / "instance.f-1.py311.1.nbc").exists()
    assert not list(target.glob("*.partial")) and not list(here.glob("*.partial"))


def test_a_build_of_other_sources_is_not_unpacked_and_says_why(tmp_path):
    archive = _fake_build(tmp_path, "0123456789abcdef")
    here = tmp_path / "cache"
    here.mkdir()
    assert install_prebuilt(here, archive) == 0
    assert [p.name for p in here.iterdir()] == [f"prebuilt-{numba_version()}-{python_tag()}.json"]
    marker = json.loads(next(here.iterdir()).read_text())
    assert not marker["installed"] and "other model sources" in marker["why_not"]


def test_an_archive_naming_a_file_outside_the_cache_is_refused(tmp_path):
    record = {"source_digest": source_digest(), "numba": numba_version(), "python": python_tag(),
              "codegen": ["t", CPU_NAME, ""], "entries": ["replay.model.instance.f"], "files": ["../../escaped.nbi"]}
    archive = tmp_path / "evil.tar.xz"
    with tarfile.open(archive, "w:xz") as tar:
        for name, data in (("build.json", json.dumps(record).encode()), ("model/../../escaped.nbi", b"x")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    with pytest.raises(ValueError, match="not a numba cache file"):
        read_prebuilt(archive)
    here = tmp_path / "a" / "b" / "cache"
    here.mkdir(parents=True)
    assert install_prebuilt(here, archive) == 0
    assert not list(tmp_path.rglob("escaped.nbi"))
    (tmp_path / "junk.tar.xz").write_bytes(b"not an archive")
    with pytest.raises(ValueError, match="not a prebuilt model build"):
        read_prebuilt(tmp_path / "junk.tar.xz")


CHILD = """
import sys
import numpy as np
from numba.core import event
from containers.geometry import load_geometry
from relayout.planning.plan import source_from_geometry
from relayout.traces.synth import synth_trace
from replay.model.config import RuntimeConfig
from replay.model.device import load_device
from replay.model.engine import simulate

compiled = []
class Top(event.Listener):
    depth = 0
    def on_start(self, ev):
        if Top.depth == 0:
            compiled.append(ev.data["dispatcher"].py_func.__qualname__)
        Top.depth += 1
    def on_end(self, ev):
        Top.depth -= 1
event.register("numba:compile", Top())
g = load_geometry("glm-5.2-int4-g64").scaled(moe_layers=2, experts=16)
src = source_from_geometry(g)
tr = synth_trace(g.moe_layers, g.n_routed_experts, g.num_experts_per_tok, 40, 2, 0)
for cfg in (RuntimeConfig(workers=8), RuntimeConfig(workers=1, coalesce=True)):
    simulate(tr, np.ones(tr.n_forwards, bool), src.stock, load_device("linux-md-raid0-4x"), cfg)
print(",".join(compiled))
"""


def test_the_model_loads_from_the_shipped_build_without_compiling(tmp_path):
    build = read_prebuilt()
    if build.mismatch():
        pytest.skip(f"the shipped build does not fit this environment: {build.mismatch()}")
    env = {k: v for k, v in os.environ.items() if k not in (NO_PREBUILT, "NUMBA_CPU_NAME", "NUMBA_CPU_FEATURES")}
    env.update(NUMBA_CACHE_DIR=str(tmp_path), PYTHONPATH=str(Path(replay.__file__).parents[1]))
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "", f"compiled although a matching build ships: {out.stdout.strip()}"
    assert "compiling the replay model" not in out.stderr
