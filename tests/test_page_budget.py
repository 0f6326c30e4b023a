"""The page cache under a memory budget (replay.model.pagecache): weight pages tracked, the least
recently used 64 KiB blocks evicted first, nothing evicted while a prefetch's reads are logged,
an undo leaving the count of cached pages true."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from replay.model.pagecache import (
    BLOCK_PAGES,
    CACHED,
    PAGE_BYTES,
    buffered_read,
    checkpoint,
    exact_read,
    new_page_cache,
    pages_cached,
    stop_logging,
    undo,
    weights_cached,
)

P = PAGE_BYTES
EXPERTS = 8
EXPERT_PAGES = 4 * BLOCK_PAGES          # 256 KiB of weights each, 64 KiB apart


def layout():
    """One layer of ``EXPERTS`` experts: weights (three tensors, one after another) at page 16
    plus 80 pages per expert, scales (three 256-byte tensors an expert) in the file's first pages."""
    wloc = np.zeros((1, EXPERTS, 3, 3), dtype=np.int64)
    sloc = np.zeros((1, EXPERTS, 3, 3), dtype=np.int64)
    third = EXPERT_PAGES * P // 4
    for e in range(EXPERTS):
        base = (16 + e * (EXPERT_PAGES + BLOCK_PAGES)) * P
        wloc[0, e] = [(0, base, third), (0, base + third, third), (0, base + 2 * third, 2 * third)]
        sloc[0, e] = [(0, e * 1024, 256), (0, e * 1024 + 256, 256), (0, e * 1024 + 512, 256)]
    size = (16 + EXPERTS * (EXPERT_PAGES + BLOCK_PAGES)) * P
    return wloc, sloc, size


def budget_cache(budget_pages, read_ahead_kb=0, undo_reads=0, mapped=False):
    wloc, sloc, size = layout()
    return new_page_cache(sloc, [size], read_ahead_kb * 1024, undo_reads, wloc=wloc,
                          budget_bytes=budget_pages * P, mapped=mapped), wloc


def read_weights(pc, wloc, e):
    off = int(wloc[0, e, 0, 1])
    return buffered_read(pc, 0, off, int(wloc[0, e, :, 2].sum()))


def cached_count(pc):
    return int(np.count_nonzero(pc.state & CACHED))


def test_without_a_budget_nothing_is_evicted_and_weights_are_tracked():
    wloc, sloc, size = layout()
    pc = new_page_cache(sloc, [size], 0, 0, wloc=wloc)
    for e in range(EXPERTS):
        read_weights(pc, wloc, e)
    assert all(weights_cached(pc, wloc[0, e]) for e in range(EXPERTS))
    assert pc.budget[1] == cached_count(pc) == EXPERTS * EXPERT_PAGES
    untracked = new_page_cache(sloc, [size], 0, 0)
    read_weights(untracked, wloc, 0)
    assert not weights_cached(untracked, wloc[0, 0])


def test_the_least_recently_used_expert_is_evicted_first():
    """Room for three experts: read 0, 1, 2, read 0 again, then 3: expert 1 goes, 0 stays."""
    pc, wloc = budget_cache(3 * EXPERT_PAGES)
    for e in (0, 1, 2):
        assert read_weights(pc, wloc, e)[0] == EXPERT_PAGES
    assert read_weights(pc, wloc, 0)[0] == 0            # a hit: the most recently used now
    read_weights(pc, wloc, 3)
    assert [weights_cached(pc, wloc[0, e]) for e in range(4)] == [True, False, True, True]
    assert pc.budget[1] == cached_count(pc) <= 3 * EXPERT_PAGES
    assert read_weights(pc, wloc, 1)[0] == EXPERT_PAGES  # read again from the drive


def test_a_logged_stretch_evicts_nothing_until_it_stops_and_an_undo_restores_the_count():
    pc, wloc = budget_cache(2 * EXPERT_PAGES, undo_reads=8)
    read_weights(pc, wloc, 0)
    read_weights(pc, wloc, 1)
    before = pc.state.copy()
    mark = checkpoint(pc)
    read_weights(pc, wloc, 2)
    read_weights(pc, wloc, 3)
    assert pc.budget[1] == cached_count(pc) == 4 * EXPERT_PAGES      # over the budget while logging
    undo(pc, mark)
    stop_logging(pc)
    assert (pc.state == before).all() and pc.budget[1] == cached_count(pc) == 2 * EXPERT_PAGES
    mark = checkpoint(pc)
    read_weights(pc, wloc, 2)
    stop_logging(pc)                                    # kept: now the budget is enforced
    assert pc.budget[1] == cached_count(pc) <= 2 * EXPERT_PAGES
    assert weights_cached(pc, wloc[0, 2]) and not weights_cached(pc, wloc[0, 0])


