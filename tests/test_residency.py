"""replay.residency: the page cache's residency, asked with mincore, on small real files."""

import os
import sys

import pytest

from replay.measure import drop_cache
from replay.residency import PAGE_BYTES, FileResidency, open_residency, residency_visible

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore on files is Linux's")


def _written(path, n_pages: int):
    with open(path, "wb") as f:
        f.write(os.urandom(n_pages * PAGE_BYTES))
        f.flush()
        os.fsync(f.fileno())
    return path


def _evicts(res: FileResidency) -> bool:
    """Whether a drop really evicts here (not on tmpfs, whose pages are the file)."""
    return not res.cached(0, PAGE_BYTES)


@linux_only
def test_a_read_page_is_held_and_an_unread_one_is_not(tmp_path):
    path = _written(tmp_path / "f.bin", 256)
    drop_cache([path])
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)      # no readahead: exactly the pages read
        res = open_residency([fd], [path])[0]
        if not _evicts(res):
            pytest.skip("this file system does not evict pages on request")
        assert res.cached_run(0, 256 * PAGE_BYTES) == 0
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
def test_residency_is_offered_only_where_linux_answers_it(tmp_path):
    path = _written(tmp_path / "mine.bin", 1)
    assert residency_visible(path)                          # our own file
    assert not residency_visible(tmp_path / "absent.bin")
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    fds = [os.open(path, os.O_RDONLY), os.open(empty, os.O_RDONLY)]
    try:
        assert open_residency(fds, [path, empty]) is None     # an empty file cannot be mapped
        got = open_residency(fds[:1], [path])
        assert got is not None and len(got) == 1
        got[0].close()
    finally:
        for fd in fds:
            os.close(fd)


def test_no_residency_off_linux(monkeypatch, tmp_path):
    path = _written(tmp_path / "f.bin", 1)
    monkeypatch.setattr(sys, "platform", "darwin")
    assert not residency_visible(path)
    assert open_residency([0], [path]) is None
