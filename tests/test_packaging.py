"""relayout installed as a user installs it (a wheel, ``pip install -e .``) finds its shipped data.

Each test installs the project into a fresh venv and runs the ``relayout`` script from a folder
outside the repository with no PYTHONPATH, so nothing can come from the checkout by accident.
The venv sees the running environment's packages (numpy, numba, ... are not reinstalled) through
a folder of links that leaves out any relayout already installed there: a venv made with
``--system-site-packages`` would import such a copy ahead of an editable install, whose import
hook runs after the ordinary path search. Installs are ``--no-deps``, and ``--no-build-isolation``
where the running environment can build the wheel itself (setuptools >= 70.1, or >= 68 with
``wheel``); otherwise pip builds in isolation and fetches setuptools from the package index.
"""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from conftest import REPO

pytestmark = pytest.mark.slow

OURS = {"relayout", "replay", "containers", "manifests"}
COPY_IGNORE = shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache",
                                     ".hypothesis", ".benchmarks", "out", "*.nbi", "*.nbc")


def _version(dist: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in metadata.version(dist).split(".")[:2] if x.isdigit())
    except metadata.PackageNotFoundError:
        return ()


def _build_flags() -> list[str]:
    st = _version("setuptools")
    offline = st >= (70, 1) or (st >= (68, 0) and _version("wheel") != ())
    return ["--no-deps"] + (["--no-build-isolation"] if offline else [])


def _run(cmd, cwd, env=None, timeout=300) -> subprocess.CompletedProcess:
    res = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, f"{' '.join(map(str, cmd))} exited {res.returncode}\n{res.stdout}\n{res.stderr}"
    return res


@pytest.fixture(scope="module")
def deps(tmp_path_factory) -> Path:
    """A folder linking every entry of the running environment's site-packages except relayout's own."""
    out = tmp_path_factory.mktemp("deps")
    dirs = [*site.getsitepackages(), site.getusersitepackages()]
    for d in map(Path, dict.fromkeys(dirs)):
        if not d.is_dir():
            continue
        for entry in d.iterdir():
            name = entry.name
            stem = name.split("-")[0].split(".")[0]
            if stem in OURS or stem.replace("_", "-") in {"__editable__", "relayout"} or name.endswith(".pth") \
                    or name.startswith("__editable__") or (out / name).exists():
                continue
            (out / name).symlink_to(entry)
    return out


@pytest.fixture
def source(tmp_path) -> Path:
    """A copy of the working tree, so that building writes nothing into the checkout."""
    dst = tmp_path / "src"
    shutil.copytree(REPO, dst, ignore=COPY_IGNORE, symlinks=True)
    return dst


def _venv(root: Path, deps: Path) -> Path:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", root], check=True, capture_output=True)
    py = root / "bin" / "python"
    purelib = _run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], root).stdout.strip()
    Path(purelib, "_relayout_test_deps.pth").write_text(f"{deps}\n")
    return py


def _clean_env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def _check_installed(py: Path, where: Path, work: Path) -> None:
    """relayout, its data package and its shipped data come from ``where``; the script works."""
    env = _clean_env()
    probe = ("import relayout, replay, containers, manifests; "
             "from containers.jsonfile import shipped_dir, shipped_names; "
             "print(*(m.__file__ for m in (relayout, replay, containers, manifests)), sep='\\n'); "
             "print('atlases', *shipped_names('atlases')); "
             "print('readme', shipped_dir('atlases').joinpath('README.md').is_file())")
    out = _run([py, "-c", probe], work, env).stdout.splitlines()
    for path in out[:4]:
        assert Path(path).resolve().is_relative_to(where.resolve()), f"{path} is not from {where}"
    assert out[4] == "atlases glm-5.2 qwen3-30b-a3b" and out[5] == "readme True", out

    relayout = py.parent / "relayout"
    assert "synth" in _run([relayout, "--help"], work, env).stdout
    assert "--json" in _run([relayout, "inspect", "--help"], work, env).stdout
    res = _run([relayout, "synth", "container", work / "c", "--geometry", "qwen3-30b-a3b", "--moe-layers", 1,
                "--experts", 8, "--hidden", 64, "--ffn", 32, "--vocab", 32], work, env)
    assert (work / "c").is_dir(), res.stdout
    _run([relayout, "inspect", work / "c"], work, env)
    res = _run([relayout, "synth", "trace", work / "t.rt", "--geometry", "glm-5.2-int4-row", "--moe-layers", 2,
                "--tokens", 20, "--sessions", 1, "--fit", "glm-5.2"], work, env)
    assert "lift median" in res.stdout and (work / "t.rt").is_file()
    res = subprocess.run([relayout, "synth", "trace", work / "u.rt", "--geometry", "glm-5.2-int4-row", "--fit", "nope"],
                         cwd=work, env=env, capture_output=True, text=True)
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "glm-5.2" in res.stderr, res.stderr


def test_wheel_install_finds_its_data(tmp_path, deps, source):
    work = tmp_path / "work"
    work.mkdir()
    _run([sys.executable, "-m", "pip", "wheel", *_build_flags(), "-q", "-w", tmp_path / "dist", source], tmp_path)
    wheel, = (tmp_path / "dist").glob("relayout-*.whl")
    py = _venv(tmp_path / "venv", deps)
    _run([py, "-m", "pip", "install", "--no-deps", "-q", wheel], tmp_path, _clean_env())
    _check_installed(py, tmp_path / "venv", work)


def test_editable_install_finds_its_data(tmp_path, deps, source):
    work = tmp_path / "work"
    work.mkdir()
    py = _venv(tmp_path / "venv", deps)
    _run([py, "-m", "pip", "install", *_build_flags(), "-q", "-e", source], tmp_path, _clean_env())
    _check_installed(py, source, work)
    # an editable install serves the checkout's files: a new geometry there is found at once
    shutil.copy(source / "manifests/geometries/qwen3-30b-a3b.json", source / "manifests/geometries/added-later.json")
    res = _run([py.parent / "relayout", "synth", "container", "--help"], work, _clean_env())
    assert "added-later" in res.stdout
