import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from containers.geometry import load_geometry
from containers.synth import synth_container
from replay.model.routing import RoutingTrace

REPO = Path(__file__).resolve().parent.parent

if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    # A suite started in the background of a non-interactive shell (`cmd &`) inherits Ctrl-C
    # ignored, and so would every relayout it starts (an ignored signal stays ignored across exec):
    # the tests that send SIGINT would then test nothing. A handler is reset on exec, so the
    # commands start with Ctrl-C at its default, as from a terminal.
    signal.signal(signal.SIGINT, signal.default_int_handler)

FUZZ_SCALE = float(os.environ.get("RELAYOUT_FUZZ_SCALE", "1"))
"""Multiplies every fuzz test's example count: ``RELAYOUT_FUZZ_SCALE=10 pytest -k fuzz`` is a long run."""


def fuzz_examples(default: int) -> int:
    """Examples for a fuzzing property test: ``default`` scaled by ``RELAYOUT_FUZZ_SCALE``."""
    return max(1, int(default * FUZZ_SCALE))


KEEPS_PAGES = {"tmpfs", "ramfs", "devtmpfs", "hugetlbfs"}
"""File systems whose pages are the file: dropping them evicts nothing."""


def page_cache_evicts(path) -> bool:
    """Whether dropping ``path``'s pages from the page cache can evict them: Linux, and a file
    system that keeps file data outside memory, as ``/proc/self/mountinfo`` names it (asked
    independently of the residency test under test)."""
    if not sys.platform.startswith("linux"):
        return False
    real = os.path.realpath(path)
    best, fstype = "", None
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                fields = line.split()
                point = fields[4].encode().decode("unicode_escape")
                inside = real == point or real.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best):
                    best, fstype = point, fields[fields.index("-") + 1]
    except (OSError, ValueError, IndexError):
        return False
    return fstype is not None and fstype not in KEEPS_PAGES


ROUTE = """\
0 0 3 5:0.5000 1:0.2500
0 1 3 2:0.6000 5:0.1000
1 0 4 7:0.9000 0:0.0100
1 1 4 1:0.5000 2:0.5000
2 0 3 5:0.7000 6:0.2000
3 0 4 0:0.8000 3:0.1000
4 0 3 4:0.3000 5:0.2000
5 0 4 1:0.4000 2:0.3000
"""
"""A small ROUTE_TRACE (``<call> <row> <layer> <expert>:<gate> ...``): layers 3 and 4, two rows in the first forward."""


SMALL = dict(moe_layers=3, experts=16, hidden=512, ffn=128, shard_bytes=1_500_000, vocab=256)


def small_geometry(name="glm-5.2-int4-g64", **kw):
    return load_geometry(name).scaled(**{**SMALL, **kw})


def source_with_manifest(path: Path, geometry, seed: int) -> Path:
    """A synthetic container at ``path`` with its manifest written (the rewriter checks against it)."""
    from containers.container import MANIFEST_NAME, Container
    from containers.manifest import build_manifest, write_manifest

    synth_container(path, geometry, seed=seed, progress=False)
    write_manifest(build_manifest(Container.open(path), progress=False), path / MANIFEST_NAME)
    return path


@pytest.fixture(scope="session")
def small_container(tmp_path_factory):
    """A ~10 MB GLM-5.2-g64-structured container (int8 MTP layer included). Treat as read-only."""
    out = tmp_path_factory.mktemp("containers") / "small"
    synth_container(out, small_geometry(), seed=7, progress=False)
    before = tree_state(out)
    yield out
    assert tree_state(out) == before, "a test modified the shared read-only source container"


@pytest.fixture(scope="session")
def calibrations(tmp_path_factory):
    """One short calibration per buffer kind (``engine``, ``huge-pages``) on a 64 MiB test file (the
    smallest, with the shortest cells calibrate accepts), with every read buffer it asked for
    recorded (``huge_pages`` of each call): kind -> (profile, asked, the directory calibrated)."""
    from replay.physical import calibrate as cal
    from replay.physical import copy_rate

    out = {}
    for kind in ("engine", "huge-pages"):
        d = tmp_path_factory.mktemp(kind)
        asked = []
        real = cal.read_buffer

        def spy(nbytes, huge_pages=True):
            asked.append(huge_pages)
            return real(nbytes, huge_pages)

        cal.read_buffer = copy_rate.read_buffer = spy
        try:
            out[kind] = (cal.calibrate(d, size_mb=64, seconds=0.05, name=f"t-{kind}", buffers=kind), asked, d)
        finally:
            cal.read_buffer = copy_rate.read_buffer = real
    return out


