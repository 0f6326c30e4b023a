"""The page cache under buffered scale reads (replay.model.pagecache): Linux's readahead, by hand.

The sequences here are the ones measured on this project's disk with ``mincore``
(benchmarks/scale_reads.py, docs/BENCHMARKS.md): a random read is read as it is, the read after
it starts a window of four times its size, and reaching that window's mark reads the next
window, its end aligned down to four pages.
"""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from containers.errors import InputError
from replay.model.device import load_device

from replay.model.pagecache import (
    CACHED,
    MARK,
    PAGE_BYTES,
    buffered_read,
    cached_read,
    checkpoint,
    new_page_cache,
    note_settled,
    pages_cached,
    scales_cached,
    scales_settled,
    start_session,
    stop_logging,
    undo,
)

P = PAGE_BYTES
FILE_PAGES = 4096


def cache(read_ahead_kb=8192, file_pages=FILE_PAGES, undo_reads=0):
    """A page cache of one file whose scales cover all of it."""
    sloc = np.array([[[[0, 0, file_pages * P], [0, 0, 0], [0, 0, 0]]]], dtype=np.int64)
    return new_page_cache(sloc, [file_pages * P], read_ahead_kb * 1024, undo_reads)


def cached_pages(pc, lo=0, hi=FILE_PAGES):
    return [p for p in range(lo, hi) if pc.state[pc.offset[0] + p - pc.first[0]] & CACHED]


def marked_pages(pc, lo=0, hi=FILE_PAGES):
    return [p for p in range(lo, hi) if pc.state[pc.offset[0] + p - pc.first[0]] & MARK]


def test_a_random_read_reads_its_pages_and_the_next_read_starts_a_window_four_times_its_size():
    pc = cache()
    off = 100 * P + 2000                               # an expert's first scales: 8 KiB from inside page 100
    waited, first = buffered_read(pc, 0, off, 8192)
    assert (waited, first) == (3, 100) and cached_pages(pc) == [100, 101, 102]
    waited, first = buffered_read(pc, 0, off + 8192, 3072)        # continues it: page 103 missing
    assert (waited, first) == (4, 103)
    assert cached_pages(pc) == list(range(100, 107)) and marked_pages(pc) == [104]
    waited, _ = buffered_read(pc, 0, off + 11264, 3072)           # page 103: cached, not the mark
    assert waited == 0 and cached_pages(pc) == list(range(100, 107))


def test_reaching_the_mark_reads_the_next_window_with_its_end_aligned_to_four_pages():
    pc = cache()
    buffered_read(pc, 0, 120 * P + 3000, 8192)      # pages 120-122
    buffered_read(pc, 0, 120 * P + 11192, 3072)     # pages 122-123: window [123, 127), mark 124
    assert marked_pages(pc) == [124]
    waited, first = buffered_read(pc, 0, 120 * P + 14264, 3072)   # pages 123-124: the mark
    # the next window starts where the last ended, 127, 16 pages, its end 143 aligned down to 140:
    # the pread needs none of it, but it started those 13 pages' read from the drive
    assert (waited, first) == (13, 127)
    assert cached_pages(pc) == list(range(120, 140))
    assert marked_pages(pc) == [127]                # the window's first folio: 127 is not 2-aligned
    # the next mark reached: order 4, end aligned down to 16 pages
    buffered_read(pc, 0, 127 * P, 100)
    start = 140
    assert cached_pages(pc) == list(range(120, start + 52))   # 140 + 64 = 204, aligned down to 192
    assert marked_pages(pc) == list(range(140, 144))          # a folio of four pages carries the mark


def test_a_miss_after_cached_history_reads_a_context_window():
    pc = cache()
    buffered_read(pc, 0, 200 * P, 30 * P)            # read as it is: 30 pages of history
    buffered_read(pc, 0, 900 * P, P)                 # a read elsewhere: not sequential any more
    assert cached_pages(pc) == list(range(200, 230)) + [900]
    waited, first = buffered_read(pc, 0, 230 * P, P)
    # a window of history + request pages (31), one of them async: the mark on its last page
    assert (waited, first) == (31, 230)
    assert cached_pages(pc) == list(range(200, 261)) + [900] and marked_pages(pc) == [260]


def test_a_standalone_small_read_leaves_no_window_and_no_mark():
    pc = cache()
    buffered_read(pc, 0, 500 * P, 2 * P)
    state = pc.ra[0].copy()
    buffered_read(pc, 0, 900 * P, 2 * P)             # not sequential, no history before it
    assert cached_pages(pc) == [500, 501, 900, 901] and not marked_pages(pc)
    assert (pc.ra[0, :3] == state[:3]).all()


def test_without_readahead_every_missing_page_is_read_alone():
    pc = cache(read_ahead_kb=0)
    waited, first = buffered_read(pc, 0, 10 * P, 3 * P)
    assert (waited, first) == (3, 10) and cached_pages(pc) == [10, 11, 12]
    assert buffered_read(pc, 0, 13 * P, P)[0] == 1 and cached_pages(pc) == [10, 11, 12, 13]


