"""Where the compiled model is kept: a cache directory named by the model's sources, code built
for any CPU of the machine's architecture, and a build of the model shipped with the package.

numba keys a cached build by the file that defines a function only, so a build that inlines code
from another module would outlive an edit of that module and run the old model. Builds are
therefore kept in a directory named by a digest of every module under :mod:`replay.model`
(:func:`compiled_cache_dir`): any change to the model's source starts a fresh build, an edit
elsewhere does not; builds of other sources untouched for a day are removed.

The model is built for the architecture's generic CPU (``NUMBA_CPU_NAME=generic``, unless the
user names one): its loops are branches and scalar arithmetic, which run as fast without the
host's vector extensions (docs/BENCHMARKS.md, "A first run without compiling"), and a generic
build can be shipped. The package carries one (:data:`PREBUILT`, made by
``python -m relayout.workflows.prebuild``): the compiled entry points of the model a first
``relayout demo`` calls, for one numba release and one CPython version. The first process that
finds the cache directory without it unpacks it there (:func:`install_prebuilt`), when it was
built from these very sources with this numba and this Python; numba loads it as its own cache,
and compiles whatever it lacks as before. Building the model takes one to two minutes on a
2-core machine; loading the shipped build, under a second.

References
----------
numba's caching notes, "Cache sharing": a cache may be reused on another machine whose CPU
name and features match the build's.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

CACHE_PREFIX = "src-"
STALE_SECONDS = 86400
"""Builds of other sources unused this long are removed."""

MODEL_PACKAGE = Path(__file__).parent / "model"
"""The compiled model's sources: the only files whose edits start a fresh build."""

PREBUILT = Path(__file__).parent / "prebuilt" / "model-build.tar.xz"
"""The shipped build: ``build.json`` (:class:`PrebuiltBuild`) and ``model/<numba cache file>``."""

CPU_NAME = "generic"
"""The CPU the model is built for unless ``NUMBA_CPU_NAME`` names another."""

NO_PREBUILT = "RELAYOUT_NO_PREBUILT"
"""Set (to anything) in the environment, the shipped build is not unpacked: the model compiles."""

_CACHE_FILE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*\.(nbi|nbc)")


def source_digest(package: Path = MODEL_PACKAGE) -> str:
    """xxh3-64 (hex) of every module under ``package`` (the compiled model by default), at any
    depth, in relative-path order."""
    import xxhash

    h = xxhash.xxh3_64()
    root = Path(package)
    for p in sorted(root.rglob("*.py"), key=lambda q: q.relative_to(root).as_posix()):
        h.update(p.relative_to(root).as_posix().encode())
        h.update(p.read_bytes())
    return h.hexdigest()


def python_tag() -> str:
    """The CPython version and ABI flags numba's cache file names carry, e.g. ``py311``."""
    return f"py{sys.version_info[0]}{sys.version_info[1]}{getattr(sys, 'abiflags', '')}"


def numba_version() -> str:
    """The installed numba's version, read without importing numba (its cache index holds it)."""
    from importlib.metadata import version

    return version("numba")


@dataclass(frozen=True)
class PrebuiltBuild:
    """What a shipped build is: the model sources it was compiled from (:func:`source_digest`),
    the numba and CPython it is for, the CPU it targets (numba's codegen tuple: LLVM triple,
    CPU name, CPU features), the compiled entry points (``module.qualname``) and the numba
    cache files that hold them."""

    source_digest: str
    numba: str
    python: str
    codegen: tuple[str, str, str]
    entries: tuple[str, ...]
    files: tuple[str, ...]

    def to_json(self) -> dict:
        return {"source_digest": self.source_digest, "numba": self.numba, "python": self.python,
                "codegen": list(self.codegen), "entries": list(self.entries), "files": list(self.files)}

    @classmethod
    def from_json(cls, d: dict) -> "PrebuiltBuild":
        keys = {"source_digest", "numba", "python", "codegen", "entries", "files"}
        if not isinstance(d, dict) or set(d) != keys:
            raise ValueError(f"a prebuilt build record has the keys {sorted(keys)}")
        codegen = d["codegen"]
        if not (isinstance(codegen, list) and len(codegen) == 3 and all(isinstance(x, str) for x in codegen)):
            raise ValueError("a prebuilt build's codegen is [triple, cpu name, cpu features]")
        for k in ("source_digest", "numba", "python"):
            if not isinstance(d[k], str):
                raise ValueError(f"a prebuilt build's {k} is a string")
        for k in ("entries", "files"):
            if not (isinstance(d[k], list) and all(isinstance(x, str) for x in d[k])):
                raise ValueError(f"a prebuilt build's {k} is a list of strings")
        bad = [f for f in d["files"] if not _CACHE_FILE.fullmatch(f)]
        if bad:
            raise ValueError(f"a prebuilt build names a file that is not a numba cache file: {bad[0]!r}")
        return cls(d["source_digest"], d["numba"], d["python"], tuple(codegen), tuple(d["entries"]), tuple(d["files"]))

    def mismatch(self) -> str | None:
        """Why this build cannot serve this process (other sources, numba or Python), or None."""
        if self.source_digest != source_digest():
            return f"built from other model sources ({self.source_digest}, these are {source_digest()})"
        if self.numba != numba_version():
            return f"built for numba {self.numba}, this is {numba_version()}"
        if self.python != python_tag():
            return f"built for {self.python}, this is {python_tag()}"
        return None


