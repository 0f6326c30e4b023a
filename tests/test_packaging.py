"""Shipped data (``manifests/``) and reading JSON; relayout installed as users install it finds it.

The install tests (marked slow) install the project into a fresh venv and runs the ``relayout`` script from a folder
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
from conftest import REPO, cli

from containers.errors import InputError
from containers.geometry import load_geometry
from containers.jsonfile import (
    iter_jsonl,
    load_shipped,
    read_document,
    shipped_dir,
    shipped_names,
)
from relayout.traces.synth import atlas_names, load_atlas
from replay.model.device import load_device

OURS = {"relayout", "replay", "containers", "manifests"}
COPY_IGNORE = shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache",
                                     ".hypothesis", ".benchmarks", "out", "*.nbi", "*.nbc")


DEEP = "[" * 100_000   # deeper than json's recursion limit


def test_shipped_data_is_one_regular_package_folder():
    import manifests

    assert manifests.__file__ is not None  # a regular package: resources gives one folder, not a MultiplexedPath
    assert shipped_names("geometries") == ["glm-5.2-int4-g64", "glm-5.2-int4-row", "qwen3-30b-a3b"]
    assert shipped_names("devices") == ["linux-md-raid0-4x", "mac-pro-2019-applraid-4x", "single-nvme"]
    assert shipped_names("atlases") == atlas_names() == ["glm-5.2", "qwen3-30b-a3b"]
    assert shipped_names("no-such-folder") == []
    readme = shipped_dir("atlases").joinpath("README.md").read_text()
    assert "mbolt" in readme and "github.com/doramirdor/mbolt" in readme and "MIT License" in readme


def test_atlas_by_shipped_name_or_by_path(tmp_path):
    glm, qwen = load_atlas("glm-5.2"), load_atlas("qwen3-30b-a3b")
    assert (glm.n_experts, glm.k, len(glm.layers), glm.tokens, glm.path) == (256, 8, 75, 1270, "glm-5.2")
    assert glm.layers[0] == 3 and glm.layers[-1] == 77
    assert (qwen.n_experts, qwen.k, len(qwen.layers), qwen.tokens) == (128, 8, 48, 75773)
    copy = tmp_path / "my-atlas.json"
    copy.write_bytes(shipped_dir("atlases").joinpath("glm-5.2.json").read_bytes())
    by_path = load_atlas(copy)
    assert by_path.path == str(copy) and (by_path.heat == glm.heat).all() and by_path.layers == glm.layers
    other = tmp_path / "atlas.txt"  # any existing file is taken as a path, whatever its name
    other.write_bytes(copy.read_bytes())
    assert load_atlas(other).tokens == 1270


@pytest.mark.parametrize("arg, problem", [
    ("nope", "unknown co-activation atlas 'nope' (known: glm-5.2, qwen3-30b-a3b, or a JSON file)"),
    ("missing.json", "missing.json: no such file"),
    ("bad.json", "bad.json: not a co-activation atlas"),
    ("deep.json", "deep.json: not a co-activation atlas"),
    ("list.json", "list.json: not a co-activation atlas"),
    ("ragged.json", "ragged.json: not a co-activation atlas"),
    ("dir.json", "dir.json: not a readable co-activation atlas"),
])
def test_bad_atlas_is_one_input_error(tmp_path, monkeypatch, arg, problem):
    monkeypatch.chdir(tmp_path)
    Path("bad.json").write_text('{"n_expert_per_layer": 4, "k": 2, "layers": [{"heat": [1, 2]')
    Path("deep.json").write_text(DEEP)
    Path("list.json").write_text("[1, 2]")
    Path("ragged.json").write_text('{"n_expert_per_layer": 4, "k": 2, "layers": [{"heat": [1, 2, 3, 4], "pairs": []},'
                                   ' {"heat": [1], "pairs": []}]}')
    Path("dir.json").mkdir()
    with pytest.raises(InputError) as exc:
        load_atlas(arg)
    assert str(exc.value).startswith(problem)


def test_cli_fits_a_shipped_atlas_by_name(tmp_path):
    res = cli("synth", "trace", tmp_path / "t.rt", "--geometry", "glm-5.2-int4-row", "--moe-layers", 2, "--tokens", 20,
              "--sessions", 1, "--fit", "glm-5.2")
    assert res.returncode == 0, res.stderr
    assert "lift median" in res.stdout and (tmp_path / "t.rt").is_file()
    res = cli("synth", "trace", tmp_path / "u.rt", "--geometry", "glm-5.2-int4-row", "--fit", "qwen3-30b-a3b")
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "128 experts" in res.stderr
    res = cli("synth", "trace", tmp_path / "u.rt", "--geometry", "glm-5.2-int4-row", "--fit", tmp_path / "none.json")
    assert res.returncode == 2 and res.stderr == f"relayout: error: {tmp_path / 'none.json'}: no such file\n"


def test_deeply_nested_json_is_invalid_json_not_a_crash(tmp_path):
    doc = tmp_path / "plan.json"
    doc.write_text(DEEP)
    with pytest.raises(InputError, match=r"plan.json: not a readable plan \(nested too deeply\)"):
        read_document(doc, "relayout-plan", 1, (), "plan")
    lines = tmp_path / "run.jsonl"
    lines.write_text('{"a": 1}\n' + DEEP + "\n")
    with pytest.raises(InputError, match=r"run.jsonl:2: not JSON \(nested too deeply\)"):
        list(iter_jsonl(lines))
    for loader, what in ((load_geometry, "geometry"), (load_device, "device profile")):
        path = tmp_path / f"{what.replace(' ', '-')}.json"
        path.write_text(DEEP)
        with pytest.raises(InputError, match=rf"{path.name}: not a valid {what} \(nested too deeply\)"):
            loader(str(path))
    with pytest.raises(InputError, match=r"geometry.json: not a valid geometry \(nested too deeply\)"):
        load_shipped("geometries", str(tmp_path / "geometry.json"), "geometry")
    # and on the command line: one line, exit 2
    res = cli("synth", "container", tmp_path / "c", "--geometry", tmp_path / "geometry.json")
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "nested too deeply" in res.stderr, res.stderr
    lines.write_text("\n" + DEEP + "\n")
    res = cli("report", lines)
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "run.jsonl:2: not JSON" in res.stderr, res.stderr


def test_shipped_name_lookup_does_not_escape_its_folder(tmp_path):
    with pytest.raises(InputError, match="no such file"):  # a path, relative to the working directory
        load_shipped("geometries", "../devices/single-nvme", "geometry")
    with pytest.raises(InputError, match="unknown geometry"):
        load_shipped("geometries", "single-nvme", "geometry")
    assert load_shipped("devices", "single-nvme", "device profile")[1] == "single-nvme"


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


@pytest.mark.slow
def test_wheel_install_finds_its_data(tmp_path, deps, source):
    work = tmp_path / "work"
    work.mkdir()
    _run([sys.executable, "-m", "pip", "wheel", *_build_flags(), "-q", "-w", tmp_path / "dist", source], tmp_path)
    wheel, = (tmp_path / "dist").glob("relayout-*.whl")
    py = _venv(tmp_path / "venv", deps)
    _run([py, "-m", "pip", "install", "--no-deps", "-q", wheel], tmp_path, _clean_env())
    _check_installed(py, tmp_path / "venv", work)


@pytest.mark.slow
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