def test_windows_stop_at_the_end_of_the_file():
    pc = cache(file_pages=64)
    buffered_read(pc, 0, 60 * P, P)
    buffered_read(pc, 0, 61 * P, P)                  # a window of 4 from 61 would pass page 63
    assert cached_pages(pc, 0, 64) == [60, 61, 62, 63]


def test_a_new_session_starts_with_nothing_cached_and_keeps_the_window():
    pc = cache()
    buffered_read(pc, 0, 0, 8192)
    buffered_read(pc, 0, 8192, 3072)
    ra = pc.ra[0].copy()
    start_session(pc, 7)
    assert not cached_pages(pc) and (pc.ra[0] == ra).all()
    start_session(pc, 7)
    buffered_read(pc, 0, 0, 100)
    start_session(pc, 7)                             # the same session: nothing dropped
    assert cached_pages(pc) == [0, 1, 2, 3]


def test_scales_cached_needs_every_page_of_every_tensor():
    sloc = np.array([[[[0, 0, 8192], [0, 8192, 3072], [0, 20 * P, 100]]]], dtype=np.int64)
    pc = new_page_cache(sloc, [64 * P], 0, 0)
    buffered_read(pc, 0, 0, 8192 + 3072)
    assert pages_cached(pc, 0, 0, 11264) and not scales_cached(pc, sloc[0, 0])
    buffered_read(pc, 0, 20 * P, 100)
    assert scales_cached(pc, sloc[0, 0])


reads = st.lists(st.tuples(st.integers(0, 300 * P), st.integers(1, 40 * P)), min_size=1, max_size=30)


@settings(max_examples=60, deadline=None)
@given(before=reads, logged=reads)
def test_undo_restores_the_page_cache_and_the_windows_exactly(before, logged):
    pc = cache(read_ahead_kb=128, file_pages=400, undo_reads=len(logged))
    for off, n in before:
        buffered_read(pc, 0, off, min(n, 400 * P - off))
    state, ra = pc.state.copy(), pc.ra.copy()
    mark = checkpoint(pc)
    for off, n in logged:
        buffered_read(pc, 0, off, min(n, 400 * P - off))
    undo(pc, mark)
    stop_logging(pc)
    assert (pc.state == state).all() and (pc.ra == ra).all()


@settings(max_examples=60, deadline=None)
@given(seq=reads)
def test_a_read_leaves_its_pages_cached_and_reads_the_drive_when_one_was_missing(seq):
    pc = cache(read_ahead_kb=256, file_pages=400)
    for off, n in seq:
        n = min(n, 400 * P - off)
        was = pages_cached(pc, 0, off, n)
        waited, first = buffered_read(pc, 0, off, n)
        assert was or waited > 0                 # a missing page is read; a mark reached may read more
        assert pages_cached(pc, 0, off, n)
        if not was:
            assert off // P <= first < -(-(off + n) // P)



def test_a_profile_keeps_its_digest_at_the_default_readahead_and_round_trips_another(tmp_path):
    old = load_device("single-nvme")
    assert old.read_ahead_bytes == 128 * 1024 and "read_ahead_bytes" not in old.to_json()
    vm = replace(old, read_ahead_bytes=8 << 20)
    assert vm.digest() != old.digest()
    p = tmp_path / "ra.json"
    p.write_text(json.dumps(vm.to_json()))
    back = load_device(str(p))
    assert back == vm and back.digest() == vm.digest()


@pytest.mark.parametrize("bad", [-4096, 1.5, True, "8M", 1 << 31])
def test_a_profile_with_a_bad_readahead_is_refused(tmp_path, bad):
    obj = load_device("single-nvme").to_json()
    obj["read_ahead_bytes"] = bad
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(obj))
    with pytest.raises(InputError, match="read_ahead_bytes"):
        load_device(str(p))



def scales_together(E=24, sizes=(3072, 3072, 8192)):
    """[1, E, 3, 3]: one layer's scales stored expert after expert (down, gate, up by name)."""
    sloc = np.zeros((1, E, 3, 3), dtype=np.int64)
    off = 5 * P
    for e in range(E):
        for t in (2, 0, 1):
            sloc[0, e, t] = (0, off, sizes[t])
            off += sizes[t]
    return sloc, off + 64 * P


@settings(max_examples=60, deadline=None)
@given(experts=st.lists(st.integers(0, 23), min_size=1, max_size=80), sessions=st.lists(st.integers(0, 79), max_size=3))
def test_settled_experts_read_as_the_page_by_page_path_does(experts, sessions):
    """The fast path (an expert whose scale pages are all cached and unmarked changes only
    ``prev_pos``) gives the same drive reads, pages and windows as reading every page."""
    sloc, size = scales_together()
    plain, fast = (new_page_cache(sloc, [size], 64 * 1024, 0) for _ in range(2))
    session = 0
    for q, e in enumerate(experts):
        session += q in sessions
        for pc in (plain, fast):
            start_session(pc, session)
        settled = scales_settled(fast, 0, e)
        for t in range(3):
            f, off, n = sloc[0, e, t]
            want = buffered_read(plain, f, off, n)
            if settled:
                cached_read(fast, f, off, n)
                assert want[0] == 0
            else:
                assert buffered_read(fast, f, off, n) == want
        note_settled(fast, 0, e, sloc[0, e])
        assert (plain.state == fast.state).all() and (plain.ra == fast.ra).all()


