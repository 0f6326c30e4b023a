"""Build the compiled model that ships with the package (``replay/prebuilt/model-build.tar.xz``).

Run ``python -m relayout.workflows.prebuild`` after any change under ``replay/model/`` and commit
the archive it writes: a test fails while the shipped build is of other sources. It runs
``relayout demo`` in a child process with an empty numba cache and the generic CPU
(:mod:`replay.compiled`), notes which of the model's compiled functions Python itself called (the
entry points: each one's cached build holds everything it calls), and packs those functions'
cache files with their record (:class:`replay.compiled.PrebuiltBuild`). A first ``relayout demo``
on another machine with the same numba, CPython and architecture then loads them instead of
compiling for one to two minutes. Takes as long as a first demo run (about two minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from replay.compiled import (
    CPU_NAME,
    NO_PREBUILT,
    PREBUILT,
    PrebuiltBuild,
    numba_version,
    python_tag,
    read_prebuilt,
    source_digest,
    write_prebuilt,
)

MODEL_MODULES = "replay.model."


def _child(entries_path: Path, demo_dir: Path) -> int:
    """Run the demo, recording the model functions Python called (top-level compilations)."""
    from numba.core import event

    from relayout.cli import main

    depth, entries = [0], {}

    class Entries(event.Listener):
        def on_start(self, ev):
            if depth[0] == 0:
                fn = ev.data["dispatcher"].py_func
                if fn.__module__.startswith(MODEL_MODULES):
                    base = f"{Path(fn.__code__.co_filename).stem}.{fn.__qualname__}-{fn.__code__.co_firstlineno}.{python_tag()}"
                    entries[f"{fn.__module__}.{fn.__qualname__}"] = base
            depth[0] += 1

        def on_end(self, ev):
            depth[0] -= 1

    event.register("numba:compile", Entries())
    status = main(["demo", "--dir", str(demo_dir)])
    from numba.core.registry import cpu_target

    codegen = list(cpu_target.target_context.codegen().magic_tuple())
    entries_path.write_text(json.dumps({"entries": entries, "codegen": codegen}))
    return status


def _run_child(tmp: Path, cache: Path, name: str) -> dict:
    """Run the demo in a child process on numba cache ``cache``; its entry points and codegen."""
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache), NUMBA_CPU_NAME=CPU_NAME, **{NO_PREBUILT: "1"})
    env.pop("NUMBA_CPU_FEATURES", None)
    out = tmp / f"{name}.json"
    subprocess.run([sys.executable, "-m", "relayout.workflows.prebuild", "--child", str(out), str(tmp / f"{name}-demo")],
                   env=env, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def _files_of(cache: Path, bases) -> list[str]:
    files = []
    for base in sorted(bases):
        named = sorted(p.name for p in cache.glob(f"{base}.*") if p.suffix in (".nbi", ".nbc"))
        if f"{base}.nbi" not in named:
            raise RuntimeError(f"no cache index for {base} in {cache}")
        files += named
    return files


def build(archive: Path = PREBUILT, rounds: int = 3) -> PrebuiltBuild:
    """Compile the model as a first demo does, in a fresh cache, and pack its entry points.

    A function compiled first as a callee and only later called from Python is not seen as an
    entry point by the first run, so the demo runs again on a cache holding only the entry points
    found so far, and whatever it still compiles joins them, until it compiles nothing (at most
    ``rounds`` checks)."""
    with tempfile.TemporaryDirectory(prefix="relayout-prebuild-") as tmp:
        tmp = Path(tmp)
        found = _run_child(tmp, tmp / "full", "full")
        if found["codegen"][1] != CPU_NAME:
            raise RuntimeError(f"the child built for CPU {found['codegen'][1]!r}, not {CPU_NAME!r}")
        model_dirs = list((tmp / "full" / "relayout").glob("src-*/model_*"))
        if len(model_dirs) != 1:
            raise RuntimeError(f"expected one model cache directory, found {len(model_dirs)}")
        full = model_dirs[0]
        entries = dict(found["entries"])
        for r in range(rounds):
            check = tmp / f"check{r}"
            target = check / full.relative_to(tmp / "full")
            target.mkdir(parents=True)
            for name in _files_of(full, entries.values()):
                (target / name).write_bytes((full / name).read_bytes())
            missing = _run_child(tmp, check, f"check{r}")["entries"]
            if not missing:
                break
            entries.update(missing)
        else:
            raise RuntimeError(f"the demo still compiled {sorted(missing)} after {rounds} rounds")
        record = PrebuiltBuild(source_digest(), numba_version(), python_tag(), tuple(found["codegen"]),
                               tuple(sorted(entries)), tuple(_files_of(full, entries.values())))
        write_prebuilt(archive, record, full)
    return read_prebuilt(archive)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m relayout.workflows.prebuild", description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", nargs=2, metavar=("ENTRIES_JSON", "DEMO_DIR"), help=argparse.SUPPRESS)
    parser.add_argument("-o", "--output", default=str(PREBUILT), help="the archive to write (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.child:
        return _child(Path(args.child[0]), Path(args.child[1]))
    record = build(Path(args.output))
    size = Path(args.output).stat().st_size
    print(f"{args.output}: {len(record.entries)} entry points in {len(record.files)} files, {size:,} B; "
          f"model sources {record.source_digest}, numba {record.numba}, {record.python}, {'/'.join(record.codegen[:2])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