def test_an_exact_read_reads_from_its_first_missing_page_to_its_last():
    pc, wloc = budget_cache(EXPERTS * EXPERT_PAGES, read_ahead_kb=8192, mapped=True)
    off = int(wloc[0, 0, 0, 1])
    assert exact_read(pc, 0, off + 4 * P, 2 * P) == (2, off // P + 4)
    waited, first = exact_read(pc, 0, off, 10 * P)
    assert (waited, first) == (10, off // P)            # pages 0-3 and 6-9 missing: one read across
    assert pages_cached(pc, 0, off, 10 * P) and not pages_cached(pc, 0, off, 11 * P)
    assert exact_read(pc, 0, off, 10 * P) == (0, -1)


@settings(max_examples=60, deadline=None)
@given(budget=st.integers(0, EXPERTS * EXPERT_PAGES), ra=st.sampled_from([0, 16, 128, 8192]),
       reads=st.lists(st.tuples(st.integers(0, EXPERTS - 1), st.booleans()), min_size=1, max_size=40))
def test_the_count_of_cached_pages_is_true_and_within_the_budget_after_every_read(budget, ra, reads):
    pc, wloc = budget_cache(budget, read_ahead_kb=ra)
    for e, weights in reads:
        if weights:
            read_weights(pc, wloc, e)
        else:
            buffered_read(pc, 0, e * 1024, 768)
        assert pc.budget[1] == cached_count(pc)
        assert pc.budget[0] < 0 or pc.budget[1] <= pc.budget[0]


@settings(max_examples=60, deadline=None)
@given(budget=st.integers(EXPERT_PAGES, EXPERTS * EXPERT_PAGES), ra=st.sampled_from([0, 16, 128, 8192]),
       before=st.lists(st.integers(0, EXPERTS - 1), max_size=12),
       logged=st.lists(st.tuples(st.integers(0, EXPERTS - 1), st.booleans()), min_size=1, max_size=12))
def test_an_undo_restores_every_page_window_and_count_after_any_logged_reads(budget, ra, before, logged):
    """Reads under a budget, then a logged stretch of weight, scale and exact reads: the undo
    gives back the pages, their marks, the readahead windows and the count of cached pages."""
    pc, wloc = budget_cache(budget, read_ahead_kb=ra, undo_reads=2 * len(logged))
    for e in before:
        read_weights(pc, wloc, e)
    state, ra_state, used = pc.state.copy(), pc.ra.copy(), int(pc.budget[1])
    mark = checkpoint(pc)
    for e, exact in logged:
        if exact:
            exact_read(pc, 0, int(wloc[0, e, 0, 1]), int(wloc[0, e, :, 2].sum()))
        else:
            read_weights(pc, wloc, e)
        buffered_read(pc, 0, e * 1024, 768)
    undo(pc, mark)
    assert (pc.state == state).all() and (pc.ra == ra_state).all() and pc.budget[1] == used == cached_count(pc)
    stop_logging(pc)
    assert pc.budget[1] <= pc.budget[0]


def live_blocks(pc):
    """The blocks whose last use a ring entry still holds."""
    live = set()
    for q in range(pc.budget[3]):
        b0, nb, t = pc.ring[(pc.budget[2] + q) % len(pc.ring)]
        live.update(b for b in range(b0, b0 + nb) if pc.stamp[b] == t)
    return live


def test_a_full_ring_of_uses_evicts_nothing_and_an_undo_leaves_no_block_out_of_reach():
    """One scale page per 64 KiB block, 250 of them read under a 300-page budget (the ring holds
    many more uses than the budget holds blocks), then a dropped prefetch of three more: nothing
    was evicted below the budget, and every block with a cached page is still one an eviction
    can reach."""
    E = 400
    sloc = np.zeros((1, E, 3, 3), dtype=np.int64)
    wloc = np.zeros((1, E, 3, 3), dtype=np.int64)
    for e in range(E):
        sloc[0, e, 0] = (0, e * BLOCK_PAGES * P, 256)
        wloc[0, e, 0] = (0, (E + 1) * BLOCK_PAGES * P + e * 16 * P, 16 * P)
    pc = new_page_cache(sloc, [(2 * E + 2) * BLOCK_PAGES * P], 0, 1, wloc=wloc, budget_bytes=300 * P)
    for e in range(250):
        buffered_read(pc, 0, int(sloc[0, e, 0, 1]), 256)
    assert pc.budget[1] == cached_count(pc) == 250                  # all held: the budget is 300
    mark = checkpoint(pc)
    for e in range(250, 253):
        buffered_read(pc, 0, int(sloc[0, e, 0, 1]), 256)
    undo(pc, mark)
    stop_logging(pc)
    cached_blocks = {s // BLOCK_PAGES for s in np.nonzero(pc.state & CACHED)[0]}
    assert pc.budget[1] == cached_count(pc) == 250 and cached_blocks <= live_blocks(pc)


def test_an_undo_to_a_later_checkpoint_reverts_a_run_that_continues_an_earlier_load():
    """Two loads read adjacent pages as mapped views, a checkpoint before each: undoing the
    second leaves the first cached and the second not (its run is not merged into the first's)."""
    wloc = np.zeros((1, 2, 3, 3), dtype=np.int64)
    sloc = np.zeros((1, 2, 3, 3), dtype=np.int64)
    wloc[0, 0, 0], wloc[0, 1, 0] = (0, 64 * P, 32 * P), (0, 96 * P, 32 * P)
    sloc[0, 0, 0], sloc[0, 1, 0] = (0, 200 * P, 100), (0, 201 * P, 100)
    pc = new_page_cache(sloc, [300 * P], 128 * 1024, 8, wloc=wloc, budget_bytes=100 * P, mapped=True)
    first = checkpoint(pc)
    exact_read(pc, 0, 64 * P, 32 * P)
    second = checkpoint(pc)
    exact_read(pc, 0, 96 * P, 32 * P)
    undo(pc, second)
    assert pages_cached(pc, 0, 64 * P, 32 * P) and not pages_cached(pc, 0, 96 * P, P)
    undo(pc, first)
    assert cached_count(pc) == 0 == pc.budget[1]
