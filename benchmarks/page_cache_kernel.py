"""The pages a thread's expert loads bring in: the page-cache model against this machine's kernel.

Usage: python benchmarks/page_cache_kernel.py CONTAINER [--loads N] [--seed S]

One thread issues the buffered preads of ``--loads`` expert loads as colibrì issues them (the
expert's adjacent weight tensors as one pread, then its scale tensors one by one; experts drawn
uniformly over layers and experts), from a cold page cache (the container's files dropped with
``posix_fadvise``), on the real files; the kernel's bytes read from storage are this process's
block input (``getrusage``). The page-cache model (:func:`replay.model.pagecache.buffered_read`,
weights tracked, no budget, with this system's ``read_ahead_kb`` and ``max_sectors_kb``) decides
the same preads; its bytes read are the pages its reads bring in, synchronous windows and the
asynchronous windows they start. Printed side by side, with the bytes asked for. A container
smaller than the machine's free memory keeps the comparison free of eviction. Only reads the
container.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from containers.container import Container  # noqa: E402
from containers.layout import SCALE_SLOTS, WEIGHT_SLOTS, layout_from_container  # noqa: E402
from replay.model.pagecache import PAGE_BYTES, buffered_read, new_page_cache  # noqa: E402
from replay.physical.request_limits import system_max_request_bytes, system_read_ahead_bytes  # noqa: E402


def load_preads(layout, loads: int, seed: int) -> list[tuple[int, int, int]]:
    """(file, offset, bytes) of each pread, in order: per load its weights' span, then its scales."""
    wloc = layout.expert_loc[:, :, list(WEIGHT_SLOTS)]
    sloc = layout.expert_loc[:, :, list(SCALE_SLOTS)]
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(loads):
        li, e = int(rng.integers(wloc.shape[0])), int(rng.integers(wloc.shape[1]))
        w = wloc[li, e]
        out.append((int(w[0, 0]), int(w[:, 1].min()), int(w[:, 2].sum())))
        out += [(int(f), int(o), int(n)) for f, o, n in sloc[li, e] if n > 0]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("container")
    ap.add_argument("--loads", type=int, default=300)
    ap.add_argument("--seed", type=int, default=2)
    args = ap.parse_args(argv)
    container = Container.open(args.container)
    layout = layout_from_container(container)
    paths = [Path(args.container) / name for name in layout.files]
    preads = load_preads(layout, args.loads, args.seed)
    fds = [os.open(p, os.O_RDONLY) for p in paths]
    try:
        for fd in fds:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_inblock
        for f, off, n in preads:
            os.pread(fds[f], n, off)
        kernel = (resource.getrusage(resource.RUSAGE_SELF).ru_inblock - before) * 512
        for fd in fds:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        for fd in fds:
            os.close(fd)
    read_ahead = system_read_ahead_bytes(paths[0])
    pc = new_page_cache(np.ascontiguousarray(layout.expert_loc[:, :, list(SCALE_SLOTS)], dtype=np.int64),
                        layout.file_sizes, read_ahead if read_ahead is not None else 128 * 1024, 0,
                        system_max_request_bytes(paths[0]),
                        wloc=np.ascontiguousarray(layout.expert_loc[:, :, list(WEIGHT_SLOTS)], dtype=np.int64))
    model = sum(buffered_read(pc, f, off, n)[0] for f, off, n in preads) * PAGE_BYTES
    asked = sum(n for _, _, n in preads)
    print(f"{len(preads)} preads of {args.loads} expert loads, {asked / 1e6:.1f} MB asked "
          f"(read_ahead_kb {(read_ahead or 0) // 1024}): kernel read {kernel / 1e6:.1f} MB from storage, "
          f"model {model / 1e6:.1f} MB ({model / kernel:.3f} of it)" if kernel else "the kernel read nothing: "
          "is the container on a block device this process's block input counts?")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