def read_prebuilt(archive: Path = PREBUILT) -> PrebuiltBuild:
    """The record of a shipped build (ValueError when the archive is not one)."""
    try:
        with tarfile.open(archive, "r:xz") as tar:
            member = tar.extractfile("build.json")
            if member is None:
                raise ValueError(f"{archive}: build.json is not a file")
            return PrebuiltBuild.from_json(json.load(member))
    except (tarfile.TarError, KeyError, EOFError, OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{archive}: not a prebuilt model build ({exc})") from exc


def write_prebuilt(archive: Path, build: PrebuiltBuild, cache_dir: Path) -> None:
    """Pack ``build.files`` from numba's cache directory ``cache_dir`` (the model's own
    subdirectory) with the record, into ``archive`` (temporary file, fsync, rename)."""
    archive.parent.mkdir(parents=True, exist_ok=True)
    tmp = archive.with_name(archive.name + ".partial")
    with open(tmp, "wb") as fh:
        with tarfile.open(fileobj=fh, mode="w:xz", preset=9) as tar:
            record = json.dumps(build.to_json(), indent=1).encode()
            info = tarfile.TarInfo("build.json")
            info.size, info.mtime = len(record), 0
            tar.addfile(info, io.BytesIO(record))
            for name in build.files:
                data = (cache_dir / name).read_bytes()
                info = tarfile.TarInfo(f"model/{name}")
                info.size, info.mtime = len(data), 0
                tar.addfile(info, io.BytesIO(data))
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, archive)


def model_cache_subdir() -> str:
    """The subdirectory numba gives the model's modules inside its cache directory (named by
    the folder the sources are installed in, so it differs between installs)."""
    from numba.core.caching import _CacheLocator

    return _CacheLocator.get_suitable_cache_subpath(str(MODEL_PACKAGE / "instance.py"))


def install_prebuilt(here: Path, archive: Path = PREBUILT) -> int:
    """Unpack the shipped build into the cache directory ``here`` once, when it was built from
    these sources for this numba and this Python; returns the number of files written.

    A marker (``prebuilt-<numba>-<python>.json``, written last) records that it was tried, and
    what came of it, so later processes do not open the archive again. Files already in the
    cache are left as they are; every file is written under a temporary name and renamed.
    """
    if not archive.is_file():
        return 0
    from importlib.metadata import PackageNotFoundError

    try:
        marker = here / f"prebuilt-{numba_version()}-{python_tag()}.json"
    except PackageNotFoundError:               # numba not installed: nothing can use the build
        return 0
    if marker.exists():
        return 0
    written = 0
    try:
        build = read_prebuilt(archive)
        why = build.mismatch()
        if why is None:
            target = here / model_cache_subdir()
            target.mkdir(parents=True, exist_ok=True)
            with tarfile.open(archive, "r:xz") as tar:
                for name in build.files:
                    dest = target / name
                    if dest.exists():
                        continue
                    member = tar.extractfile(f"model/{name}")
                    if member is None:
                        raise ValueError(f"{archive}: model/{name} is not a file")
                    tmp = dest.with_name(f".{name}.{os.getpid()}.partial")
                    with open(tmp, "wb") as fh:
                        shutil.copyfileobj(member, fh)
                    os.replace(tmp, dest)
                    written += 1
        outcome = {"archive": str(archive), "installed": why is None, "files_written": written, "why_not": why}
    except (ValueError, KeyError, tarfile.TarError, OSError) as exc:
        outcome = {"archive": str(archive), "installed": False, "files_written": written, "why_not": str(exc)}
    try:
        tmp = marker.with_name(marker.name + f".{os.getpid()}.partial")
        tmp.write_text(json.dumps(outcome, indent=1) + "\n")
        os.replace(tmp, marker)
    except OSError:
        pass
    return written


def compiled_cache_dir() -> Path | None:
    """Where numba keeps the compiled model: ``$NUMBA_CACHE_DIR/relayout`` (else
    ``$XDG_CACHE_HOME/relayout`` or ``~/.cache/relayout``) ``/src-<digest>``; ``None`` when it
    cannot be created (numba then caches beside the sources, as it does by default). A
    ``$NUMBA_CACHE_DIR`` that is already such a directory (a child process of ours) is taken
    as its root's."""
    user = os.environ.get("NUMBA_CACHE_DIR")
    if user and Path(user).name.startswith(CACHE_PREFIX):
        root = Path(user).parent
    elif user:
        root = Path(user) / "relayout"
    else:
        root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "relayout"
    here = root / f"{CACHE_PREFIX}{source_digest()}"
    try:
        here.mkdir(parents=True, exist_ok=True)
        os.utime(here)
    except OSError:
        return None
    now = time.time()
    for old in root.glob(f"{CACHE_PREFIX}*"):
        try:
            if old != here and old.is_dir() and now - old.stat().st_mtime > STALE_SECONDS:
                shutil.rmtree(old, ignore_errors=True)
        except OSError:
            pass
    return here


def use_compiled_cache() -> None:
    """Point numba at the model's cache directory and the generic CPU, and unpack the shipped
    build there if it fits and ``$RELAYOUT_NO_PREBUILT`` is not set (numba reads both settings when it
    first compiles)."""
    if "numba" in sys.modules:
        from numba.core import config

        if config.CPU_NAME is None and "NUMBA_CPU_NAME" not in os.environ:
            config.CPU_NAME, config.CPU_FEATURES = CPU_NAME, ""
    os.environ.setdefault("NUMBA_CPU_NAME", CPU_NAME)
    where = compiled_cache_dir()
    if where is None:
        return
    if "numba" in sys.modules:
        from numba.core import config

        config.CACHE_DIR = str(where)
    os.environ["NUMBA_CACHE_DIR"] = str(where)
    if not os.environ.get(NO_PREBUILT):
        install_prebuilt(where)