def test_an_expert_read_once_is_settled_until_the_session_ends_and_not_while_logging():
    sloc, size = scales_together()
    pc = new_page_cache(sloc, [size], 64 * 1024, 4)
    start_session(pc, 0)
    mark = checkpoint(pc)
    for t in range(3):
        buffered_read(pc, 0, *sloc[0, 3, t, 1:])
    note_settled(pc, 0, 3, sloc[0, 3])
    assert not scales_settled(pc, 0, 3)              # an undo could still drop its pages
    undo(pc, mark)
    stop_logging(pc)
    for t in range(3):
        buffered_read(pc, 0, *sloc[0, 3, t, 1:])
    note_settled(pc, 0, 3, sloc[0, 3])
    assert scales_settled(pc, 0, 3) and scales_cached(pc, sloc[0, 3])
    start_session(pc, 1)
    assert not scales_settled(pc, 0, 3) and not scales_cached(pc, sloc[0, 3])


def test_the_undo_log_holds_a_routing_of_cold_loads_with_the_largest_scale_reads_and_refuses_more():
    """GLM-5.2 group-64 scales (786,432 B a tensor, 192 pages: more than the default readahead
    maximum) read cold for 64 loads, all logged: the log is sized for it; one more stretch than
    it was sized for raises instead of writing past its end (the log keeps runs of pages, so a
    log sized for no read, one entry, shows it)."""
    E, n = 64, 786_432
    sloc = np.zeros((1, E, 3, 3), dtype=np.int64)
    for e in range(E):
        for t in range(3):
            sloc[0, e, t] = (0, P + (3 * e + t) * (n + 5 * P), n)    # apart: every read cold
    size = int(sloc[0, -1, 2, 1]) + n + 64 * P
    for read_ahead, max_request in ((128 * 1024, 1280 * 1024), (0, None), (16 * 1024, 4 << 20)):
        pc = new_page_cache(sloc, [size], read_ahead, 3 * E, max_request)
        mark = checkpoint(pc)
        for e in range(E):
            for t in range(3):
                buffered_read(pc, 0, sloc[0, e, t, 1], n)
        assert pc.log_n[0] <= len(pc.log_key)
        undo(pc, mark)
        assert not pc.state.any()
        stop_logging(pc)
    pc = new_page_cache(sloc, [size], 128 * 1024, 0, 1280 * 1024)     # a log for no read: its one entry
    checkpoint(pc)
    with pytest.raises(RuntimeError, match="undo log is full"):
        buffered_read(pc, 0, sloc[0, 0, 0, 1], n)


def test_a_read_larger_than_the_readahead_maximum_takes_a_window_up_to_the_largest_request():
    """Linux's ``ractl_max_pages``: a 192-page sequential read with a 32-page maximum and 320-page
    requests reads one window of its own size, not 32-page windows."""
    sloc = np.array([[[[0, 0, 4096 * P], [0, 0, 0], [0, 0, 0]]]], dtype=np.int64)
    pc = new_page_cache(sloc, [4096 * P], 128 * 1024, 0, 1280 * 1024)
    waited, first = buffered_read(pc, 0, 0, 192 * P)                # at the file's start: a new window
    assert first == 0 and pc.ra[0, 1] == 192
    assert waited == 384                         # its mark, at 96, started the next 192-page window
    small = new_page_cache(sloc, [4096 * P], 128 * 1024, 0)         # no larger request: 32-page windows
    buffered_read(small, 0, 0, 192 * P)
    assert small.ra[0, 1] == 32


def test_the_readahead_request_is_the_systems_and_falls_back_to_the_drives_largest_request(tmp_path):
    """Linux sizes a large read's readahead window by the queue's max_sectors_kb (io_pages), not
    by the request the engine's buffers allow: a profile keeps it apart, round trip and checks."""
    old = load_device("single-nvme")
    assert old.readahead_request_bytes is None and old.readahead_request == old.drive.max_request_bytes
    assert "readahead_request_bytes" not in old.to_json()
    vm = replace(old, readahead_request_bytes=4 << 20)
    p = tmp_path / "io.json"
    p.write_text(json.dumps(vm.to_json()))
    back = load_device(str(p))
    assert back == vm and back.readahead_request == 4 << 20 and back.digest() != old.digest()
    for bad in (0, 1.5, True, "4M"):
        obj = dict(vm.to_json(), readahead_request_bytes=bad)
        p.write_text(json.dumps(obj))
        with pytest.raises(InputError, match="readahead_request_bytes"):
            load_device(str(p))