@pytest.fixture
def container_copy(small_container, tmp_path):
    """A private copy of the small container that a test may damage."""
    dst = tmp_path / "copy"
    shutil.copytree(small_container, dst)
    return dst


def run_cli(*args, cwd=None):
    """Run ``python -m relayout ARGS`` in a subprocess; returns CompletedProcess."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "relayout", *map(str, args)], capture_output=True, text=True, cwd=cwd, env=env)


def cli(*args, cwd=None):
    """Run the command line's ``main(ARGS)`` in this process, its stdout and stderr captured; returns
    a CompletedProcess as :func:`run_cli` does. For tests of what a command does and says; a test
    of a real process (signals, start-up, the entry point) uses :func:`run_cli`."""
    import contextlib
    import io

    from relayout.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.chdir(cwd or os.getcwd()), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = main([str(a) for a in args])
        except SystemExit as exc:
            status = 0 if exc.code is None else exc.code if isinstance(exc.code, int) else 1
    return subprocess.CompletedProcess(["relayout", *map(str, args)], status, out.getvalue(), err.getvalue())


def tree_state(root: Path) -> dict:
    """(size, mtime_ns, content hash) of every file below ``root``: proof nothing was touched."""
    import xxhash

    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file():
            st = p.stat()
            out[str(p.relative_to(root))] = (st.st_size, st.st_mtime_ns, xxhash.xxh3_128_hexdigest(p.read_bytes()))
    return out


def make_trace(rows, layers=(3,), committed=None, evaluated=None, sessions=None, E=16):
    """rows: per forward a list of positions, each a list of expert ids (same k)."""
    rf, rl, rp, ex = [], [], [], []
    for f, positions in enumerate(rows):
        for layer in layers:
            for p, sel in enumerate(positions):
                rf.append(f)
                rl.append(layer)
                rp.append(p)
                ex.append(sel)
    F = len(rows)
    ev = np.array(evaluated or [len(p) for p in rows], dtype=np.int32)
    sess = np.array(sessions or [0] * F, dtype=np.int32)
    return RoutingTrace(
        layers=np.array(layers, dtype=np.int16), n_experts=E, top_k=len(ex[0]), geometry="test",
        sessions=[f"s{i}" for i in range(int(sess.max()) + 1)],
        row_forward=np.array(rf, dtype=np.int32), row_layer=np.array(rl, dtype=np.int16), row_position=np.array(rp, dtype=np.int32),
        experts=np.array(ex, dtype=np.int16), gates=np.full((len(ex), len(ex[0])), np.nan, dtype=np.float32),
        fwd_session=sess, fwd_kind=np.zeros(F, dtype=np.int8), fwd_evaluated=ev,
        fwd_committed=np.array(committed or [1] * F, dtype=np.int32),
    )


def louvain_plan_and_trace(tmp_path: Path) -> tuple[Path, Path]:
    """A Louvain plan for a two-layer Qwen3 geometry and the synthetic trace it was made from,
    saved as ``tmp_path/p.json`` and ``tmp_path/t.rt``: what a gate CLI test replays."""
    from relayout.planning.plan import make_plan, source_from_geometry
    from relayout.traces.synth import synth_trace
    from replay.formats.planfile import save_plan
    from replay.formats.trace import save_trace

    g = load_geometry("qwen3-30b-a3b").scaled(moe_layers=2, ffn=128)
    tr = synth_trace(g.moe_layers, 32, 4, 400, 8, seed=3)
    save_plan(make_plan(tr, source_from_geometry(g), method="louvain", progress=False), tmp_path / "p.json")
    save_trace(tr, tmp_path / "t.rt")
    return tmp_path / "p.json", tmp_path / "t.rt"
