"""replay.physical.residency: the page cache's residency, asked with mincore, on small real files."""

import os
import sys

import pytest
from conftest import page_cache_evicts

from replay.physical.measure import drop_cache
from replay.physical.residency import PAGE_BYTES, FileResidency, open_residency, residency_visible

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore on files is Linux's")


def _written(path, n_pages: int):
    with open(path, "wb") as f:
        f.write(os.urandom(n_pages * PAGE_BYTES))
        f.flush()
        os.fsync(f.fileno())
    return path


@linux_only
def test_a_read_page_is_held_and_an_unread_one_is_not(tmp_path):
    path = _written(tmp_path / "f.bin", 256)
    drop_cache([path])
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)      # no readahead: exactly the pages read
        if not page_cache_evicts(path):
            pytest.skip("this file system keeps its pages in memory")
        res = open_residency([fd], [path])[0]
        assert not res.cached(0, PAGE_BYTES) and res.cached_run(0, 256 * PAGE_BYTES) == 0
        os.preadv(fd, [bytearray(100)], 10 * PAGE_BYTES + 7)
        assert res.cached(10 * PAGE_BYTES + 7, 100)
        assert res.cached(10 * PAGE_BYTES, PAGE_BYTES)
        assert not res.cached(10 * PAGE_BYTES + 7, PAGE_BYTES)   # reaches into page 11, unread
        assert not res.cached(0, 11 * PAGE_BYTES)
        assert res.cached_run(10 * PAGE_BYTES, 5 * PAGE_BYTES) == PAGE_BYTES
        os.preadv(fd, [bytearray(2 * PAGE_BYTES)], 11 * PAGE_BYTES)
        assert res.cached_run(10 * PAGE_BYTES, 5 * PAGE_BYTES) == 3 * PAGE_BYTES
        assert res.cached(0, 0)                                   # nothing to hold
        res.close()
    finally:
        os.close(fd)


@linux_only
def test_residency_is_offered_only_where_linux_answers_it(tmp_path, monkeypatch):
    path = _written(tmp_path / "mine.bin", 1)
    assert residency_visible(path)                          # our own file
    assert not residency_visible(tmp_path / "absent.bin")
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    fds = [os.open(path, os.O_RDONLY), os.open(empty, os.O_RDONLY)]
    try:
        got = open_residency(fds, [path, empty])
        assert got is not None and len(got) == 2
        assert got[1].cached(0, 100) and got[1].cached_run(0, PAGE_BYTES) == 0    # nothing to read
        for r in got:
            r.close()
        with pytest.raises(ValueError):
            open_residency(fds, [path])
        # someone else's file, not writable by us: Linux would report every page held
        monkeypatch.setattr(os, "geteuid", lambda: os.stat(path).st_uid + 1)
        monkeypatch.setattr(os, "access", lambda p, mode, **kw: False)
        assert not residency_visible(path)
        assert open_residency(fds[:1], [path]) is None
    finally:
        for fd in fds:
            os.close(fd)


def test_a_file_of_any_size_maps_and_a_partial_last_page_counts_its_bytes(tmp_path):
    big = tmp_path / "sparse.bin"
    with open(big, "wb") as f:
        f.truncate(1 << 40)                                 # 1 TiB, sparse: a private mapping would need its size in memory
    small = tmp_path / "small.bin"
    small.write_bytes(os.urandom(10_000))
    fds = [os.open(big, os.O_RDONLY), os.open(small, os.O_RDONLY)]
    try:
        os.pread(fds[1], 10_000, 0)
        got = open_residency(fds, [big, small])
        assert got is not None
        assert got[1].cached(0, 10_000) and got[1].cached(9_000, 50_000)
        assert got[1].cached_run(0, 1 << 20) == 10_000 and got[1].cached_run(2 * PAGE_BYTES, PAGE_BYTES) == 10_000 - 2 * PAGE_BYTES
        assert got[1].cached(20_000, 1)                     # past the end: nothing to wait for
        for r in got:
            r.close()
    finally:
        for fd in fds:
            os.close(fd)


def test_no_residency_off_linux(monkeypatch, tmp_path):
    path = _written(tmp_path / "f.bin", 1)
    monkeypatch.setattr(sys, "platform", "darwin")
    assert not residency_visible(path)
    assert open_residency([0], [path]) is None
