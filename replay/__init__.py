"""The engine model and everything judged with it, in rooms by concept.

- :mod:`replay.formats`: the files the model reads and writes (trace, plan, gate record, pins).
- :mod:`replay.model`: the compiled model of the runtime's read path (numba).
- :mod:`replay.colibri`: the real engine's configuration, output and measured metrics.
- :mod:`replay.physical`: the harness that reads real drives, and calibration.
- :mod:`replay.evaluation`: statistics, evidence, the gate, hypotheses.
- :mod:`replay.control`: placement, split curves and policy experiments.
- :mod:`replay.execution`: running replays serially or on a Dask cluster.

The compiled model is cached on disk. numba keys a cached build by the file that defines a
function only, so a build that inlines code from another module would outlive an edit of that
module and run the old model. Builds are therefore kept in a directory named by a digest of every
module under :mod:`replay.model` (:func:`compiled_cache_dir`): any change to the model's source
starts a fresh build, an edit elsewhere does not; builds of other sources untouched for a day are
removed.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

CACHE_PREFIX = "src-"
STALE_SECONDS = 86400
"""Builds of other sources unused this long are removed."""


MODEL_PACKAGE = Path(__file__).parent / "model"
"""The compiled model's sources: the only files whose edits start a fresh build."""


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


def _use_compiled_cache() -> None:
    where = compiled_cache_dir()
    if where is None:
        return
    import sys

    if "numba" in sys.modules:
        from numba.core import config

        config.CACHE_DIR = str(where)
    os.environ["NUMBA_CACHE_DIR"] = str(where)


_use_compiled_cache()
