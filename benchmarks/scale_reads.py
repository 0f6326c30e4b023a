"""Which buffered scale preads reach the drive: the page-cache model against this machine's kernel.

Usage: python benchmarks/scale_reads.py CONTAINER [--tokens N] [--sessions S] [--top-k K]
       [--skew A] [--gap-us G] [--read-ahead-kb R] [--seed S]

Issues the scale preads a runtime at RAM 0 issues (each token, every layer: ``--top-k`` experts
drawn with Zipf weights ``rank^-A``, read in the layer's physical order, each expert's scale
tensors gate, up, down, as :func:`replay.model.readplan.plan_layer` plans them), ``--tokens`` tokens
per session, each session starting with the container's page cache dropped
(:func:`replay.physical.measure.drop_cache`) and its files opened afresh. Before each pread, ``mincore``
says whether the page cache holds every page of it, read (up to date); if not, the pread waits
for the drive (:mod:`replay.physical.residency`, as the harness in :mod:`replay.physical.measure` asks). (``RWF_NOWAIT``,
the harness's test before, races with a fast device: it also succeeds when the readahead it started itself completes before it looks, which
on a virtual disk the host has cached takes microseconds; how often it failed is printed
beside.) ``--gap-us`` is slept after each expert (its weight read and matmul in a runtime; 0:
the experts' scale reads back to back, as with coalescing). The page-cache model
(:func:`replay.model.pagecache.buffered_read`, with the device's ``read_ahead_kb`` unless
``--read-ahead-kb``) decides the same preads. Printed: the preads, those that reached the drive
in each, and how often the two agreed pread by pread. The container's files must be yours or
writable by you (Linux's ``mincore`` reports every page of any other file as cached); they are
only read.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

from containers.container import Container
from containers.layout import SCALE_SLOTS, WEIGHT_SLOTS, layout_from_container
from replay.physical.request_limits import system_max_request_bytes, system_read_ahead_bytes
from replay.physical.measure import drop_cache
from replay.model.pagecache import buffered_read, new_page_cache, start_session
from replay.physical.residency import open_residency, residency_visible


def reads_of(layout, rng, tokens: int, k: int, skew: float) -> list:
    """[(file, offset, bytes, expert tag)] of one session's scale preads."""
    L, E = len(layout.layers), layout.n_experts
    loc = layout.expert_loc
    weights = 1.0 / np.arange(1, E + 1) ** skew
    weights /= weights.sum()
    popular = [rng.permutation(E) for _ in range(L)]
    where = loc[:, :, list(WEIGHT_SLOTS), 0] * (1 << 44) + loc[:, :, list(WEIGHT_SLOTS), 1]
    first_byte = where.min(axis=2)                               # [L, E]: the issue order
    out = []
    for _ in range(tokens):
        for li in range(L):
            chosen = popular[li][rng.choice(E, size=min(k, E), replace=False, p=weights)]
            for e in chosen[np.argsort(first_byte[li, chosen])]:
                scales = [(int(loc[li, e, s, 0]), int(loc[li, e, s, 1]), int(loc[li, e, s, 2])) for s in SCALE_SLOTS]
                out.extend((f, off, n, li * E + int(e)) for f, off, n in scales if n > 0)
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("container")
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--skew", type=float, default=1.0)
    ap.add_argument("--gap-us", type=float, default=300.0)
    ap.add_argument("--read-ahead-kb", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    if not hasattr(os, "RWF_NOWAIT"):
        print("this system has no RWF_NOWAIT: nothing to classify the preads with", file=sys.stderr)
        return 2
    c = Container.open(Path(a.container))
    if not all(residency_visible(p) for p in c.files):
        print(f"{a.container}: its files are not yours or writable by you, so mincore would report every page cached",
              file=sys.stderr)
        return 2
    layout = layout_from_container(c)
    files = [Path(p) for p in c.files]
    ra_bytes = a.read_ahead_kb * 1024 if a.read_ahead_kb is not None else system_read_ahead_bytes(files[0])
    if ra_bytes is None:
        print(f"{files[0]}: the device's read_ahead_kb is unknown; give --read-ahead-kb", file=sys.stderr)
        return 2
    rng = np.random.default_rng(a.seed)
    pc = new_page_cache(layout.expert_loc[:, :, list(SCALE_SLOTS)], layout.file_sizes, ra_bytes, 0,
                        system_max_request_bytes(files[0]))
    both = [[0, 0], [0, 0]]                                     # [kernel to drive][model to drive]
    nowait_drive = 0
    buf = bytearray(max(int(layout.expert_loc[:, :, list(SCALE_SLOTS), 2].max()), 1) + 8192)
    for s in range(a.sessions):
        drop_cache(files)
        start_session(pc, s)
        fds = [os.open(p, os.O_RDONLY) for p in files]
        maps = open_residency(fds, files)
        try:
            last = None
            for f, off, n, tag in reads_of(layout, rng, a.tokens, a.top_k, a.skew):
                if last is not None and tag != last and a.gap_us > 0:
                    time.sleep(a.gap_us * 1e-6)
                last = tag
                view = memoryview(buf)[:n]
                cached = maps[f].cached(off, n)
                try:
                    nowait = os.preadv(fds[f], [view], off, os.RWF_NOWAIT) == n
                except BlockingIOError:
                    nowait = False
                if not nowait:
                    nowait_drive += 1
                    os.preadv(fds[f], [view], off)
                waited, _ = buffered_read(pc, f, off, n)
                both[int(not cached)][int(waited > 0)] += 1
        finally:
            for m in maps:
                m.close()
            for fd in fds:
                os.close(fd)
    total = sum(map(sum, both))
    kernel, model = both[1][0] + both[1][1], both[0][1] + both[1][1]
    print(f"{a.container}: read_ahead_kb {ra_bytes // 1024}; {a.sessions} sessions x {a.tokens} tokens, top-{a.top_k}, "
          f"skew {a.skew}, {a.gap_us:.0f} us after each expert")
    print(f"  scale preads {total}: to the drive, kernel {kernel}, model {model} (model / kernel {model / max(kernel, 1):.3f}); "
          f"RWF_NOWAIT failed on {nowait_drive}")
    print(f"  pread by pread: both drive {both[1][1]}, both page cache {both[0][0]}, "
          f"model only {both[0][1]}, kernel only {both[1][0]}: agree {(both[0][0] + both[1][1]) / max(total, 1):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
